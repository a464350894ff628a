"""Host-memory reads with helmc's own compiled kernels, on every core (the profile kit's profile_kernels.so).

  dram_gbs       helmc's stream-read kernel (schedules/cpu/stream_read.py) over a buffer >= 4 x L3;
  l3_gbs         the same kernel re-reading half the L3;
  gemv_reads     per weight type: one decode step's GEMV launches over a transformer block, as the CPU stage makes
                 them (fused q/k/v, o, fused gate/up SwiGLU, down; quantized types one launch per linear, or
                 q/k/v and gate/up in one launch each where the stage fuses them), over copies of the block's
                 weights whose total is >= 4 x L3, so every pass reads DRAM;
  host_read_gbs  the fp16 one: M of the cost model (what a CPU block streams);
  gemm_gflops    helmc's prefill GEMM over a 128-token chunk: P on the CPU (the cost model's compute term);
  attention_gbs  helmc's decode-attention kernel over layers of 32K-token fp16 KV >= 4 x L3 (the cost model's rate
                 for a CPU block's attention at long contexts).

The read buffer and every weight copy lie in one allocation (a VM guest's bandwidth differs between
allocations, benchmarks/bench_cpu_gemv.py's WeightArena); bytes are filled with 0x3c before timing: as fp16,
bf16 and the quantized blocks' scales that is a normal number, so no pass runs into denormals. Each figure is
the median of the timed passes after one warm-up (a shared machine's best pass says what it did once); the passes
come in rounds over the stream reads and every GEMV type, so a burst of a slow host lands in a few passes of many
figures, not in all of one figure's. A figure still implausible against another of the same run (recheck: a stream
read below a GEMV's read of the same memory, an L3 read below the DRAM read) is measured again, the best kept, and
said doubtful if it stays so. Rounds of one figure that disagree (the DRAM read's or a GEMV's round medians more than
SPREAD_LIMIT apart) say the host was busy or unsteady: every round is measured again, and the profile refused if
they never agree.
Needs NumPy and the TVM runtime only.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

from helmc.hardware.kit import FLOAT_ROLES, FLOAT_TYPES, FUSED_LINEARS, KERNELS_LIB, ProfileKit
from helmc.hardware.profile import KernelRead

ALIGN = 4096
FILL = 0x3C
MIN_CYCLE_BYTES = 256 << 20       # weight copies per pass at least this, and at least 4 x L3


def quant_row_bytes(qtype: str, k: int) -> int:
    from helmc.model.weight_types import WEIGHT_TYPES
    return WEIGHT_TYPES[qtype].tensor_bytes(k)


def weight_bytes(kit: ProfileKit, weight_type: str) -> dict[str, tuple[tuple[int, int], str]]:
    """role -> ((rows, bytes per row), storage dtype) of one block's linears in `weight_type`."""
    out = {}
    for role, (n, k) in kit.block.linear_shapes().items():
        if weight_type in FLOAT_TYPES:
            out[role] = ((n, k), weight_type)
        else:
            out[role] = ((n, quant_row_bytes(weight_type, k)), "uint8")
    return out


def block_bytes(kit: ProfileKit, weight_type: str) -> int:
    return sum(n * (k * 2 if dt != "uint8" else k) for (n, k), dt in weight_bytes(kit, weight_type).values())


def cycle_bytes(kit: ProfileKit) -> int:
    """Weight bytes each pass reads: enough that the L3 holds under a quarter of them."""
    return max(MIN_CYCLE_BYTES if not kit.quick else 0, 4 * kit.l3_bytes)


