"""LoRA adapters (minisgl.lora, minisgl.layers.lora, minisgl.kernels.lora) against PEFT, on the CPU.

Tiny transformers models get PEFT adapters (lora_B drawn at random: PEFT starts it at zero), saved with
`save_pretrained`; `load_adapter` reads them into a `LoraPool`, and `lora_add` on a batch that mixes
adapters and base-only rows must add what PEFT's modules add, for every layer and projection. The
Triton kernels run under Triton's interpreter against the torch path; tensor-parallel shards must add
up to the whole; every adapter minisgl refuses is refused with a message naming why.
"""

import json
import shutil

import pytest
import torch
from conftest import make_peft_model, make_tiny_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

from minisgl.kernels import lora as K
from minisgl.layers import lora as L
from minisgl.layers.lora import LoraBatch, lora_add, lora_add_reference
from minisgl.lora import LoraError, LoraPool, load_adapter, lora_projections
from minisgl.models.config import ModelConfig

# 2 layers, hidden 64, 4 query / 2 KV heads (of 16 but Qwen3's 32), intermediate 96 (conftest's shapes)
SHAPE = dict(num_hidden_layers=2)
PROJECTIONS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
# a batch: each request's rows and slot (-1: no adapter; slot 3 stays empty)
ROWS, SLOTS = [3, 2, 1, 4, 1, 2], [2, -1, 0, 1, 3, 2]
TOTAL = sum(ROWS)
# the adapters of the llama pool: slot -> LoraConfig arguments
ADAPTERS = {
    0: dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=r".*\.(q_proj|v_proj|down_proj)",
        exclude_modules=r".*\.0\.mlp\.down_proj",
    ),
    1: dict(
        r=2,
        lora_alpha=4,
        target_modules=["q_proj", "o_proj", "up_proj"],
        rank_pattern={"o_proj": 4},
        alpha_pattern={"q_proj": 3},
        layers_to_transform=[1],
    ),
    2: dict(r=4, lora_alpha=8, target_modules="all-linear"),
}
MAX_RANK = 8


def _peft_adapter(model_folder, out, seed, **lora):
    """A PEFT model of `model_folder` with one adapter (A and B random), saved in `out`."""
    return make_peft_model(model_folder, out, seed, **lora)[0]


def _peft_delta(peft_model, layer, projection, x):
    """What PEFT's modules of `projection` in `layer` add to x's output rows (zeros where untargeted)."""
    decoder = peft_model.base_model.model.model.layers[layer]
    parts = []
    for name in _MODULES[projection]:
        module = decoder.get_submodule(name)
        if isinstance(module, LoraLayer):
            parts.append(module(x) - module.base_layer(x))
        else:
            parts.append(torch.zeros(x.shape[0], module.out_features))
    return torch.cat(parts, dim=1)


# the transformers modules of each packed projection, rows in order
_MODULES = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model folder, ModelConfig, {slot: PEFT model}, {slot: adapter folder})."""
    tmp = tmp_path_factory.mktemp("lora")
    folder = make_tiny_model(tmp, "llama", **SHAPE)
    peft_models, folders = {}, {}
    for slot, lora in ADAPTERS.items():
        folders[slot] = tmp / f"adapter{slot}"
        peft_models[slot] = _peft_adapter(folder, folders[slot], seed=slot, **lora)
    return folder, ModelConfig.from_path(folder), peft_models, folders


def _pool(cfg, folders, tp_rank=0, tp_size=1, dtype=torch.float32):
    pool = LoraPool(
        cfg, max_loras=4, max_rank=MAX_RANK, dtype=dtype, device="cpu", tp_rank=tp_rank, tp_size=tp_size
    )
    for slot, folder in folders.items():
        adapter = load_adapter(
            f"a{slot}", folder, cfg, max_rank=MAX_RANK, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size
        )
        pool.load(slot, adapter)
    return pool


def _inputs(pool, projection, seed, rows=TOTAL):
    in_cols = pool.a[projection].shape[-1]
    return torch.randn(rows, in_cols, generator=torch.Generator().manual_seed(seed))


def _expected(peft_models, layer, projection, x):
    """Each row's PEFT delta under its slot of (ROWS, SLOTS)."""
    row_slots = [s for n, s in zip(ROWS, SLOTS) for _ in range(n)]
    with torch.no_grad():
        deltas = {s: _peft_delta(m, layer, projection, x) for s, m in peft_models.items()}
    zero = torch.zeros_like(next(iter(deltas.values())))
    return torch.stack([deltas.get(s, zero)[t] for t, s in enumerate(row_slots)])


