"""Statistics of one saved tensor, and what each candidate format does to it, as mergeable sums
(so groups of tensors combine exactly). Uses torch; imported only by the analysis commands.

Format metrics are computed with the quant ops that training runs (``fake_quant``), along the
reduction dimension the tensor has in its GEMM, with the element type of its direction (E5M2
for gradients under ``mxfp8``): not against fixed ranges. The names follow Transformer
Engine's debug statistics where they coincide (``underflows %``, ``overflows %``, ``mse``,
``dynamic_range``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from quantpatch.runtime import quantpatch_formats as formats
from quantpatch.runtime import quantpatch_nvfp4 as nvq
from quantpatch.runtime import quantpatch_ops as ops

# tensor name -> (reduction dimension in its GEMM, backward element type)
REDUCTION: dict[str, tuple[int, bool]] = {
    "input": (-1, False),  # linear forward: input [s, b, h_in] . W^T, reduced along h_in
    "weight": (-1, False),  # W [out, in], reduced along in
    "grad_output": (-1, True),  # dgrad: grad_output [s, b, out] . W, reduced along out
    "query": (-1, False),  # Q.K^T reduces along the head dimension
    "key": (-1, False),
    "value": (0, False),  # P.V: value [sk, b, np, hn] reduced along sk
    "attention_probs": (-1, False),  # P [b, np, sq, sk] reduced along sk
}
_MX_ELEMENTS = {  # (fmt, backward) -> (largest normal, emax_elem) of the floor-rule MX values
    (f.name, backward): (
        formats.ELEMENTS[str(f.grad_output if backward else f.input)].vmax,
        formats.ELEMENTS[str(f.grad_output if backward else f.input)].emax,
    )
    for f in formats.SPECS
    if f.family == "mx" and f.scale == "e8m0-floor"
    for backward in (False, True)
}
_FLOOR_MX = {fmt for fmt, _ in _MX_ELEMENTS}
"""The values whose block statistics (saturated blocks, clipped scales) are counted."""
HIFP8_MAX = 32768.0


def _family(fmt: str) -> str:
    return formats.spec_of(fmt).family


def tiles_weights(fmt: str) -> bool:
    """Whether ``fmt`` quantizes a weight in 2-D tiles (``nvfp4-2d``; the 4over6 values,
    whose weight operand format is tiled)."""
    return formats.spec_of(formats.spec_of(fmt).operands[0]).tiled


def _four_over_six(fmt: str, backward: bool) -> bool:
    """Whether ``fmt`` quantizes this tensor with 4over6 (a gradient takes ``nvfp4``'s
    blocks: TE's gradient slots take no 4over6)."""
    return bool(formats.spec_of(fmt).four_over_six) and not backward


NOT_APPLICABLE = "n/a"
"""The cells of a candidate that applies to none of a row's tensors (ParetoQ: weights only)."""


def reduction_of(tensor: str | None, operation: str | None) -> tuple[int, bool]:
    if tensor in REDUCTION:
        return REDUCTION[tensor]
    return -1, operation == "backward"


@dataclass
class TensorSums:
    """Sums over the elements of one or more tensors."""

    tensors: int = 0
    numel: int = 0
    finite: int = 0
    zeros: int = 0
    nonfinite: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    absmax: float = 0.0
    absmin_nonzero: float = math.inf

    def merge(self, o: TensorSums) -> None:
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(o, f.name)
            if f.name == "absmax":
                setattr(self, f.name, max(a, b))
            elif f.name == "absmin_nonzero":
                setattr(self, f.name, min(a, b))
            else:
                setattr(self, f.name, a + b)

    def summary(self) -> dict[str, Any]:
        n = self.finite
        mean = self.total / n if n else math.nan
        var = max(self.total_sq / n - mean * mean, 0.0) if n else math.nan
        rng = (
            math.log2(self.absmax / self.absmin_nonzero)
            if self.absmax > 0 and math.isfinite(self.absmin_nonzero)
            else 0.0
        )
        return {
            "tensors": self.tensors,
            "numel": self.numel,
            "absmax": self.absmax,
            "mean": mean,
            "std": math.sqrt(var) if n else math.nan,
            "zeros %": 100 * self.zeros / self.numel if self.numel else 0.0,
            "nan/inf %": 100 * self.nonfinite / self.numel if self.numel else 0.0,
            "dynamic_range": rng,  # binades between the smallest and largest nonzero |x|
        }


def tensor_sums(t: torch.Tensor) -> TensorSums:
    x = t.detach().reshape(-1).float()
    finite = torch.isfinite(x)
    nf = int(finite.sum())
    x0 = torch.where(finite, x, torch.zeros((), dtype=x.dtype))
    a = x0.abs()
    nonzero = a > 0
    return TensorSums(
        tensors=1,
        numel=x.numel(),
        finite=nf,
        zeros=int((x == 0).sum()),
        nonfinite=x.numel() - nf,
        total=float(x0.sum(dtype=torch.float64)),
        total_sq=float((x0.double() ** 2).sum()),
        absmax=float(a.max()) if x.numel() else 0.0,
        absmin_nonzero=float(torch.where(nonzero, a, math.inf).min()) if x.numel() else math.inf,
    )


def sums_from_info(info: dict[str, Any]) -> TensorSums | None:
    """What a stats-only record (min, max, mean, std, shape) gives: absmax, mean and std; the
    zero and NaN counts are not recorded there."""
    try:
        shape = info.get("shape") or []
        n = math.prod(int(s) for s in shape) if shape else int(info.get("numel", 0))
        mean, std = float(info["mean"]), float(info["std"])
        absmax = max(abs(float(info["min"])), abs(float(info["max"])))
    except (KeyError, TypeError, ValueError):
        return None
    return TensorSums(
        tensors=1,
        numel=n,
        finite=n,
        total=mean * n,
        total_sq=(std * std + mean * mean) * n,
        absmax=absmax,
    )


@dataclass
class FormatSums:
    """What one format does to one or more tensors, as sums."""

    finite: int = 0
    nonzero: int = 0
    underflows: int = 0  # nonzero values that became zero
    overflows: int = 0  # |x| above the largest magnitude representable at its scale (clamped)
    blocks: int = 0
    blocks_saturated: int = 0  # MX/NVFP4 blocks with at least one clamped value
    # MX blocks whose E8M0 scale left [2^-127, 2^127]; NVFP4 blocks whose E4M3 scale saturated
    # (above 448) or flushed to 0 (a nonzero block far below the tensor's amax)
    blocks_scale_clipped: int = 0
    signal: float = 0.0  # sum x^2
    noise: float = 0.0  # sum (x - q)^2
    dot: float = 0.0  # sum x q
    quant_sq: float = 0.0  # sum q^2
    not_applicable: int = 0  # tensors the format does not apply to (ParetoQ: all but weights)

    def merge(self, o: FormatSums) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))

    def summary(self) -> dict[str, Any]:
        if self.not_applicable and not self.finite:  # no tensor it applies to: every cell n/a
            keys = FormatSums().summary()
            return dict.fromkeys(keys, NOT_APPLICABLE)
        sqnr = (
            math.inf
            if self.noise == 0
            else 10 * math.log10(self.signal / self.noise)
            if self.signal > 0
            else -math.inf
        )
        denom = math.sqrt(self.signal * self.quant_sq)
        return {
            "underflows %": 100 * self.underflows / self.nonzero if self.nonzero else 0.0,
            "overflows %": 100 * self.overflows / self.finite if self.finite else 0.0,
            "blocks saturated %": 100 * self.blocks_saturated / self.blocks
            if self.blocks
            else None,
            "blocks scale clipped %": (
                100 * self.blocks_scale_clipped / self.blocks if self.blocks else None
            ),
            "sqnr_db": sqnr,
            "rel_error": math.sqrt(self.noise / self.signal) if self.signal > 0 else 0.0,
            "cosine": self.dot / denom if denom > 0 else (1.0 if self.noise == 0 else 0.0),
            "mse": self.noise / self.finite if self.finite else 0.0,
        }


