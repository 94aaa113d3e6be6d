"""`minisgl-run`: generate, bench and config, through click's CliRunner and as real processes.

Most model-backed commands run in-process on one shared LLM (the CLI's own `_make_llm` runs, only the
`LLM(...)` construction is replaced by a proxy to the shared engine), so the model loads once here and
once more in the end-to-end subprocess test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

import minisgl.llm
from minisgl.bench.offline import WorkloadShape, make_workload
from minisgl.cli import STDIN_PROMPT_NOTE, main
from minisgl.core import SamplingParams
from minisgl.settings import NON_SETTING_ENV_VARS, EngineSettings

PROMPT = "The capital of France is"
REPO = Path(__file__).resolve().parent.parent
CPU_YAML = REPO / "configs" / "cpu-smollm2.yaml"
SUBPROCESS_TIMEOUT = 180
SMOLLM2_VOCAB = 49152


def _minisgl_run() -> list[str]:
    """The installed console script, or the module when the script is not on PATH."""
    script = Path(sys.executable).with_name("minisgl-run")
    return [os.fspath(script)] if script.exists() else [sys.executable, "-m", "minisgl.cli"]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment, offline, without MINISGL_* settings variables (MINISGL_CACHE_DIR stays)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith("MINISGL_") or k.upper() in NON_SETTING_ENV_VARS - {"MINISGL_CONFIG"}
    }
    env.update(HF_HUB_OFFLINE="1", **extra)
    return env


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_minisgl_run(), *args],
        env=_env(**env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd=REPO,
    )


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MINISGL_* settings variables (nor MINISGL_CONFIG) from the caller's environment."""
    for name in list(os.environ):
        if name.upper().startswith("MINISGL_") and name.upper() != "MINISGL_CACHE_DIR":
            monkeypatch.delenv(name)


def _no_traceback(result: Any) -> None:
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


# -- a shared LLM behind the CLI -----------------------------------------------------------------


class _SharedLLM:
    """The shared LLM as the CLI sees it: shutdown is a no-op, stream deltas are recorded in `events`."""

    def __init__(self, llm: minisgl.llm.LLM, events: list[tuple[str, str]]) -> None:
        self._llm = llm
        self._events = events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def stream(self, *args: Any, **kwargs: Any):
        deltas = self._llm.stream(*args, **kwargs)  # checks the request now, as LLM.stream does

        def recorded():
            for delta in deltas:
                self._events.append(("delta", delta))
                yield delta

        return recorded()

    def shutdown(self) -> None:
        self._events.append(("shutdown", ""))


