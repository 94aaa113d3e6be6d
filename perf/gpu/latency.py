"""Latency under light load: where one request's time to first token goes, and what a decode step
costs at small batches (docs/performance.md, "Latency under light load", gives the parts, the stages
and the figures).

    python -m perf.gpu.latency [--shape cpu] [--out FILE.json] [--config YAML] [--model DIR] [--reps N]
                               [--parts engine,steps,server]

Parts: engine (the engine alone in this process, each request's stages stamped by wrapping scheduler
and engine methods on their instances: minisgl is unchanged), steps (decode steps at batch 1 to 16,
greedy and sampled), server (`minisgl-run serve` with a request trace, one request at a time; run
first and gone before the engine starts). `--shape cpu`: a dry run on the CPU with the default model at
small sizes (tests/test_latency_script.py). Every figure goes to one JSON file (`--out`, the server's
log and trace beside it) and a plain-text table is printed last. Every loop is bounded in steps and
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from minisgl.core import SamplingParams
from perf.common import PRESET, ROOT, ServerProcess, free_port, http_get, median, serve_command

CPU_CONFIG = ROOT / "configs" / "cpu-smollm2.yaml"
MAX_STEPS, MAX_SECONDS = 5000, 300.0  # bounds of every stepping loop
BACKGROUND = 4  # requests decoding beside the measured one
VARIANTS = {
    "greedy": {},
    "t0.6": {"temperature": 0.6},
    "t0.6_p0.95_k50": {"temperature": 0.6, "top_p": 0.95, "top_k": 50},
}
HOST_STAGES = ("admitted", "prepared", "launched", "first_token", "step_returned")
DEVICE_STAGES = ("forward_start", "forward_done", "sampled")
STAGES = ("admitted", "prepared", "forward_start", "launched", "forward_done", "sampled", "first_token")
STAGES += ("step_returned",)
TRACE_STAMPS = ("tokenized", "sent", "arrived", "admitted", "first_token", "first_received")
TRACE_STAMPS += ("first_written", "done")


@dataclass(frozen=True)
class Shape:
    prompts: tuple[int, ...]  # the engine and server parts' prompt lengths
    reps: int  # engine part repetitions
    background: int  # prompt tokens of each background decode
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: int  # timed decode steps per configuration
    requests: int  # server requests per length and kind
    settings: dict[str, Any] = field(default_factory=dict)  # extra settings (LLM and serve)


GPU = Shape((128, 512, 1024), 20, 128, (1, 2, 4, 8, 16), (512, 1024, 2048), 50, 5)
CPU = Shape((16, 32, 64), 3, 16, (1, 2, 4), (32, 64), 5, 3, {"cpu_kv_budget_gib": 0.25})


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10000) for _ in range(length)]


# ---------------------------------------------------------------------------- driving the scheduler


def _add(llm: Any, prompt: list[int], params: SamplingParams) -> Any:
    with llm._lock:
        return llm.scheduler.add_request(prompt, params)


def _step(llm: Any) -> float:
    """One scheduler step under the LLM's lock (as `LLM.generate` steps); when it returned."""
    with llm._lock:
        llm.scheduler.step()
    return time.perf_counter()


def _run_until(llm: Any, done: Callable[[], bool], what: str) -> float:
    """Steps until `done()` (bounded in steps and seconds); when the last step returned."""
    deadline, returned, steps = time.monotonic() + MAX_SECONDS, time.perf_counter(), 0
    while not done():
        if steps == MAX_STEPS or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done after {steps} steps or {MAX_SECONDS:.0f} s")
        returned, steps = _step(llm), steps + 1
    return returned


def _clear(llm: Any, states: list[Any]) -> None:
    """Aborts `states`, steps until the scheduler is idle and empties the prefix cache."""
    with llm._lock:
        for state in states:
            llm.scheduler.abort(state)
    _run_until(llm, lambda: not llm.scheduler.has_work(), "draining")
    llm.flush_cache()


