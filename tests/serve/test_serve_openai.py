"""`helmc serve` on a tiny Qwen3 bundle (plan made for 8 sequences) against the official openai client on
loopback: chat and text completions, streamed and not, equal to `helmc run` greedy on the same (templated)
prompt; batched decode equal to single-request decode; a 32-client load test; disconnects; bad requests;
`helmc chat` through a pipe. The server is a real process; nothing is mocked."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from chat_templates import QWEN3

pytest.importorskip("openai")
pytest.importorskip("starlette")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT}
MAX_BATCH = 8


def cli(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "helmc.cli.main", *args], env=env or ENV, capture_output=True,
                          text=True, timeout=kw.pop("timeout", 300), **kw)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, host_hardware, cache_dir):
    from helmc.testing import make_tiny_model
    d = str(tmp_path_factory.mktemp("serve") / "qwen3-chat")
    make_tiny_model(d, "qwen3")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": QWEN3, "eos_token": "<|endoftext|>", "bos_token": None}, f)
    out, hw = d + ".bundle", d + "-hardware.json"
    host_hardware.save(hw)
    # The session's artifact cache: the tiny Qwen3's batch-8 stage is the served bundles' of tests/reliability and
    # test_serve_logprobs.py, compiled once for all of them
    r = cli("build", d, hw, "-o", out, "--max-batch", str(MAX_BATCH), env={**ENV, "HELMC_CACHE_DIR": cache_dir})
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "plan.json")) as f:
        assert json.load(f)["workload"]["batch"] == MAX_BATCH                  # the plan is made for the server's batch
    return out


@pytest.fixture(scope="module")
def session(bundle):
    from helmc.runtime.session import Session
    return Session.load(bundle)


@pytest.fixture(scope="module")
def server(bundle):
    p = subprocess.Popen([sys.executable, "-m", "helmc.cli.main", "serve", bundle, "--port", "0", "--model-name", "tiny"],
                         env=ENV, stderr=subprocess.PIPE, text=True)
    line = ""
    t0 = time.time()
    while "listening on" not in line:
        line = p.stderr.readline()
        assert line or p.poll() is None, "helmc serve exited before listening"
        assert time.time() - t0 < 120, "helmc serve did not start in 120 s"
    url = line.split("listening on ")[1].split(" ")[0]
    yield url
    p.terminate()
    p.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def http_client():
    """The HTTP package the installed openai client is built on (httpx, or httpx2 in its newer releases)."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        import httpx
        return httpx


def health(server):
    httpx = http_client()
    return httpx.get(server + "/health").json()


def reference(session, prompt_ids, n):
    """Greedy single-request output (the Session's own token loop), as text and token count."""
    r = session.generate(prompt_ids=list(prompt_ids), max_new_tokens=n)
    return session.tokenizer.decode(r.tokens), len(r.tokens)


