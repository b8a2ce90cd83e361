"""Fused Triton kernels for ``quantpatch_ops.fake_quant``: one pass per call for every format.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch_kernels.py`` beside
``quantpatch_ops.py``, which calls :func:`fake_quant` here for CUDA tensors (unless
``QUANTPATCH_KERNELS=reference``). Depends on torch and triton only; triton ships with CUDA
builds of torch. With ``TRITON_INTERPRET=1`` set before import the same kernels run on CPU
tensors (Triton's interpreter), which is how they are tested bit for bit against the
PyTorch reference without a GPU.

* MX (every value of the spec's ``mx`` family: its element per direction, FLOOR or RCEIL
  scale rule): one kernel. Each program loads
  a tile of rows x (a multiple of 32) elements along the reduction dimension, takes each
  block's amax, derives the E8M0 scale (floor or RCEIL), rounds (nearest even) and saturates
  each element and multiplies the scale back, all in registers, and stores once. The tensor
  is addressed through its own strides as ``[batch, rows, reduction]``, so a transposed
  operand (Megatron's ``key.transpose(0, 1).transpose(1, 2)``) is read in place, never
  copied; the output has the input's strides.
* ``hifp8``: per tensor with no scale, so one elementwise kernel over the storage.
* NVFP4 (``nvfp4``, ``nvfp4-2d``): one kernel like the MX one, blocks of 16 along the
  reduction dimension (or 16 x 16 tiles of the last two dimensions of the contiguous tensor),
  E4M3 block scales and the per-tensor scale from the tensor's amax, which one torch
  reduction computes before the launch (a grid-wide maximum cannot be taken inside one
  pass). TransformerEngine 2.20.2's order of operations (``nv_fake_quant``); the divisions
  are ``div_rn`` (correctly rounded, as PyTorch's); stochastic rounding (``backward``) reads
  the caller's 8 random bits per element, laid out with the input's strides.
* The MX and HiF8 kernels are autotuned over a small fixed set of tiles, once per shape class
  (``_MX_CONFIGS``, ``_HIFP8_CONFIGS``); the interpreter runs the first of a layout.
* ``quant_gemm``: a GEMM that quantizes its operands in the tile loop in any of these formats
  and ``fp8-tensor`` / ``fp8-block`` (K-tiles of multiples of 32, of 128 for ``fp8-block``,
  so every block is whole in one tile; a weight's 128 x 128 or 16 x 16 tiles whole in its
  N-tile); ``quantpatch_ops`` chooses it or the separate kernels per shape
  (``QUANTPATCH_GEMM``).

The arithmetic mirrors the reference step for step on exact float32 values (powers of two are
built from their bits; rounding is floor plus an exact remainder test, not a library call), so
results are bit-identical, NaN/Inf pass through and signed zeros keep their sign.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import quantpatch_env as env
from . import quantpatch_formats as formats

FOUR_OVER_SIX = {f.name: (f.four_over_six, f.e4m3_max) for f in formats.SPECS if f.four_over_six}
"""NVFP4's 4over6 entries of the spec: (error metric, E4M3 bound)."""
# element type: (mantissa bits, minimum normal exponent, largest normal, emax_elem): the spec's
_ELEMENTS = formats.ELEMENTS
BLOCK = 32
# MX value: (forward element, gradient element, RCEIL scale rule), from the spec
MX_VALUES = {
    f.name: (str(f.input), str(f.grad_output), f.scale == "e8m0-rceil")
    for f in formats.SPECS
    if f.family == "mx"
}


# -- the configurations the fake-quant kernels are tuned over (issue 30) -----------------------
#
# A small fixed set per kernel, tried once per shape class on the first call of that class
# (``triton.autotune``; the winner is cached for the process) instead of one hard-coded tile.
# The shape class is (layout, ceil(log2(rows)), ceil(log2(reduction length))): a training run
# tunes a handful of times, never per call. The MX tiles depend on the layout: where the
# reduction dimension is contiguous (``sn == 1``, rows of an activation) the tiles are wide
# (few rows of many 32-element blocks); where it is strided (a weight or the key reduced along
# a leading dimension) they are tall (many rows of one or two blocks), so loads stay
# coalesced. In Triton's interpreter (``TRITON_INTERPRET=1``) only the first configuration of a
# layout runs (no timing there); ``tests/test_weight_cache_and_gemm.py`` runs every
# configuration in the interpreter bit for bit against the reference.
#
# (layout, BLOCK_R, BLOCK_N, num_warps); layout 1: reduction contiguous, 0: strided
_MX_CONFIGS = (
    (1, 8, 256, 4),
    (1, 16, 256, 8),
    (1, 4, 512, 4),
    (1, 32, 128, 4),
    (1, 16, 512, 8),
    (0, 64, 32, 4),
    (0, 128, 32, 8),
    (0, 32, 64, 4),
    (0, 64, 64, 8),
)
# HiF8 walks storage order: one layout. (layout, BLOCK_SIZE, num_warps)
_HIFP8_CONFIGS = ((1, 4096, 4), (1, 1024, 4), (1, 2048, 4), (1, 4096, 8), (1, 8192, 8))


def _interpreting() -> bool:
    return env.triton_interpret()


_LAYOUTS: dict[tuple[tuple[str, int], ...], int] = {}


def _configs(table: tuple[tuple[int, ...], ...], names: tuple[str, ...]) -> list[Any]:
    """``triton.Config`` objects of a table; each one's layout is kept in ``_LAYOUTS`` (by its
    tile sizes) for :func:`_prune_by_layout`."""
    out = []
    for layout, *sizes, warps in table:
        tiles = dict(zip(names, sizes, strict=True))
        _LAYOUTS[tuple(sorted(tiles.items()))] = layout
        out.append(triton.Config(tiles, num_warps=warps))
    return out


def layout_of(config: Any) -> int:
    """1 for a configuration made for a contiguous reduction, 0 for a strided one."""
    return _LAYOUTS[tuple(sorted(config.kwargs.items()))]


def shape_class(rows: int, n: int, sn: int) -> int:
    """The autotuning key of a ``[rows, n]`` problem (reduction stride ``sn``): the layout and
    the sizes rounded up to powers of two, packed into one integer."""
    return (int(sn == 1) << 16) | (max(rows - 1, 0).bit_length() << 8) | max(n - 1, 0).bit_length()


