"""Makers of valid inputs to damage: a raw GGUF encoder (every field under the test's control, so a length
can be 2^63 or a type id unknown) and a tiny model's GGUF, safetensors header and JSON documents."""
from __future__ import annotations

import json
import struct

import numpy as np

# GGUF value types (gguf-py's GGUFValueType)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
           I64: "<q", F64: "<d"}
GGML_F32, GGML_F16 = 0, 1


def gguf_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype: int, value) -> bytes:
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(gguf_value(item_type, v) for v in items)
    return struct.pack(_SCALAR[vtype], value)


def gguf_kv(key: str, vtype: int, value) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype) + gguf_value(vtype, value)


def gguf_file(kvs: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, bytes]], version: int = 3,
              alignment: int = 32, n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    """A GGUF file of already-encoded key/values and (name, dims ne0 first, GGML type id, data) tensors."""
    infos, data, offset = b"", b"", 0
    for name, dims, ggml_type, payload in tensors:
        infos += gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", ggml_type, offset)
        pad = (-len(payload)) % alignment
        data += payload + b"\0" * pad
        offset += len(payload) + pad
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + infos
    return head + b"\0" * ((-len(head)) % alignment) + data


TINY = dict(hidden=32, heads=1, kv_heads=1, head_dim=32, inter=64, layers=1, vocab=32, context=512)


def tiny_qwen3_kvs(arch: str = "qwen3", **over) -> list[bytes]:
    t = dict(TINY, **over)
    return [gguf_kv("general.architecture", STRING, arch),
            gguf_kv(f"{arch}.block_count", U32, t["layers"]), gguf_kv(f"{arch}.context_length", U32, t["context"]),
            gguf_kv(f"{arch}.embedding_length", U32, t["hidden"]),
            gguf_kv(f"{arch}.feed_forward_length", U32, t["inter"]),
            gguf_kv(f"{arch}.attention.head_count", U32, t["heads"]),
            gguf_kv(f"{arch}.attention.head_count_kv", U32, t["kv_heads"]),
            gguf_kv(f"{arch}.attention.key_length", U32, t["head_dim"]),
            gguf_kv(f"{arch}.attention.layer_norm_rms_epsilon", F32, 1e-6),
            gguf_kv(f"{arch}.rope.freq_base", F32, 10000.0)]


def tiny_qwen3_tensors(**over) -> list[tuple[str, tuple[int, ...], int, bytes]]:
    """Every tensor of the tiny Qwen3 in F32 (dims ne0 first), small random values."""
    t = dict(TINY, **over)
    H, D, I, V = t["hidden"], t["head_dim"], t["inter"], t["vocab"]
    Q, KV = t["heads"] * D, t["kv_heads"] * D
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    for i in range(t["layers"]):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.attn_q.weight": (Q, H),
                       f"blk.{i}.attn_k.weight": (KV, H), f"blk.{i}.attn_v.weight": (KV, H),
                       f"blk.{i}.attn_q_norm.weight": (D,), f"blk.{i}.attn_k_norm.weight": (D,),
                       f"blk.{i}.attn_output.weight": (H, Q), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.ffn_gate.weight": (I, H), f"blk.{i}.ffn_up.weight": (I, H),
                       f"blk.{i}.ffn_down.weight": (H, I)})
    return [(n, tuple(reversed(s)), GGML_F32, (0.02 * rng.standard_normal(s)).astype(np.float32).tobytes())
            for n, s in shapes.items()]


def tiny_gguf_bytes(**over) -> bytes:
    return gguf_file(tiny_qwen3_kvs(**over), tiny_qwen3_tensors(**over))


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def tiny_safetensors() -> tuple[dict, bytes]:
    """(header, data) of a valid safetensors file of three small tensors."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, shape, dtype, item in (("a", (4, 8), "F32", 4), ("b", (16,), "F16", 2), ("c", (2, 3), "BF16", 2)):
        n = int(np.prod(shape)) * item
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + n]}
        data += bytes(range(256)) * (n // 256) + bytes(range(n % 256))
    return header, data
