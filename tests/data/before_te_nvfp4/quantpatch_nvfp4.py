"""NVFP4 fake quantization, the PyTorch reference (part of ``quantpatch_ops``; see its docstring
for the format): E2M1 elements in blocks of 16 with E4M3 scales and one float32 scale per
tensor, ``nvfp4-2d`` in 16 x 16 tiles, and the stochastic rounding of gradients with its
per-device generators (``sr_seed``, ``reset_sr_generators``, ``sr_uniforms``).

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only.
"""

from __future__ import annotations

import os

import torch

from .quantpatch_mx import E2M1 as _E2M1
from .quantpatch_mx import E4M3 as _E4M3
from .quantpatch_mx import quantum as _quantum
from .quantpatch_mx import round_element as _round_element

NVFP4_FORMATS = ("nvfp4", "nvfp4-2d")
NV_BLOCK = 16
_NV_RANGE = 448.0 * 6.0  # E4M3 max x E2M1 max
_FLT_MAX = 3.4028234663852886e38


def nv_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale ``448 * 6 / amax`` (float32), 1 where ``amax`` is 0 and at most
    the float32 maximum (an amax below ~8e-36 would overflow it)."""
    amax = amax.to(torch.float32)
    # a tensor over a tensor: ``scalar / tensor`` multiplies by a reciprocal (not rounded once)
    num = torch.full_like(amax, _NV_RANGE)
    g = torch.clamp(num / torch.where(amax > 0, amax, torch.ones_like(amax)), max=_FLT_MAX)
    return torch.where(amax > 0, g, torch.ones_like(g))


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


def _nvfp4(
    x: torch.Tensor,
    dim: int,
    two_d: bool,
    rand: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 fake quantization (see the module docstring); ``rand`` (float32 in [0, 1), the
    shape of ``x``) rounds the elements stochastically, None to nearest even; ``amax`` is the
    tensor's when ``x`` is a slice of it (None: the amax of ``x``)."""
    if x.dim() == 0:
        r = None if rand is None else rand.reshape(1)
        return _nvfp4(x.reshape(1), 0, False, r, amax).reshape(())
    v = x.to(torch.float32)
    finite = torch.isfinite(v)
    mags = torch.where(finite, v.abs(), torch.zeros_like(v))
    g = nv_global_scale(mags.amax() if amax is None else amax)
    bmax = _nv_block_amax(mags, dim, two_d and x.dim() >= 2)
    s = _round_element((bmax / 6.0) * g, _E4M3)  # >= 0: the block's E4M3 scale
    usable = finite & (s > 0)
    p = torch.where(usable, (mags * g) / torch.where(usable, s, torch.ones_like(s)), 0.0)
    q = _round_element(p, _E2M1) if rand is None else _stochastic_e2m1(p, rand)
    q = torch.copysign(q, v)
    out = torch.where(finite, (q * s) / g, v)
    return out.to(x.dtype)


def _stochastic_e2m1(p: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """``p`` >= 0 (float32) rounded to E2M1 stochastically: up with probability the fraction
    of the spacing above the value below (``rand < fraction``), saturating at 6."""
    mbits, emin, vmax, _ = _E2M1
    a = torch.clamp(p, max=vmax)
    quantum = _quantum(a, mbits, emin)
    y = a / quantum  # exact: a power of two
    low = torch.floor(y)
    up = rand.to(torch.float32) < (y - low)  # the fraction is exact
    return torch.clamp((low + up.to(torch.float32)) * quantum, max=vmax)


def sr_seed() -> int:
    """The seed of the stochastic-rounding generators: ``QUANTPATCH_SR_SEED`` (default 0)
    plus the process's ``RANK`` (default 0)."""
    return int(os.environ.get("QUANTPATCH_SR_SEED", "0")) + int(os.environ.get("RANK", "0"))


_SR_GENERATORS: dict[str, torch.Generator] = {}


def reset_sr_generators() -> None:
    """Forget the stochastic-rounding generators: the next draw starts again from
    ``sr_seed()``."""
    _SR_GENERATORS.clear()


def sr_uniforms(x: torch.Tensor) -> torch.Tensor:
    """The next ``torch.rand(x.shape)`` (float32) of ``x``'s device's generator."""
    key = str(x.device)
    gen = _SR_GENERATORS.get(key)
    if gen is None:
        gen = torch.Generator(device=x.device).manual_seed(sr_seed())
        _SR_GENERATORS[key] = gen
    return torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32)


nvfp4 = _nvfp4
