"""The prefix-cache workloads of `minisgl-run bench --workload shared-prefix|multi-turn`, as plain data
(their definitions, draw order and shapes: docs/bench-workloads.md).

Plain Python (the standard library's `random` and `dataclasses` only): this file imports nothing from
minisgl or torch, so another engine's benchmark script can load it by its path and run the very same
requests (`.peer/bench_prefix.py` does so for Mini-SGLang):

    spec = importlib.util.spec_from_file_location("workloads", "minisgl/bench/workloads.py")
    workloads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workloads)
    prompts, max_tokens = workloads.shared_prefix_workload(workloads.SharedPrefixShape())
"""

# no `from __future__ import annotations`: with string annotations, @dataclass looks the module up
# in sys.modules, where a file loaded by path (spec_from_file_location, exec_module) need not be
import random
from dataclasses import dataclass, fields

TOKEN_ID_MAX = 10000  # token ids are randint(0, TOKEN_ID_MAX), as in the random workload


def _check(shape: object) -> None:
    """ValueError naming the field when a count or length is below its minimum or a range is empty."""
    for f in fields(shape):
        value = getattr(shape, f.name)
        if f.name in ("temperature", "seed"):
            continue
        least = 0 if f.name.startswith("prefix") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{f.name} must be an integer >= {least}, got {f.name}={value!r}")
        if f.name.startswith("max_"):
            low = getattr(shape, "min_" + f.name[4:])
            if low > value:
                raise ValueError(f"min_{f.name[4:]}={low} must not exceed {f.name}={value}")


@dataclass(frozen=True)
class SharedPrefixShape:
    """Groups of requests sharing a system prompt (defaults: the GPU shape of docs/bench-workloads.md)."""

    groups: int = 16
    per_group: int = 16
    prefix_len: int = 2048
    min_own: int = 128
    max_own: int = 512
    min_output: int = 128
    max_output: int = 512
    temperature: float = 0.6
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class MultiTurnShape:
    """Conversations whose every turn resends the whole conversation so far (defaults: the GPU shape)."""

    conversations: int = 64
    turns: int = 4
    min_user: int = 64
    max_user: int = 256
    min_output: int = 128
    max_output: int = 256
    temperature: float = 0.6
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self)


# the shapes scaled down for a CPU (SmolLM2-135M-Instruct in float32 on a few cores)
SHARED_PREFIX_CPU_SHAPE = SharedPrefixShape(
    groups=4, per_group=4, prefix_len=512, min_own=16, max_own=64, min_output=8, max_output=32
)
MULTI_TURN_CPU_SHAPE = MultiTurnShape(
    conversations=8, turns=3, min_user=16, max_user=64, min_output=8, max_output=32
)


def _ids(rng: random.Random, n: int, vocab_size: int | None) -> list[int]:
    if vocab_size is None:
        return [rng.randint(0, TOKEN_ID_MAX) for _ in range(n)]
    return [rng.randint(0, TOKEN_ID_MAX) % vocab_size for _ in range(n)]


def shared_prefix_workload(
    shape: SharedPrefixShape, vocab_size: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens per request), interleaved round-robin over the groups: request `i` belongs
    to group `i % shape.groups`. Token ids wrap modulo `vocab_size` when it is given."""
    rng = random.Random(shape.seed)
    prefixes = [_ids(rng, shape.prefix_len, vocab_size) for _ in range(shape.groups)]
    by_group: list[list[tuple[list[int], int]]] = []
    for prefix in prefixes:
        requests = []
        for _ in range(shape.per_group):
            own = _ids(rng, rng.randint(shape.min_own, shape.max_own), vocab_size)
            requests.append((prefix + own, rng.randint(shape.min_output, shape.max_output)))
        by_group.append(requests)
    order = [by_group[g][j] for j in range(shape.per_group) for g in range(shape.groups)]
    return [prompt for prompt, _ in order], [n for _, n in order]


def group_of(index: int, shape: SharedPrefixShape) -> int:
    """The group of request `index` of `shared_prefix_workload(shape)`."""
    return index % shape.groups


def multi_turn_workload(
    shape: MultiTurnShape, vocab_size: int | None = None
) -> list[list[tuple[list[int], int]]]:
    """Per conversation, per turn: (the turn's new user ids, its max_tokens). Token ids wrap modulo
    `vocab_size` when it is given. Turn k's prompt is `next_turn_prompt(prompt of turn k-1, tokens
    generated for it, user ids of turn k)`; turn 0's prompt is its user ids."""
    rng = random.Random(shape.seed)
    conversations = []
    for _ in range(shape.conversations):
        turns = []
        for _ in range(shape.turns):
            user = _ids(rng, rng.randint(shape.min_user, shape.max_user), vocab_size)
            turns.append((user, rng.randint(shape.min_output, shape.max_output)))
        conversations.append(turns)
    return conversations


def next_turn_prompt(
    previous_prompt: list[int], previous_output: list[int], user_ids: list[int]
) -> list[int]:
    """The prompt of the next turn: the whole conversation so far, then the new user ids."""
    return [*previous_prompt, *previous_output, *user_ids]
