"""Fused Triton kernels for the FP8 values of ``quantpatch_fp8.py`` (``fp8-tensor``,
``fp8-block`` and its weight tiles ``fp8-block-2d``): one pass per call, bit-identical to the
PyTorch reference (tested in Triton's interpreter, ``TRITON_INTERPRET=1``).

Installed by ``quantpatch init`` as ``megatron/core/quantpatch/quantpatch_fp8_kernels.py`` beside
``quantpatch_kernels.py``, whose exact float32 helpers (powers of two from their bits, floor
log2, bf16 loads and stores through their bits) it uses; ``quantpatch_quantize`` calls
:func:`fake_quant` here for CUDA tensors (``QUANTPATCH_KERNELS``).

* ``fp8-tensor``: one torch reduction takes the tensor's finite amax and derives the scale
  and its reciprocal exactly as the reference (a grid-wide maximum cannot be taken inside one
  pass); one elementwise kernel then rounds ``x * scale`` to E4M3 / E5M2 and multiplies by
  the reciprocal, walking the storage in order.
* ``fp8-block``: each program loads rows x (a multiple of 128) elements along the reduction
  dimension (read in place through the tensor's strides, as the MX kernel does), takes each
  1 x 128 block's amax and power-of-two scale (``div_rn``: the float32 quotient 448 / amax,
  57344 / amax for ``fp8-block-hybrid``'s E5M2 gradients, correctly rounded), rounds and
  stores once. ``fp8-block-2d``: one program per 128 x 128
  tile of the last two dimensions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import quantpatch_formats as formats
from .quantpatch_fp8 import FP8_BLOCK, finite_amax, tensor_scales
from .quantpatch_kernels import (
    as_3d,
    load_f32,
    non_overlapping_and_dense,
    pow2,
    pow2_exponent,
    round_nonneg,
    signed,
    storage_view,
    store_as,
)

_ELEMENTWISE_BLOCK = 2048


@triton.jit
def _fp8_tensor_kernel(
    x_ptr,
    y_ptr,
    s_ptr,
    numel,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    VMAX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BF16: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = offs < numel
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    scale = tl.load(s_ptr)
    scale_inv = tl.load(s_ptr + 1)
    v = load_f32(x, BF16)
    finite = tl.abs(v) < float("inf")
    p = tl.where(finite, v, 0.0) * scale  # the float32 product, rounded once
    q = signed(round_nonneg(tl.abs(p), MBITS, EMIN, VMAX), p)
    out = tl.where(finite, store_as(q * scale_inv, y_ptr.dtype.element_ty, BF16), x)
    tl.store(y_ptr + offs, out, mask=inside)


@triton.jit
def _fp8_block_kernel(
    x_ptr,
    y_ptr,
    rows,
    n,
    sb,
    sr,
    sn,
    BIG: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16: tl.constexpr,
    MBITS: tl.constexpr = 3,
    EMIN: tl.constexpr = -6,
    VMAX: tl.constexpr = 448.0,
):
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = pid_b * sb + r[:, None].to(tl.int64) * sr + c[None, :].to(tl.int64) * sn
    inside = (r[:, None] < rows) & (c[None, :] < n)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    v = load_f32(x, BF16)
    finite = tl.abs(v) < float("inf")
    clean = tl.where(finite, v, 0.0)
    blocks = tl.reshape(tl.abs(clean), (BLOCK_R, BLOCK_N // 128, 128))
    e = pow2_exponent(tl.max(blocks, axis=2), BIG, VMAX)  # [BLOCK_R, BLOCK_N // 128]
    e = tl.reshape(
        tl.broadcast_to(e[:, :, None], (BLOCK_R, BLOCK_N // 128, 128)), (BLOCK_R, BLOCK_N)
    )
    p = clean * pow2(e)  # exact
    q = signed(round_nonneg(tl.abs(p), MBITS, EMIN, VMAX), p)
    out = tl.where(finite, store_as(q * pow2(-e), y_ptr.dtype.element_ty, BF16), x)
    tl.store(y_ptr + offs, out, mask=inside)


@triton.jit
def _fp8_tile_kernel(
    x_ptr,
    y_ptr,
    rows,
    cols,
    BIG: tl.constexpr,
    TILE: tl.constexpr,
    BF16: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One 128 x 128 tile of a contiguous ``[batch, rows, cols]`` tensor per program, read in
    chunks of CHUNK rows twice (its amax, then its elements): a whole tile in registers took
    all of them and spilled, and so did the chunks unrolled (``tl.static_range``: ptxas
    hoisted their loads), so both passes are loops."""
    pid_b = tl.program_id(2).to(tl.int64)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    amax = tl.zeros((1,), tl.float32)
    for i in range(0, TILE, CHUNK):
        r = tl.program_id(0) * TILE + i + tl.arange(0, CHUNK)
        offs = pid_b * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        v = load_f32(tl.load(x_ptr + offs, mask=inside, other=0.0), BF16)
        clean = tl.where(tl.abs(v) < float("inf"), v, 0.0)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(clean), axis=1), axis=0))
    e = pow2_exponent(amax, BIG)  # [1]
    for i in range(0, TILE, CHUNK):
        r = tl.program_id(0) * TILE + i + tl.arange(0, CHUNK)
        offs = pid_b * rows * cols + r[:, None].to(tl.int64) * cols + c[None, :]
        inside = (r[:, None] < rows) & (c[None, :] < cols)
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        v = load_f32(x, BF16)
        finite = tl.abs(v) < float("inf")
        clean = tl.where(finite, v, 0.0)
        p = clean * pow2(e[:, None])
        q = signed(round_nonneg(tl.abs(p), 3, -6, 448.0), p)
        out = tl.where(finite, store_as(q * pow2(-e[:, None]), y_ptr.dtype.element_ty, BF16), x)
        tl.store(y_ptr + offs, out, mask=inside)


