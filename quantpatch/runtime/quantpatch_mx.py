"""MX and HiF8 fake quantization, the PyTorch reference (part of ``quantpatch_ops``; see its
docstring for the formats): elements rounded to E4M3 / E5M2 / E2M1 under a shared E8M0 scale
per block of 32, and HiFloat8's per-element tapered precision.

Two rules derive a block's E8M0 scale exponent from its amax (``rule``):

* ``floor`` (OCP Microscaling v1.0; scale ``e8m0-floor`` in the spec):
  ``floor(log2 amax) - emax_elem``, so the largest elements may saturate; torchao's
  ``ScaleCalculationMode.FLOOR``.
* ``rceil`` (NVIDIA's: TransformerEngine's ``MXFP8BlockScaling``, cuBLAS, Blackwell's
  ``cvt.rp.satfinite.ue8m0x2.f32``; scale ``e8m0-rceil`` in the spec):
  ``ceil(log2(amax / max_elem))`` with ``amax / max_elem`` one float32 division, the ceiling
  taken exactly on its bits, clamped to [-127, 127]. The elements are ``x * 2^-e`` clamped to
  +-max_elem and rounded; where ``e`` is -127 (a zero block, or amax <= max_elem * 2^-127) the
  elements are multiplied by 1 instead, as TE's ``exp2f_rcp`` and torchao's
  ``_to_mx_rceil`` do (such a block dequantizes to +-0). torchao's ``ScaleCalculationMode.RCEIL``.

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only. Exact float32 work on powers of two: the same on CPU and CUDA.
"""

from __future__ import annotations

import torch

from .quantpatch_formats import E2M1 as _E2M1
from .quantpatch_formats import E4M3 as _E4M3
from .quantpatch_formats import E5M2 as _E5M2
from .quantpatch_formats import Element

BLOCK = 32

_SCALE_MIN, _SCALE_MAX = -127, 127


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) exactly, for finite a > 0 (float32), as int32."""
    _, exp = torch.frexp(a)
    return (exp - 1).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for int32 e in [-149, 127], built from its bits (subnormals too): a few
    integer passes where ``ldexp`` computes a power."""
    e = e.to(torch.int32)
    normal = (e + 127) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _quantum(a: torch.Tensor, mbits: int, emin: int) -> torch.Tensor:
    """The element type's spacing at each ``a`` >= 0: 2^(exponent - mantissa bits), the
    subnormal spacing below the smallest normal."""
    tiny = a < 2.0**emin
    e = torch.where(
        tiny,
        torch.full_like(a, emin, dtype=torch.int32),
        _floor_log2(torch.where(tiny, torch.ones_like(a), a)),
    )
    return _pow2(e - mbits)


def _round_element(p: torch.Tensor, elem: Element) -> torch.Tensor:
    """Round float32 ``p`` to the element type (nearest, ties to even), saturating."""
    mbits, emin, vmax, _ = elem
    a = p.abs()
    quantum = _quantum(a, mbits, emin)
    q = torch.round(a / quantum) * quantum  # torch.round: half to even; the division is exact
    return torch.copysign(torch.clamp(q, max=vmax), p)


RULES = ("floor", "rceil")


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) exactly, for finite a > 0 (float32, subnormals too), as int32."""
    f = _floor_log2(a)
    return f + (a != _pow2(f.clamp(-149, 127))).to(torch.int32)


def _mx(x: torch.Tensor, dim: int, elem: Element, rule: str = "floor") -> torch.Tensor:
    if rule not in RULES:
        raise ValueError(f"MX scale rule {rule!r}; expected one of {RULES}")
    if x.dim() == 0:  # a scalar is a block of one
        return _mx(x.reshape(1), 0, elem, rule).reshape(())
    v = x.to(torch.float32).movedim(dim, -1)
    n = v.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    blocks = v.reshape(*v.shape[:-1], -1, BLOCK)
    finite = torch.isfinite(blocks)
    mags = torch.where(finite, blocks.abs(), torch.zeros_like(blocks))
    amax = mags.amax(dim=-1, keepdim=True)
    if rule == "rceil":
        descale = amax / elem[2]  # one float32 division, as torchao and the hardware take it
        nonzero = descale > 0
        shared = _ceil_log2(torch.where(nonzero, descale, torch.ones_like(descale)))
        shared = torch.where(nonzero, shared, torch.full_like(shared, _SCALE_MIN))
        shared = torch.clamp(shared, _SCALE_MIN, _SCALE_MAX)
        scale = _pow2(shared)
        # the reciprocal 2^-e, except 1 for the smallest scale (TE's exp2f_rcp)
        rcp = torch.where(shared == _SCALE_MIN, torch.ones_like(scale), _pow2(-shared))
        p = torch.where(finite, blocks, torch.zeros_like(blocks)) * rcp
        q = _round_element(torch.clamp(p, -elem[2], elem[2]), elem)
    else:
        nonzero = amax > 0
        shared = _floor_log2(torch.where(nonzero, amax, torch.ones_like(amax))) - elem[3]
        shared = torch.where(nonzero, shared, torch.full_like(shared, _SCALE_MIN))
        scale = _pow2(torch.clamp(shared, _SCALE_MIN, _SCALE_MAX))
        q = _round_element(torch.where(finite, blocks, torch.zeros_like(blocks)) / scale, elem)
    out = torch.where(finite, q * scale, blocks)
    out = out.reshape(*v.shape)[..., :n].movedim(-1, dim)
    return out.to(x.dtype)


def _hifp8(x: torch.Tensor) -> torch.Tensor:
    v = x.to(torch.float32)
    a = v.abs()
    finite = torch.isfinite(v)
    positive = finite & (a > 0)
    # the exponent field: subnormals read -127 and zero, Inf, NaN are replaced below
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    ae = e.abs()
    mbits = 3 - (ae > 3).to(torch.int32) - (ae > 7).to(torch.int32) - (ae > 15).to(torch.int32)
    # exponents beyond float32's normal range only occur where the value saturates anyway
    up = _pow2((mbits - e).clamp(-126, 127))
    down = _pow2((e - mbits).clamp(-126, 127))
    q = torch.floor(a * up + 0.5) * down  # ties away from zero
    # below the smallest denormal 2^-22: nearest of {0, 2^-22}, the tie going away from zero
    q = torch.where(e < -22, torch.where(a >= 2.0**-23, 2.0**-22, 0.0), q)
    q = torch.clamp(q, max=2.0**15)  # saturate: the code above 2^15 is infinity
    out = torch.where(positive, torch.copysign(q, v), v)
    return out.to(x.dtype)


# the names the other runtime modules use (nothing outside this module takes its private names)
E4M3, E5M2, E2M1 = _E4M3, _E5M2, _E2M1
SCALE_MIN, SCALE_MAX = _SCALE_MIN, _SCALE_MAX
quantum = _quantum
round_element = _round_element
mx = _mx
ceil_log2 = _ceil_log2
hifp8 = _hifp8
