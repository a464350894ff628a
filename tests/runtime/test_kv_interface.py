"""Both KV caches implement runtime/kv/interface.KVCache, and the stages call nothing else on "a cache".

Signatures are compared with inspect: every parameter of the interface's method is accepted by the cache's
method at the same position and name, and anything the cache adds has a default. The stage code is read with
ast: every method called on `self.kv` (the stage's cache) or on an element of `caches` (a batch's slot caches)
is an interface method, except attend's `out=` on the GPU-only path (attn_out is given only by the GPU session).
"""
import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

from helmc.runtime.kv.cache_cpu import KVCacheCPU
from helmc.runtime.kv.cache_gpu import KVCacheGPU
from helmc.runtime.kv.interface import KV_CACHE_METHODS, KVCache
from kv_device_emulator import EmulatedOps

ROOT = Path(__file__).resolve().parents[2]


def _compatible(interface_fn, impl_fn) -> list[str]:
    """What of interface_fn's signature impl_fn does not accept (empty when compatible)."""
    want = list(inspect.signature(interface_fn).parameters.values())
    have = list(inspect.signature(impl_fn).parameters.values())
    problems = []
    for i, p in enumerate(want):
        if i >= len(have) or have[i].name != p.name or have[i].kind not in (p.kind, p.POSITIONAL_OR_KEYWORD):
            problems.append(f"parameter {i} expected {p.name!r}, found {have[i].name if i < len(have) else None!r}")
    for p in have[len(want):]:
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            problems.append(f"extra parameter {p.name!r} without a default")
    return problems


def test_interface_lists_its_methods():
    declared = {n for n, v in vars(KVCache).items() if callable(v) and not n.startswith("_")}
    assert declared == set(KV_CACHE_METHODS)


@pytest.mark.parametrize("cls", [KVCacheCPU, KVCacheGPU])
def test_both_caches_implement_the_interface(cls):
    for name in KV_CACHE_METHODS:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        assert _compatible(getattr(KVCache, name), getattr(cls, name)) == [], (cls.__name__, name)
    assert isinstance(getattr(cls, "length"), property), f"{cls.__name__}.length is not a property"


def test_signature_check_rejects_a_mismatch():
    class Wrong:
        def append(self, layer, key, v, extra): ...
    assert len(_compatible(KVCache.append, Wrong.append)) == 2


@pytest.mark.parametrize("make", [
    lambda: KVCacheCPU(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, max_tokens=8),
    lambda: KVCacheGPU(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, max_tokens=8, staging_pages=2,
                       ops=EmulatedOps(num_sms=2)),
], ids=["cpu", "gpu-emulated"])
def test_a_step_through_the_interface_alone(make):
    """The same two steps on either cache through KVCache's methods only, with the same result."""
    cache: KVCache = make()
    assert isinstance(cache, KVCache)
    xp = getattr(getattr(cache, "ops", None), "xp", np)
    rows = [np.full((1, 1, 8), v, np.float16) for v in (1.0, 3.0)]
    for k in rows:
        cache.append(0, xp.asarray(k), xp.asarray(k))
        out = cache.attend(0, xp.asarray(k), 0.01)
        cache.advance(1)
    assert cache.length == 2 and cache.max_tokens == 8
    w = np.exp(np.array([3.0, 9.0]) * 8 * 0.01)                   # q = 3 against keys 1 and 3, d = 8
    assert abs(float(np.asarray(out).ravel()[0]) - (w @ [1.0, 3.0]) / w.sum()) < 1e-2
    cache.reset()
    assert cache.length == 0


def _cache_calls(path: Path) -> dict[str, set[str]]:
    """Methods called on the stage's cache (self.kv.M) or on a loop variable over `caches` (kv.M), with keywords."""
    calls: dict[str, set[str]] = {}
    tree = ast.parse(path.read_text())
    loop_vars = {t.id for node in ast.walk(tree) if isinstance(node, (ast.For, ast.comprehension))
                 and "caches" in ast.unparse(node.iter) for t in ast.walk(node.target) if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner == "self.kv" or owner in loop_vars:
                calls.setdefault(node.func.attr, set()).update(k.arg for k in node.keywords)
    return calls


def test_stage_calls_only_interface_methods():
    calls = _cache_calls(ROOT / "runtime" / "stage.py")
    assert {"append", "attend", "advance"} <= set(calls), calls        # the check reads what it should
    assert set(calls) <= set(KV_CACHE_METHODS), sorted(set(calls) - set(KV_CACHE_METHODS))
    assert calls["attend"] <= {"out"}, calls["attend"]                 # out=: the GPU session's path only
