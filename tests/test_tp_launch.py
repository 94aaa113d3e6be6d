"""LLM(tp=N): rank 0 in this process schedules, spawned ranks follow; results equal a single rank."""

import os
import socket

import pytest
import torch
from conftest import make_tiny_model

from minisgl.core import SamplingParams
from minisgl.llm import LLM

pytestmark = pytest.mark.slow


def _addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen3")


def _generate(folder, tp: int, prompts, params):
    llm = LLM(
        str(folder),
        tp=tp,
        device="cpu",
        dtype="float32",
        max_running_req=8,
        distributed_addr=_addr(),
        distributed_timeout=60,
        max_prefill_tokens=16,
    )
    try:
        return [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def test_llm_tp2_equals_tp1(tiny_qwen3):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 40, 1, 23, 17)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 3, 9, 4, 7)]
    params[1] = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)  # rank 0 samples
    single = _generate(tiny_qwen3, 1, prompts, params)
    assert _generate(tiny_qwen3, 2, prompts, params) == single
    assert [len(t) for t in single] == [6, 8, 9, 4, 7]


def test_dead_rank_is_a_clear_error(tiny_qwen3):
    llm = LLM(
        str(tiny_qwen3), tp=2, device="cpu", dtype="float32", distributed_addr=_addr(), distributed_timeout=60
    )
    try:
        llm.engine.workers[0].kill()
        llm.engine.workers[0].join(10)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    finally:
        llm.shutdown()


def test_cli_generate_tp3_on_the_default_model(smollm2_path):
    """`minisgl-run generate --tp 3`: SmolLM2 (9 heads, 3 KV heads) over three processes."""
    import os
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [
            "minisgl-run",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--tp",
            "3",
            "--device",
            "cpu",
            "--distributed-addr",
            _addr(),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("The capital of France is") and "Paris" in out.stdout


def test_torchrun_style_ranks_from_the_environment(smollm2_path):
    """Three processes started as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0
    prints the answer, the others follow it and exit quietly."""
    import os
    import subprocess

    port = _addr().rsplit(":", 1)[1]
    base = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    cmd = [
        "minisgl-run",
        "generate",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--device",
        "cpu",
        "-q",
    ]
    procs = [
        subprocess.Popen(
            cmd,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-1500:] for _, err in outs]
    assert outs[0][0].startswith("The capital of France is") and "Paris" in outs[0][0]
    assert outs[1][0] == outs[2][0] == ""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_without_a_main_guard_is_told_before_any_rank_starts(tiny_qwen3, tmp_path, guarded):
    """Spawned ranks import the main script again: LLM(tp=2) at a script's top level is refused with
    the fix named, before any process starts; under `if __name__ == "__main__":` it is not."""
    import subprocess
    import sys

    call = f"LLM({str(tiny_qwen3)!r}, tp=2, device='cpu', distributed_addr={_addr()!r}).shutdown()"
    body = f"if __name__ == '__main__':\n    {call}\n    print('ran')\n" if guarded else f"{call}\n"
    script = tmp_path / "script.py"
    script.write_text(f"from minisgl.llm import LLM\n{body}")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    if guarded:
        assert out.returncode == 0 and "ran" in out.stdout, out.stderr[-2000:]
    else:
        assert out.returncode != 0
        assert 'put the code that creates the LLM under `if __name__ == "__main__":`' in out.stderr
        assert "bootstrapping" not in out.stderr  # no rank was started


def test_auto_rendezvous_needs_no_port_and_a_taken_port_is_a_clear_error(tiny_qwen3):
    """Unset distributed_addr: the ranks meet at a file in a private folder, removed at shutdown. A
    tcp:// address whose port is taken is an error naming the address and the fix, not a raw
    EADDRINUSE, and the spawned rank is stopped."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(str(tiny_qwen3), tp=2, device="cpu", dtype="float32", distributed_timeout=60)
    folder = llm._rendezvous_dir
    assert llm.settings.distributed_addr == f"file://{folder}/rendezvous"
    out = llm.generate([[5, 6, 7]], params)[0].token_ids
    workers = list(llm.engine.workers)
    llm.shutdown()
    assert not os.path.exists(folder) and not any(p.is_alive() for p in workers)
    assert out == _generate(tiny_qwen3, 1, [[5, 6, 7]], params)[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="could not meet its group at distributed_addr"):
            LLM(str(tiny_qwen3), tp=2, device="cpu", distributed_addr=addr, distributed_timeout=20)
