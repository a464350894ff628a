"""`logprobs` / `top_logprobs` and `n` choices of a real `helmc serve` process on the tiny Qwen3 (8 slots, a ChatML
template), through the official openai client: each greedy token's log-probability is the log-softmax (float64)
of the logits the runtime's own Session gives for that step; top tokens sorted, of the asked count; n choices with
indices 0..n-1 that a seed repeats, streamed and not; bad values a 400 naming what was expected."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.reliability.serve_process import CHATML, Server, bundle_with_template, http

pytest.importorskip("openai")
pytest.importorskip("starlette")


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("logprobs")
    return bundle_with_template(tiny.bundle("qwen3", batch=8), str(d / "tiny.bundle"), CHATML)


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    s = Server(served, tmp_path_factory.mktemp("logprobs-log") / "serve.log", "--max-batch", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def session(served):
    from helmc.runtime.session import Session
    return Session.load(served)


def greedy_steps(session, prompt_ids, n):
    """The Session's greedy tokens (EOS or not) and each step's log-softmax (float64) of its own logits."""
    from helmc.runtime.logprobs import log_softmax
    session.reset()
    row, tokens, steps = session.forward(list(prompt_ids))[-1], [], []
    for _ in range(n):
        steps.append(log_softmax(row))
        tokens.append(int(np.argmax(row)))
        row = session.forward([tokens[-1]])[-1]
    return tokens, steps


def test_completion_logprobs_are_the_sessions_log_softmax(client, session):
    prompt = session.tokenizer.encode("The quick brown fox").ids
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    r, plain = client.completions.create(logprobs=3, **kw), client.completions.create(**kw)
    assert plain.choices[0].logprobs is None and r.choices[0].text == plain.choices[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) \
        == r.usage.completion_tokens == 12
    tokens, steps = greedy_steps(session, prompt, 12)
    assert lp.tokens == [session.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    worst = 0.0
    for i, (tok, row) in enumerate(zip(tokens, steps)):
        worst = max(worst, abs(lp.token_logprobs[i] - row[tok]))
        expected = {}
        for t in np.argsort(-row, kind="stable")[:3]:          # keyed by text: two tokens of one text, the likelier
            expected.setdefault(session.tokenizer.decode([int(t)], skip_special_tokens=False), row[t])
        assert lp.top_logprobs[i] == pytest.approx(expected, abs=1e-6)
        best = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert lp.token_logprobs[i] <= 0 and best[0] >= lp.token_logprobs[i]
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]          # the chosen token among them
    print(f"completion logprobs vs the Session's log-softmax: max abs diff {worst:.2e}")
    assert worst <= 1e-6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in client.completions.create(logprobs=3, stream=True, **kw):
        for k, v in streamed.items():
            v += getattr(c.choices[0].logprobs, k) if c.choices[0].logprobs else []
    assert streamed == {k: getattr(lp, k) for k in streamed}                      # offsets go on across chunks


def test_chat_logprobs_shape_bytes_and_values(client, session, served):
    from helmc.runtime.serve.chat_template import load_chat_template
    messages = [{"role": "user", "content": "Tell me about foxes"}]
    text = load_chat_template(served).render(messages, add_generation_prompt=True)
    prompt = session.tokenizer.encode(text, add_special_tokens=False).ids
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(prompt)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    tokens, steps = greedy_steps(session, prompt, 10)
    for e, tok, row in zip(content, tokens, steps):
        assert e.logprob == pytest.approx(row[tok], abs=1e-6) and e.logprob <= 0
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and tops[0] >= e.logprob
        assert tops == pytest.approx(sorted(row, reverse=True)[:5], abs=1e-6)
        assert e.top_logprobs[0].token == e.token and all(isinstance(t.bytes, list) for t in e.top_logprobs)
    # the bytes put together are the tokens' text, a character split over tokens included
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined == session.tokenizer.decode(tokens, skip_special_tokens=False)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_n_choices_repeat_with_a_seed(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=5, logprobs=2)
    a, b = client.completions.create(n=3, **kw), client.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]                 # the seed repeats every choice
    assert len({c.text for c in a.choices}) > 1                                      # each choice its own draw
    one = client.completions.create(n=1, **kw)
    assert one.choices[0].text == a.choices[0].text                                  # choice 0 is the lone request's
    assert a.usage.prompt_tokens == one.usage.prompt_tokens                          # the prompt counted once
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)
    for c in a.choices:
        for chosen, tops in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
            assert chosen <= 0 and max(tops.values()) >= chosen and 1 <= len(tops) <= 3      # texts may coincide


def test_n_choices_streamed_equal_the_whole_response(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "A story"}], max_tokens=12, temperature=0.9, seed=9,
              n=2, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    text, entries, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    parts = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for p in parts:
        for c in p.choices:
            text[c.index] += c.delta.content or ""
            entries[c.index] += c.logprobs.content if c.logprobs else []
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in whole.choices:
        assert text[c.index] == c.message.content and finish[c.index] == c.finish_reason
        assert [(e.token, e.logprob) for e in entries[c.index]] == [(e.token, e.logprob) for e in c.logprobs.content]
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens == sum(len(e) for e in entries.values())


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"n": 0}, "n", "n: expected a value in [1, 8], found 0"),
    ("/v1/completions", {"n": 9}, "n", "n: expected a value in [1, 8], found 9"),
    ("/v1/completions", {"n": "2"}, "n", "n: expected an integer"),
    ("/v1/completions", {"logprobs": 6}, "logprobs", "expected an integer in [0, 5]"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "expected an integer in [0, 5]"),
    ("/v1/chat/completions", {"logprobs": 2}, "logprobs", "expected a boolean"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20], found 21"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "expected logprobs: true"),
])
def test_bad_n_or_logprobs_is_a_400(server, path, body, param, words):
    base = {"model": "tiny", "max_tokens": 2, **({"prompt": "hi"} if "chat" not in path else
                                                 {"messages": [{"role": "user", "content": "hi"}]})}
    r = http().post(server.url + path, content=json.dumps({**base, **body}), headers={"content-type": "application/json"},
                    timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert "Traceback" not in server.text()
