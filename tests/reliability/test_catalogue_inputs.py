"""Catalogue of bad inputs besides the weights: config.json and hardware.json (through `helmc build`), and the
arguments of run, serve and chat. Each case checks the one-line message, exit status 2, and that nothing was
written or lost (no bundle, no stray file, the inputs byte for byte as they were). A config.json with auto_map
(custom model code) is refused without the code ever being imported."""
from __future__ import annotations

import json
import shutil
import sys

import pytest

from cli_check import cli, refused, tree


# ---- config.json ----------------------------------------------------------------------------------
def _set(**kv):
    return lambda cfg: cfg.update(kv)


def _drop(key):
    return lambda cfg: cfg.pop(key) and None


CONFIG_CASES = {
    "missing_hidden_size": (_drop("hidden_size"), "required key 'hidden_size' missing"),
    "missing_num_hidden_layers": (_drop("num_hidden_layers"), "required key 'num_hidden_layers' missing"),
    "missing_vocab_size": (_drop("vocab_size"), "required key 'vocab_size' missing"),
    "missing_architectures": (_drop("architectures"), "architectures expected one of"),
    "heads_not_dividing": (_set(num_key_value_heads=3), "must be a multiple of num_key_value_heads (3)"),
    "head_dim_odd": (_set(head_dim=31), "head_dim must be even"),
    "unsupported_architecture": (_set(architectures=["GPT2LMHeadModel"]), "found ['GPT2LMHeadModel']"),
    "hidden_size_not_an_integer": (_set(hidden_size=64.5), "'hidden_size' expected a positive integer"),
    "hidden_size_a_string": (_set(hidden_size="64"), "'hidden_size' expected a positive integer"),
    "layers_negative": (_set(num_hidden_layers=-2), "'num_hidden_layers' expected a positive integer"),
    "layers_2^31": (_set(num_hidden_layers=2**31), "num_layers expected a positive integer of at most 4096"),
    "unsupported_activation": (_set(hidden_act="gelu"), "hidden_act expected one of ('silu', 'gelu_pytorch_tanh')"),
    "unsupported_rope": (_set(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}), "rope type expected default"),
    "rope_not_an_object": (_set(rope_parameters=[1, 2]), "rope_parameters expected a JSON object"),
    "unsupported_dtype": (_set(dtype="int8"), "dtype expected float32, float16 or bfloat16"),
    "eos_not_an_integer": (_set(eos_token_id="</s>"), "eos_token_id expected an integer"),
    "not_json": (lambda cfg: "{\"architectures\": [", "not valid JSON"),
    "a_list": (lambda cfg: [cfg], "expected a JSON object"),
}


def _model_copy(tiny, tmp_path):
    src, _ = tiny.model("qwen3")
    model = tmp_path / "model"
    shutil.copytree(src, model)
    return model


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_json(case, tiny, hw_json, tmp_path, workdir):
    edit, message = CONFIG_CASES[case]
    model = _model_copy(tiny, tmp_path)
    cfg = json.loads((model / "config.json").read_text())
    out = edit(cfg)
    (model / "config.json").write_text(out if isinstance(out, str) else json.dumps(out if out is not None else cfg))
    before = tree(tmp_path)
    refused(cli("build", model, hw_json, "-o", tmp_path / "bundle"), "config.json", message)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "EvilForCausalLM"])
