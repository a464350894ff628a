"""gpt-oss checkpoints store each block's experts fused: mlp.experts.gate_up_proj [E, H, 2I] (x @ W, gate and up
interleaved on the last axis: gate at even columns, up at odd ones), gate_up_proj_bias [E, 2I] alike, down_proj
[E, I, H] and down_proj_bias [E, H]. The compiled expert function takes one expert's gate [I, H], up [I, H] and
down [H, I] weights ([out, in], as every linear) and their biases (helmc.model.moe's `gpt_oss` naming): here each is
a strided NumPy view of the fused tensor (no copy; binding copies it into the expert's own tensor)."""
from __future__ import annotations

from helmc.errors import HelmcError


def _gate(w):
    return w[:, 0::2].T if w.ndim == 2 else w[0::2]


def _up(w):
    return w[:, 1::2].T if w.ndim == 2 else w[1::2]


def _down(w):
    return w.T if w.ndim == 2 else w


def fused_expert_parts(experts: int, hidden: int, inter: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """{fused suffix under model.layers.N.mlp.experts.: (its shape, ((part name template under
    model.layers.N., its shape, view of one expert's slice -> the part), ...))}; {e} in a template is the expert."""
    E, H, I = experts, hidden, inter
    w, b = "mlp.experts.{e}.{kind}.weight", "mlp.experts.{e}.{kind}.bias"
    return {
        "gate_up_proj": ((E, H, 2 * I), ((w.replace("{kind}", "gate_proj"), (I, H), _gate),
                                         (w.replace("{kind}", "up_proj"), (I, H), _up))),
        "gate_up_proj_bias": ((E, 2 * I), ((b.replace("{kind}", "gate_proj"), (I,), _gate),
                                           (b.replace("{kind}", "up_proj"), (I,), _up))),
        "down_proj": ((E, I, H), ((w.replace("{kind}", "down_proj"), (H, I), _down),)),
        "down_proj_bias": ((E, H), ((b.replace("{kind}", "down_proj"), (H,), _down),)),
    }


def split_fused_experts(names, info, experts: int, hidden: int, inter: int) -> dict[str, tuple[str, int, tuple, object]]:
    """{part name: (fused tensor name, expert, part shape, view function)} for every fused expert tensor among
    `names` (info(name) its TensorInfo), each fused tensor's shape checked against config.json's."""
    parts = fused_expert_parts(experts, hidden, inter)
    out = {}
    for name in names:
        stem, dot, suffix = name.rpartition(".")
        if stem.endswith(".mlp.experts") and suffix.endswith(("_blocks", "_scales")):
            raise HelmcError(f"weights: gpt-oss's experts expected as floats in a Hugging Face directory (or in a GGUF "
                             f"file, llama.cpp's convert_hf_to_gguf.py keeping them MXFP4), found {name} (the "
                             f"published MXFP4 checkpoint)")
        if not (name.startswith("model.layers.") and stem.endswith(".mlp.experts") and suffix in parts):
            continue
        shape, pieces = parts[suffix]
        found = tuple(info(name).shape)
        if found != shape:
            raise HelmcError(f"weights: {name} shape expected {list(shape)} (num_local_experts, hidden_size, "
                             f"intermediate_size of config.json), found {list(found)}")
        layer = stem[:-len("mlp.experts")]
        for e in range(experts):
            for template, part_shape, fn in pieces:
                out[layer + template.format(e=e)] = (name, e, part_shape, fn)
    return out

