"""Property-based fuzzing of the HTTP API of a real `helmc serve` process: batches of well-formed requests (text and
chat, greedy or seeded sampling, stop strings, penalties, streamed or not) sent concurrently must each give exactly
the output the same request gives when it runs alone."""
from __future__ import annotations

import asyncio
import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from serve_process import http  # noqa: E402

WORDS = ["the", "fox", "ran", "über", "日本", "🙂", "a", "12", "\n", "tool", "cat", "  "]
text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join)
sampling = st.one_of(st.just({"temperature": 0}),
                     st.fixed_dictionaries({"temperature": st.floats(0.1, 1.5), "seed": st.integers(0, 2 ** 31),
                                            "top_p": st.floats(0.5, 1.0), "top_k": st.integers(0, 40)}),
                     st.fixed_dictionaries({"temperature": st.floats(1e-300, 1e-3), "seed": st.integers(0, 99)}))
extra = st.fixed_dictionaries({}, optional={"stop": st.lists(st.sampled_from(["a", "e ", "th", "\n"]), max_size=3),
                                            "frequency_penalty": st.floats(-1, 1), "repetition_penalty": st.floats(0.8, 1.3)})
request = st.builds(lambda kind, prompt, s, e, n, stream: (kind, stream, {
    "model": "tiny", "max_tokens": n, **s, **e,
    **({"prompt": prompt} if kind == "completion" else {"messages": [{"role": "user", "content": prompt}]})}),
    st.sampled_from(["completion", "chat"]), text, sampling, extra, st.integers(1, 24), st.booleans())


async def send(client, server, kind, stream, body):
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    if not stream:
        r = await client.post(server.url + path, json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return (c["text"] if kind == "completion" else c["message"]["content"]), c["finish_reason"]
    out, finish = [], None
    async with client.stream("POST", server.url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                c = obj["choices"][0]
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
                finish = c["finish_reason"] or finish
    return "".join(out), finish


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(request, min_size=2, max_size=8))
def test_concurrent_requests_equal_their_lone_runs(server, batch):
    async def together():
        async with http().AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(send(c, server, *r) for r in batch))

    async def alone():
        async with http().AsyncClient(timeout=120) as c:
            return [await send(c, server, kind, False, body) for kind, _, body in batch]
    got, want = asyncio.run(together()), asyncio.run(alone())
    for r, g, w in zip(batch, got, want):
        assert g == w, f"{r}: {g!r} concurrently, {w!r} alone"
