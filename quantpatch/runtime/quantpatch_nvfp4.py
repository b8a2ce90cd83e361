"""NVFP4 fake quantization, the PyTorch reference (part of ``quantpatch_ops``; see its docstring
for the format): E2M1 elements in blocks of 16 with E4M3 scales and one float32 scale per
tensor, ``nvfp4-2d`` in 16 x 16 tiles, and the stochastic rounding of gradients with its
per-device generators (``sr_seed``, ``reset_sr_generators``, ``sr_bits``).

The arithmetic is TransformerEngine 2.20.2's (``NVFP4QuantizerRef._quantize_blockwise_reference``
in ``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``, the reference TE's CUDA
kernels are tested bit-exact against), every step one float32 operation rounded to nearest, in
this order (``A`` the tensor's amax, ``b`` a block's)::

    g   = min(2688 / A, FLT_MAX)                 # 1 where that is 0 (A infinite)
    m   = g * fl(1/6)                            # the FP4 reciprocal folded in (TE >= 2.14)
    s   = E4M3(min(b * m, 448))                  # the block's scale, nearest even
    enc = min(1 / (s * fl(1 / g)), FLT_MAX)      # FLT_MAX where s is 0
    q   = E2M1(clamp(x * enc, -6, 6))            # nearest even; negative iff x * enc < 0

The fake-quantized value is ``q * (s * (A / 2688))``: the code times its block's decode scale
times the tensor's, the factor TE's GEMM applies (``alpha``) split per operand. A length that is
not a multiple of 16 (and, for ``nvfp4-2d``, a row count) is padded with zeros, as TE's
``_pad_tensor`` does. NaN and +-Inf pass through and are left out of every amax (TE's
reference does not define them).

4over6 (the spec's ``four_over_six`` values: Cook et al., arXiv 2512.02010; TE's
``_quantize_blockwise_4over6_reference``) quantizes every block twice, with ``E`` the E4M3
bound of the entry (256 or 448)::

    g   = min(6E / A, FLT_MAX)                   # 1 where that is 0
    b6  = (b / 6) * g                            # one division, then one product
    s6  = E4M3(min(b6, 448)),  s4 = E4M3(min(b6 * 1.5, 448))
    enc = min(1 / (s * fl(1 / g)), FLT_MAX)      # per candidate, as above
    q   = E2M1(clamp(x * enc, -6, 6))

and keeps the candidate whose error over the block is smaller, ties and NaN going to 6: per
element ``d = ((q * s) * A) / 6E - x``, summed in float32 in the block's order (``|d|`` for
MAE, ``d * d`` for MSE); a 16 x 16 weight tile sums each row so, then the 16 rows pairwise
(rows i and i + 8, then i + 4, i + 2, i + 1: the CUDA warp reduction TE's reference follows).
The result is ``q * (s * (A / 6E))``. A tile's errors run along the operand's reduction
dimension (TE's columnwise operand is the transpose, quantized row by row), so a weight and its
transpose may pick differently near a tie. Under ``backward=True`` (the output gradient) a
4over6 value quantizes as ``nvfp4``: TE's gradient slots take no 4over6.

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only.
"""

from __future__ import annotations

import torch

from . import quantpatch_env as env
from . import quantpatch_formats as formats
from .quantpatch_mx import E2M1 as _E2M1
from .quantpatch_mx import E4M3 as _E4M3
from .quantpatch_mx import quantum as _quantum
from .quantpatch_mx import round_element as _round_element

