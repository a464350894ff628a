"""Session: a verified bundle, its weights bound to devices, and the token loop.

    s = Session.load("bundle/")                 # verify -> load libraries -> stream weights
    r = s.generate(prompt_ids=[...], max_new_tokens=32)

Per step: embedding rows gathered from the mmapped checkpoint, the CPU stage, one copy of the
hidden state to the GPU, the GPU stage, the head, sampling (thesis 4.2.1). Which device runs what
comes from plan.json; nothing in the loop decides placement.
Imports only NumPy, the TVM runtime and (for a GPU stage) CuPy: this runs with TVM_USE_RUNTIME_LIB=1.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from helmc.errors import HelmcError
from helmc.model.spec import ModelSpec
from helmc.runtime.bundle.plan import Plan
from helmc.runtime.bundle.plan_check import check_plan, machine_memory
from helmc.runtime.bundle.weights_digest import check_pinned_weights
from helmc.runtime.kv.options import KVOptions
from helmc.runtime.bundle.manifest import BundleManifest, verify_bundle
from helmc.runtime.detokenize import Detokenizer
from helmc.runtime.rope import rope_tables
from helmc.runtime.weights.bind import Embedding, check_checkpoint, open_checkpoint
from helmc.runtime.weights.safetensors_mmap import Checkpoint
from helmc.runtime.sampling import Sampler, SamplingParams

from helmc.runtime.cpu_stage import CPU_STAGE_LIB, build_cpu_stage, load_stage_library, progress


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str = ""
    ttft_ms: float = 0.0
    decode_tok_s: float = 0.0
    per_token_ms: list[float] = field(default_factory=list)
    stop_reason: str = ""
    max_context: int = 0             # tokens this session's KV caches and memory hold (capacity check)
    kv_limited_by: str = ""          # what bounds max_context
    experts: dict | None = None      # a GPU stage's MoE blocks: this request's expert_cache_hit_rate (the share of its
                                     # decode's selected experts served from VRAM), the plan's predicted_hit_rate,
                                     # expert_cache (on or off) and expert_cache_promotions (over the session)

    def to_json_dict(self) -> dict:
        out = {"prompt_ids": self.prompt_ids, "tokens": self.tokens, "text": self.text,
               "ttft_ms": round(self.ttft_ms, 3), "decode_tok_s": round(self.decode_tok_s, 3),
               "stop_reason": self.stop_reason, "max_context": self.max_context, "kv_limited_by": self.kv_limited_by}
        return out | (self.experts or {})


class Session:
    def __init__(self, bundle_dir: str, manifest: BundleManifest, spec: ModelSpec, plan: Plan,
                 checkpoint: Checkpoint, cpu_stage, head, tokenizer, gpu=None):
        self.bundle_dir = bundle_dir
        self.manifest = manifest
        self.spec = spec
        self.plan = plan
        self.checkpoint = checkpoint
        self.cpu_stage = cpu_stage
        self.head = head
        self.tokenizer = tokenizer
        self.gpu = gpu
        self.rope = rope_tables(spec)
        gpu_only = cpu_stage is None and gpu is not None and all(
            part is None for part in (gpu.cpu_stage_step, gpu.hybrid, gpu.streamed_prefill))
        self._embed = Embedding(checkpoint, spec, native=gpu_only)     # rows that only ever go to the GPU stay fp16
        self.position = 0
        self.kv_capacity = None          # KVCapacity of the last request (generate)
        self._kv_tokens_touched = 0      # KV positions earlier requests wrote: memory the caches already hold

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, bundle_dir: str, weights_dir: str | None = None, quiet: bool = True, plan: Plan | None = None,
             trusted_keys: tuple | None = None, require_signed: bool = False, **kv_options) -> "Session":
        """plan: run the bundle with this plan instead of its own (benchmarks: a hybrid bundle as a plain split;
        the libraries hold every block function, so any split of the same model and batch runs).
        trusted_keys (signature.PublicKey, e.g. from signature.trusted_keys()) and require_signed: see
        signature.verify_manifest_signature; the signature is checked before any other file is read.
        On failure nothing stays held: the checkpoint is closed and the error carries no traceback into the
        frames that held half-bound weights or KV memory, so a server that keeps the error keeps no memory."""
        kv = KVOptions.from_keywords(kv_options)
        manifest, spec, own, wdir = read_bundle(bundle_dir, weights_dir, trusted_keys, require_signed)
        made_for_bundle = (own.placement.num_layers, own.workload.batch)
        if plan is not None and (plan.placement.num_layers, plan.workload.batch) != made_for_bundle:
            raise HelmcError(f"plan override: expected {own.placement.num_layers} layers and batch "
                             f"{own.workload.batch} (the bundle's), found {plan.placement.num_layers} and "
                             f"{plan.workload.batch}")
        made_for = plan.provenance.architecture_hash if plan is not None else ""
        if made_for and made_for != spec.architecture_hash():
            raise HelmcError(f"plan override: expected a plan made for this bundle's model (architecture "
                             f"{spec.architecture_hash()}), found one for {plan.provenance.architecture_hash}")
        if plan is not None:   # made on this machine, unauthenticated: checked against the model and the machine
            check_plan(plan, spec, own, "plan override", machine_memory(plan.placement.uses_gpu))
        plan = plan or own
        checkpoint = open_checkpoint(wdir, spec)
        try:
            return cls._load_parts(bundle_dir, manifest, spec, plan, checkpoint, quiet, kv)
        except HelmcError as e:
            checkpoint.close()
            raise e.with_traceback(None) from None
        except BaseException:
            checkpoint.close()
            raise

    @classmethod
    def _load_parts(cls, bundle_dir, manifest, spec, plan, checkpoint, quiet, kv: KVOptions) -> "Session":
        check_checkpoint(checkpoint, spec)
        tokenizer = _load_tokenizer(bundle_dir)
        if plan.placement.uses_gpu:
            from helmc.runtime.gpu_session import load_gpu_parts  # CuPy only where the plan has a GPU stage
            return load_gpu_parts(cls, bundle_dir, manifest, spec, plan, checkpoint, tokenizer, quiet, kv)
        vm = load_stage_library(bundle_dir, manifest, CPU_STAGE_LIB)
        cpu_stage, head = build_cpu_stage(vm, spec, plan, checkpoint, quiet, kv=kv)
        return cls(bundle_dir, manifest, spec, plan, checkpoint, cpu_stage, head, tokenizer)

    # ---------------------------------------------------------------- model steps
    def gpu_moe(self):
        """The GPU stage's mixture-of-experts feed-forward (moe_gpu.GpuMoeFeedForward: its served() counts), or None."""
        return getattr(getattr(self.gpu, "stage", None), "_moe", None)

    def reset(self):
        self.position = 0
        if self.cpu_stage is not None:
            self.cpu_stage.kv.reset()
        if self.gpu is not None:
            self.gpu.reset()

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self._embed(ids)                                   # [S, H] float32 (fp16 when only the GPU reads it)

    def forward(self, ids: list[int], all_logits: bool = False, argmax: bool = False):
        """Run len(ids) new tokens at the current position; returns logits [S or 1, V] float32, or with argmax
        (greedy decoding) the last row's argmax as an int, found where the logits are (on the GPU: 8 bytes back
        instead of V * 4)."""
        S = len(ids)
        if self.position + S > self.plan.memory.max_context:
            raise HelmcError(f"context: {self.position + S} tokens needed, the plan allows "
                             f"{self.plan.memory.max_context}")
        phase = "decode" if S == 1 else "prefill"
        positions = np.arange(self.position, self.position + S)
        cos, sin = self.rope.cos_sin(positions)                   # [S, D] each
        x = self.embed(np.asarray(ids, dtype=np.int64))
        if self.gpu is not None:
            logits = self.gpu.forward(self, x, cos, sin, phase, all_logits, argmax=argmax and not all_logits)
            self.position += S
            return logits
        else:
            import tvm.runtime
            dev = tvm.cpu()
            xt = self.cpu_stage.forward(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(cos, dev),
                                        tvm.runtime.tensor(sin, dev), phase)
            logits = self.head(xt, phase, all_logits)
        self.position += S
        return int(np.argmax(logits[-1])) if argmax and not all_logits else logits

    # ---------------------------------------------------------------- generation
    def generate(self, prompt: str | None = None, prompt_ids: list[int] | None = None, max_new_tokens: int = 32,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 on_text: Callable[[str], None] | None = None, stop_at_eos: bool = True) -> GenerationResult:
        if prompt_ids is None:
            if prompt is None:
                raise HelmcError("generate: expected a prompt or prompt ids, found neither")
            if self.tokenizer is None:
                raise HelmcError("generate: a text prompt needs tokenizer.json in the bundle; pass --prompt-ids instead")
            prompt_ids = self.tokenizer.encode(prompt).ids
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise HelmcError("generate: the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise HelmcError(f"generate: token ids expected in [0, {self.spec.vocab_size}), found {bad[:5]}")
        if max_new_tokens < 1:
            raise HelmcError(f"--max-new-tokens expected >= 1, found {max_new_tokens}")
        from helmc.runtime.kv.capacity import check_request
        self.kv_capacity = request_kv_capacity(self, len(prompt_ids))          # before any work
        check_request(self.kv_capacity, len(prompt_ids), max_new_tokens)
        sampler = Sampler(SamplingParams(temperature, top_k, top_p, seed))
        self.reset()
        eos = set(self.spec.eos_token_ids) if stop_at_eos else set()
        moe = self.gpu_moe()
        served = moe.served(decode=True) if moe is not None else None
        t0 = time.perf_counter()
        try:
            tok = self._next_token(prompt_ids, sampler)
            t_first = time.perf_counter()
            out, stamps, stop = [tok], [t_first], "length"
            detok = Detokenizer(self.tokenizer) if on_text is not None and self.tokenizer is not None else None
            _emit(on_text, detok, tok)
            if tok in eos:
                stop = "eos"
            while stop != "eos" and len(out) < max_new_tokens:
                tok = self._next_token([tok], sampler)
                out.append(tok)
                stamps.append(time.perf_counter())
                _emit(on_text, detok, tok)
                if tok in eos:
                    stop = "eos"
            if detok is not None and (rest := detok.flush()):
                on_text(rest)
        finally:   # the CPU cache's arena keeps the pages this request touched: the next one reuses them
            self._kv_tokens_touched = max(self._kv_tokens_touched, self.position)
        per_token = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
        decode_s = stamps[-1] - t_first
        text = self.tokenizer.decode(out) if self.tokenizer is not None else ""
        return GenerationResult(prompt_ids, out, text, 1000 * (t_first - t0),
                                (len(out) - 1) / decode_s if decode_s > 0 else 0.0, per_token, stop,
                                self.kv_capacity.tokens_fit, self.kv_capacity.limited_by,
                                _expert_stats(moe, served, self.plan) if moe is not None else None)

    def _next_token(self, ids: list[int], sampler: Sampler) -> int:
        if sampler.plain_greedy:                                   # the argmax where the logits are
            return sampler.take(self.forward(ids, argmax=True))
        return sampler(self.forward(ids)[-1])



def _expert_stats(moe, before: tuple[int, int], plan: Plan) -> dict:
    """A request's expert counts (GenerationResult.experts) from the MoE feed-forward's decode totals before it: the
    share of its decode tokens' selected experts served from VRAM (per token, as the plan predicts it)."""
    rows, hits = (a - b for a, b in zip(moe.served(decode=True), before))
    return {"expert_cache_hit_rate": round(hits / rows, 4) if rows else 0.0,
            "predicted_hit_rate": plan.predictions.expert_hit_rate, "expert_cache": plan.placement.expert_cache,
            "expert_cache_promotions": moe.cache_promotions()}


def _emit(on_text, detok, tok: int) -> None:
    if detok is not None and (delta := detok.add(tok)):
        on_text(delta)


# -------------------------------------------------------------------- helpers
def read_bundle(bundle_dir: str, weights_dir: str | None = None, trusted_keys: tuple | None = None,
                require_signed: bool = False, cpu_flags: frozenset[str] | None = None
                ) -> tuple[BundleManifest, ModelSpec, Plan, str]:
    """Manifest (signature and hashes verified before any library in the bundle loads), spec, plan and the
    weights directory. cpu_flags: the CPU features to check the bundle's against (default this CPU's; a plan made
    here for another machine checks that machine's)."""
    manifest = verify_bundle(bundle_dir, cpu_flags, trusted_keys=trusted_keys, require_signed=require_signed)
    spec = ModelSpec.from_json(_read_text(bundle_dir, "model_spec.json"))
    plan = Plan.from_json(_read_text(bundle_dir, "plan.json"))
    check_plan(plan, spec, plan, "bundle: plan.json")
    if weights_dir:                       # given by the user: relative to the current directory, as any path argument
        wdir = os.path.abspath(weights_dir)
    else:                                 # the manifest's: relative to the bundle
        wdir = manifest.weights_dir if os.path.isabs(manifest.weights_dir) else \
            os.path.join(bundle_dir, manifest.weights_dir)
    if require_signed and manifest.weights:     # the signature covers the weights' digests: check them before binding
        check_pinned_weights(wdir, manifest.weights)
    return manifest, spec, plan, wdir


def _read_text(bundle_dir: str, name: str) -> str:
    try:
        with open(os.path.join(bundle_dir, name), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise HelmcError(f"bundle: expected {name} (UTF-8 JSON) in {bundle_dir}, could not read it "
                         f"({getattr(e, 'strerror', None) or e})") from None


def request_kv_capacity(session: Session, prompt_tokens: int):
    """KVCapacity of the session's caches for a request of `prompt_tokens` prompt tokens: host RAM for
    KV is MemAvailable plus what the caches already hold, less what a step holds besides KV; VRAM is
    the GPU cache's page pool; the plan's context limit is what the caches were sized for."""
    from helmc.runtime.kv import capacity as kc
    cpu_kv = session.cpu_stage.kv if session.cpu_stage is not None else None
    gpu_stage = getattr(session.gpu, "stage", None)
    gpu_kv = gpu_stage.kv if gpu_stage is not None else None
    available = kc.host_ram_available_bytes()
    if available is None:                     # no /proc/meminfo: host RAM is not what refuses a request
        host_free = 1 << 62
    else:
        spec = session.spec
        cpu_rows = cpu_kv is not None and not getattr(session.plan, "prefill_on_gpu", False)
        step = kc.host_step_bytes(spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim,
                                  prompt_tokens, cpu_rows)
        held = kc.caches_host_bytes_held(cpu_kv, gpu_kv, getattr(session, "_kv_tokens_touched", 0))
        host_free = available + held - step
    return kc.capacity_of_caches(cpu_kv, gpu_kv, host_free, session.spec.max_position_embeddings)


def _load_tokenizer(bundle_dir: str):
    path = os.path.join(bundle_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(path)