def codes(x: torch.Tensor, scale: torch.Tensor, elem: formats.Element) -> torch.Tensor:
    """``quantpatch_fp8.tensor_codes`` in one kernel: the codes of ``x`` under the float32
    per-tensor ``scale`` (the tensor kernel with a reciprocal of 1), in ``x``'s dtype."""
    if x.numel() == 0:
        return x.clone()
    if x.dim() == 0:
        return codes(x.reshape(1), scale, elem).reshape(())
    if not non_overlapping_and_dense(x):
        x = x.contiguous()
    y = torch.empty_like(x)
    if y.stride() != x.stride():
        x = x.contiguous()
        y = torch.empty_like(x)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    scales = torch.stack([scale.reshape(()).to(torch.float32), one])
    numel = x.numel()
    mbits, emin, vmax, _ = elem
    _fp8_tensor_kernel[(triton.cdiv(numel, _ELEMENTWISE_BLOCK),)](
        storage_view(x), storage_view(y), scales, numel,
        MBITS=mbits, EMIN=emin, VMAX=vmax, BLOCK_SIZE=_ELEMENTWISE_BLOCK,
        BF16=x.dtype == torch.bfloat16,
    )  # fmt: skip
    return y


def fake_quant(x: torch.Tensor, fmt: str, dim: int = -1, backward: bool = False) -> torch.Tensor:
    """``quantpatch_fp8.fp8_quantize`` in one kernel (``fmt`` of the fp8-tensor and fp8-block
    families, fp8-block-2d included)."""
    if x.numel() == 0:
        return x.clone()
    if x.dim() == 0:
        return fake_quant(x.reshape(1), fmt, 0, backward).reshape(())
    if not non_overlapping_and_dense(x):
        x = x.contiguous()
    bf16 = x.dtype == torch.bfloat16
    big = float(torch.finfo(x.dtype).max)
    spec = formats.spec_of(fmt)
    if spec.family == "fp8-tensor":
        y = torch.empty_like(x)
        if y.stride() != x.stride():
            x = x.contiguous()
            y = torch.empty_like(x)
        mbits, emin, vmax, _ = formats.ELEMENTS[str(spec.grad_output if backward else spec.input)]
        scale, scale_inv = tensor_scales(finite_amax(x), vmax, x.dtype)
        scales = torch.stack([scale.reshape(()), scale_inv.reshape(())]).to(torch.float32)
        numel = x.numel()
        grid = (triton.cdiv(numel, _ELEMENTWISE_BLOCK),)
        _fp8_tensor_kernel[grid](
            storage_view(x), storage_view(y), scales, numel,
            MBITS=mbits, EMIN=emin, VMAX=vmax, BLOCK_SIZE=_ELEMENTWISE_BLOCK, BF16=bf16,
        )  # fmt: skip
        return y
    if spec.family == "fp8-block" and spec.tiled and x.dim() >= 2:
        xc = x.contiguous()
        y = torch.empty_like(xc)
        rows, cols = xc.shape[-2:]
        batch = xc.numel() // max(1, rows * cols)
        grid2 = (triton.cdiv(rows, FP8_BLOCK), triton.cdiv(cols, FP8_BLOCK), batch)
        _fp8_tile_kernel[grid2](
            xc, y, rows, cols, BIG=big, TILE=FP8_BLOCK, BF16=bf16, CHUNK=32, num_warps=4
        )
        return y
    if spec.family != "fp8-block":
        raise ValueError(f"not an FP8 format: {fmt!r}")
    x, (b, rows, n), (sb, sr, sn) = as_3d(x, dim if x.dim() > 1 or not spec.tiled else -1)
    y = torch.empty_like(x)
    if y.stride() != x.stride():
        x = x.contiguous()
        x, (b, rows, n), (sb, sr, sn) = as_3d(x, dim)
        y = torch.empty_like(x)
    block_r, block_n = (8, 256) if sn == 1 else (32, 128)

    grid3 = (triton.cdiv(rows, block_r), triton.cdiv(n, block_n), b)
    mbits, emin, vmax, _ = formats.ELEMENTS[str(spec.grad_output if backward else spec.input)]
    _fp8_block_kernel[grid3](
        x, y, rows, n, sb, sr, sn, BIG=big, BLOCK_R=block_r, BLOCK_N=block_n, BF16=bf16,
        MBITS=mbits, EMIN=emin, VMAX=vmax,
    )  # fmt: skip
    return y
