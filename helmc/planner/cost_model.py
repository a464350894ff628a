"""The roofline cost model of thesis 4.1.3 (eqs. 4.7-4.16) and the memory each device needs.

A stage (a contiguous run of partition units on one device) costs, per decode token,

    T_proj = max(F_proj / (P eta_c), W_param / (M eta_m))                      (4.9, 4.10)
    T_attn = max(F_attn / (P eta_c), W_kv / (M_hat eta_m))                     (4.11-4.13)
    M_hat  = alpha B_L3 + (1 - alpha) M,  alpha = min(1, C_L3 / W_kv)          (4.14, CPU only)
    T_stage = max(T_proj + T_attn, T_kv_stream) + n_blocks * delta + n_heads * sigma   (6.4.4)

where T_kv_stream is KV of GPU blocks that did not fit in VRAM and streams over PCIe from pinned
host pages while the stage computes (thesis 4.2.2-4.2.3), delta is the per-block overhead of the
stage's device and sigma the per-token overhead of the step's tail (embedding gather, RoPE, head,
logits out, sampling) charged where the lm_head runs. As in thesis 6.4.4 (T_hat = T_pred + N delta)
each device's delta is fitted by `helmc calibrate` against helmc's own decode step on that device;
a profile without calibration uses its one profile-wide delta for both devices. The link costs
T_comm = l_link + W_act / B_link at the CPU->GPU boundary (4.15), plus the sampled token ids
coming back when the lm_head is on the GPU (Algorithm 1 omits this; it is ~l_link and common to
every plan that uses the GPU). Objective "prefill" scores the time to first token instead: S
tokens through every projection, causal attention, S activations across the link.

Fallbacks for unmeasured figures (each is said in the plan table): CPU P_dec = M numerically, as
the thesis sets it; CPU B_L3 = 3 M, as the thesis estimates it; a GPU without a measured P has no
compute term (decode is memory-bound there by two orders of magnitude).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from helmc.planner.analyze_program import ProgramAnalysis, StageLoad
from helmc.errors import HelmcError
from helmc.hardware.profile import CpuProfile, GpuProfile, HardwareProfile, LinkProfile
from helmc.runtime.kv.options import KV_PAGE_TOKENS, KV_WATERMARK

OBJECTIVES = ("decode", "prefill")
TOKEN_ID_BYTES = 4              # int32 token id returned to the host per sequence and step
# KV_PAGE_TOKENS (thesis 4.2.2: one KV page holds 512 tokens) and KV_WATERMARK (KV may fill 80% of the VRAM left after
# weights): the sessions' defaults, runtime/kv/options.py.
KV_PREFETCH_PAGES = 2           # the page being attended and the one being prefetched (thesis 4.2.3)
L3_TO_DRAM_RATIO = 3.0          # thesis 4.1.2: B_L3 estimated as 3 x M
PREFILL_CHUNK_TOKENS = 512      # the GPU runs a prompt in chunks of this many tokens: activations stay bounded
KV_SCORE_TILE_BYTES = 32 << 20  # the GPU KV cache's prefill score tile (runtime/kv/cache_gpu.py)


@dataclass(frozen=True)
class Workload:
    """W = (S, T_out, B) of thesis Algorithm 2, the objective and where KV of GPU blocks lives."""
    prompt_len: int = 128
    output_len: int = 128
    batch: int = 1
    objective: str = "decode"
    kv_offload: bool = True
    stream_prefill: bool = True     # prefill CPU blocks on the GPU, their weights streamed over PCIe
    hybrid: bool = True             # decode may stream some host blocks to the GPU while the CPU computes others
    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS   # the GPU's prefill chunk (its activations are planned)
    # Every prompt in whole chunks of prefill_chunk_tokens, however short the workload's: a mixture of experts, whose
    # experts are read (host ones across PCIe, quantized ones dequantized) once per chunk, so a 2048-token prompt
    # in a bundle planned for 128-token prompts does not read them 16 times. Activations are planned for the chunk.
    whole_chunks: bool = False

    def __post_init__(self):
        if self.prompt_len < 1 or self.output_len < 1 or self.batch < 1:
            raise HelmcError(f"workload: prompt_len, output_len and batch expected >= 1, found "
                             f"{self.prompt_len}, {self.output_len}, {self.batch}")
        if self.objective not in OBJECTIVES:
            raise HelmcError(f"workload: objective expected one of {OBJECTIVES}, found {self.objective!r}")

    @property
    def total_context(self) -> int:
        """KV must hold the prompt and every generated token."""
        return self.prompt_len + self.output_len

    @property
    def decode_context(self) -> float:
        """Mean context over the decode steps: the per-token time of eq. 4.7 averaged over the output."""
        return self.prompt_len + self.output_len / 2


@dataclass(frozen=True)
class DeviceRates:
    """The denominators of eqs. 4.10, 4.13 and 4.14 for one device."""
    mem_gbs: float                 # M
    compute_gflops: float          # P (0: no compute term)
    eta_compute: float = 1.0
    eta_memory: float = 1.0
    l3_bytes: int = 0              # C_L3 (0: no cache blending)
    l3_gbs: float = 0.0            # B_L3
    block_overhead_ms: float = 0.0 # delta: per block per token beyond the roofline
    step_overhead_ms: float = 0.0  # sigma: per token, charged to the stage that holds the lm_head
    attention_gbs: float = 0.0     # KV read of the device's decode attention kernel (0: eq. 4.14's blend of M, B_L3)
    overhead_block_bytes: int = 0  # delta is per block of these weight bytes, scaled by a block's own (0: per block)

    @classmethod
    def of_cpu(cls, cpu: CpuProfile, block_overhead_ms: float = 0.0,
               weight_bytes: tuple[tuple[str, int], ...] = (), rows: int = 1) -> "DeviceRates":
        """block_overhead_ms: the profile-wide delta, used where the CPU has no calibrated one.
        weight_bytes: the model's linear bytes per stored type (ProgramAnalysis.linear_bytes_by_type): M is
        then the rate at which helmc's GEMVs read that mix, sum(bytes) / sum(bytes / M_type).
        rows: sequences per decode step (a batch): M of GEMVs of that many rows (CpuProfile.read_gbs)."""
        M = cpu.stream_gbs * cpu.read_gbs("float16", rows) / cpu.read_gbs("float16")
        if weight_bytes and sum(n for _, n in weight_bytes) > 0:
            M = sum(n for _, n in weight_bytes) / sum(n / cpu.read_gbs(t, rows) for t, n in weight_bytes)
        return cls(mem_gbs=M, compute_gflops=cpu.fp32_gflops if cpu.fp32_gflops > 0 else M,
                   eta_compute=cpu.eta_compute, eta_memory=cpu.eta_memory, l3_bytes=cpu.l3_bytes,
                   l3_gbs=cpu.l3_gbs if cpu.l3_gbs > 0 else L3_TO_DRAM_RATIO * M,
                   block_overhead_ms=block_overhead_ms if cpu.block_overhead_ms is None else cpu.block_overhead_ms,
                   step_overhead_ms=cpu.step_overhead_ms or 0.0, attention_gbs=cpu.attention_read_gbs,
                   overhead_block_bytes=cpu.overhead_block_bytes if cpu.block_overhead_ms is not None else 0)

    @classmethod
    def of_gpu(cls, gpu: GpuProfile, block_overhead_ms: float = 0.0,
               weight_bytes: tuple[tuple[str, int], ...] = ()) -> "DeviceRates":
        """block_overhead_ms: the profile-wide delta, used where the GPU has no calibrated one.
        weight_bytes: the model's weight bytes per stored type (linears and lm_head): M is then the rate at which
        helmc's GPU GEMVs read that mix (GpuProfile.read_gbs; hbm_gbs for a type the profile did not measure)."""
        M = gpu.hbm_gbs
        if weight_bytes and gpu.gemv_reads and sum(n for _, n in weight_bytes) > 0:
            M = sum(n for _, n in weight_bytes) / sum(n / gpu.read_gbs(t) for t, n in weight_bytes)
        return cls(mem_gbs=M, compute_gflops=gpu.fp16_tflops * 1e3, eta_compute=gpu.eta_compute,
                   eta_memory=gpu.eta_memory,
                   block_overhead_ms=block_overhead_ms if gpu.block_overhead_ms is None else gpu.block_overhead_ms,
                   step_overhead_ms=gpu.step_overhead_ms or 0.0)

    @classmethod
    def of_device(cls, hw: HardwareProfile, name: str, with_overheads: bool = True,
                  analysis: ProgramAnalysis | None = None, rows: int = 1) -> "DeviceRates":
        """Rates of hw's "cpu" or "gpu" with that device's own deltas (or none: the bare roofline); with
        `analysis`, the CPU's M for that model's weight types; rows: sequences per decode step."""
        if name == "cpu":
            rates = cls.of_cpu(hw.cpu, hw.block_overhead_ms, analysis.linear_bytes_by_type if analysis else (), rows)
        else:
            rates = cls.of_gpu(hw.device(name), hw.block_overhead_ms,
                               analysis.linear_bytes_by_type + analysis.head_bytes_by_type if analysis else ())
        if with_overheads:
            return rates
        return dataclasses.replace(rates, block_overhead_ms=0.0, step_overhead_ms=0.0)


