"""A GGUF file's header: its keys (short ones), its tensor table (names, types, dims, offsets), checked for
truncation, overlap and corrupt lengths before anything reads the data; stacked experts and phi3's fused projections
become one plain tensor entry each.

Parsing goes through the `gguf` package (llama.cpp's own reader, NumPy only, an optional dependency:
`pip install 'helmc[gguf]'`); its failures on garbage or truncated files become HelmcErrors.
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from helmc.errors import HelmcError
from helmc.model.arch import Architecture, gguf_architecture
from helmc.model.gguf_names import GGUF_ROUTER, GGUF_STACKED
from helmc.model.weight_types import WEIGHT_TYPES

# The tensor types helmc reads (the weight-type registry's).
SUPPORTED_TYPES = tuple(WEIGHT_TYPES)


@dataclass(frozen=True)
class GGUFTensor:
    name: str                 # llama.cpp name
    type: str                 # lower-case GGML type name (also ones helmc does not read, such as q2_k)
    dims: tuple[int, ...]     # ne0 first, as the file lists them
    offset: int               # absolute byte offset of the data in the file
    nbytes: int
    block_weights: int        # weights per quantization block (1 for float types)
    block_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:      # logical shape in HF / NumPy order (rows, cols)
        return tuple(reversed(self.dims))

    @property
    def row_bytes(self) -> int:              # one row of ne0 weights: GGUF blocks run along the input dimension
        return self.dims[0] // self.block_weights * self.block_bytes if self.dims else self.nbytes


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    architecture: str                  # general.architecture as written (qwen3, llama, ...)
    metadata: dict                     # key -> value; arrays longer than 64 entries are left out
    tensors: dict                      # llama.cpp name -> GGUFTensor, in file order
    n_tokens: int                      # length of tokenizer.ggml.tokens (0: no token list)
    rope_freqs: tuple[float, ...] = () # rope_freqs.weight values (llama3 RoPE), when present


def _gguf():
    try:
        import gguf
        return gguf
    except ImportError:
        raise HelmcError("reading GGUF files needs the gguf package (pip install 'helmc[gguf]'), not installed") from None


MAX_ARRAY_ITEMS = 1 << 22


class _Corrupt(Exception):
    """A structural problem found inside the reader; reported as a HelmcError with the path."""


@lru_cache(maxsize=1)
def _reader_class():
    gguf = _gguf()

    class CheckedReader(gguf.GGUFReader):
        # gguf's _get slices the mapping and returns a short (even empty) array past its end without a word, so
        # an array length of 2^63 in the header becomes a loop appending empty parts until memory runs out:
        # every read must lie inside the file, which bounds the reader's work by the file's size.
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if int(count) < 0 or end > len(self.data):
                raise _Corrupt(f"GGUF header truncated or corrupt: a field at byte {int(offset)} needs {int(count)} "
                               f"x {np.dtype(dtype).itemsize} bytes, past the end of the file ({len(self.data)} bytes)")
            return super()._get(offset, dtype, count, override_order)

        # gguf reads an array item by item, a NumPy object each (~100 bytes): an array length taken from the file
        # must fit in the bytes left, and all arrays together stay under MAX_ARRAY_ITEMS, so a crafted file of a
        # few GB cannot make the reader hold hundreds of GB of items.
        def __init__(self, path, mode="r"):
            self._array_items = 0
            super().__init__(path, mode)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == gguf.GGUFValueType.ARRAY:
                item_type, n = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
                least = {gguf.GGUFValueType.STRING: 8, gguf.GGUFValueType.ARRAY: 12}.get(
                    item_type, np.dtype(self.gguf_scalar_to_np.get(item_type, np.uint8)).itemsize)
                if n * least > len(self.data) - orig_offs - 12:
                    raise _Corrupt(f"GGUF header truncated or corrupt: an array at byte {orig_offs} claims {n} items, "
                                   f"more than the {len(self.data) - orig_offs - 12} bytes left in the file hold")
                self._array_items += n
                if self._array_items > MAX_ARRAY_ITEMS:
                    raise _Corrupt(f"GGUF header: expected at most {MAX_ARRAY_ITEMS} array items in all (a 262k-token "
                                   f"vocabulary with its scores and merges has ~1.3M), found more")
            return super()._get_field_parts(orig_offs, raw_type)

        # gguf's reader slices every tensor out of the mapping and fails with a bare reshape error when
        # the data runs past the end of the file; check each tensor's extent first to say which one.
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                # tensor-info parts: name length, name, n_dims, dims, type, offset (stable since GGUF v2)
                name, raw = bytes(field.parts[1]).decode("utf-8", "replace"), int(field.parts[4][0])
                dims = [int(d) for d in field.parts[3]]
                try:
                    qt = gguf.GGMLQuantizationType(raw)
                except ValueError:
                    raise _Corrupt(f"tensor {name!r} has GGML type id {raw}, unknown to the installed gguf package; "
                                   f"helmc reads {', '.join(t.upper() for t in SUPPORTED_TYPES)}") from None
                block, type_bytes = gguf.GGML_QUANT_SIZES[qt]
                if dims and dims[0] % block:
                    raise _Corrupt(f"tensor {name!r} ({qt.name}, dims {dims}): rows of {dims[0]} weights are not a "
                                   f"multiple of the {qt.name} block of {block}")
                end = start_offs + int(field.parts[5][0]) + math.prod(dims) // block * type_bytes
                if end > size:
                    raise _Corrupt(f"tensor {name!r} ({qt.name}, dims {dims}) ends at byte {end}, past the end of the "
                                   f"file ({size} bytes): the file is truncated")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def open_gguf_reader(path: str):
    """A gguf.GGUFReader on `path`, every failure a HelmcError naming what was expected and found."""
    if not os.path.isfile(path):
        raise HelmcError(f"GGUF: expected a .gguf file at {path}, found nothing")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise HelmcError(f"{path}: not a GGUF file: expected the magic b'GGUF' at byte 0, found {head!r}")
    try:
        return _reader_class()(path, "r")
    except _Corrupt as e:
        raise HelmcError(f"{path}: {e}") from None
    except IndexError:              # gguf's reader indexes past the mapping's end: the header is cut short
        raise HelmcError(f"{path}: GGUF header truncated or corrupt: it runs past the end of the file "
                         f"({os.path.getsize(path)} bytes)") from None
    except RecursionError:          # arrays of arrays nested thousands deep
        raise HelmcError(f"{path}: GGUF header corrupt: arrays nested too deep to read") from None
    except (ValueError, KeyError, OverflowError, TypeError, UnicodeDecodeError) as e:
        raise HelmcError(f"{path}: GGUF header unreadable, truncated or corrupt "
                         f"(file is {os.path.getsize(path)} bytes; gguf said {type(e).__name__}: {e})") from None


def field_value(field):
    try:
        return field.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise HelmcError(f"GGUF key {field.name!r}: value unreadable ({e})") from None


def read_gguf_header(path: str) -> GGUFHeader:
    """Keys (short ones) and tensor table of a GGUF file, checked for truncation; the tensor data is not read.
    Read once per process and file version: a build asks for the spec and the types, and gguf's reader takes
    seconds over a 150k-token vocabulary."""
    st = os.stat(path) if os.path.isfile(path) else None
    return _read_gguf_header(path, st.st_size if st else -1, st.st_mtime_ns if st else -1)


@functools.lru_cache(maxsize=8)
def _read_gguf_header(path: str, _size: int, _mtime_ns: int) -> GGUFHeader:
    gguf = _gguf()
    reader = open_gguf_reader(path)
    metadata, n_tokens = {}, 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key == "tokenizer.ggml.tokens":
            n_tokens = len(field.data)
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > 64:
            continue          # token lists and merges: read_gguf_tokenizer reads them when it needs them
        try:
            metadata[key] = field_value(field)
        except HelmcError as e:
            raise HelmcError(f"{path}: {e}") from None
    split = metadata.get("split.count", 1)
    if isinstance(split, bool) or not isinstance(split, int):
        raise HelmcError(f"{path}: split.count expected an integer, found {split!r:.40}")
    if split > 1:
        raise HelmcError(f"{path}: expected one GGUF file, found part of a split of {metadata['split.count']}: "
                         "merge it first (llama.cpp's gguf-split --merge)")
    if not isinstance(arch := metadata.get("general.architecture"), str):
        raise HelmcError(f"{path}: required key 'general.architecture' missing")
    tensors, rope_freqs = {}, ()
    for t in reader.tensors:
        name = t.tensor_type.name.lower()
        block, type_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        tensors[t.name] = GGUFTensor(t.name, name, tuple(int(d) for d in t.shape), int(t.data_offset),
                                     int(t.n_bytes), block, type_bytes)
        if t.name == "rope_freqs.weight":
            if name != "f32":
                raise HelmcError(f"{path}: tensor 'rope_freqs.weight' expected F32, found {t.tensor_type.name}")
            rope_freqs = tuple(float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1))
    entry = file_architecture(arch, metadata, tensors)
    if getattr(entry, "moe", False):
        tensors = expert_slices(path, tensors)
    if getattr(entry, "fused_projections", False):
        tensors = fused_slices(path, arch, metadata, tensors)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:                    # llama.cpp lays tensors out one after another; two views of one span are corrupt
            raise HelmcError(f"{path}: tensors {n0!r} [{b0}, {e0}) and {n1!r} [{b1}, {e1}) overlap in the file")
    return GGUFHeader(path, arch, metadata, tensors, n_tokens, rope_freqs)


def file_architecture(arch: str, metadata: dict, tensors) -> Architecture | None:
    """The registry entry a GGUF file of general.architecture `arch` reads as (None: one helmc lacks): llama.cpp
    writes Mixtral as llama with experts, so a file with experts ({arch}.expert_count > 0 or a router tensor) reads
    as the entry that claims `arch` with experts, where one does."""
    count = metadata.get(f"{arch}.expert_count")
    experts = (isinstance(count, int) and not isinstance(count, bool) and count > 0) or any(
        n.endswith("." + GGUF_ROUTER) for n in tensors)
    return gguf_architecture(arch, experts)


_GGUF_FUSED = re.compile(r"blk\.(\d+)\.(attn_qkv|ffn_up)\.weight")


def fused_slices(path: str, arch: str, metadata: dict, tensors: dict) -> dict:
    """`tensors` with a phi3 file's fused blk.N.attn_qkv.weight (q, k, v rows) and blk.N.ffn_up.weight (gate, up
    rows) replaced by blk.N.attn_q / attn_k / attn_v and ffn_gate / ffn_up: row ranges of the stored tensor, each at
    its own offset, bound zero-copy like any other. A file that stores them apart is left as it is."""
    heads, kv = metadata.get(f"{arch}.attention.head_count"), metadata.get(f"{arch}.attention.head_count_kv")
    kv = heads if kv is None else kv
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, kv)):
        raise HelmcError(f"{path}: {arch}.attention.head_count and head_count_kv expected positive integers, found "
                         f"{heads!r:.40} and {kv!r:.40}")
    out = {}
    for name, t in tensors.items():
        m = _GGUF_FUSED.fullmatch(name)
        if not m or (m.group(2) == "ffn_up" and f"blk.{m.group(1)}.ffn_gate.weight" in tensors):
            out.setdefault(name, t)
            continue
        rows = t.dims[1] if len(t.dims) == 2 else 0
        parts = ("attn_q", "attn_k", "attn_v") if m.group(2) == "attn_qkv" else ("ffn_gate", "ffn_up")
        shares = (heads, kv, kv) if m.group(2) == "attn_qkv" else (1, 1)
        if rows < 1 or rows % sum(shares):
            raise HelmcError(f"{path}: tensor {name!r}: expected GGUF dims [cols, rows] with rows a multiple of "
                             f"{sum(shares)} ({' + '.join(parts)}), found {list(t.dims)}")
        each, offset = rows // sum(shares), t.offset
        for part, share in zip(parts, shares):
            n = f"blk.{m.group(1)}.{part}.weight"
            out[n] = GGUFTensor(n, t.type, (t.dims[0], each * share), offset, each * share * t.row_bytes,
                                t.block_weights, t.block_bytes)
            offset += each * share * t.row_bytes
    return out


def expert_slices(path: str, tensors: dict) -> dict:
    """`tensors` with each stacked expert tensor (blk.N.ffn_gate_exps.weight, dims [cols, rows, experts]; gpt-oss's
    biases blk.N.ffn_gate_exps.bias, [rows, experts]) replaced by one entry per expert (blk.N.ffn_gate_exps.E.weight,
    dims [cols, rows]): expert E's rows lie together in the file, so each is a plain tensor at its own offset, bound
    zero-copy like any other."""
    out = {}
    for name, t in tensors.items():
        if not (m := GGUF_STACKED.fullmatch(name)):
            out[name] = t
            continue
        n = 3 if m.group(3) == "weight" else 2
        if len(t.dims) != n or t.dims[-1] < 1:
            raise HelmcError(f"{path}: tensor {name!r}: expected GGUF dims [{'cols, ' * (n == 3)}rows, experts], "
                             f"found {list(t.dims)}")
        experts = t.dims[-1]
        each = t.nbytes // experts                     # [experts, rows, row bytes]: one expert's rows together
        stem, kind = name.rsplit(".", 1)
        for e in range(experts):
            out[f"{stem}.{e}.{kind}"] = GGUFTensor(f"{stem}.{e}.{kind}", t.type, t.dims[:-1], t.offset + e * each, each,
                                                   t.block_weights, t.block_bytes)
    return out

