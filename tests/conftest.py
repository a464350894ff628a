"""Shared fixtures: tiny random-weight models in real architectures and their bundles.

Builds are the slow part of the suite (ONNX export + LLVM compile, ~20 s each on 2 cores), so each model and
build option (`tiny.build`: architecture, dtype, shape, batch, quant, CPU-only) is built once per session and
shared; the artifact cache lives in a temporary directory of this run (shared by its xdist workers and
scripts/test.sh's two phases) so the tests exercise real compiles, and a build of another key with the same compiled
stage reuses it from there.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys

import pytest

from helmc.compiler.frame_modules import remember_frames_of_no_module
from tests.shared_run import run_lock, shared_dir


# Every kernel a test writes parses without rescanning each loaded module per stack frame, as `helmc build` and
# `helmc profile`'s kits do (helmc/compiler/frame_modules.py); tests call the schedules' makers directly too.
remember_frames_of_no_module()

# The test tiers. `scripts/test.sh` runs the fast tier (`-m "not slow"`: every layer, one real build + run of a tiny
# model against transformers); `scripts/test.sh --all` (CI) runs every test. A test is in the slow tier when its
# module marks it @pytest.mark.slow or when its node id matches a pattern here; a new test is fast unless it is marked
# or listed. A pattern is a node id, or its start up to a "::" or "[", with * matching anything. What stays fast
# of each family: the session's shared bundles, the host's own ISA tier, one build per layer.
# The rule: the fast tier's summed test time stays <= ~16 min on an uncontended 2-core host (its two xdist workers
# then take ~8, so a loaded host still finishes within 10), measured from a full run's junit per-test times
# (`--junitxml`; a session fixture's build is charged to its first user). Over budget, list the costliest tests whose layer another fast test still covers with
# a real build run against transformers: compiler, CPU runtime, planner, serve, reliability, kernels at the host's
# ISA tier, one MoE build. List parametrisations rather than whole modules.
SLOW_TESTS = (
    # a fresh-clone fast tier measured 11.9 min: each of these has a fast sibling covering its layer
    "tests/reliability/test_faults_build.py::test_two_builds_into_one_directory[over_a_bundle]",
    "tests/compiler/test_compile_gpu_stage.py::test_k_quant_gpu_stage_builds_with_its_kernels",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[q5_k-avx512_vnni]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[q4_0-avx512_vnni]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[q5_k]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[q3_k-avx512_vnni]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[q5_0-avx512_vnni]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[q3_k]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[q5_0]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[iq4_xs-avx512_vnni]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[iq4_xs]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[mxfp4-avx512_vnni]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[mxfp4]",
    "tests/kernels/test_gpu_moe_kernels.py::test_selected_experts_match_float64[q6_k-q4_k]",
    "tests/kernels/test_gpu_moe_biased_kernels.py::test_selected_biased_experts_match_float64[q8_0-mxfp4-0.8]",
    "tests/kernels/test_gpu_moe_biased_kernels.py::test_selected_biased_experts_match_float64[mxfp4-mxfp4-7.0]",
    "tests/reliability/test_serve_isolation.py::test_template_with_a_huge_constant_costs_only_chat_requests",
    "tests/kernels/test_cpu_fused_kernels.py::test_amx_gemm_is_selected_and_compiles_for_an_amx_target_only",
    "tests/runtime/test_batch_decode_cpu.py::test_padding_rows_change_nothing",
    # architectures beyond the first build of each: the GGUF twins and the sliding-window build
    "tests/compiler/test_phi3.py::test_phi3_gguf_twin_is_the_hf_model_exactly",
    "tests/compiler/test_phi3.py::test_phi3_sliding_window_matches_transformers",
    "tests/compiler/test_gemma3.py::test_gemma3_fp16_greedy_matches_or_top5",
    "tests/compiler/test_gemma3.py::test_gemma3_gguf_twin_is_the_hf_model_exactly",
    "tests/compiler/test_head_dim.py::test_llama_gguf_with_key_length_is_the_hf_model_exactly",
    # end to end: one more build per architecture, dtype and checkpoint layout (qwen3 fp32, shared, stays fast)
    "tests/compiler/test_end_to_end.py::test_fp32_logits_and_greedy_match_transformers[qwen2]",
    "tests/compiler/test_end_to_end.py::test_fp32_logits_and_greedy_match_transformers[llama]",
    "tests/compiler/test_end_to_end.py::test_fp32_logits_and_greedy_match_transformers[mistral]",
    "tests/compiler/test_end_to_end.py::test_fp16_greedy_matches_or_top5",
    "tests/compiler/test_end_to_end.py::test_sharded_untied_checkpoint",
    "tests/kernels/test_cpu_decode_attention.py::test_fp16_bundle_decodes_on_the_kernel",
    "tests/kernels/test_cpu_decode_attention.py::test_one_sequence_decode_fast_path_is_bitwise_append_attend",
    # quantized builds: Q4_K_M (two block signatures, a q6_k head) stays fast, each other type is a build of its own
    "tests/compiler/test_quantized_models.py::test_quant_at_build_matches_transformers[qwen3-q8_0]",
    "tests/compiler/test_quantized_models.py::test_quant_at_build_matches_transformers[qwen3-q4_0]",
    "tests/compiler/test_quantized_models.py::test_quant_at_build_matches_transformers[qwen3-q5_k_m]",
    "tests/compiler/test_quantized_models.py::test_quant_at_build_matches_transformers[qwen3-q3_k_m]",
    "tests/compiler/test_quantized_models.py::test_quant_at_build_matches_transformers[llama-q4_k]",
    "tests/compiler/test_quantized_models.py::test_quant_at_build_matches_transformers[qwen2-q8_0]",
    "tests/compiler/test_quantized_models.py::test_gguf_file_builds_and_matches",
    "tests/compiler/test_quantized_models.py::test_calibrate_measures_a_quantized_bundle",
    # mixture of experts: the q4_k_m build (two expert signatures) and the GGUF twin stay fast
    "tests/compiler/test_moe_gguf.py::test_quantized_experts_match_transformers[q8_0]",
    # a quantized GGUF's batched steps (test_moe's fp32 batched decode and the m-row kernels' own tests stay fast)
    "tests/compiler/test_moe_gguf.py::test_q4_k_m_batched_steps_equal_single_runs",
    # a prompt's int8 experts bit for bit in chunks (the q4_k_m comparison with transformers runs that path, fast)
    "tests/compiler/test_moe_gguf.py::test_prompt_experts_are_the_one_row_sums_in_chunks",
    # the spread-routing benchmark input built, routed and compared with transformers (its layout, metadata and
    # reader tests stay fast)
    "tests/bench/test_make_gguf_moe.py::test_routing_spreads_over_the_experts",
    "tests/bench/test_make_gguf_moe.py::test_bundle_is_transformers_on_the_dequantized_file",
    # the GPU MoE kernels' m-row form against the one-row form, emulated (each form against float64 stays fast)
    "tests/kernels/test_gpu_moe_kernels.py::test_rows_kernels_equal_the_one_row_kernels_per_row*",
    # the tiled m-row expert sum beyond Qwen3-MoE's types (the q4_k/q6_k tiles and the biased m-row sum stay fast),
    # the q4_0 m-row sum (q4_k/q6_k stays fast), and calibrate's expert-sum rate (calibrate's routing stays fast):
    # the fresh-clone fast tier measured 10:04 with them
    "tests/kernels/test_cpu_moe_expert_rows.py::test_tiles_of_one_experts_pairs_match_one_row[q5_k-q3_k]",
    "tests/kernels/test_cpu_moe_expert_rows.py::test_tiles_of_one_experts_pairs_match_one_row[q4_0-q4_0]",
    "tests/kernels/test_cpu_moe_expert_rows.py::test_biased_tiles_of_one_experts_pairs_match_one_row",
    "tests/kernels/test_cpu_moe_expert_rows.py::test_expert_rows_match_one_row_and_float64[q4_0-q4_0]",
    "tests/compiler/test_moe_routing.py::test_calibrate_measures_the_one_call_expert_sum_the_cost_model_prices",
    # Gemma 3's batched GeGLU rows (the batched-decode bit tests of the other architectures stay fast)
    "tests/runtime/test_batch_decode_cpu.py::test_gemma3_geglu_batched_decode_is_bitwise",
    "tests/runtime/test_batch_decode_cpu.py::test_batched_decode_is_bitwise_single_decode[bfloat16-]",
    "tests/runtime/test_batch_decode_cpu.py::test_batched_decode_is_bitwise_single_decode[float16-q4_k_m]",
    "tests/runtime/test_batch_decode_cpu.py::test_batched_decode_is_bitwise_single_decode[float16-q8_0]",
    "tests/runtime/test_batch_decode_cpu.py::test_avx2_build_is_bitwise_too",
    # a benchmark GGUF of a second architecture (its Qwen3 file stays fast; Gemma 3's reader: test_gemma3) and the
    # 32-client load (serve's batching equals single requests: test_batched_decode_equals_single_requests)
    "tests/bench/test_make_gguf.py::test_file_builds_and_runs[gemma3-12b]",
    # the MoE benchmark file's control build (positive-scale blocks routing to a few experts); its own build stays fast
    "tests/bench/test_make_gguf_moe.py::test_positive_blocks_route_to_few_experts",
    "tests/serve/test_serve_openai.py::test_load_32_streaming_clients_x_8",
    # whole GPU stages and profile kits through nvcc
    "tests/compiler/test_compile_gpu_stage.py::test_quantized_gpu_stage_builds_with_its_kernels",
    "tests/compiler/test_compile_gpu_stage.py::test_quantized_prefill_dequantizes_each_weight_just_before_its_matmul",
    "tests/planner/test_cli_plan.py::test_profile_kit_built_here_measures_there",
    # a GPU stage's export + import with batched variants (~30 s each): fp16 unquantized stays fast
    "tests/compiler/test_lower_decode_gemv.py::test_every_decode_linear_is_an_m_row_gemv[bfloat16-False]",
    "tests/compiler/test_lower_decode_gemv.py::test_every_decode_linear_is_an_m_row_gemv[float16-True]",
    "tests/compiler/test_lower_decode_gemv.py::test_one_launch_per_shared_x_and_epilogues[bfloat16]",
    # AMX prefill cross-compiled for a CPU this host need not be (the emulated-tile kernel tests stay fast)
    "tests/compiler/test_lower_linear.py::test_prefill_uses_amx_gemm_only_for_whole_tiles_on_an_amx_target",
    "tests/compiler/test_lower_linear.py::test_fp32_prefill_activations_build_the_split_amx_gemms",
    "tests/compiler/test_lower_linear.py::test_prefill_fuses_qkv_and_gate_up_into_one_amx_launch_each_with_per_shape_blocking",
    "tests/compiler/test_lower_linear.py::test_fp16_block_compiles_with_amx_prefill_for_an_amx_target",
    # builds killed or rebuilt: one of each stays fast
    "tests/reliability/test_faults_build.py::test_build_killed_half_way[manifest_written-*]",
    "tests/reliability/test_faults_build.py::test_build_killed_half_way[swapping-fresh]",
    "tests/reliability/test_faults_build.py::test_build_killed_half_way[swapped-fresh]",
    "tests/reliability/test_faults_build.py::test_build_killed_half_way[files_copied-over_a_bundle]",
    "tests/reliability/test_faults_build.py::test_corrupted_cache_entry_is_detected_and_rebuilt[library_deleted]",
    "tests/reliability/test_faults_build.py::test_corrupted_cache_entry_is_detected_and_rebuilt[meta_not_json]",
    # CPU kernels: every ISA tier in the full run; the fast tier keeps AVX-512 VNNI (or what the host runs) and AVX2
    # (the float GEMVs have no VNNI tier: theirs is plain AVX-512's code, so that tier's fp16 check stays fast)
    "tests/kernels/test_cpu_quant_gemv.py::test_quant_gemv_matches_float64[*-avx512]",
    "tests/kernels/test_cpu_quant_gemv.py::test_quant_gemv_matches_float64[*-sse2]",
    "tests/kernels/test_cpu_quant_gemv.py::test_quant_gemv_matches_float64[6-4096-*-avx2]",
    "tests/kernels/test_cpu_gemv_rows.py::test_float_gemvs_rows_are_single_rows[*-sse2]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[*-avx512]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[*-sse2]",
    "tests/kernels/test_cpu_fused_kernels.py::test_quant_multi_gemv_is_bitwise_its_single_kernels[*-avx512]",
    "tests/kernels/test_cpu_gemv_rows.py::test_float_gemvs_rows_are_single_rows[float32-*]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[q8_0]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[q4_0]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_over_several_k_tiles[q6_k]",
    "tests/kernels/test_cpu_fused_kernels.py::test_amx_gemm_variants_compile_with_distinct_symbols",
    "tests/kernels/test_cpu_fused_kernels.py::test_amx_gemm_multi_compiles_for_an_amx_target",
    "tests/kernels/test_cpu_fused_kernels.py::test_amx_gemm_multi_matches_float64_with_emulated_tiles[bfloat16-ns0-*]",
    "tests/kernels/test_cpu_fused_kernels.py::test_amx_gemm_multi_matches_float64_with_emulated_tiles[bfloat16-ns2-*]",
    "tests/kernels/test_paged_attention_cuda_emulated.py::test_fused_append_batch_is_each_sequence_alone[2-4-128-16]",
    # mixture of experts: the fp32 build (logits, greedy, batched decode) is the fast tier's one MoE build
    "tests/compiler/test_moe.py::test_16bit_greedy_matches_transformers",
    "tests/compiler/test_moe.py::test_mixtral_is_the_same_code_with_other_values",
    "tests/compiler/test_moe_gguf.py::test_quantized_experts_match_transformers[q4_k_m]",
    "tests/compiler/test_moe_gguf.py::test_f16_gguf_twin_is_the_hf_model_exactly",
    # gpt-oss: the fp32 build against transformers stays fast; its bf16 build and GGUF twins are builds of their own
    "tests/compiler/test_gpt_oss.py::test_gpt_oss_bf16_greedy_matches_transformers",
    "tests/compiler/test_gpt_oss.py::test_calibrate_measures_a_gpt_oss_bundle",
    "tests/compiler/test_gpt_oss_gguf.py::test_gguf_twin_is_the_hf_model_exactly",
    "tests/compiler/test_gpt_oss_gguf.py::test_mxfp4_experts_match_transformers",
    "tests/compiler/test_gpt_oss_gguf.py::test_mxfp4_decode_steps_match_transformers",
    "tests/compiler/test_gpt_oss_gguf.py::test_file_of_llamacpps_converter_is_the_hf_model_exactly",
    # Mixtral as a GGUF twin and quantized: Qwen3-MoE's fast tests cover the same code with other values
    "tests/compiler/test_mixtral_gguf.py::test_f16_gguf_twin_is_the_hf_model_exactly",
    "tests/compiler/test_mixtral_gguf.py::test_quantized_mixtral_matches_transformers",
    # the CPU runtime's batched decode: serve's batched-equals-single test runs it on the shared bundle
    "tests/runtime/test_batch_decode_cpu.py::test_batched_decode_is_bitwise_single_decode[float16-]",
    # the profile's full (Qwen3-8B-block) kit: ~40 s to build; the quick profile every build uses stays fast
    "tests/hardware/test_host_read.py::test_host_read_is_what_bench_cpu_gemv_measures",
    "tests/hardware/test_host_read.py::test_measured_reads_are_consistent",
    "tests/hardware/test_full_kit.py",
    "tests/hardware/test_profile_kit_gpu.py::test_kit_gpu_gemvs_cover_every_type_in_the_stage_launch_forms",
    "tests/hardware/test_profile_kit_gpu.py::test_measurement_launches_match_the_kernels_signatures",
    "tests/runtime/test_gpu_collection.py::test_gpu_tests_collect_with_a_runtime_only_tvm",
    # reliability: one killed build, one rebuilt cache entry and every other command's one-line error stay fast
    "tests/reliability/test_faults_build.py::test_two_builds_into_one_directory[fresh]",
    "tests/reliability/test_faults_build.py::test_corrupted_cache_entry_is_detected_and_rebuilt[library_flipped]",
    "tests/reliability/test_catalogue_cli.py::test_sigint_during_compile_is_an_interruption",
    "tests/reliability/test_serve_fuzz.py::test_concurrent_requests_equal_their_lone_runs",
    # the whole host read on the quick kit, measured up to three times on a busy host (its sweeps stay fast)
    "tests/hardware/test_round_spread.py::test_measured_reads_either_agree_across_rounds_or_refuse_in_one_line",
)

# On an AVX-512 VNNI host the fast tier runs its kernels at that tier alone; a host without it keeps AVX2 fast.
SLOW_BESIDE_VNNI = (
    "tests/kernels/test_cpu_gemv_rows.py::test_float_gemvs_rows_are_single_rows[*-avx2]",
    "tests/kernels/test_cpu_gemv_rows.py::test_quant_gemv_rows_are_single_rows[*-avx2]",
)


# Tests that time the host, run alone after the rest (`scripts/test.sh` runs everything else on one pytest-xdist
# worker per core first): the profiler and its busy-host checks, the host read measurements, the profile kits, the
# serve tests that bound a latency, BLAS thread counts, plans timed under a second. Patterns as in SLOW_TESTS.
SERIAL_TESTS = (
    "tests/hardware/test_host_read.py",
    "tests/hardware/test_round_spread.py",
    "tests/hardware/test_profile_hardware.py",
    "tests/hardware/test_blas_threads.py",
    "tests/reliability/test_catalogue_profile.py",
    "tests/reliability/test_serve_isolation.py::test_huge_body_is_refused_without_freezing_health",
    "tests/reliability/test_serve_isolation.py::test_template_that_loops_or_explodes_costs_only_its_request",
    "tests/planner/test_cli_plan.py::test_profile_*",
    "tests/planner/test_cli_plan.py::test_64_layer_plan_answers_under_a_second",
    "tests/planner/test_search_partition.py::test_64_layer_plan_under_a_second",
)


# The longest modules (a full run's per-test times, each over a minute on the 2-core host), collected first, about
# longest first: pytest-xdist hands a module to whichever worker is free in collection order (scripts/test.sh passes
# --no-loadscope-reorder: by default xdist hands out the modules with the most tests first, which put the kit
# modules, a few tests of minutes each, among the last), so a long one handed out last would keep one worker busy
# while the other had nothing left. The two kit modules lead: one test or fixture of 2-3 minutes each. Modules not
# listed keep their order.
LONG_MODULES_FIRST = (
    "tests/planner/test_cli_plan.py",
    "tests/hardware/test_full_kit.py",
    "tests/kernels/test_cpu_gemv_rows.py",
    "tests/kernels/test_cpu_fused_kernels.py",
    "tests/compiler/test_moe_gguf.py",
    "tests/compiler/test_quantized_models.py",
    "tests/kernels/test_cpu_moe_expert_rows.py",
    "tests/compiler/test_compile_gpu_stage.py",
    "tests/compiler/test_lower_linear.py",
    "tests/serve/test_serve_openai.py",
    "tests/bench/test_make_gguf.py",
    "tests/bench/test_make_gguf_moe.py",
    "tests/compiler/test_gpt_oss_gguf.py",
    "tests/kernels/test_gpu_moe_kernels.py",
    "tests/compiler/test_mixtral_gguf.py",
    "tests/compiler/test_lower_decode_gemv.py",
    "tests/kernels/test_gpu_int8_gemv_kernels.py",
    "tests/kernels/test_gpu_gemv_kernels.py",
    "tests/kernels/test_cpu_quant_gemv.py",
    "tests/runtime/test_batch_decode_cpu.py",
    "tests/compiler/test_moe.py",
    "tests/reliability/test_faults_build.py",
    "tests/kernels/test_paged_attention_cuda_emulated.py",
    "tests/hardware/test_profile_kit_gpu.py",
)


def _host_runs_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in f)
    except OSError:
        return False


def _node_pattern(p: str) -> str:
    return re.escape(p).replace(r"\*", ".*") + r"(?:$|::|\[)"


_SLOW_RE = re.compile("|".join(map(_node_pattern, SLOW_TESTS + SLOW_BESIDE_VNNI * _host_runs_vnni())))
_SERIAL_RE = re.compile("|".join(map(_node_pattern, SERIAL_TESTS)))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _SLOW_RE.match(item.nodeid):
            item.add_marker(pytest.mark.slow)
        if _SERIAL_RE.match(item.nodeid):
            item.add_marker(pytest.mark.serial)
    first = {m: i for i, m in enumerate(LONG_MODULES_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))    # stable: the rest in order


ARCHS = ("qwen3", "qwen2", "llama", "mistral")

# The GPU test machine has a runtime-only TVM (TVM_USE_RUNTIME_LIB=1: tvm.runtime imports, tvm.relax
# and the TIR/TensorIR modules do not). A test module that imports the compiler at import time is
# skipped there as a whole, with the reason, instead of stopping collection for every GPU test.
_COMPILER_IN_TRACEBACK = re.compile(r"tvm[/\\.](relax|tirx?|s_tir|script|te|topi|dlight|meta_schedule|driver)\b")
_compiler_ok: list[bool] = []


def compiler_available() -> bool:
    """Whether this TVM has its compiler (tvm.relax imports); checked once, on first need."""
    if not _compiler_ok:
        try:
            import tvm.relax  # noqa: F401
            _compiler_ok.append(True)
        except Exception:
            _compiler_ok.append(False)
    return _compiler_ok[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if not (rep.failed and isinstance(collector, pytest.Module)):
        return
    text = str(rep.longrepr)
    if _COMPILER_IN_TRACEBACK.search(text) and not compiler_available():
        last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
        rep.outcome = "skipped"
        rep.longrepr = (str(collector.path), 0, "Skipped: imports the TVM compiler, which this runtime-only TVM "
                        f"lacks ({last[0].strip()[:160]})")
        rep.result = []


_ABSENT = object()


@pytest.fixture(autouse=True)
def compiler_imports_restored():
    """`helmc run`, `calibrate`, `serve` and `chat` bar torch, onnx and onnxscript from their process
    (runtime/isolation.py); a test invoking them in-process (CliRunner) would leave the bar on its xdist worker, and a
    later test there that exports a model (its onnxscript not yet imported: the build came from the shared cache) fails
    with "import of onnxscript halted". The bar is lifted after each test."""
    from helmc.runtime.isolation import FORBIDDEN
    before = {name: sys.modules.get(name, _ABSENT) for name in FORBIDDEN}
    yield
    for name, module in before.items():
        if module is _ABSENT and name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


@pytest.fixture(scope="session")
def host_hardware(tmp_path_factory):
    # Quick sizes, no per-block overheads: a compile target and rough rates for the tests' tiny builds. The
    # profile kit it measures with is cached in the artifact cache, so later sessions compile nothing; the
    # processes of one run measure once and share the profile.
    from helmc.api import profile
    from helmc.hardware.profile import HardwareProfile
    path = os.path.join(shared_dir(tmp_path_factory), "host-hardware.json")
    with run_lock(tmp_path_factory, "host-hardware"):
        if os.path.exists(path):
            return HardwareProfile.load(path)
        hw = profile(quick=True, overheads=False, progress=lambda m: None)
        hw.save(path)
        return hw


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    # one artifact cache for the whole run: a stage another worker (or the parallel phase) compiled is reused
    d = os.path.join(shared_dir(tmp_path_factory), "artifact-cache")
    os.makedirs(d, exist_ok=True)
    return d


class TinyModels:
    """Lazily makes model directories and bundles, once per key: a model by (arch, dtype, make_tiny_model's
    arguments), a bundle by the model and the build's options. Build options: batch (--max-batch), quant (--quant),
    cpu_only (the host's profile without its GPU: every unit on the CPU)."""

    def __init__(self, root, hardware, cache_dir, lock=None):
        self.root, self.hardware, self.cache_dir = root, hardware, cache_dir
        self._lock = lock or (lambda name: contextlib.nullcontext())
        self._models, self._builds = {}, {}

    def model(self, arch: str, dtype: str = "float32", **kw):
        key = (arch, dtype, tuple(sorted(kw.items())))
        if key not in self._models:
            from helmc.testing import make_tiny_model
            d = os.path.join(self.root, "-".join(map(str, (arch, dtype) + tuple(f"{k}{v}" for k, v in sorted(kw.items())))))
            ref = make_tiny_model(d, arch, dtype=dtype, **kw)
            self._models[key] = (d, ref.float().eval())
        return self._models[key]

    def build(self, arch: str, dtype: str = "float32", *, batch: int = 1, quant: str = "", cpu_only: bool = False, **kw):
        """The BuildResult of the model's bundle with these build options (built on first call)."""
        key = (arch, dtype, tuple(sorted(kw.items())), batch, quant, cpu_only)
        if key not in self._builds:
            import dataclasses

            from helmc import api
            d, _ = self.model(arch, dtype, **kw)
            options = f"-b{batch}" * (batch != 1) + f"-{quant}" * bool(quant) + "-cpu" * cpu_only
            hw = dataclasses.replace(self.hardware, gpu=None, link=None) if cpu_only else self.hardware
            out = d + options + ".bundle"
            with self._lock("build-" + os.path.basename(out)):    # a worker building it: wait, then hit the cache
                self._builds[key] = api.build(d, hw, out, cache_dir=self.cache_dir, quiet=True, batch=batch,
                                              quant=quant)
        return self._builds[key]

    def bundle(self, arch: str, dtype: str = "float32", **kw) -> str:
        return self.build(arch, dtype, **kw).bundle_dir


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, host_hardware, cache_dir):
    return TinyModels(str(tmp_path_factory.mktemp("tiny-models")), host_hardware, cache_dir,
                      lambda name: run_lock(tmp_path_factory, name))


# The compiler tests' quantized tiny GPU stage compiled to an sm_90 cubin once (nvcc takes tens of seconds) for the
# tests that read its files. Here, not in a tests/compiler/conftest.py: a second conftest module.
@pytest.fixture(scope="session")
def quantized_gpu_stage_files(tmp_path_factory):
    """(out dir, file names) of compile_gpu_stage on gpu_stage_specs' Q4_K_M-like stage with batched decode."""
    pytest.importorskip("tvm.relax")
    from helmc.compiler.passes.compile_gpu_stage import compile_gpu_stage, find_nvcc
    from gpu_stage_specs import imported_gpu_stage   # tests/compiler, on sys.path once a test there is imported
    if find_nvcc() is None:
        pytest.skip("needs nvcc")
    mod, weight_types = imported_gpu_stage("float16", True)
    out = tmp_path_factory.mktemp("quantized-gpu-stage")
    return out, compile_gpu_stage(mod, "sm_90", str(out), weight_types=weight_types)
