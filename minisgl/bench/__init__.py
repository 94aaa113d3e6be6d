"""minisgl's benchmarks, one layer above the LLM front end and below the server (tests/test_layers.py).

- `minisgl.bench.offline`: the offline throughput benchmark (`minisgl-run bench`, `python -m minisgl
  bench`): a workload run on an `LLM` in this process.
- `minisgl.bench.workloads`: the prefix-cache workloads' generators (plain Python that other engines'
  scripts load by path).
- `minisgl.bench.serving`: the online benchmark (`minisgl-run bench-serving`), a client of a running
  server over HTTP; `minisgl.bench.client` is its HTTP/SSE client, `minisgl.bench.processes` its client
  processes. Neither imports the server nor, until
  it draws the offline workload, the engine.

This file imports nothing, so that the serving benchmark's client processes load no engine.
"""
