"""`minisgl-run`: generate text, run the offline benchmark, show the effective settings."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from minisgl import metrics
from minisgl.core import SamplingParams
from minisgl.settings import EngineSettings, SettingsError

# printed to stderr before `generate` waits for prompts on a stdin that is no terminal
STDIN_PROMPT_NOTE = (
    "reading prompts from stdin, one per line, until end of input (Ctrl-D); or give them as arguments"
)


def _settings_options(command: Callable) -> Callable:
    """One option per setting (--page-size, --max-prefill-tokens, ...), help text from its declaration."""
    for name, field in reversed(EngineSettings.model_fields.items()):
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} [env MINISGL_{name.upper()}]"
        if name == "model_path":
            command = click.option(
                "--model",
                "model_path",
                default=None,
                metavar="PATH|ALIAS|HUB_ID",
                help="Model: a local folder, 'smollm2-135m' (the default) or a Hugging Face hub id. "
                "[env MINISGL_MODEL_PATH]",
            )(command)
        elif name == "tp_size":
            command = click.option(
                "--tp",
                "--tp-size",
                "tp_size",
                default=None,
                metavar="N",
                help=f"{help_text} Rank 0 runs here, N-1 ranks in spawned processes.",
            )(command)
        elif name == "dp_size":
            command = click.option(
                "--dp", "--dp-size", "dp_size", default=None, metavar="N", help=f"{help_text} serve only."
            )(command)
        elif name == "lora_modules":
            command = click.option(
                flag, name, multiple=True, metavar="NAME=PATH", help=f"{help_text} Repeatable."
            )(command)
        elif field.annotation in (bool, "bool"):
            command = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)(command)
        else:
            command = click.option(flag, name, default=None, help=help_text, metavar="VALUE")(command)
    command = click.option(
        "--config",
        "config",
        type=click.Path(dir_okay=False),
        default=None,
        help="YAML settings file (else $MINISGL_CONFIG). Options and MINISGL_* variables override it.",
    )(command)
    return command


def _explicit(kwargs: dict[str, Any]) -> dict[str, Any]:
    # a repeatable option given no times is ()
    return {k: v for k, v in kwargs.items() if k in EngineSettings.model_fields and v not in (None, ())}


def _sampling_options(command: Callable) -> Callable:
    options = [
        ("--max-tokens", click.IntRange(min=1), 256, "Most tokens to generate per prompt."),
        ("--temperature", float, 0.0, "Sampling temperature; 0 is greedy."),
        ("--top-k", int, -1, "Keep the k most likely tokens; -1: all."),
        ("--top-p", float, 1.0, "Nucleus sampling mass, in (0, 1]."),
        ("--min-p", float, 0.0, "Drop tokens below this share of the top probability."),
    ]
    flags = [
        click.option("--seed", type=int, default=None, help="Seed: the same seed gives the same tokens."),
        click.option("--stop", multiple=True, help="Stop when the text contains this string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token."),
        click.option(
            "--min-tokens",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="Generate at least this many tokens before any stop condition.",
        ),
    ]
    for option in reversed(flags):
        command = option(command)
    for flag, kind, default, help_text in reversed(options):
        command = click.option(flag, type=kind, default=default, show_default=True, help=help_text)(command)
    return command


def _common(command: Callable) -> Callable:
    command = click.option(
        "--metrics-port",
        type=click.IntRange(1, 65535),
        default=None,
        help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics while running.",
    )(command)
    command = click.option("-q", "--quiet", is_flag=True, help="Log warnings only.")(command)
    return _settings_options(command)


SAMPLING_OPTIONS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "max_tokens",
    "stop",
    "ignore_eos",
    "min_tokens",
)


_LORA_OPTION = click.option(
    "--lora",
    default=None,
    metavar="NAME",
    help="Generate with the LoRA adapter NAME (one of --lora-modules); default: the base model.",
)


def _texts_options(name: str, file_name: str, what: str) -> Callable[[Callable], Callable]:
    """A command's texts: the arguments `name`, and --file (`file_name`) with one of `what` per line."""

    def apply(command: Callable) -> Callable:
        help = f"Read {what} from a file, one per line ('-' for stdin)."
        command = click.option("--file", file_name, type=click.File("r"), default=None, help=help)(command)
        return click.argument(name, nargs=-1)(command)

    return apply


