"""Speculative decoding's two small device steps around a verify forward, each one Triton program per
request on a GPU (instead of about 40 PyTorch launches of host time at batch one) and PyTorch elsewhere:
`accept` (the accepted drafts, the next token to `last_tokens`, the shift by page-table row) and `move`
(a pending verify batch built on the guess that every draft was accepted, moved to what was; returns
(B,) and (T,) shifts for the attention plan). Both take the layout as (B,) `ext` (each request's rows:
drafts + 1), `starts` and `table_idx`, on the device. docs/speculative.md.
"""

from __future__ import annotations

import torch

from minisgl.kernels.decode_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _accept_kernel(
        tokens_ptr, ids_ptr, ext_ptr, starts_ptr, rows_ptr, last_ptr, shift_ptr, WIDTH: tl.constexpr
    ):
        b = tl.program_id(0)
        n = tl.load(ext_ptr + b)
        s = tl.load(starts_ptr + b)
        row = tl.load(rows_ptr + b)
        j = tl.arange(0, WIDTH)
        drafted = j < n - 1
        sampled = tl.load(tokens_ptr + s + j, mask=j < n, other=0)
        draft = tl.load(ids_ptr + s + j + 1, mask=drafted, other=0)
        # the first row whose token is not the draft after it (the last row has none): the accepted count
        a = tl.min(tl.where(drafted & (sampled == draft), WIDTH, j), 0)
        tl.store(last_ptr + row, tl.load(tokens_ptr + s + a).to(last_ptr.dtype.element_ty))
        tl.store(shift_ptr + row, (a - (n - 1)).to(shift_ptr.dtype.element_ty))

    @triton.jit
    def _move_kernel(
        ids_ptr,
        pos_ptr,
        loc_ptr,
        offs_ptr,
        req_shift_ptr,
        tok_shift_ptr,
        ext_ptr,
        starts_ptr,
        rows_ptr,
        last_ptr,
        shift_ptr,
        table_ptr,
        stride_table,
        HAS_OFFS: tl.constexpr,
        WIDTH: tl.constexpr,
    ):
        b = tl.program_id(0)
        n = tl.load(ext_ptr + b)
        s = tl.load(starts_ptr + b)
        row = tl.load(rows_ptr + b).to(tl.int64)
        sh = tl.load(shift_ptr + row)
        j = tl.arange(0, WIDTH)
        m = j < n
        pos = tl.load(pos_ptr + s + j, mask=m, other=0) + sh
        tl.store(pos_ptr + s + j, pos, mask=m)
        loc = tl.load(table_ptr + row * stride_table + pos, mask=m, other=0)
        tl.store(loc_ptr + s + j, loc.to(loc_ptr.dtype.element_ty), mask=m)
        tl.store(tok_shift_ptr + s + j, tl.zeros([WIDTH], tl.int64) + sh, mask=m)
        if HAS_OFFS:
            tl.store(offs_ptr + s + j, tl.load(offs_ptr + s + j, mask=m, other=0) + sh, mask=m)
        tl.store(req_shift_ptr + b, sh)
        tl.store(ids_ptr + s, tl.load(last_ptr + row).to(ids_ptr.dtype.element_ty))


def _use_triton(device: torch.device, use_triton: bool | None) -> bool:
    return triton is not None and (device.type == "cuda" if use_triton is None else use_triton)


def accept(
    tokens: torch.Tensor,
    input_ids: torch.Tensor,
    ext: torch.Tensor,
    starts: torch.Tensor,
    table_idx: torch.Tensor,
    last_tokens: torch.Tensor,
    shift: torch.Tensor,
    width: int,
    use_triton: bool | None = None,
) -> None:
    """Accepts each request's drafts (see the module docstring); `width`: the most rows a request has.
    `use_triton` (None: on a GPU) picks the kernel."""
    if _use_triton(tokens.device, use_triton):
        _accept_kernel[(len(ext),)](
            tokens, input_ids, ext, starts, table_idx, last_tokens, shift, WIDTH=triton.next_power_of_2(width)
        )
        return
    j = torch.arange(width, device=tokens.device)
    at = starts[:, None] + torch.minimum(j, ext[:, None] - 1)  # (B, width): each request's rows
    sampled = tokens[at]
    drafts = input_ids[torch.clamp(at + 1, max=len(input_ids) - 1)]
    match = (sampled[:, :-1] == drafts[:, :-1]) & (j[:-1] < ext[:, None] - 1)
    accepted = match.to(torch.int64).cumprod(1).sum(1)
    last_tokens[table_idx] = sampled.gather(1, accepted[:, None])[:, 0].to(last_tokens.dtype)
    shift[table_idx] = accepted - (ext - 1)


def move(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    offsets: torch.Tensor | None,
    ext: torch.Tensor,
    starts: torch.Tensor,
    table_idx: torch.Tensor,
    last_tokens: torch.Tensor,
    shift: torch.Tensor,
    page_table: torch.Tensor,
    width: int,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves a pending verify batch in place (see the module docstring); returns each request's and
    each row's shift. `offsets`: the sampling positions of the rows, or None (greedy)."""
    if _use_triton(input_ids.device, use_triton):
        req_shift = torch.empty(len(ext), dtype=torch.int64, device=ext.device)
        tok_shift = torch.empty(len(positions), dtype=torch.int64, device=ext.device)
        _move_kernel[(len(ext),)](
            input_ids, positions, out_loc, positions if offsets is None else offsets, req_shift, tok_shift,
            ext, starts, table_idx, last_tokens, shift, page_table, page_table.stride(0),
            HAS_OFFS=offsets is not None, WIDTH=triton.next_power_of_2(width),
        )  # fmt: skip
        return req_shift, tok_shift
    req_shift = shift[table_idx]
    tok_req = torch.repeat_interleave(
        torch.arange(len(ext), device=ext.device), ext, output_size=len(positions)
    )
    tok_shift = req_shift[tok_req]
    input_ids[starts] = last_tokens[table_idx].to(input_ids.dtype)
    positions += tok_shift
    out_loc.copy_(page_table[table_idx[tok_req], positions])
    if offsets is not None:
        offsets += tok_shift
    return req_shift, tok_shift