@pytest.fixture
def cli_llm(shared_llm, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replaces `minisgl.llm.LLM` (which the CLI imports when it needs a model) by the shared LLM.

    Returns a record: 'calls' holds (model, keyword arguments) of each construction, 'events' the stream
    deltas, the echoed text and the shutdowns in order.
    """
    record: dict[str, Any] = {"calls": [], "events": []}

    def fake_llm(model: str | None = None, **kwargs: Any) -> _SharedLLM:
        record["calls"].append((model, kwargs))
        return _SharedLLM(shared_llm, record["events"])

    echo = click.echo

    def recording_echo(message: Any = None, *args: Any, **kwargs: Any) -> None:
        record["events"].append(("echo", "" if message is None else str(message)))
        echo(message, *args, **kwargs)

    monkeypatch.setattr(minisgl.llm, "LLM", fake_llm)
    monkeypatch.setattr(click, "echo", recording_echo)
    return record


def _greedy(llm, prompts: list[str], max_tokens: int, **params: Any) -> list[str]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **params))
    return [o.text for o in outputs]


# -- generate: end to end ------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_subprocess_paris() -> None:
    proc = _run("generate", PROMPT, "--max-tokens", "8", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(PROMPT), proc.stdout  # logs go to stderr, not into the text
    assert "Paris" in proc.stdout[len(PROMPT) :]
    assert "Traceback" not in proc.stderr


# -- generate: in-process on the shared LLM ------------------------------------------------------


@pytest.mark.slow
def test_generate_streams_single_prompt(runner, cli_llm, shared_llm) -> None:
    result = runner.invoke(main, ["generate", PROMPT, "--max-tokens", "8", "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    [expected] = _greedy(shared_llm, [PROMPT], 8)
    assert result.stdout == PROMPT + expected + "\n"
    # the CLI built one LLM with the given settings and shut it down
    assert cli_llm["calls"] == [(None, {"config": None, "device": "cpu"})]
    events = cli_llm["events"]
    assert events[-1] == ("shutdown", "")
    # the prompt goes out first (the request was checked when the stream was created), then each
    # delta is echoed as soon as the stream yields it, before the next one is computed
    deltas = [i for i, (kind, _) in enumerate(events) if kind == "delta"]
    assert len(deltas) > 1
    assert events[deltas[0] - 1] == ("echo", PROMPT)
    for i in deltas:
        assert events[i + 1] == ("echo", events[i][1])
    assert "".join(events[i][1] for i in deltas) == expected


@pytest.mark.slow
def test_generate_several_prompts(runner, cli_llm, shared_llm) -> None:
    prompts = [PROMPT, "One, two, three,"]
    result = runner.invoke(main, ["generate", *prompts, "--max-tokens", "6", "-q"])
    assert result.exit_code == 0, result.output
    texts = _greedy(shared_llm, prompts, 6)
    assert result.stdout == "".join(f"{p}{t}\n\n" for p, t in zip(prompts, texts))
    assert "Paris" in result.stdout
    assert not any(kind == "delta" for kind, _ in cli_llm["events"])  # batched, not streamed


@pytest.mark.slow
def test_generate_prompt_file_and_stdin(runner, cli_llm, shared_llm, tmp_path: Path) -> None:
    prompts = [PROMPT, "One, two, three,"]
    expected = "".join(f"{p}{t}\n\n" for p, t in zip(prompts, _greedy(shared_llm, prompts, 4)))
    file = tmp_path / "prompts.txt"
    file.write_text(f"{prompts[0]}\n\n{prompts[1]}\n")  # blank lines are skipped
    from_file = runner.invoke(main, ["generate", "--file", str(file), "--max-tokens", "4", "-q"])
    assert from_file.exit_code == 0, from_file.output
    assert from_file.stdout == expected
    from_stdin = runner.invoke(main, ["generate", "--max-tokens", "4", "-q"], input=file.read_text())
    assert from_stdin.exit_code == 0, from_stdin.output
    assert from_stdin.stdout == expected
    dash = runner.invoke(main, ["generate", "--file", "-", "--max-tokens", "4", "-q"], input=file.read_text())
    assert dash.exit_code == 0, dash.output
    assert dash.stdout == expected


@pytest.mark.slow
def test_generate_chat(runner, cli_llm) -> None:
    result = runner.invoke(main, ["generate", "What is 2+2?", "--chat", "--max-tokens", "16", "-q"])
    assert result.exit_code == 0, result.output
    assert "4" in result.stdout
    assert "What is 2+2?" not in result.stdout  # a chat reply without the prompt


@pytest.mark.slow
def test_generate_seeded_sampling_is_reproducible(runner, cli_llm, shared_llm) -> None:
    args = ["generate", PROMPT, "--temperature", "0.8", "--seed", "3", "--max-tokens", "6", "-q"]
    first = runner.invoke(main, args)
    second = runner.invoke(main, args)
    assert first.exit_code == second.exit_code == 0, first.output
    assert first.stdout == second.stdout
    # the streamed single prompt draws the same tokens as LLM.generate with the same seed
    [sampled] = _greedy(shared_llm, [PROMPT], 6, temperature=0.8, seed=3)
    assert first.stdout == PROMPT + sampled + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("num_prompts", [1, 2], ids=["streamed", "batched"])
def test_generate_stop_string(runner, cli_llm, shared_llm, num_prompts: int) -> None:
    prompts = [PROMPT] * num_prompts
    [full] = _greedy(shared_llm, [PROMPT], 8)
    assert "." in full, full  # greedy: " Paris.\n\n..."
    cut = full[: full.index(".")]
    result = runner.invoke(main, ["generate", *prompts, "--max-tokens", "8", "--stop", ".", "-q"])
    assert result.exit_code == 0, result.output
    tail = "\n" if num_prompts == 1 else "\n\n"
    assert result.stdout == (PROMPT + cut + tail) * num_prompts
    assert "Paris" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("num_prompts", [1, 2], ids=["streamed", "batched"])
def test_generate_request_that_cannot_run(runner, cli_llm, num_prompts: int) -> None:
    result = runner.invoke(main, ["generate", *[PROMPT] * num_prompts, "--max-tokens", "100000", "-q"])
    assert result.exit_code == 1
    assert result.stdout == ""  # nothing printed before the error, not even the prompt
    assert "max_tokens=100000" in result.stderr and result.stderr.startswith("Error:")
    _no_traceback(result)
    assert cli_llm["events"][-1] == ("shutdown", "")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--top-p", "0"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--min-p", "2"], "min_p"),
        (["--max-tokens", "4", "--min-tokens", "5"], "min_tokens"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_generate_bad_sampling_options(runner, monkeypatch, args: list[str], named: str) -> None:
    def no_model(*a: Any, **k: Any) -> None:
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(minisgl.llm, "LLM", no_model)
    result = runner.invoke(main, ["generate", PROMPT, *args])
    assert result.exit_code == 2, result.output
    assert named in result.stderr
    assert "Usage:" in result.stderr
    _no_traceback(result)


# -- config --------------------------------------------------------------------------------------


def _setting(output: str, name: str) -> tuple[str, str]:
    """(value, origin) of one setting line 'name: value  # origin'."""
    match = re.search(rf"^{name}: (.*?)  # (.+)$", output, re.MULTILINE)
    assert match, f"no {name} line in\n{output}"
    return match.group(1), match.group(2)


@pytest.mark.usefixtures("clean_env")
def test_config_explicit_option(runner) -> None:
    result = runner.invoke(main, ["config", "--page-size", "32"])
    assert result.exit_code == 0, result.output
    assert _setting(result.stdout, "page_size") == ("32", "explicit")
    assert _setting(result.stdout, "device") == ("auto", "default")
    loaded = yaml.safe_load(result.stdout)
    assert loaded["page_size"] == 32
    assert set(loaded) == set(EngineSettings.model_fields)


def test_config_env_var_subprocess() -> None:
    proc = _run("config", MINISGL_PAGE_SIZE="64")
    assert proc.returncode == 0, proc.stderr
    assert _setting(proc.stdout, "page_size") == ("64", "env MINISGL_PAGE_SIZE")
    assert yaml.safe_load(proc.stdout)["page_size"] == 64


@pytest.mark.usefixtures("clean_env")
def test_config_yaml_env_explicit_layers(runner) -> None:
    result = runner.invoke(main, ["config", "--config", str(CPU_YAML)])
    assert result.exit_code == 0, result.output
    value, origin = _setting(result.stdout, "page_size")
    assert value == "16" and origin.startswith("yaml ") and "cpu-smollm2.yaml" in origin
    assert _setting(result.stdout, "device") == ("cpu", origin)
    assert result.stdout.startswith(f"# settings file: {CPU_YAML}")
    assert yaml.safe_load(result.stdout)["dtype"] == "float32"
    # explicit over env over yaml
    layered = runner.invoke(
        main,
        ["config", "--config", str(CPU_YAML), "--dtype", "bfloat16"],
        env={"MINISGL_PAGE_SIZE": "64", "MINISGL_DTYPE": "float16"},
    )
    assert layered.exit_code == 0, layered.output
    assert _setting(layered.stdout, "page_size") == ("64", "env MINISGL_PAGE_SIZE")
    assert _setting(layered.stdout, "dtype") == ("bfloat16", "explicit")
    assert _setting(layered.stdout, "device") == ("cpu", origin)
    # MINISGL_CONFIG names the file when --config is not given
    via_env = runner.invoke(main, ["config"], env={"MINISGL_CONFIG": str(CPU_YAML)})
    assert via_env.exit_code == 0, via_env.output
    assert _setting(via_env.stdout, "page_size") == ("16", origin)


@pytest.mark.usefixtures("clean_env")
def test_config_output_loads_back(runner, tmp_path: Path) -> None:
    args = ["--page-size", "32", "--cuda-graph-bs", "1,2,4", "--use-dummy-weight", "--device", "cpu"]
    first = runner.invoke(main, ["config", *args])
    assert first.exit_code == 0, first.output
    assert _setting(first.stdout, "cuda_graph_bs") == ("[1, 2, 4]", "explicit")
    assert _setting(first.stdout, "use_dummy_weight") == ("true", "explicit")
    saved = tmp_path / "saved.yaml"
    saved.write_text(first.stdout)
    again = runner.invoke(main, ["config", "--config", str(saved)])
    assert again.exit_code == 0, again.output
    assert yaml.safe_load(again.stdout) == yaml.safe_load(first.stdout)
    assert _setting(again.stdout, "page_size") == ("32", f"yaml {saved}")
    negated = runner.invoke(main, ["config", "--config", str(saved), "--no-use-dummy-weight"])
    assert negated.exit_code == 0, negated.output
    assert _setting(negated.stdout, "use_dummy_weight") == ("false", "explicit")


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--page-size", "0"], {}, ["page_size", "0"]),
        (["--page-size", "many"], {}, ["page_size", "many"]),
        (["--device", "tpu"], {}, ["device", "tpu"]),
        ([], {"MINISGL_PAGESIZE": "3"}, ["MINISGL_PAGESIZE", "MINISGL_PAGE_SIZE"]),
        ([], {"MINISGL_PAGE_SIZE": "0"}, ["page_size", "MINISGL_PAGE_SIZE"]),
        (["--config", "/nonexistent/settings.yaml"], {}, ["/nonexistent/settings.yaml"]),
    ],
    ids=["zero", "not-a-number", "device", "unknown-env", "bad-env", "missing-yaml"],
)
def test_config_errors(runner, args: list[str], env: dict[str, str], named: list[str]) -> None:
    result = runner.invoke(main, ["config", *args], env=env)
    assert result.exit_code != 0
    assert result.stdout == ""
    for word in named:
        assert word in result.stderr
    _no_traceback(result)


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize(("key", "value"), [("page_size", "32"), ("max_prefill_tokens", "24")])
def test_one_key_through_options_env_and_yaml(
    runner, monkeypatch, tmp_path: Path, key: str, value: str
) -> None:
    """An EngineConfig field and a SchedulerConfig field: --key, MINISGL_KEY, `key:` in YAML, and the
    option reaches LLM(key=...)."""
    flag = "--" + key.replace("_", "-")
    assert _setting(runner.invoke(main, ["config", flag, value]).stdout, key) == (value, "explicit")
    env = f"MINISGL_{key.upper()}"
    assert _setting(runner.invoke(main, ["config"], env={env: value}).stdout, key) == (value, f"env {env}")
    saved = tmp_path / "s.yaml"
    saved.write_text(f"{key}: {value}\n")
    from_yaml = runner.invoke(main, ["config", "--config", str(saved)])
    assert _setting(from_yaml.stdout, key) == (value, f"yaml {saved}")

    calls = []

    def recorded_llm(model: str | None = None, **kwargs: Any) -> None:
        calls.append(kwargs)
        raise ValueError("recorded")

    monkeypatch.setattr(minisgl.llm, "LLM", recorded_llm)
    for command in (["generate", "hi"], ["bench"]):
        result = runner.invoke(main, [*command, flag, value, "-q"])
        assert result.exit_code == 1 and "recorded" in result.stderr, result.output
    assert calls == [{"config": None, key: value}] * 2


@pytest.mark.usefixtures("clean_env")
def test_bad_max_prefill_tokens_option(runner) -> None:
    result = runner.invoke(main, ["config", "--max-prefill-tokens", "0"])
    assert result.exit_code != 0 and result.stdout == ""
    assert "max_prefill_tokens='0'" in result.stderr and "explicit" in result.stderr
    _no_traceback(result)


# -- bench ---------------------------------------------------------------------------------------

BENCH_ARGS = ["--device", "cpu", "--num-seqs", "3", "--min-input", "8", "--max-input", "16"]
BENCH_ARGS += ["--min-output", "4", "--max-output", "8", "-q"]


def test_reference_workload_totals() -> None:
    prompts, max_tokens = make_workload(WorkloadShape(), vocab_size=SMOLLM2_VOCAB)
    assert len(prompts) == len(max_tokens) == 256
    assert sum(map(len, prompts)) == 142_827
    assert sum(max_tokens) == 133_966
    assert all(0 <= t < SMOLLM2_VOCAB for p in prompts for t in p)


@pytest.mark.slow
def test_bench(runner, cli_llm, shared_llm) -> None:
    result = runner.invoke(main, ["bench", *BENCH_ARGS, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    shape = WorkloadShape(num_seqs=3, min_input=8, max_input=16, min_output=4, max_output=8)
    assert report["shape"] == shape.__dict__
    prompts, max_tokens = make_workload(shape, shared_llm.engine.config.model_config.vocab_size)
    assert report["device"] == "cpu" and report["model"] == "smollm2-135m-instruct"
    assert len(report["passes"]) == 2
    for p in report["passes"]:
        assert p["output_tokens"] == sum(max_tokens)
        assert p["input_tokens"] == sum(map(len, prompts))
        assert p["tokens_per_s"] > 0 and p["seconds"] > 0
        assert 0 < p["ttft_p50"] <= p["ttft_p90"] <= p["ttft_p99"]
    assert cli_llm["calls"] == [(None, {"config": None, "device": "cpu"})]


@pytest.mark.slow
def test_bench_text_report(runner, cli_llm, shared_llm) -> None:
    args = [
        "--num-seqs",
        "2",
        "--min-input",
        "4",
        "--max-input",
        "8",
        "--min-output",
        "2",
        "--max-output",
        "3",
    ]
    result = runner.invoke(main, ["bench", "--device", "cpu", "-q", *args])
    assert result.exit_code == 0, result.output
    shape = WorkloadShape(num_seqs=2, min_input=4, max_input=8, min_output=2, max_output=3)
    prompts, max_tokens = make_workload(shape, shared_llm.engine.config.model_config.vocab_size)
    lines = result.stdout.splitlines()
    assert "2 requests, input 4..8, output 2..3" in result.stdout
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["pass", "output"])
    assert "tok/s" in lines[header] and "TTFT p50" in lines[header]
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [row[0] for row in rows] == ["1", "2"]  # both passes
    assert lines[header + 3].startswith("startup: ")
    for row in rows:
        assert row[1:3] == [str(sum(max_tokens)), str(sum(map(len, prompts)))]
        assert float(row[4]) > 0


@pytest.mark.slow
def test_bench_bad_shape(runner, cli_llm) -> None:
    result = runner.invoke(main, ["bench", *BENCH_ARGS[:-5], "--min-output", "9", "--max-output", "8"])
    assert result.exit_code == 2
    assert "--min-output" in result.stderr
    _no_traceback(result)


# -- help and bad input --------------------------------------------------------------------------


def _setting_flags() -> list[str]:
    flags = ["--config", "--model"]
    for name, field in EngineSettings.model_fields.items():
        if name == "model_path":
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag, "--no-" + flag[2:]] if field.annotation is bool else [flag]
    return flags


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (
            "generate",
            ["--metrics-port", "--max-prefill-tokens", "--file", "--chat", "--stop", "--top-p", "-q"],
        ),
        ("bench", ["--metrics-port", "--max-prefill-tokens", "--num-seqs", "--json", "--max-output", "-q"]),
        ("config", []),
    ],
)
def test_help(runner, command: str, extra: list[str]) -> None:
    result = runner.invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    for flag in [*_setting_flags(), *extra]:
        assert re.search(rf"(^|[\s,/]){re.escape(flag)}\b", result.stdout), (
            f"{flag} missing from {command} --help"
        )
    assert "--page-size" in result.stdout and "--attention-backend" in result.stdout


def test_main_help_and_version(runner) -> None:
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("generate", "bench", "config"):
        assert command in result.stdout
    version = runner.invoke(main, ["--version"])
    assert version.exit_code == 0 and "0.1.0" in version.stdout


def test_missing_model_subprocess() -> None:
    proc = _run("generate", "hi", "--model", "/nonexistent/folder", "-q")
    assert proc.returncode != 0
    assert "/nonexistent/folder" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""


@pytest.mark.parametrize("model", ["/nonexistent/folder", "./nonexistent", "empty-dir"])
def test_bad_model(runner, tmp_path: Path, model: str) -> None:
    if model == "empty-dir":
        model = str(tmp_path)  # a folder, but not a model
    result = runner.invoke(main, ["generate", "hi", "--model", model, "--device", "cpu", "-q"])
    assert result.exit_code == 1
    assert model in result.stderr
    assert result.stderr.startswith("Error:")
    _no_traceback(result)


def test_generate_missing_config_file(runner) -> None:
    result = runner.invoke(main, ["generate", "hi", "--config", "/nonexistent/settings.yaml", "-q"])
    assert result.exit_code == 1
    assert "/nonexistent/settings.yaml" in result.stderr
    _no_traceback(result)


@pytest.mark.parametrize("stdin", ["", "\n  \n"], ids=["empty", "blank-lines"])
def test_generate_without_prompt(runner, monkeypatch, stdin: str) -> None:
    """Without prompts, stdin (no terminal under CliRunner) is read, and first said so on stderr: an open
    pipe would otherwise wait without a word."""
    monkeypatch.setattr(minisgl.llm, "LLM", None)  # never reached
    result = runner.invoke(main, ["generate"], input=stdin)
    assert result.exit_code == 2
    assert "Usage:" in result.stderr and "give a prompt" in result.stderr
    assert result.stderr.startswith(STDIN_PROMPT_NOTE + "\n"), result.stderr
    assert "stdin" in STDIN_PROMPT_NOTE and "Ctrl-D" in STDIN_PROMPT_NOTE
    assert result.stdout == ""
    _no_traceback(result)


@pytest.mark.parametrize("given", ["argument", "file"])
def test_generate_stdin_note_only_when_stdin_is_read(runner, monkeypatch, tmp_path: Path, given: str) -> None:
    """A prompt argument or --file: stdin is not read and nothing is said about it (the run stops at a bad
    option, or at an empty file, before any model)."""
    monkeypatch.setattr(minisgl.llm, "LLM", None)  # never reached
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    args = [PROMPT, "--top-p", "0"] if given == "argument" else ["--file", str(empty)]
    result = runner.invoke(main, ["generate", *args], input=f"{PROMPT}\n")
    assert result.exit_code == 2 and "Usage:" in result.stderr, result.output
    assert STDIN_PROMPT_NOTE not in result.output
    _no_traceback(result)
