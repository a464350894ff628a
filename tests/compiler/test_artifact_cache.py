"""The artifact cache key: what a compiled stage library was made from."""
def test_cache_key_follows_the_schedules_sources(tmp_path, monkeypatch):
    """An edited kernel must never be served from the artifact cache: the key hashes the schedules."""
    import helmc.schedules as schedules
    from helmc.compiler.artifact_cache import cache_key
    extra = tmp_path / "extra_schedule.py"
    extra.write_text("TILE = 16\n")
    monkeypatch.setattr(schedules, "__path__", [*schedules.__path__, str(tmp_path)])
    before = cache_key("arch", "cpu", "llvm")
    assert cache_key("arch", "cpu", "llvm") == before                     # deterministic
    extra.write_text("TILE = 32\n")
    assert cache_key("arch", "cpu", "llvm") != before
