"""FP8 with float32 scales, the PyTorch reference (part of ``quantpatch_ops``; see its docstring
for the formats): TransformerEngine's two FP8 recipes besides MXFP8.

* ``fp8-tensor`` (TE ``Float8CurrentScaling``, ``Format.HYBRID``; ``fp8-tensor-e4m3``:
  ``Format.E4M3``, E4M3 gradients too): one scale per tensor from
  its current amax: ``scale = fp8_max / amax`` (448 for E4M3, 57344 for E5M2 gradients) in
  float32, the dtype's largest finite value (float32's for float64) where that overflows, 1
  where amax is 0; ``scale_inv = 1 / scale`` (float32); ``q = fp8(x.float() * scale)``
  (nearest even, the float32 product rounded once); the result ``(q * scale_inv)`` cast to
  ``x``'s dtype:
  bit for bit TE 2.20.2's ``CurrentScalingQuantizerRef`` and its ``dequantize``.
* ``fp8-block`` (DeepSeek-V3's recipe, TE ``Float8BlockScaling`` defaults): E4M3 everywhere,
  one power-of-two scale per 1 x 128 block along the reduction dimension (activations,
  gradients) or per 128 x 128 tile of the last two dimensions (weights: the internal operand
  format ``fp8-block-2d``); ``scale = 2^floor(log2(448 / amax))`` (the float32 quotient's
  exponent, TE's ``pow_2_scales``; the dtype's largest finite value first where it
  overflows), 1 for an all-zero block, eps 0; ``q = E4M3(x * scale)``, result
  ``q / scale``: every step exact. ``fp8-block-hybrid`` (``Format.HYBRID``): the output
  gradient's blocks E5M2 under ``2^floor(log2(57344 / amax))``, as TE's quantizer computes any
  FP8 dtype's scale from that dtype's largest value.

NaN and +-Inf pass through unchanged and are left out of the amax (TE takes them in: a NaN
makes its whole tensor NaN, an Inf zeroes it); a tensor that is all non-finite keeps scale 1.

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only.
"""

from __future__ import annotations

import torch

from . import quantpatch_formats as formats
from .quantpatch_mx import E4M3, round_element

