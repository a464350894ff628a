"""Catalogue of bad plans: a `--plan` file (made on the target, unsigned) and a bundle's own plan.json are data,
checked against the model spec and the machine before anything is allocated. Each bad value is refused in one line,
exit status 2, by the real CLI; the bundle's own plan passed as `--plan` runs (the control)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from cli_check import cli, refused

RUN = ("--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")


def _plan(tiny) -> dict:
    with open(os.path.join(tiny.bundle("qwen3"), "plan.json")) as f:
        return json.load(f)


def _scale_times(d: dict, by: float) -> None:
    for row in [d["predictions"]] + d["predictions"].get("candidates", []):
        for k in ("t_cpu_ms", "t_gpu_ms", "t_comm_ms", "t_plan_ms"):
            row[k] *= by


def _set(part: str, **fields):
    """An edit setting fields of one part of the plan's JSON (a callable value: of the plan's JSON)."""
    return lambda d: d[part].update({k: v(d) if callable(v) else v for k, v in fields.items()})


def _flat(d: dict) -> dict:
    """The plan as helmc wrote plan.json before its parts (format 1): every field at the top level."""
    out = {"format_version": 1}
    for part in ("placement", "predictions", "memory", "workload", "provenance"):
        out.update(d[part])
    return out


# case -> (edit of the plan's JSON, the refusal's words)
BAD_PLANS = {
    "max_context_1e12": (_set("memory", max_context=10 ** 12), "max_context expected 1.."),
    "max_context_zero": (_set("memory", max_context=0), "max_context expected 1.."),
    "max_context_negative": (_set("memory", max_context=-5), "max_context expected"),
    "prompt_len_over_context": (_set("workload", prompt_len=lambda d: d["memory"]["max_context"] + 1),
                                "prompt_len expected at most"),
    "chunk_over_context": (_set("placement", prefill_chunk_tokens=10 ** 9), "prefill_chunk_tokens expected at most"),
    "cpu_units_past_the_model": (_set("placement", cpu_units=lambda d: d["placement"]["num_layers"] + 9),
                                 "cpu_units expected 0.."),
    "num_layers_other_model": (lambda d: (d["placement"].update(num_layers=d["placement"]["num_layers"] + 1),
                                          d["predictions"].update(candidates=[])), "layers"),
    "batch_other": (_set("workload", batch=4096), "batch"),
    "kv_pool_negative": (_set("memory", gpu_kv_pool_bytes=-1), "expected >= 0"),
    "negative_times": (lambda d: _scale_times(d, -1.0), "expected a finite number >= 0"),
    "host_bytes_past_ram": (_set("memory", cpu_bytes=1 << 60), "cpu_bytes expected at most this machine's"),
    "weights_bytes_negative": (_set("memory", cpu_weight_bytes=-(10 ** 9)), "cpu_weight_bytes expected >= 0"),
    "string_for_number": (_set("memory", max_context="1e12"), "max_context"),
    "unknown_key": (lambda d: d.update(exec="rm -rf /"), "exec"),
    "unknown_key_in_a_part": (_set("placement", exec="rm -rf /"), "exec"),
    "a_later_format": (lambda d: d.update(format_version=3), "format_version expected 2 (or 1, read into the parts), "
                                                              "found 3"),
    "flat_with_a_bad_value": (lambda d: (d.update(_flat(d)), d.update(format_version=1),
                                         [d.pop(k) for k in ("placement", "predictions", "memory", "workload",
                                                             "provenance")], d.update(max_context=10 ** 12)),
                              "max_context expected 1.."),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_override(case, tiny, tmp_path, workdir):
    d = _plan(tiny)
    edit, words = BAD_PLANS[case]
    edit(d)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(d))
    refused(cli("run", tiny.bundle("qwen3"), *RUN, "--plan", p), words)


def test_own_plan_as_override_runs(tiny, tmp_path, workdir):
    """The control: the bundle's own plan given with --plan passes every check and gives the same tokens."""
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(_plan(tiny)))
    a, b = cli("run", tiny.bundle("qwen3"), *RUN), cli("run", tiny.bundle("qwen3"), *RUN, "--plan", p)
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    assert json.loads(a.stdout.splitlines()[-1])["tokens"] == json.loads(b.stdout.splitlines()[-1])["tokens"]


def test_bundle_plan_json_with_huge_context(tiny, tmp_path, workdir):
    """A bundle whose plan.json (and manifest hash) was rewritten to a context of 10^12: refused on load."""
    b = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), b)
    d = json.loads((b / "plan.json").read_text())
    d["memory"]["max_context"] = 10 ** 12
    (b / "plan.json").write_text(json.dumps(d))
    m = json.loads((b / "manifest.json").read_text())
    data = (b / "plan.json").read_bytes()
    for f in m["files"]:
        if f["path"] == "plan.json":
            f.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (b / "manifest.json").write_text(json.dumps(m))
    refused(cli("run", b, *RUN), "bundle: plan.json: max_context expected 1..")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_plan_special_file_is_refused_without_blocking(kind, tiny, tmp_path, workdir):
    """A FIFO with no writer would block an open() forever: the real CLI process refuses it at once."""
    p = tmp_path / "plan"
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p = "/dev/zero"
    helmc = os.path.join(os.path.dirname(sys.executable), "helmc")
    r = subprocess.run([helmc, "run", tiny.bundle("qwen3"), *RUN, "--plan", str(p)], capture_output=True, text=True,
                       timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.startswith("helmc:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "--plan: expected a regular file, found a" in lines[0], lines
