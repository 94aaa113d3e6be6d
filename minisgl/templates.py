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


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    """Splits a reply of a model that thinks in ``<think>...</think>`` into its reasoning and its
    content, piece by piece as the text arrives (SGLang's `separate_reasoning`): a reply that starts
    with ``<think>`` (after blanks), or whose prompt ended inside one (`in_reasoning`: the template
    opened it), is reasoning up to ``</think>``; the rest, its leading blanks dropped, is content. A tag
    cut across pieces is held back until it is whole, so the split does not depend on the pieces."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.mode = "reasoning" if in_reasoning else "start"
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next piece) completes; `final`: the reply
        ends here (nothing is held back)."""
        held = self.held + text
        reasoning = content = ""
        while True:
            if self.mode == "start":
                rest = held.lstrip()
                if rest.startswith(THINK_OPEN):
                    held, self.mode = rest[len(THINK_OPEN) :], "reasoning"
                elif THINK_OPEN.startswith(rest) and not final:
                    break  # still may become <think>
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                end = held.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += held[:end]
                    held, self.mode = held[end + len(THINK_CLOSE) :], "after"
                    continue
                keep = 0 if final else _partial_tag(held, THINK_CLOSE)
                reasoning, held = reasoning + held[: len(held) - keep], held[len(held) - keep :]
                break
            elif self.mode == "after":  # the blanks between </think> and the content are dropped
                held = held.lstrip()
                if held:
                    self.mode = "content"
                else:
                    break
            else:
                content, held = content + held, ""
                break
        self.held = held
        return reasoning, content


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """A whole reply's (reasoning, content) (`ReasoningSplitter` in one piece)."""
    return ReasoningSplitter(in_reasoning).feed(text, final=True)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
