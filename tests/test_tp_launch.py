"""LLM(tp=N): rank 0 in this process schedules, spawned ranks follow; results equal a single rank."""

import os
import socket

import pytest
import torch
from conftest import llm_clean, make_peft_adapter

from minisgl.core import SamplingParams
from minisgl.llm import LLM

pytestmark = pytest.mark.slow

# the KV pool of a `minisgl-run` rank of SmolLM2: 218 pages (3488 tokens), plenty for these prompts; the
# default budget (10% of the RAM) commits about 1 GB in each of the 3 ranks at start, seconds of CPU
SMALL_KV = ["--cpu-kv-budget-gib", "0.05"]


def _addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_model):
    return tiny_model("qwen3")


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


def test_lora_adapters_under_tp2_equal_tp1(tiny_qwen3, tmp_path):
    """Adapters sharded like the projections they modify, loaded at start and at runtime (rank 0's load
    and unload reach the other rank with the next step), requests of the base and two adapters in
    one batch with one device slot: the same tokens as one rank."""
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a = make_peft_adapter(tiny_qwen3, tmp_path / "a", 0, r=4, lora_alpha=8, target_modules=every)
    some = dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])
    b = make_peft_adapter(tiny_qwen3, tmp_path / "b", 1, **some)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 19, 1, 12)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(tp: int) -> list[list[list[int]]]:
        llm = _text_llm(tiny_qwen3, tp, lora_modules={"a": a}, max_loras=1, max_lora_rank=8)
        try:
            runs = [llm.generate(prompts, params, lora=[None, "a", "a", None])]
            llm.load_lora("b", b)
            runs.append(llm.generate(prompts, params, lora=["b", "a", None, "b"]))
            llm.unload_lora("a")
            runs.append(llm.generate(prompts, params, lora=["b", None, "b", None]))
            return [[o.token_ids for o in outputs] for outputs in runs]
        finally:
            llm.shutdown()

    single = run(1)
    assert run(2) == single
    # the adapters change the tokens (prompt 0 under the base, then b; prompt 1 under a, then the base)
    assert single[0][0] != single[1][0] and single[1][1] != single[2][1]


def test_dead_rank_is_a_clear_error(tiny_qwen3):
    llm = LLM(
        str(tiny_qwen3), tp=2, device="cpu", dtype="float32", distributed_addr=_addr(), distributed_timeout=60
    )
    try:
        llm.group.workers[0].kill()
        llm.group.workers[0].join(10)
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
            *SMALL_KV,
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
        *SMALL_KV,
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
    workers = list(llm.group.workers)
    llm.shutdown()
    assert not os.path.exists(folder) and not any(p.is_alive() for p in workers)
    assert out == _generate(tiny_qwen3, 1, [[5, 6, 7]], params)[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="could not meet its group at distributed_addr"):
            LLM(str(tiny_qwen3), tp=2, device="cpu", distributed_addr=addr, distributed_timeout=20)


# -- ranks in lockstep, two processes: overlap, stops decided by rank 0, aborts, faults ------------


def _text_llm(folder, tp: int, **kw) -> LLM:
    return LLM(
        str(folder),
        tp=tp,
        device="cpu",
        dtype="float32",
        max_running_req=6,
        page_size=4,
        max_prefill_tokens=24,
        distributed_timeout=120,  # also how long rank 0 waits for the spawned rank to start (a busy CI host)
        **kw,
    )


@pytest.fixture(scope="module")
def text_model(tiny_model):
    return tiny_model("qwen3", tokenizer=True)


LOCKSTEP_PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "Hello"]


def _lockstep_params(stop: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12),  # EOS may stop it: rank 0 decides
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=3),
        SamplingParams(max_tokens=16, stop=[stop]),  # a stop string: only rank 0 has the text
        SamplingParams(max_tokens=9, min_tokens=4, ignore_eos=False, stop_token_ids=[7, 8, 9]),
    ]


def _outputs(llm: LLM, params) -> list[tuple[list[int], str]]:
    return [(o.token_ids, o.finish_reason) for o in llm.generate(LOCKSTEP_PROMPTS, params)]


def _exit_codes(llm: LLM) -> list[int | None]:
    workers = list(llm.group.workers)
    llm.shutdown()
    return [proc.exitcode for proc in workers]