NVFP4_FORMATS = formats.names(family="nvfp4", rht=False, values_only=False)
"""The values and operand formats this module quantizes (``nvfp4-rht`` transforms first:
``quantpatch_rht``)."""
PLAIN = formats.names(family="nvfp4", rht=False, tiled=False, four_over_six="")[0]
"""NVFP4 itself (no transform, tiles or 4over6): what TE's gradient slots take."""
FOUR_OVER_SIX = {f.name: (f.four_over_six, f.e4m3_max) for f in formats.SPECS if f.four_over_six}
"""The 4over6 entries: (error metric, E4M3 bound)."""
NV_BLOCK = 16
TE_VERSION = "2.20.2"
"""The TransformerEngine release whose NVFP4 reference this module reproduces bit for bit."""
_NV_RANGE = 448.0 * 6.0  # E4M3 max x E2M1 max
_FLT_MAX = 3.4028234663852886e38
SR_BITS = 8
"""Random bits per element of the stochastic rounding (the hardware's ``cvt.rs``)."""


def nv_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor encode scale ``g = 2688 / amax`` (float32) as TE computes it: at most
    the float32 maximum (so an amax of 0 gives the maximum), 1 where it would be 0."""
    amax = amax.to(torch.float32)
    g = torch.clamp(torch.full_like(amax, _NV_RANGE) / amax, max=_FLT_MAX)
    return torch.where(g == 0, torch.ones_like(g), g)


def nv_global_decode(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor decode scale of the dequantized values, ``amax / 2688`` (float32)."""
    amax = amax.to(torch.float32)
    return amax / torch.full_like(amax, _NV_RANGE)


