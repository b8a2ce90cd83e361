"""Flash attention (forward and backward) in Triton for the FA schemes' local attention.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch/quantpatch_flash.py`` beside
``quantpatch_ops.py``, whose ``quant_flash_attention`` fake-quantizes Q and K (straight-through,
exactly as the unfused ``quant_baddbmm`` does) and then calls :func:`flash_attention` here.
Depends on torch and triton only. With ``TRITON_INTERPRET=1`` set before import the kernels run
on CPU tensors in Triton's interpreter, which is how they are tested without a GPU.

Layout is Megatron's: ``q`` ``[sq, b, h, d]``, ``k`` ``[sk, b, g, d]``, ``v`` ``[sk, b, g, dv]``
(any strides), ``g`` dividing ``h``: query head ``i`` reads key/value head ``i // (h // g)``,
which is what ``repeat_interleave(h // g, dim=2)`` gives the unfused path, without the copy.
The output is ``[sq, b, h, dv]``, contiguous (a view to ``[sq, b, h * dv]`` is free).

* Forward: one program per (block of ``BLOCK_M`` queries, batch x head) streams the key/value
  blocks with the online softmax (running max and sum in float32, scores in base 2), P is cast
  to the input dtype for P.V (as the unfused path's bf16 probabilities are), the row's
  log-sum-exp is kept (float32, ``[b, h, sq]``) for the backward. Causal attention (``sq ==
  sk``, key ``j`` visible from query ``i`` when ``j <= i``) skips the blocks above the diagonal.
* Backward (FlashAttention-2): ``delta = rowsum(dO * O)``; one kernel per key/value block
  accumulates ``dK`` and ``dV`` over every query block of every query head of its group (no
  atomics, deterministic); one kernel per query block accumulates ``dQ``. ``dQ = dS . K``
  and ``dK = dS^T . Q`` with the operands the forward used, so with fake-quantized Q and K
  they are the gradients the unfused path's straight-through ``quant_baddbmm`` gives.

Saved for the backward: q, k, v, the output and the log-sum-exp: O(s) per head, never a
``[b * h, sq, sk]`` tensor. Block sizes are first choices, not yet measured on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """``tl.dot(a, b)`` accumulated in float32; ``F32`` widens the operands first (exactly:
    bf16 and fp16 are subsets of float32) for Triton's interpreter, whose ``tl.dot`` reads
    bf16 operands wrongly."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _flash_fwd(
    Q,
    K,
    V,
    OUT,
    LSE,
    qk_scale,
    sq,
    sk,
    H,
    GROUP,
    D,
    DV,
    sq_s,
    sq_b,
    sq_h,
    sq_d,
    sk_s,
    sk_b,
    sk_h,
    sk_d,
    sv_s,
    sv_b,
    sv_h,
    sv_d,
    so_s,
    so_b,
    so_h,
    so_d,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    g = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < sq) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    hi = sk
    if CAUSAL:
        hi = tl.minimum(sk, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + b * sk_b + g * sk_h + offs_n[None, :] * sk_s + offs_d[:, None] * sk_d
        kt = tl.load(k_ptrs, mask=(offs_n[None, :] < sk) & (offs_d[:, None] < D), other=0.0)
        s = _dot(q, kt, DOT_F32) * qk_scale  # [BLOCK_M, BLOCK_N], base-2 logits
        valid = offs_n[None, :] < sk
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + b * sv_b + g * sv_h + offs_n[:, None] * sv_s + offs_dv[None, :] * sv_d
        v = tl.load(v_ptrs, mask=(offs_n[:, None] < sk) & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = OUT + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_dv[None, :] * so_d
    tl.store(
        o_ptrs, out.to(OUT.dtype.element_ty), mask=(offs_m[:, None] < sq) & (offs_dv[None, :] < DV)
    )
    lse = m_i + tl.log2(l_safe)
    tl.store(LSE + bh.to(tl.int64) * sq + offs_m, lse, mask=offs_m < sq)


@triton.jit
def _flash_bwd_delta(
    OUT,
    DO,
    DELTA,
    sq,
    H,
    DV,
    so_s,
    so_b,
    so_h,
    so_d,
    sdo_s,
    sdo_b,
    sdo_h,
    sdo_d,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    inside = (offs_m[:, None] < sq) & (offs_dv[None, :] < DV)
    o = tl.load(
        OUT + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_dv[None, :] * so_d,
        mask=inside,
        other=0.0,
    )
    do = tl.load(
        DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_dv[None, :] * sdo_d,
        mask=inside,
        other=0.0,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * sq + offs_m, delta, mask=offs_m < sq)


@triton.jit
def _flash_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DVT,
    qk_scale,
    sm_scale,
    sq,
    sk,
    H,
    GROUP,
    D,
    DV,
    sq_s,
    sq_b,
    sq_h,
    sq_d,
    sk_s,
    sk_b,
    sk_h,
    sk_d,
    sv_s,
    sv_b,
    sv_h,
    sv_d,
    sdo_s,
    sdo_b,
    sdo_h,
    sdo_d,
    sdk_s,
    sdk_b,
    sdk_h,
    sdk_d,
    sdv_s,
    sdv_b,
    sdv_h,
    sdv_d,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bg = tl.program_id(1)
    G = H // GROUP
    b = (bg // G).to(tl.int64)
    g = bg % G
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    gl = g.to(tl.int64)
    k_mask = (offs_n[:, None] < sk) & (offs_d[None, :] < D)
    v_mask = (offs_n[:, None] < sk) & (offs_dv[None, :] < DV)
    k = tl.load(
        K + b * sk_b + gl * sk_h + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d,
        mask=k_mask,
        other=0.0,
    )
    v = tl.load(
        V + b * sv_b + gl * sv_h + offs_n[:, None] * sv_s + offs_dv[None, :] * sv_d,
        mask=v_mask,
        other=0.0,
    )
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # query blocks below the diagonal only
    for hh in range(0, GROUP):
        h = g * GROUP + hh
        hl = h.to(tl.int64)
        row = (b * H + hl) * sq
        for start_m in range(lo, sq, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = tl.load(
                Q + b * sq_b + hl * sq_h + offs_m[:, None] * sq_s + offs_d[None, :] * sq_d,
                mask=(offs_m[:, None] < sq) & (offs_d[None, :] < D),
                other=0.0,
            )
            do = tl.load(
                DO + b * sdo_b + hl * sdo_h + offs_m[:, None] * sdo_s + offs_dv[None, :] * sdo_d,
                mask=(offs_m[:, None] < sq) & (offs_dv[None, :] < DV),
                other=0.0,
            )
            lse = tl.load(LSE + row + offs_m, mask=offs_m < sq, other=0.0)
            delta = tl.load(DELTA + row + offs_m, mask=offs_m < sq, other=0.0)
            qkt = _dot(k, tl.trans(q), DOT_F32) * qk_scale  # [BLOCK_N, BLOCK_M]
            valid = (offs_n[:, None] < sk) & (offs_m[None, :] < sq)
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            pt = tl.where(valid, tl.exp2(qkt - lse[None, :]), 0.0)
            dv += _dot(pt.to(do.dtype), do, DOT_F32)
            dpt = _dot(v, tl.trans(do), DOT_F32)
            dst = pt * (dpt - delta[None, :])
            dk += _dot(dst.to(q.dtype), q, DOT_F32)
    dk = dk * sm_scale
    tl.store(
        DK + b * sdk_b + gl * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :] * sdk_d,
        dk.to(DK.dtype.element_ty),
        mask=k_mask,
    )
    tl.store(
        DVT + b * sdv_b + gl * sdv_h + offs_n[:, None] * sdv_s + offs_dv[None, :] * sdv_d,
        dv.to(DVT.dtype.element_ty),
        mask=v_mask,
    )


@triton.jit
def _flash_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    qk_scale,
    sm_scale,
    sq,
    sk,
    H,
    GROUP,
    D,
    DV,
    sq_s,
    sq_b,
    sq_h,
    sq_d,
    sk_s,
    sk_b,
    sk_h,
    sk_d,
    sv_s,
    sv_b,
    sv_h,
    sv_d,
    sdo_s,
    sdo_b,
    sdo_h,
    sdo_d,
    sdq_s,
    sdq_b,
    sdq_h,
    sdq_d,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    g = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_mask = (offs_m[:, None] < sq) & (offs_d[None, :] < D)
    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :] * sq_d,
        mask=q_mask,
        other=0.0,
    )
    do = tl.load(
        DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_dv[None, :] * sdo_d,
        mask=(offs_m[:, None] < sq) & (offs_dv[None, :] < DV),
        other=0.0,
    )
    row = bh.to(tl.int64) * sq
    lse = tl.load(LSE + row + offs_m, mask=offs_m < sq, other=0.0)
    delta = tl.load(DELTA + row + offs_m, mask=offs_m < sq, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = sk
    if CAUSAL:
        hi = tl.minimum(sk, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(
            K + b * sk_b + g * sk_h + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d,
            mask=(offs_n[:, None] < sk) & (offs_d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            V + b * sv_b + g * sv_h + offs_n[:, None] * sv_s + offs_dv[None, :] * sv_d,
            mask=(offs_n[:, None] < sk) & (offs_dv[None, :] < DV),
            other=0.0,
        )
        qk = _dot(q, tl.trans(k), DOT_F32) * qk_scale
        valid = (offs_n[None, :] < sk) & (offs_m[:, None] < sq)
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(valid, tl.exp2(qk - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), DOT_F32)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_F32)
    dq = dq * sm_scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :] * sdq_d,
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )


def _pow2_at_least(n: int, low: int = 16) -> int:
    return max(low, int(triton.next_power_of_2(n)))


def blocks(d: int, dv: int, device: torch.device) -> dict[str, int]:
    """Tile sizes and launch options for head dims ``d`` / ``dv`` on ``device``: 32 x 32 tiles
    in the interpreter (CPU tensors: few programs, as each costs milliseconds there), otherwise
    64 x 64 tiles, 32 x 32 for head dims above 128 (not yet measured on a GPU); the backward
    kernels' own from these (:func:`backward_blocks`)."""
    bd, bdv = _pow2_at_least(d), _pow2_at_least(dv)
    if device.type != "cuda":
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_D": bd, "BLOCK_DV": bdv, "DOT_F32": True}
    wide = max(bd, bdv) > 128
    tile = 32 if wide else 64
    return {
        "BLOCK_M": tile,
        "BLOCK_N": tile,
        "BLOCK_D": bd,
        "BLOCK_DV": bdv,
        "DOT_F32": False,
        "num_warps": 4,
        "num_stages": 1 if wide else 2,
    }


def backward_blocks(
    opts: dict[str, int], device: torch.device
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The launches of ``_flash_bwd_delta``, ``_flash_bwd_dkdv`` and ``_flash_bwd_dq`` from
    :func:`blocks`' on a GPU (the interpreter's as they are). ``delta``: 16 rows of
    ``O * dO`` (a row's sum does not depend on the rows beside it; 64 rows of a 256-wide head
    held 256 values per thread and spilled on sm_100). dQ: the forward's tiles with twice its
    warps (its float32 accumulator beside the transients). dK and dV: ``BLOCK_N`` keys
    accumulate in float32 over query blocks of half the forward's rows with dQ's warps (the
    query block's transient ``[BLOCK_N, BLOCK_M]`` scores, probabilities and their gradients
    are what kept 255 registers and spilled at the forward's rows); on sm_100 one stage (with
    two, ptxas spilled 24 bytes at a head dim of 64)."""
    if "num_warps" not in opts:
        return {"BLOCK_M": opts["BLOCK_M"], "BLOCK_DV": opts["BLOCK_DV"]}, opts, opts
    delta = {"BLOCK_M": 16, "BLOCK_DV": opts["BLOCK_DV"], "num_warps": 4}
    dq = {**opts, "num_warps": 2 * opts["num_warps"]}
    dkdv = {**dq, "BLOCK_M": max(16, opts["BLOCK_M"] // 2)}
    if torch.cuda.get_device_capability(device)[0] == 10:
        dkdv["num_stages"] = 1
    return delta, dkdv, dq


def shape_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    """Why the kernels cannot take these tensors, or None when they can."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "query, key and value must be [s, b, heads, head_dim]"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: the kernel takes bf16 or fp16, all alike"
    if len({q.device, k.device, v.device}) != 1:
        return "query, key and value are on different devices"
    sq, b, h, d = q.shape
    sk, bk, g, dk = k.shape
    if k.shape[:3] != v.shape[:3] or bk != b or dk != d:
        return f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not match"
    if min(sq, sk, b, h, g, d, v.shape[3]) == 0 or h % g:
        return f"{h} query heads cannot share {g} key/value heads (or a dimension is empty)"
    if max(d, v.shape[3]) > MAX_HEAD_DIM:
        return f"head dims {d}/{v.shape[3]} above {MAX_HEAD_DIM}"
    if causal and sq != sk:
        return f"causal attention needs sq == sk (got {sq} and {sk})"
    return None


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    sq, b, h, d = q.shape
    sk, _, g, dv = v.shape
    o = torch.empty((sq, b, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    opts = blocks(d, dv, q.device)
    grid = (triton.cdiv(sq, opts["BLOCK_M"]), b * h)
    _flash_fwd[grid](
        q, k, v, o, lse, scale * LOG2E, sq, sk, h, h // g, d, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        CAUSAL=causal, **opts,
    )  # fmt: skip
    return o, lse


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    scale: float,
    want_dq: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    sq, b, h, d = q.shape
    sk, _, g, dv = v.shape
    opts = blocks(d, dv, q.device)
    delta_opts, dkdv_opts, dq_opts = backward_blocks(opts, q.device)
    delta = torch.empty_like(lse)
    _flash_bwd_delta[(triton.cdiv(sq, delta_opts["BLOCK_M"]), b * h)](
        o, do, delta, sq, h, dv, *_strides(o), *_strides(do), **delta_opts
    )
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dvt = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common = (scale * LOG2E, scale, sq, sk, h, h // g, d, dv)
    _flash_bwd_dkdv[(triton.cdiv(sk, dkdv_opts["BLOCK_N"]), b * g)](
        q, k, v, do, lse, delta, dk, dvt, *common,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dvt),
        CAUSAL=causal, **dkdv_opts,
    )  # fmt: skip
    dq = None
    if want_dq:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _flash_bwd_dq[(triton.cdiv(sq, dq_opts["BLOCK_M"]), b * h)](
            q, k, v, do, lse, delta, dq, *common,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
            CAUSAL=causal, **dq_opts,
        )  # fmt: skip
    return dq, dk, dvt


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> torch.Tensor:
        o, lse = _forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(
        ctx: Any, do: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(
            q, k, v, o, lse, do, ctx.causal, ctx.scale, bool(ctx.needs_input_grad[0])
        )
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
) -> torch.Tensor:
    """softmax(scale * q k^T [causal]) v per head, ``[sq, b, h, dv]`` (see the module
    docstring for layouts); differentiable in q, k and v."""
    why = shape_refusal(q, k, v, causal)
    if why is not None:
        raise ValueError(f"flash attention: {why}")
    out: torch.Tensor = _FlashAttention.apply(q, k, v, causal, float(scale))
    return out