class Watch:
    """Stamps the stages of one watched request by wrapping `Admission.admit`, `Pipeline.prepare`,
    `Engine.forward_batch` and `engine.sampler.sample` on the instances; `close` removes the wrappers."""

    def __init__(self, llm: Any) -> None:
        self.sched, self.engine = llm.scheduler, llm.engine
        self.cuda = self.engine.device.type == "cuda"
        self.state: Any = None
        self.batch: Any = None
        self.inside = False  # in forward_batch of the watched batch
        self.stamps: dict[str, Any] = {}  # host seconds, or CUDA events (device stages)
        self.mode: str | None = None
        self.anchor: tuple[float, Any] | None = None
        self.patched = [(self.sched.admission, "admit"), (self.sched.pipeline, "prepare")]
        self.patched += [(self.engine, "forward_batch"), (self.engine.sampler, "sample")]
        for obj, name in self.patched:
            setattr(obj, name, getattr(self, "_" + name.lstrip("_"))(getattr(obj, name)))

    def close(self) -> None:
        for obj, name in self.patched:
            delattr(obj, name)  # the class's method again

    def calibrate(self) -> None:
        """Pairs a host time with a CUDA event recorded while the device is idle."""
        if self.cuda:
            torch.cuda.synchronize()
            event = torch.cuda.Event(enable_timing=True)
            self.anchor = (time.perf_counter(), event)
            event.record()

    def watch(self, state: Any) -> None:
        self.state, self.batch, self.stamps, self.mode = state, None, {}, None

    def _mark(self, name: str) -> None:
        if self.cuda:
            self.stamps[name] = torch.cuda.Event(enable_timing=True)
            self.stamps[name].record()
        else:
            self.stamps[name] = time.perf_counter()

    def _admit(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def admit(*args: Any) -> Any:
            updates = original(*args)
            if "admitted" not in self.stamps and any(s is self.state for s in self.sched.running):
                self.stamps["admitted"] = time.perf_counter()
            return updates

        return admit

    def _prepare(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare(states: list[Any], *args: Any) -> Any:
            prepared = original(states, *args)
            if any(s is self.state for s in states) and self.state.first_token_time is None:
                self.stamps["prepared"], self.batch = time.perf_counter(), prepared[0]
            return prepared

        return prepare

    def _forward_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward_batch(batch: Any, *args: Any) -> Any:
            if batch is not self.batch:
                return original(batch, *args)
            forward_mode = getattr(self.engine, "forward_mode", None)
            self.mode = None if forward_mode is None else forward_mode(batch)
            self.inside = True
            self._mark("forward_start")
            try:
                return original(batch, *args)
            finally:
                self.inside = False
                self.stamps["launched"] = time.perf_counter()

        return forward_batch

    def _sample(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def sample(*args: Any, **kwargs: Any) -> Any:
            if not self.inside:
                return original(*args, **kwargs)
            self._mark("forward_done")
            tokens = original(*args, **kwargs)
            self._mark("sampled")
            return tokens

        return sample

    def result(self, returned: float) -> dict[str, Any]:
        """The watched request's stages in ms since it was added, and the device's own times."""
        stamps = {**self.stamps, "first_token": self.state.first_token_time, "step_returned": returned}
        if self.cuda:
            t0, anchor = self.anchor
            for name in DEVICE_STAGES:
                stamps[name].synchronize()
                stamps[name] = t0 + anchor.elapsed_time(stamps[name]) / 1e3
        ms = {name: 1e3 * (stamps[name] - self.state.arrival_time) for name in STAGES}
        ms["device_forward_ms"] = ms["forward_done"] - ms["forward_start"]
        ms["device_sample_ms"] = ms["sampled"] - ms["forward_done"]
        return ms


# ------------------------------------------------------------------------------------------ engine


def _ttft(llm: Any, watch: Watch, shape: Shape, length: int, reps: int, beside: bool) -> dict[str, Any]:
    """`reps` requests of `length` prompt tokens, max_tokens 1, one at a time (alone or beside
    `BACKGROUND` decodes): each stage's median ms since the request was added."""
    background = []
    watch.calibrate()
    try:
        if beside:
            room = llm.engine.max_seq_len - shape.background - 1
            params = SamplingParams(max_tokens=min(4096, room), ignore_eos=True)
            background = [_add(llm, _prompt(-1 - i, shape.background), params) for i in range(BACKGROUND)]
            _run_until(llm, lambda: all(s.first_token_time for s in background), "background prefill")
            _step(llm)  # a decode step is in flight as the measured request comes
        rows, modes = [], Counter()
        for rep in range(reps):
            state = _add(
                llm, _prompt(1000 * length + rep + 500 * beside, length), SamplingParams(max_tokens=1)
            )
            watch.watch(state)
            returned = _run_until(llm, lambda s=state: s.first_token_time is not None, "first token")
            rows.append(watch.result(returned))
            modes[watch.mode] += 1
            if not beside:
                _run_until(llm, lambda: not llm.scheduler.has_work(), "draining")
    finally:
        _clear(llm, background)
    table = {name: median([r[name] for r in rows]) for name in rows[0]}
    return {"stages_ms": table, "ttft_ms": table["first_token"], "reps": reps, "prefill_mode": dict(modes)}


def part_engine(llm: Any, shape: Shape, reps: int) -> dict[str, Any]:
    # warm-up: each length alone, then all of them together beside decodes
    for length in shape.prompts:
        llm.generate([_prompt(7, length)], SamplingParams(max_tokens=2, ignore_eos=True))
    prompts = [_prompt(8 + i, n) for i, n in enumerate((*shape.prompts, *[shape.background] * BACKGROUND))]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    llm.flush_cache()
    watch = Watch(llm)
    try:
        result: dict[str, Any] = {"alone": {}, "beside_decodes": {}}
        for beside, key in ((False, "alone"), (True, "beside_decodes")):
            for length in shape.prompts:
                result[key][str(length)] = row = _ttft(llm, watch, shape, length, reps, beside)
                print(
                    f"engine {key} {length}: TTFT {row['ttft_ms']:.2f} ms {row['prefill_mode']}", flush=True
                )
    finally:
        watch.close()
    return result


# ------------------------------------------------------------------------------------------- steps


def _decode_steps(llm: Any, context: int, batch: int, params: SamplingParams, n: int) -> dict[str, Any]:
    sched = llm.scheduler
    params = replace(params, max_tokens=n + 64, ignore_eos=True)
    states = [_add(llm, _prompt(100_000 * context + 100 * batch + i, context), params) for i in range(batch)]
    kept = sched.record_steps
    try:
        _run_until(llm, lambda: all(s.first_token_time for s in states), "prefill")
        sched.record_steps = n + 8
        last, walls = _step(llm), []
        for _ in range(n):
            now = _step(llm)
            walls.append(now - last)
            last = now
        records = [r for r in sched.step_records if r.phase == "decode" and r.batch_size == batch][-n:]
    finally:
        sched.record_steps = kept
        _clear(llm, states)
    row = {"wall_ms": 1e3 * statistics.median(walls), "steps": n, "records": len(records)}
    row["device_ms"] = median([r.device_ms for r in records])
    for name in ("launch", "wait", "process"):
        row[f"{name}_ms"] = median([1e3 * getattr(r, f"{name}_s") for r in records])
    return row


def part_steps(llm: Any, shape: Shape) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for context in shape.contexts:
        rows = result[str(context)] = {}
        for batch in shape.batches:
            rows[str(batch)] = {}
            for name, variant in VARIANTS.items():
                rows[str(batch)][name] = row = _decode_steps(
                    llm, context, batch, SamplingParams(**variant), shape.steps
                )
                print(f"decode ctx {context} bs {batch} {name}: {row['wall_ms']:.3f} ms", flush=True)
        base = rows[str(shape.batches[0])]["greedy"]
        for by_variant in rows.values():
            for row in by_variant.values():
                row["ratio_wall"] = row["wall_ms"] / base["wall_ms"]
                if row["device_ms"] is not None and base["device_ms"]:
                    row["ratio_device"] = row["device_ms"] / base["device_ms"]
    return result


# ------------------------------------------------------------------------------------------ server


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[float, str]:
    """One request; the client's TTFT in seconds (streamed: to the chunk with a token; else to the
    whole response) and the response's id."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started, ttft, rid = time.perf_counter(), None, None
    with urllib.request.urlopen(request, timeout=timeout) as response:
        if not body["stream"]:
            return time.perf_counter() - started, json.loads(response.read())["id"]
        for line in response:  # server-sent events, ending with data: [DONE]
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk.get("id", rid)
            choices = chunk.get("choices") or []
            if ttft is None and any(
                c.get("token_ids") or c.get("text") or c.get("delta", {}).get("content") for c in choices
            ):
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError(f"no token came in the stream of {rid}")
    return ttft, rid


def _trace_line(path: Path, rid: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            if record["id"] == rid:
                return record
        time.sleep(0.05)
    raise RuntimeError(f"request {rid} is not in the trace {path} after {timeout:.0f} s")


def part_server(args: argparse.Namespace, shape: Shape, out: Path) -> dict[str, Any]:
    from minisgl.bench.serving import load_tokenizer, request_body, with_texts, workload
    from minisgl.llm import TOKENIZER_FILES
    from minisgl.settings import EngineSettings

    model_dir = Path(EngineSettings.load(args.config, **_model(args)).resolved_model_path())
    tokenizer = None
    if any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = load_tokenizer(model_dir)
    endpoint = "chat" if getattr(tokenizer, "chat_template", None) else "completions"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    trace, log = out.with_suffix(".trace.jsonl"), out.with_suffix(".server.log")
    trace.unlink(missing_ok=True)
    cmd = serve_command(args.config, port, "--request-trace", str(trace), model=args.model)
    for key, value in shape.settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    result: dict[str, Any] = {"endpoint": endpoint, "lengths": {}}
    deadline = time.monotonic() + 1800
    server = ServerProcess(cmd, log, f"{base}/health")
    try:
        result["start_s"] = server.start_s
        model = json.loads(http_get(f"{base}/v1/models")[1])["data"][0]["id"]
        url = f"{base}/v1/chat/completions" if endpoint == "chat" else f"{base}/v1/completions"
        for length in shape.prompts:
            # a prompt of its own for each request (a repeated one would hit the prefix cache)
            requests = workload(2 * shape.requests + 2, length, length, 1, 1, seed=length)
            if endpoint == "chat":
                requests = with_texts(requests, tokenizer)
            kinds: dict[str, list[tuple[float, dict[str, Any]]]] = {"non_streamed": [], "streamed": []}
            for i, request in enumerate(requests):  # non-streamed and streamed in turn
                if time.monotonic() > deadline:
                    raise RuntimeError("the server part ran out of time")
                kind = "streamed" if i % 2 else "non_streamed"
                body = request_body(
                    request, model=model, endpoint=endpoint, temperature=0.0, stream=i % 2 == 1
                )
                ttft, rid = _post(url, body)
                if i >= 2:  # the first of each kind and length warms up
                    kinds[kind].append((ttft, _trace_line(trace, rid)))
            result["lengths"][str(length)] = row = {k: _summary(m) for k, m in kinds.items()}
            print(
                f"server {length}: client TTFT {row['streamed']['client_ttft_ms']:.1f} ms (streamed)",
                flush=True,
            )
    finally:  # stopped in every case, and gone before the engine part takes the device
        server.stop()
        server.wait_gone()
    return result


def _summary(measured: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over (client TTFT, trace record) pairs: the TTFT, the trace's stamps in ms since
    `received` and its stages in ms."""
    records = [r for _, r in measured]

    def ms(value: float | None, start: float = 0.0) -> float | None:
        return None if value is None else 1e3 * (value - start)

    return {
        "client_ttft_ms": 1e3 * statistics.median(t for t, _ in measured),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in records),
        "stamps_ms": {
            name: median([ms(r["stamps"][name], r["stamps"]["received"]) for r in records])
            for name in TRACE_STAMPS
        },
        "stages_ms": {s: median([ms(r["stages_s"][s]) for r in records]) for s in records[0]["stages_s"]},
        "requests": len(records),
    }


# ------------------------------------------------------------------------------------------- table


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict[str, Any]) -> str:
    lines = []
    engine = results.get("engine")
    if engine:
        lengths = list(engine["alone"])
        cols = [(key, n) for n in lengths for key in ("alone", "beside_decodes")]
        lines.append("engine: TTFT stages, median ms since the request was added")
        lines.append(
            f"{'stage':<18}"
            + "".join(f"{n + (' alone' if k == 'alone' else ' beside'):>14}" for k, n in cols)
        )
        for stage in (*STAGES, "device_forward_ms", "device_sample_ms"):
            lines.append(
                f"{stage:<18}" + "".join(f"{_fmt(engine[k][n]['stages_ms'][stage]):>14}" for k, n in cols)
            )
        modes = [",".join(engine[k][n]["prefill_mode"]) for k, n in cols]
        lines.append(f"{'prefill mode':<18}" + "".join(f"{m:>14}" for m in modes))
    steps = results.get("steps")
    if steps:
        names = list(VARIANTS)
        for context, rows in steps.items():
            lines.append(
                f"\ndecode step, context {context}: median ms per step, wall (device) and x batch 1 greedy"
            )
            lines.append(f"{'batch':>5}" + "".join(f"{name:>30}" for name in names))
            for batch, row in rows.items():
                cells = [
                    f"{_fmt(row[n]['wall_ms'], 3)} ({_fmt(row[n]['device_ms'], 3)}) {row[n]['ratio_wall']:.2f}x"
                    for n in names
                ]
                lines.append(f"{batch:>5}" + "".join(f"{c:>30}" for c in cells))
    server = results.get("server")
    if server:
        cols = [(n, kind) for n in server["lengths"] for kind in ("non_streamed", "streamed")]
        lines.append(f"\nserver ({server['endpoint']}): median ms since received (trace), client TTFT")
        lines.append(
            f"{'stamp':<18}"
            + "".join(f"{n + (' plain' if k == 'non_streamed' else ' stream'):>14}" for n, k in cols)
        )
        for stamp in TRACE_STAMPS:
            lines.append(
                f"{stamp:<18}"
                + "".join(f"{_fmt(server['lengths'][n][k]['stamps_ms'][stamp]):>14}" for n, k in cols)
            )
        lines.append(
            f"{'prompt tokens':<18}"
            + "".join(f"{server['lengths'][n][k]['prompt_tokens']:>14.0f}" for n, k in cols)
        )
        lines.append(
            f"{'client TTFT':<18}"
            + "".join(f"{_fmt(server['lengths'][n][k]['client_ttft_ms']):>14}" for n, k in cols)
        )
    for part, error in results.get("errors", {}).items():
        lines.append(f"\n{part} FAILED: {error.splitlines()[-1]}")
    return "\n".join(lines)


def _model(args: argparse.Namespace) -> dict[str, str]:
    return {"model_path": args.model} if args.model else {}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=["full", "cpu"], default="full", help="cpu: a small dry run")
    parser.add_argument("--out", default="latency-out.json")
    parser.add_argument(
        "--config", default=None, help=f"settings YAML (default {PRESET.name}; cpu: {CPU_CONFIG.name})"
    )
    parser.add_argument("--model", default=None, help="model folder (default: the config's)")
    parser.add_argument("--reps", type=int, default=None, help="engine part repetitions (default 20; cpu 3)")
    parser.add_argument("--parts", default="engine,steps,server")
    args = parser.parse_args()
    shape = CPU if args.shape == "cpu" else GPU
    args.config = str(args.config or (CPU_CONFIG if args.shape == "cpu" else PRESET))
    parts = set(args.parts.split(","))
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ["TQDM_DISABLE"] = "1"
    results: dict[str, Any] = {"shape": args.shape, "config": args.config, "model": args.model, "errors": {}}

    def run(part: str, fn: Callable[[], Any]) -> None:
        started = time.monotonic()
        try:
            results[part] = fn()
        except Exception:
            traceback.print_exc()
            results["errors"][part] = traceback.format_exc()
        results.setdefault("seconds", {})[part] = time.monotonic() - started
        out.write_text(json.dumps(results, indent=1))

    if "server" in parts:  # first: the in-process engine below then has the device to itself
        run("server", lambda: part_server(args, shape, out))
    if parts & {"engine", "steps"}:
        from minisgl.llm import LLM

        llm = LLM(args.model, config=args.config, **shape.settings)
        results["device"] = str(llm.engine.device)
        if llm.engine.device.type == "cuda":
            results["device"] += f" ({torch.cuda.get_device_name()})"
        try:
            if "engine" in parts:
                run("engine", lambda: part_engine(llm, shape, args.reps or shape.reps))
            if "steps" in parts:
                run("steps", lambda: part_steps(llm, shape))
        finally:
            llm.shutdown()
    out.write_text(json.dumps(results, indent=1))
    print(f"\n--- latency ({args.shape}; {out}) ---\n{table(results)}", flush=True)
    if results["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