def test_custom_code_is_never_imported(architecture, tiny, hw_json, tmp_path, workdir):
    """auto_map names Python files of the model directory (transformers runs them with trust_remote_code): helmc
    refuses the config and never imports them, whether the architecture is one it supports or not."""
    model = _model_copy(tiny, tmp_path)
    marker = tmp_path / "imported"
    (model / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nclass EvilModel: pass\n")
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(architectures=[architecture], auto_map={"AutoModelForCausalLM": "modeling_evil.EvilModel"})
    (model / "config.json").write_text(json.dumps(cfg))
    before = tree(tmp_path)
    for command in (("build", model, hw_json, "-o", tmp_path / "bundle"), ("plan", model, hw_json)):
        refused(cli(*command), "custom model code, which helmc never imports or runs")
    assert not marker.exists() and "modeling_evil" not in sys.modules
    assert tree(tmp_path) == before


def test_config_json_missing(tiny, hw_json, tmp_path, workdir):
    model = _model_copy(tiny, tmp_path)
    (model / "config.json").unlink()
    before = tree(tmp_path)
    refused(cli("build", model, hw_json, "-o", tmp_path / "bundle"), "config.json")
    assert tree(tmp_path) == before


# ---- hardware.json --------------------------------------------------------------------------------
def _hw(edit):
    def make(doc):
        edit(doc)
        return json.dumps(doc)
    return make


HARDWARE_CASES = {
    "not_json": (lambda doc: "{\"cpu\": ", "not valid JSON"),
    "empty_file": (lambda doc: "", "not valid JSON"),
    "a_list": (lambda doc: json.dumps([doc]), "expected a JSON object, found list"),
    "unknown_key": (_hw(lambda d: d.update(cpu_count=4)), "cpu_count"),
    "unknown_nested_key": (_hw(lambda d: d["cpu"].update(dram_gbps=30)), "dram_gbps"),
    "missing_cpu": (_hw(lambda d: d.pop("cpu")), "missing required key 'cpu'"),
    "format_version_99": (_hw(lambda d: d.update(format_version=99)), "format_version expected 2, found 99"),
    "cores_zero": (_hw(lambda d: d["cpu"].update(cores=0)), "cpu.cores expected > 0, found 0"),
    "dram_negative": (_hw(lambda d: d["cpu"].update(dram_gbs=-1.0)), "cpu.dram_gbs expected > 0"),
    "ram_free_above_total": (_hw(lambda d: d["cpu"].update(ram_free_bytes=d["cpu"]["ram_total_bytes"] + 1)),
                             "cpu.ram_free_bytes expected in (0, ram_total_bytes="),
    "number_a_string": (_hw(lambda d: d["cpu"].update(cores="2")), "cpu.cores: expected int, found str '2'"),
    # Impossible figures: refused when read, before the planner sizes anything by them.
    "block_overhead_minus_1e9": (_hw(lambda d: d["cpu"].update(block_overhead_ms=-1e9)),
                                 "cpu.block_overhead_ms expected a finite number in [-1000, 1000], found -1000000000"),
    "step_overhead_minus_1e9": (_hw(lambda d: d["cpu"].update(step_overhead_ms=-1e9)), "cpu.step_overhead_ms"),
    "profile_overhead_negative": (_hw(lambda d: d.update(block_overhead_ms=-0.5)), "block_overhead_ms expected >= 0"),
    "dram_nan": (_hw(lambda d: d["cpu"].update(dram_gbs=float("nan"))), "dram_gbs"),
    "dram_infinite": (_hw(lambda d: d["cpu"].update(dram_gbs=float("inf"))), "dram_gbs"),
    "host_read_1e30": (_hw(lambda d: d["cpu"].update(host_read_gbs=1e30)), "cpu.host_read_gbs expected a finite number"),
    "gemv_rate_zero": (_hw(lambda d: d["cpu"].update(gemv_reads=[{"weight_type": "float32", "gbs": 0.0}])),
                       "gemv_reads expected a weight type, gbs > 0"),
    "ram_total_2e62": (_hw(lambda d: d["cpu"].update(ram_total_bytes=1 << 62, ram_free_bytes=1 << 61)),
                       "cpu.ram_total_bytes expected a finite number in [0, "),
    "threads_1e9": (_hw(lambda d: d["cpu"].update(threads=10 ** 9)), "cpu.threads"),
    "reserve_1e30": (_hw(lambda d: d.update(host_reserve_bytes=1 << 60)), "host_reserve_bytes"),
    "gpu_without_link": (_hw(lambda d: d.update(gpu={"name": "g", "arch": "sm_90", "vram_total_bytes": 8 << 30,
                                                     "vram_free_bytes": 7 << 30, "hbm_gbs": 900.0}, link=None)),
                         "gpu and link must be both present or both absent"),
}


@pytest.mark.parametrize("case", sorted(HARDWARE_CASES))
def test_bad_hardware_json(case, tiny, hw_json, tmp_path, workdir):
    make, message = HARDWARE_CASES[case]
    hw_json.write_text(make(json.loads(hw_json.read_text())))
    model, _ = tiny.model("qwen3")
    before = tree(tmp_path, model)
    refused(cli("build", model, hw_json, "-o", tmp_path / "bundle"), message)
    assert tree(tmp_path, model) == before


def test_hardware_json_missing_or_a_directory(tiny, tmp_path, workdir):
    model, _ = tiny.model("qwen3")
    before = tree(tmp_path, model)
    refused(cli("build", model, tmp_path / "nope.json", "-o", tmp_path / "bundle"), "expected a hardware.json path")
    (tmp_path / "hwdir").mkdir()
    refused(cli("build", model, tmp_path / "hwdir", "-o", tmp_path / "bundle"), "found a directory")
    assert tree(tmp_path, model) == dict(before, **{str(tmp_path / "hwdir"): "dir"})


# ---- run, serve and chat arguments ----------------------------------------------------------------
IDS = ("--prompt-ids", "1,2,3")
RUN_CASES = {
    "max_new_tokens_0": (("run", *IDS, "--max-new-tokens", "0"), "--max-new-tokens expected >= 1, found 0"),
    "temperature_negative": (("run", *IDS, "--temperature", "-1"), "temperature expected >= 0"),
    "temperature_nan": (("run", *IDS, "--temperature", "nan"), "temperature expected >= 0, found nan"),
    "top_p_0": (("run", *IDS, "--top-p", "0"), "top_p expected in (0, 1]"),
    "top_p_above_1": (("run", *IDS, "--top-p", "1.5"), "top_p expected in (0, 1]"),
    "top_k_negative": (("run", *IDS, "--top-k", "-1"), "top_k expected >= 0"),
    "seed_negative": (("run", *IDS, "--seed", "-1"), "seed expected a non-negative integer"),
    "kv_watermark_0": (("run", *IDS, "--kv-watermark", "0"), "--kv-watermark expected in (0, 1]"),
    "kv_page_tokens_0": (("run", *IDS, "--kv-page-tokens", "0"), "--kv-page-tokens expected a positive integer"),
    "prompt_and_ids": (("run", *IDS, "--prompt", "hi"), "expected exactly one of --prompt or --prompt-ids"),
    "no_prompt": (("run",), "expected exactly one of --prompt or --prompt-ids"),
    "ids_not_integers": (("run", "--prompt-ids", "1,x"), "--prompt-ids expected comma-separated integers"),
    "ids_outside_vocabulary": (("run", "--prompt-ids", "1,99999"), "token ids expected in [0, 512), found [99999]"),
    "empty_prompt": (("run", "--prompt", ""), "the prompt is empty"),
    "prompt_longer_than_context": (("run", "--prompt-ids", ",".join(["1"] * 600)), "do not fit"),
    "weights_missing": (("run", *IDS, "--weights", "{tmp}/nope"), "expected model.safetensors"),
    "bundle_missing": (("run", *IDS), "bundle: expected a directory, found nothing", "{tmp}/nope"),
    "bundle_a_file": (("run", *IDS), "bundle: expected a directory, found a file", "{tmp}/hw.json"),
    "serve_max_batch_above_plan": (("serve", "--max-batch", "99", "--port", "0"), "--max-batch 99: the bundle's plan"),
    "serve_max_batch_0": (("serve", "--max-batch", "0", "--port", "0"), "--max-batch expected >= 1"),
    "serve_port_out_of_range": (("serve", "--port", "70000"), "--port expected in [0, 65535]"),
    "serve_log_level": (("serve", "--port", "0", "--log-level", "loud"), "--log-level expected one of"),
    "chat_without_template": (("chat",), "chat: expected a chat template"),
    "chat_top_p_0": (("chat", "--top-p", "0"), "top_p expected in (0, 1]"),
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_bad_run_arguments(case, tiny, hw_json, tmp_path, workdir):
    command, *args = RUN_CASES[case][0]
    message = RUN_CASES[case][1]
    bundle = (RUN_CASES[case][2] if len(RUN_CASES[case]) > 2 else "{bundle}")
    bundle = bundle.format(tmp=tmp_path, bundle=tiny.bundle("qwen3"))
    args = [a.format(tmp=tmp_path) for a in args]
    before = tree(tmp_path, tiny.bundle("qwen3"))
    refused(cli(command, bundle, *args, input=""), message)
    assert tree(tmp_path, tiny.bundle("qwen3")) == before


def test_click_usage_errors_are_one_message(tiny, workdir):
    """What click itself refuses (a value of the wrong type, an unknown option): its usage message, status 2."""
    for args in (("run", tiny.bundle("qwen3"), "--max-new-tokens", "many"), ("run", "--no-such-option")):
        r = cli(*args)
        assert r.exit_code == 2 and "Error:" in r.stderr and r.stdout == "", r.output
