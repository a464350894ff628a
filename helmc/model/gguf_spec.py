"""GGUF files (llama.cpp's format) as a model input: the ModelSpec, the tensor names and types, the tokenizer.

A GGUF file is one self-contained model: hyper-parameters as `{arch}.*` keys, the tokenizer as
`tokenizer.ggml.*` keys, then tensors under llama.cpp's names (`blk.N.attn_q.weight`) with their dims
listed ne0 first (the reverse of NumPy / Hugging Face order) and their data at aligned offsets. helmc
keeps Hugging Face names everywhere else, so this module maps the names both ways (one table, shared
with the HF -> GGUF writer), derives the same ModelSpec that `ModelSpec.from_hf_config` gives for the
original config.json, and checks every tensor's type and shape against it before anything binds.

Parsing goes through the `gguf` package (llama.cpp's own reader, NumPy only, an optional dependency:
`pip install 'helmc[gguf]'`); its failures on garbage or truncated files become HelmcErrors.
Supported: architectures qwen3, qwen2, llama (Mistral files are llama; llama with experts is Mixtral), qwen3moe, phi3
(its fused tensors split); tensor types F32, F16, BF16,
Q8_0, Q4_0, Q4_K, Q6_K; byte-level BPE tokenizers (tokenizer.ggml.model "gpt2").
"""
from __future__ import annotations

import math
import functools
import os
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from helmc.errors import HelmcError
from helmc.model.arch import ARCHITECTURES, GGUF_ARCHITECTURES as ARCH_BY_GGUF, Architecture, gguf_architecture
from helmc.model.arch.tensors import DENSE_BLOCK, EXPERT_STACKS, EXTRA_TENSORS, QK_PERMUTED, ROOT_TENSORS
from helmc.model.gguf_gemma import gemma_gguf_fields, gpt_oss_gguf_fields
from helmc.model.gguf_rope import yarn_gguf_rope
from helmc.model.moe import NAMINGS, MoeSpec
from helmc.model.spec import ModelSpec, RopeSpec
from helmc.model.weight_types import WEIGHT_TYPES

# general.architecture -> the HF class a file of it reads as (helmc.model.arch's entries).
GGUF_ARCHITECTURES = {g: a.hf_class for g, a in ARCH_BY_GGUF.items()}
SUPPORTED_TYPES = tuple(WEIGHT_TYPES)

# ---- names: one table (helmc.model.arch.tensors, every architecture's block), read both ways ---------------
HF_TO_GGUF_ROOT = ROOT_TENSORS
# Without Gemma's block, which names the same HF norm otherwise (post_attention_layernorm): its names go by the
# architecture (gguf_name / hf_name's `arch`).
HF_TO_GGUF_BLOCK = {**DENSE_BLOCK, **{h: g for a in ARCHITECTURES.values() if not a.sandwich_norms and all(
    DENSE_BLOCK.get(h, g) == g for h, g in a.block_tensors.items()) for h, g in a.block_tensors.items()}}
GGUF_TO_HF_ROOT = {g: h for h, g in HF_TO_GGUF_ROOT.items()}
GGUF_TO_HF_BLOCK = {g: h for h, g in HF_TO_GGUF_BLOCK.items()}
# The tensors llama.cpp's llama converter reorders per head (see qk_rows_to_hf); which files have them: the arch entry.
PERMUTED_FOR_LLAMA = QK_PERMUTED

_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# One expert's weight: HF model.layers.N.mlp.experts.E.gate_proj.weight (Mixtral: block_sparse_moe.experts.E.w1.weight;
# every naming of helmc.model.moe.NAMINGS) <-> blk.N.ffn_gate_exps.E.weight, the slice E of the file's stacked
# blk.N.ffn_gate_exps.weight (expert_slices names them so). GGUF -> HF takes the file's naming.
# gpt-oss's experts' biases alike: mlp.experts.E.gate_proj.bias <-> blk.N.ffn_gate_exps.E.bias.
_HF_EXPERTS = tuple((re.compile(r"model\.layers\.(\d+)\." + re.escape(t.split("{e}")[0]) + r"(\d+)"
                                + re.escape(t.split("{e}")[1][:-len("weight")]) + r"(weight|bias)"), stack)
                    for _router, templates in NAMINGS.values() for t, stack in zip(templates, EXPERT_STACKS))
