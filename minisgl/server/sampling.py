"""A checked OpenAI request (`minisgl.server.protocol`) as the engine's sampling parameters: one
`minisgl.core.SamplingParams` per choice (`sampling_params`), for a prompt of `prompt_len` tokens on a
model whose context holds `max_context`. Pure functions, no HTTP and no engine.

The request's fields onto `minisgl.core.SamplingParams`:

- ``max_tokens`` (chat: ``max_completion_tokens``, or ``max_tokens``, its older name) -> ``max_tokens``.
  Unset: the rest of the context, ``max_context - prompt_len``. The prompt and max_tokens must fit in
  the context, else a 400 with code "context_length_exceeded".
- ``temperature`` -> ``temperature``; unset or null: 1.0, OpenAI's default (the engine's own default is 0,
  greedy). 0 is greedy.
- ``top_p``, ``seed``, ``stop`` (a string or a list of strings) -> the same fields.
- ``n`` (1 to 128) -> n SamplingParams. With a seed, choice i uses ``seed + i``: the choices differ and
  each one is reproducible. Without a seed each choice draws a random seed of its own.
- The engine's own fields, as extra body fields (the names vLLM and SGLang use): ``top_k``, ``min_p``,
  ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` -> the same fields.
- ``chat_template_kwargs`` (chat, extra): the chat template's own variables (``minisgl.templates``).
- ``separate_reasoning`` (chat, extra; SGLang's): the ``<think>...</think>`` of a thinking model goes to
  the message's (or delta's) ``reasoning_content``, the rest to ``content``.
- ``logit_bias`` -> ``logit_bias`` (keys: token ids as strings; values in [-100, 100]; ids in the
  vocabulary, checked by the scheduler).
- ``presence_penalty``, ``frequency_penalty`` (OpenAI's, in [-2, 2]) and ``repetition_penalty`` (extra,
  in (0, 10]) -> the same fields.
- ``response_format`` (both endpoints; ``text``, ``json_object``, ``json_schema``) and ``regex``,
  ``ebnf`` (extra, SGLang's) -> ``json_object``, ``json_schema``, ``regex``, ``ebnf``
  (``minisgl.server.structured``; docs/structured-output.md).
- ``tool_choice`` (chat) "required" or a named function -> ``ebnf``, the forced calls' grammar
  (``minisgl.server.tool_grammar``, given as `tool_grammar`; docs/tools.md); it excludes the fields
  above.
- Log probabilities (of the model's own distribution, before logit_bias, penalties and temperature):
  completions ``logprobs`` k (0 to 20) -> ``logprobs`` k, and with ``echo`` also ``prompt_logprobs`` k
  (``echo`` puts the prompt before the text; with it ``max_tokens`` may be 0, to score a prompt); chat
  ``logprobs: true`` with ``top_logprobs`` k -> ``logprobs`` k. Shapes: `minisgl.server.logprobs`.
- ``return_token_ids`` (extra): each choice, and each streamed chunk, carries the generated token ids in
  a ``token_ids`` field. Default: true when the completion prompt is a list of token ids (the mode of
  models without a tokenizer, whose text is empty), false otherwise.

SamplingParams checks the values again: its TypeError / ValueError become 400s naming the parameter
(`minisgl.server.errors.invalid_request`).
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
