"""Fused Triton kernels for ``quantpatch_ops.fake_quant``: one pass per call for every format.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch_kernels.py`` beside
``quantpatch_ops.py``, which calls :func:`fake_quant` here for CUDA tensors (unless
``QUANTPATCH_KERNELS=reference``). Depends on torch and triton only; triton ships with CUDA
builds of torch. With ``TRITON_INTERPRET=1`` set before import the same kernels run on CPU
tensors (Triton's interpreter), which is how they are tested bit for bit against the
PyTorch reference without a GPU.

* MX (``mxfp8`` E4M3 forward / E5M2 backward, ``mxfp4`` E2M1): one kernel. Each program loads
  a tile of rows x (a multiple of 32) elements along the reduction dimension, takes each
  block's amax, derives the E8M0 scale, rounds (nearest even) and saturates each element and
  multiplies the scale back, all in registers, and stores once. The tensor is addressed
  through its own strides as ``[batch, rows, reduction]``, so a transposed operand (Megatron's
  ``key.transpose(0, 1).transpose(1, 2)``) is read in place, never copied; the output has the
  input's strides.
* ``hifp8``: per tensor with no scale, so one elementwise kernel over the storage.
* NVFP4 (``nvfp4``, ``nvfp4-2d``): one kernel like the MX one, blocks of 16 along the
  reduction dimension (or 16 x 16 tiles of the last two dimensions of the contiguous tensor),
  E4M3 block scales and the per-tensor scale from the tensor's amax, which one torch
  reduction computes before the launch (a grid-wide maximum cannot be taken inside one
  pass). The divisions are ``div_rn`` (correctly rounded, as PyTorch's); stochastic
  rounding (``backward``) reads the caller's uniforms, laid out with the input's strides.

The arithmetic mirrors the reference step for step on exact float32 values (powers of two are
built from their bits; rounding is floor plus an exact remainder test, not a library call), so
results are bit-identical, NaN/Inf pass through and signed zeros keep their sign.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

# element type: (mantissa bits, minimum normal exponent, largest normal, emax_elem), as in
# quantpatch_ops
_ELEMENTS = {"e4m3": (3, -6, 448.0, 8), "e5m2": (2, -14, 57344.0, 15), "e2m1": (1, 0, 6.0, 2)}
BLOCK = 32


@triton.jit
def _floor_log2(a):
    """floor(log2(a)) for finite a > 0 (float32), as int32, subnormals included."""
    bits = a.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    # a subnormal: scale it by 2^24 (exact) and read the exponent of that
    sub = (tl.where(biased == 0, a, 0.0) * 16777216.0).to(tl.int32, bitcast=True)
    return tl.where(biased == 0, ((sub >> 23) & 0xFF) - 127 - 24, biased - 127)


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e in [-149, 127], built from its bits (subnormals too)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    shift = tl.minimum(tl.maximum(e + 149, 0), 22)
    subnormal = (tl.full(e.shape, 1, tl.int32) << shift).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, subnormal)


@triton.jit
def _load_f32(x, BF16: tl.constexpr):
    """``x`` as float32; bf16 widened through its bits (exact for subnormals too, where the
    interpreter's own conversion is not)."""
    if BF16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _store_as(v, dtype: tl.constexpr, BF16: tl.constexpr):
    """Finite float32 ``v`` rounded to the output dtype (nearest even); bf16 through its bits."""
    if BF16:
        u = v.to(tl.int32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _round_half_even(y):
    """Round y >= 0 (y < 2^22) to the nearest integer, ties to even, exactly."""
    f = tl.floor(y)
    d = y - f  # exact
    odd = (f.to(tl.int32) & 1) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _mx_kernel(
    x_ptr,
    y_ptr,
    rows,
    n,
    sb,
    sr,
    sn,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    VMAX: tl.constexpr,
    EMAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = pid_b * sb + r[:, None].to(tl.int64) * sr + c[None, :].to(tl.int64) * sn
    inside = (r[:, None] < rows) & (c[None, :] < n)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    v = _load_f32(x, BF16)
    a = tl.abs(v)
    finite = a < float("inf")  # False for +-Inf and NaN
    mags = tl.where(finite, a, 0.0)
    blocks = tl.reshape(mags, (BLOCK_R, BLOCK_N // 32, 32))
    amax = tl.max(blocks, axis=2)  # [BLOCK_R, BLOCK_N // 32]
    nonzero = amax > 0
    shared = tl.where(nonzero, _floor_log2(tl.where(nonzero, amax, 1.0)) - EMAX, -127)
    shared = tl.minimum(tl.maximum(shared, -127), 127)
    shared = tl.reshape(
        tl.broadcast_to(shared[:, :, None], (BLOCK_R, BLOCK_N // 32, 32)), (BLOCK_R, BLOCK_N)
    )
    scale = _pow2(shared)
    inv_scale = _pow2(-shared)  # exact: -shared in [-127, 127]
    p = tl.abs(tl.where(finite, v, 0.0) * inv_scale)  # == |v / scale|, correctly rounded
    tiny = p < _pow2(tl.full(p.shape, EMIN, tl.int32))
    e = tl.where(tiny, EMIN, _floor_log2(tl.where(tiny, 1.0, p)))
    y = p * _pow2(MBITS - e)  # exact: p / quantum
    q = tl.minimum(_round_half_even(y) * _pow2(e - MBITS), VMAX)
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # copysign(q, v): -0 stays -0
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    # +-Inf and NaN are stored as they were loaded (never converted: the payload is kept)
    out = tl.where(finite, _store_as(qs * scale, y_ptr.dtype.element_ty, BF16), x)
    tl.store(y_ptr + offs, out, mask=inside)


@triton.jit
def _hifp8_kernel(x_ptr, y_ptr, numel, BLOCK_SIZE: tl.constexpr, BF16: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = offs < numel
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    v = _load_f32(x, BF16)
    a = tl.abs(v)
    positive = (a < float("inf")) & (a > 0)
    e = _floor_log2(tl.where(positive, a, 1.0))
    ae = tl.abs(e)
    mbits = tl.where(ae <= 3, 3, tl.where(ae <= 7, 2, tl.where(ae <= 15, 1, 0)))
    k = tl.minimum(mbits - e, 127)  # lanes with e < -22 overflow here and are replaced below
    q = tl.floor(a * _pow2(k) + 0.5) * _pow2(tl.maximum(e - mbits, -149))  # ties away
    q = tl.where(e < -22, tl.where(a >= 1.1920928955078125e-07, 2.384185791015625e-07, 0.0), q)
    q = tl.minimum(q, 32768.0)  # saturate: the code above 2^15 is infinity
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    out = tl.where(positive, _store_as(qs, y_ptr.dtype.element_ty, BF16), x)  # 0, Inf, NaN as is
    tl.store(y_ptr + offs, out, mask=inside)


@triton.jit
def _round_nonneg(p, MBITS: tl.constexpr, EMIN: tl.constexpr, VMAX: tl.constexpr):
    """Finite ``p`` >= 0 rounded to the element type (nearest even), saturating at VMAX."""
    tiny = p < _pow2(tl.full(p.shape, EMIN, tl.int32))
    e = tl.where(tiny, EMIN, _floor_log2(tl.where(tiny, 1.0, p)))
    y = p * _pow2(MBITS - e)  # exact: p / quantum
    return tl.minimum(_round_half_even(y) * _pow2(e - MBITS), VMAX)


@triton.jit
def _nvfp4_kernel(
    x_ptr,
    y_ptr,
    u_ptr,
    amax_ptr,
    rows,
    n,
    sb,
    sr,
    sn,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16: tl.constexpr,
    TWO_D: tl.constexpr,
    SR: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = pid_b * sb + r[:, None].to(tl.int64) * sr + c[None, :].to(tl.int64) * sn
    inside = (r[:, None] < rows) & (c[None, :] < n)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    v = _load_f32(x, BF16)
    a = tl.abs(v)
    finite = a < float("inf")  # False for +-Inf and NaN
    mags = tl.where(finite, a, 0.0)
    # the tensor's scale g = 448 * 6 / amax (1 for amax 0, at most the float32 maximum)
    amax = tl.load(amax_ptr + tl.zeros((BLOCK_R, BLOCK_N), tl.int32))
    g = tl.math.div_rn(
        tl.full((BLOCK_R, BLOCK_N), 2688.0, tl.float32), tl.where(amax > 0, amax, 1.0)
    )
    g = tl.where(amax > 0, tl.minimum(g, 3.4028234663852886e38), 1.0)
    if TWO_D:
        tiles = tl.reshape(mags, (BLOCK_R // 16, 16, BLOCK_N // 16, 16))
        bmax = tl.max(tl.max(tiles, axis=3), axis=1)  # [BLOCK_R // 16, BLOCK_N // 16]
        bmax = tl.broadcast_to(bmax[:, None, :, None], (BLOCK_R // 16, 16, BLOCK_N // 16, 16))
    else:
        bmax = tl.max(tl.reshape(mags, (BLOCK_R, BLOCK_N // 16, 16)), axis=2)
        bmax = tl.broadcast_to(bmax[:, :, None], (BLOCK_R, BLOCK_N // 16, 16))
    bmax = tl.reshape(bmax, (BLOCK_R, BLOCK_N))
    six = tl.full((BLOCK_R, BLOCK_N), 6.0, tl.float32)
    s = _round_nonneg(tl.math.div_rn(bmax, six) * g, 3, -6, 448.0)  # the block's E4M3 scale
    usable = finite & (s > 0)
    p = tl.where(usable, tl.math.div_rn(mags * g, tl.where(usable, s, 1.0)), 0.0)
    if SR:
        u = tl.load(u_ptr + offs, mask=inside, other=0.0)
        pa = tl.minimum(p, 6.0)
        e = tl.where(pa < 1.0, 0, _floor_log2(tl.where(pa < 1.0, 1.0, pa)))
        y = pa * _pow2(1 - e)  # exact: pa / quantum
        low = tl.floor(y)
        q = tl.minimum(tl.where(u < y - low, low + 1.0, low) * _pow2(e - 1), 6.0)
    else:
        q = _round_nonneg(p, 1, 0, 6.0)
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # copysign(q, v): -0 stays -0
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    res = tl.math.div_rn(qs * s, g)
    out = tl.where(finite, _store_as(res, y_ptr.dtype.element_ty, BF16), x)
    tl.store(y_ptr + offs, out, mask=inside)


def _nvfp4(
    x: torch.Tensor, two_d: bool, dim: int, y: torch.Tensor, rand: torch.Tensor | None
) -> torch.Tensor:
    """NVFP4 of dense ``x`` into ``y`` (``empty_like(x)``): blocks along ``dim``, or tiles."""
    bf16 = x.dtype == torch.bfloat16
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax()
    amax = amax.to(torch.float32).reshape(1)
    if two_d:
        x = x.contiguous()
        y = torch.empty_like(x)
        rows, n = x.shape[-2], x.shape[-1]
        b, sb, sr, sn = x.numel() // (rows * n), rows * n, n, 1
        block_r, block_n = 32, 64
    else:
        x, (b, rows, n), (sb, sr, sn) = _as_3d(x, dim)
        if y.stride() != x.stride():
            y = torch.empty_like(x)
        block_r, block_n = _tiles(sn)
    u = x  # unread without stochastic rounding
    if rand is not None:  # the draws laid out like x, so they are read at x's offsets
        u = torch.empty_like(x, dtype=torch.float32)
        u.copy_(rand)
        if u.stride() != x.stride():
            raise AssertionError("uniforms laid out unlike the input")
    grid = (triton.cdiv(rows, block_r), triton.cdiv(n, block_n), b)
    _nvfp4_kernel[grid](
        x, y, u, amax, rows, n, sb, sr, sn,
        BLOCK_R=block_r, BLOCK_N=block_n, BF16=bf16, TWO_D=two_d, SR=rand is not None,
    )  # fmt: skip
    return y


def _as_3d(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """``x`` (possibly made contiguous) and a ``[batch, rows, n]`` view of it as sizes and
    strides, ``n`` the extent of ``dim``: read in place whenever the leading dimensions
    collapse to two."""
    for attempt in range(2):
        t = x.movedim(dim, -1)
        n, sn = t.shape[-1], t.stride(-1)
        lead = [(s, st) for s, st in zip(t.shape[:-1], t.stride()[:-1], strict=True) if s != 1]
        merged: list[tuple[int, int]] = []
        for size, stride in lead:  # merge a dimension into the one before when they are dense
            if merged and merged[-1][1] == size * stride:
                merged[-1] = (merged[-1][0] * size, stride)
            else:
                merged.append((size, stride))
        if len(merged) <= 2:
            merged = [(1, 0)] * (2 - len(merged)) + merged
            (b, sb), (rows, sr) = merged
            return x, [b, rows, n], [sb, sr, sn]
        if attempt == 0:
            x = x.contiguous()
    raise AssertionError("a contiguous tensor always collapses to [batch, rows, n]")


def _tiles(sn: int) -> tuple[int, int]:
    # reduction contiguous in memory: wide rows of blocks; strided: many rows of one block
    return (8, 256) if sn == 1 else (64, 32)


def fake_quant(
    x: torch.Tensor,
    fmt: str,
    dim: int = -1,
    backward: bool = False,
    rand: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quantpatch_ops.fake_quant`` in one kernel (``fmt`` in mxfp8, mxfp4, hifp8, nvfp4,
    nvfp4-2d; ``rand``: the uniforms of NVFP4's stochastic rounding, the shape of ``x``)."""
    if x.numel() == 0:
        return x.clone()
    if not _non_overlapping_and_dense(x):
        x = x.contiguous()
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty_like(x)  # the input's strides (it is dense and does not overlap itself)
    if y.stride() != x.stride():
        x = x.contiguous()
        y = torch.empty_like(x)
    if fmt == "hifp8":
        numel = x.numel()
        # the same strides in and out: the elementwise pass walks storage order
        _hifp8_kernel[(triton.cdiv(numel, 4096),)](
            _storage_view(x), _storage_view(y), numel, BLOCK_SIZE=4096, BF16=bf16
        )
        return y
    if x.dim() == 0:  # a scalar is a block of one
        r = None if rand is None else rand.reshape(1)
        return fake_quant(x.reshape(1), fmt, 0, backward, r).reshape(())
    if fmt in ("nvfp4", "nvfp4-2d"):
        two_d = fmt == "nvfp4-2d" and x.dim() >= 2
        return _nvfp4(x, two_d, dim, y, rand if backward else None)
    elem = _ELEMENTS["e2m1" if fmt == "mxfp4" else "e5m2" if backward else "e4m3"]
    x, (b, rows, n), (sb, sr, sn) = _as_3d(x, dim)
    if y.stride() != x.stride():
        y = torch.empty_like(x)
    block_r, block_n = _tiles(sn)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(n, block_n), b)
    mbits, emin, vmax, emax = elem
    _mx_kernel[grid](
        x, y, rows, n, sb, sr, sn,
        MBITS=mbits, EMIN=emin, VMAX=vmax, EMAX=emax, BLOCK_R=block_r, BLOCK_N=block_n, BF16=bf16,
    )  # fmt: skip
    return y


def _non_overlapping_and_dense(x: torch.Tensor) -> bool:
    dims = sorted((st, s) for s, st in zip(x.shape, x.stride(), strict=True) if s != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _storage_view(x: torch.Tensor) -> Any:
    """The dense storage of ``x`` as a flat tensor in memory order (no copy)."""
    return x.as_strided((x.numel(),), (1,), x.storage_offset())