_GGUF_EXPERT = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.(\d+)\.(weight|bias)")
_GGUF_STACKED = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.(weight|bias)")
_GGUF_ROUTER = "ffn_gate_inp.weight"


def _block_names(arch: str | None) -> tuple[dict, dict]:
    """(HF -> GGUF, GGUF -> HF) block suffixes of the architecture `arch` (an HF class; None: the shared table)."""
    if arch is None or arch not in ARCHITECTURES:
        return HF_TO_GGUF_BLOCK, GGUF_TO_HF_BLOCK
    table = ARCHITECTURES[arch].block_tensors
    return table, {g: h for h, g in table.items()}


def gguf_name(hf_name: str, arch: str | None = None) -> str:
    """llama.cpp's name of a Hugging Face parameter name (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight);
    `arch` (the HF class) where its block names the norms its own way (Gemma)."""
    if hf_name in HF_TO_GGUF_ROOT:
        return HF_TO_GGUF_ROOT[hf_name]
    for pattern, stack in _HF_EXPERTS:
        if m := pattern.fullmatch(hf_name):
            return f"blk.{m.group(1)}.{stack}.{m.group(2)}.{m.group(3)}"
    m, block = _HF_BLOCK.fullmatch(hf_name), _block_names(arch)[0]
    if m and m.group(2) in block:
        return f"blk.{m.group(1)}.{block[m.group(2)]}"
    raise HelmcError(f"tensor name: expected a Qwen3/Qwen2/Llama parameter name, found {hf_name!r} (no GGUF equivalent)")