# ------------------------------------------------------------------ batched decode, in process
def test_batched_decode_equals_single_requests(session):
    from helmc.runtime.serve.batch_model import BatchModel
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, 500, size=n)) for n in (3, 9, 1, 17, 5, 30, 2, 11)]
    steps = 24
    singles = []
    for p in prompts:
        session.reset()
        rows = [session.forward(p)[-1]]
        for _ in range(steps - 1):
            rows.append(session.forward([int(np.argmax(rows[-1]))])[-1])
        singles.append(np.stack(rows))                       # [steps, V] logits of the single-request run
    m = BatchModel(session, MAX_BATCH)
    # Staggered: requests join a running batch (prefilled while the others are mid-decode), as the engine does.
    logits = {b: [] for b in range(len(prompts))}
    for t in range(steps + 3):
        active = [b for b in range(len(prompts)) if b // 3 <= t and len(logits[b]) < steps]
        new = [b for b in active if not logits[b]]
        for b in new:
            logits[b].append(m.prefill(b, prompts[b]))
        old = [b for b in active if b not in new]
        if old:
            rows = m.decode(old, [int(np.argmax(logits[b][-1])) for b in old])
            for b, row in zip(old, rows):
                logits[b].append(row)
    worst = 0.0
    for b in range(len(prompts)):
        got = np.stack(logits[b])
        assert got.shape == singles[b].shape
        worst = max(worst, float(np.abs(got - singles[b]).max() / np.abs(singles[b]).max()))
        assert list(got.argmax(1)) == list(singles[b].argmax(1)), f"request {b}: greedy tokens differ"
    print(f"batched vs single logits: max rel diff {worst:.2e}")
    assert worst == 0.0           # batch-invariant decode: every bit of every logit equal
    assert m.pages_in_use() > 0
    for b in range(MAX_BATCH):
        m.free(b)
    assert m.pages_in_use() == 0
    for B in (1, MAX_BATCH):                                 # what batching buys on this CPU (printed, not asserted)
        for b in range(B):
            m.prefill(b, prompts[b])
        n, t0 = 40, time.perf_counter()
        for _ in range(n):
            m.decode(list(range(B)), [7] * B)
        print(f"decode batch {B}: {B * n / (time.perf_counter() - t0):.0f} tok/s")
        for b in range(B):
            m.free(b)



def test_prompts_prefilled_together_equal_single_requests(session):
    """BatchModel.prefill_many: 8 prompts at once, cut into chunks of 16 rows that share steps (several
    prompts per step, a prompt over several steps, one-row chunks as one batched decode step), then decoded
    together: every logit bit-identical to each prompt's single-request run. Then the engine with 8 requests
    submitted at once prefills them in one call, and each response equals its greedy reference."""
    from helmc.runtime.sampling import SamplingParams
    from helmc.runtime.serve.batch_model import BatchModel
    from helmc.runtime.serve.engine import Engine
    from helmc.runtime.serve.protocol import Request
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(1, 500, size=n)] for n in (3, 9, 1, 17, 5, 30, 2, 11)]
    steps = 6
    m = BatchModel(session, MAX_BATCH)
    m.chunk = 16          # the single prefill's chunks too: 17 -> 16 + 1, 30 -> 16 + 14
    singles = []          # each request alone, as the engine runs one: prefill, then one-row decode steps
    for p in prompts:
        rows = [m.prefill(0, p)]
        for _ in range(steps - 1):
            rows.append(m.decode([0], [int(np.argmax(rows[-1]))])[0])
        singles.append(np.stack(rows))
        m.free(0)
    calls = []
    for kind in ("_prefill_rows", "_decode_rows"):
        run = getattr(m, kind)
        setattr(m, kind, lambda slots, ids, run=run: calls.append([len(r) for r in ids]) or run(slots, ids))
    logits = [[row] for row in m.prefill_many(list(enumerate(prompts)))]
    assert [3, 9] in calls and [16] in calls and [14, 2] in calls and [1, 1] in calls, calls   # each kind of step
    for _ in range(steps - 1):
        for b, row in enumerate(m.decode(list(range(8)), [int(np.argmax(lg[-1])) for lg in logits])):
            logits[b].append(row)
    for b in range(8):
        got = np.stack(logits[b])
        same = got.view(np.uint32) == singles[b].view(np.uint32)
        assert same.all(), f"request {b} ({len(prompts[b])} tokens): logits differ first at step {(~same).any(1).argmax()}"
        m.free(b)
    del m._prefill_rows, m._decode_rows
    eng = Engine(m, session.tokenizer, session.spec.eos_token_ids)
    batched, done = [], {}
    prefill_many, m.prefill_many = m.prefill_many, lambda items: batched.append(len(items)) or prefill_many(items)
    for b, p in enumerate(prompts):
        eng.submit(Request(f"r{b}", tuple(p), SamplingParams(max_tokens=steps, ignore_eos=True)),
                   lambda c, b=b: done.setdefault(b, []).extend(c.token_ids))
    while len(eng._running) or eng.scheduler.waiting or not done:
        eng.step()
    assert batched == [8], batched                                            # one prefill for all eight
    for b in range(8):
        assert done[b] == list(singles[b].argmax(1)), f"request {b}: tokens differ from its single run"
    assert m.pages_in_use() == 0

def test_max_batch_over_the_plan_is_refused(bundle):
    r = cli("serve", bundle, "--max-batch", str(MAX_BATCH + 1), "--port", "0", timeout=120)
    assert r.returncode == 2
    assert f"--max-batch {MAX_BATCH + 1}: the bundle's plan was made for at most {MAX_BATCH} sequences" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------ the openai client
def test_models_health_metrics(client, server):
    httpx = http_client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert health(server)["status"] == "ok"
    text = httpx.get(server + "/metrics").text
    for name in ("helmc_requests_total", "helmc_queue_requests", "helmc_time_to_first_token_seconds_bucket",
                 "helmc_decode_tokens_per_second_bucket", "helmc_kv_pages_in_use"):
        assert name in text