def _message(e: Exception) -> str:
    """An exception's message (a KeyError's str() quotes it)."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    """The sampling options of `generate` and `chat` as SamplingParams (a usage error if invalid)."""
    try:
        return SamplingParams(**{name: kwargs[name] for name in SAMPLING_OPTIONS})
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e)) from e


def _make_llm(kwargs: dict[str, Any]):
    from minisgl.launch.tp import exit_now, launched_rank, worker_main
    from minisgl.llm import LLM, resolve_model

    logging.basicConfig(
        level=logging.WARNING if kwargs["quiet"] else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    explicit = _explicit(kwargs)
    launched = launched_rank()
    if launched is not None and launched[0] > 0:  # a rank started by torchrun & co: follow rank 0, then exit
        rank, size = launched
        if "model_path" in explicit:
            explicit["model_path"] = resolve_model(explicit["model_path"])
        worker_main(rank, {"tp_size": size, "distributed_addr": "env://", **explicit}, kwargs["config"])
        exit_now()  # as a spawned rank ends: no interpreter teardown
    model = explicit.pop("model_path", None)
    if kwargs["metrics_port"] is not None:
        try:
            metrics.serve(kwargs["metrics_port"])
        except OSError as e:
            raise click.ClickException(
                f"cannot serve metrics on 127.0.0.1:{kwargs['metrics_port']}: {e}"
            ) from e
    try:
        return LLM(model, config=kwargs["config"], **explicit)
    except (SettingsError, FileNotFoundError, ValueError, MemoryError, ModuleNotFoundError) as e:
        raise click.ClickException(str(e)) from e


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="minisgl")
def main() -> None:
    """minisgl: a small LLM inference engine. Without --model, the embedded SmolLM2-135M-Instruct runs."""


@main.command()
@_texts_options("prompts", "prompt_file", "prompts")
@click.option("--chat", is_flag=True, help="Wrap each prompt in the model's chat template as a user message.")
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="An image file shown before each prompt (repeatable; with --chat, a vision-language model).",
)
@_LORA_OPTION
@_sampling_options
@_common
def generate(
    prompts: tuple[str, ...],
    prompt_file,
    chat: bool,
    images: tuple[str, ...],
    lora: str | None,
    **kwargs: Any,
) -> None:
    """Generate text for PROMPTS (or --file, or lines of stdin), streaming a single prompt as it is produced."""
    if images and not chat:
        raise click.UsageError("--image needs --chat (the chat template places the images)")
    texts = list(prompts)
    if prompt_file is not None:
        texts += [line.rstrip("\n") for line in prompt_file if line.strip()]
    elif not texts and not sys.stdin.isatty():
        click.echo(STDIN_PROMPT_NOTE, err=True)  # an open pipe would wait without a word
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise click.UsageError('give a prompt: minisgl-run generate "The capital of France is"')
    params = _sampling_params(kwargs)
    from minisgl.llm import RequestError

    llm = _make_llm(kwargs)
    try:
        pictures = [{"type": "image", "image": Path(path)} for path in images]
        inputs = [
            llm.chat_inputs([{"role": "user", "content": [*pictures, {"type": "text", "text": t}]}])
            if chat
            else t
            for t in texts
        ]
        if len(inputs) == 1:
            deltas = llm.stream(
                inputs[0], params, lora=lora
            )  # checks the request: nothing is printed if it can't run
            if not chat:
                click.echo(texts[0], nl=False)
            for delta in deltas:
                click.echo(delta, nl=False)
            click.echo()
            return
        for text, output in zip(texts, llm.generate(inputs, params, progress=True, lora=lora)):
            click.echo(f"{'' if chat else text}{output.text}" if not chat else f"> {text}\n{output.text}")
            if output.error is not None:
                click.echo(f"[{output.error}]", err=True)
            click.echo()
    except (TypeError, ValueError, KeyError, RequestError) as e:
        raise click.ClickException(_message(e)) from e
    finally:
        llm.shutdown()


@main.command()
@_texts_options("texts", "text_file", "inputs")
@click.option("--dimensions", type=int, default=None, help="Keep the first N values (Matryoshka truncation).")
@_common
def embed(texts: tuple[str, ...], text_file, dimensions: int | None, **kwargs: Any) -> None:
    """Print the embedding of each of TEXTS (or --file) as a JSON line: {"index", "text", "embedding"}
    (docs/embeddings.md)."""
    inputs = list(texts)
    if text_file is not None:
        inputs += [line.rstrip("\n") for line in text_file if line.strip()]
    if not inputs:
        raise click.UsageError('give a text: minisgl-run embed "The capital of France is Paris."')
    llm = _make_llm(kwargs)
    try:
        for i, (text, vector) in enumerate(zip(inputs, llm.embed(inputs, dimensions=dimensions))):
            click.echo(json.dumps({"index": i, "text": text, "embedding": vector}))
    except (TypeError, ValueError, RuntimeError) as e:
        raise click.ClickException(_message(e)) from e
    finally:
        llm.shutdown()


# bench's shape options: the shape field each sets (its flag: --field-name) and its help, by the
# workloads that have the field ([default; on CPU])
_SHAPE_FIELDS = {
    "random": [
        ("num_seqs", "requests [256; 32 on CPU]."),
        ("min_input", "shortest prompt [100; 16 on CPU]."),
        ("max_input", "longest prompt [1024; 128 on CPU]."),
    ],
    "shared-prefix": [
        ("groups", "groups of requests sharing a system prompt [16; 4 on CPU]."),
        ("per_group", "requests per group [16; 4 on CPU]."),
        ("prefix_len", "tokens of each group's system prompt [2048; 512 on CPU]."),
        ("min_own", "fewest tokens a request adds to its prefix [128; 16 on CPU]."),
        ("max_own", "most tokens a request adds to its prefix [512; 64 on CPU]."),
    ],
    "multi-turn": [
        ("conversations", "conversations, all in flight [64; 8 on CPU]."),
        ("turns", "turns per conversation [4; 3 on CPU]."),
        ("min_user", "fewest new user tokens per turn [64; 16 on CPU]."),
        ("max_user", "most new user tokens per turn [256; 64 on CPU]."),
    ],
    "": [
        ("min_output", "Fewest new tokens per request [random 100, shared-prefix and multi-turn 128; on CPU 16, 8, 8]."),
        ("max_output", "Most new tokens per request [random 1024, shared-prefix 512, multi-turn 256; on CPU 128, 32, 32]."),
    ],
}  # fmt: skip
# (flag, field, help) of each
_SHAPE_OPTIONS = [
    ("--" + name.replace("_", "-"), name, f"{workload}: {text}" if workload else text)
    for workload, fields in _SHAPE_FIELDS.items()
    for name, text in fields
]


def _shape_options(command: Callable) -> Callable:
    for flag, name, help_text in reversed(_SHAPE_OPTIONS):
        command = click.option(flag, name, type=click.IntRange(min=1), default=None, help=help_text)(command)
    return command


@main.command()
@click.option(
    "--workload",
    type=click.Choice(["random", "shared-prefix", "multi-turn"]),
    default="random",
    show_default=True,
    help="random: the workload Mini-SGLang and nano-vllm publish; shared-prefix: groups of requests "
    "sharing a system prompt; multi-turn: conversations whose turns resend the conversation so far "
    "(docs/bench-workloads.md).",
)
@_shape_options
@click.option("--temperature", type=float, default=0.6, show_default=True, help="Sampling temperature.")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the workload's random generator."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--single-request", is_flag=True, help="Also time one request alone: 128 prompt tokens, 1024 new, greedy."
)
@click.option(
    "--passes", type=click.IntRange(min=1), default=2, show_default=True, help="Timed passes of the workload."
)
@click.option(
    "--keep-cache",
    is_flag=True,
    help="Keep the prefix cache between passes (later passes find the earlier ones' prompts); by default "
    "it is emptied before each pass, so every pass starts cold.",
)
@_common
def bench(workload, temperature, seed, as_json, single_request, passes, keep_cache, **kwargs) -> None:
    """The offline throughput benchmark: a workload (--workload, random by default) timed --passes times
    after a warm-up; tokens/s, time to first token and the prefix cache's hit rate per pass."""
    import dataclasses
    import time

    from minisgl.bench.offline import default_shape, dumps, format_report, run_bench

    given = {name: kwargs.pop(name) for _, name, _ in _SHAPE_OPTIONS}
    given = {name: value for name, value in given.items() if value is not None}
    fields = {f.name for f in dataclasses.fields(default_shape(workload, "cpu"))}
    unknown = [flag for flag, name, _ in _SHAPE_OPTIONS if name in given and name not in fields]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not an option of --workload {workload}")
    started = time.perf_counter()
    llm = _make_llm(kwargs)
    startup = time.perf_counter() - started
    try:
        base = default_shape(workload, llm.engine.device.type)
        values = {**dataclasses.asdict(base), **given, "temperature": temperature, "seed": seed}
        for name in sorted(fields):  # each range's bounds, as the options name them
            if name.startswith("min_") and values[name] > values["max_" + name[4:]]:
                flag = name[4:].replace("_", "-")
                raise click.BadParameter(f"--min-{flag} must not exceed --max-{flag}")
        try:
            shape = type(base)(**values)
        except ValueError as e:
            raise click.BadParameter(str(e)) from e
        report = {
            "startup_seconds": startup,
            **run_bench(llm, shape, passes=passes, single=single_request, keep_cache=keep_cache),
        }
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    finally:
        llm.shutdown()
    click.echo(dumps(report) if as_json else format_report(report))