def rate_fallbacks(hw: HardwareProfile, w: Workload | None = None) -> tuple[str, ...]:
    """Which thesis fallbacks the cost model used for this profile (and workload), for the plan table."""
    out = []
    if w is not None and w.batch > 1 and w.objective == "decode" and not any(r.rows > 1 for r in hw.cpu.gemv_reads):
        out.append(f"CPU decode of {w.batch} sequences at the one-row GEMVs' read rate (the profile has no batched "
                   "GEMV figures; helmc profile measures them)")
    if hw.cpu.fp32_gflops <= 0:
        out.append("CPU P_dec = M (fp32 rate not measured; thesis 4.1.2)")
    if hw.cpu.l3_gbs <= 0:
        out.append("CPU B_L3 = 3 M (L3 bandwidth not measured; thesis 4.1.2)")
    if hw.cpu.attention_read_gbs <= 0:
        out.append("CPU decode attention at eq. 4.14's blend of M and B_L3 (helmc's attention kernel's KV read not "
                   "measured; helmc profile measures it)")
    if hw.cpu.host_read_gbs <= 0:
        out.append("CPU M from one contiguous buffer (helmc's GEMV read rate not measured)")
    if hw.gpu is not None and not hw.gpu.gemv_reads:
        out.append("GPU M = hbm_gbs for every weight type (helmc's GPU GEMVs not measured; helmc profile measures "
                   "them)")
    if hw.gpu is not None and hw.gpu.fp16_tflops <= 0:
        out.append("GPU compute term dropped (fp16 rate not measured)")
    if hw.link is not None and not hw.link.has_concurrent:
        out.append("no hybrid decode considered: the profile has no DRAM + PCIe concurrent rate (helmc profile "
                   "measures it on the machine)")
    # A figure the profile measured again and still found implausible: the plan rests on it all the same, and says so.
    out += [f"the profile marks a figure doubtful (measure again: helmc profile): {d}" for d in hw.doubtful]
    for name, dev in (("CPU", hw.cpu), ("GPU", hw.gpu)):
        if dev is not None and dev.block_overhead_ms is None:
            out.append(f"{name} per-block overhead delta = {hw.block_overhead_ms:g} ms, the profile-wide figure "
                       f"(not calibrated on helmc's own stage: helmc calibrate)")
    return tuple(out)


