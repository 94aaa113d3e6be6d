"""SGLang's native API on a minisgl server: `POST /generate` and the endpoints SGLang's router asks its
workers for (`/server_info`, `/model_info`, `/get_load`). The parsing and the answers are pure
functions, like `protocol`'s; `add_routes` puts them on the server's app. The sampling parameters become
a `/v1/completions` request checked by `protocol`, so errors name SGLang's fields. Fields, defaults and
the answer's shape: docs/scale-out.md ("SGLang's `/generate`").
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from minisgl.core import SamplingParams
from minisgl.server import generation, protocol, responses
from minisgl.server.errors import APIError, error_body, short
from minisgl.server.guards import error_response, why_unavailable
from minisgl.server.jobs import Job
from minisgl.server.sampling import sampling_params
from minisgl.server.state import ServerState

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for max_new_tokens


def _none(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _true(v: Any) -> bool:
    return v is None or v is True


def _any_bool(v: Any) -> bool:
    return v is None or isinstance(v, bool)


# top-level fields of SGLang's GenerateReqInput taken at the values that ask for nothing minisgl lacks
_TOP_DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "return_logprob": _false,
    "logprob_start_len": lambda v: v is None or (type(v) is int and v == -1),
    "top_logprobs_num": lambda v: v is None or (type(v) is int and v == 0),
    "token_ids_logprob": _none,
    "return_text_in_logprobs": _any_bool,  # shapes log probabilities, which are not asked for
    "log_metrics": _any_bool,  # SGLang's own logging
    "no_logs": _any_bool,
    "return_hidden_states": _false,
    "return_bytes": _false,
    "return_entropy": _false,
    "background": _false,
    "data_parallel_rank": _none,
    "lora_path": _none,
    "input_embeds": _none,
    "audio_data": _none,
    "video_data": _none,
    "session_params": _none,
    "custom_logit_processor": _none,
    "bootstrap_host": _none,
    "bootstrap_port": _none,
    "bootstrap_room": _none,
}
# sampling_params: SGLang's name -> the /v1/completions field that does the same
_SAMPLING = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    **{
        name: name
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "logit_bias",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "regex",
            "ebnf",
        )
    },
}
_SAMPLING_DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "skip_special_tokens": _true,
    "spaces_between_special_tokens": _true,
    "no_stop_trim": _false,
    "n": lambda v: v is None or (type(v) is int and v == 1),
    "structural_tag": _none,
    "custom_params": lambda v: v is None or v == {},
    "stream_interval": _none,
}


def _check_fields(
    given: dict[str, Any], known: set[str], defaults: dict[str, Callable[[Any], bool]], where: str
) -> None:
    """The fields of `given` (`where` prefixes their names: "sampling_params.") that are not `known`
    must be in `defaults` with a value it takes (`protocol.check_unsupported`)."""
    accepted = {where + name: check for name, check in defaults.items()}
    for name, value in given.items():
        if name not in known:
            protocol.check_unsupported(where + name, value, accepted)


@dataclass(frozen=True)
class GenerateRequest:
    """A checked `POST /generate`: `request` is the same request as `/v1/completions` sees it."""

    request: protocol.CompletionRequest
    rid: str
    prompt_field: str  # "text" or "input_ids"
    default_max: bool  # max_new_tokens unset: SGLang's default applies
    # image_data (a vision-language model, docs/vision.md): URLs, data URLs or base64 strings, one per
    # <|image_pad|> of the text, in order
    image_data: tuple[str, ...] = ()

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    def renamed(self, e: APIError) -> APIError:
        return _renamed(e, self.prompt_field)

    async def checked(self, pending: Awaitable[list[int]]) -> list[int]:
        """The prompt's ids from `pending` (the server's tokenization), its errors renamed."""
        try:
            return await pending
        except APIError as e:
            raise self.renamed(e) from None

    def sampling_params(self, prompt_len: int, max_context: int) -> list[SamplingParams]:
        """One SamplingParams (`minisgl.server.sampling.sampling_params`), with SGLang's default
        max_new_tokens."""
        request = self.request
        if self.default_max:
            room = max_context - prompt_len
            request = request.model_copy(update={"max_tokens": max(1, min(DEFAULT_MAX_NEW_TOKENS, room))})
        try:
            return sampling_params(request, prompt_len, max_context)
        except APIError as e:
            raise self.renamed(e) from None


def _renamed(e: APIError, prompt_field: str) -> APIError:
    """`e` (about the completion request) with SGLang's names for the field it names: `prompt_field`
    for the prompt, `sampling_params.NAME` for a sampling parameter (NAME in the message too)."""
    if e.param is None:
        return e
    head = re.split(r"[.\[]", e.param, maxsplit=1)[0]
    if head == "prompt":
        new, message = prompt_field, e.message.replace("'prompt", f"'{prompt_field}")
    elif head == "response_format":  # only ever made from sampling_params.json_schema
        new, head, message = "sampling_params.json_schema", e.param, e.message.replace(e.param, "json_schema")
    elif head in _SAMPLING.values():
        name = next(sg for sg, field in _SAMPLING.items() if field == head)
        new, message = "sampling_params." + name, re.sub(rf"\b{head}\b", name, e.message)
    else:  # model, stream: the same names
        return e
    e.message, e.param = message, new + e.param[len(head) :]
    return e


def _json_schema_format(schema: Any) -> dict[str, Any]:
    """SGLang's `sampling_params.json_schema` (a JSON schema as a string) as OpenAI's response_format."""
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else None
    except ValueError as e:
        raise APIError(
            f"sampling_params.json_schema is not valid JSON ({e}); give a JSON schema as a string",
            param="sampling_params.json_schema",
        ) from None
    if not isinstance(parsed, dict):
        raise APIError(
            f"sampling_params.json_schema must be a JSON schema object as a string, got {short(schema)}",
            param="sampling_params.json_schema",
        )
    return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": parsed}}


def parse_generate(
    body: Any, served_model: str | protocol.Served, limits: protocol.Limits | None = None
) -> GenerateRequest:
    """A `POST /generate` body (the decoded JSON) as a checked request; APIError 400 or 404. Its LoRA
    adapter (`lora_name`, or `model`) is the request's `model`."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    known = {"text", "input_ids", "sampling_params", "stream", "rid", "model", "lora_name", "image_data"}
    _check_fields(body, known, _TOP_DEFAULTS, "")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise APIError("give the prompt as exactly one of 'text' and 'input_ids'", param="text")
    sampling = body.get("sampling_params")
    sampling = {} if sampling is None else sampling
    if not isinstance(sampling, dict):
        raise APIError(f"sampling_params must be an object, got {short(sampling)}", param="sampling_params")
    _check_fields(sampling, {*_SAMPLING, "json_schema"}, _SAMPLING_DEFAULTS, "sampling_params.")
    if type(sampling.get("max_new_tokens")) is int and sampling["max_new_tokens"] == 0:
        raise APIError(
            "sampling_params.max_new_tokens must be at least 1 on this server, got 0",
            param="sampling_params.max_new_tokens",
        )
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise APIError(f"rid must be a string, got {short(rid)}", param="rid")
    model, lora = body.get("model"), body.get("lora_name")
    if lora is not None:
        if not isinstance(lora, str):
            raise APIError(
                f"lora_name must be a string (an adapter's name), got {short(lora)}", param="lora_name"
            )
        if model is not None and model != lora:
            raise APIError(
                f"model={short(model)} and lora_name={short(lora)} disagree: give the adapter in one of them",
                param="lora_name",
            )
        model = lora
    base = served_model.base if isinstance(served_model, protocol.Served) else served_model
    completion = {
        "model": base if model is None else model,
        "prompt": ids if text is None else text,
        **{
            _SAMPLING[name]: value
            for name, value in sampling.items()
            if name in _SAMPLING and value is not None
        },
    }
    if sampling.get("json_schema") is not None:
        completion["response_format"] = _json_schema_format(sampling["json_schema"])
    if body.get("stream") is not None:
        completion["stream"] = body["stream"]
    prompt_field = "text" if text is not None else "input_ids"
    try:
        checked = protocol.parse_completion_request(completion, served_model, limits)
    except APIError as e:
        raise _renamed(e, prompt_field) from None
    images = _image_data(body.get("image_data"), prompt_field)
    return GenerateRequest(
        checked, rid or uuid.uuid4().hex, prompt_field, "max_tokens" not in completion, images
    )