@main.command()
@click.option("-q", "--quiet", is_flag=True, help="Log warnings only.")
@_settings_options
def serve(quiet: bool, **kwargs: Any) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics; SGLang's /generate) on --host (127.0.0.1) and --port until SIGINT or
    SIGTERM; --dp N runs N replicas behind it (docs/scale-out.md)."""
    from minisgl.launch.tp import exit_now
    from minisgl.server.app import serve as run_server
    from minisgl.server.replicas import replica_settings

    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    explicit = _explicit(kwargs)
    try:  # bad settings fail here, before any process
        replica_settings(EngineSettings.load(kwargs["config"], **explicit), explicit)
    except (SettingsError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    try:
        run_server(explicit, kwargs["config"])
    except SystemExit as e:  # as Python ends on it: a message goes to stderr with status 1
        if isinstance(e.code, str):
            sys.stderr.write(e.code + "\n")
        exit_now(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
    exit_now()  # the server stopped: the process ends without tearing its modules down


@main.command()
@_settings_options
def config(**kwargs: Any) -> None:
    """Print the effective settings as YAML, each with where its value came from."""
    explicit = _explicit(kwargs)
    try:
        settings = EngineSettings.load(kwargs["config"], **explicit)
    except (SettingsError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    if kwargs["config"]:
        click.echo(f"# settings file: {Path(kwargs['config']).resolve()}")
    click.echo(settings.to_yaml(with_sources=True), nl=False)


# -- bench-serving and chat ----------------------------------------------------------------------


def _option(flag: str, kind: Any, default: Any, help: str) -> Any:
    """A bench-serving option of type `kind`; its default shown unless it is None (unset)."""
    return click.option(flag, type=kind, default=default, show_default=default is not None, help=help)


POSITIVE = click.FloatRange(min=0, min_open=True)


@main.command("bench-serving")
@click.option(
    "--base-url",
    default="http://127.0.0.1:30000/v1",
    show_default=True,
    help="The server's OpenAI API root (as `minisgl-run serve` prints it).",
)
@click.option("--model", default=None, help="Model name to request [default: the first of GET /v1/models].")
@click.option("--api-key", default=None, help="Bearer key [default: $MINISGL_API_KEY, else 'EMPTY'].")
@click.option(
    "--num-prompts", type=click.IntRange(min=1), default=None, help="Requests [default: 256, as `bench`]."
)
@click.option("--min-input", type=click.IntRange(min=1), default=None, help="Shortest prompt [100].")
@click.option("--max-input", type=click.IntRange(min=1), default=None, help="Longest prompt [1024].")
@click.option("--min-output", type=click.IntRange(min=1), default=None, help="Fewest new tokens [100].")
@click.option("--max-output", type=click.IntRange(min=1), default=None, help="Most new tokens [1024].")
@click.option(
    "--vocab-size",
    type=click.IntRange(min=2),
    default=None,
    help="Wrap prompt token ids into [0, N) for models with a vocabulary of 10,000 or less.",
)
@click.option("--temperature", type=float, default=0.6, show_default=True, help="Sampling temperature.")
@_option(
    "--request-rate",
    POSITIVE,
    float("inf"),
    "Requests per second, Poisson arrivals; inf sends them all at once.",
)
@_option(
    "--max-concurrency", click.IntRange(min=1), None, "Most requests in flight at once [default: unlimited]."
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the workload and of the arrival times."
)
@_option("--timeout", POSITIVE, 3600.0, "Stop after this many seconds; unfinished requests count as failed.")
@_option(
    "--endpoint",
    click.Choice(["completions", "chat"]),
    "completions",
    "POST /completions, or /chat/completions (one user message per prompt; needs --tokenizer).",
)
@_option(
    "--prompt-format",
    click.Choice(["ids", "text"]),
    "ids",
    "Completions: send the prompts as token ids, or decoded to text (needs --tokenizer).",
)
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="A tokenizer folder (transformers) that decodes the prompts to text, once, for chat and text.",
)
@click.option(
    "--stream/--no-stream", default=True, show_default=True, help="Streamed requests (TTFT, ITL) or not."
)
@click.option(
    "--n", "n", type=click.IntRange(min=1), default=1, show_default=True, help="Choices per request."
)
@click.option(
    "--return-token-ids/--no-return-token-ids",
    default=True,
    show_default=True,
    help="Ask for the token ids of each chunk (minisgl's return_token_ids; other servers may refuse it).",
)
@_option(
    "--client-processes",
    click.IntRange(min=1),
    None,
    "Client processes the requests are spread over [default: a quarter of the CPUs, 1 to 8].",
)
@click.option(
    "--extra-body",
    default=None,
    help="A JSON object added to every request's body, e.g. '{\"logprobs\": 5}' or penalties.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench_serving_command(
    base_url,
    model,
    api_key,
    num_prompts,
    min_input,
    max_input,
    min_output,
    max_output,
    vocab_size,
    temperature,
    request_rate,
    max_concurrency,
    seed,
    timeout,
    endpoint,
    prompt_format,
    tokenizer,
    stream,
    n,
    return_token_ids,
    client_processes,
    extra_body,
    as_json,
) -> None:
    """Benchmark a running OpenAI-compatible server (`minisgl-run serve`): the offline `bench` workload
    sent as streamed /v1/completions (or chat) requests; reports throughput, TTFT, ITL, TPOT and E2E."""
    from minisgl.bench.serving import bench_serving, dumps, format_report, with_texts, workload

    if (endpoint == "chat" or prompt_format == "text") and tokenizer is None:
        what = "--endpoint chat" if endpoint == "chat" else "--prompt-format text"
        raise click.BadParameter(f"{what} needs --tokenizer PATH (to decode the prompts to text)")

    extra = None
    if extra_body is not None:
        try:
            extra = json.loads(extra_body)
        except ValueError as e:
            raise click.BadParameter(f"--extra-body is not JSON ({e}): {extra_body[:60]!r}") from None
        if not isinstance(extra, dict):
            raise click.BadParameter(f"--extra-body must be a JSON object, got {extra_body[:60]!r}")
    for low, high, names in ((min_input, max_input, "input"), (min_output, max_output, "output")):
        if low is not None and high is not None and low > high:
            raise click.BadParameter(f"--min-{names} must not exceed --max-{names}")
    try:
        requests = workload(num_prompts, min_input, max_input, min_output, max_output, seed, vocab_size)
        if tokenizer is not None and (endpoint == "chat" or prompt_format == "text"):
            requests = with_texts(requests, tokenizer)
        report = bench_serving(
            requests,
            base_url=base_url,
            model=model,
            api_key=api_key,
            temperature=temperature,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            seed=seed,
            timeout=timeout,
            endpoint=endpoint,
            prompt_format=prompt_format,
            stream=stream,
            n=n,
            return_token_ids=return_token_ids,
            client_processes=client_processes,
            extra_body=extra,
            progress=not as_json and sys.stderr.isatty(),
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    except (RuntimeError, TimeoutError, OSError) as e:
        raise click.ClickException(f"cannot benchmark {base_url}: {type(e).__name__}: {e}") from e
    click.echo(dumps(report) if as_json else format_report(report))
    if report["interrupted"]:  # a partial report, then the exit status the signal's default gives
        import signal

        sys.exit(128 + signal.Signals[report["interrupted"]])


@main.command("chat")
@click.option("--system", default=None, help="A system prompt that starts the conversation.")
@_LORA_OPTION
@_sampling_options
@_common
def chat_command(system: str | None, lora: str | None, **kwargs: Any) -> None:
    """Chat with the model in the terminal: one message per line, the reply streams. /reset clears the
    conversation; /exit, /quit or end of input (Ctrl-D) ends; Ctrl-C stops a reply."""
    from minisgl.chat import ChatSession, NoChatTemplate, run_chat

    params = _sampling_params(kwargs)
    llm = _make_llm(kwargs)
    try:
        if lora is not None:
            llm.scheduler.lora_adapter(lora)  # not loaded: said before the first prompt
        run_chat(ChatSession(llm, params, system=system, lora=lora))
    except (NoChatTemplate, ValueError, KeyError) as e:
        raise click.ClickException(_message(e)) from e
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