def sample_rows(t: torch.Tensor, dim: int, limit: int | None) -> tuple[torch.Tensor, int]:
    """At most about ``limit`` elements of ``t``: whole rows along ``dim`` (so MX blocks stay
    whole), evenly spaced. Returns the tensor and the dimension to reduce along."""
    if limit is None or t.numel() <= limit or t.dim() == 0:
        return t, dim
    rows = t.movedim(dim, -1).reshape(-1, t.shape[dim])
    keep = max(1, limit // max(1, rows.shape[1]))
    idx = torch.unique(torch.linspace(0, rows.shape[0] - 1, keep).round().long())
    return rows[idx], -1


TILE_GROUP = 32
"""Rows kept together when a weight is sampled for ``nvfp4-2d``: whole 16 x 16 tiles, and
whole MX blocks of 32 where the reduction runs along the rows."""


def is_tiled_weight(tensor: str | None, t: torch.Tensor) -> bool:
    """Whether ``nvfp4-2d`` quantizes this saved tensor in 16 x 16 tiles: a linear layer's
    2-D weight (as the quant op does with the operand init's sites name the weight). Every
    other tensor (activations, gradients, attention operands) gets ``nvfp4``'s 1-D blocks
    of 16 along its reduction dimension, as it does in training."""
    return tensor == "weight" and t.dim() == 2


def sample_row_groups(t: torch.Tensor, limit: int | None) -> torch.Tensor:
    """At most about ``limit`` elements of the 2-D ``t`` as groups of ``TILE_GROUP``
    consecutive rows starting at multiples of it, evenly spaced (the last, possibly partial,
    group only ever last): every 16 x 16 tile and every MX block in the sample is one of the
    tensor's own."""
    if limit is None or t.numel() <= limit:
        return t
    rows, cols = t.shape
    groups = -(-rows // TILE_GROUP)
    keep = max(1, limit // max(1, TILE_GROUP * cols))
    idx = torch.unique(torch.linspace(0, groups - 1, keep).round().long()).tolist()
    return torch.cat([t[g * TILE_GROUP : (g + 1) * TILE_GROUP] for g in idx])


def _mx_blocks(
    blocks: torch.Tensor, amax: torch.Tensor, vmax: float, emax: int
) -> tuple[int, int, int, int]:
    """(overflows, blocks, blocks saturated, blocks whose scale clips) of ``blocks`` (|x| in
    rows of 32, non-finite values zeroed) with their ``amax``."""
    nonzero = amax > 0
    _, exp = torch.frexp(torch.where(nonzero, amax, torch.ones_like(amax)))
    shared = (exp - 1) - emax
    clipped = nonzero & ((shared < ops.SCALE_MIN) | (shared > ops.SCALE_MAX))
    shared = torch.clamp(shared, ops.SCALE_MIN, ops.SCALE_MAX).double()
    limit = vmax * torch.exp2(shared)  # float64: 448 x 2^127 does not fit a float32
    per_block = (blocks > limit[:, None]).sum(dim=-1)
    return int(per_block.sum()), blocks.shape[0], int((per_block > 0).sum()), int(clipped.sum())


_SLICE = 1 << 18  # elements per slice: the temporaries of a slice stay in cache


def nv_amax(t: torch.Tensor) -> torch.Tensor:
    """The amax of the finite values of ``t`` (float32, 0-d): what NVFP4's tensor scale is
    taken from (take it before sampling rows, and pass it to :func:`formats_sums`)."""
    v = t.detach().to(torch.float32)
    return torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v)).amax()


def formats_sums(
    t: torch.Tensor,
    fmts: tuple[str, ...],
    dim: int = -1,
    backward: bool = False,
    amax: torch.Tensor | None = None,
    tiled: bool = False,
    *,
    weight: bool = False,
) -> dict[str, FormatSums]:
    """What each of ``fmts`` does to ``t``, as sums. Large tensors are worked slice by slice
    along a dimension other than ``dim`` (every sum adds up exactly, MX blocks stay whole),
    and what every format shares (the float32 values, their block maxima, the signal) is
    computed once per slice. NVFP4's tensor scale comes from ``amax`` (the whole tensor's
    where ``t`` is a sample of it; None: ``t``'s own); its elements are rounded to nearest even
    in either direction (stochastic rounding's error is a random draw, not a property of the
    tensor). ``tiled``: ``nvfp4-2d`` takes 16 x 16 tiles of ``t`` (a weight: see
    :func:`is_tiled_weight`), else its 1-D blocks, as ``nvfp4``. ParetoQ's weight values
    apply to a ``weight`` tensor only (rows ``[out, in]``, the step taken as the layer's
    first forward would; "clipped" counts as overflows); for any other tensor they count
    it as not applicable."""
    if t.dim() == 0:
        t, dim = t.reshape(1), 0
    t = t.detach()
    if amax is None and any(
        f in ops.NVFP4_FORMATS or _family(f) in ("fp8-tensor", "fp8-delayed") for f in fmts
    ):
        amax = nv_amax(t)  # NVFP4's, fp8-tensor's and the delayed values' scale: the whole tensor's
    out = {f: FormatSums() for f in fmts}
    weights_only = tuple(f for f in fmts if ops.is_paretoq(f))
    if weights_only:
        _add_weight_formats(t, weights_only, weight, out)
        fmts = tuple(f for f in fmts if f not in weights_only)
        if not fmts:
            return out
    d = dim % t.dim()
    others = [i for i in range(t.dim()) if i != d]
    if t.numel() <= 2 * _SLICE or not others:
        _add_slice(t, fmts, d, backward, out, amax, tiled)
        return out
    split = max(others, key=lambda i: t.shape[i])
    step = max(1, _SLICE // max(1, t.numel() // t.shape[split]))
    if tiled:  # slices of whole tiles
        step = -(-step // ops.NV_BLOCK) * ops.NV_BLOCK
    for start in range(0, t.shape[split], step):
        piece = t.narrow(split, start, min(step, t.shape[split] - start))
        _add_slice(piece, fmts, d, backward, out, amax, tiled)
    return out


def _nv_blocks(
    t: torch.Tensor, dim: int, amax: torch.Tensor, two_d: bool = False
) -> tuple[int, int, int, int]:
    """(overflows, blocks, blocks saturated, blocks whose E4M3 scale saturated or flushed) of
    NVFP4 blocks of 16 along ``dim`` (``two_d``: 16 x 16 tiles of the last two dimensions),
    in the float32 arithmetic of the quant op."""
    v = t.to(torch.float32)
    mags = torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v))
    if two_d:
        blocks = _tiles(mags)
    else:
        mags = mags.movedim(dim, -1)
        pad = (-mags.shape[-1]) % ops.NV_BLOCK
        if pad:
            mags = torch.nn.functional.pad(mags, (0, pad))
        blocks = mags.reshape(-1, ops.NV_BLOCK)
    bmax = blocks.amax(dim=-1, keepdim=True)
    g = nvq.nv_global_scale(amax)
    raw = bmax * (g * torch.reciprocal(torch.full_like(g, 6.0)))  # TE's order (quantpatch_nvfp4)
    s = nvq.nv_block_scale(bmax, g)
    # saturated: nearest even would go past 448 (to 480: at or above the midpoint 464); raw is
    # 448 and a rounding error at most for the block of the tensor's own amax
    clipped = (raw >= 464.0) | ((bmax > 0) & (s == 0))
    over = blocks * nvq.nv_encode_scale(s, g) > ops.E2M1[2]
    over &= s > 0
    per_block = over.sum(dim=-1)
    return int(per_block.sum()), blocks.shape[0], int((per_block > 0).sum()), int(clipped.sum())


def _nv4o6_blocks(
    t: torch.Tensor, fmt: str, dim: int, amax: torch.Tensor, two_d: bool
) -> tuple[int, int, int, int]:
    """:func:`_nv_blocks` of a 4over6 value: each block counted at the scale 4over6 chose for
    it (map-to-4 or map-to-6), under the value's E4M3 bound in the tensor scale."""
    _, scales, a = nvq.nvfp4_4over6_parts(t, fmt, dim, two_d, amax)
    v = t.to(torch.float32)
    mags = torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v))
    fmax = torch.finfo(torch.float32).max
    g = torch.clamp(torch.full_like(a, 6.0 * formats.spec_of(fmt).e4m3_max) / a, max=fmax)
    g = torch.where(g == 0, torch.ones_like(g), g)
    enc = torch.clamp(torch.reciprocal(scales * torch.reciprocal(g)), max=fmax)
    over = ((mags * enc > ops.E2M1[2]) & (scales > 0)).to(torch.float32)
    if two_d:
        over, s, bmax = _tiles(over), _tiles(scales), _tiles(mags)
    else:

        def flat(x: torch.Tensor) -> torch.Tensor:
            x = x.movedim(dim, -1) if x.dim() else x.reshape(1)
            x = torch.nn.functional.pad(x, (0, (-x.shape[-1]) % ops.NV_BLOCK))
            return x.reshape(-1, ops.NV_BLOCK)

        over, s, bmax = flat(over), flat(scales), flat(mags)
    s, bmax = s.amax(dim=-1), bmax.amax(dim=-1)
    raw6 = (bmax / 6.0) * g
    six = ops.round_element(torch.clamp(raw6, max=448.0), ops.E4M3)
    raw = torch.where(s == six, raw6, raw6 * 1.5)  # the chosen candidate's scale before E4M3
    clipped = (raw >= 464.0) | ((bmax > 0) & (s == 0))
    per_block = over.sum(dim=-1)
    return int(per_block.sum()), over.shape[0], int((per_block > 0).sum()), int(clipped.sum())


