"""A conversation under the model's chat template, with the template's own options
(`chat_template_kwargs`: variables the template reads, such as Qwen3's `enable_thinking`), said once for
`LLM.chat` and the server's `/v1/chat/completions`; and the tokenizer of a model folder with its chat
template, also where the checkpoint keeps it in `chat_template.json` (`load_tokenizer`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# the file some checkpoints (Mistral's among them) keep their chat template in, beside the tokenizer:
# {"chat_template": "..."}; transformers' AutoTokenizer reads only tokenizer_config.json and
# chat_template.jinja
CHAT_TEMPLATE_JSON = "chat_template.json"


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """transformers' AutoTokenizer of the model folder `path`. Where it brings no chat template, the one
    of the folder's `chat_template.json` (if any) becomes its template."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    if not tokenizer.chat_template:
        template = json_chat_template(path)
        if template is not None:
            tokenizer.chat_template = template
    return tokenizer


def eos_token_id_from_files(folder: str | os.PathLike[str]) -> int | None:
    """The id `load_tokenizer(folder).eos_token_id` has, read from the folder's tokenizer_config.json
    and tokenizer.json without transformers (whose imports take seconds): the `eos_token` the config
    names, found among tokenizer.json's added tokens or its vocabulary. None where these files cannot
    tell for sure (no such files, a special_tokens_map.json, no EOS named, the token not found, or two
    files disagreeing): then only the tokenizer can."""
    root = Path(folder)
    if (root / "special_tokens_map.json").exists():
        return None
    try:
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        model = json.loads((root / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str) or not isinstance(model, dict):
        return None
    ids = set()
    for entry in config.get("added_tokens_decoder", {}).items():
        if isinstance(entry[1], dict) and entry[1].get("content") == eos:
            ids.add(int(entry[0]))
    for token in model.get("added_tokens") or ():
        if isinstance(token, dict) and token.get("content") == eos:
            ids.add(token.get("id"))
    vocab = (model.get("model") or {}).get("vocab")
    if not ids and isinstance(vocab, dict) and eos in vocab:
        ids.add(vocab[eos])
    found = ids.pop() if len(ids) == 1 else None
    return found if isinstance(found, int) else None


def json_chat_template(folder: str | os.PathLike[str]) -> str | dict[str, str] | None:
    """The chat template of `folder`'s `chat_template.json`: its `chat_template` string (or named
    templates: an object of strings, or a list of {"name", "template"} as tokenizer_config.json writes
    them); None without the file. ValueError naming the file where it holds no template."""
    path = Path(folder) / CHAT_TEMPLATE_JSON
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object with a chat_template ({e})") from e
    if isinstance(template, list) and all(isinstance(t, dict) for t in template):
        template = {t.get("name"): t.get("template") for t in template}
    if isinstance(template, str) or (
        isinstance(template, dict)
        and template
        and all(isinstance(k, str) and isinstance(v, str) for k, v in template.items())
    ):
        return template
    raise ValueError(
        f"{path}: chat_template must be a template string, or named templates, got {type(template).__name__}"
    )


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
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: Mapping[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The conversation's text under `tokenizer`'s chat template, ending where the reply begins;
    `tools`: the functions the reply may call, the template's `tools` variable (transformers')."""
    extra = check_template_kwargs(template_kwargs) if template_kwargs else {}
    if tools:
        extra["tools"] = tools
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
                keep = 0 if final else partial_tag(held, THINK_CLOSE)
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


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