def _ms(amount: float, rate_per_s: float) -> float:
    return amount / rate_per_s * 1e3 if rate_per_s > 0 else 0.0


def roofline_ms(flops: float, nbytes: float, rates: DeviceRates, mem_gbs: float | None = None) -> float:
    """max(F / (P eta_c), W / (M eta_m)); the compute term vanishes where P is unknown."""
    M = rates.mem_gbs if mem_gbs is None else mem_gbs
    t_mem = _ms(nbytes, M * 1e9 * rates.eta_memory)
    t_flop = _ms(flops, rates.compute_gflops * 1e9 * rates.eta_compute) if rates.compute_gflops > 0 else 0.0
    return max(t_mem, t_flop)


@dataclass(frozen=True)
class StageTime:
    proj_ms: float = 0.0
    attn_ms: float = 0.0
    kv_stream_ms: float = 0.0      # KV pages over PCIe, overlapped with compute
    overhead_ms: float = 0.0       # n_blocks * delta + n_heads * sigma

    @property
    def total_ms(self) -> float:
        # A negative delta (calibrated against another machine's rates) brings the roofline down, never below 0.
        return max(0.0, max(self.proj_ms + self.attn_ms, self.kv_stream_ms) + self.overhead_ms)


def stage_time(a: ProgramAnalysis, load: StageLoad, rates: DeviceRates, w: Workload, *,
               blend_l3: bool, kv_resident_bytes: float | None = None, link: LinkProfile | None = None) -> StageTime:
    """Per-token decode time (objective decode) or time to first token (objective prefill) of one stage.

    kv_resident_bytes: how much of this stage's KV (at the workload's context) stays in device
    memory; the rest streams over `link`. None: all of it is resident."""
    if load.units == 0:
        return StageTime()
    B = w.batch
    if w.objective == "decode":
        tokens = 1
        # A sliding-window block attends over its window, the others over the whole context (Gemma 3 mixes them).
        c_full = w.decode_context
        c_window = min(c_full, a.sliding_window) if a.sliding_window else c_full
        window_share = load.sliding_kv_bytes_per_token / load.kv_bytes_per_token if load.kv_bytes_per_token else 0.0
        c = c_full * (1 - window_share) + c_window * window_share
        attn_flops = B * c * load.attn_flops_per_context_token                    # eq. 4.11
        kv_bytes = B * c * load.kv_bytes_per_token                                # eq. 4.12
    else:
        tokens = w.prompt_len
        S = w.prompt_len
        # Causal prefill: query i attends over i keys, sum_i 4 h_a d_h i = 2 h_a d_h S (S + 1).
        attn_flops = B * load.attn_flops_per_context_token * S * (S + 1) / 2
        kv_bytes = 2 * B * S * load.kv_bytes_per_token                            # written once, read once
    proj_flops = B * tokens * load.block_flops_per_token + B * load.head_flops_per_token  # logits of the last position only
    weight_bytes = load.param_bytes + B * tokens * load.gather_bytes_per_token
    t_proj = roofline_ms(proj_flops, weight_bytes, rates)                             # eq. 4.10
    resident = kv_bytes if kv_resident_bytes is None else min(kv_bytes, kv_resident_bytes)
    streamed = kv_bytes - resident
    m_hat = rates.mem_gbs
    if rates.attention_gbs > 0 and w.objective == "decode":
        # the kernel's measured read over KV >> L3: between two tokens' attention of a layer every block's weights
        # stream through the L3, so its KV is not there to blend in (measured: 0.74 M, where the blend says 1.17 M)
        m_hat = rates.attention_gbs
    elif blend_l3 and kv_bytes > 0 and rates.l3_bytes > 0:
        alpha = min(1.0, rates.l3_bytes / kv_bytes)                                  # eq. 4.14
        m_hat = alpha * rates.l3_gbs + (1 - alpha) * rates.mem_gbs
    # Attention reads every KV byte from device memory: streamed pages too, once staged there. So
    # residency changes only the PCIe term, and more VRAM can never make a split slower.
    t_attn = roofline_ms(attn_flops, kv_bytes, rates, mem_gbs=m_hat) if load.blocks else 0.0   # eq. 4.13
    t_stream = 0.0
    if streamed > 0:
        if link is None:
            raise HelmcError("cost model: KV beyond device memory needs a link profile to stream over")
        t_stream = _ms(streamed, link.h2d_gbs * 1e9)
    return StageTime(proj_ms=t_proj, attn_ms=t_attn, kv_stream_ms=t_stream,
                     overhead_ms=block_overheads_ms(load, rates) + load.heads * rates.step_overhead_ms)