def _tiles(mags: torch.Tensor) -> torch.Tensor:
    """The 16 x 16 tiles of the last two dimensions of ``mags`` (zero-padded), one a row."""
    b = ops.NV_BLOCK
    rows, cols = mags.shape[-2:]
    mags = torch.nn.functional.pad(mags, (0, (-cols) % b, 0, (-rows) % b))
    lead = mags.shape[:-2]
    r, c = mags.shape[-2] // b, mags.shape[-1] // b
    tiles = mags.reshape(*lead, r, b, c, b).movedim(-3, -2)
    return tiles.reshape(-1, b * b)


def _add_slice(
    t: torch.Tensor,
    fmts: tuple[str, ...],
    dim: int,
    backward: bool,
    out: dict[str, FormatSums],
    tensor_amax: torch.Tensor | None = None,
    tiled: bool = False,
) -> None:
    # float64 throughout: a square or product of float32 values leaves float32's range (a
    # value of 2^-83 squares to zero, 1e30 to inf) but never float64's (2^-266 to 2^256
    # for every finite bf16/fp32 value), so SQNR, relative error and cosine stay finite
    # and correct for any finite tensor; a slice is small, so its float64 copies are too
    f64 = torch.float64

    def total(v: torch.Tensor) -> float:
        return float(v.sum(dtype=f64))

    x = t.to(f64)
    finite = torch.isfinite(x)
    all_finite = bool(finite.all())
    zero = torch.zeros((), dtype=f64)
    x0 = x if all_finite else torch.where(finite, x, zero)
    nonzero = x0 != 0
    n_finite, n_nonzero = int(finite.sum()), int(nonzero.sum())
    signal = total(x0 * x0)
    blocks = amax = None
    if any(f in _FLOOR_MX for f in fmts):
        v = x0.abs().movedim(dim, -1)
        pad = (-v.shape[-1]) % ops.BLOCK
        if pad:
            v = torch.nn.functional.pad(v, (0, pad))
        blocks = v.reshape(-1, ops.BLOCK)
        amax = blocks.amax(dim=-1)
    for fmt in fmts:
        if fmt in ops.NVFP4_FORMATS:
            assert tensor_amax is not None
            nv_fmt = fmt if _four_over_six(fmt, backward) else nvq.PLAIN
            two_d = tiles_weights(fmt) and tiled
            q = ops.nvfp4_value(t, nv_fmt, dim, two_d, None, tensor_amax).to(f64)
        elif _family(fmt) == "fp8-tensor" and tensor_amax is not None:  # the whole tensor's
            q = ops.fp8_tensor(t, backward, tensor_amax, fmt).to(f64)
        elif ops.is_delayed(fmt):  # the scale its history settles on: the tensor's own amax
            q = ops.settled_quantize(t, fmt, backward, tensor_amax).to(f64)
        else:
            q = ops.fake_quant(t, fmt, dim=dim, backward=backward).to(f64)
        q0 = q if all_finite else torch.where(finite, q, zero)
        err = x0 - q0  # exact: both are float32 values, held in float64
        s = FormatSums(
            finite=n_finite,
            nonzero=n_nonzero,
            underflows=int((nonzero & (q0 == 0)).sum()),
            signal=signal,
            noise=total(err * err),
            dot=total(x0 * q0),
            quant_sq=total(q0 * q0),
        )
        if fmt in _FLOOR_MX:
            assert blocks is not None and amax is not None
            vmax, emax = _MX_ELEMENTS[(fmt, backward)]
            s.overflows, s.blocks, s.blocks_saturated, s.blocks_scale_clipped = _mx_blocks(
                blocks, amax, vmax, emax
            )
        elif fmt in ops.NVFP4_FORMATS:
            assert tensor_amax is not None
            two_d = tiles_weights(fmt) and tiled
            if _four_over_six(fmt, backward):
                counts = _nv4o6_blocks(t, fmt, dim, tensor_amax, two_d)
            else:
                counts = _nv_blocks(t, dim, tensor_amax, two_d)
            s.overflows, s.blocks, s.blocks_saturated, s.blocks_scale_clipped = counts
        elif _family(fmt) == "hifp8":
            s.overflows = int((x0.abs() > HIFP8_MAX).sum())
        out[fmt].merge(s)