def test_chat_equals_helmc_run_on_the_templated_prompt(client, bundle, session):
    from helmc.runtime.serve.chat_template import load_chat_template
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
    prompt = load_chat_template(bundle).render(messages, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    run = cli("run", bundle, "--prompt", prompt, "--max-new-tokens", "12", "--json")
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == expected["text"] and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(expected["prompt_ids"]) and r.usage.completion_tokens == len(expected["tokens"])
    assert r.choices[0].finish_reason == ("stop" if expected["stop_reason"] == "eos" else "length")
    parts = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == expected["text"]
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == r.choices[0].finish_reason
    assert parts[-1].usage.completion_tokens == len(expected["tokens"]) and not parts[-1].choices


def test_text_completion_equals_helmc_run(client, bundle):
    run = cli("run", bundle, "--prompt", "The quick brown fox", "--max-new-tokens", "10", "--json")
    expected = json.loads(run.stdout)
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0)
    assert r.choices[0].text == expected["text"] and r.usage.completion_tokens == len(expected["tokens"])
    s = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in s) == expected["text"]
    ids = client.completions.create(model="tiny", prompt=expected["prompt_ids"], max_tokens=10, temperature=0)
    assert ids.choices[0].text == expected["text"]                          # token ids as the prompt


def test_sampled_stream_is_the_one_shot_decode(client, bundle, session):
    """Sampled tokens of a random-weight model split characters into bytes: the streamed deltas put together are the
    one-shot decode of the tokens (`helmc run --json`'s text for the same seed), with no character lost."""
    split = 0
    for seed in (1, 2):
        run = cli("run", bundle, "--prompt", "Once upon a time", "--max-new-tokens", "64", "--temperature", "1",
                  "--seed", str(seed), "--json")
        expected = json.loads(run.stdout)
        ids = expected["tokens"]
        assert expected["text"] == session.tokenizer.decode(ids)
        s = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=64, temperature=1, seed=seed,
                                      stream=True)
        assert "".join(c.choices[0].text for c in s) == expected["text"], seed
        full = expected["text"]
        split += any((p := session.tokenizer.decode(ids[:i])).endswith("\ufffd") and not full.startswith(p)
                     for i in range(1, len(ids)))
    assert split                     # a character over several tokens, streamed whole


def test_sampling_options_reach_the_sampler(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.3, top_p=0.95, seed=11,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1}, frequency_penalty=0.5)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text                           # the seed repeats the draw
    greedy = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    full = greedy.choices[0].text
    if len(full) > 4:                                                       # stop strings cut before the stop
        stop = full[2:4]
        cut = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ bad requests
@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (json.dumps({"model": "other", "prompt": "hi"}).encode(), 404, "model"),
    (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "word " * 600}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 600}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "hi", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "hi", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": "tiny", "prompt": "hi", "n": 9}).encode(), 400, "n"),
    (json.dumps({"model": "tiny", "prompt": [1, 99999]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "hi", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps([1, 2]).encode(), 400, None),
])
def test_bad_requests_get_openai_errors(server, client, body, status, param):
    httpx = http_client()
    r = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    assert client.completions.create(model="tiny", prompt="still", max_tokens=2, temperature=0).choices  # still serving


def test_bad_chat_request(server, client):
    import openai
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": 5}])
    with pytest.raises(openai.BadRequestError, match="messages: expected a non-empty list"):
        client.chat.completions.create(model="tiny", messages=[])
    assert health(server)["running"] == 0