def hf_name(gguf_name: str, naming: str = "qwen_moe", arch: str | None = None) -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name (blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight);
    a router's and an expert's under `naming` (a helmc.model.moe.NAMINGS key: the file's architecture's)."""
    if gguf_name in GGUF_TO_HF_ROOT:
        return GGUF_TO_HF_ROOT[gguf_name]
    router, experts = NAMINGS[naming]
    if m := _GGUF_EXPERT.fullmatch(gguf_name):
        local = experts[EXPERT_STACKS.index(m.group(2))].format(e=int(m.group(3)))[:-len("weight")] + m.group(4)
        return f"model.layers.{m.group(1)}.{local}"
    m = _GGUF_BLOCK.fullmatch(gguf_name)
    if m and m.group(2) == _GGUF_ROUTER:
        return f"model.layers.{m.group(1)}.{router}"
    block = _block_names(arch)[1]
    if m and m.group(2) in block:
        return f"model.layers.{m.group(1)}.{block[m.group(2)]}"
    raise HelmcError(f"tensor name: expected a llama.cpp tensor of a qwen3/qwen2/llama model, found {gguf_name!r}")


def qk_rows_to_hf(n_heads: int, head_dim: int) -> np.ndarray:
    """int64 [n_heads * head_dim]: HF row r of a llama file's attn_q / attn_k is GGUF row idx[r].

    llama.cpp's converter (LlamaModel.permute) interleaves each head's two RoPE halves, so GGUF row
    h*D + 2j + i holds HF row h*D + i*D/2 + j: the same rows (also whole quantized rows), reordered."""
    idx = np.arange(n_heads * head_dim, dtype=np.int64).reshape(n_heads, head_dim // 2, 2)  # [h, j, i] = GGUF row
    return np.ascontiguousarray(idx.swapaxes(1, 2)).reshape(-1)                                # [h, i, j] -> HF order


def qk_rows_to_gguf(n_heads: int, head_dim: int) -> np.ndarray:
    """The inverse of qk_rows_to_hf: GGUF row r is HF row idx[r] (what a HF -> GGUF writer applies)."""
    return np.argsort(qk_rows_to_hf(n_heads, head_dim))


def permuted_heads(gguf_arch: str, spec: ModelSpec, gguf_tensor: str) -> int:
    """Heads whose rows llama.cpp permuted in this tensor of a `gguf_arch` file (0: stored in HF order)."""
    m = _GGUF_BLOCK.fullmatch(gguf_tensor)
    entry = ARCH_BY_GGUF.get(gguf_arch)
    kind = entry.permuted_tensors.get(m.group(2)) if m and entry is not None else None
    return {"q": spec.num_heads, "k": spec.num_kv_heads}.get(kind, 0)


# ---- the parsed header ----------------------------------------------------------------------------
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
        n.endswith("." + _GGUF_ROUTER) for n in tensors)
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
        if not (m := _GGUF_STACKED.fullmatch(name)):
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


# ---- the ModelSpec --------------------------------------------------------------------------------
def _f32(v: float) -> float:
    # GGUF stores these as float32; the shortest decimal that rounds to it is what config.json said (1e-06).
    return float(str(np.float32(v)))


def spec_from_gguf_header(h: GGUFHeader) -> ModelSpec:
    entry = file_architecture(h.architecture, h.metadata, h.tensors)
    if entry is None:
        raise HelmcError(f"{h.path}: general.architecture expected one of {', '.join(GGUF_ARCHITECTURES)} "
                         f"(Mistral files are llama, Mixtral's llama with experts), found {h.architecture!r}")
    arch = h.architecture
    missing = object()

    def key(name, default=missing, kind=int):
        full = f"{arch}.{name}"
        v = h.metadata.get(full, missing)
        if v is missing:
            if default is missing:
                raise HelmcError(f"{h.path}: required key {full!r} missing for {arch}")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:   # also a per-layer list
            raise HelmcError(f"{h.path}: {full!r} expected one positive number, found {v!r:.80}")
        return kind(v)

    H, heads = key("embedding_length"), key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    head_dim = key("attention.key_length", H // heads)
    for k, why in (("attention.value_length", "= key_length"), ("rope.dimension_count", "RoPE over the whole head")):
        if (v := key(k, head_dim)) != head_dim:
            raise HelmcError(f"{h.path}: {arch}.{k} expected {head_dim} ({why}), found {v}")
    if heads % kv_heads:
        raise HelmcError(f"{h.path}: head_count ({heads}) must be a multiple of head_count_kv ({kv_heads})")
    if head_dim % 2:
        raise HelmcError(f"{h.path}: head dim must be even for RoPE, found {head_dim}")
    theta = _f32(key("rope.freq_base", 10000.0, float))   # llama.cpp's default when the key is absent
    if "rope_factors_long.weight" in h.tensors or "rope_factors_short.weight" in h.tensors:
        raise HelmcError(f"{h.path}: RoPE scaling expected none or linear, found longrope (rope_factors_long / "
                         f"rope_factors_short tensors), which helmc does not build")

    embd = h.tensors.get("token_embd.weight")
    if embd is None or len(embd.dims) != 2:
        raise HelmcError(f"{h.path}: tensor 'token_embd.weight' (model.embed_tokens.weight): expected GGUF dims "
                         f"[{H}, vocab], found {list(embd.dims) if embd else 'no such tensor'}")
    vocab = embd.dims[1]
    for what, n in (("tokenizer.ggml.tokens lists", h.n_tokens), (f"{arch}.vocab_size says", key("vocab_size", 0))):
        if n and n != vocab:
            raise HelmcError(f"{h.path}: vocabulary: token_embd.weight has {vocab} rows, {what} {n} tokens")
    eos = [h.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if isinstance(e, int)))   # distinct, in this order
    bos = h.metadata.get("tokenizer.ggml.bos_token_id")
    fields = dict(
        architecture=entry.hf_class, hidden_size=H, intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=int(vocab), rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", kind=float)),
        rope=_rope(h, key, theta, head_dim), max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in h.tensors,
        # the activation / KV precision reference: quantized weights carry their own type per tensor
        dtype={"f32": "float32", "bf16": "bfloat16"}.get(embd.type, "float16"),
        qkv_bias="blk.0.attn_q.bias" in h.tensors, qk_norm=entry.qk_norm,
        sliding_window=_sliding_window(h) if entry.sliding_window else 0,
        bos_token_id=int(bos) if isinstance(bos, int) else -1, eos_token_ids=eos_ids)
    if entry.moe:
        fields["moe"] = _moe(h, key, fields["num_layers"], entry.moe_naming)
    if entry.local_rope:
        fields.update(gemma_gguf_fields(h.path, h.architecture, h.metadata, key, fields))
    if entry.attn_sinks:
        fields.update(gpt_oss_gguf_fields(h.path, h.architecture, h.metadata, h.tensors, key, fields))
    try:
        return ModelSpec(**fields)
    except HelmcError as e:                  # ModelSpec's own checks: say which file they are about
        raise HelmcError(f"{h.path}: {e}") from None


def _sliding_window(h: GGUFHeader) -> int:
    """{arch}.attention.sliding_window, config.json's sliding_window as the converter copies it (0 or absent: none)."""
    v = h.metadata.get(f"{h.architecture}.attention.sliding_window", 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise HelmcError(f"{h.path}: {h.architecture}.attention.sliding_window expected a non-negative integer, "
                         f"found {v!r:.40}")
    return v


def _moe(h: GGUFHeader, key, num_layers: int, naming: str) -> MoeSpec:
    """The experts' layout of a MoE file: {arch}.expert_count, expert_used_count, expert_feed_forward_length (absent
    from llama files, whose experts are feed_forward_length wide, as llama.cpp reads them); a block without a router
    (ffn_gate_inp) is dense; llama.cpp renormalises the top-k of qwen3moe and of llama with experts always."""
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.{_GGUF_ROUTER}" not in h.tensors)
    try:
        return MoeSpec(num_experts=key("expert_count"), top_k=key("expert_used_count"), norm_topk_prob=True,
                       expert_intermediate_size=key("expert_feed_forward_length", key("feed_forward_length")),
                       dense_layers=dense, naming=naming)
    except HelmcError as e:
        raise HelmcError(f"{h.path}: {e}") from None


def _rope(h: GGUFHeader, key, theta: float, head_dim: int) -> RopeSpec:
    kind = h.metadata.get(f"{h.architecture}.rope.scaling.type")
    factor = key("rope.scaling.factor", 0.0, float) or key("rope.scale_linear", 0.0, float)
    if kind is None and factor not in (0.0, 1.0):
        kind = "linear"                     # older files: rope.scale_linear without a scaling type
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=_f32(factor))
    if kind == "yarn":
        return yarn_gguf_rope(h.path, h.architecture, h.metadata, key, theta, factor)
    if kind not in (None, "none"):
        raise HelmcError(f"{h.path}: {h.architecture}.rope.scaling.type expected none, linear or yarn, found {kind!r}")
    if h.rope_freqs:
        return _llama3_rope(h.path, h.rope_freqs, theta, head_dim)
    return RopeSpec(theta=theta)