def test_lockstep_tp2_equals_tp1_with_overlap_stops_aborts_and_faults(text_model, monkeypatch):
    """TP=2 with overlap scheduling (on by default): the same tokens and finishes as one rank, with a
    stop string found in rank 0's text, an aborted stream, unseeded sampling (ranks share the seed rank
    0 draws: the follower checks the tokens every step) and faults injected on rank 0 alone (a failed
    step, one request's failed token handling), which fail only their requests. The follower ends
    cleanly (exit code 0), so it never diverged."""
    single = _text_llm(text_model, 1)
    try:
        probe = single.generate(LOCKSTEP_PROMPTS[2], SamplingParams(max_tokens=16))[0].text
        stop = probe[len(probe) // 2 : len(probe) // 2 + 2] or "x"
        params = _lockstep_params(stop)
        expected = _outputs(single, params)
        with single.stream("Hello", SamplingParams(max_tokens=20, ignore_eos=True)) as stream:
            streamed = [next(stream), next(stream)]
    finally:
        single.shutdown()
    assert expected[2][1] == "stop"

    llm = _text_llm(text_model, 2)
    try:
        assert llm.scheduler.overlap and llm.group is not None
        assert _outputs(llm, params) == expected
        with llm.stream("Hello", SamplingParams(max_tokens=20, ignore_eos=True)) as stream:
            assert [next(stream), next(stream)] == streamed
        assert stream.finish_reason == "abort"
        unseeded = llm.generate(
            LOCKSTEP_PROMPTS, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
        )
        assert [len(o.token_ids) for o in unseeded] == [12] * 4

        # rank 0 alone fails preparing one step: its requests fail, on every rank; the rest go on
        output = llm.scheduler.output
        original = output.suppressed

        def fail_once(*args):
            output.suppressed = original
            raise RuntimeError("injected on rank 0")

        output.suppressed = fail_once
        failed = llm.generate(LOCKSTEP_PROMPTS, params)
        assert {o.finish_reason for o in failed} == {"error"}
        assert "injected on rank 0" in failed[0].error
        # rank 0 alone fails handling one request's token: that request alone fails
        check_stop = output.check_stop
        monkeypatch.setattr(
            output,
            "check_stop",
            lambda state, token: (
                (_ for _ in ()).throw(RuntimeError("bad token"))
                if state.prompt_ids == llm.tokenizer(LOCKSTEP_PROMPTS[1])["input_ids"]
                else check_stop(state, token)
            ),
        )
        mixed = _outputs(llm, params)
        assert mixed[1][1] == "error"
        assert [mixed[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
        monkeypatch.setattr(output, "check_stop", check_stop)
        assert _outputs(llm, params) == expected
        llm_clean(llm)
    finally:
        codes = _exit_codes(llm)
    assert codes == [0]


def _fail_third_forward(rank, engine, scheduler):
    """Worker setup (runs in the spawned rank): its third forward raises."""
    calls = []
    original = engine.forward_batch

    def forward_batch(batch, args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"injected on rank {rank}")
        return original(batch, args)

    engine.forward_batch = forward_batch


def test_a_failure_on_another_rank_ends_the_group_with_that_rank_named(tiny_qwen3, monkeypatch):
    """Rank 1 fails inside a step: it reports its error and exits; rank 0, left waiting in the step's
    collectives, raises a FatalEngineError naming rank 1 and its error, well inside
    distributed_timeout; the LLM refuses later calls."""
    import functools
    import time

    from minisgl import llm as llm_module
    from minisgl.core import FatalEngineError
    from minisgl.launch import start_workers

    monkeypatch.setattr(
        llm_module, "start_workers", functools.partial(start_workers, setup=_fail_third_forward)
    )
    llm = LLM(str(tiny_qwen3), tp=2, device="cpu", dtype="float32", distributed_timeout=120)
    try:
        started = time.monotonic()
        with pytest.raises(
            FatalEngineError, match=r"tensor-parallel rank 1 failed \(.*RuntimeError: injected on rank 1"
        ):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
        assert time.monotonic() - started < 60  # not the 120 s timeout: the report ends the wait
        with pytest.raises(FatalEngineError, match="rank 1"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        codes = _exit_codes(llm)
    assert codes == [1]


def test_a_rank_killed_mid_stream_is_a_clear_error(text_model):
    llm = _text_llm(text_model, 2)
    try:
        stream = llm.stream("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
        next(stream)
        llm.group.workers[0].kill()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            for _ in stream:
                pass
        assert stream.finish_reason == "error"
    finally:
        codes = _exit_codes(llm)
    assert codes == [-9]
    # rank 0 aborted its communicators rather than waiting for the dead rank: a new group starts
    with _text_llm(text_model, 2) as again:
        assert (
            len(again.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
        )
