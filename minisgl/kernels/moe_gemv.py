"""The mixture-of-experts MLP of a few tokens (decode) in two Triton kernels, routing included.

A decode step's work is reading the chosen experts' weights, not multiplying: here a step is two
kernels (`_gate_up_kernel`, `_down_kernel`) that compute the top-k themselves and read each chosen
expert's weights once, with no sort, gather or scatter, and nothing read on the host (CUDA graphs).
Routing weights and activations are rounded as `select_experts` and the grouped-GEMM path round them.
Experts in minisgl's packed layout (`PackedWeights`, 4- or 8-bit) are read packed and dequantized in
registers, as `minisgl.kernels.packed_gemm`'s GEMV does (`_packed_dot`).
Launch configurations: `MOE_GEMV_CONFIGS` (`python -m perf.gpu.moe_tune`). docs/tensor-parallel-and-moe.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minisgl.kernels.packed import PackedWeights

try:
    import triton
    import triton.language as tl

    from minisgl.kernels.packed_gemm import _packed_dot
except ImportError:  # CPU-only installs: the grouped GEMM path serves every batch
    triton = None

# tuned launch configurations, two tables: "gemv" (these kernels) and "grouped" (`moe_gemm`'s), each
# "E,2I,H,T" -> {"gate_up": [...], "down": [...]} for T tokens; written by `python -m perf.gpu.moe_tune`
CONFIG_FILE = Path(__file__).with_name("moe_gemv_configs.json")


def _load_configs() -> dict[str, dict[str, dict[str, list[int]]]]:
    return json.loads(CONFIG_FILE.read_text()) if CONFIG_FILE.exists() else {}


MOE_GEMV_CONFIGS = _load_configs()


def lookup_config(table: dict, num_experts: int, inter: int, hidden: int, tokens: int) -> dict | None:
    """The entry of `table` for this shape at the nearest token count at or above `tokens`, else at the
    largest tuned count; None when the shape was never tuned."""
    prefix = f"{num_experts},{2 * inter},{hidden},"
    tuned = sorted(
        (int(key.rsplit(",", 1)[1]), value) for key, value in table.items() if key.startswith(prefix)
    )
    for count, value in tuned:
        if count >= tokens:
            return value
    return tuned[-1][1] if tuned else None


Experts = torch.Tensor | PackedWeights


def moe_gemv_fits(x: torch.Tensor, w13: Experts, w2: Experts) -> bool:
    """True when the kernels can take these tensors (any token count): Triton present, one float dtype
    throughout (x's, for packed experts), contiguous expert weights."""
    tensors = [t for w in (w13, w2) for t in ((w,) if isinstance(w, torch.Tensor) else w[:3])]
    dense = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    return (
        triton is not None
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and (not dense or x.dtype == w13.dtype == w2.dtype)
        and all(t.is_contiguous() for t in tensors)
        and (x.is_cuda or x.device.type == "cpu")
    )


def _default_config(part: str, tokens: int, width: int, bits: int) -> list[int]:
    """[block_n, block_k, warps] of kernel `part` before tuning: a few output rows a program, the row
    (`width` columns) in 512-wide blocks; packed experts (`bits`), as tuned at Qwen3-30B-A3B's shapes:
    gate/up 8 rows (16 with the up rows), the whole row a step (to 2,048 columns); down 16 rows, 1,024
    columns a step, the pairs shared among 4 programs (a fourth entry: `_down_kernel`'s SPLIT)."""
    if bits:
        if part == "gate_up":
            return [8, min(2048, triton.next_power_of_2(width)), 4]
        return [16, min(1024, triton.next_power_of_2(width)), 4, 4]
    return [4 if tokens == 1 else 8, min(512, triton.next_power_of_2(width)), 4]


def moe_gemv_config(
    num_experts: int, inter: int, hidden: int, tokens: int, bits: int = 0
) -> dict[str, list[int]]:
    """The launch configuration of both kernels for this shape and token count (see `lookup_config`;
    table "gemv", or "gemv_q4" / "gemv_q8" for packed experts of `bits`), or the defaults. The down
    kernel's may name a fourth entry, its SPLIT (`_down_kernel`)."""
    table = MOE_GEMV_CONFIGS.get(f"gemv_q{bits}" if bits else "gemv", {})
    return lookup_config(table, num_experts, inter, hidden, tokens) or {
        "gate_up": _default_config("gate_up", tokens, hidden, bits),
        "down": _default_config("down", tokens, inter, bits),
    }


def packed_args(w: Experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """(weights or words, scales, zero points, bits, group) of the experts for the kernels: bits 0 and
    the weights themselves in place of scales and zero points for plain experts."""
    if isinstance(w, PackedWeights):
        return w.qweight, w.scales, w.zeros, w.bits, w.group
    return w, w, w, 0, 1


if triton is not None:

    @triton.jit
    def _logits(logits_ptr, E, BLOCK_E: tl.constexpr):
        """A token's router logits in float32 (-inf past E) and their offsets."""
        offs = tl.arange(0, BLOCK_E)
        return tl.load(logits_ptr + offs, mask=offs < E, other=float("-inf")).to(tl.float32), offs

    @triton.jit
    def _next_choice(rest, offs):
        """The best remaining expert (ties to the lower id) and its logit; it leaves `rest`."""
        best = tl.max(rest, axis=0)
        index = tl.argmax(rest, axis=0)
        return best, index, tl.where(offs == index, float("-inf"), rest)

    @triton.jit
    def _gate_up_kernel(
        x_ptr, logits_ptr, w13_ptr, s13_ptr, z13_ptr, act_ptr, E, x_stride, logits_stride,
        INTER: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """A block of gate and up rows of one (token, slot) pair's expert, SiLU(gate) * up stored. BITS 0:
        w13 (E, 2I, H) in x's dtype; else packed (words, scales and zero points: `PackedWeights`)."""
        block = tl.program_id(0)  # rows of the intermediate dimension
        pair = tl.program_id(1)  # token * TOP_K + slot
        token = pair // TOP_K
        slot = pair % TOP_K
        rest, offs = _logits(logits_ptr + token * logits_stride, E, BLOCK_E)
        expert = slot * 0
        for j in tl.static_range(TOP_K):
            _, index, rest = _next_choice(rest, offs)
            expert = tl.where(slot == j, index, expert)
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < INTER
        if BITS == 0:
            gate_at = w13_ptr + expert.to(tl.int64) * (2 * INTER * H) + rows.to(tl.int64)[:, None] * H
            acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in tl.static_range(0, H, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                mask = row_mask[:, None] & (cols < H)[None, :]
                x = tl.load(x_ptr + token * x_stride + cols, mask=cols < H, other=0.0).to(tl.float32)
                gate = tl.load(gate_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                up = tl.load(gate_at + INTER * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                acc_gate += gate * x[None, :]
                acc_up += up * x[None, :]
            gate = tl.sum(acc_gate, axis=1)
            up = tl.sum(acc_up, axis=1)
        else:  # the gate and up rows interleaved in one tile: one sweep of x for both
            KW: tl.constexpr = H * BITS // 32
            G: tl.constexpr = H // GROUP
            rows2 = tl.reshape(rows.to(tl.int64)[:, None] + tl.arange(0, 2)[None, :] * INTER, (2 * BLOCK_N,))
            groups_at = expert.to(tl.int64) * (2 * INTER * G)
            both = _packed_dot(
                w13_ptr + expert.to(tl.int64) * (2 * INTER * KW), s13_ptr + groups_at, z13_ptr + groups_at,
                rows2, tl.reshape(tl.broadcast_to(row_mask[:, None], (BLOCK_N, 2)), (2 * BLOCK_N,)),
                x_ptr + token * x_stride, KW, G, BITS, GROUP * BITS // 32, 2 * BLOCK_N, BLOCK_K * BITS // 32,
            )  # fmt: skip
            gate, up = tl.split(tl.reshape(both, (BLOCK_N, 2)))
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + pair * INTER + rows, act.to(act_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _down_kernel(
        act_ptr, logits_ptr, w2_ptr, s2_ptr, z2_ptr, out_ptr, E, logits_stride,
        INTER: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
        BITS: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """A block of hidden rows of one token: its TOP_K pairs' activations times their experts' down
        projection, weighted by the routing weights and summed. BITS as in `_gate_up_kernel`. SPLIT > 1:
        the pairs shared among SPLIT programs, each storing its float32 sum (out (T, SPLIT, H)), for
        more programs in flight at few tokens."""
        block = tl.program_id(0)  # rows of the hidden dimension
        token = tl.program_id(1) // SPLIT
        part = tl.program_id(1) % SPLIT
        logits, offs = _logits(logits_ptr + token * logits_stride, E, BLOCK_E)
        top = tl.max(logits, axis=0)
        norm = tl.sum(tl.exp(logits - top), axis=0)  # softmax over every expert
        if RENORMALIZE:  # over the chosen ones
            norm = norm * 0.0
            rest = logits
            for _ in tl.static_range(TOP_K):
                best, _index, rest = _next_choice(rest, offs)
                norm += tl.exp(best - top)
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < H
        if BITS == 0:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:  # the packed experts' sums go to `out` directly
            acc = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        KW: tl.constexpr = INTER * BITS // 32  # packed: words and groups of a row
        G: tl.constexpr = INTER // GROUP
        PER: tl.constexpr = TOP_K // SPLIT  # pairs a program
        rest = logits
        for j in tl.static_range(TOP_K):
            best, expert, rest = _next_choice(rest, offs)
            if j // PER == part:  # always, without a split
                # the routing weight rounded to the model's dtype, as `select_experts` returns it
                weight = (tl.exp(best - top) / norm).to(act_ptr.dtype.element_ty).to(tl.float32)
                a_at = act_ptr + (token * TOP_K + j) * INTER
                if BITS == 0:
                    w_at = w2_ptr + expert.to(tl.int64) * (H * INTER) + rows.to(tl.int64)[:, None] * INTER
                    for k0 in tl.static_range(0, INTER, BLOCK_K):
                        cols = k0 + tl.arange(0, BLOCK_K)
                        a = tl.load(a_at + cols, mask=cols < INTER, other=0.0).to(tl.float32) * weight
                        mask = row_mask[:, None] & (cols < INTER)[None, :]
                        w = tl.load(w_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                        acc += w * a[None, :]
                else:
                    groups_at = expert.to(tl.int64) * (H * G)
                    out += weight * _packed_dot(
                        w2_ptr + expert.to(tl.int64) * (H * KW), s2_ptr + groups_at, z2_ptr + groups_at,
                        rows.to(tl.int64), row_mask, a_at, KW, G, BITS, GROUP * BITS // 32, BLOCK_N,
                        BLOCK_K * BITS // 32,
                    )  # fmt: skip
        out += tl.sum(acc, axis=1)
        at = out_ptr + tl.program_id(1) * H + rows  # (token, part)
        tl.store(at, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def moe_gemv(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: Experts,
    w2: Experts,
    top_k: int,
    renormalize: bool,
    config: dict[str, list[int]] | None = None,
) -> torch.Tensor:
    """The MoE MLP of x (T, H) on the two kernels; shapes as in `BaseMoeBackend.forward`, the experts
    plain or packed (`PackedWeights`). `config` overrides the tuned launch configuration (the tuning
    script sweeps it)."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens == 0:
        return out
    w13_args, w2_args = packed_args(w13), packed_args(w2)
    bits = w13_args[3]
    config = config or moe_gemv_config(num_experts, inter, hidden, tokens, bits)
    act = x.new_empty(tokens * top_k, inter)
    block_e = triton.next_power_of_2(num_experts)
    n, k, warps = config["gate_up"]
    _gate_up_kernel[(triton.cdiv(inter, n), tokens * top_k)](
        x, router_logits, *w13_args[:3], act, num_experts, x.stride(0), router_logits.stride(0),
        INTER=inter, H=hidden, TOP_K=top_k, BITS=bits, GROUP=w13_args[4], BLOCK_E=block_e, BLOCK_N=n,
        BLOCK_K=k, num_warps=warps,
    )  # fmt: skip
    n, k, warps, *split = config["down"]
    split = split[0] if split and top_k % split[0] == 0 else 1
    partial = out if split == 1 else x.new_empty(tokens, split, hidden, dtype=torch.float32)
    _down_kernel[(triton.cdiv(hidden, n), tokens * split)](
        act, router_logits, *w2_args[:3], partial, num_experts, router_logits.stride(0),
        INTER=inter, H=hidden, TOP_K=top_k, RENORMALIZE=renormalize, BITS=bits, GROUP=w2_args[4],
        SPLIT=split, BLOCK_E=block_e, BLOCK_N=n, BLOCK_K=k, num_warps=warps,
    )  # fmt: skip
    return out if split == 1 else out.copy_(partial.sum(1))  # the float32 sums, rounded once