def block_overheads_ms(load: StageLoad, rates: DeviceRates) -> float:
    """delta for each block of the stage: whole per block, or scaled by the blocks' weight bytes where the rates say
    which block size delta was fitted on (the CPU's: its stage reads below its lone GEMVs by time per byte, and a
    quantized block has a third of an fp16 block's bytes)."""
    if rates.overhead_block_bytes > 0:
        return rates.block_overhead_ms * load.block_param_bytes / rates.overhead_block_bytes
    return load.blocks * rates.block_overhead_ms


def comm_time_ms(a: ProgramAnalysis, cpu_units: int, w: Workload, link: LinkProfile | None) -> float:
    """Eq. 4.15 at the CPU->GPU boundary plus the token ids returning from a GPU lm_head."""
    if cpu_units >= a.num_units:
        return 0.0                                                # all on the CPU: no link used
    if link is None:
        raise HelmcError("cost model: a plan with GPU units needs a link profile")
    tokens = w.prompt_len if w.objective == "prefill" else 1
    t = link.latency_us * 1e-3 + _ms(TOKEN_ID_BYTES * w.batch, link.d2h_gbs * 1e9)
    if cpu_units > 0:
        w_act = w.batch * tokens * a.act_bytes_per_token                          # eq. 4.4
        t += link.latency_us * 1e-3 + _ms(w_act, link.h2d_gbs * 1e9)
    return t