def copies(kit: ProfileKit, weight_type: str) -> int:
    return max(1, -(-cycle_bytes(kit) // block_bytes(kit, weight_type)))


def arena_bytes(kit: ProfileKit) -> int:
    per_type = [copies(kit, t) * (block_bytes(kit, t) + 8 * ALIGN) for t in kit.weight_types]
    attention = [attention_copies(kit) * (attention_layer_bytes(kit) + 2 * ALIGN)] if kit.attention_name else []
    return max([kit.read_elements * 4] + per_type + attention)


# Tokens of each layer's KV the attention read runs over: long, so one call's fixed cost (its fork/join) is a
# sliver of its time and the figure is the kernel's read rate (the per-block delta carries fixed costs). The quick
# kit's block has 4x fewer KV heads: 16K tokens there are 16 MiB a call.
ATTENTION_CONTEXT, QUICK_ATTENTION_CONTEXT = 32768, 16384


def attention_context(kit: ProfileKit) -> int:
    return QUICK_ATTENTION_CONTEXT if kit.quick else ATTENTION_CONTEXT


def attention_layer_bytes(kit: ProfileKit) -> int:
    """One layer's fp16 K and V at attention_context tokens."""
    return 2 * kit.block.kv_heads * attention_context(kit) * kit.block.head_dim * 2


def attention_copies(kit: ProfileKit) -> int:
    return max(1, -(-cycle_bytes(kit) // attention_layer_bytes(kit)))


class Arena:
    """One allocation for the DRAM read and every weight copy, placed from the start, 4 KiB-aligned.

    pinned: page-locked memory (CuPy), where the runtime keeps CPU blocks when a GPU is present (their prefill and
    hybrid decode stream them to the GPU); else ordinary anonymous pages, as the runtime's CPU-only weights."""

    def __init__(self, nbytes: int, pinned: bool = False):
        if pinned:
            import cupyx
            self.region = cupyx.empty_pinned((nbytes,), np.uint8)
        else:
            from helmc.runtime.weights.host_memory import huge_page_buffer
            self.region = huge_page_buffer(nbytes, advise=False)
        self.pinned = pinned
        self.region.fill(FILL)                                  # every page touched before any timing
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def tensor(self, shape: tuple[int, ...], dtype: str):
        from helmc.runtime.weights.host_memory import cpu_tensor_over, tensor_bytes
        start = -(-self.used // ALIGN) * ALIGN
        self.used = start + tensor_bytes(shape, dtype)
        if self.used > self.region.nbytes:
            raise ValueError(f"profile arena: {self.used} bytes expected to fit, found {self.region.nbytes}")
        return cpu_tensor_over(self.region[start:], shape, dtype)


class KitLibrary:
    """profile_kernels.so loaded, with the small input and output vectors the GEMVs need."""

    def __init__(self, kit_dir: str, kit: ProfileKit):
        import tvm.runtime
        from helmc.runtime.tvm_tensors import available_cpu_count, use_cpu_threads
        use_cpu_threads(available_cpu_count())       # every core, as the session; TVM's default is half on x86
        self.kit = kit
        self.lib = tvm.runtime.load_module(os.path.join(kit_dir, KERNELS_LIB))
        self.dev = tvm.runtime.cpu()

    def vector(self, shape: tuple[int, ...], value: float = 0.01):
        from helmc.runtime.tvm_tensors import tensor_from_numpy
        return tensor_from_numpy(np.full(shape, value, np.float32), "float32", self.dev)


class GemvPass:
    """One decode step's GEMV launches over every copy of a block's weights of one type; run() is one pass."""

    def __init__(self, lib: KitLibrary, arena: Arena, weight_type: str, rows: int = 1):
        kit, b = lib.kit, lib.kit.block
        H, I, Q, KV = b.hidden, b.ffn, b.q_dim, b.kv_dim
        arena.reset()
        layout = weight_bytes(kit, weight_type)
        self.copies = copies(kit, weight_type)
        self.nbytes = self.copies * block_bytes(kit, weight_type)
        self.weight_type = weight_type
        blocks = [{role: arena.tensor(shape, dt) for role, (shape, dt) in layout.items()} for _ in range(self.copies)]
        calls = []
        m = self.rows = rows                          # decode rows per call: one token, or a batched step's
        if weight_type in FLOAT_TYPES:
            f = {role: lib.lib[kit.kernel(weight_type, role, m)] for role in FLOAT_ROLES}
            x, xq, xi = lib.vector((m, H)), lib.vector((m, Q)), lib.vector((m, I))
            yq, yk, yv, yh, yi = (lib.vector((m, n), 0.0) for n in (Q, KV, KV, H, I))
            for w in blocks:
                calls += [(f["qkv"], (x, w["q"], w["k"], w["v"], yq, yk, yv)), (f["o"], (xq, w["o"], yh)),
                          (f["swiglu"], (x, w["gate"], w["up"], yi)), (f["down"], (xi, w["down"], yh))]
        else:
            roles = kit.gemv_roles(weight_type, m)
            f = {role: lib.lib[kit.kernel(weight_type, role, m)] for role in roles}
            x, xq, xi = lib.vector((m, H)), lib.vector((m, Q)), lib.vector((m, I))
            ys = {role: lib.vector((m, n), 0.0) for role, (n, _) in kit.block.linear_shapes().items()}
            inputs = {"q": x, "k": x, "v": x, "o": xq, "gate": x, "up": x, "down": xi}
            for w in blocks:
                for role in roles:
                    linears = FUSED_LINEARS.get(role, (role,))
                    calls.append((f[role], (inputs[linears[0]], *(w[n] for n in linears), *(ys[n] for n in linears))))
        self.calls = calls
        self.blocks = blocks                          # role -> weight tensor, per copy
        self.check = (yh if weight_type in FLOAT_TYPES else ys["down"])

    def run(self) -> None:
        for fn, args in self.calls:
            fn(*args)


class AttentionPass:
    """One decode step's attention over layers of KV at attention_context tokens, as the CPU stage calls helmc's
    decode-attention kernel (one call per layer, K and V [h_kv, tokens, d] fp16); run() is one pass over copies
    whose total is >= 4 x L3, so every pass reads DRAM, as a real step does (the blocks' weights stream through
    the L3 between one token's attention of a layer and the next's)."""

    def __init__(self, lib: KitLibrary, arena: Arena):
        kit, b = lib.kit, lib.kit.block
        arena.reset()
        n = attention_context(kit)
        self.copies = attention_copies(kit)
        self.nbytes = self.copies * attention_layer_bytes(kit)
        fn = lib.lib[kit.attention_name]
        q, self.check = lib.vector((b.heads, b.head_dim)), lib.vector((b.heads, b.head_dim), 0.0)
        scale = 1.0 / float(np.sqrt(b.head_dim))
        self.calls = [(fn, (q, arena.tensor((b.kv_heads, n, b.head_dim), "float16"),
                            arena.tensor((b.kv_heads, n, b.head_dim), "float16"), 0, n, scale, self.check))
                      for _ in range(self.copies)]

    def run(self) -> None:
        for fn, args in self.calls:
            fn(*args)


# A figure under this share of a rate it bounds (a plain stream read against a GEMV's read of the same memory) was
# taken in a disturbance; kernels differ by less (the 2-core EPYC's q8_0 GEMV reads 1.1 x its stream read: two cores
# do not saturate its DRAM, and the GEMV prefetches), the disturbances seen by far more (11.7 against 89).
PLAUSIBLE_SHARE = 0.75
RETRIES = 3
RETRY_PAUSE_S = 1.0               # a slow host's bursts last a second or so: a retry at once would land in the same


def recheck(what: str, gbs: float, bound: float, again, progress=lambda m: None) -> tuple[float, str]:
    """(gbs, "") when gbs >= PLAUSIBLE_SHARE x bound (a rate measured in the same run that gbs cannot fall below);
    else again() (a new measurement, GB/s) up to RETRIES times, the best kept, and (best, why it is doubtful) if it
    stays below."""
    for i in range(RETRIES):
        if gbs >= PLAUSIBLE_SHARE * bound:
            return gbs, ""
        progress(f"{what} {gbs:.1f} GB/s is implausible against {bound:.1f}: measuring it again ({i + 1} of {RETRIES})")
        time.sleep(RETRY_PAUSE_S)
        gbs = max(gbs, again())
    if gbs >= PLAUSIBLE_SHARE * bound:
        return gbs, ""
    return gbs, (f"{what} {gbs:.1f} GB/s stayed below {PLAUSIBLE_SHARE:.2f} x {bound:.1f} GB/s, which it cannot be "
                 f"below, in {RETRIES} more measurements: taken in a disturbance of the host?")


def median_gbs(nbytes: int, fn, passes: int) -> tuple[float, list[float]]:
    """(median GB/s, every pass's GB/s) of `passes` timed calls after one warm-up."""
    fn()
    rates = []
    for _ in range(passes):
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates), rates


# A quiet host's rounds of one figure agree within a few percent (round medians of 5 passes); a memory-bound job
# beside the profile halves a round's rate for the second or so it runs (53.6 GB/s where the idle host read 94.8:
# 1.77x). 1.5, not less: in a run of the test suite on the 2-core CPU machine, a small 8-row GEMV's rounds read
# 8.6, 10.9 and 11.2 GB/s (1.31x) in each of three measurements.
SPREAD_LIMIT = 1.5
SPREAD_ATTEMPTS = 3               # the rounds measured this many times before the profile is refused


@dataclass(frozen=True)
class RoundSpread:
    """One figure's rounds: each round's median GB/s."""
    what: str
    rounds_gbs: tuple[float, ...]

    @property
    def spread(self) -> float:
        """max / min of the rounds (1.0 for fewer than two; inf where a round read nothing)."""
        if len(self.rounds_gbs) < 2:
            return 1.0
        low = min(self.rounds_gbs)
        return max(self.rounds_gbs) / low if low > 0 else float("inf")

    def describe(self) -> str:
        return (f"{self.what} read {', '.join(f'{r:.1f}' for r in self.rounds_gbs)} GB/s in its rounds "
                f"(max/min {self.spread:.2f} > {SPREAD_LIMIT})")


def unsteady(figures: dict[str, list[float]], limit: float = SPREAD_LIMIT) -> tuple[RoundSpread, ...]:
    """The figures (name -> each round's GB/s) whose rounds disagree by more than limit (max/min), worst first."""
    spreads = [RoundSpread(what, tuple(r)) for what, r in figures.items()]
    return tuple(sorted((x for x in spreads if x.spread > limit), key=lambda x: -x.spread))


def figure_name(key) -> str:
    """A rate's name in the profile: "dram", "l3" or a GEMV's (weight type, rows)."""
    if key in ("dram", "l3"):
        return f"cpu.{key}_gbs"
    t, m = key
    return f"cpu.gemv_reads {t}" + (f" x{m}" if m > 1 else "")


def refuse_unsteady(worst: RoundSpread, attempts: int) -> None:
    from helmc.errors import HelmcError
    raise HelmcError(f"profile: expected a steady host, found {worst.describe()} in each of {attempts} measurements; "
                     f"another job is using the cores or the memory bandwidth: stop it and run `helmc profile` again")


GEMM_TOKENS = 128                 # a prompt chunk: the GEMM's rate at the size prefill runs it


@dataclass(frozen=True)
class HostReads:
    dram_gbs: float
    l3_gbs: float
    gemv_reads: tuple[KernelRead, ...]
    gemm_gflops: float                # helmc's prefill GEMM (fp16 weights) on every core
    notes: tuple[str, ...]
    attention_gbs: float = 0.0        # helmc's decode attention's KV read (0: a kit without the kernel)
    doubtful: tuple[str, ...] = ()    # figures implausible against the others even when measured again (recheck)

    @property
    def host_read_gbs(self) -> float:
        return next((r.gbs for r in self.gemv_reads if r.weight_type == "float16" and r.rows == 1), 0.0)


def _sweeps(lib: KitLibrary, arena: Arena, kit: ProfileKit, streams: dict, rounds: int, passes: int,
            progress) -> dict:
    """{figure key: one list of pass GB/s per round}: the stream reads (streams: key -> (bytes, fn)) and every type's
    GEMVs in `rounds` sweeps. Sweeps, not one figure's rounds back to back: a host's bandwidth drops in bursts of a
    second or so (one profile: fp16 GEMVs 61 GB/s in their 0.1 s of passes, 105 in the DRAM + PCIe window's a few
    seconds later; another: the stream read 11.7 GB/s and the L3 read 14.3 in their 0.1 s at the start, the GEMVs 89
    after), which one figure's back-to-back passes would take whole."""
    rates: dict = {}
    for sweep in range(rounds):
        for key, (nbytes, fn) in streams.items():
            rates.setdefault(key, []).append(median_gbs(nbytes, fn, passes)[1])
        for t in kit.weight_types:
            for m in kit.rows_measured(t):
                g = GemvPass(lib, arena, t, m)
                if sweep == 0:
                    progress(f"host read: helmc's {t} decode GEMVs{f' at {m} rows' if m > 1 else ''} over {g.copies} "
                             f"block copies ({g.nbytes >> 20} MiB)")
                rates.setdefault((t, m), []).append(median_gbs(g.nbytes, g.run, passes)[1])
                if not np.isfinite(g.check.numpy()).all():
                    raise RuntimeError(f"profile: the {t} GEMVs produced non-finite outputs (a kernel bound to wrong "
                                       "shapes?)")
                del g
    return rates


def measure_host_reads(kit_dir: str, kit: ProfileKit, passes: int = 5, progress=lambda m: None,
                       pinned: bool = False, rounds: int = 3) -> HostReads:
    lib = KitLibrary(kit_dir, kit)
    arena = Arena(arena_bytes(kit), pinned)
    read = lib.lib[kit.read_name]
    partial = lib.vector((1024,), 0.0)
    from helmc.runtime.weights.host_memory import cpu_tensor_over
    buf = cpu_tensor_over(arena.region, (kit.read_elements,), "float32")
    l3_fn = lib.lib[kit.l3_read_name]
    l3_buf = cpu_tensor_over(arena.region, (kit.l3_read_elements,), "float32")
    inner = 20                          # repeated reads of one cached buffer per timed pass

    def l3_pass():
        for _ in range(inner):
            l3_fn(l3_buf, partial)
    dram_read = (kit.read_elements * 4, lambda: read(buf, partial))
    l3_read = (kit.l3_read_elements * 4 * inner, l3_pass)
    progress(f"host read: helmc's stream read over {kit.read_elements * 4 >> 20} MiB and {kit.l3_read_elements * 4 >> 20}"
             f" MiB (L3) on {kit.cores} cores, then every type's decode GEMVs, {rounds} rounds")
    for attempt in range(1, SPREAD_ATTEMPTS + 1):
        rounds_of = _sweeps(lib, arena, kit, {"dram": dram_read, "l3": l3_read}, rounds, passes,
                            progress if attempt == 1 else (lambda m: None))
        bad = unsteady({figure_name(k): [statistics.median(r) for r in v] for k, v in rounds_of.items() if k != "l3"})
        if not bad:
            break
        if attempt == SPREAD_ATTEMPTS:
            refuse_unsteady(bad[0], attempt)
        progress(f"host unsteady: {bad[0].describe()}; measuring every round again ({attempt} of "
                 f"{SPREAD_ATTEMPTS - 1})")
        time.sleep(RETRY_PAUSE_S)
    rates = {k: [x for r in v for x in r] for k, v in rounds_of.items()}
    dram, l3 = statistics.median(rates.pop("dram")), statistics.median(rates.pop("l3"))
    reads = [KernelRead(t, round(statistics.median(r), 2), m) for (t, m), r in rates.items()]
    notes = [] if attempt == 1 else [f"cpu: the rounds disagreed (max/min > {SPREAD_LIMIT}); measured {attempt} times"]
    notes += ["cpu: decode GEMV reads (one block's launches as the CPU stage makes them for each type; "
                 f"{kit.block.hidden}x{kit.block.ffn} block, copies >= {cycle_bytes(kit) >> 20} MiB per pass; "
                 "GB/s of weights, at 1 row and at a batched step's rows): "
                 + ", ".join(f"{r.weight_type}{f' x{r.rows}' if r.rows > 1 else ''} {r.gbs:.1f}" for r in reads)]
    attention = 0.0
    if kit.attention_name:
        att = AttentionPass(lib, arena)
        progress(f"host read: helmc's decode attention over {att.copies} layers of {attention_context(kit)} tokens "
                 f"({att.nbytes >> 20} MiB of KV)")
        attention, _ = median_gbs(att.nbytes, att.run, passes)
        if not np.isfinite(att.check.numpy()).all():
            raise RuntimeError("profile: the decode attention produced non-finite outputs")
        notes.append(f"cpu: attention_read_gbs {attention:.1f}, helmc's decode attention over {att.copies} layers' "
                     f"fp16 KV of {attention_context(kit)} tokens each (one call per layer)")
        del att
    # A GEMV's or the attention's read of DRAM cannot beat a plain stream read of it, nor can a read of the L3.
    dram, doubt_dram = recheck("cpu.dram_gbs (helmc's stream read)", dram,
                               max([r.gbs for r in reads if r.rows == 1] + [attention]),
                               lambda: median_gbs(*dram_read, passes)[0], progress)
    l3, doubt_l3 = recheck("cpu.l3_gbs (the stream read from the L3)", l3, dram,
                           lambda: median_gbs(*l3_read, passes)[0], progress)
    notes.insert(0, f"cpu: dram_gbs {dram:.1f} from helmc's stream-read kernel over {kit.read_elements * 4 >> 20} MiB, "
                    f"l3_gbs {l3:.1f} re-reading {kit.l3_read_elements * 4 >> 20} MiB; {kit.isa} kernels, every core, "
                    f"{'pinned' if pinned else 'pageable'} memory; each the median of {rounds} rounds of {passes} "
                    f"passes (a figure measured again when implausible: the best kept)")
    n, k = kit.block.ffn, kit.block.hidden
    arena.reset()
    w = arena.tensor((n, k), "float16")
    x, y = lib.vector((GEMM_TOKENS, k)), lib.vector((GEMM_TOKENS, n), 0.0)
    gemm = lib.lib[kit.gemm_name]
    gflops, _ = median_gbs(2 * GEMM_TOKENS * n * k, lambda: gemm(x, w, y), passes)     # "GB/s" of flops: GFLOP/s
    notes.append(f"cpu: fp32_gflops {gflops:.0f} from helmc's prefill GEMM ({GEMM_TOKENS} tokens x [{n}, {k}] "
                 f"fp16 weights, fp32 accumulation)")
    return HostReads(dram_gbs=round(dram, 2), l3_gbs=round(l3, 2), gemv_reads=tuple(reads), gemm_gflops=round(gflops, 1),
                     notes=tuple(notes), attention_gbs=round(attention, 2),
                     doubtful=tuple(d for d in (doubt_dram, doubt_l3) if d))