def _llama3_factors(freq: np.ndarray, factor: float, low: float, high: float, old: int) -> np.ndarray:
    # llama.cpp stores the divisor of each inverse frequency (convert_hf_to_gguf's rope_factors)
    wavelen = 2 * math.pi / freq
    smooth = (old / wavelen - low) / (high - low)
    with np.errstate(divide="ignore"):      # only used where 0 <= smooth <= 1
        mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def _llama3_rope(path: str, factors: tuple[float, ...], theta: float, head_dim: int) -> RopeSpec:
    """Llama 3's RoPE scaling from the rope_freqs.weight factors (the file has no keys for it).

    The factors depend on (old_ctx, low, high) only through a = old/(high-low) and b = low/(high-low),
    so every triple with the same a, b gives the same frequencies: with >= 2 factors strictly between 1
    and `factor` a line fit gives a, b and low is set to 1; otherwise Llama 3.1's (1, 4, 8192) is tried.
    Whatever is chosen must reproduce every stored factor."""
    f = np.asarray(factors, dtype=np.float64)
    if f.size != head_dim // 2:           # before sizing anything by head_dim, which a corrupt header sets at will
        raise HelmcError(f"{path}: rope_freqs.weight expected {head_dim // 2} factors (head dim {head_dim} / 2), found {f.size}")
    freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)   # [D/2]
    factor = float(f.max())
    if factor <= 1.0:
        return RopeSpec(theta=theta)
    candidates = []
    mid = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if mid.sum() >= 2:
        smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
        a, minus_b = np.polyfit(freq[mid] / (2 * math.pi), smooth, 1)   # smooth = a / wavelen - b
        if -minus_b > 0:
            candidates.append((1.0, round(1 - 1 / minus_b, 4), int(round(-a / minus_b))))
    candidates.append((1.0, 4.0, 8192))
    for low, high, old in candidates:
        if np.allclose(_llama3_factors(freq, factor, low, high, old), f, rtol=1e-4):
            return RopeSpec(theta=theta, kind="llama3", factor=_f32(factor), low_freq_factor=low,
                            high_freq_factor=high, original_max_position=old)
    raise HelmcError(f"{path}: rope_freqs.weight: expected Llama 3 RoPE scaling factors, found {list(np.round(f, 4))} "
                     "that no (factor, low, high, original context) reproduces")