def _image_data(value: Any, prompt_field: str) -> tuple[str, ...]:
    """`image_data` as a tuple of image references: a string or a list of strings, each a URL, a data
    URL, or base64 data (made a data URL); with a text prompt only."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise APIError(
            f"image_data must be a string or a list of strings, got {short(value)}", param="image_data"
        )
    if items and prompt_field != "text":
        raise APIError(
            "image_data needs the prompt as 'text' (holding an image placeholder per image)",
            param="image_data",
        )
    return tuple(
        item if "://" in item or item.startswith("data:") else "data:;base64," + item for item in items
    )


# ---------------------------------------------------------------------------------------------- answers


def finish_reason(choice: Any) -> dict[str, Any] | None:
    """SGLang's finish_reason of a choice (the server's `Choice`): null while it runs; "error" and
    "abort" raise the APIError that replaces the answer (`responses.openai_finish_reason`)."""
    reason = choice.finish_reason
    if reason is None:
        return None
    responses.openai_finish_reason(reason, choice.error)
    if reason == "length":
        return {"type": "length", "length": len(choice.token_ids)}
    if choice.hidden_last:  # EOS or a stop token
        return {"type": "stop", "matched": choice.token_ids[-1]}
    full = choice.detokenizer.text if choice.detokenizer is not None else ""
    cut = len(choice.text)
    matched = next((s for s in choice.params.stop if full.startswith(s, cut)), None)
    return {"type": "stop", "matched": matched}


def generate_response(
    request: GenerateRequest, choice: Any, text: str, ids: list[int], prompt_tokens: int, e2e_s: float
) -> dict[str, Any]:
    """The `/generate` answer for `choice`, its text and token ids so far (all of them once finished)."""
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": request.rid,
            "finish_reason": finish_reason(choice),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "e2e_latency": e2e_s,
        },
    }


async def stream_events(
    request: GenerateRequest,
    job: Any,
    prompt_tokens: int,
    elapsed: Callable[[], float],
    written: Callable[[], None],
    release: Callable[[], None],
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed `/generate` (one choice): each time the job is woken with
    news, the text and ids so far (what might begin a stop string held back); the last event carries
    the finish reason, then `data: [DONE]`. `written()` after each write of tokens, `release()` at the
    end (the client gone included)."""
    [choice] = job.choices
    text = ""
    try:
        while True:
            await job.wake.wait()
            job.wake.clear()
            generation.check_rejected(choice)
            before = choice.emitted_ids
            delta, _ = choice.take()
            text += delta
            if choice.emitted_ids > before or choice.finished:
                answer = generate_response(
                    request, choice, text, choice.token_ids[: choice.emitted_ids], prompt_tokens, elapsed()
                )
                yield responses.sse(answer).encode()
                written()
            if choice.finished:
                break
        yield responses.SSE_DONE.encode()
    except APIError as e:
        yield (responses.sse(error_body(e)) + responses.SSE_DONE).encode()
    finally:
        release()


