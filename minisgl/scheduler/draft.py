"""Speculative decoding's draft-model proposer: a second, smaller model proposes k greedy tokens per
request.

The draft runs in an `Engine` of its own that shares the target's page table (its pool has as many
pages, a position's draft KV at the same page id), so it needs no pages or allocator of its own; greedy
drafts keep the output the target's distribution exactly. docs/speculative.md (`draft`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.core import Batch, Req
from minisgl.distributed import get_tp_info, set_tp_info
from minisgl.engine import Engine, EngineConfig, check_tensor_parallel
from minisgl.kvcache import bytes_per_page
from minisgl.models import DEFAULT_MODEL_ALIAS, MODEL_FAMILIES, ModelConfig, default_model_path
from minisgl.models.weights import checkpoint_files

logger = logging.getLogger(__name__)

GIB = 1 << 30
SETTING = "speculative_draft_model"
# tokens of the prompts a request's first proposal computes per draft forward, at most
DRAFT_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class DraftFootprint:
    """What a draft model takes from the target's memory budget (`Engine(..., companion=...)`)."""

    config: EngineConfig  # the draft engine's config, before the target's pool gives it its page count
    weight_bytes: int  # this rank's draft weights
    page_bytes: int  # the draft's KV bytes per page (the target's page_size and KV dtype)


def _resolve_draft_path(draft_path: str | os.PathLike[str] | None) -> str:
    """The draft model's folder: `draft_path`, or the embedded default model's for its alias."""
    if draft_path is None or draft_path == "":
        raise ValueError(f"{SETTING} is not set: give the draft model's folder (or {DEFAULT_MODEL_ALIAS!r})")
    if draft_path == DEFAULT_MODEL_ALIAS:
        return os.fspath(default_model_path())
    folder = os.fspath(draft_path)
    if not (Path(folder) / "config.json").is_file():
        what = "has no config.json" if Path(folder).is_dir() else "is not a folder"
        raise ValueError(
            f"{SETTING}={folder!r} {what}: give a model folder (config.json + *.safetensors) sharing the "
            f"target's tokenizer, or {DEFAULT_MODEL_ALIAS!r}"
        )
    return folder


def _weight_bytes(model_config: ModelConfig, config: EngineConfig) -> int:
    """The bytes of this rank's weights of a model, counted on the meta device (nothing is allocated
    or read); the same sum the engine logs once it has loaded them."""
    previous_dtype, previous_tp = torch.get_default_dtype(), get_tp_info()
    torch.set_default_dtype(config.torch_dtype)
    set_tp_info(config.tp_info)  # the model sizes its shards by the current rank
    try:
        with torch.device("meta"):
            model = MODEL_FAMILIES[model_config.family](model_config, 1)
    finally:
        torch.set_default_dtype(previous_dtype)
        set_tp_info(previous_tp)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def draft_footprint(target_config: EngineConfig, draft_path: str) -> DraftFootprint:
    """Reads the draft model's config.json (a folder, or the default model's alias as `model_path`
    takes it) and computes what it will take: its weight bytes (from its parameter shapes, without
    loading them) and its KV bytes per page (the target's page_size and KV dtype). The draft's config is
    the target's with the draft's folder (device, dtypes, the quantization setting, backends, graph
    sizes, ablation switches and dummy weights as the target's). Refuses, with a ValueError naming `speculative_draft_model`, a folder
    without a config or (unless dummy weights) checkpoint, and a vocabulary other than the target's."""
    folder = _resolve_draft_path(draft_path)
    try:
        # the draft proposes for the base model: no LoRA adapter slots (their memory) of its own
        config = dataclasses.replace(target_config, model_path=folder, cache_dir=None, enable_lora=False)
        model_config = config.model_config
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{SETTING}={draft_path!r}: {e}") from e
    target_vocab = target_config.model_config.vocab_size
    if model_config.vocab_size != target_vocab:
        raise ValueError(
            f"{SETTING}={draft_path!r} has vocab_size={model_config.vocab_size}, but the target model "
            f"{target_config.model_path!r} has vocab_size={target_vocab}: a draft model must share the "
            "target's tokenizer"
        )
    if not config.use_dummy_weight:
        try:
            checkpoint_files(folder)  # fails now, not after the target has loaded
        except FileNotFoundError as e:
            raise ValueError(f"{SETTING}={draft_path!r}: {e}") from e
    kv_heads = check_tensor_parallel(config).num_kv_heads
    page_bytes = bytes_per_page(
        model_config.num_layers, config.page_size, kv_heads, model_config.head_dim, config.kv_torch_dtype
    )
    return DraftFootprint(config, _weight_bytes(model_config, config), page_bytes)


