"""The machine code of minisgl's packed-weight Triton kernels for a Hopper GPU (sm_90), compiled on this
machine without one (Triton's own LLVM, `ptxas` and `cuobjdump`): registers, shared memory, and each
loop's instruction mix. Where a kernel's time goes per value before any GPU is lent.

    python -m perf.sass [gemv gemv_rows moe_gate_up moe_down ...] [--out DIR]

Each kernel is compiled as the GPU compiles it at one of Qwen3-8B's or Qwen3-30B-A3B's shapes (4-bit,
group 128; pointer and size arguments specialized as divisible by 16, as Triton does when they are),
at its default configuration. Per loop (a backward branch): instructions, the most frequent opcodes,
and the instructions per weight value a thread handles (`per value`). `BAR` in a loop is a barrier:
values going through shared memory each step. `--out` keeps each kernel's SASS and TTGIR. docs/quantization.md
("One row, after the GEMV's rewrite").
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# (kernel, signature of the runtime arguments, constexprs, warps, arguments divisible by 16, weight
# values a thread handles per loop step): the presets this script knows
PTR = {
    "q_ptr": "*i32",
    "s_ptr": "*fp16",
    "z_ptr": "*u8",
    "b_ptr": "*bf16",
    "y_ptr": "*bf16",
    "x_ptr": "*bf16",
}


@dataclass(frozen=True)
class Loop:
    instructions: int
    opcodes: collections.Counter
    per_value: float


@dataclass(frozen=True)
class Report:
    name: str
    registers: int
    shared: int
    loops: list[Loop]
    sass: str
    ttgir: str


def presets() -> dict[str, tuple]:
    from minisgl.kernels import moe_gemv as G
    from minisgl.kernels import packed_gemm as P

    moe = dict(INTER=768, H=2048, TOP_K=8, BITS=4, GROUP=128, BLOCK_E=128)
    gate_up, down = G._default_config("gate_up", 1, 2048, 4), G._default_config("down", 1, 768, 4)
    n, w, warps = P.gemv_config(1)
    n4, w4, warps4 = P.gemv_config(4)
    return {
        "gemv": (  # one row of x, Qwen3-8B's gate/up
            P._packed_gemv_kernel,
            {**PTR, "N": "i32", "KW": "i32", "G": "i32"},
            dict(BITS=4, GROUP_WORDS=16, HAS_BIAS=False, BLOCK_N=n, BLOCK_W=w, USE_PDL=True),
            warps,
            ("N", "KW", "G"),
            n * w * 8,
        ),
        "gemv_rows": (  # four rows of x
            P._packed_gemv_rows_kernel,
            {**PTR, "perm_ptr": "*i64", "M": "i32", "N": "i32", "KW": "i32", "G": "i32", "x_stride": "i32"},
            dict(
                BITS=4,
                GROUP_WORDS=16,
                HAS_PERM=False,
                HAS_BIAS=False,
                BLOCK_M=4,
                BLOCK_N=n4,
                BLOCK_W=w4,
                USE_PDL=True,
            ),  # fmt: skip
            warps4,
            ("N", "KW", "G", "x_stride"),
            4 * n4 * w4 * 8,
        ),
        "moe_gate_up": (  # one token, Qwen3-30B-A3B's experts; the gate and up rows in one tile
            G._gate_up_kernel,
            {
                "x_ptr": "*bf16",
                "logits_ptr": "*bf16",
                "w13_ptr": "*i32",
                "s13_ptr": "*fp16",
                "z13_ptr": "*u8",
                "act_ptr": "*bf16",
                "E": "i32",
                "x_stride": "i32",
                "logits_stride": "i32",
            },  # fmt: skip
            dict(**moe, BLOCK_N=gate_up[0], BLOCK_K=gate_up[1]),
            gate_up[2],
            ("E", "x_stride", "logits_stride"),
            2 * gate_up[0] * gate_up[1],
        ),
        "moe_down": (
            G._down_kernel,
            {
                "act_ptr": "*bf16",
                "logits_ptr": "*bf16",
                "w2_ptr": "*i32",
                "s2_ptr": "*fp16",
                "z2_ptr": "*u8",
                "out_ptr": "*fp32",
                "E": "i32",
                "logits_stride": "i32",
            },  # fmt: skip
            dict(**moe, RENORMALIZE=True, SPLIT=down[3], BLOCK_N=down[0], BLOCK_K=down[1]),
            down[2],
            ("E", "logits_stride"),
            down[0] * down[1],
        ),
    }


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def available() -> bool:
    """Whether this install can compile for sm_90 here (Triton with its CUDA tools)."""
    try:
        return os.access(_tool("ptxas"), os.X_OK) and os.access(_tool("cuobjdump"), os.X_OK)
    except ImportError:
        return False


def compile_report(name: str) -> Report:
    """Compiles preset `name` for sm_90 and reads its SASS."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, runtime, constexprs, warps, divisible, values = presets()[name]
    index = {arg: i for i, arg in enumerate(fn.arg_names)}
    signature = {arg: runtime.get(arg, "constexpr") for arg in fn.arg_names}
    attrs = {
        (index[arg],): [["tt.divisibility", 16]]
        for arg, kind in runtime.items()
        if kind.startswith("*") or arg in divisible
    }
    source = ASTSource(fn, signature, {(index[k],): v for k, v in constexprs.items()}, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True
        ).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True)
    registers = int(re.search(r"REG:(\d+)", usage.stdout).group(1))
    ops = []
    for line in sass.splitlines():
        match = re.match(
            r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)[^;]*?(0x[0-9a-f]+)?\s*;", line
        )
        if match:
            ops.append((int(match.group(1), 16), match.group(2), match.group(3)))
    threads = 32 * warps
    loops = []
    for at, opcode, target in ops:
        if opcode == "BRA" and target and int(target, 16) < at:  # a backward branch closes a loop
            body = [op for a, op, _ in ops if int(target, 16) <= a <= at]
            loops.append(Loop(len(body), collections.Counter(body), len(body) * threads / values))
    return Report(name, registers, kernel.metadata.shared, loops, sass, kernel.asm["ttgir"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("kernels", nargs="*", default=list(presets()), choices=list(presets()))
    parser.add_argument("--out", type=Path, help="a folder for each kernel's SASS and TTGIR")
    args = parser.parse_args(argv)
    if not available():
        raise SystemExit("needs Triton with its CUDA tools (ptxas, cuobjdump): pip install triton")
    for name in args.kernels:
        report = compile_report(name)
        print(f"{name}: {report.registers} registers, {report.shared} bytes of shared memory")
        for loop in report.loops:
            top = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(10))
            print(f"  loop: {loop.instructions} instructions, {loop.per_value:.2f} per value: {top}")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.sass").write_text(report.sass)
            (args.out / f"{name}.ttgir").write_text(report.ttgir)


if __name__ == "__main__":
    main()