def _add_weight_formats(
    t: torch.Tensor, fmts: tuple[str, ...], weight: bool, out: dict[str, FormatSums]
) -> None:
    """ParetoQ candidates: the weight's rows (``[..., in]`` as ``[rows, in]``) quantized with
    the initial step; another tensor is counted as not applicable."""
    if not weight:
        for f in fmts:
            out[f].not_applicable += 1
        return
    w = t.reshape(-1, t.shape[-1])
    x = w.to(torch.float64)
    finite = torch.isfinite(x)
    x0 = torch.where(finite, x, torch.zeros_like(x))
    for f in fmts:
        q = ops.fake_quant(w, f).to(torch.float64)
        q0 = torch.where(finite, q, torch.zeros_like(q))
        err = x0 - q0
        out[f].merge(
            FormatSums(
                finite=int(finite.sum()),
                nonzero=int((x0 != 0).sum()),
                underflows=int(((x0 != 0) & (q0 == 0)).sum()),
                overflows=int((ops.paretoq_clipped(w, f) & finite).sum()),
                signal=float((x0 * x0).sum()),
                noise=float((err * err).sum()),
                dot=float((x0 * q0).sum()),
                quant_sq=float((q0 * q0).sum()),
            )
        )


(RHT,) = formats.names(rht=True)
"""The Hadamard-transformed NVFP4 candidate: for the weight-gradient GEMM's operands only."""


