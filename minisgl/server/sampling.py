"""A checked OpenAI request (`minisgl.server.protocol`) as the engine's sampling parameters: one
`minisgl.core.SamplingParams` per choice (`sampling_params`), for a prompt of `prompt_len` tokens on a
model whose context holds `max_context`. Pure functions, no HTTP and no engine. The parameters and their
defaults: docs/server.md ("Endpoints").
"""

from __future__ import annotations

from dataclasses import replace

from minisgl.core import INT64_MAX, MAX_LOGPROBS, SamplingParams
from minisgl.server.errors import APIError, context_exceeded, invalid_request
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.server.structured import StructuredOutputError, grammar_fields


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_context: int,
    tool_grammar: str | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice (`n`) for a prompt of `prompt_len` tokens on a model whose context
    holds `max_context` tokens (prompt and reply); `tool_grammar`: the EBNF of forced tool calls.
    APIError 400 when the request cannot run."""
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if prompt_len < 1:
        raise APIError("the prompt is empty: give at least one token", param=prompt_param)
    room = max_context - prompt_len
    if room < 1:
        raise context_exceeded(prompt_len, max_context, prompt_param)
    name, max_tokens = request.max_tokens_param()
    echo = bool(getattr(request, "echo", False))
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < (0 if echo else 1):
        raise APIError(
            f"{name} must be at least 1 (0 only with echo, to score a prompt), got {name}={max_tokens}",
            param=name,
        )
    elif max_tokens > room:
        raise APIError(
            f"{name}={max_tokens} and the prompt's {prompt_len} tokens make {prompt_len + max_tokens}, "
            f"more than this model's context of {max_context} tokens: ask for at most {room} tokens or "
            "shorten the prompt",
            param=name,
            code="context_length_exceeded",
        )
    given = {
        "top_p": request.top_p,
        "seed": request.seed,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "logit_bias": request.logit_bias,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        **_logprob_params(request),
    }
    temperature = 1.0 if request.temperature is None else request.temperature
    try:
        given.update(grammar_fields(request.response_format, request.regex, request.ebnf))
    except StructuredOutputError as e:
        raise APIError(str(e), param=e.param) from None
    aliases = {}
    if tool_grammar is not None:
        if given.keys() & {"json_schema", "json_object", "regex", "ebnf"}:
            raise APIError(
                "tool_choice forces tool calls, which response_format, regex and ebnf cannot constrain "
                'as well: give one of them, or tool_choice "auto"',
                param="tool_choice",
            )
        if request.ignore_eos:
            raise APIError(
                "tool_choice forces tool calls, which end where their grammar does: leave ignore_eos out",
                param="tool_choice",
            )
        given["ebnf"], aliases["ebnf"] = tool_grammar, "tool_choice"
    try:
        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            **{key: value for key, value in given.items() if value is not None},
        )
    except (TypeError, ValueError) as e:
        logprobs = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        raise invalid_request(
            e, {"max_tokens": name, "logprobs": logprobs, "prompt_logprobs": "logprobs", **aliases}
        ) from None
    n = request.n or 1
    if params.seed is None:
        return [params] * n
    if params.seed + n - 1 > INT64_MAX:
        raise APIError(
            f"seed={params.seed} with n={n}: choice i uses seed + i, which must stay below 2**63; "
            f"use a seed of at most {INT64_MAX - n + 1}",
            param="seed",
        )
    return [replace(params, seed=params.seed + i) for i in range(n)]


def _logprob_params(request: CompletionRequest | ChatCompletionRequest) -> dict[str, int | None]:
    """SamplingParams' `logprobs` and `prompt_logprobs` of a request (their ranges checked there)."""
    if isinstance(request, ChatCompletionRequest):
        k = request.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise APIError(
                f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the alternatives given per "
                f"token), got top_logprobs={k}",
                param="top_logprobs",
            )
        if not request.logprobs:
            if k:
                raise APIError(
                    f"top_logprobs={k} needs logprobs: true (it says how many alternatives each token's "
                    "log probability comes with)",
                    param="top_logprobs",
                )
            return {}
        return {"logprobs": k or 0}
    k = request.logprobs
    return {"logprobs": k, "prompt_logprobs": k if request.echo else None}
