"""Prompt tokenization for the server's front end, off its event loop: one thread, or a pool of
processes (`tokenizer_workers`) that tokenize in parallel (the chat template is Python, and a thread
of this process would share the GIL with the event loop). Each worker loads the model's tokenizer once;
requests travel as their messages or text, prompts come back as lists of token ids."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

_tokenizer: Any = None  # the worker's tokenizer (in the thread's case, this process's)


def default_workers() -> int:
    """A quarter of the CPUs, between 1 and 4: 1 (a thread) on a 2-core machine, 4 on 16 cores."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _load(path: str, process: bool) -> None:
    global _tokenizer
    if process:  # Linux: die with the front end, as the scheduler process does
        from minisgl.server.worker import set_parent_death_signal

        set_parent_death_signal()
    import transformers

    _tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if _tokenizer.chat_template:  # compiles the template now, not in a request's time
        encode_chat([{"role": "user", "content": "Hi"}])


def encode_chat(messages: list[dict[str, Any]]) -> list[int]:
    """The chat template over `messages` with the generation prompt, tokenized (no special tokens
    added: the template writes them)."""
    text = _tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return _tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_text(text: str) -> list[int]:
    return _tokenizer(text)["input_ids"]


class TokenizerPool:
    """`workers` processes tokenizing the prompts of the model at `path`; 1: one thread."""

    def __init__(self, path: str, workers: int) -> None:
        self.workers = workers
        if workers <= 1:
            self._pool: Executor = ThreadPoolExecutor(
                1, thread_name_prefix="minisgl-tokenize", initializer=_load, initargs=(path, False)
            )
        else:
            self._pool = ProcessPoolExecutor(
                workers, mp_context=mp.get_context("spawn"), initializer=_load, initargs=(path, True)
            )

    async def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return await asyncio.wrap_future(self._pool.submit(encode_chat, messages))

    async def text(self, text: str) -> list[int]:
        return await asyncio.wrap_future(self._pool.submit(encode_text, text))

    async def warm(self) -> None:
        """Starts the workers (each loads the tokenizer and compiles its chat template) before the
        first request needs one."""
        await asyncio.gather(*(self.text("warm") for _ in range(self.workers)))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
