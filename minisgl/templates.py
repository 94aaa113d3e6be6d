"""A conversation under the model's chat template, with the template's own options
(`chat_template_kwargs`: variables the template reads, such as Qwen3's `enable_thinking`), said once for
`LLM.chat` and the server's `/v1/chat/completions`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# names `apply_chat_template` takes for itself: a template variable cannot have them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "add_generation_prompt",
        "tokenize",
        "chat_template",
        "tools",
        "documents",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
    }
)


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """`kwargs` as the template's variables; ValueError (naming chat_template_kwargs) when it is not an
    object with string keys or sets a name the renderer takes for itself."""
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(
            "chat_template_kwargs must be an object of the template's variables, e.g. "
            f'{{"enable_thinking": false}}, got {type(kwargs).__name__}'
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValueError(
            f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it; give only the "
            "template's own variables"
        )
    return dict(kwargs)


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None
) -> str:
    """The conversation's text under `tokenizer`'s chat template, ending where the reply begins."""
    extra = check_template_kwargs(template_kwargs) if template_kwargs else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