def test_adapters_read_as_peft_configures_them(llama):
    _, cfg, _, folders = llama
    adapters = [
        load_adapter(f"a{s}", folders[s], cfg, max_rank=MAX_RANK, dtype=torch.float32) for s in range(3)
    ]
    assert [a.rank for a in adapters] == [8, 4, 4]
    assert adapters[0].targets == ("q_proj", "v_proj", "down_proj")
    assert adapters[1].targets == ("q_proj", "o_proj", "up_proj")
    assert adapters[2].targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert adapters[0].layers[0]["down_proj"] is None and adapters[0].layers[1]["down_proj"] is not None
    # layers_to_transform=[1]: layer 0 has nothing; rank_pattern gives o_proj rank 4, q_proj keeps r=2
    assert all(ab is None for ab in adapters[1].layers[0].values())
    a_qkv, b_qkv = adapters[1].layers[1]["qkv_proj"]
    assert a_qkv.shape == (3, 4, 64) and b_qkv.shape == (64 + 32 + 32, 4)
    assert a_qkv[0, 2:].abs().sum() == 0 and a_qkv[1:].abs().sum() == 0


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
def test_lora_add_matches_peft_for_a_mixed_batch(llama, kernel, monkeypatch):
    """Every layer and projection: rows of three adapters, base-only rows and an empty slot in one batch;
    the torch path, and the Triton kernels under the interpreter (the op `minisgl::lora_add`)."""
    _, cfg, peft_models, folders = llama
    monkeypatch.setattr(L, "kernel_applies", lambda x: kernel)
    pool = _pool(cfg, folders)
    batch = LoraBatch.build(ROWS, SLOTS, "cpu")
    for layer in range(cfg.num_layers):
        for seed, projection in enumerate(pool.sizes):
            x = _inputs(pool, projection, seed)
            a, b = pool.weights(layer, projection)
            out = torch.zeros(x.shape[0], b.shape[1])
            got = lora_add(x, out, a, b, batch, pool.sizes[projection])
            assert got is out
            torch.testing.assert_close(
                got, _expected(peft_models, layer, projection, x), atol=1e-5, rtol=1e-4
            )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "qwen3_moe"])
def test_other_families_match_peft(tmp_path, tiny_model, arch):
    """Every module minisgl serves LoRA on: Qwen2 (q/k/v biases), Qwen3 (head_dim 32: q rows != hidden),
    Mistral, and Qwen3-MoE (attention only; its MLP refused)."""
    folder = tiny_model(arch, **SHAPE)
    cfg = ModelConfig.from_path(folder)
    moe = arch == "qwen3_moe"
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"] + (
        [] if moe else ["gate_proj", "up_proj", "down_proj"]
    )
    peft_model = _peft_adapter(
        folder, tmp_path / "adapter", seed=5, r=4, lora_alpha=4, target_modules=modules
    )
    pool = _pool(cfg, {1: tmp_path / "adapter"})
    assert list(pool.sizes) == (["qkv_proj", "o_proj"] if moe else PROJECTIONS)
    batch = LoraBatch.build([2, 3], [-1, 1], "cpu")
    for layer in range(cfg.num_layers):
        for projection in pool.sizes:
            x = _inputs(pool, projection, layer, rows=5)
            a, b = pool.weights(layer, projection)
            got = lora_add(x, torch.zeros(5, b.shape[1]), a, b, batch, pool.sizes[projection])
            with torch.no_grad():
                want = _peft_delta(peft_model, layer, projection, x)
            torch.testing.assert_close(got[2:], want[2:], atol=1e-5, rtol=1e-4)
            assert not got[:2].any()
    if moe:
        with pytest.raises(LoraError, match="'gate_proj', .* mixture-of-experts"):
            _refused(tmp_path / "adapter", cfg, tmp_path / "moe-mlp", target_modules=["q_proj", "gate_proj"])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("ranked", [False, True], ids=["pool-rank", "slot-ranks"])
