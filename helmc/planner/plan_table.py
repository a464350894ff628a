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
    pl, pr, mem, wl = plan.placement, plan.predictions, plan.memory, plan.workload
    gib = 1024 ** 3
    title = f"{spec.architecture} ({pl.num_layers} blocks, {pl.num_units} units)" if spec is not None \
        else f"{pl.num_layers} blocks, {pl.num_units} units"
    lines = [f"partition search: {title}; objective {wl.objective}, prompt {wl.prompt_len}, "
             f"output {wl.output_len}, batch {wl.batch}, KV offload {'on' if wl.kv_offload else 'off'}",
             f"usable VRAM {mem.usable_vram_bytes / gib:.2f} GiB, free host RAM {mem.ram_free_bytes / gib:.2f} GiB"]
    unit = ("ms/token" if wl.batch == 1 else f"ms per decode step of {wl.batch} sequences (a token each)") \
        if wl.objective == "decode" else "ms to first token"
    decode = wl.objective == "decode"
    rate_head = f" {'tok/s':>8}" if decode else ""
    header = (f"  {'k':>3} {'CPU units':<12} {'GPU units':<12} {'T_cpu':>9} {'T_gpu':>9} {'T_comm':>8} "
              f"{'T_plan':>9}{rate_head} {'VRAM GiB':>9} {'host GiB':>9}  feasible")
    lines += [f"times in {unit}", header]
    for c in pr.candidates:
        mark = ">" if c.cpu_units == pl.cpu_units and not pl.is_hybrid else " "
        if not c.feasible:
            feas = f"no: {c.why}"
        else:
            feas = "yes" if mark == ">" else f"yes, +{c.t_plan_ms - pr.t_plan_ms:.2f} ms"
            feas += ", the hybrid layout's host part" if pl.is_hybrid and c.cpu_units == pl.cpu_units else ""
        lines.append(f"{mark} {c.cpu_units:>3} {_units_text(0, c.cpu_units, pl.num_layers):<12} "
                     f"{_units_text(c.cpu_units, pl.num_units, pl.num_layers):<12} {c.t_cpu_ms:>9.2f} "
                     f"{c.t_gpu_ms:>9.2f} {c.t_comm_ms:>8.4f} {c.t_plan_ms:>9.2f}{_rate(plan, c.t_plan_ms if c.feasible else 0.0) if decode else ''} "
                     f"{c.gpu_bytes / gib:>9.2f} "
                     f"{c.cpu_bytes / gib:>9.2f}  {feas}")
    if pl.is_hybrid:
        split = pr.candidates[pl.cpu_units].t_plan_ms if pr.candidates else 0.0
        best_split = min((c.t_plan_ms for c in pr.candidates if c.feasible), default=0.0)
        lines.append(f"hybrid decode beats every split: {pr.t_plan_ms:.2f} ms against {best_split:.2f} ms for the "
                     f"fastest ({best_split / pr.t_plan_ms:.2f}x); its host part alone as a split: {split:.2f} ms")
    rate = f" = {plan.tokens_per_s:.1f} tok/s" if decode and pr.t_plan_ms > 0 else ""
    lines.append(f"chosen: {plan.describe()}  T_plan {pr.t_plan_ms:.2f} ms{rate} (T_cpu {pr.t_cpu_ms:.2f} + "
                 f"T_gpu {pr.t_gpu_ms:.2f} + T_comm {pr.t_comm_ms:.4f}); weights CPU "
                 f"{mem.cpu_weight_bytes / gib:.2f} GiB, GPU {mem.gpu_weight_bytes / gib:.2f} GiB; "
                 f"max context {mem.max_context} tokens")
    if wl.objective == "decode" and wl.batch > 1 and pr.t_plan_ms > 0:
        lines.append(f"serving {wl.batch} sequences at once: {wl.batch * 1000 / pr.t_plan_ms:.1f} tok/s in all, "
                     f"{1000 / pr.t_plan_ms:.2f} each (predicted)")
    if pl.is_hybrid:
        lines += hybrid_lines(plan)
    if pl.prefill_on_gpu:
        lines.append(f"prefill: the {len(pl.cpu_layers)} CPU blocks run the prompt on the GPU, each block's weights "
                     f"streamed over PCIe ({mem.prefill_staging_bytes / gib:.2f} GiB of VRAM staging), "
                     f"{pl.prefill_chunk_tokens} tokens at a time")
    if pl.uses_gpu:
        lines.append(f"KV pages of GPU blocks: {mem.gpu_kv_pool_bytes / gib:.2f} GiB of VRAM"
                     f"{', the rest in pinned host RAM' if wl.kv_offload else ''}")
    if spec is not None and spec.moe is not None:
        lines.append(experts_line(plan, spec))
    if spec is not None:
        lines.append(weights_line(spec))
    for f in pr.fallbacks:
        lines.append(f"note: {f}")
    return "\n".join(lines)


