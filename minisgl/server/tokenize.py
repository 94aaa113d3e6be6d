"""Prompt tokenization for the server's front end, off its event loop: one thread, or a pool of
`tokenizer_workers` processes (the chat template is Python: a thread would share the GIL with the event
loop). Large prompts (over LARGE_PROMPT_CHARS) get a lane of their own, and a prompt whose bytes cannot
fit the context (`token_bytes_bound`) is refused untokenized: docs/server.md#security.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import threading
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from minisgl.multimodal.config import MediaConfig
from minisgl.multimodal.inputs import ImageInputs
from minisgl.templates import load_tokenizer, render_chat

_worker = threading.local()  # .tokenizer: the worker's own (two threads never share one)
_loading = threading.Lock()  # transformers' lazy imports are not safe from two threads at once
LARGE_PROMPT_CHARS = 64 << 10

# pieces of a fast tokenizer's pipeline (tokenizer.json) that keep every byte of the text in some
# token, with the most a normalizer may shrink the text (in bytes): NFKC maps U+1D400 (4 bytes) to "A"
_NORMALIZERS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1}
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}


class TemplateFailed(Exception):
    """The chat template raised on a conversation (its own checks, or a variable the client set)."""


class PromptWithImages(list):
    """A prompt's token ids (the list) that carries images: `images`, their `ImageInputs.to_bytes()`,
    travels with the ids to the scheduler; `counts`, (images, image placeholder tokens), goes to the
    request trace (docs/vision.md)."""

    def __init__(self, ids: list[int], inputs: ImageInputs) -> None:
        super().__init__(ids)
        self.images = inputs.to_bytes()
        self.counts = (inputs.num_images, len(inputs.token_positions))


class PromptTooLong(Exception):
    """A prompt refused by its size before tokenization: `size` bytes, more than `limit`."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size, self.limit = size, limit


def default_workers() -> int:
    """A quarter of the CPUs, between 1 and 4: 1 (a thread) on a 2-core machine, 4 on 16 cores."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _load(path: str, process: bool, template: str | None = None, media: MediaConfig | None = None) -> None:
    if process:  # Linux: die with the front end, as the scheduler process does
        from minisgl.server.worker import set_parent_death_signal

        set_parent_death_signal()
    _worker.path, _worker.media, _worker.prompter = path, media or MediaConfig(), None
    with _loading:
        _worker.tokenizer = load_tokenizer(path)
    if template is not None:  # the setting chat_template: a template file's text
        _worker.tokenizer.chat_template = template
    if _worker.tokenizer.chat_template:  # compiles the template now, not in a request's time
        encode_chat([{"role": "user", "content": "Hi"}])


def encode_chat(
    messages: list[dict[str, Any]],
    max_bytes: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat template over `messages` (with `template_kwargs`, its variables, and `tools`, the
    functions the reply may call) and the generation prompt, tokenized (no special tokens added: the
    template writes them); PromptTooLong if the text has more than `max_bytes` bytes."""
    tokenizer = _worker.tokenizer
    if any(isinstance(m["content"], list) for m in messages):  # image parts: the images load here
        return _encode_with_images(messages, template_kwargs, tools)
    try:
        text = render_chat(tokenizer, messages, template_kwargs, tools)
    except Exception as e:  # the template refused the conversation (or a variable broke it)
        raise TemplateFailed(f"{type(e).__name__}: {e}"[:300]) from None
    if max_bytes is not None and len(text) > max_bytes // 4:  # only a long text can be too long
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise PromptTooLong(size, max_bytes)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode_with_images(
    messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None
) -> list[int]:
    """`encode_chat` of messages with image parts (`minisgl.multimodal.chat`): a ValueError (a
    `MediaError` for an image that does not load) names what is wrong with them."""
    ids, images = _prompter().prompt(_worker.tokenizer, messages, template_kwargs, tools)
    return ids if images is None else PromptWithImages(ids, images)


def encode_text_with_images(text: str, refs: list[str]) -> list[int]:
    """A text prompt whose ``<|image_pad|>`` placeholders stand for the images `refs` (/generate's
    image_data), tokenized without special tokens (the text holds the template's own); ValueError as
    `encode_chat` with images."""
    ids, images = _prompter().text_prompt(_worker.tokenizer, text, refs)
    return ids if images is None else PromptWithImages(ids, images)


def _prompter() -> Any:
    """The worker's `minisgl.multimodal.chat.VisionPrompter` (made at its first image)."""
    from minisgl.models.config import ModelConfig
    from minisgl.multimodal.chat import VisionPrompter

    if _worker.prompter is None:
        _worker.prompter = VisionPrompter(_worker.path, ModelConfig.from_path(_worker.path), _worker.media)
    return _worker.prompter


