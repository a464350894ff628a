"""The plan as a readable table: every candidate split (thesis Figure 4.4), the chosen row marked."""
from __future__ import annotations

from helmc.runtime.bundle.plan import Plan


def _units_text(lo: int, hi: int, num_layers: int) -> str:
    """Units [lo, hi) as 'emb+20blk', '16blk+head', ..."""
    if lo >= hi:
        return "-"
    parts = []
    if lo == 0:
        parts.append("emb")
    blocks = max(0, min(hi, num_layers + 1) - max(lo, 1))
    if blocks:
        parts.append(f"{blocks}blk")
    if hi == num_layers + 2:
        parts.append("head")
    return "+".join(parts)


def format_plan_table(plan: Plan, spec=None) -> str:
    """Every candidate split as text (thesis Figure 4.4), the chosen row marked with '>'."""
    gib = 1024 ** 3
    title = f"{spec.architecture} ({plan.num_layers} blocks, {plan.num_units} units)" if spec is not None \
        else f"{plan.num_layers} blocks, {plan.num_units} units"
    lines = [f"partition search: {title}; objective {plan.objective}, prompt {plan.prompt_len}, "
             f"output {plan.output_len}, batch {plan.batch}, KV offload {'on' if plan.kv_offload else 'off'}",
             f"usable VRAM {plan.usable_vram_bytes / gib:.2f} GiB, free host RAM {plan.ram_free_bytes / gib:.2f} GiB"]
    unit = "ms/token" if plan.objective == "decode" else "ms to first token"
    header = (f"  {'k':>3} {'CPU units':<12} {'GPU units':<12} {'T_cpu':>9} {'T_gpu':>9} {'T_comm':>8} "
              f"{'T_plan':>9} {'VRAM GiB':>9} {'host GiB':>9}  feasible")
    lines += [f"times in {unit}", header]
    for c in plan.candidates:
        mark = ">" if c.cpu_units == plan.cpu_units else " "
        if not c.feasible:
            feas = f"no: {c.why}"
        else:
            feas = "yes" if mark == ">" else f"yes, +{c.t_plan_ms - plan.t_plan_ms:.2f} ms"
        lines.append(f"{mark} {c.cpu_units:>3} {_units_text(0, c.cpu_units, plan.num_layers):<12} "
                     f"{_units_text(c.cpu_units, plan.num_units, plan.num_layers):<12} {c.t_cpu_ms:>9.2f} "
                     f"{c.t_gpu_ms:>9.2f} {c.t_comm_ms:>8.4f} {c.t_plan_ms:>9.2f} {c.gpu_bytes / gib:>9.2f} "
                     f"{c.cpu_bytes / gib:>9.2f}  {feas}")
    lines.append(f"chosen: {plan.describe()}  T_plan {plan.t_plan_ms:.2f} ms (T_cpu {plan.t_cpu_ms:.2f} + "
                 f"T_gpu {plan.t_gpu_ms:.2f} + T_comm {plan.t_comm_ms:.4f}); weights CPU "
                 f"{plan.cpu_weight_bytes / gib:.2f} GiB, GPU {plan.gpu_weight_bytes / gib:.2f} GiB; "
                 f"max context {plan.max_context} tokens")
    if plan.prefill_on_gpu:
        lines.append(f"prefill: the {len(plan.cpu_layers)} CPU blocks run the prompt on the GPU, each block's weights "
                     f"streamed over PCIe ({plan.prefill_staging_bytes / gib:.2f} GiB of VRAM staging), "
                     f"{plan.prefill_chunk_tokens} tokens at a time")
    if plan.uses_gpu:
        lines.append(f"KV pages of GPU blocks: {plan.gpu_kv_pool_bytes / gib:.2f} GiB of VRAM"
                     f"{', the rest in pinned host RAM' if plan.kv_offload else ''}")
    if spec is not None:
        lines.append(weights_line(spec))
    for f in plan.fallbacks:
        lines.append(f"note: {f}")
    return "\n".join(lines)


def weights_line(spec) -> str:
    """The weights' format per unit and the model's size as stored, e.g. 'weights: embedding q4_k, 28 blocks
    q4_k, 8 blocks q4_k + q6_k (v, down), head q6_k; 4.68 GiB'."""
    from helmc.model.spec import LINEAR_NAMES
    gib = 1024 ** 3
    V, H = spec.vocab_size, spec.hidden_size
    lm_type = spec.embed_type if spec.tie_word_embeddings else spec.head_type
    total = sum(spec.block_weight_bytes(i) for i in range(spec.num_layers)) + spec.tensor_bytes((V, H), spec.embed_type)
    total += 0 if spec.tie_word_embeddings else spec.tensor_bytes((V, H), spec.head_type)
    if not spec.quantized:
        return f"weights: {spec.dtype}; {total / gib:.2f} GiB"
    blocks = []
    for sig in spec.block_signatures():
        count = sum(1 for t in spec.layer_types if t == sig) if spec.layer_types else spec.num_layers
        kinds = list(dict.fromkeys(t or spec.dtype for t in sig))
        main = max(kinds, key=lambda k: sum(1 for t in sig if (t or spec.dtype) == k))
        others = [f"{k} ({', '.join(n.split('.')[1].removesuffix('_proj') for n, t in zip(LINEAR_NAMES, sig) if (t or spec.dtype) == k)})"
                  for k in kinds if k != main]
        blocks.append(f"{count} blocks {main}" + (" + " + " + ".join(others) if others else ""))
    return (f"weights: embedding {spec.embed_type or spec.dtype}, {', '.join(blocks)}, head {lm_type or spec.dtype}; "
            f"{total / gib:.2f} GiB")