def nv_block_scale(bmax: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The E4M3 block scales (float32 values) of block maxima ``bmax`` under the tensor's
    encode scale ``g``: ``E4M3(min(bmax * (g * fl(1/6)), 448))``."""
    m = g * torch.reciprocal(torch.full_like(g, 6.0))
    s = torch.clamp(bmax * m, max=448.0)
    return _round_element(s, _E4M3)


def nv_encode_scale(s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """What a block's elements are multiplied by before the E2M1 cast:
    ``min(1 / (s * fl(1 / g)), FLT_MAX)`` (float32; the maximum where ``s`` is 0)."""
    dec = torch.reciprocal(g)
    return torch.clamp(torch.reciprocal(s * dec), max=_FLT_MAX)


def _nv_block_amax(mags: torch.Tensor, dim: int, two_d: bool) -> torch.Tensor:
    """Each element's block maximum (``mags`` >= 0, float32), in the shape of ``mags``."""
    if two_d:
        r, c = mags.shape[-2], mags.shape[-1]
        pr, pc = (-r) % NV_BLOCK, (-c) % NV_BLOCK
        v = torch.nn.functional.pad(mags, (0, pc, 0, pr)) if pr or pc else mags
        lead = v.shape[:-2]
        tiles = v.reshape(*lead, (r + pr) // NV_BLOCK, NV_BLOCK, (c + pc) // NV_BLOCK, NV_BLOCK)
        amax = tiles.amax(dim=(-3, -1), keepdim=True).expand(tiles.shape)
        return amax.reshape(v.shape)[..., :r, :c]
    v = mags.movedim(dim, -1)
    n = v.shape[-1]
    pad = (-n) % NV_BLOCK
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    blocks = v.reshape(*v.shape[:-1], -1, NV_BLOCK)
    amax = blocks.amax(dim=-1, keepdim=True).expand(blocks.shape)
    return amax.reshape(v.shape)[..., :n].movedim(-1, dim)


def nvfp4_parts(
    x: torch.Tensor,
    dim: int = -1,
    two_d: bool = False,
    bits: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantized form of ``x`` (at least 1-D): ``(q, s, amax)``, ``q`` each element's
    signed E2M1 value (float32, ``x``'s shape; NaN/Inf where ``x`` is not finite), ``s`` its
    block's E4M3 scale (float32, ``x``'s shape) and ``amax`` the tensor's (float32, 0-D).
    ``bits`` (uint8, ``x``'s shape) rounds stochastically, None to nearest even; ``amax`` is
    the tensor's when ``x`` is a slice of it (None: the amax of ``x``)."""
    v = x.to(torch.float32)
    finite = torch.isfinite(v)
    mags = torch.where(finite, v.abs(), torch.zeros_like(v))
    a = (mags.amax() if amax is None else amax).to(torch.float32).reshape(())
    g = nv_global_scale(a)
    s = nv_block_scale(_nv_block_amax(mags, dim, two_d and x.dim() >= 2), g)
    scaled = torch.where(finite, v, torch.zeros_like(v)) * nv_encode_scale(s, g)
    p = torch.clamp(scaled.abs(), max=6.0)
    q = _round_element(p, _E2M1) if bits is None else _stochastic_e2m1(p, bits)
    q = torch.where(scaled < 0, -q, q)
    return torch.where(finite, q, v), s, a


def _nvfp4(
    x: torch.Tensor,
    dim: int,
    two_d: bool,
    bits: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 fake quantization (see the module docstring): ``q * (s * (amax / 2688))`` in
    ``x``'s dtype, non-finite values unchanged; ``bits`` and ``amax`` as in
    :func:`nvfp4_parts`."""
    if x.dim() == 0:
        b = None if bits is None else bits.reshape(1)
        return _nvfp4(x.reshape(1), 0, False, b, amax).reshape(())
    q, s, a = nvfp4_parts(x, dim, two_d, bits, amax)
    out = q * (s * nv_global_decode(a))
    return torch.where(torch.isfinite(q), out, x.to(torch.float32)).to(x.dtype)


def tensor_decode(amax: torch.Tensor, fmt: str = PLAIN) -> torch.Tensor:
    """The per-tensor factor a product applies to its result for an NVFP4 operand of ``fmt``:
    ``amax / 2688`` (``amax / (6 * 256)`` under a 4over6 bound of 256; float32, 0-d), 1 where
    that is 0 (an all-zero tensor, whose codes are all 0: the factor then changes nothing, and
    an Inf passing through stays Inf, not NaN)."""
    d = nv_decode(amax, fmt).reshape(())
    return torch.where(d == 0, torch.ones_like(d), d)


def nvfp4_factored(
    x: torch.Tensor,
    dim: int,
    two_d: bool,
    bits: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 with the per-tensor scale factored out: ``(q * s, amax / 2688)``, the code times
    its E4M3 block scale in ``x``'s dtype (exact: at most 6 significant bits, between 2^-10
    and 2688, which bf16 and fp16 hold) and :func:`tensor_decode` of the tensor's amax;
    non-finite values pass through. ``bits`` and ``amax`` as in :func:`nvfp4_parts`."""
    if x.dim() == 0:
        b = None if bits is None else bits.reshape(1)
        t, f = nvfp4_factored(x.reshape(1), 0, False, b, amax)
        return t.reshape(()), f
    q, s, a = nvfp4_parts(x, dim, two_d, bits, amax)
    t = torch.where(torch.isfinite(q), q * s, x.to(torch.float32)).to(x.dtype)
    return t, tensor_decode(a)


def _stochastic_e2m1(p: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``p`` in [0, 6] (float32) rounded to E2M1 stochastically with 8 random bits ``r`` per
    element, as the hardware's ``cvt.rs`` does (TE's ``ptx.cuh``): up iff
    ``r < floor(256 * f)``, ``f`` the fraction of the spacing above the value below, so
    P(up) = floor(256 f) / 256 and a fraction below 1/256 never rounds up."""
    mbits, emin, vmax, _ = _E2M1
    quantum = _quantum(p, mbits, emin)
    y = p / quantum  # exact: a power of two
    low = torch.floor(y)
    frac256 = torch.floor((y - low) * 256.0)  # exact: the fraction has few bits
    up = bits.to(torch.float32) < frac256
    return torch.clamp((low + up.to(torch.float32)) * quantum, max=vmax)


def sr_seed() -> int:
    """The seed of the stochastic-rounding generators: ``QUANTPATCH_SR_SEED`` (default 0)
    plus the process's ``RANK`` (default 0)."""
    return env.sr_seed()


_SR_GENERATORS: dict[str, torch.Generator] = {}


def reset_sr_generators() -> None:
    """Forget the stochastic-rounding generators: the next draw starts again from
    ``sr_seed()``."""
    _SR_GENERATORS.clear()


def sr_bits(x: torch.Tensor) -> torch.Tensor:
    """The next 8 random bits per element of ``x`` (uint8, ``x``'s shape) from ``x``'s device's
    generator: ``torch.randint(0, 256)``."""
    key = str(x.device)
    gen = _SR_GENERATORS.get(key)
    if gen is None:
        gen = torch.Generator(device=x.device).manual_seed(sr_seed())
        _SR_GENERATORS[key] = gen
    return torch.randint(
        0, 1 << SR_BITS, x.shape, generator=gen, device=x.device, dtype=torch.uint8
    )


def _e4m3(s: torch.Tensor) -> torch.Tensor:
    return _round_element(s, _E4M3)


def _candidate(
    v: torch.Tensor, s: torch.Tensor, gd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed E2M1 code, |x * enc| before clamping) of the blocks ``v`` under scales ``s``."""
    enc = torch.clamp(torch.reciprocal(s * gd), max=_FLT_MAX)
    scaled = v * enc
    q = _round_element(torch.clamp(scaled.abs(), max=6.0), _E2M1)
    return torch.where(scaled < 0, -q, q), scaled


def _block_error(
    q: torch.Tensor,
    s: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    denom: torch.Tensor,
    mse: bool,
) -> torch.Tensor:
    """Each block's error (``[..., rows, blocks]``) of the codes ``q`` (``[..., rows, blocks,
    16]``), summed in the block's order as TE's reference does."""
    err = torch.zeros_like(q[..., 0])
    for i in range(NV_BLOCK):
        d = ((q[..., i] * s[..., 0]) * a) / denom - v[..., i]
        err = err + (d * d if mse else d.abs())
    return err


def _tile_sum(err: torch.Tensor) -> torch.Tensor:
    """16 rows' errors (``[..., rows, blocks]``, rows a multiple of 16) summed per tile in the
    CUDA warp's tree order, each tile's sum repeated over its rows."""
    t = err.reshape(*err.shape[:-2], -1, NV_BLOCK, err.shape[-1])
    for h in (8, 4, 2, 1):
        t = t[..., :h, :] + t[..., h : 2 * h, :]
    return t.expand(*t.shape[:-2], NV_BLOCK, t.shape[-1]).reshape(err.shape)


def nvfp4_4over6_parts(
    x: torch.Tensor,
    fmt: str,
    dim: int = -1,
    two_d: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4over6's ``(q, s, amax)`` of ``x`` (at least 1-D) for the entry ``fmt``, as
    :func:`nvfp4_parts` gives them: blocks of 16 along ``dim``, or (``two_d``) 16 x 16 tiles of
    the last two dimensions whose errors run along ``dim`` (the last two's)."""
    mode, bound = FOUR_OVER_SIX[fmt]
    v = x.to(torch.float32)
    finite = torch.isfinite(v)
    v0 = torch.where(finite, v, torch.zeros_like(v))
    a = (v0.abs().amax() if amax is None else amax).to(torch.float32).reshape(())
    nd = x.dim()
    two_d = two_d and nd >= 2
    swap = two_d and dim % nd == nd - 2
    t = v0.transpose(-1, -2) if swap else (v0 if two_d else v0.movedim(dim, -1))
    if t.dim() == 1:
        t = t.reshape(1, -1)
    rows, n = t.shape[-2], t.shape[-1]
    pr = (-rows) % NV_BLOCK if two_d else 0
    pc = (-n) % NV_BLOCK
    if pr or pc:
        t = torch.nn.functional.pad(t, (0, pc, 0, pr))
    blocks = t.reshape(*t.shape[:-1], -1, NV_BLOCK)  # [..., rows, nb, 16]
    if two_d:
        m = blocks.abs().reshape(*blocks.shape[:-3], -1, NV_BLOCK, *blocks.shape[-2:])
        bmax = m.amax(dim=(-3, -1), keepdim=True).expand((*m.shape[:-1], 1))
        bmax = bmax.reshape(*blocks.shape[:-1], 1)
    else:
        bmax = blocks.abs().amax(dim=-1, keepdim=True)
    six = torch.full_like(a, 6.0)
    denom = torch.full_like(a, float(bound)) * six
    g = torch.clamp(denom / a, max=_FLT_MAX)
    g = torch.where(g == 0, torch.ones_like(g), g)
    gd = torch.reciprocal(g)
    base = (bmax / six) * g
    s4 = _e4m3(torch.clamp(base * 1.5, max=448.0))
    s6 = _e4m3(torch.clamp(base, max=448.0))
    q4, _ = _candidate(blocks, s4, gd)
    q6, _ = _candidate(blocks, s6, gd)
    mse = mode == "mse"
    e4 = _block_error(q4, s4, blocks, a, denom, mse)
    e6 = _block_error(q6, s6, blocks, a, denom, mse)
    if two_d:
        e4, e6 = _tile_sum(e4), _tile_sum(e6)
    pick4 = (e4 < e6)[..., None]
    q = torch.where(pick4, q4, q6).reshape(t.shape)
    s = torch.where(pick4, s4, s6).expand(blocks.shape).reshape(t.shape)
    q, s = q[..., :rows, :n], s[..., :rows, :n]
    if x.dim() == 1:
        q, s = q.reshape(-1), s.reshape(-1)
    elif swap:
        q, s = q.transpose(-1, -2), s.transpose(-1, -2)
    elif not two_d:
        q, s = q.movedim(-1, dim), s.movedim(-1, dim)
    return torch.where(finite, q, v), s.contiguous(), a


def nvfp4_4over6_factored(
    x: torch.Tensor,
    fmt: str,
    dim: int,
    two_d: bool,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """4over6 with the per-tensor scale factored out, as :func:`nvfp4_factored`: ``(q * s,
    amax / 6E)``, the code times its chosen E4M3 block scale in ``x``'s dtype (exact) and
    :func:`tensor_decode` for ``fmt``'s bound; non-finite values pass through."""
    if x.dim() == 0:
        t, f = nvfp4_4over6_factored(x.reshape(1), fmt, 0, False, amax)
        return t.reshape(()), f
    q, s, a = nvfp4_4over6_parts(x, fmt, dim, two_d, amax)
    t = torch.where(torch.isfinite(q), q * s, x.to(torch.float32)).to(x.dtype)
    return t, tensor_decode(a, fmt)


def nv_decode(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The per-tensor decode scale of ``fmt``'s dequantized values, ``amax / (E * 6)``."""
    bound = FOUR_OVER_SIX[fmt][1] if fmt in FOUR_OVER_SIX else 448
    amax = amax.to(torch.float32)
    return amax / torch.full_like(amax, bound * 6.0)


def nvfp4_value(
    x: torch.Tensor,
    fmt: str,
    dim: int,
    two_d: bool,
    bits: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """The NVFP4 entry ``fmt`` (``nvfp4``, ``nvfp4-2d``, the 4over6 ones) of ``x``: a 4over6
    entry with ``bits`` (the output gradient) quantizes as ``nvfp4`` with them."""
    if fmt not in FOUR_OVER_SIX or bits is not None:
        return _nvfp4(x, dim, two_d and fmt not in FOUR_OVER_SIX, bits, amax)
    if x.dim() == 0:
        return nvfp4_value(x.reshape(1), fmt, 0, False, None, amax).reshape(())
    q, s, a = nvfp4_4over6_parts(x, fmt, dim, two_d, amax)
    out = q * (s * nv_decode(a, fmt))
    return torch.where(torch.isfinite(q), out, x.to(torch.float32)).to(x.dtype)


nvfp4 = _nvfp4