def encode_text(text: str) -> list[int]:
    return _worker.tokenizer(text)["input_ids"]


def token_bytes_bound() -> int | None:
    """The most bytes of text one token of the worker's tokenizer can stand for, or None when its
    pipeline may drop text (whitespace splitting, stripping, unknown-token fusing, added tokens that
    swallow spaces, a slow tokenizer): then no bound holds. The bound is the longest token (decoded,
    or as a vocabulary piece), times what the normalizer may shrink the text."""
    backend = getattr(_worker.tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    config = json.loads(backend.to_str())
    shrink = _shrink(config.get("normalizer"))
    if shrink is None or not _keeps_text(config.get("pre_tokenizer")):
        return None
    model = config.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and model.get("unk_token")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens") or ()):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    decoded = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    pieces = backend.get_vocab(with_added_tokens=True)
    longest = max(max(len(d.encode()) for d in decoded), max(map(len, pieces)), 4)
    return longest * shrink


def _shrink(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", ()):
            f = _shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":  # a literal pattern replaced by a text at least as long keeps the bytes
        pattern, content = (normalizer.get("pattern") or {}).get("String"), normalizer.get("content", "")
        if pattern is None or not content:
            return None
        return max(1, -(-len(pattern.encode()) // len(content.encode())))
    return _NORMALIZERS.get(kind)


def _keeps_text(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", ()))
    return kind in _PRE_TOKENIZERS and pre.get("behavior", "Isolated") != "Removed"


class TokenizerPool:
    """`workers` processes tokenizing the prompts of the model at `path`; 1: one thread. `template`: the
    text of a chat template that replaces the model's (setting chat_template)."""

    def __init__(
        self, path: str, workers: int, template: str | None = None, media: MediaConfig | None = None
    ) -> None:
        self.workers = workers
        self.max_bytes: int | None = None  # set by `limit`: longer prompts are refused untokenized
        self._per_token: int | None = None  # `token_bytes_bound` (found by `warm`)
        self._large = ThreadPoolExecutor(
            1,
            thread_name_prefix="minisgl-tokenize-large",
            initializer=_load,
            initargs=(path, False, template, media),
        )
        if workers <= 1:
            self._pool: Executor = ThreadPoolExecutor(
                1,
                thread_name_prefix="minisgl-tokenize",
                initializer=_load,
                initargs=(path, False, template, media),
            )
        else:
            self._pool = ProcessPoolExecutor(
                workers,
                mp_context=mp.get_context("spawn"),
                initializer=_load,
                initargs=(path, True, template, media),
            )

    def _lane(self, chars: int) -> Executor:
        return self._large if chars > LARGE_PROMPT_CHARS else self._pool

    async def chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The conversation's prompt ids; PromptTooLong when its text cannot fit the context."""
        chars = sum(len(m["content"]) + 32 for m in messages)  # 32: the template's text per message, about
        chars += len(json.dumps(tools)) if tools else 0
        future = self._lane(chars).submit(encode_chat, messages, self.max_bytes, template_kwargs, tools)
        return await asyncio.wrap_future(future)

    async def text(self, text: str) -> list[int]:
        """The text's prompt ids; PromptTooLong when it cannot fit the context (checked at once)."""
        if self.max_bytes is not None and len(text) > self.max_bytes // 4:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > self.max_bytes:
                raise PromptTooLong(size, self.max_bytes)
        return await asyncio.wrap_future(self._lane(len(text)).submit(encode_text, text))

    async def text_with_images(self, text: str, refs: list[str]) -> list[int]:
        """`encode_text_with_images` off the event loop (the images load and are preprocessed there)."""
        future = self._lane(len(text)).submit(encode_text_with_images, text, refs)
        return await asyncio.wrap_future(future)

    async def warm(self) -> None:
        """Starts the workers (each loads the tokenizer and compiles its chat template) before the
        first request needs one, and finds the most bytes of text a token stands for (`limit`)."""
        jobs = [self.text("warm") for _ in range(self.workers)]
        self._per_token, *_ = await asyncio.gather(
            asyncio.wrap_future(self._large.submit(token_bytes_bound)), *jobs
        )

    def limit(self, max_context: int) -> None:
        """Sets the byte bound of a prompt of `max_context` tokens (after `warm`)."""
        self.max_bytes = None if self._per_token is None else max_context * self._per_token

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)