class DraftProposer:
    """Proposes up to k greedy tokens per request with a draft model whose KV lives at the target
    engine's page ids (see the module docstring)."""

    def __init__(
        self,
        target: Engine,
        draft_path: str,
        k: int,
        *,
        footprint: DraftFootprint | None = None,
        max_prefill_tokens: int = DRAFT_PREFILL_TOKENS,
    ) -> None:
        """Builds the draft engine: the target's settings, its page count, max_seq_len and page table.
        `footprint`: the `draft_footprint` the target was sized with (computed again when None)."""
        if k < 1:
            raise ValueError(f"speculative_num_tokens={k} must be at least 1")
        if target.config.tp_info.size > 1:
            raise ValueError(
                f"{SETTING} with tensor parallelism (tp size {target.config.tp_info.size}) is not supported "
                "yet: run the target on one rank, or use speculative_method 'ngram'"
            )
        footprint = footprint or draft_footprint(target.config, draft_path)
        if target.companion is None:
            logger.warning(
                "the target's KV pool was sized without room for the draft model (Engine(..., "
                "companion=draft_footprint(...))); its %d pages of draft KV may not fit",
                target.num_pages,
            )
        # the draft never samples (its tokens are the logits' argmax): no compiled sampler, no graphs of it
        config = dataclasses.replace(
            footprint.config,
            num_page_override=target.num_pages,
            max_seq_len_override=target.max_seq_len,
            compile_sampler=False,
        )
        positions = config.model_config.max_position_embeddings
        if target.max_seq_len > positions:
            logger.warning(
                "the draft model's max_position_embeddings (%d) is below the target's max_seq_len (%d): "
                "past it the draft's RoPE extrapolates and its proposals may get worse",
                positions,
                target.max_seq_len,
            )
        self.target = target
        self.k = k
        self.max_prefill_tokens = max_prefill_tokens
        self.engine = Engine(config, page_table=target.page_table)
        if self.engine.num_pages != target.num_pages or self.engine.max_seq_len != target.max_seq_len:
            self.engine.shutdown()
            raise RuntimeError(
                f"the draft engine has {self.engine.num_pages} pages and max_seq_len {self.engine.max_seq_len}"
                f", the target {target.num_pages} and {target.max_seq_len}: they must be equal"
            )
        self._vocab_size = config.model_config.vocab_size
        # per request (Req.uid): the positions whose draft KV holds the request's accepted tokens
        self._draft_len: dict[int, int] = {}
        logger.info(
            "draft model %s (%s): %d KV pages of %d tokens (%.2f GiB) at the target's page ids, "
            "%.2f GiB of weights, k=%d",
            config.model_path,
            config.model_config.architecture,
            self.engine.num_pages,
            config.page_size,
            self.engine.kv_cache.size_bytes / GIB,
            footprint.weight_bytes / GIB,
            k,
        )

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], limits: Sequence[int]) -> list[list[int]]:
        """Up to `limits[i]` (0..k) greedy draft tokens for each of the target's decode requests `reqs`
        (all tokens on the host, all but the last in the target's KV), whose page-table rows the caller
        has reserved up to position len(input_ids) - 1 + limits[i]. Runs one forward over each request's
        tokens the draft has not seen, then the decode steps; syncs with the device once, to copy the
        drafts to the host."""
        if len(reqs) != len(limits):
            raise ValueError(f"{len(reqs)} requests but {len(limits)} limits")
        for req, limit in zip(reqs, limits):
            if not 0 <= limit <= self.k:
                raise ValueError(f"request {req.uid}: limit {limit} is outside [0, k={self.k}]")
        proposals: list[list[int]] = [[] for _ in reqs]
        # the drafting requests, most drafts first: those still drafting at each step are a prefix
        order = sorted((i for i, limit in enumerate(limits) if limit > 0), key=lambda i: -limits[i])
        if not order:
            return proposals
        lens = [len(reqs[i].input_ids) for i in order]
        steps = [limits[i] for i in order]
        drafting = [
            Req(
                input_ids=reqs[i].input_ids,
                table_idx=reqs[i].table_idx,
                cached_len=min(self._draft_len.get(reqs[i].uid, 0), n - 1),
                output_len=0,
                uid=reqs[i].uid,
                device_len=n,
            )
            for i, n in zip(order, lens)
        ]
        prefills = self._prefill_plan(drafting, lens)
        # on the host: the prefills' tokens, every forward's positions and their flat page-table indices
        tokens = [t for plan in prefills for req, start, end in plan for t in req.input_ids[start:end]]
        rows: list[int] = []
        positions: list[int] = []
        for plan in prefills:
            for req, start, end in plan:
                rows += [req.table_idx] * (end - start)
                positions += range(start, end)
        for j in range(1, steps[0]):  # decode step j feeds draft j at position len - 1 + j
            active = sum(s > j for s in steps)
            rows += [req.table_idx for req in drafting[:active]]
            positions += [n - 1 + j for n in lens[:active]]
        device, width = self.engine.device, self.engine.page_table.shape[1]
        flat = [row * width + pos for row, pos in zip(rows, positions)]
        packed = torch.tensor(
            tokens + positions + flat, dtype=torch.int64, pin_memory=device.type == "cuda"
        ).to(device, non_blocking=True)
        num_tokens, num_rows = len(tokens), len(positions)
        input_ids = packed[:num_tokens].to(torch.int32)
        all_positions = packed[num_tokens : num_tokens + num_rows]
        # the draft's KV goes where the target's page table puts the position (its pages were reserved)
        all_out_loc = self.engine.page_table.view(-1)[packed[num_tokens + num_rows :]].to(torch.int64)

        token_at = row_at = 0
        for plan in prefills:
            for req, start, end in plan:
                req.cached_len, req.device_len = start, end
            size = sum(end - start for _, start, end in plan)
            one_each = all(end - start == 1 for _, start, end in plan)  # a decode batch: CUDA graphs
            batch = Batch(reqs=[req for req, _, _ in plan], phase="decode" if one_each else "prefill")
            batch.input_ids = input_ids[token_at : token_at + size]
            batch.positions = all_positions[row_at : row_at + size]
            batch.out_loc = all_out_loc[row_at : row_at + size]
            logits = self.engine.forward_logits(batch)
            token_at, row_at = token_at + size, row_at + size
        drafts = torch.zeros((steps[0], len(drafting)), dtype=torch.int32, device=device)
        drafts[0] = logits[:, : self._vocab_size].argmax(dim=-1)  # the last prefill holds every request
        for j in range(1, steps[0]):
            active = sum(s > j for s in steps)
            for req in drafting[:active]:
                req.device_len = req.cached_len + 1
            batch = Batch(reqs=drafting[:active], phase="decode")
            batch.input_ids = drafts[j - 1, :active]
            batch.positions = all_positions[row_at : row_at + active]
            batch.out_loc = all_out_loc[row_at : row_at + active]
            logits = self.engine.forward_logits(batch)
            drafts[j, :active] = logits[:, : self._vocab_size].argmax(dim=-1)
            row_at += active
        host = drafts.cpu().tolist()  # the one copy to the host (and the one sync)
        for r, (i, n, limit) in enumerate(zip(order, lens, steps)):
            proposals[i] = [host[j][r] for j in range(limit)]
            self._draft_len[reqs[i].uid] = n - 1 + limit
        return proposals

    def _prefill_plan(self, drafting: list[Req], lens: list[int]) -> list[list[tuple[Req, int, int]]]:
        """The draft forwards that compute each request's unseen tokens, as (req, start, end) spans: one
        forward over them all, preceded, when they are more than `max_prefill_tokens`, by forwards of at
        most that many (the longest backlogs first) that leave each request its last token (the last
        forward's logits give the first drafts)."""
        done = [req.cached_len for req in drafting]
        plans: list[list[tuple[Req, int, int]]] = []
        while sum(n - d for n, d in zip(lens, done)) > self.max_prefill_tokens:
            plan, room = [], self.max_prefill_tokens
            for r in sorted(range(len(drafting)), key=lambda r: done[r] - lens[r]):
                take = min(lens[r] - 1 - done[r], room)
                if take > 0:
                    plan.append((drafting[r], done[r], done[r] + take))
                    done[r] += take
                    room -= take
                if room == 0:
                    break
            if not plan:  # only last tokens left: they go together
                break
            plans.append(plan)
        plans.append([(req, d, n) for req, d, n in zip(drafting, done, lens)])
        return plans

    def accepted(self, req: Req) -> None:
        """After the target verified `req`'s drafts: `req.cached_len` positions hold accepted tokens,
        whose draft KV is right (an accepted draft is the token the draft computed there); past them it
        is stale."""
        if req.uid in self._draft_len:
            self._draft_len[req.uid] = min(self._draft_len[req.uid], req.cached_len)

    def forget(self, req: Req) -> None:
        """The request was released (finished, preempted, aborted): its draft state goes."""
        self._draft_len.pop(req.uid, None)

    def shutdown(self) -> None:
        """Shuts the draft engine down (the target's page table stays the target's)."""
        self._draft_len.clear()
        self.engine.shutdown()