def is_wgrad_operand(tensor: str | None, operation: str | None, kind: str | None) -> bool:
    """Whether a saved tensor is an operand of a linear layer's weight-gradient GEMM (grad_W =
    grad_output^T . input, reduced along the tokens): the saver's ``input`` of a forward and
    ``grad_output`` of a backward, of a linear module (not attention)."""
    if kind == "core_attention":
        return False
    return (tensor, operation) in (("input", "forward"), ("grad_output", "backward"))


def rht_sums(t: torch.Tensor, wgrad_operand: bool) -> FormatSums:
    """What ``nvfp4-rht`` does to a wgrad operand ``t`` (``[..., features]``): its tokens
    (every leading dimension, flattened) are the reduction dimension, transformed in blocks
    of 16 and quantized (nearest even), then taken back through the inverse transform, so
    the error is the one the product sees; overflows and saturated blocks are counted on the
    transformed tensor. Any other tensor, and a token count that is not a multiple of 16
    (which ``nvfp4-rht`` refuses, as TransformerEngine does): not applicable."""
    out = FormatSums()
    if not wgrad_operand or t.dim() < 2 or (t.numel() // max(t.shape[-1], 1)) % 16:
        out.not_applicable = 1
        return out
    from quantpatch.runtime import quantpatch_rht as rht

    x2 = t.detach().reshape(-1, t.shape[-1])
    x = x2.to(torch.float64)
    finite = torch.isfinite(x)
    x0 = torch.where(finite, x, torch.zeros_like(x))
    q = ops.fake_quant(x2, RHT, dim=0).to(torch.float64)
    q0 = torch.where(finite, q, torch.zeros_like(q))
    err = x0 - q0
    transformed = rht.rht(x2, 0)
    out.merge(
        FormatSums(
            finite=int(finite.sum()),
            nonzero=int((x0 != 0).sum()),
            underflows=int(((x0 != 0) & (q0 == 0)).sum()),
            signal=float((x0 * x0).sum()),
            noise=float((err * err).sum()),
            dot=float((x0 * q0).sum()),
            quant_sq=float((q0 * q0).sum()),
        )
    )
    over, blocks, saturated, clipped = _nv_blocks(transformed, 0, nv_amax(transformed))
    out.overflows, out.blocks = over, blocks
    out.blocks_saturated, out.blocks_scale_clipped = saturated, clipped
    return out


def format_sums(
    t: torch.Tensor, fmt: str, dim: int = -1, backward: bool = False, tiled: bool = False
) -> FormatSums:
    """What ``fmt`` does to ``t`` (see :func:`formats_sums`)."""
    return formats_sums(t, (fmt,), dim, backward, tiled=tiled)[fmt]