# ---- tensors: names, types, shapes ----------------------------------------------------------------
def expected_hf_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight (runtime.weights.bind.expected_tensors; the model layer cannot import it)."""
    out = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "model.norm.weight": (spec.hidden_size,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    for i in range(spec.num_layers):
        out.update({f"model.layers.{i}.{n}": s for n, s in spec.block_weight_shapes(i).items()})
    return out


def _types(h: GGUFHeader) -> dict[str, str]:
    out = {}
    entry = file_architecture(h.architecture, h.metadata, h.tensors)
    naming = entry.moe_naming if entry is not None else "qwen_moe"
    arch = entry.hf_class if entry is not None else None
    for t in h.tensors.values():
        if t.name in EXTRA_TENSORS:
            continue
        try:
            hf = hf_name(t.name, naming, arch)
        except HelmcError:
            raise HelmcError(f"{h.path}: unexpected tensor {t.name!r}: not part of a qwen3/qwen2/llama model helmc runs") from None
        if t.type not in SUPPORTED_TYPES:
            raise HelmcError(f"{h.path}: tensor {t.name!r} ({hf}) has type {t.type.upper()}; helmc reads "
                             f"{', '.join(s.upper() for s in SUPPORTED_TYPES)}")
        out[hf] = t.type
    return out


def check_gguf_tensors(h: GGUFHeader, spec: ModelSpec) -> dict[str, str]:
    """Every tensor the spec needs is present with its shape and a supported type, and nothing else is
    there; returns HF name -> type name."""
    types = _types(h)
    expected = expected_hf_tensors(spec)
    for hf, shape in expected.items():
        g = gguf_name(hf, spec.architecture)
        t = h.tensors.get(g)
        if t is None:
            raise HelmcError(f"{h.path}: missing tensor {g!r} ({hf}): expected shape {list(shape)} "
                             f"(GGUF dims {list(reversed(shape))}) for this {h.architecture} model")
        if t.shape != tuple(shape):
            raise HelmcError(f"{h.path}: tensor {g!r} ({hf}): expected GGUF dims {list(reversed(shape))} (HF shape "
                             f"{list(shape)}) from the model's hyper-parameters, found dims {list(t.dims)} "
                             f"(HF shape {list(t.shape)})")
    for hf in types:
        if hf not in expected:
            raise HelmcError(f"{h.path}: unexpected tensor {gguf_name(hf, spec.architecture)!r} ({hf}): not part of this "
                             f"{h.architecture} model ({spec.num_layers} blocks, qkv_bias={spec.qkv_bias}, "
                             f"tied embeddings={spec.tie_word_embeddings})")
    return types


def read_gguf_spec(path: str) -> ModelSpec:
    """The ModelSpec of a GGUF file, after checking every tensor's presence, shape and type against it."""
    h = read_gguf_header(path)
    check_gguf_tensors(h, spec := spec_from_gguf_header(h))
    return spec


def gguf_tensor_types(path: str) -> dict[str, str]:
    """HF tensor name -> lower-case type name (a weight_types.WEIGHT_TYPES key); any other type
    raises a HelmcError naming the tensor and its type."""
    return _types(read_gguf_header(path))