def _rate(plan: Plan, t_ms: float) -> str:
    """Tokens per second of a decode step of t_ms (a token per sequence), as the table's column."""
    return f" {plan.workload.batch * 1000 / t_ms:>8.1f}" if t_ms > 0 else f" {'-':>8}"


def _blocks_text(first: int, count: int, with_embedding: bool) -> str:
    blocks = f"{first}" if count == 1 else f"{first}-{first + count - 1}"
    return ("emb+" if with_embedding else "") + blocks


def hybrid_lines(plan: Plan) -> list[str]:
    """Hybrid decode's order of groups with each pair's predicted CPU, copy and overlapped times, the share of
    the copies hidden behind the CPU, and the layouts tried per pair count."""
    pl, pr, mem = plan.placement, plan.predictions, plan.memory
    gib = 1024 ** 3
    pairs = len(pl.groups) // 2
    lines = [f"decode order (hybrid): {pairs} pairs of a CPU group and a streamed group, then the GPU-resident "
             f"blocks; staging ring {mem.staging_ring_bytes / gib:.2f} GiB of VRAM; the copy of each streamed group "
             f"is issued when the CPU group before it starts",
             f"  {'#':>3} {'kind':<9} {'blocks':<10} {'GiB':>6} {'CPU ms':>8} {'copy ms':>8} {'both ms':>8} {'GPU ms':>8}"]
    cpu_alone = 0.0
    for i, g in enumerate(pl.groups):
        where = _blocks_text(g.first_layer, g.num_layers, i == 0)
        if g.kind == "cpu":
            cpu_alone += g.t_compute_ms
            lines.append(f"  {i + 1:>3} {'cpu':<9} {where:<10} {g.weight_bytes / gib:>6.2f} {g.t_compute_ms:>8.2f}")
        else:
            lines.append(f"  {i + 1:>3} {'streamed':<9} {where:<10} {g.weight_bytes / gib:>6.2f} {'':>8} "
                         f"{g.t_copy_ms:>8.2f} {g.t_overlap_ms:>8.2f} {g.t_compute_ms:>8.2f}")
    hidden = (cpu_alone + pr.t_copy_ms - pr.t_cpu_ms) / pr.t_copy_ms if pr.t_copy_ms else 0.0
    cpu_bytes = sum(g.weight_bytes for g in pl.groups if g.kind == "cpu")
    copied = sum(g.weight_bytes for g in pl.groups if g.kind == "streamed")
    lines.append(f"predicted overlap: the copies take {pr.t_copy_ms:.2f} ms alone and the CPU groups "
                 f"{cpu_alone:.2f} ms alone; together {pr.t_cpu_ms:.2f} ms, so {100 * max(0.0, min(1.0, hidden)):.0f}% "
                 f"of the copy time is hidden; per token the CPU reads {cpu_bytes / 1e9:.2f} GB and PCIe carries "
                 f"{copied / 1e9:.2f} GB in those {pr.t_cpu_ms:.2f} ms ({(cpu_bytes + copied) / pr.t_cpu_ms / 1e6:.1f} GB/s "
                 f"of host memory)")
    lines.append(f"hybrid layouts tried, the best per pair count ('>' chosen):")
    lines.append(f"    {'pairs':>5} {'streamed':>8} {'host blocks':>11} {'ring GiB':>8} {'T_plan':>9}")
    for c in pr.hybrid_candidates:
        mark = ">" if c.key() == (pl.cpu_units, pairs, len(pl.streamed_layers)) else " "
        lines.append(f"  {mark} {c.pairs:>5} {c.streamed_blocks:>8} {c.cpu_units - 1:>11} {c.ring_bytes / gib:>8.2f} "
                     f"{c.t_plan_ms:>9.2f}")
    return lines