def _prune_by_layout(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    contiguous = int(named_args.get("sn", 1) == 1)
    kept = [c for c in configs if layout_of(c) == contiguous] or configs
    return kept[:1] if _interpreting() else kept


@triton.jit
def floor_log2(a):
    """floor(log2(a)) for finite a > 0 (float32), as int32, subnormals included."""
    bits = a.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    # a subnormal: scale it by 2^24 (exact) and read the exponent of that
    sub = (tl.where(biased == 0, a, 0.0) * 16777216.0).to(tl.int32, bitcast=True)
    return tl.where(biased == 0, ((sub >> 23) & 0xFF) - 127 - 24, biased - 127)


@triton.jit
def pow2(e):
    """2^e as float32 for int32 e in [-149, 127], built from its bits (subnormals too)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    shift = tl.minimum(tl.maximum(e + 149, 0), 22)
    subnormal = (tl.full(e.shape, 1, tl.int32) << shift).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, subnormal)


@triton.jit
def load_f32(x, BF16: tl.constexpr):
    """``x`` as float32; bf16 widened through its bits (exact for subnormals too, where the
    interpreter's own conversion is not)."""
    if BF16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def store_as(v, dtype: tl.constexpr, BF16: tl.constexpr):
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


@triton.autotune(
    configs=_configs(_MX_CONFIGS, ("BLOCK_R", "BLOCK_N")),
    key=["shape_class"],
    prune_configs_by={"early_config_prune": _prune_by_layout},
)
@triton.jit(do_not_specialize=["shape_class"])
def _mx_kernel(
    x_ptr,
    y_ptr,
    rows,
    n,
    sb,
    sr,
    sn,
    shape_class,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    VMAX: tl.constexpr,
    EMAX: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BF16: tl.constexpr,
    RCEIL: tl.constexpr = False,
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
    a = tl.abs(v)
    finite = a < float("inf")  # False for +-Inf and NaN
    mags = tl.where(finite, a, 0.0)
    blocks = tl.reshape(mags, (BLOCK_R, BLOCK_N // 32, 32))
    amax = tl.max(blocks, axis=2)  # [BLOCK_R, BLOCK_N // 32]
    if RCEIL:  # ceil(log2(amax / VMAX)) on the float32 quotient's bits
        descale = tl.math.div_rn(amax, tl.full(amax.shape, VMAX, tl.float32))
        nonzero = descale > 0
        d = tl.where(nonzero, descale, 1.0)
        f = floor_log2(d)
        shared = tl.where(nonzero, f + (d != pow2(f)).to(tl.int32), -127)
    else:
        nonzero = amax > 0
        shared = tl.where(nonzero, floor_log2(tl.where(nonzero, amax, 1.0)) - EMAX, -127)
    shared = tl.minimum(tl.maximum(shared, -127), 127)
    shared = tl.reshape(
        tl.broadcast_to(shared[:, :, None], (BLOCK_R, BLOCK_N // 32, 32)), (BLOCK_R, BLOCK_N)
    )
    scale = pow2(shared)
    inv_scale = pow2(-shared)  # exact: -shared in [-127, 127]
    if RCEIL:  # the smallest scale multiplies by 1 (TE's exp2f_rcp), the elements clamped
        inv_scale = tl.where(shared == -127, 1.0, inv_scale)
        p = tl.minimum(tl.abs(tl.where(finite, v, 0.0) * inv_scale), VMAX)
    else:
        p = tl.abs(tl.where(finite, v, 0.0) * inv_scale)  # == |v / scale|, correctly rounded
    tiny = p < pow2(tl.full(p.shape, EMIN, tl.int32))
    e = tl.where(tiny, EMIN, floor_log2(tl.where(tiny, 1.0, p)))
    y = p * pow2(MBITS - e)  # exact: p / quantum
    q = tl.minimum(_round_half_even(y) * pow2(e - MBITS), VMAX)
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # copysign(q, v): -0 stays -0
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    # +-Inf and NaN are stored as they were loaded (never converted: the payload is kept)
    out = tl.where(finite, store_as(qs * scale, y_ptr.dtype.element_ty, BF16), x)
    tl.store(y_ptr + offs, out, mask=inside)


@triton.autotune(
    configs=_configs(_HIFP8_CONFIGS, ("BLOCK_SIZE",)),
    key=["shape_class"],
    prune_configs_by={"early_config_prune": _prune_by_layout},
)
@triton.jit(do_not_specialize=["shape_class"])
def _hifp8_kernel(x_ptr, y_ptr, numel, shape_class, BLOCK_SIZE: tl.constexpr, BF16: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    inside = offs < numel
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    v = load_f32(x, BF16)
    a = tl.abs(v)
    positive = (a < float("inf")) & (a > 0)
    e = floor_log2(tl.where(positive, a, 1.0))
    ae = tl.abs(e)
    mbits = tl.where(ae <= 3, 3, tl.where(ae <= 7, 2, tl.where(ae <= 15, 1, 0)))
    k = tl.minimum(mbits - e, 127)  # lanes with e < -22 overflow here and are replaced below
    q = tl.floor(a * pow2(k) + 0.5) * pow2(tl.maximum(e - mbits, -149))  # ties away
    q = tl.where(e < -22, tl.where(a >= 1.1920928955078125e-07, 2.384185791015625e-07, 0.0), q)
    q = tl.minimum(q, 32768.0)  # saturate: the code above 2^15 is infinity
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    out = tl.where(positive, store_as(qs, y_ptr.dtype.element_ty, BF16), x)  # 0, Inf, NaN as is
    tl.store(y_ptr + offs, out, mask=inside)


@triton.jit
def round_nonneg(p, MBITS: tl.constexpr, EMIN: tl.constexpr, VMAX: tl.constexpr):
    """Finite ``p`` >= 0 rounded to the element type (nearest even), saturating at VMAX."""
    tiny = p < pow2(tl.full(p.shape, EMIN, tl.int32))
    e = tl.where(tiny, EMIN, floor_log2(tl.where(tiny, 1.0, p)))
    y = p * pow2(MBITS - e)  # exact: p / quantum
    return tl.minimum(_round_half_even(y) * pow2(e - MBITS), VMAX)


@triton.jit
def nv_fake_quant(v, finite, bmax, amax, u, SR: tl.constexpr):
    """NVFP4 of float32 ``v`` (``finite``: where it is; ``bmax``: each element's block
    maximum; ``amax``: the tensor's, broadcast; ``u``: 8 random bits per element as float32
    where ``SR``), dequantized to float32, in the reference's order (TE 2.20.2's; see
    ``quantpatch_nvfp4``): ``g = min(2688 / A, FLT_MAX)``, ``s = E4M3(min(b * (g * fl(1/6)),
    448))``, ``enc = min(1 / (s * fl(1 / g)), FLT_MAX)``, ``q = E2M1(clamp(x * enc, +-6))``
    negative iff ``x * enc < 0``, result ``q * (s * (A / 2688))``; non-finite ``v`` unchanged."""
    fmax = 3.4028234663852886e38
    one = tl.full(v.shape, 1.0, tl.float32)
    g = tl.where(amax > 0, tl.math.div_rn(one * 2688.0, tl.where(amax > 0, amax, 1.0)), fmax)
    g = tl.minimum(g, fmax)  # the division overflows for an amax below ~7.9e-36
    m = g * tl.math.div_rn(one, one * 6.0)
    s = round_nonneg(tl.minimum(bmax * m, 448.0), 3, -6, 448.0)  # the block's E4M3 scale
    sd = s * tl.math.div_rn(one, g)
    enc = tl.minimum(tl.math.div_rn(one, tl.where(sd > 0, sd, 1.0)), fmax)
    enc = tl.where(sd > 0, enc, fmax)
    scaled = tl.where(finite, v, 0.0) * enc
    p = tl.minimum(tl.abs(scaled), 6.0)
    if SR:  # 8 random bits: up iff r < floor(256 * fraction) (the hardware's cvt.rs)
        e = tl.where(p < 1.0, 0, floor_log2(tl.where(p < 1.0, 1.0, p)))
        y = p * pow2(1 - e)  # exact: p / quantum
        low = tl.floor(y)
        up = u < tl.floor((y - low) * 256.0)
        q = tl.minimum(tl.where(up, low + 1.0, low) * pow2(e - 1), 6.0)
    else:
        q = round_nonneg(p, 1, 0, 6.0)
    q = tl.where(scaled < 0, -q, q)
    dec = tl.math.div_rn(amax, one * 2688.0)
    return tl.where(finite, q * (s * dec), v)


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
    v = load_f32(x, BF16)
    a = tl.abs(v)
    finite = a < float("inf")  # False for +-Inf and NaN
    mags = tl.where(finite, a, 0.0)
    amax = tl.load(amax_ptr + tl.zeros((BLOCK_R, BLOCK_N), tl.int32))
    if TWO_D:
        tiles = tl.reshape(mags, (BLOCK_R // 16, 16, BLOCK_N // 16, 16))
        bmax = tl.max(tl.max(tiles, axis=3), axis=1)  # [BLOCK_R // 16, BLOCK_N // 16]
        bmax = tl.broadcast_to(bmax[:, None, :, None], (BLOCK_R // 16, 16, BLOCK_N // 16, 16))
    else:
        bmax = tl.max(tl.reshape(mags, (BLOCK_R, BLOCK_N // 16, 16)), axis=2)
        bmax = tl.broadcast_to(bmax[:, :, None], (BLOCK_R, BLOCK_N // 16, 16))
    bmax = tl.reshape(bmax, (BLOCK_R, BLOCK_N))
    u = tl.zeros((BLOCK_R, BLOCK_N), tl.float32)  # unread without stochastic rounding
    if SR:
        u = tl.load(u_ptr + offs, mask=inside, other=0).to(tl.float32)
    res = nv_fake_quant(v, finite, bmax, amax, u, SR)
    out = tl.where(finite, store_as(res, y_ptr.dtype.element_ty, BF16), x)
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
    if rand is not None:  # the random bits laid out like x, so they are read at x's offsets
        u = torch.empty_like(x, dtype=torch.uint8)
        u.copy_(rand)
        if u.stride() != x.stride():
            raise AssertionError("uniforms laid out unlike the input")
    grid = (triton.cdiv(rows, block_r), triton.cdiv(n, block_n), b)
    _nvfp4_kernel[grid](
        x, y, u, amax, rows, n, sb, sr, sn,
        BLOCK_R=block_r, BLOCK_N=block_n, BF16=bf16, TWO_D=two_d, SR=rand is not None,
    )  # fmt: skip
    return y


@triton.jit
def _nv4o6_load(x_ptr, base, r, kb, rows, n, sr, sn, K: tl.constexpr, BF16: tl.constexpr):
    """Element ``K`` of each block ``kb`` of rows ``r`` as float32 (0 where outside or not
    finite), where it was loaded from, and the loaded value."""
    c = kb * 16 + K
    offs = base + r[:, None].to(tl.int64) * sr + c[None, :].to(tl.int64) * sn
    inside = (r[:, None] < rows) & (c[None, :] < n)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    v = load_f32(x, BF16)
    finite = tl.abs(v) < float("inf")
    return tl.where(finite, v, 0.0), finite, offs, inside, x


@triton.jit
def _nv4o6_code(v, enc):
    """The signed E2M1 code of ``v * enc`` (clamped to +-6, nearest even)."""
    scaled = v * enc
    q = round_nonneg(tl.minimum(tl.abs(scaled), 6.0), 1, 0, 6.0)
    return tl.where(scaled < 0, -q, q)


@triton.jit
def _nv4o6_tree(e, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """Per-row errors ``[BLOCK_R, NB]`` summed per 16 rows in the CUDA warp's order (rows i
    and i + 8, then i + 4, i + 2, i + 1), each sum repeated over its 16 rows."""
    t = tl.reshape(e, (BLOCK_R // 16, 2, 8, NB))
    a, b = tl.split(tl.permute(t, (0, 2, 3, 1)))  # [T, 8, NB]: rows i, i + 8
    t = tl.reshape(a + b, (BLOCK_R // 16, 2, 4, NB))
    a, b = tl.split(tl.permute(t, (0, 2, 3, 1)))
    t = tl.reshape(a + b, (BLOCK_R // 16, 2, 2, NB))
    a, b = tl.split(tl.permute(t, (0, 2, 3, 1)))
    t = tl.reshape(a + b, (BLOCK_R // 16, 2, 1, NB))
    a, b = tl.split(tl.permute(t, (0, 2, 3, 1)))  # [T, 1, NB]
    return tl.reshape(tl.broadcast_to(a + b, (BLOCK_R // 16, 16, NB)), (BLOCK_R, NB))


@triton.jit
def _nvfp4_4over6_kernel(
    x_ptr,
    y_ptr,
    amax_ptr,
    rows,
    n,
    sb,
    sr,
    sn,
    DENOM: tl.constexpr,
    MSE: tl.constexpr,
    TWO_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NB: tl.constexpr,
    BF16: tl.constexpr,
):
    """4over6 (``quantpatch_nvfp4``'s order of operations) of ``[batch, rows, n]``: each
    program takes ``BLOCK_R`` rows of ``NB`` blocks of 16 and reads a block one element at a
    time, so that its errors add up in the block's order, as TE's reference sums them."""
    pid_b = tl.program_id(2).to(tl.int64)
    base = pid_b * sb
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1) * NB + tl.arange(0, NB)
    fmax = 3.4028234663852886e38
    one = tl.full((BLOCK_R, NB), 1.0, tl.float32)
    amax = tl.load(amax_ptr + tl.zeros((BLOCK_R, NB), tl.int32))
    bmax = tl.zeros((BLOCK_R, NB), tl.float32)
    for i in tl.static_range(16):
        v, _, _, _, _ = _nv4o6_load(x_ptr, base, r, kb, rows, n, sr, sn, i, BF16)
        bmax = tl.maximum(bmax, tl.abs(v))
    if TWO_D:  # the 16 x 16 tile's maximum
        bmax = tl.max(tl.reshape(bmax, (BLOCK_R // 16, 16, NB)), axis=1)
        bmax = tl.reshape(tl.broadcast_to(bmax[:, None, :], (BLOCK_R // 16, 16, NB)), (BLOCK_R, NB))
    g = tl.where(amax > 0, tl.math.div_rn(one * DENOM, tl.where(amax > 0, amax, 1.0)), fmax)
    g = tl.minimum(g, fmax)
    gd = tl.math.div_rn(one, g)
    b6 = tl.math.div_rn(bmax, one * 6.0) * g
    s4 = round_nonneg(tl.minimum(b6 * 1.5, 448.0), 3, -6, 448.0)
    s6 = round_nonneg(tl.minimum(b6, 448.0), 3, -6, 448.0)
    d4, d6 = s4 * gd, s6 * gd
    enc4 = tl.where(d4 > 0, tl.minimum(tl.math.div_rn(one, tl.where(d4 > 0, d4, 1.0)), fmax), fmax)
    enc6 = tl.where(d6 > 0, tl.minimum(tl.math.div_rn(one, tl.where(d6 > 0, d6, 1.0)), fmax), fmax)
    e4 = tl.zeros((BLOCK_R, NB), tl.float32)
    e6 = tl.zeros((BLOCK_R, NB), tl.float32)
    for i in tl.static_range(16):
        v, _, _, _, _ = _nv4o6_load(x_ptr, base, r, kb, rows, n, sr, sn, i, BF16)
        f4 = tl.math.div_rn((_nv4o6_code(v, enc4) * s4) * amax, one * DENOM) - v
        f6 = tl.math.div_rn((_nv4o6_code(v, enc6) * s6) * amax, one * DENOM) - v
        if MSE:
            e4 = e4 + f4 * f4
            e6 = e6 + f6 * f6
        else:
            e4 = e4 + tl.abs(f4)
            e6 = e6 + tl.abs(f6)
    if TWO_D:
        e4 = _nv4o6_tree(e4, BLOCK_R, NB)
        e6 = _nv4o6_tree(e6, BLOCK_R, NB)
    pick4 = e4 < e6  # ties (and NaN) map to 6
    s = tl.where(pick4, s4, s6)
    enc = tl.where(pick4, enc4, enc6)
    dec = s * tl.math.div_rn(amax, one * DENOM)
    for i in tl.static_range(16):
        v, finite, offs, inside, x = _nv4o6_load(x_ptr, base, r, kb, rows, n, sr, sn, i, BF16)
        res = _nv4o6_code(v, enc) * dec
        out = tl.where(finite, store_as(res, y_ptr.dtype.element_ty, BF16), x)
        tl.store(y_ptr + offs, out, mask=inside)


def _nvfp4_4over6(
    x: torch.Tensor, fmt: str, two_d: bool, dim: int, y: torch.Tensor
) -> torch.Tensor:
    """4over6 of dense ``x`` into ``y`` (``empty_like(x)``): blocks along ``dim``, or the
    16 x 16 tiles of the last two dimensions with their errors along ``dim``."""
    mode, bound = FOUR_OVER_SIX[fmt]
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax()
    amax = amax.to(torch.float32).reshape(1)
    if two_d:
        x = x.contiguous()
        y = torch.empty_like(x)
        r, c = x.shape[-2], x.shape[-1]
        b, sb = x.numel() // (r * c), r * c
        rows, n, sr, sn = (c, r, 1, c) if dim % x.dim() == x.dim() - 2 else (r, c, c, 1)
        block_r, nb = 16, 8
    else:
        x, (b, rows, n), (sb, sr, sn) = _as_3d(x, dim)
        if y.stride() != x.stride():
            y = torch.empty_like(x)
        block_r, nb = (16, 8) if sn == 1 else (64, 2)
    if _interpreting():  # the interpreter's cost is per operation: few, large programs
        block_r, nb = 128, 32
    grid = (triton.cdiv(rows, block_r), triton.cdiv(triton.cdiv(n, 16), nb), b)
    _nvfp4_4over6_kernel[grid](
        x, y, amax, rows, n, sb, sr, sn, DENOM=6.0 * bound, MSE=mode == "mse", TWO_D=two_d,
        BLOCK_R=block_r, NB=nb, BF16=x.dtype == torch.bfloat16, enable_fp_fusion=False,
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
    """``quantpatch_ops.fake_quant`` in one kernel (``fmt`` of the spec's MX, HiF8 or NVFP4
    families, ``nvfp4-rht`` aside; ``rand``: the 8 random bits per element (uint8) of NVFP4's
    stochastic rounding, the shape of ``x``)."""
    if x.numel() == 0:
        return x.clone()
    if not _non_overlapping_and_dense(x):
        x = x.contiguous()
    bf16 = x.dtype == torch.bfloat16
    y = torch.empty_like(x)  # the input's strides (it is dense and does not overlap itself)
    if y.stride() != x.stride():
        x = x.contiguous()
        y = torch.empty_like(x)
    spec = formats.spec_of(fmt)
    if spec.family == "hifp8":
        numel = x.numel()
        # the same strides in and out: the elementwise pass walks storage order
        _hifp8_kernel[lambda meta: (triton.cdiv(numel, meta["BLOCK_SIZE"]),)](
            _storage_view(x), _storage_view(y), numel, shape_class(1, numel, 1), BF16=bf16
        )
        return y
    if x.dim() == 0:  # a scalar is a block of one
        r = None if rand is None else rand.reshape(1)
        return fake_quant(x.reshape(1), fmt, 0, backward, r).reshape(())
    if fmt in FOUR_OVER_SIX and not (backward and rand is not None):
        return _nvfp4_4over6(x, fmt, spec.tiled and x.dim() >= 2, dim, y)
    if spec.family == "nvfp4" and not spec.rht:
        two_d = spec.tiled and x.dim() >= 2 and fmt not in FOUR_OVER_SIX
        return _nvfp4(x, two_d, dim, y, rand if backward else None)
    forward_elem, gradient_elem, rceil = MX_VALUES[fmt]
    elem = _ELEMENTS[gradient_elem if backward else forward_elem]
    x, (b, rows, n), (sb, sr, sn) = _as_3d(x, dim)
    if y.stride() != x.stride():
        y = torch.empty_like(x)

    def grid(meta: dict[str, Any]) -> tuple[int, int, int]:
        return (triton.cdiv(rows, meta["BLOCK_R"]), triton.cdiv(n, meta["BLOCK_N"]), b)

    mbits, emin, vmax, emax = elem
    _mx_kernel[grid](
        x, y, rows, n, sb, sr, sn, shape_class(b * rows, n, sn),
        MBITS=mbits, EMIN=emin, VMAX=vmax, EMAX=emax, BF16=bf16, RCEIL=rceil,
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


# the names quantpatch_fp8_kernels.py uses (nothing outside this module takes its private names)
as_3d = _as_3d
non_overlapping_and_dense = _non_overlapping_and_dense
storage_view = _storage_view


# -- a GEMM that quantizes its operands inside the tile loop (issue 30) ----------------------
#
# ``quant_gemm(a, b, ...)`` computes ``a @ b`` (batched or not) with each operand fake-quantized
# along the reduction dimension as its tiles are loaded: no quantized copy of either operand
# is written to memory. The K-tiles are multiples of 32 (128 where an operand is ``fp8-block``)
# and start at such multiples, so every block lies whole in one tile; the tail of K is loaded
# as zeros, exactly the reference's padding, so any K is handled. The per-tensor scale of
# ``fp8-tensor`` and NVFP4's tensor amax are computed before the launch and read by every
# tile; the quantized tile is the reference's value rounded to the operand's dtype (the same
# arithmetic as the fake-quant kernels, so the operands are bit-identical to ``fake_quant``'s);
# the products accumulate in float32 (float32 operands: ``input_precision="ieee"``, not TF32,
# as ``torch.matmul``'s default) and the result is rounded once to the output dtype. Only the
# order of the float32 sums differs from ``torch.matmul`` of the quantized operands.
#
# The tile loop re-quantizes an operand tile for every tile of the other dimension that reads
# it (A once per column of C tiles, B once per row), so whether this beats two fake-quant
# kernels plus a plain GEMM depends on the shape; ``quantpatch_ops`` measures both per shape.
#
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): a small fixed set tuned once per
# (M, N, K, operand kinds) on CUDA; in the interpreter the first that fits the kinds only. Each
# thread quantizes (BLOCK_M + BLOCK_N) * BLOCK_K / (32 * num_warps) elements per K-tile; at 64
# or fewer ptxas keeps them in registers (about 180 of 255), at 96 or more it spills
# (``benchmarks/kernel_resources.py``). The shared memory a configuration takes is num_stages x
# one A and one B tile; configurations above the device's limit per block are pruned before
# they are tried (``_prune_gemm``). BLOCK_K = 128: fp8-block's blocks (the last, one
# stage: with two, or 64 x 64 tiles, ptxas spilled 8-40 bytes).
_GEMM_CONFIGS = (
    (32, 32, 32, 4, 4, 2),
    (128, 128, 64, 8, 8, 3),
    (64, 128, 64, 8, 8, 3),
    (128, 64, 64, 8, 8, 3),
    (128, 128, 32, 8, 8, 4),
    (64, 64, 64, 8, 4, 2),
    (16, 128, 128, 8, 8, 1),
)
# shared memory per block (opt-in) by compute capability, where the device cannot be asked
_SMEM_PER_BLOCK = {
    (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
    (10, 0): 232448, (10, 3): 232448, (12, 0): 101376,
}  # fmt: skip
# operand kinds of the GEMM: not quantized, MX blocks of 32 along K, HiF8 elementwise, MX with
# the RCEIL rule, fp8-tensor, fp8-block's 1 x 128 blocks along K, its 128 x 128 weight tiles,
# NVFP4's blocks of 16 along K, its 16 x 16 weight tiles
GEMM_NONE, GEMM_MX, GEMM_HIFP8, GEMM_MX_RCEIL = 0, 1, 2, 3
GEMM_FP8_TENSOR, GEMM_FP8_BLOCK, GEMM_FP8_TILE, GEMM_NVFP4, GEMM_NVFP4_2D = 4, 5, 6, 7, 8
_FP8_KINDS = (GEMM_FP8_BLOCK, GEMM_FP8_TILE)


def _gemm_configs() -> list[Any]:
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    return [
        triton.Config(dict(zip(names, c[:4], strict=True)), num_warps=c[4], num_stages=c[5])
        for c in _GEMM_CONFIGS
    ]


def gemm_fits(config: Any, a_kind: int, b_kind: int) -> bool:
    """Whether a configuration's tiles hold whole blocks of both operands: K-tiles of 128
    for ``fp8-block`` (and only there), 128 x 128 weight tiles whole in the M / N tile."""
    kw = config.kwargs
    if (a_kind in _FP8_KINDS or b_kind in _FP8_KINDS) != (kw["BLOCK_K"] == 128):
        return False  # 128-element K-tiles for fp8-block alone (MX tiles of them spilled)
    if a_kind == GEMM_FP8_TILE and kw["BLOCK_M"] % 128:
        return False
    return not (b_kind == GEMM_FP8_TILE and kw["BLOCK_N"] % 128)


def smem_limit() -> int:
    """The current CUDA device's shared memory per block (opt-in), in bytes: asked of the
    device, or where it cannot be (no CUDA build) taken from its generation."""
    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        optin = getattr(props, "shared_memory_per_block_optin", None)
    except (AssertionError, RuntimeError):
        optin = None
    if isinstance(optin, int):
        return optin
    major, minor = torch.cuda.get_device_capability()
    return _SMEM_PER_BLOCK.get((major, minor), 101376)


def gemm_smem(config: Any, itemsize: int) -> int:
    """The shared memory a GEMM configuration takes: its stages of one A and one B tile."""
    kw = config.kwargs
    tiles: int = (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * itemsize
    return int(config.num_stages) * tiles


def _prune_gemm(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    fits = [c for c in configs if gemm_fits(c, kwargs["A_KIND"], kwargs["B_KIND"])]
    if _interpreting():
        return fits[:1]
    itemsize = named_args["a_ptr"].element_size()
    limit = smem_limit()
    # the first configuration is the interpreter's (small tiles: never the fastest on a GPU)
    kept = [c for c in fits if c is not configs[0] and gemm_smem(c, itemsize) <= limit]
    return kept or fits[-1:]


@triton.jit
def _mx_quant_tile(
    x,
    R: tl.constexpr,
    C: tl.constexpr,
    BLOCKS_ALONG_C: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    VMAX: tl.constexpr,
    EMAX: tl.constexpr,
    OUT: tl.constexpr,
    BF16: tl.constexpr,
    RCEIL: tl.constexpr = False,
):
    """A loaded ``[R, C]`` tile MX-fake-quantized in registers, blocks of 32 along C (or R),
    as ``_mx_kernel`` does it (``RCEIL``: NVIDIA's scale rule): the result in the tile's
    dtype."""
    v = load_f32(x, BF16)
    a = tl.abs(v)
    finite = a < float("inf")
    mags = tl.where(finite, a, 0.0)
    if BLOCKS_ALONG_C:
        amax = tl.max(tl.reshape(mags, (R, C // 32, 32)), axis=2)
    else:
        amax = tl.max(tl.reshape(mags, (R // 32, 32, C)), axis=1)
    if RCEIL:  # ceil(log2(amax / VMAX)) on the float32 quotient's bits
        descale = tl.math.div_rn(amax, tl.full(amax.shape, VMAX, tl.float32))
        nonzero = descale > 0
        d = tl.where(nonzero, descale, 1.0)
        f = floor_log2(d)
        shared = tl.where(nonzero, f + (d != pow2(f)).to(tl.int32), -127)
    else:
        nonzero = amax > 0
        shared = tl.where(nonzero, floor_log2(tl.where(nonzero, amax, 1.0)) - EMAX, -127)
    shared = tl.minimum(tl.maximum(shared, -127), 127)
    if BLOCKS_ALONG_C:
        shared = tl.reshape(tl.broadcast_to(shared[:, :, None], (R, C // 32, 32)), (R, C))
    else:
        shared = tl.reshape(tl.broadcast_to(shared[:, None, :], (R // 32, 32, C)), (R, C))
    scale = pow2(shared)
    inv_scale = pow2(-shared)
    if RCEIL:  # the smallest scale multiplies by 1, the elements clamped
        inv_scale = tl.where(shared == -127, 1.0, inv_scale)
        p = tl.minimum(tl.abs(tl.where(finite, v, 0.0) * inv_scale), VMAX)
    else:
        p = tl.abs(tl.where(finite, v, 0.0) * inv_scale)
    q = round_nonneg(p, MBITS, EMIN, VMAX)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(finite, store_as(qs * scale, OUT, BF16), x)


@triton.jit
def _hifp8_quant_tile(x, OUT: tl.constexpr, BF16: tl.constexpr):
    """A loaded tile HiF8-fake-quantized in registers, as ``_hifp8_kernel`` does it."""
    v = load_f32(x, BF16)
    a = tl.abs(v)
    positive = (a < float("inf")) & (a > 0)
    e = floor_log2(tl.where(positive, a, 1.0))
    ae = tl.abs(e)
    mbits = tl.where(ae <= 3, 3, tl.where(ae <= 7, 2, tl.where(ae <= 15, 1, 0)))
    k = tl.minimum(mbits - e, 127)
    q = tl.floor(a * pow2(k) + 0.5) * pow2(tl.maximum(e - mbits, -149))
    q = tl.where(e < -22, tl.where(a >= 1.1920928955078125e-07, 2.384185791015625e-07, 0.0), q)
    q = tl.minimum(q, 32768.0)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    qs = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(positive, store_as(qs, OUT, BF16), x)


@triton.jit
def pow2_exponent(amax, BIG: tl.constexpr):
    """fp8-block's scale exponent for float32 amax >= 0: floor(log2(448 / amax)) of the
    float32 quotient (BIG, the input dtype's largest value, where it overflows); 0 for 0."""
    nonzero = amax > 0
    quotient = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.where(nonzero, amax, 1.0))
    quotient = tl.where(quotient == float("inf"), BIG, quotient)
    return tl.where(nonzero, floor_log2(quotient), 0)


@triton.jit
def signed(q, v):
    """``copysign(q, v)`` on the bits (-0 stays -0)."""
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_quant_tile(
    x,
    scales_ptr,
    KIND: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    BLOCKS_ALONG_C: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    VMAX: tl.constexpr,
    OUT: tl.constexpr,
    BF16: tl.constexpr,
    BIG: tl.constexpr,
):
    """A loaded ``[R, C]`` tile in ``fp8-tensor`` (KIND 4: the scale and its reciprocal at
    ``scales_ptr``), ``fp8-block`` (5: 1 x 128 blocks along C, or R) or its 128 x 128 weight
    tiles (6), as ``quantpatch_fp8_kernels`` computes them: the result in the tile's dtype."""
    v = load_f32(x, BF16)
    finite = tl.abs(v) < float("inf")
    clean = tl.where(finite, v, 0.0)
    if KIND == 4:
        p = clean * tl.load(scales_ptr)  # the float32 product, rounded once
        res = signed(round_nonneg(tl.abs(p), MBITS, EMIN, VMAX), p) * tl.load(scales_ptr + 1)
    else:
        mags = tl.abs(clean)
        if KIND == 6:
            tiles = tl.reshape(mags, (R // 128, 128, C // 128, 128))
            e = pow2_exponent(tl.max(tl.max(tiles, axis=3), axis=1), BIG)
            e = tl.broadcast_to(e[:, None, :, None], (R // 128, 128, C // 128, 128))
        elif BLOCKS_ALONG_C:
            e = pow2_exponent(tl.max(tl.reshape(mags, (R, C // 128, 128)), axis=2), BIG)
            e = tl.broadcast_to(e[:, :, None], (R, C // 128, 128))
        else:
            e = pow2_exponent(tl.max(tl.reshape(mags, (R // 128, 128, C)), axis=1), BIG)
            e = tl.broadcast_to(e[:, None, :], (R // 128, 128, C))
        e = tl.reshape(e, (R, C))
        p = clean * pow2(e)  # exact
        res = signed(round_nonneg(tl.abs(p), 3, -6, 448.0), p) * pow2(-e)
    return tl.where(finite, store_as(res, OUT, BF16), x)


@triton.jit
def _nv_quant_tile(
    x,
    u,
    amax_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    BLOCKS_ALONG_C: tl.constexpr,
    TWO_D: tl.constexpr,
    SR: tl.constexpr,
    OUT: tl.constexpr,
    BF16: tl.constexpr,
):
    """A loaded ``[R, C]`` tile in NVFP4 as ``_nvfp4_kernel`` computes it: blocks of 16 along
    C (or R), or 16 x 16 tiles (``TWO_D``), the tensor's amax at ``amax_ptr``, ``u`` the
    random bits of stochastic rounding (float32, read where ``SR``)."""
    v = load_f32(x, BF16)
    a = tl.abs(v)
    finite = a < float("inf")
    mags = tl.where(finite, a, 0.0)
    amax = tl.load(amax_ptr + tl.zeros((R, C), tl.int32))
    if TWO_D:
        bmax = tl.max(tl.max(tl.reshape(mags, (R // 16, 16, C // 16, 16)), axis=3), axis=1)
        bmax = tl.broadcast_to(bmax[:, None, :, None], (R // 16, 16, C // 16, 16))
    elif BLOCKS_ALONG_C:
        bmax = tl.max(tl.reshape(mags, (R, C // 16, 16)), axis=2)
        bmax = tl.broadcast_to(bmax[:, :, None], (R, C // 16, 16))
    else:
        bmax = tl.max(tl.reshape(mags, (R // 16, 16, C)), axis=1)
        bmax = tl.broadcast_to(bmax[:, None, :], (R // 16, 16, C))
    res = nv_fake_quant(v, finite, tl.reshape(bmax, (R, C)), amax, u, SR)
    return tl.where(finite, store_as(res, OUT, BF16), x)


@triton.jit
def _quant_operand(
    x,
    u_ptr,
    u_offs,
    inside,
    aux_ptr,
    KIND: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    VMAX: tl.constexpr,
    EMAX: tl.constexpr,
    SR: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    BLOCKS_ALONG_C: tl.constexpr,
    OUT: tl.constexpr,
    BF16: tl.constexpr,
    BIG: tl.constexpr,
):
    """A GEMM operand's loaded tile quantized as its KIND says (``GEMM_*``)."""
    if KIND == 1:
        x = _mx_quant_tile(x, R, C, BLOCKS_ALONG_C, MBITS, EMIN, VMAX, EMAX, OUT, BF16, False)
    elif KIND == 3:
        x = _mx_quant_tile(x, R, C, BLOCKS_ALONG_C, MBITS, EMIN, VMAX, EMAX, OUT, BF16, True)
    elif KIND == 2:
        x = _hifp8_quant_tile(x, OUT, BF16)
    elif KIND >= 7:
        u = tl.zeros((R, C), tl.float32)
        if SR:
            u = tl.load(u_ptr + u_offs, mask=inside, other=0).to(tl.float32)
        x = _nv_quant_tile(x, u, aux_ptr, R, C, BLOCKS_ALONG_C, KIND == 8, SR, OUT, BF16)
    elif KIND >= 4:
        x = _fp8_quant_tile(
            x, aux_ptr, KIND, R, C, BLOCKS_ALONG_C, MBITS, EMIN, VMAX, OUT, BF16, BIG
        )
    return x


@triton.autotune(
    configs=_gemm_configs(),
    key=["M", "N", "K", "A_KIND", "B_KIND"],  # the kinds: which tiles fit
    prune_configs_by={"early_config_prune": _prune_gemm},
)
@triton.jit
def _qgemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    sab,
    sam,
    sak,
    sbb,
    sbk,
    sbn,
    scb,
    scm,
    scn,
    a_aux_ptr,
    b_aux_ptr,
    a_u_ptr,
    b_u_ptr,
    A_KIND: tl.constexpr,
    A_MBITS: tl.constexpr,
    A_EMIN: tl.constexpr,
    A_VMAX: tl.constexpr,
    A_EMAX: tl.constexpr,
    A_SR: tl.constexpr,
    B_KIND: tl.constexpr,
    B_MBITS: tl.constexpr,
    B_EMIN: tl.constexpr,
    B_VMAX: tl.constexpr,
    B_EMAX: tl.constexpr,
    B_SR: tl.constexpr,
    BF16: tl.constexpr,
    BIG: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # grouped order: GROUP_M rows of C tiles share the B tiles they read (L2 reuse)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = batch * sab + rm[:, None].to(tl.int64) * sam
    b_cols = batch * sbb + rn[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a_offs = a_rows + kk[None, :].to(tl.int64) * sak
        a_in = (rm[:, None] < M) & (kk[None, :] < K)
        a = tl.load(a_ptr + a_offs, mask=a_in, other=0.0)
        b_offs = b_cols + kk[:, None].to(tl.int64) * sbk
        b_in = (kk[:, None] < K) & (rn[None, :] < N)
        b = tl.load(b_ptr + b_offs, mask=b_in, other=0.0)
        a = _quant_operand(
            a, a_u_ptr, a_offs, a_in, a_aux_ptr, A_KIND, A_MBITS, A_EMIN, A_VMAX, A_EMAX, A_SR,
            BLOCK_M, BLOCK_K, True, a_ptr.dtype.element_ty, BF16, BIG,
        )  # fmt: skip
        b = _quant_operand(
            b, b_u_ptr, b_offs, b_in, b_aux_ptr, B_KIND, B_MBITS, B_EMIN, B_VMAX, B_EMAX, B_SR,
            BLOCK_K, BLOCK_N, False, b_ptr.dtype.element_ty, BF16, BIG,
        )  # fmt: skip
        if UPCAST:  # the interpreter multiplies bf16 as its raw bits: exact float32 instead
            acc = tl.dot(load_f32(a, BF16), load_f32(b, BF16), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = store_as(acc, c_ptr.dtype.element_ty, BF16)
    c_offs = batch * scb + rm[:, None].to(tl.int64) * scm + rn[None, :].to(tl.int64) * scn
    tl.store(c_ptr + c_offs, c, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_operand(fmt: str, backward: bool) -> tuple[int, int, int, float, int]:
    """The GEMM's constants for an operand of ``fmt`` (``bf16`` / None: not quantized):
    (kind, mantissa bits, minimum normal exponent, largest normal, emax)."""
    if fmt in ("bf16", "none"):
        return (GEMM_NONE, 0, 0, 0.0, 0)
    if fmt == "hifp8":
        return (GEMM_HIFP8, 0, 0, 0.0, 0)
    if fmt in MX_VALUES:
        forward_elem, gradient_elem, rceil = MX_VALUES[fmt]
        elem = _ELEMENTS[gradient_elem if backward else forward_elem]
        return (GEMM_MX_RCEIL if rceil else GEMM_MX, *elem)
    if fmt == "fp8-tensor":
        return (GEMM_FP8_TENSOR, *_ELEMENTS["e5m2" if backward else "e4m3"])
    if fmt in ("fp8-block", "fp8-block-2d"):
        return (GEMM_FP8_BLOCK if fmt == "fp8-block" else GEMM_FP8_TILE, *_ELEMENTS["e4m3"])
    if fmt in ("nvfp4", "nvfp4-2d"):
        return (GEMM_NVFP4 if fmt == "nvfp4" else GEMM_NVFP4_2D, *_ELEMENTS["e2m1"])
    fused = ", ".join(formats.names(fused_gemm=True))
    raise ValueError(f"the quantized GEMM takes {fused} or bf16 operands, not {fmt!r}")


def _operand_aux(
    t: torch.Tensor, kind: int, backward: bool, rand: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What an operand's tile loop reads besides it: the per-tensor scale and its reciprocal
    (``fp8-tensor``) or amax (NVFP4), float32; the random bits of stochastic rounding laid
    out like ``t`` (uint8); whether they are read."""
    aux = t
    if kind == GEMM_FP8_TENSOR:
        from .quantpatch_fp8 import finite_amax, tensor_scales

        vmax = _ELEMENTS["e5m2" if backward else "e4m3"][2]
        scale, scale_inv = tensor_scales(finite_amax(t), vmax, t.dtype)
        aux = torch.stack([scale.reshape(()), scale_inv.reshape(())]).to(torch.float32)
    elif kind in (GEMM_NVFP4, GEMM_NVFP4_2D):
        amax = torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t)).amax()
        aux = amax.to(torch.float32).reshape(1)
    if rand is None or kind not in (GEMM_NVFP4, GEMM_NVFP4_2D):
        return aux, t, False
    u = torch.empty_like(t, dtype=torch.uint8)
    u.copy_(rand.reshape(t.shape))
    if u.stride() != t.stride():
        raise AssertionError("random bits laid out unlike their operand")
    return aux, u, True


def quant_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_fmt: str,
    b_fmt: str,
    a_backward: bool = False,
    b_backward: bool = False,
    a_rand: torch.Tensor | None = None,
    b_rand: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.matmul(fake_quant(a, a_fmt, dim=-1), fake_quant(b, b_fmt, dim=-2))`` in one
    kernel: ``a`` ``[M, K]`` or ``[batch, M, K]``, ``b`` ``[K, N]`` or ``[batch, K, N]`` (a 2-D
    operand is shared by every batch), the same float dtype; both read in place through their
    strides (a transposed weight is not copied). The result is contiguous, in that dtype.
    ``fmt``: a value's element format (``fp8-block-2d`` / ``nvfp4-2d``: a weight's tiles);
    ``a_rand`` / ``b_rand``: NVFP4's 8 random bits per element (uint8, the operand's shape)
    where that operand rounds stochastically; the per-tensor amax of ``fp8-tensor`` and
    NVFP4 is taken (one torch reduction) before the launch."""
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quant_gemm takes bf16, fp16 or fp32 operands, not {a.dtype}, {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3) or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"quant_gemm cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    batch = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
    for t in (a, b):
        if t.dim() == 3 and t.shape[0] not in (1, batch):
            raise ValueError(f"quant_gemm: batch sizes {a.shape[0]} and {b.shape[0]} differ")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out_shape = (batch, m, n) if max(a.dim(), b.dim()) == 3 else (m, n)
    c = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()

    def strides3(t: torch.Tensor) -> tuple[int, int, int]:
        if t.dim() == 2:
            return (0, t.stride(0), t.stride(1))
        return (0 if t.shape[0] == 1 else t.stride(0), t.stride(1), t.stride(2))

    sab, sam, sak = strides3(a)
    sbb, sbk, sbn = strides3(b)
    c3 = c if c.dim() == 3 else c.unsqueeze(0)
    ak, am, aemin, avmax, aemax = gemm_operand(a_fmt, a_backward)
    bk, bm, bemin, bvmax, bemax = gemm_operand(b_fmt, b_backward)
    for t, kind, rand in ((a, ak, a_rand), (b, bk, b_rand)):
        if rand is not None and (kind not in (GEMM_NVFP4, GEMM_NVFP4_2D) or rand.shape != t.shape):
            raise ValueError("quant_gemm: random bits belong to an NVFP4 operand, its shape")
    if (ak == GEMM_FP8_TILE and a.dim() == 3) or (bk == GEMM_FP8_TILE and b.dim() == 3):
        raise ValueError("quant_gemm: 128 x 128 weight tiles need a 2-D operand")
    a_aux, a_u, a_sr = _operand_aux(a, ak, a_backward, a_rand)
    b_aux, b_u, b_sr = _operand_aux(b, bk, b_backward, b_rand)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)

    _qgemm_kernel[grid](
        a, b, c3, m, n, k, sab, sam, sak, sbb, sbk, sbn, *c3.stride(), a_aux, b_aux, a_u, b_u,
        A_KIND=ak, A_MBITS=am, A_EMIN=aemin, A_VMAX=avmax, A_EMAX=aemax, A_SR=a_sr,
        B_KIND=bk, B_MBITS=bm, B_EMIN=bemin, B_VMAX=bvmax, B_EMAX=bemax, B_SR=b_sr,
        BF16=a.dtype == torch.bfloat16, BIG=float(torch.finfo(a.dtype).max),
        IEEE=a.dtype == torch.float32,
        UPCAST=_interpreting() and a.dtype == torch.bfloat16,
    )  # fmt: skip
    return c
