"""The fused Triton kernel of ``quantpatch_rht.rht_fake_quant``: Hadamard transform and NVFP4
quantization in one pass.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch_rht_kernels.py``; depends on
torch, triton and ``quantpatch_kernels`` (whose element arithmetic it shares). With
``TRITON_INTERPRET=1`` it runs on CPU tensors, which is how it is tested bit for bit against
the reference.

NVFP4's per-tensor scale needs the amax of the *transformed* tensor, which no single pass can
know before it has seen every block, so there are two launches: ``_rht_amax_kernel`` reads
the input, transforms each tile in registers and writes one maximum per tile (nothing else);
``_rht_nvfp4_kernel`` reads the input again, transforms it again (the same float32 steps, so
the same values), quantizes and writes the result once. The transformed tensor itself is never
stored. The butterfly is the reference's step for step: four stages of ``(a + b, a - b)`` on
the lowest index bit with the bits rotated right, then ``* SIGNS * 0.25``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .quantpatch_kernels import floor_log2, load_f32, pow2, round_nonneg, store_as

BLOCK_R, BLOCK_N = 16, 64


@triton.jit
def _transform(v, s, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """The documented butterfly on [BLOCK_R, BLOCK_N] float32 ``v`` (16-element blocks along
    the last axis), times the signs ``s`` (``[16]``, already times 0.25)."""
    nb: tl.constexpr = BLOCK_N // 16
    for _ in tl.static_range(4):
        pairs = tl.reshape(v, (BLOCK_R, nb, 8, 2))
        a, b = tl.split(pairs)
        both = tl.join(a + b, a - b)  # [BLOCK_R, nb, 8, 2]: the new bit last
        v = tl.reshape(tl.permute(both, (0, 1, 3, 2)), (BLOCK_R, BLOCK_N))  # the new bit first
    blocks = tl.reshape(v, (BLOCK_R, nb, 16)) * s[None, None, :]
    return tl.reshape(blocks, (BLOCK_R, BLOCK_N))


@triton.jit
def _load_tile(x_ptr, s_ptr, rows, n, sr, sn, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
               BF16: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (r[:, None] < rows) & (c[None, :] < n)  # beyond n: the zero padding
    offs = r[:, None].to(tl.int64) * sr + c[None, :].to(tl.int64) * sn
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    s = tl.load(s_ptr + tl.arange(0, 16))
    return _transform(load_f32(x, BF16), s, BLOCK_R, BLOCK_N), r, c


@triton.jit
def _rht_amax_kernel(x_ptr, s_ptr, part_ptr, rows, n, sr, sn, BLOCK_R: tl.constexpr,
                     BLOCK_N: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    t, _, _ = _load_tile(x_ptr, s_ptr, rows, n, sr, sn, BLOCK_R, BLOCK_N, BF16)
    a = tl.abs(t)
    mags = tl.where(a < float("inf"), a, 0.0)
    part = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(part_ptr + part, tl.max(tl.max(mags, axis=1), axis=0))


@triton.jit
def _rht_nvfp4_kernel(x_ptr, s_ptr, y_ptr, u_ptr, amax_ptr, rows, n, npad, sr, sn,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                      OUT_BF16: tl.constexpr, SR: tl.constexpr):  # fmt: skip
    v, r, c = _load_tile(x_ptr, s_ptr, rows, n, sr, sn, BLOCK_R, BLOCK_N, BF16)
    a = tl.abs(v)
    finite = a < float("inf")
    mags = tl.where(finite, a, 0.0)
    amax = tl.load(amax_ptr + tl.zeros((BLOCK_R, BLOCK_N), tl.int32))
    g = tl.math.div_rn(
        tl.full((BLOCK_R, BLOCK_N), 2688.0, tl.float32), tl.where(amax > 0, amax, 1.0)
    )
    g = tl.where(amax > 0, tl.minimum(g, 3.4028234663852886e38), 1.0)
    bmax = tl.max(tl.reshape(mags, (BLOCK_R, BLOCK_N // 16, 16)), axis=2)
    bmax = tl.reshape(tl.broadcast_to(bmax[:, :, None], (BLOCK_R, BLOCK_N // 16, 16)),
                      (BLOCK_R, BLOCK_N))  # fmt: skip
    six = tl.full((BLOCK_R, BLOCK_N), 6.0, tl.float32)
    s = round_nonneg(tl.math.div_rn(bmax, six) * g, 3, -6, 448.0)
    usable = finite & (s > 0)
    p = tl.where(usable, tl.math.div_rn(mags * g, tl.where(usable, s, 1.0)), 0.0)
    out_offs = r[:, None].to(tl.int64) * npad + c[None, :].to(tl.int64)
    inside = (r[:, None] < rows) & (c[None, :] < npad)
    if SR:
        u = tl.load(u_ptr + out_offs, mask=inside, other=0.0)
        pa = tl.minimum(p, 6.0)
        e = tl.where(pa < 1.0, 0, floor_log2(tl.where(pa < 1.0, 1.0, pa)))
        y = pa * pow2(1 - e)
        low = tl.floor(y)
        q = tl.minimum(tl.where(u < y - low, low + 1.0, low) * pow2(e - 1), 6.0)
    else:
        q = round_nonneg(p, 1, 0, 6.0)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    res = tl.where(finite, tl.math.div_rn(qs * s, g), v)
    tl.store(y_ptr + out_offs, store_as(res, y_ptr.dtype.element_ty, OUT_BF16), mask=inside)


def rht_nvfp4(
    x: torch.Tensor, dim: int, rand: torch.Tensor | None, signs: torch.Tensor
) -> torch.Tensor:
    """``quantpatch_rht.rht_fake_quant`` of ``x`` (``rand``: the draws, shaped as the result,
    or None for nearest even; ``signs``: the transform's sign vector, on ``x``'s device)."""
    t = x.movedim(dim, -1)
    n = t.shape[-1]
    t2 = t.reshape(-1, n)  # a view where the leading dimensions collapse, else a copy
    rows = t2.shape[0]
    npad = n + (-n) % 16
    bf16 = x.dtype == torch.bfloat16
    s = signs.to(torch.float32) * 0.25
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(npad, BLOCK_N))
    parts = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    sr, sn = t2.stride()
    _rht_amax_kernel[grid](t2, s, parts, rows, n, sr, sn, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
                           BF16=bf16)  # fmt: skip
    amax = parts.amax().reshape(1)
    y = torch.empty((rows, npad), dtype=x.dtype, device=x.device)
    u: Any = y  # unread without stochastic rounding
    if rand is not None:
        u = rand.to(torch.float32).movedim(dim, -1).reshape(rows, npad).contiguous()
    _rht_nvfp4_kernel[grid](
        t2, s, y, u, amax, rows, n, npad, sr, sn,
        BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BF16=bf16, OUT_BF16=bf16, SR=rand is not None,
    )  # fmt: skip
    return y.reshape(*t.shape[:-1], npad).movedim(-1, dim)
