"""The profile's full (Qwen3-8B-block) kit for this CPU, its kernels without the synthetic stages: what its passes
launch and read, and its JSON. Built once per test run and shared (tests/conftest.py's run directory): the timed
host reads (test_host_read.py, run alone) measure with this very kit, so its compile happens here, beside other
tests, not while the host is being timed."""
import dataclasses
import json
import os
import shutil

import pytest

from helmc.errors import HelmcError
from helmc.hardware import host_read as hr
from helmc.hardware.kit import QUANT_FUSED_ROLES, QUANT_ROLES, QUANT_TYPES, ProfileKit, check_kit_runs_here


def _here():
    from helmc.compiler.profile_kit import KitTarget
    from helmc.hardware.measure import cpu_facts
    f = cpu_facts()
    return KitTarget(f.features, f.l3_bytes, f.cores)


def shared_full_kit(tmp_path_factory) -> tuple[str, ProfileKit]:
    """(dir, ProfileKit) of the full kit's kernels for this CPU: the first process of the run to ask builds it."""
    from tests.shared_run import run_lock, shared_dir
    from helmc.compiler.profile_kit import build_kit
    d = os.path.join(shared_dir(tmp_path_factory), "full-kit")
    with run_lock(tmp_path_factory, "full-kit"):
        if os.path.isdir(d):
            return d, ProfileKit.load(d)
        work = d + ".partial"
        shutil.rmtree(work, ignore_errors=True)
        kit = build_kit(work, _here(), stages=False)
        os.replace(work, d)
        return d, kit


@pytest.fixture(scope="module")
def full_kit(tmp_path_factory):
    return shared_full_kit(tmp_path_factory)


def test_quantized_passes_launch_what_the_cpu_stage_launches(full_kit):
    """Where the CPU stage fuses a quantized type's q/k/v and gate/up (quant_gemvs_fuse, lower_linear's "qmulti"),
    the kit's pass times those fused kernels, else one kernel per linear; either way its calls read every weight of
    every copy once, so its byte count is what it reads."""
    from helmc.schedules.cpu.isa import select_isa
    from helmc.schedules.cpu.quant.gemv_int8_multi import gemv_quant_multi_symbol, quant_gemvs_fuse
    kit_dir, kit = full_kit
    b, isa = kit.block, select_isa(_here().features)
    lib, arena = hr.KitLibrary(kit_dir, kit), hr.Arena(hr.arena_bytes(kit))
    for t in QUANT_TYPES:
        for m in kit.rows_measured(t):
            fused = quant_gemvs_fuse(t, isa, m, b.hidden)
            assert kit.gemv_roles(t, m) == (QUANT_FUSED_ROLES if fused else QUANT_ROLES)
            if fused:
                assert kit.kernel(t, "qkv", m) == gemv_quant_multi_symbol(t, (b.q_dim, b.kv_dim, b.kv_dim), b.hidden)
                assert kit.kernel(t, "gate_up", m) == gemv_quant_multi_symbol(t, (b.ffn, b.ffn), b.hidden)
            g = hr.GemvPass(lib, arena, t, m)
            read = [id(a) for _, args in g.calls for a in args]
            weights = [id(w) for blk in g.blocks for w in blk.values()]
            assert sorted(w for w in read if w in set(weights)) == sorted(weights)
            assert len(g.calls) == g.copies * len(kit.gemv_roles(t, m))
    assert any(quant_gemvs_fuse(t, isa, 1, b.hidden) for t in QUANT_TYPES) == (isa.tier == "avx512")


def test_attention_pass_reads_whole_layers_beyond_the_cache(full_kit):
    """The attention pass calls the kernel once per layer copy over its whole context, K and V fp16 [h_kv, n, d]:
    its byte count is what those calls read, and more than the L3 holds, so no pass is served from cache."""
    kit_dir, kit = full_kit
    att = hr.AttentionPass(hr.KitLibrary(kit_dir, kit), hr.Arena(hr.arena_bytes(kit)))
    b, n = kit.block, hr.attention_context(kit)
    assert n == hr.ATTENTION_CONTEXT and len(att.calls) == att.copies
    assert att.nbytes == att.copies * 2 * b.kv_heads * n * b.head_dim * 2 >= max(hr.cycle_bytes(kit), 4 * kit.l3_bytes)
    assert all(args[4] == n and args[1].shape == (b.kv_heads, n, b.head_dim) for _, args in att.calls)


def test_kit_json_round_trip_and_refusals(full_kit, tmp_path):
    kit_dir, kit = full_kit
    kit.save(str(tmp_path))
    assert ProfileKit.load(str(tmp_path)) == kit == ProfileKit.load(kit_dir)
    raw = json.loads(kit.to_json())
    raw["read_elementz"] = 1
    (path := str(tmp_path / "bad")) and os.makedirs(path, exist_ok=True)
    open(os.path.join(path, "profile_kit.json"), "w").write(json.dumps(raw))
    with pytest.raises(HelmcError, match=r"unknown key\(s\) \['read_elementz'\]"):
        ProfileKit.load(path)
    with pytest.raises(HelmcError, match="expected profile_kit.json in"):
        ProfileKit.load(os.path.join(kit_dir, "nowhere"))
    with pytest.raises(HelmcError, match=r"compiled for CPU flags \[.*\] that this CPU lacks"):
        check_kit_runs_here(kit, ("sse2",))
    with pytest.raises(HelmcError, match="expected a role of 'float16' weights"):
        dataclasses.replace(kit, kernels=(dataclasses.replace(kit.kernels[0], role="gate"),))
    mixed = tuple(dataclasses.replace(k, role="q") if k.role == "qkv" and k.weight_type in QUANT_TYPES else k
                  for k in kit.kernels)
    if mixed != kit.kernels:                          # a kit with fused quantized launches: they come whole or not
        with pytest.raises(HelmcError, match=r"GEMVs at 1 rows expected one block's launches in order"):
            dataclasses.replace(kit, kernels=mixed)
    assert not kit.cpu_bundle and kit.synthetic_layers > 0 and not kit.quick
