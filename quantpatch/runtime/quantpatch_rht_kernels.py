"""The fused Triton kernel of ``quantpatch_rht.rht_fake_quant``: Hadamard transform and NVFP4
quantization in one pass.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch/quantpatch_rht_kernels.py``;
depends on torch, triton and ``quantpatch_kernels`` (whose NVFP4 arithmetic, ``nv_fake_quant``, it
shares). With ``TRITON_INTERPRET=1`` it runs on CPU tensors, which is how it is tested bit for
bit against the reference.

NVFP4's per-tensor scale needs the amax of the *transformed* tensor, which no single pass can
know before it has seen every block, so there are two launches: ``_rht_amax_kernel`` reads
the input, transforms each tile in registers and writes one maximum per tile (nothing else);
``_rht_nvfp4_kernel`` reads the input again, transforms it again (the same float32 steps, so
the same values), quantizes and writes the result once. The transformed tensor itself is never
stored. The transform is the reference's step for step (TransformerEngine 2.20.2's): each
output ``sum_i v[i] * M[i, j]`` accumulated in float32 in index order from 0, then rounded to
the input's dtype (bf16: through its bits) before the amax and the cast. The length along the
reduction dimension is a multiple of 16 (``quantpatch_rht`` refuses another).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .quantpatch_kernels import load_f32, nv_fake_quant, store_as

BLOCK_R, BLOCK_N = 16, 64


@triton.jit
def _transform(v, m_ptr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """``v @ M`` for every 16-element block along the last axis of [BLOCK_R, BLOCK_N] float32
    ``v`` (``M``: 16 x 16 float32 at ``m_ptr``, row major), accumulated in index order."""
    nb: tl.constexpr = BLOCK_N // 16
    blocks = tl.reshape(v, (BLOCK_R, nb, 16))
    k = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_R, nb, 16), tl.float32)
    for i in tl.static_range(16):
        vi = tl.sum(tl.where(k[None, None, :] == i, blocks, 0.0), axis=2)  # exact: one term
        mi = tl.load(m_ptr + i * 16 + k)
        acc = acc + vi[:, :, None] * mi[None, None, :]  # the product is exact
    return tl.reshape(acc, (BLOCK_R, BLOCK_N))


@triton.jit
def _to_dtype(t, dtype: tl.constexpr, BF16: tl.constexpr):
    """Float32 ``t`` rounded to the input's dtype (nearest even) and widened back."""
    if BF16:
        return load_f32(store_as(t, dtype, BF16), BF16)
    else:
        return t.to(dtype).to(tl.float32)


@triton.jit
def _load_tile(x_ptr, m_ptr, rows, n, sr, sn, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
               BF16: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (r[:, None] < rows) & (c[None, :] < n)  # n is a multiple of 16: whole blocks
    offs = r[:, None].to(tl.int64) * sr + c[None, :].to(tl.int64) * sn
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    t = _transform(load_f32(x, BF16), m_ptr, BLOCK_R, BLOCK_N)
    return _to_dtype(t, x_ptr.dtype.element_ty, BF16), r, c


@triton.jit
def _rht_amax_kernel(x_ptr, m_ptr, part_ptr, rows, n, sr, sn, BLOCK_R: tl.constexpr,
                     BLOCK_N: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    t, _, _ = _load_tile(x_ptr, m_ptr, rows, n, sr, sn, BLOCK_R, BLOCK_N, BF16)
    a = tl.abs(t)
    mags = tl.where(a < float("inf"), a, 0.0)
    part = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(part_ptr + part, tl.max(tl.max(mags, axis=1), axis=0))


@triton.jit
def _rht_nvfp4_kernel(x_ptr, m_ptr, y_ptr, u_ptr, amax_ptr, rows, n, sr, sn,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                      SR: tl.constexpr, FACTORED: tl.constexpr):  # fmt: skip
    v, r, c = _load_tile(x_ptr, m_ptr, rows, n, sr, sn, BLOCK_R, BLOCK_N, BF16)
    a = tl.abs(v)
    finite = a < float("inf")
    mags = tl.where(finite, a, 0.0)
    amax = tl.load(amax_ptr + tl.zeros((BLOCK_R, BLOCK_N), tl.int32))
    bmax = tl.max(tl.reshape(mags, (BLOCK_R, BLOCK_N // 16, 16)), axis=2)
    bmax = tl.reshape(tl.broadcast_to(bmax[:, :, None], (BLOCK_R, BLOCK_N // 16, 16)),
                      (BLOCK_R, BLOCK_N))  # fmt: skip
    out_offs = r[:, None].to(tl.int64) * n + c[None, :].to(tl.int64)
    inside = (r[:, None] < rows) & (c[None, :] < n)
    u = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)  # unread without stochastic rounding
    if SR:
        u = tl.load(u_ptr + out_offs, mask=inside, other=0).to(tl.float32)
    res = nv_fake_quant(v, finite, bmax, amax, u, SR, FACTORED)
    tl.store(y_ptr + out_offs, store_as(res, y_ptr.dtype.element_ty, BF16), mask=inside)


def rht_nvfp4(
    x: torch.Tensor,
    dim: int,
    bits: torch.Tensor | None,
    matrix: torch.Tensor,
    amax_out: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """``quantpatch_rht.rht_fake_quant`` of ``x`` (``bits``: 8 random bits per element, shaped
    as ``x``, or None for nearest even; ``matrix``: the transform's ``M``, float32 16 x 16, on
    ``x``'s device); ``x.shape[dim]`` a multiple of 16. ``amax_out``: given, the values are
    code x block scale (the tensor's scale factored out) and the transformed tensor's amax is
    appended to it."""
    t = x.movedim(dim, -1)
    n = t.shape[-1]
    t2 = t.reshape(-1, n)  # a view where the leading dimensions collapse, else a copy
    rows = t2.shape[0]
    bf16 = x.dtype == torch.bfloat16
    m = matrix.to(torch.float32).contiguous()
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(n, BLOCK_N))
    parts = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    sr, sn = t2.stride()
    _rht_amax_kernel[grid](t2, m, parts, rows, n, sr, sn, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
                           BF16=bf16)  # fmt: skip
    amax = parts.amax().reshape(1)
    if amax_out is not None:
        amax_out.append(amax)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    u: Any = y  # unread without stochastic rounding
    if bits is not None:
        u = bits.to(torch.uint8).movedim(dim, -1).reshape(rows, n).contiguous()
    _rht_nvfp4_kernel[grid](
        t2, m, y, u, amax, rows, n, sr, sn,
        BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BF16=bf16, SR=bits is not None,
        FACTORED=amax_out is not None,
    )  # fmt: skip
    return y.reshape(*t.shape[:-1], n).movedim(-1, dim)