@dataclass(frozen=True)
class MemoryNeed:
    """What one device needs for a plan, in bytes, at the workload's full context (S + T)."""
    weights: int = 0
    kv: int = 0               # KV kept on this device (host: CPU blocks, plus GPU blocks' pages when offloaded)
    workspace: int = 0        # activations (and on the GPU the KV staging pages when KV is offloaded)
    reserve: int = 0          # CUDA context and runtime / host runtime process
    available: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.workspace + self.reserve

    @property
    def shortfall(self) -> int:
        return max(0, self.total - self.available)

    @property
    def fits(self) -> bool:
        return self.total <= self.available


def shortfall_text(host: MemoryNeed, dev: MemoryNeed) -> str:
    """What is missing where, e.g. 'VRAM short by 1.20 GiB (needs 8.20 GiB, usable 7.00 GiB)'."""
    gib = lambda n: f"{n / 2 ** 30:.2f} GiB"                           # noqa: E731
    parts = []
    if dev.shortfall:
        parts.append(f"VRAM short by {gib(dev.shortfall)} (needs {gib(dev.total)}, usable {gib(dev.available)})")
    if host.shortfall:
        parts.append(f"host RAM short by {gib(host.shortfall)} (needs {gib(host.total)}, free {gib(host.available)})")
    return "; ".join(parts)


def kv_staging_bytes(a: ProgramAnalysis, gpu: StageLoad, batch: int) -> int:
    """Offloaded KV still needs VRAM beyond its page pool: the GPU cache's own workspace (staging for
    pages read back from the host, split partials, prefill score tiles), as runtime/kv/cache_gpu.py
    allocates it."""
    if not gpu.blocks:
        return 0
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    return KVCacheGPU.workspace_bytes(a.num_heads, a.num_kv_heads, a.head_dim, KV_PAGE_TOKENS,
                                      score_budget_bytes=KV_SCORE_TILE_BYTES, caches=batch)


def prefill_staging_bytes(a: ProgramAnalysis, cpu: StageLoad, gpu: StageLoad, w: Workload) -> int:
    """VRAM that holds one CPU block's weights while the prompt runs through it on the GPU: with
    stream_prefill the CPU blocks' prefill moves to the GPU, each block's weights crossing PCIe once
    per prompt instead of the CPU computing S tokens through them."""
    if not (w.stream_prefill and cpu.blocks and gpu.units):
        return 0
    return max(u.stored_bytes for u in a.units if u.kind == "block")


def quantized_prefill_scratch_bytes(a: ProgramAnalysis, cpu: StageLoad, gpu: StageLoad, computed: StageLoad,
                                    w: Workload) -> int:
    """VRAM the GPU's prefill functions hold for quantized weights dequantized to fp16 (lower_quantized_gpu: one
    reused buffer per function), kept by the VM's pooled allocator once a prompt has run: wherever the GPU runs a
    block's prefill (its own blocks, streamed ones, or the CPU blocks' streamed prefill), and, serving several
    sequences, the head's when it is quantized and on the GPU (its prefill function takes their last rows)."""
    blocks_on_gpu = computed.blocks or prefill_staging_bytes(a, cpu, gpu, w)
    head = a.quantized_head_scratch_bytes if gpu.heads and w.batch > 1 else 0
    return (a.quantized_prefill_scratch_bytes if blocks_on_gpu else 0) + head