def weights_line(spec) -> str:
    """The weights' format per unit and the model's size as stored, e.g. 'weights: embedding float16, 28 blocks
    A, 8 blocks A + B (v, down), head B; 4.68 GiB' for a Q4_K_M file (A, B: its two types' names)."""
    from helmc.model.spec import LINEAR_NAMES
    gib = 1024 ** 3
    V, H = spec.vocab_size, spec.hidden_size
    lm_type = spec.embed_type if spec.tie_word_embeddings else spec.head_type
    total = sum(spec.block_weight_bytes(i) for i in range(spec.num_layers)) + spec.tensor_bytes((V, H), spec.embed_type)
    total += 0 if spec.tie_word_embeddings else spec.tensor_bytes((V, H), spec.head_type)
    if not spec.quantized:
        return f"weights: {spec.dtype}; {total / gib:.2f} GiB"
    blocks = []
    names = LINEAR_NAMES[:4] if spec.moe is not None else LINEAR_NAMES     # a MoE block's linears: its attention's
    for sig in spec.block_signatures():
        count = sum(1 for t in spec.layer_types if t == sig) if spec.layer_types else spec.num_layers
        sig = sig[:len(names)]
        kinds = list(dict.fromkeys(t or spec.dtype for t in sig))
        main = max(kinds, key=lambda k: sum(1 for t in sig if (t or spec.dtype) == k))
        others = [f"{k} ({', '.join(n.split('.')[1].removesuffix('_proj') for n, t in zip(names, sig) if (t or spec.dtype) == k)})"
                  for k in kinds if k != main]
        blocks.append(f"{count} blocks {main}" + (" + " + " + ".join(others) if others else ""))
    if spec.moe is not None:
        sigs = ["/".join(t or spec.dtype for t in sig) for sig in spec.expert_signatures()]
        blocks.append(f"experts (gate/up/down) {', '.join(sigs)}")
    return (f"weights: embedding {spec.embed_type or spec.dtype}, {', '.join(blocks)}, head {lm_type or spec.dtype}; "
            f"{total / gib:.2f} GiB")


def experts_line(plan: Plan, spec) -> str:
    """A mixture of experts' split: how many routed experts the plan holds in VRAM, the predicted hit rate (the share
    of selections they take: from routing statistics, or uniform routing as Plan.predictions.fallbacks says), the rest in host
    RAM for the CPU."""
    from helmc.planner.moe import UNIFORM_ROUTING, expert_bytes
    pl, mem = plan.placement, plan.memory
    gib = 1024 ** 3
    routed = sum(1 for i in range(spec.num_layers) if spec.is_moe_layer(i))
    total = routed * spec.moe.num_experts
    in_vram = sum(len(ids) for ids in pl.gpu_experts)
    held = expert_bytes(spec)
    how = "uniform routing" if UNIFORM_ROUTING in plan.predictions.fallbacks else "routing statistics"
    return (f"experts: {in_vram} of {total} in VRAM ({held * in_vram / total / gib:.2f} GiB), "
            f"{total - in_vram} in host RAM ({held * (total - in_vram) / total / gib:.2f} GiB) for the CPU; "
            f"predicted hit rate {plan.predictions.expert_hit_rate:.2f} ({how}), top-{spec.moe.top_k} of "
            f"{spec.moe.num_experts} per block"
            + (f"; a prompt's host experts stream to the GPU through {mem.expert_staging_bytes / gib:.2f} GiB of "
               "staging" if mem.expert_staging_bytes else "")
            + ("; the VRAM expert cache refreshes the slots from the tokens' routing" if pl.expert_cache else ""))
