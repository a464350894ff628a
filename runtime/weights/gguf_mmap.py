"""Zero-copy, tensor-by-tensor access to a GGUF file through mmap, under Hugging Face names.

The runtime's counterpart of safetensors_mmap.Checkpoint for llama.cpp's format: the header is parsed
and checked once (helmc.model.gguf_spec: truncation, types, every shape against the ModelSpec), then
each tensor is a NumPy window on the page cache; the file is never copied as a whole.

GGUF stores a 2-D weight [rows, cols] (dims listed ne0 = cols first) row by row; a quantized row is
cols / block_weights blocks of block_bytes, contiguous along the input dimension. So `raw()` is always a
uint8 view [rows, row_bytes], whatever the type, and a row permutation moves whole rows.

llama files: llama.cpp's converter reorders the rows of attn_q / attn_k (and their biases) per head
(gguf_spec.qk_rows_to_hf). `raw()` shows the file's order; `hf_row_order()` gives the index array back
to HF's; `raw_hf()` and `view()` apply it. Cost: that is a gather, so those two return a copy of that one
tensor (q: q_dim x row_bytes, k: kv_dim x row_bytes; Llama-3-8B in F16 32 + 8 MiB per block, freed after
upload); every other tensor, and every tensor of a qwen2 / qwen3 file, comes back as a view.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from helmc.errors import HelmcError
from helmc.runtime.weights.page_release import release_pages
from helmc.model.gguf_spec import (GGUFTensor, check_gguf_tensors, gguf_name, permuted_heads, qk_rows_to_hf,
                                   read_gguf_header, spec_from_gguf_header)
from helmc.model.spec import ModelSpec

# NumPy element type of the float types; bf16 has none and is handed out as its raw uint16 bits.
_ELEMENT = {"f32": (np.float32, "float32"), "f16": (np.float16, "float16"), "bf16": (np.uint16, "bfloat16")}
_MUST_MATCH = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "vocab_size", "qkv_bias", "qk_norm", "tie_word_embeddings")


@dataclass(frozen=True)
class GGUFTensorInfo:
    type: str                  # a helmc.model.weight_types name
    shape: tuple[int, ...]     # logical shape in HF order (rows, cols)
    offset: int                # absolute byte offset of the data in the file
    nbytes: int
    hf_name: str
    gguf_name: str
    row_bytes: int             # bytes of one row (cols weights) in the file
    permuted_heads: int        # > 0: a llama q/k tensor whose rows the file holds permuted per head

    @property
    def dtype(self) -> str:
        """float32 | float16 | bfloat16 for float tensors (as safetensors_mmap.TensorInfo.dtype), else the type."""
        return _ELEMENT[self.type][1] if self.type in _ELEMENT else self.type


class GGUFCheckpoint:
    """A GGUF model file, mapped read-only. Invariant: every tensor the spec needs is present, of a
    supported type, of the spec's shape and inside the file (checked once in __init__)."""

    def __init__(self, path: str, spec: ModelSpec | None = None):
        self.path = path
        header = read_gguf_header(path)
        own = spec_from_gguf_header(header)
        # A bundle passes its own spec: the file must match what the stages were compiled for.
        diff = [f"{f} {getattr(spec, f)} expected, {getattr(own, f)} in the file" for f in _MUST_MATCH
                if spec is not None and getattr(spec, f) != getattr(own, f)]
        if diff:
            raise HelmcError(f"{path}: this GGUF is not the model the bundle was built for: {'; '.join(diff)}")
        self.spec = spec if spec is not None else own
        self._arch = header.architecture
        self._tensors: dict[str, GGUFTensor] = {hf: header.tensors[gguf_name(hf, self.spec.architecture)]
                                                for hf in check_gguf_tensors(header, self.spec)}
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def info(self, hf_name: str) -> GGUFTensorInfo:
        t = self._tensors.get(hf_name)
        if t is None:
            raise HelmcError(f"weights: tensor {hf_name!r} expected in {self.path}, not found")
        return GGUFTensorInfo(t.type, t.shape, t.offset, t.nbytes, hf_name, t.name, t.row_bytes,
                              permuted_heads(self._arch, self.spec, t.name))

    def raw(self, hf_name: str) -> np.ndarray:
        """uint8 [rows, row_bytes]: the tensor's bytes as stored (file row order), a view of the mapping.
        A 1-D tensor is one row."""
        i = self.info(hf_name)
        rows = i.shape[0] if len(i.shape) == 2 else 1
        flat = np.frombuffer(self._map, dtype=np.uint8, count=i.nbytes, offset=i.offset)
        return flat.reshape(rows, i.nbytes // rows)   # [nbytes] -> [rows, row_bytes]

    def hf_row_order(self, hf_name: str) -> np.ndarray | None:
        """int64 index array with HF row r = raw(hf_name)[idx[r]] (element r for a 1-D bias), or None
        where the file holds HF's order (everything but llama q/k)."""
        i = self.info(hf_name)
        return qk_rows_to_hf(i.permuted_heads, self.spec.head_dim) if i.permuted_heads else None

    def raw_hf(self, hf_name: str) -> np.ndarray:
        """raw() in HF row order: the view itself, or a gathered copy of this one tensor for llama q/k."""
        data, idx = self.raw(hf_name), self.hf_row_order(hf_name)
        if idx is None:
            return data
        i = self.info(hf_name)
        if len(i.shape) == 1:                       # a bias: permute its elements
            if i.type not in _ELEMENT:
                raise HelmcError(f"weights: {hf_name} is a 1-D {i.type} tensor; expected a float type for a bias")
            elements = data.reshape(i.shape[0], -1)    # [1, nbytes] -> [n, element bytes]
            return elements[idx].reshape(1, -1)        # [n, element bytes] -> [1, nbytes]
        return data[idx]

    def view(self, hf_name: str, expect_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A float tensor (F32 / F16 / BF16 as uint16 bits) of its HF shape, in HF row order: a view of
        the mapping except llama q/k (a copy, see the module note). Quantized tensors: use raw()."""
        i = self.info(hf_name)
        if expect_shape is not None and tuple(i.shape) != tuple(expect_shape):
            raise HelmcError(f"weights: {hf_name} shape expected {list(expect_shape)}, found {list(i.shape)} in {self.path}")
        if i.type not in _ELEMENT:
            raise HelmcError(f"weights: {hf_name} is {i.type} in {self.path}; view() reads F32, F16 and BF16, raw() every type")
        np_dtype = _ELEMENT[i.type][0]
        count = i.nbytes // np.dtype(np_dtype).itemsize
        arr = np.frombuffer(self._map, dtype=np_dtype, count=count, offset=i.offset).reshape(i.shape)  # flat -> HF shape
        idx = self.hf_row_order(hf_name)
        return arr if idx is None else arr[idx]

    def release(self, hf_name: str) -> int:
        """After the runtime copied `hf_name` into memory of its own: its mapped pages go (page_release.py)."""
        i = self.info(hf_name)
        return release_pages(self._map, i.offset, i.offset + i.nbytes)

    def close(self):
        try:
            self._map.close()
        except BufferError:
            pass          # views handed out are still alive: the mapping goes with the last of them
        self._file.close()


def dequantize_rows(rows: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """float32 [S, cols] of S quantized rows (uint8 [S, row_bytes]), by the gguf package's own dequantizer:
    the embedding gathers a few rows per step, so only those are ever dequantized."""
    import gguf
    out = gguf.quants.dequantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType[qtype.upper()])
    return np.ascontiguousarray(out.reshape(rows.shape[0], cols), dtype=np.float32)   # [S, row_bytes] -> [S, cols]
