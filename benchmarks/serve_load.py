"""Load test of `helmc serve` with a share of bad requests: does any good request fail or change?

Starts `helmc serve BUNDLE`, runs each good request alone once (its reference output), then for --duration
seconds runs --clients concurrent streaming clients; a --bad-share of their requests are bad in the ways a
careless or hostile client is (a tiny temperature, over-long stop strings, a 5 MB body, JSON nested 100,000 deep,
lone surrogates, template arguments that collide, malformed tool_calls, clients that go away mid-body or before a
non-streamed answer). Meanwhile /health is probed every 100 ms. Reports good requests failed or changed
(output vs its lone run), /health p50/p99 latency, the server's RSS growth after the references, and the KV pages
held at the end (/metrics), as a table and one JSON line.

    python benchmarks/serve_load.py BUNDLE [--clients 16] [--duration 600] [--bad-share 0.33] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def child_env() -> dict:
    """The server's environment: this checkout first on PYTHONPATH, then whatever the caller had there (the GPU
    machine's runtime-only TVM and packages travel that way)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}

def start_server(bundle: str, log_path: str):
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "helmc.cli.main", "serve", bundle, "--port", "0", "--model-name", "m"],
                            env=child_env(), stderr=log, stdout=subprocess.DEVNULL)
    t0 = time.time()
    while True:
        text = open(log_path).read()
        if "listening on " in text:
            return proc, text.split("listening on ")[1].split(" ")[0]
        if proc.poll() is not None or time.time() - t0 > 300:
            sys.exit(f"serve_load: helmc serve did not start: {text[-500:]}")
        time.sleep(0.2)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def good_requests(chat: bool) -> list[tuple[str, dict]]:
    out = []
    for i in range(12):
        body = {"model": "m", "max_tokens": 8 + 2 * i, "ignore_eos": True,
                **({"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i, "top_p": 0.95})}
        if chat and i % 3 == 0:
            out.append(("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Question {i}?"}]}))
        else:
            out.append(("/v1/completions", {**body, "prompt": f"Request {i}: once upon a time"}))
    return out


def bad_requests(chat: bool) -> list:
    """(name, path, raw body or a callable taking the url) of each kind of bad request."""
    msg = [{"role": "user", "content": "hi"}]
    kinds = [
        ("tiny-temperature", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 8, "temperature": 1e-300}),
        ("long-stop", "/v1/completions", {"model": "m", "prompt": "x", "stop": ["s" * 100_000]}),
        ("many-stops", "/v1/completions", {"model": "m", "prompt": "x", "stop": ["a"] * 1000}),
        ("huge-body", "/v1/completions", b'{"model": "m", "prompt": "' + b"a" * (5 << 20) + b'"}'),
        ("deep-json", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
        ("surrogate", "/v1/completions", b'{"model": "m", "prompt": "\\ud800"}'),
        ("nan", "/v1/completions", b'{"model": "m", "prompt": "x", "temperature": NaN}'),
        ("huge-max-tokens", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 10 ** 30}),
        ("mid-body-disconnect", "/v1/completions", None),
        ("non-stream-disconnect", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 400, "ignore_eos": True}),
    ]
    if chat:
        kinds += [("template-kwargs", "/v1/chat/completions", {"model": "m", "messages": msg,
                                                               "chat_template_kwargs": {"messages": 1}}),
                  ("tool-calls", "/v1/chat/completions", {"model": "m", "messages": [
                      {"role": "assistant", "content": "x", "tool_calls": [{"function": 5}]}]})]
    return kinds


