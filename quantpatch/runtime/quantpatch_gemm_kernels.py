"""The quantized GEMM of ``quantpatch_ops``: a Triton GEMM that fake-quantizes each operand
tile as it loads it (no quantized copy of either operand is written).

Installed by ``quantpatch init`` as ``megatron/core/quantpatch/quantpatch_gemm_kernels.py`` beside
``quantpatch_kernels.py``, whose exact float32 arithmetic (powers of two from their bits,
floor log2, bf16 loads and stores through their bits, NVFP4's order of operations) each tile
shares with the fake-quant kernels, so the quantized operands are bit for bit theirs.
``quantpatch_weights`` calls :func:`quant_gemm` for the values whose spec entry says
``fused_gemm`` (and only those: each operand's kind is derived from its entry, and a format
the tile loop does not compute is refused); with ``TRITON_INTERPRET=1`` it runs on CPU
tensors, which is how it is tested bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import quantpatch_env as env
from . import quantpatch_formats as formats
from .quantpatch_kernels import (
    floor_log2,
    load_f32,
    nv_fake_quant,
    pow2,
    pow2_exponent,
    round_nonneg,
    signed,
    store_as,
)

_ELEMENTS = formats.ELEMENTS


def _interpreting() -> bool:
    return env.triton_interpret()


# A GEMM that quantizes its operands inside the tile loop.
#
# ``quant_gemm(a, b, ...)`` computes ``a @ b`` (batched or not) with each operand fake-quantized
# along the reduction dimension as its tiles are loaded: no quantized copy of either operand
# is written to memory. The K-tiles are multiples of 32 (128 where an operand is ``fp8-block``)
# and start at such multiples, so every block lies whole in one tile; the tail of K is loaded
# as zeros, exactly the reference's padding, so any K is handled. The per-tensor scale of
# ``fp8-tensor`` and NVFP4's tensor amax are computed before the launch and read by every
# tile; the quantized tile is the reference's value rounded to the operand's dtype (the same
# arithmetic as the fake-quant kernels, so the operands are bit-identical to ``fake_quant``'s;
# ``factored``: to ``quantize_factored``'s, code x block scale, the per-tensor scales of both
# operands multiplying the float32 accumulator once after the tile loop);
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
    (64, 64, 64, 8, 8, 2),
    (16, 128, 128, 8, 8, 1),
    (64, 64, 32, 8, 8, 3),
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
_NV_KINDS = (GEMM_NVFP4, GEMM_NVFP4_2D)
# the quantized elements a thread may hold per K-tile, by the heaviest operand kind: NVFP4's
# amax, block maxima, E4M3 scales and random bits per element (at 24 or more ptxas spilled
# 4-1,680 bytes), the RCEIL rule's quotient (at 64, 4-8 bytes); the other kinds are held to
# none here (their configurations above keep at most 64, 72 for fp8-block's 128-element K-tiles)
_PER_THREAD = {GEMM_NVFP4: 16, GEMM_NVFP4_2D: 16, GEMM_MX_RCEIL: 48}
# (the spec's family, scale rule, tiled): the operand kind that computes it in the tile loop
_GEMM_KINDS = {
    ("mx", "e8m0-floor", False): GEMM_MX,
    ("mx", "e8m0-rceil", False): GEMM_MX_RCEIL,
    ("hifp8", None, False): GEMM_HIFP8,
    ("fp8-tensor", "fp32", False): GEMM_FP8_TENSOR,
    ("fp8-block", "pow2", False): GEMM_FP8_BLOCK,
    ("fp8-block", "pow2", True): GEMM_FP8_TILE,
    ("nvfp4", "e4m3-fp32", False): GEMM_NVFP4,
    ("nvfp4", "e4m3-fp32", True): GEMM_NVFP4_2D,
}


def _gemm_configs() -> list[Any]:
    names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    return [
        triton.Config(dict(zip(names, c[:4], strict=True)), num_warps=c[4], num_stages=c[5])
        for c in _GEMM_CONFIGS
    ]


def gemm_fits(config: Any, a_kind: int, b_kind: int) -> bool:
    """Whether a configuration's tiles hold whole blocks of both operands: K-tiles of 128
    for ``fp8-block`` (and only there), 128 x 128 weight tiles whole in the M / N tile; and
    whether each thread's share of a K-tile stays within what the kinds keep in registers."""
    kw = config.kwargs
    per_thread = (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] // (32 * config.num_warps)
    limits = [_PER_THREAD[k] for k in (a_kind, b_kind) if k in _PER_THREAD]
    if limits and per_thread > min(limits):
        return False
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
            e = pow2_exponent(tl.max(tl.max(tiles, axis=3), axis=1), BIG, VMAX)
            e = tl.broadcast_to(e[:, None, :, None], (R // 128, 128, C // 128, 128))
        elif BLOCKS_ALONG_C:
            e = pow2_exponent(tl.max(tl.reshape(mags, (R, C // 128, 128)), axis=2), BIG, VMAX)
            e = tl.broadcast_to(e[:, :, None], (R, C // 128, 128))
        else:
            e = pow2_exponent(tl.max(tl.reshape(mags, (R // 128, 128, C)), axis=1), BIG, VMAX)
            e = tl.broadcast_to(e[:, None, :], (R // 128, 128, C))
        e = tl.reshape(e, (R, C))
        p = clean * pow2(e)  # exact
        res = signed(round_nonneg(tl.abs(p), MBITS, EMIN, VMAX), p) * pow2(-e)
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
    FACTORED: tl.constexpr,
):
    """A loaded ``[R, C]`` tile in NVFP4 as ``_nvfp4_kernel`` computes it: blocks of 16 along
    C (or R), or 16 x 16 tiles (``TWO_D``), the tensor's amax at ``amax_ptr``, ``u`` the
    random bits of stochastic rounding (float32, read where ``SR``); ``FACTORED``: code x
    block scale, the tensor's scale left to the GEMM's result."""
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
    res = nv_fake_quant(v, finite, tl.reshape(bmax, (R, C)), amax, u, SR, FACTORED)
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
    FACTORED: tl.constexpr,
):
    """A GEMM operand's loaded tile quantized as its KIND says (``GEMM_*``; ``FACTORED``:
    NVFP4 as code x block scale, its tensor scale left to the result)."""
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
        x = _nv_quant_tile(x, u, aux_ptr, R, C, BLOCKS_ALONG_C, KIND == 8, SR, OUT, BF16, FACTORED)
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
    alpha_ptr,
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
    FACTORED: tl.constexpr,
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
            BLOCK_M, BLOCK_K, True, a_ptr.dtype.element_ty, BF16, BIG, FACTORED,
        )  # fmt: skip
        b = _quant_operand(
            b, b_u_ptr, b_offs, b_in, b_aux_ptr, B_KIND, B_MBITS, B_EMIN, B_VMAX, B_EMAX, B_SR,
            BLOCK_K, BLOCK_N, False, b_ptr.dtype.element_ty, BF16, BIG, FACTORED,
        )  # fmt: skip
        if UPCAST:  # the interpreter multiplies bf16 as its raw bits: exact float32 instead
            acc = tl.dot(load_f32(a, BF16), load_f32(b, BF16), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if FACTORED:  # the operands' per-tensor scales, once, on the float32 result
        acc = acc * tl.load(alpha_ptr)
    c = store_as(acc, c_ptr.dtype.element_ty, BF16)
    c_offs = batch * scb + rm[:, None].to(tl.int64) * scm + rn[None, :].to(tl.int64) * scn
    tl.store(c_ptr + c_offs, c, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_operand(fmt: str, backward: bool) -> tuple[int, int, int, float, int]:
    """The GEMM's constants for an operand of ``fmt`` (a format of the spec; ``bf16``: not
    quantized), derived from its entry: (kind, mantissa bits, minimum normal exponent, largest
    normal, emax). A format whose family, scale rule or transform the tile loop does not
    compute is a ``ValueError``: ``quantpatch_weights`` sends only the spec's ``fused_gemm``
    values here and computes every other one on the separate path."""
    spec = formats.spec_of(fmt)
    if spec.family == "none":
        return (GEMM_NONE, 0, 0, 0.0, 0)
    kind = None if spec.rht else _GEMM_KINDS.get((spec.family, spec.scale, spec.tiled))
    if kind is None:
        raise ValueError(
            f"the quantized GEMM's tile loop does not compute {fmt!r} (its family "
            f"{spec.family}, scale {spec.scale}{', a Hadamard transform first' if spec.rht else ''}"
            "); the separate path does"
        )
    if kind == GEMM_HIFP8:
        return (kind, 0, 0, 0.0, 0)
    element = spec.grad_output if backward else spec.input
    return (kind, *_ELEMENTS[str(element)])


def _operand_aux(
    t: torch.Tensor,
    kind: int,
    vmax: float,
    rand: torch.Tensor | None,
    factored: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor | None]:
    """What an operand's tile loop reads besides it: the per-tensor scale and its reciprocal
    (``fp8-tensor``; ``factored``: 1 for the reciprocal, the codes left as they are) or amax
    (NVFP4), float32; the random bits of stochastic rounding laid out like ``t`` (uint8);
    whether they are read; and (``factored``) the per-tensor scale the result takes for this
    operand (None: none), or ``scale`` where the operand enters already quantized."""
    aux = t
    factor = scale
    if kind == GEMM_FP8_TENSOR:
        from .quantpatch_fp8 import finite_amax, tensor_scales

        fwd, inv = tensor_scales(finite_amax(t), vmax, t.dtype)
        if factored:
            factor, inv = inv.reshape(()), torch.ones_like(inv)
        aux = torch.stack([fwd.reshape(()), inv.reshape(())]).to(torch.float32)
    elif kind in _NV_KINDS:
        amax = torch.where(torch.isfinite(t), t.abs(), torch.zeros_like(t)).amax()
        aux = amax.to(torch.float32).reshape(1)
        if factored:
            from .quantpatch_nvfp4 import tensor_decode

            factor = tensor_decode(aux)
    if rand is None or kind not in _NV_KINDS:
        return aux, t, False, factor
    u = torch.empty_like(t, dtype=torch.uint8)
    u.copy_(rand.reshape(t.shape))
    if u.stride() != t.stride():
        raise AssertionError("random bits laid out unlike their operand")
    return aux, u, True, factor


def _batch(a: torch.Tensor, b: torch.Tensor) -> int:
    """The batch of ``quant_gemm``'s operands, once their dtypes and shapes are checked."""
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quant_gemm takes bf16, fp16 or fp32 operands, not {a.dtype}, {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3) or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"quant_gemm cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    batch = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
    for t in (a, b):
        if t.dim() == 3 and t.shape[0] not in (1, batch):
            raise ValueError(f"quant_gemm: batch sizes {a.shape[0]} and {b.shape[0]} differ")
    return batch


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    """A 2-D or 3-D operand's (batch, row, column) strides; a shared 2-D operand's batch: 0."""
    if t.dim() == 2:
        return (0, t.stride(0), t.stride(1))
    return (0 if t.shape[0] == 1 else t.stride(0), t.stride(1), t.stride(2))


def _alpha(
    a_f: torch.Tensor | None, b_f: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """The per-tensor scales' product that multiplies the float32 accumulator (1 where none),
    rounded once, as ``quantpatch_quantize.scaled_matmul`` takes it."""
    factors = [f for f in (a_f, b_f) if f is not None]
    if not factors:
        return torch.ones(1, dtype=torch.float32, device=device)
    f = factors[0] if len(factors) == 1 else factors[0] * factors[1]
    return f.to(device=device, dtype=torch.float32).reshape(1)


def quant_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_fmt: str,
    b_fmt: str,
    a_backward: bool = False,
    b_backward: bool = False,
    a_rand: torch.Tensor | None = None,
    b_rand: torch.Tensor | None = None,
    factored: bool = False,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch.matmul(fake_quant(a, a_fmt, dim=-1), fake_quant(b, b_fmt, dim=-2))`` in one
    kernel: ``a`` ``[M, K]`` or ``[batch, M, K]``, ``b`` ``[K, N]`` or ``[batch, K, N]`` (a 2-D
    operand is shared by every batch), the same float dtype; both read in place through their
    strides (a transposed weight is not copied). The result is contiguous, in that dtype.
    ``fmt``: a value's element format (``fp8-block-2d`` / ``nvfp4-2d``: a weight's tiles);
    ``a_rand`` / ``b_rand``: NVFP4's 8 random bits per element (uint8, the operand's shape)
    where that operand rounds stochastically; the per-tensor amax of ``fp8-tensor`` and
    NVFP4 is taken (one torch reduction) before the launch. ``factored`` (bf16 and fp16: see
    ``quantpatch_quantize``'s ``factors``): the tiles of ``fp8-tensor`` and NVFP4 operands are
    code x block scale, and their per-tensor scales multiply the float32 accumulator once,
    before its rounding to the output dtype; ``a_scale`` / ``b_scale``: that scale of an
    operand that enters already quantized (``bf16``, from the weight cache)."""
    batch = _batch(a, b)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out_shape = (batch, m, n) if max(a.dim(), b.dim()) == 3 else (m, n)
    c = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()

    sab, sam, sak = _strides3(a)
    sbb, sbk, sbn = _strides3(b)
    c3 = c if c.dim() == 3 else c.unsqueeze(0)
    ak, am, aemin, avmax, aemax = gemm_operand(a_fmt, a_backward)
    bk, bm, bemin, bvmax, bemax = gemm_operand(b_fmt, b_backward)
    for t, kind, rand in ((a, ak, a_rand), (b, bk, b_rand)):
        if rand is not None and (kind not in _NV_KINDS or rand.shape != t.shape):
            raise ValueError("quant_gemm: random bits belong to an NVFP4 operand, its shape")
    if (ak == GEMM_FP8_TILE and a.dim() == 3) or (bk == GEMM_FP8_TILE and b.dim() == 3):
        raise ValueError("quant_gemm: 128 x 128 weight tiles need a 2-D operand")
    a_aux, a_u, a_sr, a_f = _operand_aux(a, ak, avmax, a_rand, factored, a_scale)
    b_aux, b_u, b_sr, b_f = _operand_aux(b, bk, bvmax, b_rand, factored, b_scale)
    alpha = _alpha(a_f, b_f, a.device)

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)

    _qgemm_kernel[grid](
        a, b, c3, m, n, k, sab, sam, sak, sbb, sbk, sbn, *c3.stride(), a_aux, b_aux, a_u, b_u,
        alpha,
        A_KIND=ak, A_MBITS=am, A_EMIN=aemin, A_VMAX=avmax, A_EMAX=aemax, A_SR=a_sr,
        B_KIND=bk, B_MBITS=bm, B_EMIN=bemin, B_VMAX=bvmax, B_EMAX=bemax, B_SR=b_sr,
        BF16=a.dtype == torch.bfloat16, BIG=float(torch.finfo(a.dtype).max),
        IEEE=a.dtype == torch.float32,
        UPCAST=_interpreting() and a.dtype == torch.bfloat16,
        FACTORED=factored,
    )  # fmt: skip
    return c
