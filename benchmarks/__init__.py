"""helmc's benchmarks: scripts that measure a build or a bundle on this machine (and llama.cpp beside it), run from
the repository root as modules (`python -m benchmarks.bench_decode ...`), and the helpers they share. Not part of
the installed package; benchmarks/README.md lists every script, its command and what it writes."""
