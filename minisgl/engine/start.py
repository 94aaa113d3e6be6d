"""The engine's start (docs/architecture.md#the-engines-init-steps): what `Engine.__init__` builds, phase
by phase, each timed and logged; and the memory budget they share: the weights, the LoRA slots and a
draft model's room come off the memory free at start, the KV pages get the rest, the page table is
checked against what is left.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from minisgl.attention import AttnOptions, create_attention_backend
from minisgl.core import Context
from minisgl.distributed import (
    HeadShard,
    divide,
    init_one_shot_all_reduce,
    init_process_group,
    set_tp_info,
    shard_heads,
)
from minisgl.engine.config import CUDA_HOST_THREADS, EngineConfig
from minisgl.engine.graph import GraphRunner
from minisgl.engine.lora import EngineLora, pool_bytes
from minisgl.kernels.packed_gemm import reserve_workspace
from minisgl.kvcache import MHAKVCachePool, bytes_per_page
from minisgl.layers.packed import PackedLinear
from minisgl.models import ModelConfig, build_model
from minisgl.models.llama import check_tensor_parallel_fp8
from minisgl.moe import create_moe_backend

logger = logging.getLogger(__name__)

GIB = 1 << 30
CPU_KV_FRACTION = 0.10  # default CPU KV budget: this share of the RAM available at start

T = TypeVar("T")


def timed(phases: dict[str, float], name: str, step: Callable[[], T]) -> T:
    """Runs one start phase, records its seconds in `phases` and logs them."""
    started = time.perf_counter()
    result = step()
    phases[name] = seconds = time.perf_counter() - started
    logger.info("start phase %s: %.2f s", name, seconds)
    return result


def check_tensor_parallel(config: EngineConfig) -> HeadShard:
    """This rank's attention heads; raises before any process group (and before a launcher starts the
    other ranks) when the model cannot be split over ``config.tp_info.size`` ranks."""
    model_config, tp_info = config.model_config, config.tp_info
    local_heads = shard_heads(model_config.num_heads, model_config.num_kv_heads, tp_info)
    divide(model_config.intermediate_size, tp_info.size, "intermediate_size")
    if model_config.num_experts:
        divide(model_config.moe_intermediate_size, tp_info.size, "moe_intermediate_size")
    check_tensor_parallel_fp8(model_config, tp_info)  # each rank's FP8 scales must cover whole blocks
    if model_config.is_multimodal and tp_info.size > 1:
        raise ValueError(
            f"{model_config.architecture} does not run under tensor parallelism yet: use tp_size=1"
        )
    return local_heads


def set_host_threads(config: EngineConfig) -> None:
    """Sets torch's intra-op threads for this process: `host_threads`, or where unset
    CUDA_HOST_THREADS on CUDA (on CPU the model's GEMMs use every core, as torch chooses)."""
    threads = config.host_threads
    if threads is None and config.torch_device.type == "cuda":
        threads = CUDA_HOST_THREADS
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        logger.info("host threads: %d (torch intra-op threads of this process)", threads)


def set_cache_dir(folder: str | None) -> None:
    """Points the compile caches of this process at `folder` (the `cache_dir` setting): before anything
    compiles or imports FlashInfer (whose JIT folder is fixed at its import)."""
    if folder is None:
        return
    root = Path(folder).expanduser().resolve()
    dirs = {
        "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
        "TRITON_CACHE_DIR": root / "triton",
        "FLASHINFER_WORKSPACE_BASE": root / "flashinfer",
    }
    for variable, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(path)
    if "flashinfer" in sys.modules:
        logger.warning(
            "cache_dir=%s: FlashInfer was imported before this engine started, so its JIT kernels stay "
            "in its earlier folder (set cache_dir for the first engine of the process)",
            folder,
        )
    logger.info("compile caches under %s (inductor, triton, flashinfer)", root)


def join_group(config: EngineConfig) -> tuple[bool, int]:
    """Joins the tensor-parallel group; returns whether this process made the group (and so destroys it
    at shutdown) and the device memory free before the model loads."""
    device = config.torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_group = init_process_group(
        config.tp_info, config.distributed_addr, config.distributed_timeout, device
    )
    set_tp_info(config.tp_info)  # read by the model's construction and the layer functions' collectives
    init_one_shot_all_reduce(config.one_shot_all_reduce_max_bytes, config.torch_dtype, device)
    return owns_group, available_memory(device)


def load_model(config: EngineConfig) -> tuple[torch.nn.Module, int]:
    """Builds the model and loads this rank's weights; returns it and its size in bytes (parameters and
    buffers, with the workspace its packed 4- or 8-bit projections dequantize into for many rows,
    `reserve_workspace`)."""
    model = build_model(
        config.model_config,
        config.model_path,
        config.configured_max_seq_len,
        config.torch_device,
        config.torch_dtype,
        dummy=config.use_dummy_weight,
    )
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    packed = [m.shape for m in model.modules() if isinstance(m, PackedLinear) and not m.experts]
    if packed and config.torch_device.type == "cuda":  # the packed GEMM's buffer counts as weights
        weights += reserve_workspace(max(n * k for n, k in packed), config.torch_dtype, config.torch_device)
    if config.torch_device.type == "cuda":
        # the load's transients (a checkpoint's tensors on their way, repacking) go back to the device:
        # the KV cache's budget counts the weights only, and blocks the allocator kept would come off
        # the activations' room instead
        torch.cuda.empty_cache()
    return model, weights


def make_lora(config: EngineConfig, model: torch.nn.Module) -> EngineLora:
    """The LoRA pool of `max_loras` slots at `max_lora_rank`, given to the model (its bytes come off
    the KV cache's budget, `num_pages`)."""
    tp_info = config.tp_info
    lora = EngineLora(
        config.model_config, config.max_loras, config.max_lora_rank, config.torch_dtype, config.torch_device,
        tp_info.rank, tp_info.size,
    )  # fmt: skip
    model.lora_pool = lora.pool
    return lora


def compile_vision(
    config: EngineConfig, model: torch.nn.Module, backend: str | Callable = "inductor"
) -> None:
    """A vision-language model's encoder blocks compiled (dynamic shapes; the setting `compile_vision`,
    on CUDA), the compile paid here on one dummy image whose merged grid is 2 x 3 (no size of 1 to
    specialize)."""
    visual = model.visual
    visual.configure(compile=True, backend=backend)
    merge = visual.cfg.spatial_merge_size
    grid = torch.tensor([[1, 2 * merge, 3 * merge]])  # on the host, as the preprocessing gives it
    pixels = torch.randn(int(grid.prod()), visual.cfg.patch_dim, device=config.torch_device)
    with torch.inference_mode():
        model.encode_images(pixels.to(config.torch_dtype), grid)


def lora_bytes(config: EngineConfig) -> int:
    """The device bytes of the LoRA pool (`enable_lora`; 0 without)."""
    if not config.enable_lora:
        return 0
    return pool_bytes(
        config.model_config, config.max_loras, config.max_lora_rank, config.torch_dtype, config.tp_info.size
    )


def num_pages(
    config: EngineConfig, kv_heads: int, available_before: int, model_bytes: int, companion: object | None
) -> int:
    """The KV pages that fit the budget (`available_before`: the memory free before the model loaded;
    `kv_heads`: this rank's share of the KV cache; `companion`: a draft model's footprint, see
    `Engine`), logged with how the budget was reached."""
    cfg, mc = config, config.model_config
    page_bytes = bytes_per_page(mc.num_layers, cfg.page_size, kv_heads, mc.head_dim, cfg.kv_torch_dtype)
    # a companion (the draft model) takes its weights from the same memory and a page of its own KV
    # per page id: the budget pays for both pools, page for page
    draft_weights = 0 if companion is None else companion.weight_bytes  # type: ignore[attr-defined]
    draft_page = 0 if companion is None else companion.page_bytes  # type: ignore[attr-defined]
    # the LoRA pool's slots come out of the same memory, before the pages are counted
    lora_size = lora_bytes(cfg)
    lora = f" - {lora_size / GIB:.2f} GiB of LoRA slots" if lora_size else ""
    free = available_before - model_bytes - draft_weights - lora_size
    if cfg.num_page_override is not None:
        check_fits(
            cfg.num_page_override * (page_bytes + draft_page),
            free,
            f"num_page_override={cfg.num_page_override}",
        )
        logger.info("KV cache: num_page_override=%d", cfg.num_page_override)
        return cfg.num_page_override
    if cfg.torch_device.type == "cuda":
        budget = int(available_before * cfg.memory_ratio) - model_bytes - draft_weights - lora_size
        how = (
            f"{available_before / GIB:.2f} GiB free before loading x memory_ratio {cfg.memory_ratio}"
            f" - {model_bytes / GIB:.2f} GiB of weights"
        )
        if companion is not None:
            how += f" - {draft_weights / GIB:.2f} GiB of draft-model weights"
        how += lora
    elif cfg.cpu_kv_budget_gib is not None:
        budget = int(cfg.cpu_kv_budget_gib * GIB)
        check_fits(budget, free, f"cpu_kv_budget_gib={cfg.cpu_kv_budget_gib}")
        how = f"cpu_kv_budget_gib={cfg.cpu_kv_budget_gib}"
    else:
        budget = int(available_before * CPU_KV_FRACTION) - lora_size
        how = f"{CPU_KV_FRACTION:.0%} of {available_before / GIB:.2f} GiB RAM available{lora} (set cpu_kv_budget_gib)"
    pages = budget // (page_bytes + draft_page)
    if pages < 1:
        needs = f"{page_bytes} bytes" + (f" + {draft_page} for the draft model's" if draft_page else "")
        raise MemoryError(
            f"KV cache does not fit: one page of {cfg.page_size} tokens needs {needs}, the "
            f"budget is {max(budget, 0)} bytes ({how}). Free memory, raise the budget, or set num_page_override."
        )
    # more pages than every table_idx can fill at the configured max_seq_len would never be used
    useful = cfg.max_running_req * -(-cfg.configured_max_seq_len // cfg.page_size)
    if pages > useful:
        pages = useful
        how += f", capped at max_running_req x max_seq_len = {useful} pages"
    if companion is not None:
        how += f"; each page id also holds {draft_page} bytes of the draft model's KV"
    logger.info("KV cache: %d pages x %d bytes (%s)", pages, page_bytes, how)
    return pages


def make_kv_cache(
    config: EngineConfig, pages: int, kv_heads: int, scales: torch.Tensor | None
) -> MHAKVCachePool:
    """The KV pool of `pages` pages of this rank's `kv_heads` (`scales`: the model's FP8 KV scales)."""
    mc = config.model_config
    return MHAKVCachePool(
        mc.num_layers,
        pages,
        config.page_size,
        kv_heads,
        mc.head_dim,
        config.kv_torch_dtype,
        config.torch_device,
        use_kernel=config.use_kv_store_kernel,
        scales=scales,
    )


def make_page_table(
    config: EngineConfig, max_seq_len: int, dummy_page: int, shared: torch.Tensor | None
) -> torch.Tensor:
    """The page table maps (table_idx, position) to a KV location; its last row, table_idx
    `max_running_req`, is the dummy request's, on the dummy page. A shared one (the engine's
    `page_table` argument) is taken as it is: its owner writes it, and its page ids must be this pool's
    (as many pages, so the same dummy page)."""
    device, page_size, max_running_req = config.torch_device, config.page_size, config.max_running_req
    aligned_max_seq_len = -(-max_seq_len // page_size) * page_size
    if shared is not None:
        expected = (max_running_req + 1, aligned_max_seq_len)
        if tuple(shared.shape) != expected or shared.dtype != torch.int32 or shared.device != device:
            raise ValueError(
                f"the shared page table is {tuple(shared.shape)} {shared.dtype} on {shared.device}; this "
                f"engine needs {expected} torch.int32 on {device} (max_running_req={max_running_req}, "
                f"max_seq_len={max_seq_len}, page_size={page_size})"
            )
        return shared
    check_fits(
        (max_running_req + 1) * aligned_max_seq_len * 4,
        available_memory(device),
        f"a page table of max_running_req={max_running_req} (+1) rows x max_seq_len={max_seq_len}",
    )
    page_table = torch.zeros((max_running_req + 1, aligned_max_seq_len), dtype=torch.int32, device=device)
    dummy_loc = dummy_page * page_size
    page_table[max_running_req] = dummy_loc + torch.arange(aligned_max_seq_len) % page_size
    return page_table


def attention_options(model_config: ModelConfig) -> AttnOptions:
    """The model's attention beyond the default (`AttnOptions`): Gemma's and gpt-oss's windowed layers,
    Gemma's scale and soft cap, gpt-oss's sinks."""
    layers = None
    if model_config.layer_types:
        layers = tuple(model_config.layer_window(i) is not None for i in range(model_config.num_layers))
    return AttnOptions(
        window_layers=layers,
        sm_scale=model_config.attn_scale,
        soft_cap=model_config.attn_softcap,
        sinks=model_config.attention_sinks,
    )


def make_context(
    config: EngineConfig,
    kv_cache: MHAKVCachePool,
    page_table: torch.Tensor,
    heads: HeadShard,
    sliding_window: int | None,
) -> Context:
    """The attention backend (which sees this rank's `heads`), the MoE backend and the context that
    holds them."""
    cfg, model_config = config, config.model_config
    attn_backend = create_attention_backend(
        cfg.attention_backend,
        kv_cache,
        page_table,
        cfg.torch_device,
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=model_config.head_dim,
        tensor_core_min_group=cfg.tensor_core_min_group,
        split_kv_max_bs=cfg.decode_split_kv_max_bs,
        # its split count follows the batch size, so a request's logits would depend on its batch
        triton_decode_max_bs=0 if cfg.batch_invariant else cfg.decode_triton_max_bs,
        dtype=cfg.torch_dtype,
        sliding_window=sliding_window,
        options=attention_options(model_config),
    )
    moe_backend = (
        create_moe_backend(cfg.moe_backend, cfg.torch_device, cfg.torch_dtype)
        if model_config.num_experts
        else None
    )
    return Context(
        batch_invariant=cfg.batch_invariant,
        use_gemv_kernel=cfg.use_gemv_kernel,
        use_fused_kernels=cfg.use_fused_kernels,
        use_pdl=cfg.use_pdl,
        page_size=cfg.page_size,
        kv_cache=kv_cache,
        page_table=page_table,
        attn_backend=attn_backend,
        moe_backend=moe_backend,
    )


def make_graph_runner(
    config: EngineConfig, model: torch.nn.Module, ctx: Context, max_seq_len: int, lora: EngineLora | None
) -> GraphRunner:
    """The CUDA graphs and the compiled forward (`minisgl.engine.graph`), as the settings ask."""
    cfg = config
    sizes = (cfg.max_running_req, max_seq_len, cfg.cuda_graph_bs, cfg.cuda_graph_max_bs)
    prefill = ("compile_prefill", "prefill_graph_max_tokens", "prefill_graph_max_context")
    return GraphRunner(
        model, ctx, cfg.torch_device, *sizes, **{name: getattr(cfg, name) for name in prefill}, lora=lora
    )


def log_ready(
    config: EngineConfig,
    seconds: float,
    model_bytes: int,
    kv_cache: MHAKVCachePool,
    max_seq_len: int,
    companion: object | None,
    shares_page_table: bool,
    lora: EngineLora | None,
) -> None:
    """The line that says the engine is ready, and what it holds."""
    model_config, tp_info = config.model_config, config.tp_info
    pages = kv_cache.num_pages
    speculative = ""
    if companion is not None:  # what the pool's sizing left for the draft model
        draft_kv = (pages + 1) * companion.page_bytes  # type: ignore[attr-defined]
        draft_weights = companion.weight_bytes  # type: ignore[attr-defined]
        speculative = (
            f"; room left for a draft model: {draft_weights / GIB:.2f} GiB of weights and "
            f"{pages} KV pages at the same page ids ({draft_kv / GIB:.2f} GiB)"
        )
    if shares_page_table:
        speculative = "; a draft model: its KV at the target's page ids (the target's page table)"
    if lora is not None:
        pool = lora.pool
        speculative += (
            f"; LoRA: {pool.max_loras} adapter slots of rank up to {pool.max_rank} "
            f"({lora_bytes(config) / GIB:.2f} GiB, from the KV cache's budget)"
        )
    logger.info(
        "engine ready in %.1f s: %s (%s, %s, %.2f GiB of weights%s), %d KV pages of %d tokens "
        "(%.2f GiB%s), max_seq_len %d%s",
        seconds,
        model_config.architecture,
        config.torch_device,
        str(config.torch_dtype).removeprefix("torch."),
        model_bytes / GIB,
        f", tp rank {tp_info.rank} of {tp_info.size}" if tp_info.size > 1 else "",
        pages,
        config.page_size,
        kv_cache.size_bytes / GIB,
        "" if config.kv_cache_dtype == "auto" else f", {config.kv_cache_dtype}",
        max_seq_len,
        speculative,
    )


def check_fits(num_bytes: int, available: int, what: str) -> None:
    """Raises a MemoryError naming `what` before an allocation larger than the memory available."""
    if num_bytes > available:
        raise MemoryError(
            f"{what} needs {num_bytes / GIB:.2f} GiB, but only {max(available, 0) / GIB:.2f} GiB are "
            "available; lower it"
        )


def available_memory(device: torch.device) -> int:
    """Bytes free on the device: GPU memory, or the RAM the OS reports available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