# ------------------------------------------------------------------------------ what the router reads


def server_info(
    model_path: str, served_model: str, tp_size: int, dp_size: int, max_running_req: int, max_context: int
) -> dict[str, Any]:
    """`GET /server_info` (and `/get_server_info`): the router reads the model's names and the sizes."""
    return {
        "model_path": model_path,
        "served_model_name": served_model,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "max_running_requests": max_running_req,
        "context_length": max_context,
        "engine": "minisgl",
        "version": _version(),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minisgl")
    except PackageNotFoundError:
        return "unknown"


def model_info(model_path: str, has_tokenizer: bool) -> dict[str, Any]:
    """`GET /model_info` (and `/get_model_info`): the model's folder, type and architectures."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    return {
        "model_path": model_path,
        "tokenizer_path": model_path if has_tokenizer else None,
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


# ------------------------------------------------------------------------------------------- the routes


def add_routes(app: FastAPI, state: ServerState) -> None:
    """SGLang's routes on `app`: `POST /generate` and what its router reads."""

    @app.post("/generate")
    async def generate_route(request: Request) -> Response:
        return await _generate(state, request)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info_route() -> Response:
        return _answer(
            state,
            lambda info: server_info(
                info["model_path"],
                state.served_model,
                state.tp_size,
                state.dp_size,
                info["max_running_req"],
                info["max_context"],
            ),
        )

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info_route() -> Response:
        return _answer(state, lambda info: model_info(info["model_path"], state.encoder is not None))

    @app.get("/get_load")
    async def get_load_route() -> Response:
        return _answer(state, lambda info: state.client.loads())


async def _generate(state: ServerState, request: Request) -> Response:
    """`POST /generate`: one choice, answered whole or streamed as the text and token ids so far."""
    job = Job(time.perf_counter())
    prepared = await generation.prepare_request(
        state,
        request,
        parse_generate,
        lambda req: req.checked(
            generation.tokenize_prompt(state, req.request, "completion", images=req.image_data)
        ),
        lambda req, prompt_len, max_context: req.sampling_params(prompt_len, max_context),
    )
    if isinstance(prepared, Response):
        return prepared
    req, prompt_ids, params = prepared
    generation.admit_job(state, job, params, prompt_ids, model=req.request.model)
    elapsed = lambda: time.perf_counter() - job.received  # noqa: E731
    release = lambda: generation.release_job(state, job, req.rid, len(prompt_ids))  # noqa: E731
    if req.stream:
        written = lambda: state.delivery.observe(job.written(time.perf_counter()))  # noqa: E731
        return StreamingResponse(
            stream_events(req, job, len(prompt_ids), elapsed, written, release),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await generation.wait_all(job, request)
        [choice] = job.choices
        answer = generate_response(req, choice, choice.text, choice.token_ids, len(prompt_ids), elapsed())
        return JSONResponse(answer)
    except APIError as e:
        return error_response(e)
    except ClientDisconnect:  # its choice is aborted below
        return generation.client_gone()
    finally:
        release()


def _answer(state: ServerState, make: Any) -> Response:
    """`make(the scheduler's facts)` as JSON once the server serves; else the 503 that says why."""
    unavailable = why_unavailable(state)
    return error_response(unavailable) if unavailable is not None else JSONResponse(make(state.client.info))