def prefill_prompt_bytes(a: ProgramAnalysis, prompt_tokens: int, batch: int = 1) -> int:
    """VRAM the streamed prefill holds for the whole prompt while it runs one CPU block over every
    chunk, as runtime/prefill_stream.py allocates it (hidden state, the block's K/V, cos and sin,
    each ARENA_ALIGN-aligned in the one buffer it asks for)."""
    from helmc.runtime.prefill_stream import aligned_bytes, prompt_buffer_sizes
    sizes = prompt_buffer_sizes(prompt_tokens, a.hidden_size, a.num_kv_heads, a.head_dim, a.rope_width or a.head_dim)
    return batch * sum(aligned_bytes(n) for n in sizes)          # each prompt its own buffers


def prefill_lent_bytes(a: ProgramAnalysis, cpu: StageLoad, gpu: StageLoad, w: Workload) -> int:
    """What the streamed prefill borrows: one block's weights plus the prompt's buffers. It runs before
    any GPU block writes KV (a new request), so it borrows the empty KV page pool when the GPU stage
    has blocks, and the pool only has to be at least this big (runtime/kv_cache_gpu.lend_empty_pool)."""
    staging = prefill_staging_bytes(a, cpu, gpu, w)
    return staging + prefill_prompt_bytes(a, w.prompt_len, w.batch) if staging else 0


# The runtime lends the ring when its aligned slots hold the loan's aligned buffers; the plan counts the ring as
# holding it only with this much to spare (alignment of a block's tensors and the prompts' buffers, a few KiB).
RING_LOAN_SLACK_BYTES = 1 << 20


def ring_hosts_loan(ring_bytes: int, lent: int) -> bool:
    """Whether a hybrid plan's staging ring holds the streamed prefill's loan: the ring is idle between decode
    steps, when prompts prefill (runtime/gpu_session.load_gpu_parts lends it), so the loan needs no VRAM of its
    own beside the pages. Taken for plans of several sequences (serving) only: one sequence's prompt buffers
    borrow the empty page pool, the ring its block staging (pool_loan_bytes)."""
    return bool(ring_bytes) and bool(lent) and ring_bytes >= lent + RING_LOAN_SLACK_BYTES


def pool_loan_bytes(a: ProgramAnalysis, cpu: StageLoad, gpu: StageLoad, w: Workload, ring_bytes: int) -> int:
    """What of the streamed prefill's loan the KV page pool holds (one sequence) or keeps beside its pages
    (several). A hybrid ring, idle between decode steps when prompts prefill, lends instead: all of the loan
    where it holds it and the plan serves several sequences (ring_hosts_loan); else the block's staging where
    it holds one block (runtime/gpu_session.load_gpu_parts: StreamedPrefill's lend_arena), the pool keeping
    only the prompts' buffers. The pool then needs no block of weights as its floor: at 7 GiB that is one more
    resident block."""
    lent = prefill_lent_bytes(a, cpu, gpu, w)
    staging = prefill_staging_bytes(a, cpu, gpu, w)
    if w.batch > 1 and ring_hosts_loan(ring_bytes, lent):
        return 0
    if staging and ring_bytes >= staging:
        return lent - staging
    return lent


def gpu_prefill_tokens(w: Workload) -> int:
    """Tokens the GPU runs at once in prefill: the prompt, in chunks of w.prefill_chunk_tokens (a whole chunk
    whatever the prompt where w.whole_chunks)."""
    return w.prefill_chunk_tokens if w.whole_chunks else min(w.prompt_len, w.prefill_chunk_tokens)


def gpu_activation_bytes(a: ProgramAnalysis, computed: StageLoad, w: Workload) -> int:
    """Peak live activations of the blocks the GPU computes: a prefill step's or a decode step's, the larger.
    A prefill step holds at most gpu_prefill_tokens(w) rows whatever the batch: one prompt's chunk, or several
    newcomers' chunks sharing a step up to that many rows (runtime/serve/batch_model.py prefill_many, where the GPU
    stage runs them sequence by sequence); a batched decode step holds one row per sequence."""
    return max(a.workspace_bytes(computed, 1, gpu_prefill_tokens(w)), a.workspace_bytes(computed, w.batch, 1))