async def stream(client, url, path, body) -> str:
    out = []
    async with client.stream("POST", url + path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                if "error" in obj:
                    raise RuntimeError(obj["error"]["message"])
                c = obj["choices"][0]
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


async def whole(client, url, path, body) -> str:
    r = await client.post(url + path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
    c = r.json()["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


async def bad(client, url, kind):
    name, path, body = kind
    host, port = url.split("//")[1].split(":")
    if name == "mid-body-disconnect":
        _, w = await asyncio.open_connection(host, int(port))
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        await w.drain()
        w.close()
        return
    if name == "non-stream-disconnect":
        try:
            await client.post(url + path, json=body, timeout=0.2)
        except Exception:
            pass
        return
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    try:
        await client.post(url + path, headers={"content-type": "application/json"}, **kw)
    except Exception:
        pass                                     # a refused upload may close mid-send


async def load(url, goods, refs, bads, clients, duration, bad_share, rng):
    httpx = _http()
    stats = {"good": 0, "good_failed": 0, "good_changed": 0, "bad": 0, "examples": []}
    end = time.time() + duration

    async def one_client(c):
        async with httpx.AsyncClient(timeout=120) as client:
            while time.time() < end:
                if rng.random() < bad_share:
                    stats["bad"] += 1
                    await bad(client, url, rng.choice(bads))
                    continue
                i = rng.randrange(len(goods))
                stats["good"] += 1
                try:
                    got = await stream(client, url, *goods[i])
                except Exception as e:
                    stats["good_failed"] += 1
                    stats["examples"].append(f"request {i} failed: {e}")
                    continue
                if got != refs[i]:
                    stats["good_changed"] += 1
                    stats["examples"].append(f"request {i}: {got!r} != {refs[i]!r}")
    await asyncio.gather(*(one_client(c) for c in range(clients)))
    return stats


def probe_health(url, stop: threading.Event, out: list):
    httpx = _http()
    with httpx.Client(timeout=30) as h:
        while not stop.is_set():
            t0 = time.perf_counter()
            h.get(url + "/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--bad-share", type=float, default=1 / 3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None, help="also write the JSON line to this file")
    ap.add_argument("--log", default="serve_load.log", help="the server's stderr")
    a = ap.parse_args(argv)
    httpx = _http()
    proc, url = start_server(a.bundle, a.log)
    try:
        chat = "chat template yes" in open(a.log).read()
        goods, bads = good_requests(chat), bad_requests(chat)
        refs = []
        for path, body in goods:                               # each good request alone, not streamed
            refs.append(asyncio.run(_alone(url, path, body)))
        rss0 = rss_kib(proc.pid)
        stop, lat = threading.Event(), []
        prober = threading.Thread(target=probe_health, args=(url, stop, lat))
        prober.start()
        t0 = time.time()
        stats = asyncio.run(load(url, goods, refs, bads, a.clients, a.duration, a.bad_share, random.Random(a.seed)))
        wall = time.time() - t0
        stop.set()
        prober.join()
        time.sleep(1.0)
        rss1 = rss_kib(proc.pid)
        metrics = httpx.get(url + "/metrics").text
        pages = {m: float(re.search(rf"^{m} (\S+)$", metrics, re.M).group(1))
                 for m in ("helmc_kv_pages_in_use", "helmc_kv_pages_reserved")}
    finally:
        proc.terminate()
        proc.wait(30)
    lat.sort()
    row = {"bundle": os.path.basename(os.path.normpath(a.bundle)), "clients": a.clients, "duration_s": round(wall, 1),
           "bad_share": round(a.bad_share, 3), "good": stats["good"], "bad": stats["bad"],
           "good_failed": stats["good_failed"], "good_changed": stats["good_changed"],
           "health_p50_ms": round(1000 * lat[len(lat) // 2], 1), "health_p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 1),
           "health_max_ms": round(1000 * lat[-1], 1), "health_probes": len(lat),
           "rss_start_mib": round(rss0 / 1024, 1), "rss_end_mib": round(rss1 / 1024, 1),
           "rss_growth_pct": round(100 * (rss1 - rss0) / rss0, 2),
           "kv_pages_in_use_end": pages["helmc_kv_pages_in_use"], "kv_pages_reserved_end": pages["helmc_kv_pages_reserved"]}
    for k in ("good", "bad", "good_failed", "good_changed", "health_p50_ms", "health_p99_ms", "health_max_ms",
              "rss_start_mib", "rss_end_mib", "rss_growth_pct", "kv_pages_in_use_end", "kv_pages_reserved_end"):
        print(f"  {k:<22} {row[k]}")
    for e in stats["examples"][:5]:
        print("  e.g. " + e)
    line = json.dumps(row)
    print(line)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(line + "\n")


def _http():
    """The HTTP package the installed openai client is built on (httpx, or httpx2 in its newer releases)."""
    try:
        import httpx2
        return httpx2
    except ImportError:
        import httpx
        return httpx


async def _alone(url, path, body):
    httpx = _http()
    async with httpx.AsyncClient(timeout=120) as client:
        return await whole(client, url, path, body)


if __name__ == "__main__":
    main()