def test_kernels_match_the_torch_path_in_bfloat16(monkeypatch, splits, ranked):
    """Random bf16 slots, a rank below 16 (the products' padded width), three unequal segments, the
    shrink's K whole or cut in parts (its parts summed by the expand). With `ranks`, slots of rank 3 and
    5 in a pool of rank 8: the kernels read no more than each slot's rank, so garbage in the padding
    changes nothing (the reference runs on the padding zeroed)."""
    monkeypatch.setattr(K, "shrink_splits", lambda rows, n, k: splits)
    g = torch.Generator().manual_seed(0)
    sizes, rank, k = [40, 8, 8], 8, 200
    a = (torch.randn(3, 3 * rank, k, generator=g) * 0.2).bfloat16()
    b = (torch.randn(3, sum(sizes), rank, generator=g) * 0.2).bfloat16()
    rows, slots = [40, 1, 3, 1], [1, 0, -1, 1]  # 40 rows: two tiles of one adapter
    batch = LoraBatch.build(rows, slots, "cpu")
    x = torch.randn(sum(rows), k, generator=g).bfloat16()
    base = torch.randn(sum(rows), sum(sizes), generator=g).bfloat16()
    ranks = torch.tensor([3, 5, 8], dtype=torch.int32) if ranked else None
    zeroed_a, zeroed_b = a.clone(), b.clone()
    if ranked:
        for slot, r in enumerate(ranks.tolist()):
            zeroed_a[slot].view(len(sizes), rank, k)[:, r:] = 0
            zeroed_b[slot, :, r:] = 0
    want = lora_add_reference(x, base.clone(), zeroed_a, zeroed_b, batch.row_slots, sizes)
    monkeypatch.setattr(L, "kernel_applies", lambda x: True)
    got = lora_add(x, base.clone(), a, b, batch, sizes, ranks)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got[41:44], base[41:44])  # base-only rows untouched, bit for bit


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
def test_torch_compile_traces_the_op_once_for_every_mix(kernel, monkeypatch):
    """fullgraph (the op `minisgl::lora_add` through its fake), one graph for every mix of slots."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(L, "kernel_applies", lambda x: kernel)
    g = torch.Generator().manual_seed(0)
    a, b, w = (
        torch.randn(2, 24, 32, generator=g),
        torch.randn(2, 24, 8, generator=g),
        torch.randn(24, 32, generator=g),
    )
    x = torch.randn(5, 32, generator=g)

    def projection(x, batch):
        return lora_add(x, x @ w.T, a, b, batch, [8, 8, 8]) * 2

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(projection, backend=counter, fullgraph=True, dynamic=False)
    for slots in ([0, 1], [1, -1], [-1, -1]):
        batch = LoraBatch.build([2, 3], slots, "cpu")
        torch.testing.assert_close(compiled(x, batch), projection(x, batch))
    assert counter.frame_count == 1


def test_the_batch_groups_the_rows_of_each_slot():
    rows, slots = [1, 1, 2, 0, 40, 3, 1], [0, 2, -1, 1, 1, 0, 2]
    batch = LoraBatch.build(rows, slots, "cpu", max_loras=3)
    assert batch.seg_starts.tolist() == [0, 1, 2, 4, 4, 44, 47, 48]
    assert batch.seg_slots.tolist() == slots
    assert batch.row_slots.tolist() == [0, 2, -1, -1] + [1] * 40 + [0] * 3 + [2]
    assert batch.order.tolist() == [0, 44, 45, 46, *range(4, 44), 1, 47, 2, 3]
    tile = K.TILE_ROWS  # (first, end, slot) of entries of `order`, one slot a tile
    assert batch.tiles.tolist() == [[0, 4, 0], [4, 4 + tile, 1], [4 + tile, 44, 1], [44, 46, 2], [0, 0, -1]]
    # the tiles are a function of T and S (and the pool's slots) only
    assert len(LoraBatch.build(rows, slots, "cpu").tiles) == -(-48 // tile) + 7
    with pytest.raises(ValueError, match="slot"):
        LoraBatch.build([1], [-2], "cpu")
    with pytest.raises(ValueError, match=r"\[-1, 3\)"):
        LoraBatch.build([1], [3], "cpu", max_loras=3)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_add_up_to_the_whole(llama, tp_size):
    """Column-parallel deltas are this rank's rows of each segment of the whole (KV heads replicated
    at tp 4 over 2 KV heads); row-parallel deltas, of this rank's columns of x, sum to the whole."""
    _, cfg, _, folders = llama
    whole = _pool(cfg, folders)
    pools = [_pool(cfg, folders, rank, tp_size) for rank in range(tp_size)]
    batch = LoraBatch.build(ROWS, SLOTS, "cpu")
    for layer in range(cfg.num_layers):
        for projection in whole.sizes:
            x = _inputs(whole, projection, layer)
            a, b = whole.weights(layer, projection)
            full = lora_add(x, torch.zeros(x.shape[0], b.shape[1]), a, b, batch, whole.sizes[projection])
            total = torch.zeros_like(full)
            for rank, pool in enumerate(pools):
                proj = lora_projections(cfg, rank, tp_size)[projection]
                cols = proj.cols
                x_r = x[:, cols.part * cols.size : (cols.part + 1) * cols.size]
                a, b = pool.weights(layer, projection)
                part = lora_add(x_r, torch.zeros(x.shape[0], b.shape[1]), a, b, batch, pool.sizes[projection])
                if cols.parts > 1:  # row-parallel
                    total += part
                    continue
                full_segments = full.split([s.size * s.parts for s in proj.segments], dim=1)
                for mine, whole_segment, s in zip(
                    part.split(pool.sizes[projection], dim=1), full_segments, proj.segments
                ):
                    torch.testing.assert_close(
                        mine, whole_segment[:, s.part * s.size : (s.part + 1) * s.size]
                    )
            if proj.cols.parts > 1:
                torch.testing.assert_close(total, full, atol=1e-5, rtol=1e-4)


