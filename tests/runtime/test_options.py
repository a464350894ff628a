"""KVOptions and BuildOptions: the defaults defined once, the keywords they are read from, bad keywords refused."""
import pytest

from helmc.errors import HelmcError
from helmc.runtime.kv.options import KV_PAGE_TOKENS, KV_WATERMARK, KVOptions


def test_kv_defaults_are_the_planners_and_the_caches():
    import inspect
    from helmc.planner import cost_model
    from helmc.runtime.kv.cache_cpu import KVCacheCPU
    from helmc.runtime.kv.cache_gpu import KVCacheGPU
    assert (cost_model.KV_PAGE_TOKENS, cost_model.KV_WATERMARK) == (KV_PAGE_TOKENS, KV_WATERMARK) == (512, 0.8)
    assert KVOptions() == KVOptions(page_tokens=512, watermark=0.8, offload=True, cuda_graph=True)
    assert inspect.signature(KVCacheCPU).parameters["page_tokens"].default == KV_PAGE_TOKENS
    gpu = inspect.signature(KVCacheGPU).parameters
    assert (gpu["page_tokens"].default, gpu["watermark"].default) == (KV_PAGE_TOKENS, KV_WATERMARK)


def test_kv_options_from_session_keywords():
    kv = KVOptions.from_keywords({"kv_page_tokens": 16, "kv_watermark": 0.5, "kv_offload": False, "cuda_graph": False})
    assert kv == KVOptions(page_tokens=16, watermark=0.5, offload=False, cuda_graph=False)
    assert KVOptions.from_keywords({}) == KVOptions()
    with pytest.raises(HelmcError, match="expected keywords among kv_page_tokens.*found kv_pages"):
        KVOptions.from_keywords({"kv_pages": 16})
    with pytest.raises(HelmcError, match=r"--kv-page-tokens expected a positive integer, found 0"):
        KVOptions.from_keywords({"kv_page_tokens": 0})
    with pytest.raises(HelmcError, match=r"--kv-watermark expected in \(0, 1\], found 1.5"):
        KVOptions(watermark=1.5)


def test_session_load_refuses_an_unknown_kv_keyword_before_reading_anything(tmp_path):
    from helmc.runtime.session import Session
    with pytest.raises(HelmcError, match="found kv_page_token$"):
        Session.load(str(tmp_path / "no-bundle"), kv_page_token=16)


def test_build_options_defaults_and_keywords(tmp_path):
    pytest.importorskip("tvm.relax")
    from helmc.api import BUILD_DEFAULTS
    from helmc.cli.main import main
    from helmc.compiler.options import BuildOptions, build_options
    from helmc.compiler.pipeline import build
    assert BUILD_DEFAULTS == BuildOptions() and BuildOptions().prompt_len == 128 and BuildOptions().hybrid
    assert build_options(None, {"quant": "q8_0", "batch": 2}) == BuildOptions(quant="q8_0", batch=2)
    cli = {p.name: p.default for p in main.commands["build"].params}
    assert (cli["prompt_len"], cli["output_len"], cli["max_batch"], cli["hybrid"], cli["stream_prefill"],
            cli["prefill_activations"]) == (128, 128, 1, True, True, "model")
    with pytest.raises(HelmcError, match="expected keywords among .*found prompt_length"):
        build(str(tmp_path), None, str(tmp_path / "out"), prompt_length=64)
    with pytest.raises(HelmcError, match="found both"):
        build(str(tmp_path), None, str(tmp_path / "out"), BuildOptions(), quant="q8_0")


def test_run_chat_serve_calibrate_options_hold_the_cli_defaults_and_check_when_made(tmp_path):
    from helmc import api
    from helmc.cli.main import main
    from helmc.runtime.serve.conversation import Sampling

    def defaults(command):
        return {p.name: p.default for p in main.commands[command].params}
    run, chat, serve, cal = defaults("run"), defaults("chat"), defaults("serve"), defaults("calibrate")
    r = api.RunOptions()
    assert (run["max_new_tokens"], run["kv_page_tokens"], run["kv_watermark"], run["top_p"]) == \
        (r.max_new_tokens, r.kv_page_tokens, r.kv_watermark, r.top_p) == (32, KV_PAGE_TOKENS, KV_WATERMARK, 1.0)
    assert api.ChatOptions().sampling() == Sampling() and chat["max_new_tokens"] == Sampling().max_new_tokens == 256
    assert (serve["port"], serve["log_level"], serve["kv_page_tokens"]) == (8000, "warning", KV_PAGE_TOKENS)
    assert cal["steps"] is api.CalibrateOptions().steps is None
    for make, line in ((lambda: api.RunOptions(max_new_tokens=0), "--max-new-tokens expected >= 1, found 0"),
                       (lambda: api.RunOptions(kv_watermark=2.0), "--kv-watermark expected in"),
                       (lambda: api.RunOptions(top_p=0.0), "top_p"),
                       (lambda: api.ChatOptions(temperature=-1.0), "temperature"),
                       (lambda: api.CalibrateOptions(steps=0), "--steps expected a positive integer"),
                       (lambda: api.ServeOptions(trust="key.pub"), "trust: expected a tuple of public key file paths")):
        with pytest.raises(HelmcError, match=line.replace("(", r"\(")):
            make()


def test_run_chat_serve_calibrate_take_one_options_or_its_keywords_before_reading_anything(tmp_path):
    from helmc import api
    missing = str(tmp_path / "no-bundle")
    for call, options in ((lambda o, **k: api.run(missing, prompt_ids=[1], options=o, **k), api.RunOptions()),
                          (lambda o, **k: api.chat(missing, o, **k), api.ChatOptions()),
                          (lambda o, **k: api.serve(missing, o, **k), api.ServeOptions()),
                          (lambda o, **k: api.calibrate(missing, "rtx4060-laptop", o, **k), api.CalibrateOptions())):
        name = type(options).__name__
        with pytest.raises(HelmcError, match=f"expected a {name} or its fields as keywords, found both"):
            call(options, seed=1)
        with pytest.raises(HelmcError, match="options: expected keywords among .*found max_tokens$"):
            call(None, max_tokens=1)
        with pytest.raises(HelmcError, match=f"expected a {name}, found dict"):
            call({})
    # A plan file is read by the API (as serve's always was), and a missing one is named before the bundle is read.
    with pytest.raises(HelmcError, match="--plan: expected a plan JSON file .* found nothing at"):
        api.run(missing, prompt_ids=[1], plan=str(tmp_path / "plan.json"))
