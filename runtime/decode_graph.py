"""The GPU share of a one-sequence decode step (the GPU stage's blocks and the head) as a CUDA graph, replayed per
token (runtime/moe_decode_graph.py: the same for a stage with mixture-of-experts blocks)."""
from __future__ import annotations

import numpy as np


def align_up(nbytes: int, to: int = 256) -> int:
    return -(-nbytes // to) * to


def logits_out(logits, argmax: bool):
    """Device logits [S, V] float32 -> [S, V] on the host, or (argmax) the last row's greedy token as an int:
    CuPy's argmax returns the first of equal maxima, as NumPy's does, so the token is the host's choice."""
    import cupy as cp
    return int(cp.argmax(logits[-1])) if argmax else cp.asnumpy(logits)


class DecodeGraph:
    """The GPU share of a decode step (the GPU stage's blocks and the head) captured once as a CUDA graph and
    replayed per token: one launch instead of ~20 launches and two Relax VM calls per block from Python.

    The step's inputs go into static buffers first (hidden state, cos, sin here; the token count and the
    page address tables by KVCacheGPU.begin_step); the logits come out where the capture's head wrote them.
    A graph bakes in page addresses, so KVCacheGPU.graph_key() names what it depends on: a key seen for the
    first time runs eagerly once (which also warms TVM's and CuPy's allocators), the second capture and
    replay, and a step that cannot replay (a page on the host) runs eagerly (a sliding window's first split moving
    makes a new key: one eager step, then a capture again). CuPy captures
    the stream; TVM launches on it through tvm_ffi's environment stream; the capture's CuPy temporaries come
    from a pool of the graph's own, so no other work is ever given memory the graph writes.
    Eager and replayed steps run the same kernels on the same buffers: tokens do not depend on which ran."""

    def __init__(self, stage, head_fns, head_weights, spec, stream, to_tvm, to_cupy):
        import cupy as cp
        self.stage, self.head_fns, self.head_weights, self.stream = stage, head_fns, head_weights, stream
        self.to_cupy = to_cupy
        # x, cos and sin cross in one copy from pinned memory: offsets of 256 bytes keep each view aligned
        # a local RoPE (Gemma 3) makes each cos / sin row [global D | local D] (Stage.rope_halves splits it)
        H, D = spec.hidden_size, spec.rope_width
        x_at, cos_at, sin_at = 0, align_up(2 * H), align_up(2 * H) + align_up(4 * D)
        n = sin_at + align_up(4 * D)
        self._pinned = cp.cuda.alloc_pinned_memory(n)
        self.host_in = np.frombuffer(self._pinned, np.uint8, n)
        self.dev_in = cp.empty(n, cp.uint8)
        self.x = self.dev_in[x_at:x_at + 2 * H].view(cp.float16).reshape(1, H)
        self.cos = self.dev_in[cos_at:cos_at + 4 * D].view(cp.float32).reshape(1, D)
        self.sin = self.dev_in[sin_at:sin_at + 4 * D].view(cp.float32).reshape(1, D)
        self.host_x = self.host_in[x_at:x_at + 2 * H].view(np.float16).reshape(1, H)
        self.host_cos = self.host_in[cos_at:cos_at + 4 * D].view(np.float32).reshape(1, D)
        self.host_sin = self.host_in[sin_at:sin_at + 4 * D].view(np.float32).reshape(1, D)
        self.attn = cp.empty((1, spec.q_dim), cp.float16)
        self.views = [to_tvm(a) for a in (self.x, self.cos, self.sin, self.attn)]   # made once, outside captures
        self.kv_layers = range(stage.kv_base, stage.kv_base + len(stage.bindings))   # the cache layers it appends
        self.graph = self.pool = self.key = self.seen = self.logits = None
        self.disabled = ""                     # why graphs are off in this session ("" while they are on)
        self.replays = self.captures = self.eager_steps = 0

    def _body(self):
        x, cos, sin, attn = self.views
        x = self.stage.run_blocks(x, cos, sin, "decode", attn_out=(self.attn, attn))
        return self.head_fns["decode"](x, *self.head_weights)

    def step(self, x, cos: np.ndarray, sin: np.ndarray, begun: bool = False, argmax: bool = False):
        """x [1, H] on the host, or fp16 on the device (hybrid decode: the last streamed group's output), cos/sin
        [1, D] on the host ([1, 2D] with a local RoPE) -> logits [1, V] float32 on the host, or with argmax their greedy token (an int: the
        argmax runs where the logits are, and 8 bytes cross instead of V * 4). begun: the cache's step is already
        open (hybrid decode's streamed blocks appended to it first); the graph appends only its own layers."""
        kv = self.stage.kv
        # the last step's result came back to the host, so its copy out of host_in is done: host_in is free
        self.host_cos[...] = np.asarray(cos).reshape(self.host_cos.shape)
        self.host_sin[...] = np.asarray(sin).reshape(self.host_sin.shape)
        if isinstance(x, np.ndarray):
            self.host_x[...] = np.asarray(x).reshape(self.host_x.shape)
        self.dev_in.set(self.host_in, stream=self.stream)          # one copy, asynchronous from pinned memory
        if not isinstance(x, np.ndarray):
            self.x[...] = x.reshape(self.x.shape)                  # device to device, after that copy (one stream)
        if not begun:
            kv.begin_step(1)
        key = None if self.disabled else kv.graph_key()
        logits = self._run(key)
        kv.advance(1)
        return logits_out(logits, argmax)

    def _run(self, key):
        """The step's GPU work, replayed, captured then launched, or eager (see the class's note) -> device logits."""
        if key is not None and key == self.key:
            self.stage.kv.mark_replayed(self.kv_layers)
            self.graph.launch(self.stream)
            self.replays += 1
            return self.logits
        if key is not None and key == self.seen and self._capture(key):
            self.graph.launch(self.stream)
            return self.logits
        self.seen = key
        self.eager_steps += 1
        return self.to_cupy(self._body())

    def _capture(self, key) -> bool:
        """Capture this step's work (not run yet: the caller launches the graph). False, with graphs off for
        the session and the step's appends forgotten, if the stream cannot be captured."""
        from helmc.runtime.cuda_runtime import capture_graph
        self.graph = self.logits = None                 # the old graph goes before its memory pool
        try:
            graph, pool, logits = capture_graph(self.stream, self._body)
        except Exception as e:   # a capture that fails enqueued nothing: the step reruns eagerly
            import warnings
            self.disabled = f"{type(e).__name__}: {e}"
            warnings.warn(f"CUDA graph capture of the decode step failed, decoding without graphs: {self.disabled}")
            self.stage.kv.forget_appends(self.kv_layers)
            return False
        self.graph, self.pool, self.key, self._logits_tensor = graph, pool, key, logits
        self.logits = self.to_cupy(logits)
        self.captures += 1
        return True
