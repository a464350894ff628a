"""Named arrays that cross between the GPU and the host, laid out once in one device buffer and its pinned host twin.

A mixture-of-experts decode block sends m and the router's logits down and the routed slots, their weights and the
CPU's sum up, every block of every step (moe_decode_row for one row, moe_decode_batch for a batched step). Each field
starts at an align_up offset in both buffers, so a run of consecutive fields crosses in one asynchronous copy from or
into page-locked memory, and the arrays never move: a captured CUDA graph may hold their addresses.
Invariant: a field's host view is written (or read) only once the stream has completed the copies queued before.
"""
from __future__ import annotations

import numpy as np

from helmc.runtime.decode_graph import align_up


class CrossingBuffers:
    def __init__(self, fields: tuple[tuple[str, str, tuple[int, ...]], ...]):
        """fields: (name, NumPy dtype name, shape) in layout order."""
        import cupy as cp
        self._span: dict[str, tuple[int, int]] = {}
        at = 0
        for name, dtype, shape in fields:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            at = align_up(at)
            self._span[name] = (at, at + nbytes)
            at += nbytes
        self.nbytes = at
        self._dev = cp.zeros(at, cp.uint8)
        self._pinned = cp.cuda.alloc_pinned_memory(at)
        pinned = np.frombuffer(self._pinned, np.uint8, at)
        self.device, self.host = {}, {}
        for name, dtype, shape in fields:
            a, b = self._span[name]
            self.device[name] = self._dev[a:b].view(dtype).reshape(shape)
            self.host[name] = pinned[a:b].view(dtype).reshape(shape)

    def to_host(self, first: str, last: str | None = None) -> None:
        """Queue the fields first..last (in layout order) device to host on the current stream."""
        self._copy(first, last, down=True)

    def to_device(self, first: str, last: str | None = None) -> None:
        """Queue the fields first..last host to device on the current stream."""
        self._copy(first, last, down=False)

    def _copy(self, first: str, last: str | None, down: bool) -> None:
        import cupy as cp
        a, b = self._span[first][0], self._span[last or first][1]
        assert a < b, (first, last)
        dev, host = self._dev.data.ptr + a, self._pinned.ptr + a
        rt = cp.cuda.runtime
        rt.memcpyAsync(host if down else dev, dev if down else host, b - a,
                       rt.memcpyDeviceToHost if down else rt.memcpyHostToDevice, cp.cuda.get_current_stream().ptr)
