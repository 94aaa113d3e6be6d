"""The prefix-cache workloads of `minisgl-run bench` (`minisgl/bench/workloads.py`) and their runs.

The generators are checked as plain data (shapes, ranges, determinism, the pinned totals of the full
shapes that other engines' scripts reproduce) and as a file that imports nothing from minisgl or torch.
The runs go through `minisgl-run bench --workload ...` on the default model, in-process on one shared
LLM (the CLI's `LLM(...)` construction is replaced by it, as in test_cli.py) and once as a real process
with `--cache-type naive`; the multi-turn driver is also checked directly.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import minisgl.llm
from minisgl.bench.offline import WORKLOADS, drive_conversations, format_report, step_bound
from minisgl.bench.workloads import (
    MULTI_TURN_CPU_SHAPE,
    SHARED_PREFIX_CPU_SHAPE,
    TOKEN_ID_MAX,
    MultiTurnShape,
    SharedPrefixShape,
    group_of,
    multi_turn_workload,
    next_turn_prompt,
    shared_prefix_workload,
)
from minisgl.cli import main
from minisgl.core import SamplingParams

REPO = Path(__file__).resolve().parent.parent
WORKLOADS_FILE = REPO / "minisgl" / "bench" / "workloads.py"
CPU_YAML = REPO / "configs" / "cpu-smollm2.yaml"
SMOLLM2_VOCAB = 49152
PAGE = 16  # the page size of configs/cpu-smollm2.yaml

# tiny shapes for the runs: a prefill budget of 64 tokens (the shared LLM's) spreads the prompts over
# several prefill steps, so later requests of a group find their prefix cached
TINY_SHARED = SharedPrefixShape(
    groups=2, per_group=3, prefix_len=48, min_own=4, max_own=8, min_output=2, max_output=4
)
TINY_SHARED_ARGS = ["--groups", "2", "--per-group", "3", "--prefix-len", "48", "--min-own", "4"]
TINY_SHARED_ARGS += ["--max-own", "8", "--min-output", "2", "--max-output", "4"]
TINY_TURNS = MultiTurnShape(conversations=3, turns=3, min_user=16, max_user=24, min_output=2, max_output=4)
TINY_TURNS_ARGS = ["--conversations", "3", "--turns", "3", "--min-user", "16", "--max-user", "24"]
TINY_TURNS_ARGS += ["--min-output", "2", "--max-output", "4"]


# -- the generators ------------------------------------------------------------------------------


def test_shared_prefix_full_shape() -> None:
    shape = SharedPrefixShape()
    assert (shape.groups, shape.per_group, shape.prefix_len) == (16, 16, 2048)
    prompts, max_tokens = shared_prefix_workload(shape)
    assert len(prompts) == len(max_tokens) == 256
    # pinned: the draws' order is the workload's definition (Mini-SGLang's script draws the same)
    assert sum(map(len, prompts)) == 606_298 and sum(max_tokens) == 81_927
    assert all(0 <= t <= TOKEN_ID_MAX for p in prompts for t in p)
    assert all(128 <= n <= 512 for n in max_tokens)
    assert all(2048 + 128 <= len(p) <= 2048 + 512 for p in prompts)


def _check_shared_prefix(shape: SharedPrefixShape, prompts: list[list[int]], max_tokens: list[int]) -> None:
    assert len(prompts) == len(max_tokens) == shape.groups * shape.per_group
    prefixes: dict[int, list[int]] = {}
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        group = group_of(i, shape)
        assert group == i % shape.groups  # interleaved round-robin
        prefix = prompt[: shape.prefix_len]
        assert prefixes.setdefault(group, prefix) == prefix  # shared within the group
        assert shape.min_own <= len(prompt) - shape.prefix_len <= shape.max_own
        assert shape.min_output <= n <= shape.max_output
    distinct = {tuple(p) for p in prefixes.values()}
    assert len(distinct) == shape.groups  # and different across groups
    # the requests' own parts differ (random ids): no two prompts are the same
    assert len({tuple(p) for p in prompts}) == len(prompts)


@pytest.mark.parametrize("shape", [SharedPrefixShape(), SHARED_PREFIX_CPU_SHAPE, TINY_SHARED], ids=str)
def test_shared_prefix_groups(shape: SharedPrefixShape) -> None:
    prompts, max_tokens = shared_prefix_workload(shape, vocab_size=SMOLLM2_VOCAB)
    _check_shared_prefix(shape, prompts, max_tokens)


def test_shared_prefix_deterministic_and_wrapped() -> None:
    shape = SHARED_PREFIX_CPU_SHAPE
    assert (shape.groups, shape.per_group, shape.prefix_len, shape.min_own, shape.max_own) == (
        4,
        4,
        512,
        16,
        64,
    )
    assert (shape.min_output, shape.max_output, shape.temperature, shape.seed) == (8, 32, 0.6, 0)
    first = shared_prefix_workload(shape)
    assert shared_prefix_workload(shape) == first
    assert shared_prefix_workload(SharedPrefixShape(**{**shape.__dict__, "seed": 1})) != first
    # ids wrap modulo the vocabulary, draw for draw
    wrapped = shared_prefix_workload(shape, vocab_size=1000)
    assert wrapped[1] == first[1]
    assert wrapped[0] == [[t % 1000 for t in p] for p in first[0]]
    assert max(t for p in first[0] for t in p) >= 1000  # so the wrap did something


def test_multi_turn_shapes() -> None:
    full = multi_turn_workload(MultiTurnShape())
    assert len(full) == 64 and all(len(turns) == 4 for turns in full)
    # pinned, as the shared-prefix totals
    assert sum(len(user) for turns in full for user, _ in turns) == 41_194
    assert sum(n for turns in full for _, n in turns) == 49_703
    for shape in (MultiTurnShape(), MULTI_TURN_CPU_SHAPE, TINY_TURNS):
        conversations = multi_turn_workload(shape, vocab_size=SMOLLM2_VOCAB)
        assert multi_turn_workload(shape, vocab_size=SMOLLM2_VOCAB) == conversations
        assert len(conversations) == shape.conversations
        for turns in conversations:
            assert len(turns) == shape.turns
            for user, n in turns:
                assert shape.min_user <= len(user) <= shape.max_user
                assert shape.min_output <= n <= shape.max_output
                assert all(0 <= t <= TOKEN_ID_MAX for t in user)
        users = [tuple(user) for turns in conversations for user, _ in turns]
        assert len(set(users)) == len(users)
    cpu = MULTI_TURN_CPU_SHAPE
    assert (cpu.conversations, cpu.turns, cpu.min_user, cpu.max_user) == (8, 3, 16, 64)
    assert (cpu.min_output, cpu.max_output) == (8, 32)
    assert multi_turn_workload(MultiTurnShape(seed=1)) != full


def test_next_turn_prompt() -> None:
    assert next_turn_prompt([1, 2], [3], [4, 5]) == [1, 2, 3, 4, 5]
    previous = [1, 2]
    next_turn_prompt(previous, [3], [4])
    assert previous == [1, 2]  # a new list


@pytest.mark.parametrize(
    ("cls", "fields", "named"),
    [
        (SharedPrefixShape, {"min_own": 9, "max_own": 8}, "min_own=9"),
        (SharedPrefixShape, {"groups": 0}, "groups"),
        (SharedPrefixShape, {"min_output": 0}, "min_output"),
        (MultiTurnShape, {"min_user": 300}, "min_user=300"),
        (MultiTurnShape, {"turns": 0}, "turns"),
    ],
)
def test_bad_shapes(cls, fields: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        cls(**fields)


def test_workloads_file_imports_nothing_of_minisgl_or_torch() -> None:
    tree = ast.parse(WORKLOADS_FILE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "random", "dataclasses"}, imported
    # loaded by path, as another engine's script does, in a fresh interpreter
    script = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("workloads", {str(WORKLOADS_FILE)!r})
w = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w)
data = [w.shared_prefix_workload(w.SHARED_PREFIX_CPU_SHAPE), w.multi_turn_workload(w.MULTI_TURN_CPU_SHAPE)]
assert not any(m == "torch" or m.startswith(("torch.", "minisgl")) for m in sys.modules), sorted(sys.modules)
print(json.dumps(data))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    shared, turns = json.loads(proc.stdout)
    assert [shared[0], shared[1]] == list(shared_prefix_workload(SHARED_PREFIX_CPU_SHAPE))
    assert turns == [[[u, n] for u, n in c] for c in multi_turn_workload(MULTI_TURN_CPU_SHAPE)]


def test_cli_lists_every_workload() -> None:
    [option] = [p for p in main.commands["bench"].params if p.name == "workload"]
    assert tuple(option.type.choices) == WORKLOADS and option.default == "random"


def test_option_of_another_workload_is_refused() -> None:
    result = CliRunner().invoke(main, ["bench", "--workload", "random", "--groups", "2", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--groups" in result.stderr and "--workload random" in result.stderr
    result = CliRunner().invoke(main, ["bench", "--workload", "shared-prefix", "--turns", "2"])
    assert result.exit_code == 2 and "--turns" in result.stderr


# -- runs on the default model -------------------------------------------------------------------


class _SharedLLM:
    """The shared LLM as the CLI sees it; shutdown is a no-op."""

    def __init__(self, llm: minisgl.llm.LLM) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def shared_llm():
    with minisgl.llm.LLM(config=CPU_YAML, cpu_kv_budget_gib=0.25, max_prefill_tokens=64) as llm:
        yield llm


@pytest.fixture
def bench(shared_llm, monkeypatch: pytest.MonkeyPatch):
    """Runs `minisgl-run bench ARGS` on the shared LLM; returns the click result."""
    monkeypatch.setattr(minisgl.llm, "LLM", lambda model=None, **kwargs: _SharedLLM(shared_llm))

    def run(*args: str) -> Any:
        result = CliRunner().invoke(main, ["bench", "-q", *args])
        assert result.exit_code == 0, result.output
        return result

    return run


def _turn_lengths(conversations: list[list[tuple[list[int], int]]]) -> list[tuple[int, int]]:
    """(prompt length, length of the conversation before it) of each turn, outputs at max_tokens."""
    lengths = []
    for turns in conversations:
        before = 0
        for user, n in turns:
            lengths.append((before + len(user), before))
            before += len(user) + n
    return lengths


@pytest.mark.slow
def test_bench_shared_prefix(bench) -> None:
    report = json.loads(bench("--workload", "shared-prefix", *TINY_SHARED_ARGS, "--json").stdout)
    assert report["workload"] == "shared-prefix" and report["cache_type"] == "radix"
    assert report["cache_flushed_before"] == "each pass"
    assert report["shape"] == TINY_SHARED.__dict__
    prompts, max_tokens = shared_prefix_workload(TINY_SHARED, SMOLLM2_VOCAB)
    passes = report["passes"]
    assert len(passes) == 2
    for p in passes:
        assert p["output_tokens"] == sum(max_tokens)
        assert p["input_tokens"] == sum(map(len, prompts)) == p["prefix_lookup_tokens"]
        assert p["requests"] == len(prompts)
        assert p["tokens_per_s"] > 0 and 0 < p["ttft_p50"] <= p["ttft_p90"] <= p["ttft_p99"]
        # cold: only the groups' prefixes can be found, and not by a group's first request
        cached = p["prefix_cached_tokens"]
        assert 0 < cached <= (len(prompts) - TINY_SHARED.groups) * TINY_SHARED.prefix_len
        assert cached % PAGE == 0
        assert p["hit_rate"] == pytest.approx(cached / p["prefix_lookup_tokens"])
    # the cache was emptied between the passes: the second found what the first did, no more
    assert passes[1]["prefix_cached_tokens"] == passes[0]["prefix_cached_tokens"]

    # the text report (what the command prints without --json) of the same run
    text = format_report(report)
    assert "workload shared-prefix: 2 groups x 3 requests (interleaved), shared prefix 48" in text
    assert "prefix cache radix, emptied before each pass" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["pass", "output"])
    assert lines[header].split()[-1] == "hit"
    for i, p in enumerate(passes, 1):
        row = lines[header + i].split()
        assert row[:2] == [str(i), str(sum(max_tokens))]
        assert row[-1] == f"{100 * p['hit_rate']:.1f}%"


@pytest.mark.slow
def test_bench_keep_cache(bench) -> None:
    args = ["--workload", "shared-prefix", *TINY_SHARED_ARGS, "--keep-cache", "--json"]
    report = json.loads(bench(*args).stdout)
    assert report["cache_flushed_before"] == "first pass"
    prompts, _ = shared_prefix_workload(TINY_SHARED, SMOLLM2_VOCAB)
    first, second = report["passes"]
    assert first["prefix_cached_tokens"] <= (len(prompts) - TINY_SHARED.groups) * TINY_SHARED.prefix_len
    # warm: every prompt of the first pass is in the tree, in whole pages, short of its last token
    assert second["prefix_cached_tokens"] == sum((len(p) - 1) // PAGE * PAGE for p in prompts)


@pytest.mark.slow
def test_bench_multi_turn(bench) -> None:
    report = json.loads(bench("--workload", "multi-turn", *TINY_TURNS_ARGS, "--passes", "1", "--json").stdout)
    assert report["workload"] == "multi-turn" and report["shape"] == TINY_TURNS.__dict__
    conversations = multi_turn_workload(TINY_TURNS, SMOLLM2_VOCAB)
    lengths = _turn_lengths(conversations)
    for p in report["passes"]:
        assert p["output_tokens"] == sum(n for turns in conversations for _, n in turns)
        assert p["requests"] == TINY_TURNS.conversations * TINY_TURNS.turns
        # each turn's prompt is the whole conversation so far: the outputs count in the inputs
        assert p["input_tokens"] == sum(prompt for prompt, _ in lengths) == p["prefix_lookup_tokens"]
        # each later turn finds the conversation before it, in whole pages (the last output token's
        # KV is never computed); first turns find nothing
        assert (
            sum((before - 1) // PAGE * PAGE for _, before in lengths if before) <= p["prefix_cached_tokens"]
        )
        assert p["prefix_cached_tokens"] <= sum(before // PAGE * PAGE for _, before in lengths)
        assert 0 < p["ttft_p50"] <= p["ttft_p99"]


@pytest.mark.slow
def test_bench_bad_range(bench, shared_llm) -> None:
    result = CliRunner().invoke(
        main, ["bench", "--workload", "multi-turn", "--min-user", "9", "--max-user", "8"]
    )
    assert result.exit_code == 2 and "--min-user must not exceed --max-user" in result.stderr


@pytest.mark.slow
def test_drive_conversations(shared_llm) -> None:
    conversations = multi_turn_workload(TINY_TURNS, SMOLLM2_VOCAB)
    records = drive_conversations(shared_llm, conversations, temperature=0.6)
    assert [len(r) for r in records] == [TINY_TURNS.turns] * TINY_TURNS.conversations
    for c, (turns, recs) in enumerate(zip(conversations, records)):
        assert recs[0].prompt_ids == turns[0][0]
        for k, (rec, (user, n)) in enumerate(zip(recs, turns)):
            assert (rec.conversation, rec.turn, rec.finish_reason) == (c, k, "length")
            assert len(rec.output_ids) == n
            assert rec.sent < rec.first_token <= rec.finished and rec.ttft > 0
            if k:
                previous = recs[k - 1]
                # the whole previous conversation, then the turn's user ids; sent once it had ended
                assert rec.prompt_ids == previous.prompt_ids + previous.output_ids + user
                assert rec.sent >= previous.finished
    # all conversations were in flight together: the first turns were all sent before any ended
    assert max(r[0].sent for r in records) < min(r[0].finished for r in records)
    scheduler = shared_llm.scheduler
    assert not (scheduler.waiting or scheduler.running or scheduler.has_work())


@pytest.mark.slow
def test_drive_conversations_stops_at_its_step_cap(shared_llm) -> None:
    conversations = multi_turn_workload(TINY_TURNS, SMOLLM2_VOCAB)
    assert step_bound(conversations) > 100
    with pytest.raises(RuntimeError, match="stopped after 3 steps"):
        drive_conversations(shared_llm, conversations, temperature=0.6, max_steps=3)
    scheduler = shared_llm.scheduler
    assert not (scheduler.waiting or scheduler.running)  # what was unfinished was aborted
    with shared_llm._lock:  # the forward still in flight, if any
        while scheduler.has_work():
            shared_llm._step()
    [out] = shared_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(out.token_ids) == 2  # the LLM goes on


@pytest.mark.slow
def test_bench_naive_subprocess() -> None:
    """The console script end to end, with `--cache-type naive`: nothing is found cached."""
    script = Path(sys.executable).with_name("minisgl-run")
    command = [os.fspath(script)] if script.exists() else [sys.executable, "-m", "minisgl.cli"]
    args = ["bench", "--config", os.fspath(CPU_YAML), "--cache-type", "naive", "--max-prefill-tokens", "64"]
    args += ["--cpu-kv-budget-gib", "0.25", "--workload", "shared-prefix", *TINY_SHARED_ARGS]
    args += ["--passes", "1", "--json", "-q"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINISGL_") or k == "MINISGL_CACHE_DIR"}
    proc = subprocess.run(
        [*command, *args],
        env={**env, "HF_HUB_OFFLINE": "1"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["cache_type"] == "naive" and report["workload"] == "shared-prefix"
    prompts, max_tokens = shared_prefix_workload(TINY_SHARED, SMOLLM2_VOCAB)
    [p] = report["passes"]
    assert p["output_tokens"] == sum(max_tokens) and p["input_tokens"] == sum(map(len, prompts))
    assert p["prefix_lookup_tokens"] == sum(map(len, prompts))
    assert p["prefix_cached_tokens"] == 0 and p["hit_rate"] == 0.0