FP8_BLOCK = 128
FP8_FORMATS = formats.names(family="fp8-tensor") + formats.names(
    family="fp8-block", values_only=False
)
"""The values this module quantizes (``fp8-block-2d``: ``fp8-block``'s weight tiles, the
operand format the products give a weight; not a value of its own)."""
_TENSOR = formats.names(family="fp8-tensor")[0]
"""The family's first value (HYBRID: E5M2 gradients), what a call without ``fmt`` takes."""


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite elements, float32 (0 for none), as a 0-d tensor."""
    v = x.to(torch.float32)
    if v.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v)).amax()


def _largest(x_dtype: torch.dtype) -> float:
    """The dtype's largest finite value, as the float32 scale holds it: float32's for float64
    (whose own does not fit), so that a float64 tensor quantizes as its float32 cast does."""
    return min(torch.finfo(x_dtype).max, torch.finfo(torch.float32).max)


def tensor_scales(
    amax: torch.Tensor, fp8_max: float, x_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``_scale_from_amax_tensor`` (eps 0, no power-of-two rounding): the quantization
    scale and its float32 reciprocal."""
    amax = amax.to(torch.float32)
    scale = torch.div(fp8_max, amax)
    scale = torch.where(scale == torch.inf, _largest(x_dtype), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


def pow2_scales(
    amax: torch.Tensor, x_dtype: torch.dtype, fp8_max: float = E4M3[2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The power-of-two scales of ``fp8-block`` (TE's ``pow_2_scales``) for float32 amax >= 0
    and the element's largest value ``fp8_max``, and their reciprocals (exact)."""
    scale = torch.div(fp8_max, amax)
    scale = torch.where(scale == torch.inf, _largest(x_dtype), scale)
    _, exp = torch.frexp(scale)
    scale = torch.ldexp(torch.ones_like(scale), exp - 1)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


def _element(fmt: str, backward: bool) -> formats.Element:
    """The element an operand of ``fmt`` takes (its gradient's with ``backward``)."""
    spec = formats.spec_of(fmt)
    return formats.ELEMENTS[str(spec.grad_output if backward else spec.input)]


def fp8_tensor(
    x: torch.Tensor,
    backward: bool = False,
    amax: torch.Tensor | None = None,
    fmt: str = _TENSOR,
) -> torch.Tensor:
    """``fmt`` (of the ``fp8-tensor`` family): its element (the gradient's with ``backward``:
    E5M2 for ``fp8-tensor``, E4M3 for ``fp8-tensor-e4m3``) under one current scale (``amax``:
    the whole tensor's, where ``x`` is a slice of it)."""
    elem = _element(fmt, backward)
    v = x.to(torch.float32)
    finite = torch.isfinite(v)
    if amax is None:
        amax = finite_amax(v)
    scale, scale_inv = tensor_scales(amax, elem[2], x.dtype)
    q = round_element(torch.where(finite, v, torch.zeros_like(v)) * scale, elem)
    return torch.where(finite, q * scale_inv, v).to(x.dtype)


def tensor_codes(x: torch.Tensor, scale: torch.Tensor, elem: formats.Element) -> torch.Tensor:
    """The codes of ``x`` under the float32 per-tensor ``scale``, ``E(x * scale)`` (nearest
    even, the float32 product rounded once, saturating), in ``x``'s dtype, which holds them
    exactly (E4M3 and E5M2 have at most 4 significant bits and lie within bf16's and fp16's
    range); NaN and +-Inf pass through."""
    v = x.to(torch.float32)
    finite = torch.isfinite(v)
    q = round_element(torch.where(finite, v, torch.zeros_like(v)) * scale, elem)
    return torch.where(finite, q, v).to(x.dtype)


def fp8_tensor_factored(
    x: torch.Tensor,
    backward: bool = False,
    amax: torch.Tensor | None = None,
    fmt: str = _TENSOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fmt`` (of the ``fp8-tensor`` family) with its scale factored out: ``(codes,
    scale_inv)``, the codes in ``x``'s dtype (:func:`tensor_codes`), ``scale_inv`` float32
    0-d; ``codes * scale_inv`` in float32 is :func:`fp8_tensor`'s value before its rounding to
    ``x``'s dtype."""
    elem = _element(fmt, backward)
    if amax is None:
        amax = finite_amax(x)
    scale, scale_inv = tensor_scales(amax, elem[2], x.dtype)
    return tensor_codes(x, scale, elem), scale_inv.reshape(())


def fp8_block(x: torch.Tensor, dim: int = -1, elem: formats.Element = E4M3) -> torch.Tensor:
    """``fp8-block`` for an activation or gradient: 1 x 128 blocks along ``dim`` (zero-padded)
    in ``elem`` (E5M2: ``fp8-block-hybrid``'s output gradient)."""
    if x.dim() == 0:
        return fp8_block(x.reshape(1), 0, elem).reshape(())
    v = x.to(torch.float32).movedim(dim, -1)
    n = v.shape[-1]
    pad = (-n) % FP8_BLOCK
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    blocks = v.reshape(*v.shape[:-1], -1, FP8_BLOCK)
    out = _blockwise(blocks, (-1,), x.dtype, elem)
    return out.reshape(v.shape)[..., :n].movedim(-1, dim).to(x.dtype)


def fp8_block_2d(x: torch.Tensor) -> torch.Tensor:
    """``fp8-block`` for a weight: 128 x 128 tiles of the last two dimensions (zero-padded;
    a tensor of fewer dimensions takes 1 x 128 blocks)."""
    if x.dim() < 2:
        return fp8_block(x, -1)
    v = x.to(torch.float32)
    r, c = v.shape[-2:]
    v = torch.nn.functional.pad(v, (0, (-c) % FP8_BLOCK, 0, (-r) % FP8_BLOCK))
    rp, cp = v.shape[-2:]
    tiles = v.reshape(*v.shape[:-2], rp // FP8_BLOCK, FP8_BLOCK, cp // FP8_BLOCK, FP8_BLOCK)
    out = _blockwise(tiles, (-3, -1), x.dtype)
    return out.reshape(v.shape)[..., :r, :c].to(x.dtype)


def _blockwise(
    blocks: torch.Tensor,
    dims: tuple[int, ...],
    x_dtype: torch.dtype,
    elem: formats.Element = E4M3,
) -> torch.Tensor:
    """Blocks (the block spanning ``dims``) quantized to ``elem`` under their power-of-two
    scales."""
    finite = torch.isfinite(blocks)
    clean = torch.where(finite, blocks, torch.zeros_like(blocks))
    amax = clean.abs().amax(dim=dims, keepdim=True)
    scale, scale_inv = pow2_scales(amax, x_dtype, elem[2])
    q = round_element(clean * scale, elem)
    return torch.where(finite, q * scale_inv, blocks)


def fp8_quantize(
    x: torch.Tensor,
    fmt: str,
    dim: int = -1,
    backward: bool = False,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` in ``fmt`` (of :data:`FP8_FORMATS`), dequantized to its dtype."""
    spec = formats.spec_of(fmt)
    if spec.family == "fp8-tensor":
        return fp8_tensor(x, backward, amax, fmt)
    if spec.family == "fp8-block":
        return fp8_block_2d(x) if spec.tiled else fp8_block(x, dim, _element(fmt, backward))
    raise ValueError(f"not an FP8 format: {fmt!r}")
