"""The serving benchmark on a GPU: `minisgl-run serve` against the engine offline, and against
Mini-SGLang's server (figures: docs/performance.md#serving).

    python -m perf.gpu.serving MODEL_DIR [--parts stub,peer,offline,http,chat,single,low,simple,light]
        [--reps 3] [--out DIR] [--peer DIR --peer-offline FILE] [--profile] [--shape cpu]

MODEL_DIR holds `config.json` and a tokenizer; the weights are dummy (the preset, `--config`). Parts:
stub (the client against `perf.stub_server`: what it can count), offline (the workload on the engine in
a child process, then each low-load prompt alone), http / chat / single / low (one `minisgl-run serve`
with a request trace: rate inf over completions and chat, one request alone, 4 requests/s with the
step-to-socket delay), simple (Mini-SGLang's `bench_simple.py` against it), peer (Mini-SGLang's offline
pass and server, `--peer`), light (the light-load goal: both servers side by side at 4 requests/s in
chat mode). Every run's JSON goes under --out and a table of the figures is printed last. Servers bind
to 127.0.0.1 and are stopped at the end of their part; every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from perf.common import (
    CPU_ARGS,
    WARM_UP,
    ServerProcess,
    bench_serving,
    children,
    dump_stalled,
    free_port,
    http_get,
    last_json,
    median,
    model_parser,
    report_line,
    serve_command,
    stop_servers_on_sigterm,
)

LOW_RATE, LOW_PROMPTS = 4.0, 128
# a light-load run (128 requests at 4 per second: 37 s of requests; about 90 s on the H100 host while the
# client processes were spawned with multiprocessing, each importing torch) is stopped past this and
# reported stalled
LOW_RUN_TIMEOUT_S = 150
# a warm-up (a server's first requests, which may compile kernels) past this is stopped and reported
WARM_UP_TIMEOUT_S = 400


# -------------------------------------------------------------------------------------------- the parts


def part_stub(out: Path) -> dict[str, Any]:
    from perf.stub_server import measure_client

    rows = {}
    for tokens_per_chunk in (1, 3):
        report = measure_client(256, tokens_per_chunk, stub_processes=4, output_len=1024)
        report.pop("requests", None)
        rows[f"stub_{tokens_per_chunk}tpc"] = report
        print(
            f"stub, {tokens_per_chunk} token(s)/chunk: client counted {report['output_throughput']:,.0f} tok/s "
            f"({report.get('client_processes')} client processes), TTFT p50 {report['ttft_ms']['p50']:.1f} ms",
            flush=True,
        )
    (out / "stub.json").write_text(json.dumps(rows, indent=1))
    return rows


def _offline_child(
    model: str, config: str, reps: int, low_prompts: list[list[int]], path: str, cpu: bool
) -> None:
    """In a child process: `reps` passes of the offline workload, then each low-load prompt alone."""
    from minisgl.bench.offline import CPU_SHAPE, WorkloadShape, make_workload, run_pass
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    os.environ["TQDM_DISABLE"] = "1"
    llm = LLM(model, config=config)
    try:
        vocab = llm.engine.config.model_config.vocab_size
        prompts, max_tokens = make_workload(CPU_SHAPE if cpu else WorkloadShape(), vocab)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=8, ignore_eos=True))
        passes = []
        for _ in range(reps):
            llm.flush_cache()
            r = run_pass(llm, prompts, max_tokens, 0.6)
            passes.append(
                {"tok_s": r.tokens_per_s, "ttft_p50_ms": 1e3 * r.ttft_p50, "ttft_p99_ms": 1e3 * r.ttft_p99}
            )
            print(
                f"offline pass: {r.tokens_per_s:,.0f} tok/s, TTFT p50 {1e3 * r.ttft_p50:.0f} ms", flush=True
            )
        # the engine's own time per token at the batch sizes of the low-load run (512 + 512 tokens)
        floors = {}
        for batch, temperature in ((1, 0.0), (1, 0.6), (2, 0.6), (4, 0.6), (8, 0.6)):
            batch_prompts = [p[:512] for p in prompts[:batch]]
            params = SamplingParams(max_tokens=512, temperature=temperature, ignore_eos=True)
            llm.generate(batch_prompts, params)  # the first run of a size may compile its prefill
            started = time.perf_counter()
            outputs = llm.generate(batch_prompts, params)
            seconds = time.perf_counter() - started
            first = max(o.time_to_first_token for o in outputs)
            floors[f"bs{batch}_t{temperature}"] = 1e3 * (seconds - first) / 511
        print(f"engine ms per decode step: {floors}", flush=True)
        alone = []
        for prompt in low_prompts:
            llm.flush_cache()
            [o] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.6, ignore_eos=True))
            alone.append(1e3 * o.time_to_first_token)
        Path(path).write_text(json.dumps({"passes": passes, "alone_ttft_ms": alone, "decode_ms": floors}))
    finally:
        llm.shutdown()


def part_offline(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import multiprocessing as mp

    from minisgl.bench.serving import workload

    cpu = {"min_input": 16, "max_input": 128} if args.shape == "cpu" else {}
    low = [r.prompt for r in workload(args.low_prompts, **cpu)]
    path = out / "offline.json"
    proc = mp.get_context("spawn").Process(
        target=_offline_child, args=(args.model, args.config, args.reps, low, str(path), args.shape == "cpu")
    )
    proc.start()
    proc.join(1800)
    if proc.exitcode != 0:
        proc.kill()
        raise RuntimeError(f"the offline child failed (exit code {proc.exitcode})")
    return json.loads(path.read_text())


def _serve(args: argparse.Namespace, out: Path, name: str, port: int, *extra: str) -> ServerProcess:
    cmd = serve_command(args.config, port, *extra, model=args.model)
    proc = ServerProcess(cmd, out / f"{name}.log", f"http://127.0.0.1:{port}/health")
    print(f"{name}: up in {proc.start_s:.0f} s", flush=True)
    return proc


def _trace_slice(path: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines[start:]], len(lines)


def start_profiles(
    server: ServerProcess, out: Path, name: str, delay: float, seconds: int
) -> list[subprocess.Popen]:
    """py-spy (if on PATH), idle samples included, on the front end and the scheduler process: from
    `delay` seconds on, for `seconds`; raw stacks to out/spy-NAME-{frontend,scheduler}.txt."""
    spy = shutil.which("py-spy")
    if spy is None:
        return []
    front = server.proc.pid
    # the scheduler: the front end's child that runs minisgl (not multiprocessing's resource tracker)
    kids = [
        pid for pid in children(front) if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    targets = {"frontend": front, **{f"scheduler{i}": pid for i, pid in enumerate(kids)}}
    return [
        subprocess.Popen(
            [
                "bash",
                "-c",
                f'sleep {delay}; exec "$0" record -p {pid} -d {seconds} -r 250 --idle -f raw -o "$1"',
                spy,
                str(out / f"spy-{name}-{who}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for who, pid in targets.items()
    ]


def summarize_profiles(out: Path, top: int = 30) -> None:
    """For each py-spy raw file: the functions of most own samples and of most samples in all."""
    for path in sorted(out.glob("spy-*.txt")):
        own: dict[str, int] = {}
        within: dict[str, int] = {}
        total = 0
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n, frames = int(count), stack.split(";")
            total += n
            own[frames[-1]] = own.get(frames[-1], 0) + n
            for frame in set(frames):
                within[frame] = within.get(frame, 0) + n
        lines = [f"{path.name}: {total} samples"]
        for title, table in (("own", own), ("inclusive", within)):
            lines.append(f"-- {title}")
            lines += [
                f"{100 * n / max(total, 1):5.1f}%  {f[:160]}"
                for f, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]
            ]
        path.with_suffix(".top").write_text("\n".join(lines) + "\n")


def breakdown(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stage of the request trace: mean, p50 and p99 in ms over the records that have it."""
    from minisgl.bench.serving import percentile
    from minisgl.server.jobs import TRACE_STAGES

    table = {}
    for _, stage in TRACE_STAGES:
        values = [1e3 * r["stages_s"][stage] for r in records if r["stages_s"][stage] is not None]
        if values:
            table[stage] = {
                "mean": statistics.fmean(values),
                "p50": percentile(values, 50),
                "p99": percentile(values, 99),
            }
    per_token = [
        1e3 * r["stages_s"]["decode"] / (r["completion_tokens"] / r["n"] - 1)
        for r in records
        if r["stages_s"]["decode"] is not None and r["completion_tokens"] / r["n"] > 1
    ]
    if per_token:  # the scheduler's time per output token (its decode stage over the tokens after the first)
        table["decode_per_token"] = {
            "mean": statistics.fmean(per_token),
            "p50": percentile(per_token, 50),
            "p99": percentile(per_token, 99),
        }
    splits = [r["delivery"]["split_mean_s"] for r in records if r["delivery"].get("split_mean_s")]
    if splits:  # step-to-socket, split: the scheduler's processing, the ZeroMQ hop, the front end
        table["delivery_split"] = {
            name: 1e3 * statistics.fmean(split[i] for split in splits)
            for i, name in enumerate(("scheduler", "zmq", "frontend"))
        }
    delays = [1e3 * r["delivery"]["max_s"] for r in records if r["delivery"]["max_s"] is not None]
    if delays:
        table["delivery_max"] = {
            "mean": statistics.fmean(delays),
            "p50": percentile(delays, 50),
            "p99": percentile(delays, 99),
        }
    return table


