"""The Triton kernels (`minisgl.kernels`) on any machine: when each applies, and the engine settings that
switch them (and the other ablation switches) off. The kernels themselves are tested on the GPU
(tests/gpu/test_gpu_kernels.py)."""

import pytest
import torch
from conftest import make_tiny_model

from minisgl.compile import gemv_kernel_mode
from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig, generate
from minisgl.kernels import gemv as G
from minisgl.kernels import kv_store as S


def test_gemv_does_not_apply_off_its_shape():
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert not G.gemv_applies(x, w)  # CPU (and float32)
    if torch.cuda.is_available() and G.triton is not None:
        xc, wc = x.cuda().bfloat16(), w.cuda().bfloat16()
        assert G.gemv_applies(xc, wc)
        assert not G.gemv_applies(torch.cat([xc, xc]), wc)  # two rows: cuBLAS
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
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama")


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
    assert engine.graph_runner.compile_prefill is compiled_prefill
    assert not engine.sampler.compiled  # CPU: eager whatever compile_sampler says
    generate(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
    assert seen and set(seen) == {gemv_in_forward}
    assert fused_seen and set(fused_seen) == {"use_fused_kernels" not in overrides}
    engine.shutdown()
    assert gemv_kernel_mode()  # outside a forward