def whole_pages(tokens: int) -> int:
    """Tokens of KV actually allocated: the caches allocate whole pages."""
    return -(-tokens // KV_PAGE_TOKENS) * KV_PAGE_TOKENS


def sliding_kv_cap(a: ProgramAnalysis, w: Workload) -> int:
    """Tokens of KV a sliding-window block of the CPU cache holds at most, whatever the context: its window and
    one page more, as the window straddles page boundaries (runtime/kv/layer_kinds.py), and while the prompt is
    prefilled in one step, the prompt's rows beside the window's."""
    return whole_pages(a.sliding_window + w.prompt_len - 1) + KV_PAGE_TOKENS


def sliding_kv_tokens(a: ProgramAnalysis, w: Workload, context: int) -> int:
    """Tokens of KV a sliding-window block of the CPU cache holds at `context` (whole pages)."""
    return min(context, sliding_kv_cap(a, w)) if a.sliding_window else context


def cpu_kv_bytes(a: ProgramAnalysis, load: StageLoad, w: Workload, context: int) -> int:
    """KV bytes of one sequence of the blocks of `load` in the CPU cache at `context` tokens (whole pages): the
    global blocks' every token, the sliding-window blocks' sliding_kv_tokens. (The GPU cache keeps every page of
    every layer: its blocks count the whole context.)"""
    full = load.kv_bytes_per_token - load.sliding_kv_bytes_per_token
    return full * context + load.sliding_kv_bytes_per_token * sliding_kv_tokens(a, w, context)


def memory_needs(a: ProgramAnalysis, hw: HardwareProfile, cpu: StageLoad, gpu: StageLoad, w: Workload,
                 context: int | None = None, streamed: StageLoad | None = None,
                 ring_bytes: int = 0) -> tuple[MemoryNeed, MemoryNeed]:
    """(host, gpu) needs of a split at `context` tokens (default: the workload's S + T) in whole KV
    pages, eq. 4.16 extended with workspace, reserves and the host side.

    Hybrid decode: `streamed` are the blocks of the host-resident `cpu` that the GPU computes from a staging
    ring of `ring_bytes` in VRAM. Their weights stay in host RAM (counted in `cpu`); their KV is the GPU
    cache's, as a GPU block's."""
    s = streamed or StageLoad()
    c = whole_pages(w.total_context if context is None else context)
    B = w.batch
    kv_gpu_blocks = B * c * (gpu.kv_bytes_per_token + s.kv_bytes_per_token)
    host_kv = B * cpu_kv_bytes(a, cpu - s, w, c) + (kv_gpu_blocks if w.kv_offload else 0)
    host = MemoryNeed(weights=a.held_bytes(cpu), kv=host_kv, workspace=a.workspace_bytes(cpu, B, w.prompt_len),
                      reserve=hw.host_reserve_bytes, available=hw.cpu.ram_free_bytes)
    if gpu.units == 0:
        return host, MemoryNeed(available=hw.usable_vram_bytes)
    computed = gpu + s                        # every block the GPU runs, resident or streamed
    gpu_ws = (gpu_activation_bytes(a, computed, w) + kv_staging_bytes(a, computed, B) + ring_bytes
              + quantized_prefill_scratch_bytes(a, cpu, gpu, computed, w))
    lent = pool_loan_bytes(a, cpu, gpu, w, ring_bytes)    # hybrid: the idle ring lends the rest
    gpu_kv = 0 if w.kv_offload else kv_gpu_blocks
    if (gpu.blocks or s.blocks) and B > 1:
        # Serving: newcomers' prompts stream while the running sequences hold their pages, so the loan (if any:
        # none in a hybrid ring that holds it) is VRAM of its own beside the pages (runtime/serve/batch_model.py
        # carves it out of the pool); with offload each sequence's cache needs two pages (one resident, one
        # being written).
        floor = B * 2 * KV_PAGE_TOKENS * (gpu.kv_bytes_per_token + s.kv_bytes_per_token) if w.kv_offload else 0
        gpu_kv = max(gpu_kv, floor) + lent
    elif gpu.blocks or s.blocks:
        gpu_kv = max(gpu_kv, lent)            # the page pool doubles as the streamed prefill's buffers
    else:
        gpu_ws += lent                        # no page pool to borrow: the GPU holds only the head
    dev = MemoryNeed(weights=a.held_bytes(gpu), kv=gpu_kv, workspace=gpu_ws,
                     reserve=hw.gpu_reserve_bytes, available=hw.usable_vram_bytes)
    return host, dev


def max_context(a: ProgramAnalysis, hw: HardwareProfile, cpu: StageLoad, gpu: StageLoad, w: Workload,
                streamed: StageLoad | None = None, ring_bytes: int = 0) -> int:
    """Longest prompt + output the split can hold: KV of CPU blocks in host RAM; KV of GPU blocks (and
    streamed ones) in pinned host RAM when offloaded, else in VRAM; in whole pages; capped at
    max_position_embeddings. 0: not even the weights fit."""
    s = streamed or StageLoad()
    host0, gpu0 = memory_needs(a, hw, cpu, gpu, w, context=0, streamed=s, ring_bytes=ring_bytes)
    B = w.batch
    gpu_kv_tok = gpu.kv_bytes_per_token + s.kv_bytes_per_token
    if host0.total > host0.available or gpu0.total > gpu0.available:
        return 0
    fit = _host_kv_fit(a, cpu - s, w, gpu_kv_tok if w.kv_offload else 0, host0.available - host0.total)
    if gpu.units and not w.kv_offload and gpu_kv_tok:
        # KV at context c needs max(c * per_token, the prefill's loan): the loan already fits; serving (B > 1)
        # holds the loan beside the pages (memory_needs).
        beside = pool_loan_bytes(a, cpu, gpu, w, ring_bytes) if B > 1 and (gpu.blocks or s.blocks) else 0
        gpu_fit = (gpu0.available - (gpu0.total - gpu0.kv) - beside) // (B * gpu_kv_tok)
        fit = gpu_fit if fit is None else min(fit, gpu_fit)
    if fit is None:
        return a.max_position_embeddings
    return int(min(a.max_position_embeddings, fit // KV_PAGE_TOKENS * KV_PAGE_TOKENS))


def _host_kv_fit(a: ProgramAnalysis, cpu: StageLoad, w: Workload, offloaded_tok: int, room: int) -> int | None:
    """Most tokens of context whose host KV (the CPU blocks' `cpu`, the offloaded GPU blocks' `offloaded_tok` a
    token) fits `room` bytes; None: no host KV grows with the context. Sliding-window blocks grow only up to
    their cap (sliding_kv_tokens), every other block's KV by the token."""
    B = w.batch
    full = B * (cpu.kv_bytes_per_token - cpu.sliding_kv_bytes_per_token + offloaded_tok)
    sliding = B * cpu.sliding_kv_bytes_per_token
    if not full and not sliding:
        return None
    cap = sliding_kv_cap(a, w)
    if (full + sliding) * cap >= room:
        return room // (full + sliding)
    return (room - sliding * cap) // full if full else None


def kv_page_pool_bytes(gpu_need: MemoryNeed) -> int:
    """The GPU KV page pool (Plan.memory.gpu_kv_pool_bytes): what the plan leaves free plus the pool's floor.
    Invariant: never below gpu_need.kv, which memory_needs makes at least the streamed prefill's loan,
    so the runtime's pool of these bytes holds the loan (runtime/gpu_session.kv_pool_bytes)."""
    pool = max(0, gpu_need.available - gpu_need.total) + gpu_need.kv
    assert pool >= gpu_need.kv, (pool, gpu_need)
    return pool


def gpu_kv_resident_bytes(gpu_need: MemoryNeed) -> float:
    """VRAM that offloaded KV pages may stay in before eviction (thesis 4.2.2 watermark): the
    KV_WATERMARK share of the page pool, the KV the timing model counts as resident. Not the pool's
    size (kv_page_pool_bytes): the loan borrows the whole pool, before any page is written."""
    return kv_page_pool_bytes(gpu_need) * KV_WATERMARK
