"""The Triton kernels (`minisgl.kernels`) on any machine: when each applies, and the engine settings that
switch them (and the other ablation switches) off. The kernels themselves are tested on the GPU
(tests/gpu/test_gpu_kernels.py)."""

import pytest
import torch

from minisgl.compile import gemv_kernel_mode
from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels import gemv as G
from minisgl.kernels import kv_store as S
from minisgl.scheduler import generate


def test_gemv_does_not_apply_off_its_shape():
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert not G.gemv_applies(x, w)  # CPU (and float32)
    if torch.cuda.is_available() and G.triton is not None:
        xc, wc = x.cuda().bfloat16(), w.cuda().bfloat16()
        assert G.gemv_applies(xc, wc)
        assert not G.gemv_applies(torch.cat([xc, xc]), wc)  # two rows: cuBLAS by default
        assert G.gemv_applies(torch.cat([xc, xc]), wc, max_rows=2)
        assert not G.gemv_applies(xc.expand(G.GEMV_MAX_ROWS + 1, -1), wc, max_rows=64)
        assert not G.gemv_applies(xc.float(), wc.float())
        assert not G.gemv_applies(xc, wc.t().contiguous().t())  # a transposed weight


def test_kv_store_does_not_apply_on_cpu():
    k = torch.randn(3, 2, 4)
    assert not S.kv_store_applies(k, k, torch.zeros(10, 2, 4))


ABLATION_OFF = dict(
    compile_sampler=False,
    compile_prefill=False,
    use_gemv_kernel=False,
    use_kv_store_kernel=False,
    use_fused_kernels=False,
    tensor_core_min_group=4,
    use_pdl=False,
)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


@pytest.mark.parametrize(
    "overrides, kv_kernel, gemv_setting, compiled_prefill, gemv_in_forward",
    [
        ({}, True, True, True, True),
        (ABLATION_OFF, False, False, False, False),
        (dict(batch_invariant=True), True, True, False, False),
    ],
    ids=["defaults", "all-off", "batch-invariant"],
)
def test_ablation_switches_reach_the_components(
    tiny_llama, monkeypatch, overrides, kv_kernel, gemv_setting, compiled_prefill, gemv_in_forward
):
    """The settings of the ablation block go to the KV pool, the context (the GEMV and fused-kernel
    switches) and the graph runner (which `batch_invariant` overrides); `linear` sees the GEMV switch
    while that engine's forward runs, and `fused_kernels_mode` the fused one."""
    import minisgl.models.llama as llama

    seen, real = [], llama.linear
    fused_seen, real_mode = [], llama.fused_kernels_mode
    monkeypatch.setattr(llama, "linear", lambda *a: seen.append(gemv_kernel_mode()) or real(*a))
    monkeypatch.setattr(llama, "fused_kernels_mode", lambda: fused_seen.append(real_mode()) or fused_seen[-1])
    engine = Engine(EngineConfig(model_path=str(tiny_llama), device="cpu", dtype=torch.float32, **overrides))
    assert engine.kv_cache.use_kernel is kv_kernel
    assert engine.ctx.use_gemv_kernel is gemv_setting
    assert engine.ctx.use_fused_kernels is ("use_fused_kernels" not in overrides)
    assert engine.ctx.use_pdl is ("use_pdl" not in overrides)
    assert engine.graph_runner.compile_prefill is compiled_prefill
    assert not engine.sampler.compiled  # CPU: eager whatever compile_sampler says
    generate(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
    assert seen and set(seen) == {gemv_in_forward}
    assert fused_seen and set(fused_seen) == {"use_fused_kernels" not in overrides}
    engine.shutdown()
    assert gemv_kernel_mode()  # outside a forward


def test_attention_settings_reach_the_backend(tiny_llama, monkeypatch):
    """`decode_split_kv_max_bs`, `decode_triton_max_bs` and `tensor_core_min_group` go to the attention
    backend's factory."""
    import minisgl.engine.start as start_module

    seen = {}
    real = start_module.create_attention_backend

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(start_module, "create_attention_backend", spy)
    cfg = dict(model_path=str(tiny_llama), device="cpu", dtype=torch.float32, decode_split_kv_max_bs=12)
    Engine(EngineConfig(**cfg, decode_triton_max_bs=8)).shutdown()
    want = dict(tensor_core_min_group=1, split_kv_max_bs=12, triton_decode_max_bs=8)
    assert {k: seen[k] for k in want} == want
    # batch_invariant: the Triton kernel's split count follows the batch size, so it is off
    Engine(EngineConfig(**cfg, decode_triton_max_bs=8, batch_invariant=True)).shutdown()
    assert seen["triton_decode_max_bs"] == 0


@pytest.mark.parametrize("name", ["split_kv_max_bs", "triton_decode_max_bs"])
@pytest.mark.parametrize("value", [-1, 2.5, "8"])
def test_flashinfer_backend_rejects_a_bad_batch_limit(name, value):
    """Checked before flashinfer is imported, so this runs without it: the error names the value."""
    from minisgl.attention.flashinfer_backend import FlashInferAttnBackend

    with pytest.raises(ValueError, match=rf"{name}={value!r}"):
        FlashInferAttnBackend(None, None, None, 16, 8, 128, "fi", "fi", **{name: value})


@pytest.mark.parametrize(
    "decode, tensor_cores, max_bs, splits",
    [
        ("fi", True, None, [True, True, True]),  # FlashInfer's own behaviour: every graph splits
        ("fi", True, 0, [False, False, False]),
        ("fi", True, 2, [True, True, False]),
        ("fi", False, 0, [True, True, True]),  # the CUDA-core kernel has no switch
        ("fa", True, 0, [True, True, True]),
    ],
)
def test_which_decode_graphs_split_the_kv(decode, tensor_cores, max_bs, splits):
    from types import SimpleNamespace

    from minisgl.attention.flashinfer_backend import FlashInferAttnBackend

    backend = SimpleNamespace(names=("fa", decode), decode_tensor_cores=tensor_cores, split_kv_max_bs=max_bs)
    assert [FlashInferAttnBackend.graph_splits_kv(backend, bs) for bs in (1, 2, 3)] == splits


def test_pdl_is_on_only_inside_a_forward_of_an_engine_that_asks_on_a_device_that_can(tiny_llama):
    """`pdl_mode` follows the running engine's `use_pdl` (off outside a forward); `pdl_enabled` also
    needs a CUDA device of compute capability 9+, so on a CPU it stays off; the launch options tie
    Triton's `launch_pdl` to the kernels' `USE_PDL`."""
    from minisgl.compile import pdl_mode
    from minisgl.kernels import pdl as P

    seen = []
    for use_pdl in (True, False):
        engine = Engine(
            EngineConfig(model_path=str(tiny_llama), device="cpu", dtype=torch.float32, use_pdl=use_pdl)
        )

        def spy(*args, real=engine.model.forward, **kwargs):
            seen.append((pdl_mode(), P.pdl_enabled(torch.zeros(1))))
            return real(*args, **kwargs)

        engine.model.forward = spy
        generate(engine, [[5, 6, 7]], SamplingParams(max_tokens=1))
        engine.shutdown()
        assert seen[-1] == (use_pdl, False)
    assert not pdl_mode()
    assert not P.pdl_supported(torch.device("cpu"))
    assert P.launch_options(True) == {"USE_PDL": True, "launch_pdl": True}
    assert P.launch_options(False) == {"USE_PDL": False}