# ------------------------------------------------------------------ many clients
def test_load_32_streaming_clients_x_8(server, session):
    from openai import AsyncOpenAI
    clients, per_client = 32, 8
    jobs = [(c, i, f"Client {c} asks question {i}: the quick brown fox", 4 + (c * 7 + i * 3) % 13)
            for c in range(clients) for i in range(per_client)]
    refs = {(c, i): reference(session, session.tokenizer.encode(p).ids, n) for c, i, p, n in jobs}
    results, ttfts = {}, []

    async def one_client(api, c):
        for _, i, prompt, n in [j for j in jobs if j[0] == c]:
            t0, first, text, usage = time.perf_counter(), None, [], None
            stream = await api.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].text)
                if chunk.usage:
                    usage = chunk.usage
            ttfts.append((first or time.perf_counter()) - t0)
            results[(c, i)] = ("".join(text), usage.completion_tokens)

    async def main():
        api = AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
        await asyncio.gather(*(one_client(api, c) for c in range(clients)))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    assert len(results) == clients * per_client
    wrong = [k for k in refs if results[k] != refs[k]]
    assert not wrong, f"{len(wrong)} responses differ from their greedy reference, e.g. {wrong[0]}: " \
                      f"{results[wrong[0]]!r} != {refs[wrong[0]]!r}"
    tokens = sum(n for _, n in results.values())
    q = np.percentile(ttfts, [50, 99]) * 1000
    print(f"load: {clients} clients x {per_client} requests, {tokens} tokens in {wall:.1f} s: {tokens / wall:.0f} tok/s "
          f"total, TTFT p50 {q[0]:.0f} ms p99 {q[1]:.0f} ms")
    h = health(server)
    assert (h["running"], h["waiting"], h["kv_pages_in_use"], h["kv_pages_reserved"]) == (0, 0, 0, 0)


def test_clients_that_disconnect_leave_no_pages(server, client):
    httpx = http_client()
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0.8, "stream": True,
            "ignore_eos": True}
    for _ in range(3):
        with httpx.Client(timeout=30) as h:
            streams = [h.stream("POST", server + "/v1/completions", json=body) for _ in range(4)]
            for s in streams:
                r = s.__enter__()
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))     # it started generating
            assert health(server)["running"] >= 1
            for s in streams:
                s.__exit__(None, None, None)                                          # go away mid-stream
        t0 = time.time()
        while (h := health(server))["running"] or h["kv_pages_in_use"]:
            assert time.time() - t0 < 10, f"pages left behind after disconnects: {h}"
            time.sleep(0.05)
        assert h["kv_pages_reserved"] == 0 and h["waiting"] == 0
    assert client.completions.create(model="tiny", prompt="after", max_tokens=3, temperature=0).choices


# ------------------------------------------------------------------ helmc chat
def test_chat_cli_through_a_pipe(bundle, session):
    from helmc.runtime.serve.chat_template import load_chat_template
    template = load_chat_template(bundle)
    first = [{"role": "user", "content": "Hello there"}]
    ids = session.tokenizer.encode(template.render(first), add_special_tokens=False).ids
    reply, _ = reference(session, ids, 6)
    r = cli("chat", bundle, "--max-new-tokens", "6", input="Hello there\n/stats\n/reset\nHello there\n", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(reply + "\n[")
    stats, rest = r.stdout[len(reply) + 1:].split("\n", 1)
    assert re.fullmatch(r"\[\d+ tokens \((stop|length)\), prompt \d+ tokens, TTFT [\d.]+ ms, decode [\d.]+ tok/s, "
                        r"conversation 2 messages\]", stats), stats
    assert rest == "[conversation cleared]\n" + reply + "\n"   # the same greedy reply after /reset


def test_chat_help_and_ctrl_c_stops_the_reply(bundle):
    """/help lists the commands and reaches no model; Ctrl-C (SIGINT) while a reply is written stops that reply, and
    the chat goes on: /stats tells it was stopped, a next question is answered, /quit leaves with status 0."""
    import signal
    p = subprocess.Popen([sys.executable, "-m", "helmc.cli.main", "chat", bundle, "--max-new-tokens", "480",
                          "--temperature", "1", "--seed", "3"], env=ENV, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.stdin.write(b"/help\n/stats\nTell me a long story\n")
        p.stdin.flush()
        out = b""
        mark = b"[no reply yet]\n"
        while mark not in out or out.endswith(mark):       # /help's lines, /stats, then the reply's first bytes
            chunk = os.read(p.stdout.fileno(), 4096)
            assert chunk, p.stderr.read().decode()
            out += chunk
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(b"/stats\nHello\n/quit\n", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    text = (out + rest).decode()
    assert p.returncode == 0, err.decode()
    assert "/reset" in text and "/quit" in text and "[no reply yet]" in text   # /help went to no model
    assert " [stopped]\n" in text
    stats = re.findall(r"\[(\d+) tokens \(([^)]*)\)", text)
    assert stats and stats[0][1] == "stopped by Ctrl-C" and 0 < int(stats[0][0]) < 480, text
    assert b"helmc chat: " in err and b"/help" in err                             # the banner, on stderr
