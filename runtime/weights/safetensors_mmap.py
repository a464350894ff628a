"""Zero-copy, tensor-by-tensor access to safetensors checkpoints through mmap.

The `safetensors` library's NumPy path copies each tensor and cannot return bfloat16; the runtime
needs views into the mapped file (never a second full copy of the model in RAM) and bf16 as raw
uint16 bits, so the header is parsed here. The format is small: 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, then the data.
Every header is validated before any tensor is handed out: truncation, offsets outside the data,
overlapping tensors, and byte counts that disagree with dtype x shape.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.weights.page_release import release_pages

# bf16 has no NumPy dtype: its raw bits are exposed as uint16 and converted by the consumer.
_DTYPES = {"F32": (np.float32, "float32"), "F16": (np.float16, "float16"), "BF16": (np.uint16, "bfloat16"),
           "I64": (np.int64, "int64"), "I32": (np.int32, "int32"), "U8": (np.uint8, "uint8"),
           "I8": (np.int8, "int8"), "BOOL": (np.bool_, "bool")}
_MAX_HEADER = 100 << 20


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str            # float32 | float16 | bfloat16 | ...
    shape: tuple[int, ...]
    file: str
    begin: int            # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One mapped .safetensors file. Invariant: every TensorInfo lies inside the data section and
    no two overlap (checked once in __init__; the mapping is read-only afterwards)."""

    def __init__(self, path: str):
        self.path = path
        from helmc.jsonio import require_regular_file
        size = require_regular_file(path, "weights").st_size      # a FIFO or device would block or never end
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HelmcError(f"{path}: truncated safetensors header (file is {size} bytes, expected at least 8)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise HelmcError(f"{path}: truncated safetensors header (header says {n} bytes, file has {size - 8} after the length)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise HelmcError(f"{path}: safetensors header is not valid JSON ({e})") from None
            except RecursionError:
                raise HelmcError(f"{path}: safetensors header is not valid JSON (nested too deep to parse)") from None
        if not isinstance(header, dict):
            raise HelmcError(f"{path}: safetensors header expected a JSON object")
        data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            # Every type checked, not only the values: the header is whatever the file says.
            meta = meta if isinstance(meta, dict) else {}
            dt, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
            if not (isinstance(shape, list) and all(_count(d) for d in shape) and isinstance(offsets, list)
                    and len(offsets) == 2 and all(_count(o) for o in offsets)):
                raise HelmcError(f"{path}: tensor {name!r} header entry expected dtype, shape (a list of non-negative "
                                 f"integers) and data_offsets [begin, end], found {str(meta)[:120]}")
            shape, (b, e) = tuple(shape), offsets
            if not isinstance(dt, str) or dt not in _DTYPES:
                raise HelmcError(f"{path}: tensor {name!r} dtype expected one of {sorted(_DTYPES)}, found {dt!r:.40}")
            itemsize = np.dtype(_DTYPES[dt][0]).itemsize
            count = math.prod(shape)                  # Python integers: no int64 wrap-around to a matching size
            if not (0 <= b <= e) or e - b != count * itemsize:
                raise HelmcError(f"{path}: tensor {name!r} data_offsets {[b, e]} hold {e - b} bytes, "
                                 f"expected {count * itemsize} for {dt} {list(shape)}")
            if data_start + e > size:
                raise HelmcError(f"{path}: tensor {name!r} ends at byte {data_start + e}, past the end of the file ({size}); truncated?")
            spans.append((b, e, name))
            self.tensors[name] = TensorInfo(name, _DTYPES[dt][1], shape, path, data_start + b, data_start + e)
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise HelmcError(f"{path}: tensors {n0!r} [{b0},{e0}) and {n1!r} [{b1},{e1}) overlap")
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def view(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        np_dtype = {v[1]: v[0] for v in _DTYPES.values()}[t.dtype]
        count = (t.end - t.begin) // np.dtype(np_dtype).itemsize
        return np.frombuffer(self._map, dtype=np_dtype, count=count, offset=t.begin).reshape(t.shape)  # flat -> shape

    def release(self, name: str) -> int:
        """The tensor's pages unmapped from this process (page_release.py); a later view() reads them again."""
        t = self.tensors[name]
        return release_pages(self._map, t.begin, t.end)

    def close(self):
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:
            pass          # views handed out are still alive: the mapping goes with the last of them
        self._file.close()


class Checkpoint:
    """A model directory's weights: model.safetensors, or shards listed in model.safetensors.index.json."""

    def __init__(self, model_dir: str, fused_rows: dict | None = None, fused_experts: tuple | None = None):
        """`fused_rows` ({fused name suffix: ((part suffix, rows), ...)}, ModelSpec.fused_rows): each tensor named
        model.layers.N.<fused> is replaced by its parts, each a range of its rows (zero-copy views of the mapping).
        `fused_experts` (experts, hidden, inter): gpt-oss's fused expert tensors read as each expert's gate, up and
        down weights and biases (fused_experts.py: strided views of the mapping)."""
        self.model_dir = model_dir
        self._parts: dict[str, tuple] = {}        # a fused expert tensor's part -> (fused name, expert, shape, view)
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.exists(index):
            from helmc.jsonio import load_json_file
            doc = load_json_file(index, "weights index")
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise HelmcError(f"{index}: expected a JSON object with a 'weight_map' of tensor name -> shard file, "
                                 f"found {str(doc)[:80]}")
            shards = sorted(set(weight_map.values()))
            for shard in shards:         # a shard is a file of this directory, never a path out of it
                if not shard or shard != os.path.basename(shard) or shard in (".", ".."):
                    raise HelmcError(f"{index}: shard expected a file name in {model_dir}, found {shard!r}")
        elif os.path.exists(single):
            shards = ["model.safetensors"]
        else:
            raise HelmcError(f"weights: expected model.safetensors or model.safetensors.index.json in {model_dir}, found neither")
        self.files = []
        self.where: dict[str, SafetensorsFile] = {}
        self._fused_where: dict[str, SafetensorsFile] = {}
        try:
            for shard in shards:
                p = os.path.join(model_dir, shard)
                if not os.path.isfile(p):
                    raise HelmcError(f"weights: shard {shard} listed in the index is missing from {model_dir}")
                sf = SafetensorsFile(p)
                self.files.append(sf)
                for name in sf.tensors:
                    self.where[name] = sf
            for name in [n for n in self.where if fused_rows and n.startswith("model.layers.")]:
                stem, _, suffix = name[len("model.layers."):].partition(".")
                if suffix in fused_rows:
                    self._split_rows(name, f"model.layers.{stem}.", fused_rows[suffix])
            if fused_experts:
                from helmc.runtime.weights.fused_experts import split_fused_experts
                self._parts = split_fused_experts(list(self.where), self.info, *fused_experts)
                for part, (fused, *_rest) in self._parts.items():
                    if part in self.where:
                        raise HelmcError(f"weights: {part} found both on its own and inside {fused}")
                for fused in {p[0] for p in self._parts.values()}:
                    self._fused_where[fused] = self.where.pop(fused)
                self.where.update({part: self._fused_where[p[0]] for part, p in self._parts.items()})
        except BaseException:
            self.close()              # the shards mapped before the bad one
            raise

    @classmethod
    def for_spec(cls, model_dir: str, spec) -> "Checkpoint":
        """The checkpoint of a ModelSpec's model directory, its fused tensors read as the spec's block names."""
        moe = spec.moe
        return cls(model_dir, spec.fused_rows(), (moe.num_experts, spec.hidden_size, moe.expert_intermediate_size)
                   if moe is not None and moe.fused_experts else None)

    def _split_rows(self, name: str, prefix: str, parts: tuple) -> None:
        sf = self.where.pop(name)
        t = sf.tensors.pop(name)
        rows = sum(r for _, r in parts)
        if len(t.shape) != 2 or t.shape[0] != rows:
            raise HelmcError(f"weights: {name} shape expected [{rows}, cols] ({' + '.join(f'{p} {r}' for p, r in parts)} "
                             f"rows, from config.json), found {list(t.shape)}")
        row_bytes = (t.end - t.begin) // rows
        begin = t.begin
        for part, r in parts:
            full = prefix + part
            if full in self.where:
                raise HelmcError(f"weights: {full} found both on its own and inside {name}")
            sf.tensors[full] = TensorInfo(full, t.dtype, (r, t.shape[1]), t.file, begin, begin + r * row_bytes)
            self.where[full] = sf
            begin += r * row_bytes

    def info(self, name: str) -> TensorInfo:
        if name not in self.where:
            raise HelmcError(f"weights: tensor {name!r} expected in {self.model_dir}, not found")
        if name in self._parts:               # a fused expert tensor's part: its own shape over the fused bytes
            fused, _, shape, _ = self._parts[name]
            t = self.where[name].tensors[fused]
            return TensorInfo(name, t.dtype, shape, t.file, t.begin, t.end)
        return self.where[name].tensors[name]

    def view(self, name: str, expect_shape: tuple[int, ...] | None = None) -> np.ndarray:
        info = self.info(name)
        if expect_shape is not None and tuple(info.shape) != tuple(expect_shape):
            raise HelmcError(f"weights: {name} shape expected {list(expect_shape)} from config.json, found {list(info.shape)}")
        if name in self._parts:
            fused, expert, _, part = self._parts[name]
            return part(self.where[name].view(fused)[expert])
        return self.where[name].view(name)

    def release(self, name: str) -> int:
        """After the runtime copied `name` into memory of its own: its mapped pages go (page_release.py); a fused
        expert tensor's part releases the whole fused tensor (its block's experts are bound together)."""
        self.info(name)
        return self.where[name].release(self._parts[name][0] if name in self._parts else name)

    def close(self):
        for f in self.files:
            f.close()
