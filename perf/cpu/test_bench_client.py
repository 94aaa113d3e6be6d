"""The benchmark client (`minisgl-run bench-serving`) against a stub server that streams as fast as it
can (perf/stub_server.py, in a subprocess): the tokens per second the client counts at 256 concurrent
streams of 1,024 tokens, with 1 and 3 tokens per SSE chunk, in the client's default number of
processes (1 on a 2-core host, 4 on a 16-core one). The engine it measures makes ~23,000 tok/s at 256
streams; the client should count at least 3x that. Run with `nox -s perf`; the figures are printed and
kept in extra_info. The same measurement from a script: `perf.stub_server.measure_client(...)`."""

import pytest

from perf.stub_server import measure_client, summary

STREAMS = 256
OUTPUT_LEN = 1024


@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
def test_client_counts_256_streams(benchmark, tokens_per_chunk):
    report = benchmark.pedantic(
        measure_client,
        kwargs=dict(
            num_prompts=STREAMS,
            tokens_per_chunk=tokens_per_chunk,
            output_len=OUTPUT_LEN,
            max_concurrency=STREAMS,
            timeout=300,
        ),
        rounds=1,
        iterations=1,
    )
    assert report["completed"] == STREAMS and report["total_output_tokens"] == STREAMS * OUTPUT_LEN
    benchmark.extra_info.update(
        {
            "tokens_per_chunk": tokens_per_chunk,
            "streams": STREAMS,
            "client_processes": report["client_processes"],
            "event_loop": report["event_loop"],
            "tokens_per_s_counted": report["output_throughput"],
            "ttft_p50_ms": report["ttft_ms"]["p50"],
        }
    )
    print("\n" + summary(report))