def test_the_pool_sizes_loads_and_clears_slots(llama):
    _, cfg, _, folders = llama
    pool = _pool(cfg, folders)
    buffers = [*pool.a.values(), *pool.b.values()]
    assert LoraPool.nbytes(cfg, max_loras=4, max_rank=MAX_RANK, dtype=torch.float32) == sum(
        t.nbytes for t in buffers
    )
    assert (
        LoraPool.nbytes(cfg, max_loras=4, max_rank=MAX_RANK, dtype=torch.bfloat16, tp_size=2)
        < sum(t.nbytes for t in buffers) // 2
    )
    assert pool.a["qkv_proj"].shape == (2, 4, 3 * MAX_RANK, 64) and pool.b["down_proj"].shape == (
        2,
        4,
        64,
        MAX_RANK,
    )
    assert pool.sizes == {
        "qkv_proj": (64, 32, 32),
        "o_proj": (64,),
        "gate_up_proj": (96, 96),
        "down_proj": (64,),
    }
    assert pool.ranks.tolist() == [8, 4, 4, 0]  # each slot's largest module rank (rank_pattern's 4 in 1)
    pool.clear(2)
    assert not any(t[:, 2].any() for t in buffers) and pool.a["qkv_proj"][:, 0].any()
    assert pool.ranks.tolist() == [8, 4, 0, 0]
    adapter = load_adapter("a0", folders[0], cfg, max_rank=MAX_RANK, dtype=torch.float32, tp_size=2)
    with pytest.raises(ValueError, match="rank 0 of 2"):
        pool.load(1, adapter)
    with pytest.raises(ValueError, match="slot 4"):
        pool.clear(4)


# -- what is refused ---------------------------------------------------------------------------------


