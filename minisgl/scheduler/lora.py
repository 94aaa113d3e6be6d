"""The scheduler's LoRA adapters: which are loaded (by name, on the host), which sit in the engine's
device slots, and which running requests pin them. docs/lora.md.

Every load gets a new id (never reused), which is what the prefix cache keys a request's KV by: KV
computed under one adapter is never found for another, for the base model (id 0), or for the same name
loaded again from another folder. A slot holds one adapter; a request pins its adapter's slot from its
admission to its release, so the running requests never use more than `max_loras` adapters and one step
never mixes more. An adapter no running request pins stays resident until its slot is needed (least
recently used first). Unloading a name takes it from the names at once (new requests get "not found");
requests already running on it finish with it, and its slot is freed after the last one.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from minisgl.lora import LoraAdapter, LoraError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Loaded:
    """One load of an adapter: its id (the prefix cache's key), its host tensors, and the running
    requests that pin it."""

    id: int
    adapter: LoraAdapter
    load_seconds: float
    pins: int = 0
    unloaded: bool = False  # taken from the names; freed once no request pins it
    slot: int = field(default=-1)  # its device slot, -1 while not resident

    @property
    def name(self) -> str:
        return self.adapter.name


class LoraManager:
    """Adapters by name, and the engine's `max_loras` slots (see the module docstring)."""

    def __init__(self, engine: Any, modules: dict[str, str]) -> None:
        self.engine = engine
        cfg = engine.config
        self.max_loras, self.max_rank = cfg.max_loras, cfg.max_lora_rank
        self.by_name: dict[str, Loaded] = {}
        self.slots: list[Loaded | None] = [None] * self.max_loras
        self.recent: OrderedDict[int, Loaded] = OrderedDict()  # resident and unpinned, oldest first
        self._next_id = 1
        for name, path in modules.items():
            self.load(name, path)

    @property
    def resident(self) -> int:
        return sum(loaded is not None for loaded in self.slots)

    def check_name(self, name: str) -> None:
        """Raises LoraError unless `name` can name a new adapter (non-empty, not loaded)."""
        if not isinstance(name, str) or not name.strip():
            raise LoraError(f"lora_name={name!r}: give the adapter a non-empty name")
        if name in self.by_name:
            raise LoraError(
                f"a LoRA adapter named {name!r} is already loaded (from {self.by_name[name].adapter.path}); "
                "unload it first or pick another name"
            )

    def load(self, name: str, path: str, adapter: LoraAdapter | None = None) -> Loaded:
        """Reads the adapter at `path` (a PEFT folder or a hub id) under `name` (`adapter`: read already,
        by `engine.read_lora`); raises LoraError (a ValueError) naming what is wrong: a name already
        loaded, no adapter there, a rank above max_lora_rank, a target the model lacks, DoRA, biases,
        modules_to_save."""
        self.check_name(name)
        start = time.perf_counter()
        if adapter is None:  # for this engine's model, dtype, rank and TP rank
            adapter = self.engine.read_lora(name, path)
        loaded = Loaded(self._next_id, adapter, time.perf_counter() - start)
        self._next_id += 1
        self.by_name[name] = loaded
        logger.info(
            "LoRA adapter %r loaded from %s: rank %d, %s, %.1f MiB on the host, %.2f s",
            name, path, adapter.rank, " ".join(adapter.targets), adapter.nbytes / 2**20, loaded.load_seconds,
        )  # fmt: skip
        return loaded

    def unload(self, name: str) -> None:
        """Takes `name` from the adapters (KeyError if it is not loaded); its slot is freed now, or once
        the requests running on it finish."""
        loaded = self.by_name.pop(name)
        loaded.unloaded = True
        if loaded.pins == 0:
            self._free(loaded)
        logger.info("LoRA adapter %r unloaded", name)

    def get(self, name: str) -> Loaded:
        """The loaded adapter `name`; KeyError if there is none."""
        return self.by_name[name]

    def acquire(self, loaded: Loaded) -> int | None:
        """Pins `loaded` for one request and returns its slot, loading it into a free or least recently
        used unpinned slot; None when every slot is pinned by running requests (the request waits)."""
        if loaded.slot < 0:
            slot = self._take_slot()
            if slot is None:
                return None
            self.engine.load_lora(slot, loaded.adapter)
            self.slots[slot], loaded.slot = loaded, slot
        self.recent.pop(loaded.id, None)
        loaded.pins += 1
        return loaded.slot

    def release(self, loaded: Loaded) -> None:
        """One request that pinned `loaded` left (finished or preempted)."""
        loaded.pins -= 1
        if loaded.pins > 0:
            return
        if loaded.unloaded:
            self._free(loaded)
        else:
            self.recent[loaded.id] = loaded

    def _take_slot(self) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        if not self.recent:
            return None
        _, victim = self.recent.popitem(last=False)
        slot = victim.slot
        victim.slot, self.slots[slot] = -1, None
        return slot

    def _free(self, loaded: Loaded) -> None:
        self.recent.pop(loaded.id, None)
        if loaded.slot >= 0:
            self.engine.clear_lora(loaded.slot)
            self.slots[loaded.slot], loaded.slot = None, -1
