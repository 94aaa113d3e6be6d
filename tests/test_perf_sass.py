"""`python -m perf.sass`: the packed-weight kernels compiled for sm_90 on this machine (no GPU), their
registers and loops read from the SASS. It runs in a process of its own: the tests' Triton is the
interpreter, which compiles nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from perf import sass

pytestmark = pytest.mark.skipif(not sass.available(), reason="needs Triton with its CUDA tools (ptxas)")


def test_the_one_row_gemv_compiles_for_hopper_and_its_loop_is_read(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "perf.sass", "gemv", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    head, loop_line = run.stdout.strip().splitlines()  # one loop over the row's words
    registers = int(re.fullmatch(r"gemv: (\d+) registers, \d+ bytes of shared memory", head).group(1))
    assert 0 < registers <= 255
    match = re.match(r"  loop: (\d+) instructions, ([\d.]+) per value: (.*)", loop_line)
    instructions, per_value = int(match.group(1)), float(match.group(2))
    _, _, constexprs, warps, _, values = sass.presets()["gemv"]
    assert values == constexprs["BLOCK_N"] * constexprs["BLOCK_W"] * 8  # 8 values a 4-bit word
    assert per_value == pytest.approx(instructions * 32 * warps / values, abs=0.01)
    ffma = int(re.search(r"FFMA (\d+)", match.group(3)).group(1))
    # a value costs at least its multiply-add (on the CUDA cores: no tensor core here), shift and mask
    assert ffma * 32 * warps >= values and per_value > 3
    text = (tmp_path / "gemv.sass").read_text()
    assert "FFMA" in text and "HGMMA" not in text
    assert "#ttg.blocked" in (tmp_path / "gemv.ttgir").read_text()
