"""Fused Triton kernels for ``quantpatch_ops.fake_quant``: one pass per call for every format.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch/quantpatch_kernels.py`` beside
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

The GEMM that quantizes its operands in its tile loop is ``quantpatch_gemm_kernels.py``, the
FP8 values' kernels ``quantpatch_fp8_kernels.py``; both share the arithmetic here.

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


# -- the configurations the fake-quant kernels are tuned over -------------------------------
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
def nv_fake_quant(v, finite, bmax, amax, u, SR: tl.constexpr, FACTORED: tl.constexpr = False):
    """NVFP4 of float32 ``v`` (``finite``: where it is; ``bmax``: each element's block
    maximum; ``amax``: the tensor's, broadcast; ``u``: 8 random bits per element as float32
    where ``SR``), dequantized to float32, in the reference's order (TE 2.20.2's; see
    ``quantpatch_nvfp4``): ``g = min(2688 / A, FLT_MAX)``, ``s = E4M3(min(b * (g * fl(1/6)),
    448))``, ``enc = min(1 / (s * fl(1 / g)), FLT_MAX)``, ``q = E2M1(clamp(x * enc, +-6))``
    negative iff ``x * enc < 0``, result ``q * (s * (A / 2688))`` (``FACTORED``: ``q * s``, the
    tensor's ``A / 2688`` left to the product's result); non-finite ``v`` unchanged."""
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
    if FACTORED:  # exact: at most 6 significant bits
        return tl.where(finite, q * s, v)
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
    FACTORED: tl.constexpr,
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
    res = nv_fake_quant(v, finite, bmax, amax, u, SR, FACTORED)
    out = tl.where(finite, store_as(res, y_ptr.dtype.element_ty, BF16), x)
    tl.store(y_ptr + offs, out, mask=inside)


def _nvfp4(
    x: torch.Tensor,
    two_d: bool,
    dim: int,
    y: torch.Tensor,
    rand: torch.Tensor | None,
    factored: bool = False,
) -> torch.Tensor:
    """NVFP4 of dense ``x`` into ``y`` (``empty_like(x)``): blocks along ``dim``, or tiles
    (``factored``: code x block scale, the tensor's scale left out)."""
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
        FACTORED=factored,
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
    FACTORED: tl.constexpr,
):
    """4over6 (``quantpatch_nvfp4``'s order of operations) of ``[batch, rows, n]``: each
    program takes ``BLOCK_R`` rows of ``NB`` blocks of 16 and reads a block one element at a
    time, so that its errors add up in the block's order, as TE's reference sums them
    (``FACTORED``: code x chosen block scale, the tensor's scale left out)."""
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
    if FACTORED:  # exact: at most 6 significant bits
        dec = s
    for i in tl.static_range(16):
        v, finite, offs, inside, x = _nv4o6_load(x_ptr, base, r, kb, rows, n, sr, sn, i, BF16)
        res = _nv4o6_code(v, enc) * dec
        out = tl.where(finite, store_as(res, y_ptr.dtype.element_ty, BF16), x)
        tl.store(y_ptr + offs, out, mask=inside)


def _nvfp4_4over6(
    x: torch.Tensor, fmt: str, two_d: bool, dim: int, y: torch.Tensor, factored: bool = False
) -> torch.Tensor:
    """4over6 of dense ``x`` into ``y`` (``empty_like(x)``): blocks along ``dim``, or the
    16 x 16 tiles of the last two dimensions with their errors along ``dim`` (``factored``:
    code x block scale, the tensor's scale left out)."""
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
    warps = 8  # 8 elements a thread: with 4 warps (16) ptxas spilled 4 bytes on sm_100
    if _interpreting():  # the interpreter's cost is per operation: few, large programs
        block_r, nb, warps = 128, 32, 4
    grid = (triton.cdiv(rows, block_r), triton.cdiv(triton.cdiv(n, 16), nb), b)
    _nvfp4_4over6_kernel[grid](
        x, y, amax, rows, n, sb, sr, sn, DENOM=6.0 * bound, MSE=mode == "mse", TWO_D=two_d,
        BLOCK_R=block_r, NB=nb, BF16=x.dtype == torch.bfloat16, FACTORED=factored,
        enable_fp_fusion=False, num_warps=warps,
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
    factored: bool = False,
) -> torch.Tensor:
    """``quantpatch_ops.fake_quant`` in one kernel (``fmt`` of the spec's MX, HiF8 or NVFP4
    families, ``nvfp4-rht`` aside; ``rand``: the 8 random bits per element (uint8) of NVFP4's
    stochastic rounding, the shape of ``x``). ``factored`` (NVFP4 only): each element's code
    times its block scale, the per-tensor scale left out (``quantpatch_quantize``'s
    ``quantize_factored``)."""
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
        return fake_quant(x.reshape(1), fmt, 0, backward, r, factored).reshape(())
    if fmt in FOUR_OVER_SIX and not (backward and rand is not None):
        return _nvfp4_4over6(x, fmt, spec.tiled and x.dim() >= 2, dim, y, factored)
    if spec.family == "nvfp4" and not spec.rht:
        two_d = spec.tiled and x.dim() >= 2 and fmt not in FOUR_OVER_SIX
        return _nvfp4(x, two_d, dim, y, rand if backward else None, factored)
    if factored:
        raise ValueError(f"{fmt!r} has no per-tensor scale to factor out")
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


@triton.jit
def pow2_exponent(amax, BIG: tl.constexpr, VMAX: tl.constexpr = 448.0):
    """fp8-block's scale exponent for float32 amax >= 0: floor(log2(VMAX / amax)) of the
    float32 quotient (VMAX: the element's largest value, 448 for E4M3, 57344 for E5M2; BIG,
    the input dtype's largest value, where it overflows); 0 for 0."""
    nonzero = amax > 0
    quotient = tl.math.div_rn(tl.full(amax.shape, VMAX, tl.float32), tl.where(nonzero, amax, 1.0))
    quotient = tl.where(quotient == float("inf"), BIG, quotient)
    return tl.where(nonzero, floor_log2(quotient), 0)


@triton.jit
def signed(q, v):
    """``copysign(q, v)`` on the bits (-0 stays -0)."""
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