def histogram(text: str, name: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of a Prometheus histogram in exposition `text` (one label set)."""
    found = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            found.append((math.inf if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(found)


def histogram_quantile(
    before: list[tuple[float, float]], after: list[tuple[float, float]], q: float
) -> float:
    """The q-quantile (0..1) of the observations between two scrapes, interpolated within its bucket
    (Prometheus' histogram_quantile); seconds."""
    counts = [(le, a - b) for (le, a), (_, b) in zip(after, before or [(le, 0.0) for le, _ in after])]
    total = counts[-1][1]
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for le, cum in counts:
        if cum >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = le, cum
    return lower


def part_http(args: argparse.Namespace, out: Path, parts: set[str]) -> dict[str, Any]:
    """One server, the runs `parts` names: http (rate inf), chat (rate inf, chat mode), single (one
    request alone, greedy: the server's own per-token cost) and low (4 requests/s)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    trace = out / "trace.jsonl"
    result: dict[str, Any] = {}
    single = ["--num-prompts", "1", "--temperature", "0", "--min-input", "128", "--max-input", "128"]
    single += ["--min-output", "1024", "--max-output", "1024"]
    low = ["--num-prompts", str(args.low_prompts), *args.workload[2:], "--request-rate", str(LOW_RATE)]
    plan = [
        ("http", "rate_inf", args.reps, [*args.workload]),
        (
            "chat",
            "chat_rate_inf",
            args.reps,
            ["--endpoint", "chat", "--tokenizer", args.model, *args.workload],
        ),
        ("single", "single", 1, single),
        ("low", "low", args.low_reps, low),
    ]
    # served under the model folder's path: Mini-SGLang's client loads its tokenizer from the name
    model = str(Path(args.model).resolve())
    with _serve(
        args, out, "minisgl-serve", port, "--request-trace", str(trace), "--served-model-name", model
    ) as server:
        result["start_s"] = server.start_s
        bench_serving(base + "/v1", *WARM_UP)
        bench_serving(base + "/v1", "--endpoint", "chat", "--tokenizer", args.model, *WARM_UP)
        _, seen = _trace_slice(trace, 0)
        for part, key, reps, extra in plan:
            if part not in parts:
                continue
            result[key] = []
            for i in range(reps):
                # py-spy (with idle samples) over the middle of the first run of each kind
                spies = (
                    start_profiles(server, out, f"{key}", delay=4, seconds=6)
                    if i == 0 and args.profile
                    else []
                )
                before = histogram(http_get(base + "/metrics")[1], "minisgl_token_delivery_seconds")
                report = bench_serving(base + "/v1", *extra)
                after = histogram(http_get(base + "/metrics")[1], "minisgl_token_delivery_seconds")
                for spy in spies:
                    spy.wait(60)
                records, seen = _trace_slice(trace, seen)
                report["breakdown"] = breakdown(records)
                report["delivery_ms"] = {
                    f"p{q}": 1e3 * histogram_quantile(before, after, q / 100) for q in (50, 90, 99)
                }
                result[key].append(report)
                print(
                    report_line(f"{key} #{i + 1}", report) + f", step-to-socket {report['delivery_ms']}",
                    flush=True,
                )
                (out / "http.json").write_text(json.dumps(result, indent=1))
        if "simple" in parts and args.peer:
            result["bench_simple_s"] = []
            for i in range(args.simple_reps):
                result["bench_simple_s"].append(
                    _bench_simple(Path(args.peer).resolve(), port, out, f"bench-simple-{i}")
                )
                (out / "http.json").write_text(json.dumps(result, indent=1))
                print(
                    f"minisgl server, bench_simple Duration: {result['bench_simple_s'][-1]:.2f} s", flush=True
                )
    return result


def _peer_env(peer: Path) -> dict[str, str]:
    """Mini-SGLang's processes import its package from `peer` (its python/ folder), after $SITE."""
    return {"PYTHONPATH": f"{os.environ.get('SITE', '/tmp/site')}:{peer}"}


def _bench_simple(peer: Path, port: int, out: Path, name: str) -> float:
    """Mini-SGLang's online client (a copy with its port and api_key changed) against a server on
    `port` that serves its model under a path name; returns its Duration in seconds."""
    src = (peer / ".." / "benchmark" / "online" / "bench_simple.py").read_text()
    script = out / "bench_simple_patched.py"
    script.write_text(src.replace("PORT = 1919", f"PORT = {port}").replace('api_key=""', 'api_key="EMPTY"'))
    env = {**os.environ, **_peer_env(peer)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env, cwd=out
    )
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # its log's colours
    found = re.findall(r"Duration:\s*([0-9.]+)", text)
    if not found:
        raise RuntimeError(f"bench_simple printed no Duration (see {out / name}.log)")
    return float(found[-1])


def part_peer(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Mini-SGLang: its offline benchmark, then its server under the fast client (chat) and its own
    online client."""
    peer = Path(args.peer).resolve()
    model = str(Path(args.model).resolve())
    result: dict[str, Any] = {}

    def save() -> None:
        (out / "peer.json").write_text(json.dumps(result, indent=1))

    done = subprocess.run(
        [sys.executable, str(Path(args.peer_offline).resolve()), model],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, **_peer_env(peer)},
        cwd=out,  # not the repository: both projects' packages are called minisgl
    )
    (out / "peer-offline.log").write_text(done.stdout + done.stderr)
    result["offline"] = last_json(done.stdout)
    save()
    print(f"Mini-SGLang offline: {result['offline']}", flush=True)
    port = free_port()
    with _peer_server(args, out, port) as server:
        result["start_s"] = server.start_s
        base = f"http://127.0.0.1:{port}/v1"
        bench_serving(base, "--endpoint", "chat", "--tokenizer", model, *WARM_UP)
        result["chat_rate_inf"] = []
        for i in range(args.reps):
            report = bench_serving(base, "--endpoint", "chat", "--tokenizer", model, *args.workload)
            result["chat_rate_inf"].append(report)
            save()
            print(report_line(f"Mini-SGLang server, chat #{i + 1}", report), flush=True)
        result["bench_simple_s"] = []
        for i in range(args.simple_reps):
            result["bench_simple_s"].append(_bench_simple(peer, port, out, f"peer-bench-simple-{i}"))
            save()
            print(
                f"Mini-SGLang server, bench_simple Duration: {result['bench_simple_s'][-1]:.2f} s", flush=True
            )
    return result


def _peer_server(args: argparse.Namespace, out: Path, port: int, *extra: str) -> ServerProcess:
    """Mini-SGLang's server (`--peer`), FlashInfer attention, dummy weights, on 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "minisgl", "--model", str(Path(args.model).resolve()), "--dummy-weight"]
    cmd += ["--port", str(port), "--attn", "fi", *extra]
    env = _peer_env(Path(args.peer).resolve())
    proc = ServerProcess(cmd, out / "peer-serve.log", f"http://127.0.0.1:{port}/v1/models", env, out)
    print(f"Mini-SGLang server: up in {proc.start_s:.0f} s", flush=True)
    return proc


def _start_both(*starts: Callable[[], ServerProcess]) -> list[ServerProcess]:
    """Servers started side by side (each start blocks until its server answers); if one fails, those
    up are stopped and its error raised."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
        wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise errors[0]
    return [f.result() for f in futures]


def part_light(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Both servers up at once (started side by side, memory_ratio 0.4 each), chat at 4 requests/s
    against each in turn. Each step is stamped with the seconds since the part began; a round past
    `LOW_RUN_TIMEOUT_S` (a warm-up past `WARM_UP_TIMEOUT_S`) is stopped and recorded as stalled
    (`"stalled"`: its server and run), the servers' stacks (py-spy) and metrics written to out/ first."""
    model = str(Path(args.model).resolve())
    low = ["--endpoint", "chat", "--tokenizer", model, "--num-prompts", str(args.low_prompts)]
    low += [*args.workload[2:], "--request-rate", str(LOW_RATE)]
    result: dict[str, Any] = {"minisgl": [], "peer": [], "stalled": []}
    peer_port, port = free_port(), free_port()
    began = time.monotonic()

    def stamp(what: str) -> None:
        print(f"[light +{time.monotonic() - began:.0f} s] {what}", flush=True)

    stamp("starting both servers")
    peer, server = _start_both(
        lambda: _peer_server(args, out, peer_port, "--memory-ratio", "0.4"),
        lambda: _serve(
            args, out, "minisgl-serve-light", port, "--memory-ratio", "0.4", "--served-model-name", model
        ),
    )
    with peer, server:
        result["start_s"] = {"minisgl": server.start_s, "peer": peer.start_s}
        servers = {
            "minisgl": (server, f"http://127.0.0.1:{port}/v1"),
            "peer": (peer, f"http://127.0.0.1:{peer_port}/v1"),
        }

        def run(name: str, what: str, flags: list[str], timeout: float) -> dict[str, Any] | None:
            """One bench-serving run; past `timeout` the stacks and metrics go to out/ and None comes back."""
            proc, base = servers[name]
            stamp(f"{what} {name}")
            tag = f"light-{name}-{what.replace(' ', '-').replace('#', '')}"
            report = bench_serving(
                base,
                *flags,
                timeout=timeout,
                on_timeout=lambda c: dump_stalled(proc.proc.pid, c, base, out, tag),
            )
            if report is None:
                result["stalled"].append(f"{name} {what}")
                print(
                    f"{what} {name}: stopped after {timeout:.0f} s (stacks and metrics: {tag}-timeout-*)",
                    flush=True,
                )
            return report

        # both at once (a loose bound: a server's first requests may compile kernels, Mini-SGLang's for
        # minutes)
        warm_up = ["--endpoint", "chat", "--tokenizer", model, *WARM_UP]
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda name: run(name, "warm-up", warm_up, WARM_UP_TIMEOUT_S), servers))
        for i in range(args.low_reps):
            for name in servers:
                report = run(name, f"light #{i + 1}", low, LOW_RUN_TIMEOUT_S)
                if report is not None:
                    result[name].append(report)
                    print(report_line(f"light {name} #{i + 1}", report), flush=True)
                (out / "light.json").write_text(json.dumps(result, indent=1))
    stamp("done")
    return result


# ------------------------------------------------------------------------------------------------ table


def _requested_rate(report: dict[str, Any]) -> float:
    """The tokens the completed requests asked for (all of them: ignore_eos) over the run's duration."""
    return report["requested_output_tokens"] / report["duration_s"]


def table(results: dict[str, Any]) -> str:
    def med(values: list[float]) -> float:
        return median(values, math.nan)

    rows = []
    stub = results.get("stub") or {}
    for key, report in stub.items():
        rows.append((f"client vs stub, {key}", f"{report['output_throughput']:,.0f} tok/s"))
    offline = results.get("offline") or {}
    off_tok = med([p["tok_s"] for p in offline.get("passes", [])])
    off_ttft = med([p["ttft_p50_ms"] for p in offline.get("passes", [])])
    if offline:
        rows.append(("offline tok/s (median)", f"{off_tok:,.0f}"))
        rows.append(("offline TTFT p50 ms (median)", f"{off_ttft:.0f}"))
    light = results.get("light") or {}
    for key, name in (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50"), ("itl_ms", "ITL p99")):
        q = "p99" if key == "itl_ms" else "p50"
        if light.get("minisgl") and light.get("peer"):
            ours = med([r[key][q] for r in light["minisgl"]])
            theirs = med([r[key][q] for r in light["peer"]])
            rows.append(
                (
                    f"4 req/s chat {name} ms: minisgl / Mini-SGLang",
                    f"{ours:.2f} / {theirs:.2f} = {ours / theirs:.3f}x",
                )
            )
    http = results.get("http") or {}
    if http.get("rate_inf"):
        runs = http["rate_inf"]
        tok = med([r["output_throughput"] for r in runs])
        rows.append(("HTTP rate inf tok/s (median)", f"{tok:,.0f} = {tok / off_tok:.3f}x offline"))
        rows.append(("HTTP rate inf TTFT p50 ms", f"{med([r['ttft_ms']['p50'] for r in runs]):.0f}"))
        rows.append(("HTTP rate inf ITL p99 ms", f"{med([r['itl_ms']['p99'] for r in runs]):.1f}"))
    if http.get("chat_rate_inf"):
        tok = med([r["output_throughput"] for r in http["chat_rate_inf"]])
        rows.append(("HTTP chat rate inf tok/s", f"{tok:,.0f}"))
    if offline.get("decode_ms"):
        rows.append(
            ("engine ms per decode step", ", ".join(f"{k} {v:.3f}" for k, v in offline["decode_ms"].items()))
        )
    if http.get("single"):
        r = http["single"][0]
        rows.append(("HTTP single request (greedy) TPOT p50 ms", f"{r['tpot_ms']['p50']:.3f}"))
        rows.append(("  its scheduler ms/token", f"{r['breakdown']['decode_per_token']['p50']:.3f}"))
    if http.get("low"):
        runs = http["low"]
        rows.append(
            (
                "4 req/s scheduler ms/token p50",
                f"{med([r['breakdown']['decode_per_token']['p50'] for r in runs]):.3f}",
            )
        )
        rows.append(("4 req/s TTFT p50 ms", f"{med([r['ttft_ms']['p50'] for r in runs]):.1f}"))
        if offline.get("alone_ttft_ms"):
            rows.append(("engine alone TTFT p50 ms", f"{med(offline['alone_ttft_ms']):.1f}"))
        rows.append(("4 req/s TPOT p50 ms", f"{med([r['tpot_ms']['p50'] for r in runs]):.3f}"))
        for q in ("p50", "p99"):
            rows.append((f"4 req/s step-to-socket {q} ms", f"{med([r['delivery_ms'][q] for r in runs]):.3f}"))
    peer = results.get("peer") or {}
    if peer:
        p_off = med(peer["offline"]["passes"])
        rows.append(("Mini-SGLang offline tok/s", f"{p_off:,.0f}"))
        # the requested tokens over the duration: Mini-SGLang's stream carries neither usage nor token
        # ids and several tokens per chunk, so the client's own count of its tokens is low
        p_chat = med([_requested_rate(r) for r in peer["chat_rate_inf"]])
        rows.append(("Mini-SGLang server chat tok/s (requested / duration)", f"{p_chat:,.0f}"))
        if http.get("chat_rate_inf") and offline:
            m_chat = med([_requested_rate(r) for r in http["chat_rate_inf"]])
            server_ratio, engine_ratio = m_chat / p_chat, off_tok / p_off
            rows.append(
                (
                    "servers / engines (chat)",
                    f"{server_ratio:.3f} / {engine_ratio:.3f} = {server_ratio / engine_ratio:.3f}",
                )
            )
        if peer.get("bench_simple_s") and http.get("bench_simple_s"):
            a, b = med(peer["bench_simple_s"]), med(http["bench_simple_s"])
            rows.append(
                ("bench_simple Duration s: Mini-SGLang / minisgl", f"{a:.2f} / {b:.2f} = {a / b:.3f}x")
            )
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main() -> None:
    stop_servers_on_sigterm()
    parser = model_parser(__doc__)
    parser.add_argument("--parts", default="stub,peer,offline,http,chat,single,low,simple")
    parser.add_argument("--simple-reps", type=int, default=2, help="runs of Mini-SGLang's client per server")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--low-reps", type=int, default=2)
    parser.add_argument("--out", default="serving-out")
    parser.add_argument("--peer", default=None, help="Mini-SGLang's python/ folder (for the peer part)")
    parser.add_argument("--peer-offline", default=None, help="bench_offline.py (for the peer part)")
    parser.add_argument(
        "--shape", choices=["full", "cpu"], default="full", help="cpu: the scaled-down workload"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy the server in the first rate-inf run")
    args = parser.parse_args()
    args.workload = CPU_ARGS if args.shape == "cpu" else []
    args.low_prompts = 8 if args.shape == "cpu" else LOW_PROMPTS
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {}
    started = time.monotonic()
    try:
        if "stub" in parts:
            results["stub"] = part_stub(out)
        if "light" in parts:
            results["light"] = part_light(args, out)
        if "peer" in parts:  # first: its compilation then disturbs nothing of minisgl's
            results["peer"] = part_peer(args, out)
        if "offline" in parts:
            results["offline"] = part_offline(args, out)
        if parts & {"http", "chat", "single", "low", "simple"}:
            results["http"] = part_http(args, out, parts)
    finally:
        summarize_profiles(out)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(
            f"\n--- serving benchmark ({time.monotonic() - started:.0f} s) ---\n{table(results)}", flush=True
        )
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], check=False)


if __name__ == "__main__":
    main()