def _refused(source, cfg, folder, weights=None, **config):
    """Loads a copy of adapter folder `source` whose adapter_config.json is changed by `config` and whose
    weights by `weights(tensors)` (in place)."""
    shutil.copytree(source, folder)
    file = folder / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    if weights is not None:
        tensors = load_file(folder / "adapter_model.safetensors")
        weights(tensors)
        save_file(tensors, folder / "adapter_model.safetensors")
    return load_adapter("bad", folder, cfg, max_rank=MAX_RANK, dtype=torch.float32)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("config", "weights", "message"),
    [
        (dict(r=16), None, r"r=16 \(of model.layers.0.self_attn.q_proj\) is above max_lora_rank=8"),
        (dict(rank_pattern={"v_proj": 9}), None, "r=9 .*v_proj.* max_lora_rank"),
        (dict(target_modules=["q_proj", "embed_tokens"]), None, "'embed_tokens'"),
        (dict(target_modules=["lm_head", "q_proj"]), None, "'lm_head'"),
        (dict(use_dora=True), None, "use_dora=True is not supported"),
        (dict(bias="lora_only"), None, "bias='lora_only' is not supported"),
        (dict(modules_to_save=["lm_head"]), None, r"modules_to_save=\['lm_head'\] is not supported"),
        (dict(peft_type="IA3"), None, "peft_type='IA3'"),
        (dict(target_modules=5), None, "target_modules=5"),
        (dict(target_modules="q_proj("), None, "not a valid regex"),
        (dict(rank_pattern={"q_proj": 2.5}), None, r"rank_pattern\['q_proj'\]=2.5 .* positive integer"),
        (dict(target_modules=["q_proj", "v_proj", "k_proj"]), None, "no lora_A/lora_B weights for .*k_proj"),
        (
            {},
            lambda w: w.update({Q_A.replace("layers.0", "layers.7"): w[Q_A].clone()}),
            "layers.7.* maps to no layer",
        ),
        (
            {},
            lambda w: w.update({Q_A.replace("q_proj", "k_proj"): w[Q_A].clone()}),
            "k_proj, which .* does not target",
        ),
        (
            {},
            lambda w: w.update({"base_model.model.model.embed_tokens.lora_embedding_A": w[Q_A].clone()}),
            "LoRA on the embedding",
        ),
        (
            {},
            lambda w: w.update({Q_A: w[Q_A][:, :32].contiguous()}),
            r"q_proj.lora_A.weight has shape \[4, 32\], expected \[4, 64\]",
        ),
    ],
    ids=lambda v: None,
)
def test_refused_adapters_say_why(llama, tmp_path, config, weights, message):
    _, cfg, _, _ = llama
    source = _base_adapter(llama, tmp_path)
    with pytest.raises(LoraError, match=message):
        _refused(source, cfg, tmp_path / "bad", weights, **config)


def _base_adapter(llama, tmp_path):
    """A plain adapter (r=4 on q_proj and v_proj) of the llama model, written by PEFT once."""
    folder, _, _, folders = llama
    source = folders[0].parent / "plain"
    if not source.exists():
        _peft_adapter(folder, source, seed=9, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    return source


def test_missing_files_and_pickles_are_refused(llama, tmp_path):
    _, cfg, _, _ = llama
    source = _base_adapter(llama, tmp_path)
    load = lambda folder: load_adapter("x", folder, cfg, max_rank=MAX_RANK, dtype=torch.float32)  # noqa: E731
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        load(tmp_path / "empty")
    shutil.copytree(source, tmp_path / "pickled")
    (tmp_path / "pickled" / "adapter_model.safetensors").rename(tmp_path / "pickled" / "adapter_model.bin")
    with pytest.raises(LoraError, match="adapter_model.bin: only safetensors are loaded"):
        load(tmp_path / "pickled")
    with pytest.raises(LoraError, match="not a folder, nor a Hugging Face hub id"):
        load(tmp_path / "nowhere" / "deeper" / "x")


def test_hub_ids_are_fetched_with_the_two_files(llama, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    _, cfg, _, _ = llama
    source = _base_adapter(llama, tmp_path)
    calls = []

    def fetched(repo_id, allow_patterns):
        calls.append((repo_id, sorted(allow_patterns)))
        return str(source)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetched)
    adapter = load_adapter("hub", "someone/adapter", cfg, max_rank=MAX_RANK, dtype=torch.float32)
    assert adapter.targets == ("q_proj", "v_proj") and adapter.path == "someone/adapter"
    assert calls == [("someone/adapter", ["adapter_config.json", "adapter_model.safetensors"])]

    def offline(repo_id, allow_patterns):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        LoraError, match=r"'hub' \(someone/missing\).*hub did not give it.*LocalEntryNotFound"
    ):
        load_adapter("hub", "someone/missing", cfg, max_rank=MAX_RANK, dtype=torch.float32)
