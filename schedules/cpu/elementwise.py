"""Parallel, vectorised loops for the CPU stage's non-linear PrimFuncs (RMSNorm, q/k norm + RoPE, SwiGLU,
residual adds) after TVM's FuseOps/FuseTIR.

TVM legalises these to serial scalar loops. For decode (one token) they touch a few KB and that is fine;
for a 128-token prefill each is a pass over 2-6 MB on one core while the rest of the machine waits. So:
fuse what inlines (one pass over memory instead of one per op: the SwiGLU's sigmoid, multiply and
multiply become a single loop), then run each remaining block's spatial loops in parallel, with the
innermost chunk vectorised for purely elementwise blocks. Functions whose every spatial domain is static
and small are inlined but stay serial: a thread-pool launch would cost more than the loop.

BATCH INVARIANCE: a batched decode step must give each row the bits its one-row decode gives, and
TVM's LLVM target fuses any multiply and add that meet in one basic block into an FMA (AllowFPOpFusion::Fast).
Left as separate loop nests over intermediate buffers, a small function (one row: the buffers on the stack)
had LLVM forward the products into the adds and fuse them (RoPE's q*cos + rot(q)*sin), a larger one (several
rows: the buffers in the workspace) kept them apart, and the rows differed in their last bit. So every
function, small or not, has its injective producers inlined first: each element is then one expression,
whose a*b + c terms TVM's LowerIntrin makes explicit FMAs, the same for every row count; what stays a separate
block (a reduction) meets its consumers through a division or a square root, never a multiply-add.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base.common_schedules import try_inline
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

PARALLEL_MIN_ELEMENTS = 1 << 15   # below this a static loop stays serial (launch ~ several us)
VECTOR_CHUNK = 64                 # inner elements per vectorised step of an elementwise loop


def _spatial_extent(info) -> int | None:
    """Product of the block's spatial loop extents, or None if any is symbolic."""
    total = 1
    for it in info.iters:
        if it.kind != "S":
            continue
        if not isinstance(it.dom, (int, tirx.IntImm)):
            return None
        total *= int(it.dom)
    return total


class ParallelLoops(CPUScheduleRule):
    """Inline producers, then parallel leading spatial loops of every remaining block."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool):  # noqa: D401 (dlight interface)
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        extents = [_spatial_extent(info) for info in infos]
        infos = try_inline(sch, infos)
        if all(e is not None and e < PARALLEL_MIN_ELEMENTS for e in extents):
            return sch      # inlined (see BATCH INVARIANCE below), serial: a launch would cost more than the loop
        reductions = []
        for info in infos:
            block = info.block_rv
            loops = sch.get_loops(block)
            kinds = info.dom_kind()
            if len(loops) != len(kinds):
                continue
            lead = []
            for loop, kind in zip(loops, kinds):
                if kind != "S":
                    break
                lead.append(loop)
            if not lead:
                continue
            fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
            if info.is_injective():
                outer, inner = sch.split(fused, factors=[None, VECTOR_CHUNK])
                sch.parallel(outer)
                sch.vectorize(inner)
            else:
                sch.parallel(fused)
                r_loops = [loop for loop, kind in zip(loops, kinds) if kind == "R"]
                if r_loops:
                    reductions.append((block, r_loops[0]))
        for block, r_loop in reductions:
            sch.decompose_reduction(block, r_loop)
        return sch


def schedule_elementwise(target: Target) -> tvm.transform.Pass:
    """Module pass: ParallelLoops on every PrimFunc not already scheduled (helmc's kernels are)."""
    del target  # the rule reads Target.current(); the argument documents the dependency at the call site
    return dlight.ApplyDefaultSchedule(ParallelLoops())
