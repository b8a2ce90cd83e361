"""Fake quantization for MXFP8, MXFP4 and HiFP8 (quantize, then dequantize to the working
dtype), and the quantized products that fork-layout sites dispatch to.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch_ops.py``; depends on torch and
the standard library only. Public API::

    fake_quant(x, fmt, *, dim=-1, backward=False) -> Tensor
    quant_matmul(a, b, fmt, *, backward=False, weight=None) -> Tensor
    quant_baddbmm(input, batch1, batch2, *, beta=1.0, alpha=1.0, fmt, backward=False) -> Tensor
    quant_bmm(a, b, fmt, *, backward=False) -> Tensor

Formats (OCP Microscaling v1.0; Luo et al., arXiv 2409.16626 for HiFloat8):

* ``mxfp8``: blocks of 32 along ``dim`` share an E8M0 scale 2^(floor(log2 amax) - emax);
  elements are E4M3 (E5M2 with ``backward=True``), rounded to nearest even and saturated.
* ``mxfp4``: the same with E2M1 elements (also for backward).
* ``nvfp4`` (NVIDIA's Blackwell FP4): E2M1 elements in blocks of 16 along ``dim``, each with
  an E4M3 scale, and one float32 scale per tensor: ``g = 448 * 6 / amax|x|`` (1 for an
  all-zero tensor; at most the float32 maximum), ``s = E4M3(amax_block / 6 * g)`` (nearest
  even, saturating at 448), ``q = E2M1(x * g / s)`` (nearest even, saturating at +-6; 0,
  keeping the sign, where ``s`` is 0), result ``q * s / g``. Every step is one float32
  operation rounded to nearest (bf16/fp16 inputs are upcast, the result cast back).
  ``backward=True`` rounds the elements stochastically instead (NVIDIA's recipe for
  gradients): ``q`` is the E2M1 value above ``|p|`` with probability the fraction of the way
  from the one below, the uniform draws ``torch.rand(x.shape)`` from a generator per device
  seeded with ``sr_seed()`` = ``QUANTPATCH_SR_SEED`` (default 0) + ``RANK`` (default 0), so a
  run is reproducible and every rank draws its own bits; ``reset_sr_generators()`` restarts
  them. The products round only their first operand stochastically (``backward=True`` at
  Megatron's dgrad and wgrad sites: the output gradient); the other one keeps nearest even.
* ``nvfp4-2d``: ``nvfp4`` with 16 x 16 tiles over the last two dimensions (any ``dim`` among
  them gives the same tiles), so a matrix and its transpose quantize alike. In the products
  only a weight takes the tiles: the operand ``quant_matmul``'s ``weight=`` names (init's
  linear forward and dgrad sites name it), or where none is named a 2-D
  ``torch.nn.Parameter`` or a view of one such as ``weight.t()``; every other operand is
  ``nvfp4``.
* ``nvfp4-rht``: ``nvfp4`` after a random Hadamard transform of both operands along the
  reduction dimension (NVIDIA's recipe for the weight-gradient GEMM): ``quantpatch_rht.py``,
  installed beside this file. ``fake_quant`` returns the quantized values taken back through
  the inverse transform (same shape, comparable with the input).
* ``hifp8``: per tensor, no scale: 3/2/1 mantissa bits for |e| <= 3/7/15, powers of two
  2^-22..2^-16 below 2^-15, zero below, saturation at 2^15, ties away from zero.
* ``bf16``: the identity.
* ``w1``, ``w1.58``, ``w2``, ``w3``, ``w4`` and their grouped forms ``w<b>g<N>``: ParetoQ's
  weight quantizers with a learnable step per output row (or row and group of N columns);
  linear role only, activations unquantized. The layer holds the step (``add_weight_scales``)
  and quantizes its weight itself (``paretoq_linear``), so the products here leave operands
  as they are; ``fake_quant(w, 'w2')`` quantizes a weight ``[out, in]`` with the initial step.
  See the ParetoQ section below.

The MX and HiF8 arithmetic is exact float32 work on powers of two (``frexp``/``ldexp``), so
the result is the same on CPU and CUDA and for bf16, fp16 and fp32 inputs; NVFP4's divisions
and products are correctly rounded float32 operations, the same on both. NaN and +-Inf pass through
unchanged; they do not disturb the scale of the rest of their block.

On CUDA tensors ``fake_quant`` runs one fused Triton kernel per call
(``quantpatch_kernels.py``, installed beside this file; bit-identical to the code here, tested
in Triton's interpreter). ``QUANTPATCH_KERNELS`` chooses: ``auto`` (default: the kernels for
CUDA tensors when triton imports, this PyTorch code otherwise), ``reference`` (always this
code), ``triton`` (always the kernels: CPU tensors too, with ``TRITON_INTERPRET=1``).
``kernels_in_use()`` says which path a CUDA tensor takes and why.

Weights are quantized once per optimizer step (``QUANTPATCH_WEIGHT_CACHE``, default on; see
``weight_cache_stats()`` and the section *weights quantized once per optimizer step*), and on
CUDA an MX or HiF8 product may run as one GEMM that quantizes its operands in its tile loop
(``QUANTPATCH_GEMM=auto|fused|separate``; section *the quantized GEMM*).

``QUANTPATCH_COMPILE=1`` runs the PyTorch code through ``torch.compile`` (one fused kernel per
format instead of ~30 elementwise passes; bit-identical results, tested).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

NV_FORMATS = ("nvfp4", "nvfp4-2d", "nvfp4-rht")
FORMATS = ("bf16", "mxfp8", "mxfp4", "hifp8", *NV_FORMATS, "w1", "w1.58", "w2", "w3", "w4")
"""Every base value (ParetoQ's ``w<b>`` also take a ``g<N>`` suffix: ``GROUPED_FORMATS``)."""
NVFP4_FORMATS = ("nvfp4", "nvfp4-2d")
BLOCK = 32
NV_BLOCK = 16
_NV_RANGE = 448.0 * 6.0  # E4M3 max x E2M1 max
_FLT_MAX = 3.4028234663852886e38

# element type: (mantissa bits, minimum normal exponent, largest normal, emax_elem)
_E4M3 = (3, -6, 448.0, 8)
_E5M2 = (2, -14, 57344.0, 15)
_E2M1 = (1, 0, 6.0, 2)
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


def _round_element(p: torch.Tensor, elem: tuple[int, int, float, int]) -> torch.Tensor:
    """Round float32 ``p`` to the element type (nearest, ties to even), saturating."""
    mbits, emin, vmax, _ = elem
    a = p.abs()
    quantum = _quantum(a, mbits, emin)
    q = torch.round(a / quantum) * quantum  # torch.round: half to even; the division is exact
    return torch.copysign(torch.clamp(q, max=vmax), p)


def _mx(x: torch.Tensor, dim: int, elem: tuple[int, int, float, int]) -> torch.Tensor:
    if x.dim() == 0:  # a scalar is a block of one
        return _mx(x.reshape(1), 0, elem).reshape(())
    v = x.to(torch.float32).movedim(dim, -1)
    n = v.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    blocks = v.reshape(*v.shape[:-1], -1, BLOCK)
    finite = torch.isfinite(blocks)
    mags = torch.where(finite, blocks.abs(), torch.zeros_like(blocks))
    amax = mags.amax(dim=-1, keepdim=True)
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


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_kernels_module: Any = None
_kernels_error: str | None = None


def _kernels() -> Any:
    """The Triton kernels module beside this one, or None (the reason kept) when it cannot be
    imported (no triton, or this file loaded outside its package)."""
    global _kernels_module, _kernels_error
    if _kernels_module is None and _kernels_error is None:
        try:
            from . import quantpatch_kernels  # megatron.core or quantpatch.runtime
        except Exception as exc:  # no triton, no package, a broken install: the reference runs
            _kernels_error = f"{type(exc).__name__}: {exc}"
        else:
            _kernels_module = quantpatch_kernels
    return _kernels_module


def _kernel_mode() -> str:
    mode = os.environ.get("QUANTPATCH_KERNELS", "auto")
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"QUANTPATCH_KERNELS={mode!r}; expected auto, reference or triton")
    return mode


def _interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter, the only way they read CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_in_use(device: str = "cuda") -> str:
    """Which path ``fake_quant`` takes for a tensor on ``device``: ``triton``,
    ``reference (why)``, or ``none (why)`` where it refuses the tensor."""
    mode = _kernel_mode()
    if mode == "reference":
        return "reference (QUANTPATCH_KERNELS=reference)"
    if mode == "auto" and device != "cuda":
        return "reference (CPU tensors)"
    if device != "cuda" and not _interpreted():
        return "none (QUANTPATCH_KERNELS=triton refuses CPU tensors without TRITON_INTERPRET=1)"
    if _kernels() is None:
        return f"reference (no Triton kernels: {_kernels_error})"
    return "triton"


def _use_kernels(x: torch.Tensor) -> bool:
    mode = _kernel_mode()
    if mode == "reference" or x.dtype not in _KERNEL_DTYPES:
        return False
    if not x.is_cuda:
        if mode == "auto":
            return False
        if not _interpreted():
            raise RuntimeError(
                f"QUANTPATCH_KERNELS=triton, but the tensor is on {x.device.type} and compiled "
                "Triton kernels run on CUDA tensors only; set TRITON_INTERPRET=1 to interpret "
                "them on CPU tensors, or QUANTPATCH_KERNELS=auto."
            )
    if _kernels() is None:
        if mode == "triton":
            raise RuntimeError(f"QUANTPATCH_KERNELS=triton, but {_kernels_error}")
        return False
    return True


_COMPILE = os.environ.get("QUANTPATCH_COMPILE", "0") == "1"
_COMPILED: dict[tuple[str, bool], Callable[[torch.Tensor, int], torch.Tensor]] = {}


def fake_quant(x: torch.Tensor, fmt: str, *, dim: int = -1, backward: bool = False) -> torch.Tensor:
    """``x`` quantized to ``fmt`` and dequantized: same shape, same dtype."""
    if fmt == "bf16":
        return x
    if is_paretoq(fmt):  # a weight [out, in], with the step its layer's first forward takes
        return paretoq_fake_quant(x, fmt)
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")
    if x.numel() == 0:
        return x.clone()
    if fmt == "nvfp4-rht":  # Hadamard-transformed NVFP4: quantpatch_rht.py
        from . import quantpatch_rht

        return quantpatch_rht.fake_quant_rht(x, dim, backward=backward)
    rand = sr_uniforms(x) if backward and fmt in NVFP4_FORMATS else None
    if _use_kernels(x):
        out: torch.Tensor = _kernels_module.fake_quant(x, fmt, dim, backward, rand)
        return out
    if fmt in NVFP4_FORMATS:  # random draws: not compiled
        return _fake_quant(x, fmt, dim, backward, rand)
    if _COMPILE:
        key = (fmt, backward)
        if key not in _COMPILED:  # one compiled function per format and direction
            _COMPILED[key] = torch.compile(
                lambda t, d: _fake_quant(t, fmt, d, backward), dynamic=True
            )
        return _COMPILED[key](x, dim)
    return _fake_quant(x, fmt, dim, backward)


_CHUNK = 1 << 18  # elements per slice on CPU: the ~30 temporaries stay in cache


def _fake_quant(
    x: torch.Tensor, fmt: str, dim: int, backward: bool, rand: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference path (``rand``: the stochastic-rounding draws of ``nvfp4`` backward)."""
    if fmt in NVFP4_FORMATS:
        two_d, r = fmt == "nvfp4-2d", rand if backward else None
        if x.device.type == "cpu" and x.numel() > 2 * _CHUNK and x.dim() >= 1:
            return _nv_sliced(x, dim, two_d, r)
        return _nvfp4(x, dim, two_d, r)
    if x.device.type == "cpu" and x.numel() > 2 * _CHUNK and x.dim() >= 1:
        return _sliced(x, fmt, dim, backward)
    return _whole(x, fmt, dim, backward)


def _sliced(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """The same arithmetic slice by slice into one output: on CPU the temporaries of a slice
    fit in cache and their memory is reused, where a whole large tensor makes every pass a
    fresh allocation (page faults) and a trip to main memory. Slices never cut an MX block:
    they run along another dimension, or along ``dim`` in multiples of 32."""
    d = dim % x.dim()
    others = [i for i in range(x.dim()) if i != d]
    split = max(others, key=lambda i: x.shape[i]) if others else d
    per_index = x.numel() // x.shape[split]
    step = max(1, _CHUNK // max(1, per_index))
    if split == d:
        step = max(BLOCK, step - step % BLOCK)
    out = torch.empty_like(x)
    for start in range(0, x.shape[split], step):
        n = min(step, x.shape[split] - start)
        out.narrow(split, start, n).copy_(_whole(x.narrow(split, start, n), fmt, dim, backward))
    return out


def _nv_sliced(x: torch.Tensor, dim: int, two_d: bool, rand: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 slice by slice (as :func:`_sliced`), every slice with the whole tensor's amax.
    Slices never cut a block: they run along a dimension the blocks do not span, or along one
    they do in multiples of 16."""
    v = x.to(torch.float32)
    amax = torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v)).amax()
    del v
    d = dim % x.dim()
    spanned = {x.dim() - 2, x.dim() - 1} if two_d and x.dim() >= 2 else {d}
    others = [i for i in range(x.dim()) if i not in spanned]
    split = max(others, key=lambda i: x.shape[i]) if others else min(spanned)
    per_index = x.numel() // max(1, x.shape[split])
    step = max(1, _CHUNK // max(1, per_index))
    if split in spanned:
        step = max(NV_BLOCK, step - step % NV_BLOCK)
    out = torch.empty_like(x)
    for start in range(0, x.shape[split], step):
        n = min(step, x.shape[split] - start)
        r = None if rand is None else rand.narrow(split, start, n)
        out.narrow(split, start, n).copy_(_nvfp4(x.narrow(split, start, n), dim, two_d, r, amax))
    return out


def _whole(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    if fmt == "mxfp8":
        return _mx(x, dim, _E5M2 if backward else _E4M3)
    if fmt == "mxfp4":
        return _mx(x, dim, _E2M1)
    return _hifp8(x)


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized tensor, exactly (``cached``: through the weight cache).
    Backward: the gradient unchanged."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, fmt: str, dim: int, backward: bool, cached: bool = False
    ) -> torch.Tensor:
        if cached:
            return _weight_fake_quant(x, fmt, dim, backward)
        return fake_quant(x, fmt, dim=dim, backward=backward)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return grad, None, None, None, None


def _is_weight(t: torch.Tensor) -> bool:
    """A 2-D ``torch.nn.Parameter`` or a view of one (``weight.t()``)."""
    base = t._base if t._base is not None else t
    return t.dim() == 2 and isinstance(base, torch.nn.Parameter)


def _operand_fmt(t: torch.Tensor, fmt: str, weight: bool | None = None) -> str:
    """``nvfp4-2d`` tiles weights only; every other operand takes 1-D ``nvfp4`` blocks.
    ``weight``: whether the caller named ``t`` the weight (``None``: it did not say, and a
    2-D Parameter or a view of one is taken for the weight)."""
    is_weight = _is_weight(t) if weight is None else weight
    return "nvfp4" if fmt == "nvfp4-2d" and not is_weight else fmt


def _named_weight(weight: str | None, operand: str) -> bool | None:
    """Whether ``operand`` ("a" or "b") is the one the caller's ``weight=`` names."""
    if weight is None:
        return None
    if weight not in ("a", "b"):
        raise ValueError(f"weight={weight!r}; expected 'a', 'b' or None")
    return weight == operand


def _q(
    x: torch.Tensor, fmt: str, dim: int, backward: bool, weight: bool | None = None
) -> torch.Tensor:
    """``x`` fake-quantized for a product; a weight (named so by the site, or else a 2-D
    Parameter or a view of one) through the once-per-step cache."""
    if fmt == "bf16" or is_paretoq(fmt):  # ParetoQ: the layer quantized its weight already
        return x
    if _is_weight(x) if weight is None else weight:
        return _cached_q(x, fmt, dim, backward)
    if x.requires_grad and torch.is_grad_enabled():
        out: torch.Tensor = _StraightThrough.apply(x, fmt, dim, backward)  # type: ignore[no-untyped-call]
        return out
    return fake_quant(x, fmt, dim=dim, backward=backward)


def _bf16_layer(backward: bool, weight: str | None) -> bool:
    """Whether the layer policy (``quantpatch_layers``, loaded by the linear file where one is
    set) keeps this linear GEMM in BF16: the forward, or under ``backward`` the input gradient
    (the weight named) or the weight gradient."""
    layers = sys.modules.get(f"{__package__}.quantpatch_layers")
    if layers is None:
        return False
    gemm = ("dgrad" if weight is not None else "wgrad") if backward else "fprop"
    return bool(layers.keeps_bf16(gemm))


def quant_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: str,
    *,
    backward: bool = False,
    weight: str | None = None,
) -> torch.Tensor:
    """``torch.matmul(a, b)`` with both operands quantized along the reduction dimension
    (the last of ``a``, the second to last of ``b``). NVFP4 rounds only ``a`` stochastically
    under ``backward``, and ``nvfp4-2d`` tiles only the weight operand: the one ``weight``
    names (``"a"`` or ``"b"``: init's linear sites say which, since Megatron's autograd
    function hands the weight over as a plain tensor), else a 2-D Parameter or a view of one."""
    if _bf16_layer(backward, weight):  # the BF16 layer policy: quantpatch_layers.py
        return torch.matmul(a, b)
    if fmt == "nvfp4-rht":  # both operands Hadamard-transformed first: quantpatch_rht.py
        from . import quantpatch_rht

        return quantpatch_rht.rht_matmul(a, b, backward=backward)
    bdim = -2 if b.dim() > 1 else -1
    fused = _fused_product(a, b, fmt, backward, backward)
    if fused is not None:
        return fused
    wa, wb = _named_weight(weight, "a"), _named_weight(weight, "b")
    return torch.matmul(
        _q(a, _operand_fmt(a, fmt, wa), -1, backward, wa),
        _q(b, _operand_fmt(b, fmt, wb), bdim, backward and fmt not in NVFP4_FORMATS, wb),
    )


def quant_bmm(
    a: torch.Tensor, b: torch.Tensor, fmt: str, *, backward: bool = False
) -> torch.Tensor:
    """``torch.bmm(a, b)`` with both operands quantized along the reduction dimension (NVFP4:
    ``a`` alone stochastically under ``backward``)."""
    nv = fmt in NVFP4_FORMATS
    fused = _fused_product(a, b, fmt, backward, backward) if a.dim() == b.dim() == 3 else None
    if fused is not None:
        return fused
    return torch.bmm(
        _q(a, _operand_fmt(a, fmt), -1, backward),
        _q(b, _operand_fmt(b, fmt), -2, backward and not nv),
    )


def quant_baddbmm(
    input: torch.Tensor,
    batch1: torch.Tensor,
    batch2: torch.Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    fmt: str,
    backward: bool = False,
) -> torch.Tensor:
    """``torch.baddbmm`` with ``batch1`` and ``batch2`` quantized along the reduction
    dimension. With ``beta == 0`` the ``input`` buffer is never read, so uninitialised memory
    (Megatron passes a preallocated buffer) cannot leak NaN into the scores."""
    nv = fmt in NVFP4_FORMATS
    if beta == 0 and batch1.dim() == batch2.dim() == 3:
        fused = _fused_product(batch1, batch2, fmt, backward, backward)
        if fused is not None:
            return fused if alpha == 1 else fused * alpha
    q1 = _q(batch1, _operand_fmt(batch1, fmt), -1, backward)
    q2 = _q(batch2, _operand_fmt(batch2, fmt), -2, backward and not nv)
    if beta == 0:
        out = torch.bmm(q1, q2)
        return out if alpha == 1 else out * alpha
    return torch.baddbmm(input, q1, q2, beta=beta, alpha=alpha)


# The element formats, scale range and steps that quantpatch's `tensors formats` measures
# candidates with (quantpatch/analysis/tensor_metrics.py), public so that nothing outside this
# module reaches for its private names.
E4M3, E5M2, E2M1 = _E4M3, _E5M2, _E2M1
SCALE_MIN, SCALE_MAX = _SCALE_MIN, _SCALE_MAX
round_element = _round_element
nvfp4 = _nvfp4
# -- flash attention for the FA schemes (Q.K^T quantized, P.V bf16) -----------------------------
#
# ``quant_flash_attention`` fake-quantizes Q and K once, up front, with ``_q`` (the fused kernel
# on CUDA tensors, straight-through for the gradients), exactly the operands and gradients of the
# unfused ``quant_baddbmm``, and runs the bf16 flash-attention kernels of
# ``quantpatch_flash.py`` on them: Q.K^T reads the same quantized values, dQ = dS . K_q and
# dK = dS^T . Q_q as the unfused path's autograd computes them, and no [b * h, sq, sk] tensor is
# made. (Quantizing inside the kernel would redo each K block's quantization for every query
# block, and again in the backward; up front it is one memory-bound pass over Q and over K.)
#
# The patched ``DotProductAttention.forward`` (``quantpatch init``) asks ``flash_eligible`` first
# and returns ``flash_dot_product_attention`` when it may; the unfused path runs otherwise.
# ``QUANTPATCH_FLASH``: ``auto`` (default: CUDA tensors), ``0`` (never), ``1`` (also CPU tensors,
# in Triton's interpreter: ``TRITON_INTERPRET=1``; without it a CPU tensor is an error).

FLASH_MODES = ("auto", "0", "1")
_flash_module: Any = None
_flash_error: str | None = None


def _flash() -> Any:
    """The flash-attention kernels module beside this one, or None (the reason kept)."""
    global _flash_module, _flash_error
    if _flash_module is None and _flash_error is None:
        try:
            from . import quantpatch_flash  # megatron.core or quantpatch.runtime
        except Exception as exc:  # no triton, no package: the unfused path runs
            _flash_error = f"{type(exc).__name__}: {exc}"
        else:
            _flash_module = quantpatch_flash
    return _flash_module


def _flash_mode() -> str:
    mode = os.environ.get("QUANTPATCH_FLASH", "auto")
    if mode not in FLASH_MODES:
        raise ValueError(f"QUANTPATCH_FLASH={mode!r}; expected auto, 0 or 1")
    return mode


def quant_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    fmt: str,
    causal: bool,
    softmax_scale: float,
) -> torch.Tensor:
    """``softmax(softmax_scale * Q_q K_q^T) V`` per head with flash-attention kernels, Q and K
    fake-quantized to ``fmt`` along the head dim (the reduction dim of Q.K^T) as
    ``quant_baddbmm`` quantizes them, V and P.V in the input dtype. Layout ``[s, b, heads,
    head_dim]``: query ``[sq, b, h, d]``, key ``[sk, b, g, d]``, value ``[sk, b, g, dv]`` with
    ``g`` dividing ``h`` (query head ``i`` reads key/value head ``i // (h // g)``); the result
    is ``[sq, b, h, dv]``. ``causal``: key ``j`` is visible from query ``i`` when ``j <= i``
    (``sq == sk``). Needs the Triton kernels: CUDA tensors, or CPU ones in the interpreter."""
    flash = _flash()
    if flash is None:
        raise RuntimeError(f"flash attention needs its Triton kernels: {_flash_error}")
    q = _q(query, _operand_fmt(query, fmt), -1, False)
    k = _q(key, _operand_fmt(key, fmt), -1, False)
    out: torch.Tensor = flash.flash_attention(q, k, value, causal=causal, scale=softmax_scale)
    return out


_FLAG_TRUE = ("1", "true", "yes", "on")
_causal_seen: list[Any] = []  # [(weakref to a mask, its version, whether it is causal)]


def _is_causal_mask(mask: torch.Tensor, sq: int) -> bool:
    """Whether ``mask`` (True = masked, Megatron's convention) is the causal mask of ``sq``
    queries for every batch and head. Remembered for the last mask seen (by identity and
    version): the layers of one step share the data loader's mask, so it is compared once."""
    if _causal_seen:
        ref, version, answer = _causal_seen[0]
        if ref() is mask and mask._version == version:
            return bool(answer)
    answer = (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and tuple(mask.shape[2:]) == (sq, sq)
        and torch.equal(
            mask,
            torch.ones(sq, sq, dtype=torch.bool, device=mask.device).triu(1).expand(mask.shape),
        )
    )
    _causal_seen[:] = [(weakref.ref(mask), mask._version, answer)]
    return answer


def _mask_kind(attention: Any) -> str:
    kind = getattr(attention, "attn_mask_type", None)
    return str(getattr(kind, "name", kind))


def flash_refusal(
    attention: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    qk: str,
    pv: str,
) -> str | None:
    """Why Megatron's ``DotProductAttention`` ``attention`` must take the unfused path for
    these inputs, or None when ``flash_dot_product_attention`` computes what it would (up to
    the rounding of a flash kernel). Raises where ``QUANTPATCH_FLASH=1`` asks for CPU tensors
    outside Triton's interpreter."""
    mode = _flash_mode()
    if mode == "0":
        return "QUANTPATCH_FLASH=0"
    if qk == "bf16":
        return "Q.K^T is bf16: the stock attention runs"
    if pv != "bf16":
        return f"P.V is quantized ({pv}): the flash kernel keeps P.V in bf16"
    if qk not in FORMATS:
        return f"unknown format {qk!r}"
    if os.environ.get("TENSOR_SAVE_ENABLED", "").strip().lower() in _FLAG_TRUE:
        return "the tensor saver is on (it saves the attention probabilities)"
    if not query.is_cuda:
        if mode == "auto":
            return "CPU tensors"
        if not _interpreted():
            raise RuntimeError(
                f"QUANTPATCH_FLASH=1, but the tensors are on {query.device.type} and compiled "
                "Triton kernels run on CUDA tensors only; set TRITON_INTERPRET=1 to interpret "
                "them on CPU tensors, or QUANTPATCH_FLASH=auto."
            )
    flash = _flash()
    if flash is None:
        return f"no flash-attention kernels ({_flash_error})"
    dropout = getattr(getattr(attention, "attention_dropout", None), "p", 0.0)
    if dropout and attention.training:
        return f"attention dropout {dropout} (the kernel has none)"
    kind = _mask_kind(attention)
    causal = kind == "causal"
    why: str | None = flash.shape_refusal(query, key, value, causal)
    if why is not None:
        return why
    if attention_mask is not None and not (causal and _is_causal_mask(attention_mask, len(query))):
        return f"an attention mask other than the causal one (mask type {kind})"
    if kind not in ("causal", "padding", "no_mask"):
        return f"mask type {kind}"
    return None


def flash_eligible(
    attention: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    qk: str,
    pv: str,
) -> bool:
    """Whether the patched ``DotProductAttention.forward`` may return
    ``flash_dot_product_attention`` (see :func:`flash_refusal` for the reasons it may not)."""
    return flash_refusal(attention, query, key, value, attention_mask, qk=qk, pv=pv) is None


def flash_dot_product_attention(
    attention: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    fmt: str,
) -> torch.Tensor:
    """What Megatron's local ``DotProductAttention.forward`` returns (``[sq, b, heads x
    head_dim]``), computed by :func:`quant_flash_attention`: the scores' scale is the layer's
    ``softmax_scale`` times its softmax's ``scale`` (the layer number under
    ``apply_query_key_layer_scaling``), causal for the causal mask type. The caller has checked
    :func:`flash_eligible`, which has seen ``attention_mask`` (None or the causal mask)."""
    coeff = getattr(getattr(attention, "scale_mask_softmax", None), "scale", None)
    scale = float(attention.softmax_scale) * (float(coeff) if coeff is not None else 1.0)
    causal = _mask_kind(attention) == "causal"
    context = quant_flash_attention(query, key, value, fmt=fmt, causal=causal, softmax_scale=scale)
    return context.view(context.shape[0], context.shape[1], -1)


# -- weights quantized once per optimizer step ---------------------------------------------------
#
# Within an optimizer step the weights do not change, but every micro-batch quantized them again
# (forward: E4M3 along the weight's input dimension; dgrad: E5M2 along its output dimension).
# ``_cached_q`` keeps the fake-quantized weight per (weight, format, dimension, direction,
# view geometry) and hands it back while the weight is provably unchanged:
#
# * the weight's version counter (``_version``, shared by every view of it: ``.add_()``,
#   ``.copy_()``, ``torch.optim`` steps and ``load_state_dict`` all bump it), its ``data_ptr``
#   (``weight.data = other`` swaps the storage), shape, strides, dtype and device;
# * the version counter of the cached tensor itself (an in-place write into what the cache
#   handed out is seen, never served again);
# * a step generation: every ``torch.optim.Optimizer.step`` (a global pre- and post-hook; apex's
#   and Transformer Engine's fused optimizers, which Megatron wraps, are ``Optimizer``
#   subclasses) empties the cache, because Megatron copies its main parameters into the model's
#   through ``param.data`` / multi-tensor kernels, writes that bump no version counter.
#
# What is left uncaught is a write through ``.data`` or a raw kernel outside any optimizer step;
# call ``weight_cache_clear()`` after one. Memory is bounded: at most ``QUANTPATCH_WEIGHT_CACHE_MB``
# MiB (default 8192) of quantized weights per process, entries dropped with their weight (weak
# references); once full, new weights are quantized per call and not kept (a cyclic
# forward/backward order would make an LRU evict every entry before its next use).
# ``weight_cache_stats()`` reports hits, misses and the bytes held. ``QUANTPATCH_WEIGHT_CACHE=0``
# turns the cache off. NVFP4's stochastically rounded operand (``backward=True``) is never cached:
# its bits come from the generator's next draws, and a hit would skip them. HiF8 and ``nvfp4-2d``
# quantize a weight alike for the forward and dgrad (elementwise; square tiles): one entry and
# one quantization a step serve both, the transposed operand a view of it.

_WEIGHT_CACHE_DEFAULT_MB = 8192


class _WeightCache:
    """Quantized weights keyed by the weight's identity (see the section's comment)."""

    def __init__(self) -> None:
        # id(base weight) -> (weak reference to it, {operand key: (stamp, quantized)})
        self.entries: dict[int, tuple[Any, dict[tuple[Any, ...], tuple[Any, torch.Tensor]]]] = {}
        self.bytes = 0
        self.counts = {"hits": 0, "misses": 0, "stale": 0, "over_cap": 0, "bypassed": 0}
        self.generation = 0
        self.hooked = False

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0

    def new_step(self, *_: Any) -> None:
        self.generation += 1
        self.clear()

    def drop(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= sum(_nbytes(q) for _, q in entry[1].values())


_WEIGHT_CACHE = _WeightCache()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _weight_cache_cap() -> int:
    mib = float(os.environ.get("QUANTPATCH_WEIGHT_CACHE_MB", _WEIGHT_CACHE_DEFAULT_MB))
    return int(mib * 2**20)


def weight_cache_enabled() -> bool:
    """Whether weight operands are cached (``QUANTPATCH_WEIGHT_CACHE``, default 1)."""
    value = os.environ.get("QUANTPATCH_WEIGHT_CACHE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"QUANTPATCH_WEIGHT_CACHE={value!r}; expected 0 or 1")
    return value == "1"


def weight_cache_clear() -> None:
    """Forget every cached weight (after a write that bypasses the version counter outside an
    optimizer step, e.g. ``param.data.copy_(...)``)."""
    _WEIGHT_CACHE.new_step()


def weight_cache_reset_stats() -> None:
    for k in _WEIGHT_CACHE.counts:
        _WEIGHT_CACHE.counts[k] = 0


def weight_cache_stats() -> dict[str, float]:
    """Hits, misses (a quantization that was kept), stale (an entry replaced because its weight
    changed), over_cap (quantized per call because the cache was full), bypassed (not
    cacheable: stochastic rounding, inference mode, cache off), the hit ratio of cacheable
    lookups, the weights and entries held and their bytes, the cap and the step generation."""
    c = _WEIGHT_CACHE.counts
    looked = c["hits"] + c["misses"] + c["stale"] + c["over_cap"]
    return {
        **c,
        "hit_ratio": c["hits"] / looked if looked else 0.0,
        "weights": len(_WEIGHT_CACHE.entries),
        "entries": sum(len(e[1]) for e in _WEIGHT_CACHE.entries.values()),
        "bytes": _WEIGHT_CACHE.bytes,
        "cap_bytes": _weight_cache_cap(),
        "generation": _WEIGHT_CACHE.generation,
    }


def _hook_optimizer_steps() -> None:
    if not _WEIGHT_CACHE.hooked:
        from torch.optim import optimizer

        optimizer.register_optimizer_step_pre_hook(_WEIGHT_CACHE.new_step)
        optimizer.register_optimizer_step_post_hook(_WEIGHT_CACHE.new_step)
        _WEIGHT_CACHE.hooked = True


def _layout_free(fmt: str, weight: torch.Tensor) -> bool:
    """Whether ``fmt`` quantizes a weight alike along either dimension and in either direction
    (HiF8: elementwise; ``nvfp4-2d``: 16 x 16 tiles of a matrix and its tensor-wide scale,
    rounded to nearest even, the only rounding a cached weight takes)."""
    return fmt == "hifp8" or (fmt == "nvfp4-2d" and weight.dim() == 2)


def _drop_collected(wid: int, _: object) -> None:
    _WEIGHT_CACHE.drop(wid)


def _weight_fake_quant(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """``fake_quant(x, ...)`` for a weight or a view of one, through the cache."""
    cache = _WEIGHT_CACHE
    if (
        (backward and fmt in NVFP4_FORMATS)  # draws from the generator: never skipped
        or torch.is_inference_mode_enabled()  # inference tensors cannot be saved for backward
        or x.is_inference()
        or not weight_cache_enabled()
    ):
        cache.counts["bypassed"] += 1
        return fake_quant(x, fmt, dim=dim, backward=backward)
    _hook_optimizer_steps()
    base = x._base if x._base is not None else x
    if _layout_free(fmt, base):
        # one entry per weight: a view of it (``weight.t()``) is the same view of its quantized
        # values, and neither the dimension nor the direction changes them
        if x is not base and x.numel() == base.numel() and base.is_contiguous():
            q_base = _weight_fake_quant(base, fmt, -1, False)
            if q_base.stride() == base.stride():
                offset = q_base.storage_offset() + x.storage_offset() - base.storage_offset()
                return q_base.as_strided(x.shape, x.stride(), offset).detach()
        dim, backward = -1, False
    wid = id(base)
    entry = cache.entries.get(wid)
    if entry is not None and entry[0]() is not base:  # the id of a collected weight, reused
        cache.drop(wid)
        entry = None
    key = (
        fmt,
        dim % max(1, x.dim()),
        backward,
        tuple(x.shape),
        x.stride(),
        x.storage_offset(),
        x.dtype,
        x.device,
    )
    stamp = (x._version, x.data_ptr())
    if entry is not None and key in entry[1]:
        (old_stamp, q_version), q = entry[1][key]
        if old_stamp == stamp and q._version == q_version:
            cache.counts["hits"] += 1
            return q.detach()  # a new alias each time: autograd never touches the kept object
        del entry[1][key]
        cache.bytes -= _nbytes(q)
        stale = True
    else:
        stale = False
    q = fake_quant(x, fmt, dim=dim, backward=backward)
    if cache.bytes + _nbytes(q) > _weight_cache_cap():
        cache.counts["over_cap"] += 1
        return q
    cache.counts["stale" if stale else "misses"] += 1
    if entry is None:
        ref = weakref.ref(base, functools.partial(_drop_collected, wid))
        entry = (ref, {})
        cache.entries[wid] = entry
    entry[1][key] = ((stamp, q._version), q)
    cache.bytes += _nbytes(q)
    return q.detach()


def _cached_q(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """``_q`` for a weight operand (a weight or a view of one): quantized once per step
    through the cache, the straight-through gradient reaching the weight under autograd."""
    if fmt == "bf16":
        return x
    if x.requires_grad and torch.is_grad_enabled():
        out: torch.Tensor = _StraightThrough.apply(x, fmt, dim, backward, True)  # type: ignore[no-untyped-call]
        return out
    return _weight_fake_quant(x, fmt, dim, backward)


# -- the quantized GEMM: operands quantized in the GEMM's tile loop, or separately -------------
#
# ``quant_matmul``, ``quant_bmm`` and ``quant_baddbmm`` (``beta == 0``) have two ways to
# compute an MX or HiF8 product: *separate* (two fake-quant kernels, then ``torch.matmul`` of
# the quantized operands: the path above) and *fused* (``quantpatch_kernels.quant_gemm``, one
# Triton GEMM that quantizes each operand tile as it loads it; no quantized copy is written).
# ``QUANTPATCH_GEMM`` chooses: ``auto`` (default: on CUDA, both are timed once per problem,
# i.e. shapes, layouts, dtype, format and direction, on its first call, and the faster is kept
# for the process, see ``gemm_choices()``; CPU tensors and ``QUANTPATCH_KERNELS=reference``
# take the separate path), ``separate`` (always), ``fused`` (wherever the GEMM applies; CPU
# tensors need ``TRITON_INTERPRET=1``). The fused GEMM applies to MX and HiF8 operands of a
# bf16, fp16 or fp32 product outside autograd (Megatron's linear layer computes its forward,
# dgrad and wgrad products inside its own autograd function: there it applies; a product whose
# operands need gradients keeps the quantized operands for its backward, so it is separate).
# NVFP4 is always separate (a tensor-wide amax and random draws). A weight operand that the
# weight cache holds enters the fused GEMM already quantized (only the other operand is
# quantized in the loop). Both paths quantize bit for bit alike; the product differs only in
# the order of its float32 sums (a few units in the last place of float32 before the output's
# rounding), so auto's choice changes results within that.

_GEMM_FORMATS = ("mxfp8", "mxfp4", "hifp8")
_GEMM_CHOICES: dict[tuple[Any, ...], str] = {}


def _gemm_mode() -> str:
    mode = os.environ.get("QUANTPATCH_GEMM", "auto")
    if mode not in ("auto", "fused", "separate"):
        raise ValueError(f"QUANTPATCH_GEMM={mode!r}; expected auto, fused or separate")
    return mode


def gemm_choices() -> dict[str, str]:
    """auto's measured choice per problem so far, ``"key": "fused" | "separate"``."""
    return {repr(k): v for k, v in _GEMM_CHOICES.items()}


def _cuda_time(fn: Callable[[], object], reps: int = 3) -> float:
    """Median seconds of ``fn`` on the current CUDA stream (after one warm-up call, which also
    autotunes a Triton kernel)."""
    fn()
    samples = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(float(start.elapsed_time(end)) / 1e3)
    return sorted(samples)[len(samples) // 2]


_gemm_timer: Callable[[Callable[[], object]], float] = _cuda_time


def _choose_gemm(
    key: tuple[Any, ...], fused: Callable[[], torch.Tensor], separate: Callable[[], torch.Tensor]
) -> str:
    """The cached choice for ``key``, measured with ``_gemm_timer`` the first time."""
    choice = _GEMM_CHOICES.get(key)
    if choice is None:
        choice = "fused" if _gemm_timer(fused) < _gemm_timer(separate) else "separate"
        _GEMM_CHOICES[key] = choice
    return choice


def _auto_fuses(t: torch.Tensor) -> bool:
    """Whether ``auto`` considers the fused GEMM for ``t``'s device: CUDA only (the
    interpreter is a correctness tool, not a candidate for speed)."""
    return t.is_cuda


def _gemm_operand(t: torch.Tensor, fmt: str, dim: int, backward: bool) -> tuple[torch.Tensor, str]:
    """The operand as the GEMM reads it: a weight the cache may hold, already quantized."""
    if _is_weight(t) and weight_cache_enabled() and not torch.is_inference_mode_enabled():
        return _weight_fake_quant(t, fmt, dim, backward), "bf16"
    return t, fmt


def _fused_product(
    a: torch.Tensor, b: torch.Tensor, fmt: str, a_backward: bool, b_backward: bool
) -> torch.Tensor | None:
    """``matmul(q(a, dim=-1), q(b, dim=-2))`` through the fused GEMM, or None where the
    separate path computes it (see the section's comment)."""
    mode = _gemm_mode()
    if mode == "separate" or fmt not in _GEMM_FORMATS:
        return None
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return None
    if a.dtype != b.dtype or a.dtype not in _KERNEL_DTYPES or a.dim() < 2 or b.dim() not in (2, 3):
        return None
    if b.dim() == 3 and (a.dim() != 3 or a.shape[0] != b.shape[0]):
        return None
    if a.shape[-1] != b.shape[-2] or a.device != b.device:
        return None
    if mode == "auto" and (not _auto_fuses(a) or _kernel_mode() == "reference"):
        return None
    if not a.is_cuda and not _interpreted():
        raise RuntimeError(
            f"QUANTPATCH_GEMM=fused, but the tensors are on {a.device.type} and compiled Triton "
            "kernels run on CUDA tensors only; set TRITON_INTERPRET=1 to interpret them on CPU "
            "tensors, or QUANTPATCH_GEMM=auto."
        )
    if _kernels() is None:
        if mode == "fused":
            raise RuntimeError(f"QUANTPATCH_GEMM=fused, but {_kernels_error}")
        return None
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1]) if b.dim() == 2 and a.dim() > 2 else a
    qa, fa = _gemm_operand(a2, fmt, -1, a_backward)
    qb, fb = _gemm_operand(b, fmt, -2, b_backward)

    def fused() -> torch.Tensor:
        out: torch.Tensor = _kernels_module.quant_gemm(qa, qb, fa, fb, a_backward, b_backward)
        return out

    if mode == "auto":

        def separate() -> torch.Tensor:
            return torch.matmul(
                fake_quant(qa, fa, dim=-1, backward=a_backward),
                fake_quant(qb, fb, dim=-2, backward=b_backward),
            )

        key = (
            tuple(a2.shape), a2.stride(), tuple(b.shape), b.stride(), a.dtype, fmt, a_backward,
            b_backward, fa, fb, str(a.device),
        )  # fmt: skip
        if _choose_gemm(key, fused, separate) == "separate":
            return None
    out = fused()
    return out.reshape(*lead, b.shape[-1]) if out.dim() != len(lead) + 1 else out


# ---------------------------------------------------------------------------------------------
# ParetoQ extremely low-bit weights (Liu et al., 2025): values of the linear role only.
#
# ``w1`` (binary), ``w1.58`` (ternary), ``w2`` (stretched elastic quant), ``w3``/``w4`` (LSQ),
# each optionally grouped ``w<b>g<N>``: a learnable step ``alpha`` per output row
# (``[out, 1]``) or per row and group of N input columns (``[out, ceil(in/N)]``), clamped below
# at 1e-5. Activations are not quantized (the products are the plain PyTorch ones); the layer
# quantizes its weight before the linear function, so the input-gradient GEMM uses the
# quantized weight and the weight gradient flows back through :class:`_ParetoQWeight`.
#
# Arithmetic: bf16/fp16 weights are upcast to float32 and every step is a float32 operation
# in ParetoQ's order (``W / alpha`` a division, ``((r + s) / n) * alpha``, ``max|W| / Q_p`` a
# division, ``(c * g) * k``); the quantized weight is rounded once to the weight's dtype. A
# sum over a row or group (the gradient of alpha, the mean |W| of 1-bit) accumulates in
# float64 and is rounded once to float32, so it does not depend on the reduction order: TP
# splits, CPU and CUDA agree wherever the float64 sum is exact (float32 terms within 29
# binades of each other).
# ---------------------------------------------------------------------------------------------

GROUPED_FORMATS = ("w1", "w1.58", "w2", "w3", "w4")
"""The ParetoQ values that accept a ``g<N>`` group suffix (all of them)."""
PARETOQ_BITS = {"w1": 1, "w1.58": 0, "w2": 2, "w3": 3, "w4": 4}
"""Each ParetoQ value's ``w_bits`` in ParetoQ's code (0: ternary)."""
ALPHA_MIN = 1e-5
_SEQ_CLIP = 0.99  # stretched elastic quant clips W / alpha to [-0.99, 0.99]


def paretoq_spec(fmt: str) -> tuple[str, int | None] | None:
    """``(base, group)`` of a ParetoQ value (``group`` None for one step per row), None for
    any other value."""
    base, sep, group = fmt.partition("g")
    if base not in PARETOQ_BITS:
        return None
    if not sep:
        return base, None
    if not group.isdigit() or not group.isascii() or group.startswith("0"):
        return None
    return base, int(group)


def is_paretoq(fmt: str) -> bool:
    return paretoq_spec(fmt) is not None


def _levels(base: str) -> tuple[float, float, float]:
    """``(Q_n, Q_p, P)``: the clip range of ``W / alpha`` and the ``P`` of the gradient scale
    (stretched elastic: the range of the dequantized levels, +-(n - s)/n)."""
    bits = PARETOQ_BITS[base]
    if bits == 1:
        return -1.0, 1.0, 1.0
    if bits in (0, 2):
        n, s = _seq_ns(bits)
        return -(n - s) / n, (n - s) / n, 1.0
    return -float(2 ** (bits - 1)), float(2 ** (bits - 1) - 1), float(2 ** (bits - 1) - 1)


def _seq_ns(bits: int) -> tuple[float, float]:
    return (1.5, 0.0) if bits == 0 else (float(2 ** (bits - 1)), 0.5)


def grad_scale(base: str, numel: int) -> torch.Tensor:
    """``k = 1 / sqrt(numel * P)`` computed in double and rounded to float32 (0-dim)."""
    return torch.tensor(1.0 / math.sqrt(numel * _levels(base)[2]), dtype=torch.float32)


def alpha_columns(fmt: str, in_features: int) -> int:
    """How many steps a row of ``in_features`` columns has under ``fmt``."""
    spec = paretoq_spec(fmt)
    if spec is None:
        raise ValueError(f"{fmt!r} is not a ParetoQ weight format")
    return 1 if spec[1] is None else -(-in_features // spec[1])


def _grouped(t: torch.Tensor, group: int) -> torch.Tensor:
    """``t`` ``[out, in]`` as ``[out, ceil(in/group), group]``, zero-padded at the end."""
    pad = (-t.shape[1]) % group
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(t.shape[0], -1, group)


def _expand(alpha: torch.Tensor, shape: torch.Size, group: int | None) -> torch.Tensor:
    """The step of each weight element (``[out, 1]`` broadcasts as it is)."""
    if group is None:
        return alpha
    return alpha.repeat_interleave(group, dim=1)[:, : shape[1]]


def _row_sum(t: torch.Tensor, group: int | None) -> torch.Tensor:
    """Per row (``[out, 1]``) or per row and group (``[out, G]``) sums of float32 ``t``,
    accumulated in float64 (not rounded)."""
    t = t.to(torch.float64)
    if group is None:
        return t.sum(dim=-1, keepdim=True)
    return _grouped(t, group).sum(dim=-1)


def _clamped(alpha: torch.Tensor) -> torch.Tensor:
    a = alpha.to(torch.float32)
    eps = torch.tensor(ALPHA_MIN, dtype=torch.float32, device=a.device)
    return torch.where(a > eps, a, eps)


def _seq_levels(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``(round(clamp(q, -0.99, 0.99) * n - s) + s) / n`` in float32."""
    n, s = _seq_ns(bits)
    clip = torch.clamp(q, -_SEQ_CLIP, _SEQ_CLIP)
    return (torch.round(clip * n - s) + s) / n


def paretoq_quantize(w: torch.Tensor, alpha: torch.Tensor, fmt: str) -> torch.Tensor:
    """The quantized weight ``W^`` (``w`` ``[out, in]``, ``alpha`` ``[out, G]``; no autograd),
    in ``w``'s dtype, computed in float32 with ``alpha`` clamped at 1e-5."""
    spec = paretoq_spec(fmt)
    if spec is None:
        raise ValueError(f"{fmt!r} is not a ParetoQ weight format")
    base, group = spec
    bits = PARETOQ_BITS[base]
    w32 = w.to(torch.float32)
    a = _expand(_clamped(alpha), w.shape, group)
    if bits == 1:
        out = torch.sign(w32) * a
    elif bits in (0, 2):
        out = _seq_levels(w32 / a, bits) * a
    else:
        qn, qp, _ = _levels(base)
        out = torch.clamp(torch.round(w32 / a), qn, qp) * a
    return out.to(w.dtype)


def paretoq_grads(
    w: torch.Tensor, alpha: torch.Tensor, grad: torch.Tensor, fmt: str, numel: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dW, dalpha)``: ``dW`` is ``grad`` where ``W / alpha`` lies in the clip range (0
    outside), in ``grad``'s dtype; ``dalpha`` the per row (group) sums of ``(c * g) * k`` as
    float64 (round to float32 after any cross-rank reduction). ``numel`` is the whole
    weight's element count (the gradient scale's; default ``w.numel()``)."""
    spec = paretoq_spec(fmt)
    if spec is None:
        raise ValueError(f"{fmt!r} is not a ParetoQ weight format")
    base, group = spec
    bits = PARETOQ_BITS[base]
    qn, qp, _ = _levels(base)
    w32 = w.to(torch.float32)
    q = w32 / _expand(_clamped(alpha), w.shape, group)
    small, big = _outside(q, base)
    inside = ~(small | big)
    dw = torch.where(inside, grad, torch.zeros_like(grad))
    if bits == 1:
        c = torch.sign(w32)
    else:
        mid = _seq_levels(q, bits) - q if bits in (0, 2) else torch.round(q) - q
        c = torch.where(small, qn, torch.where(big, qp, mid))
    k = grad_scale(base, w.numel() if numel is None else numel).to(q.device)
    contrib = (c * grad.to(torch.float32)) * k
    return dw, _row_sum(contrib, group)


def _outside(q: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``q = W / alpha`` lies below and above the clip range."""
    qn, qp, _ = _levels(base)
    lo, hi = (-_SEQ_CLIP, _SEQ_CLIP) if PARETOQ_BITS[base] in (0, 2) else (qn, qp)
    return q < lo, q > hi


def paretoq_clipped(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Where ``w`` lies outside the clip range at the initial step (a boolean mask)."""
    spec = paretoq_spec(fmt)
    if spec is None:
        raise ValueError(f"{fmt!r} is not a ParetoQ weight format")
    alpha = _expand(_clamped(paretoq_init_alpha(w, fmt)), w.shape, spec[1])
    small, big = _outside(w.to(torch.float32) / alpha, spec[0])
    return small | big


def paretoq_init_alpha(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """ParetoQ's initial step from the weights, float32 ``[out, G]``: mean |W| per row (group)
    for 1 bit, max |W| for ternary and 2 bits, max |W| / Q_p for 3 and 4 bits."""
    sums, counts, maxes = _init_stats(w, fmt)
    return _init_from_stats(fmt, sums, counts, maxes)


def _init_stats(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (group): the float64 sum of |W|, the element count, the float32 max |W|."""
    spec = paretoq_spec(fmt)
    if spec is None:
        raise ValueError(f"{fmt!r} is not a ParetoQ weight format")
    group = spec[1]
    mags = w.detach().to(torch.float32).abs()
    sums = _row_sum(mags, group)
    if group is None:
        maxes = mags.amax(dim=-1, keepdim=True)
        counts = torch.full_like(sums, float(w.shape[1]))
    else:
        maxes = _grouped(mags, group).amax(dim=-1)
        cols = torch.arange(sums.shape[1], dtype=torch.float64, device=w.device)
        counts = torch.clamp(w.shape[1] - cols * group, max=group).expand_as(sums)
    return sums, counts, maxes


def _init_from_stats(
    fmt: str, sums: torch.Tensor, counts: torch.Tensor, maxes: torch.Tensor
) -> torch.Tensor:
    spec = paretoq_spec(fmt)
    assert spec is not None
    bits = PARETOQ_BITS[spec[0]]
    if bits == 1:
        return (sums / counts).to(torch.float32)
    if bits in (0, 2):
        return maxes
    return maxes / _levels(spec[0])[1]


def paretoq_fake_quant(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` (2-D ``[out, in]``) quantized with the step a layer's first forward would take
    (:func:`paretoq_init_alpha`): what ``fake_quant`` does for a ParetoQ value."""
    if w.dim() != 2:
        raise ValueError(f"ParetoQ quantizes 2-D weights [out, in]; got shape {tuple(w.shape)}")
    return paretoq_quantize(w, paretoq_init_alpha(w, fmt), fmt)


class _ParetoQWeight(torch.autograd.Function):
    """``W^`` forward; backward ``dW`` (straight through inside the clip range) and
    ``dalpha``, summed over the TP group ``reduce_group`` where the step is whole on every
    rank (RowParallelLinear's per-row step)."""

    @staticmethod
    def forward(
        ctx: Any,
        w: torch.Tensor,
        alpha: torch.Tensor,
        fmt: str,
        numel: int,
        reduce_group: Any,
    ) -> torch.Tensor:
        ctx.save_for_backward(w, alpha)
        ctx.fmt, ctx.numel, ctx.group = fmt, numel, reduce_group
        return paretoq_quantize(w, alpha, fmt)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        w, alpha = ctx.saved_tensors
        dw, dalpha = paretoq_grads(w, alpha, grad, ctx.fmt, ctx.numel)
        if ctx.group is not None:
            torch.distributed.all_reduce(dalpha, group=ctx.group)
        return dw, dalpha.to(torch.float32).to(alpha.dtype), None, None, None


def paretoq_weight(
    w: torch.Tensor,
    alpha: torch.Tensor,
    fmt: str,
    *,
    numel: int | None = None,
    reduce_group: Any = None,
) -> torch.Tensor:
    """The quantized weight, differentiable in ``w`` and ``alpha``."""
    n = w.numel() if numel is None else numel
    out: torch.Tensor = _ParetoQWeight.apply(w, alpha, fmt, n, reduce_group)  # type: ignore[no-untyped-call]
    return out


# -- the linear layers (init's constructor sites and the forward / checkpoint dispatches) ----


def _tp_size(module: Any, partition_dim: int) -> int:
    if partition_dim == 0:
        return int(module.output_size) // int(module.output_size_per_partition)
    return int(module.input_size) // int(module.input_size_per_partition)


def add_weight_scales(module: Any, fmt: str, *, partition_dim: int) -> None:
    """Give a tensor-parallel linear layer its ParetoQ step ``weight_alpha`` (a Parameter of
    the value's shape, created here so the optimizer and checkpoints see it) and the buffer
    ``weight_alpha_initialized`` (saved with it: a loaded step is not re-initialised). Other
    values, and a layer that takes its weight at forward time, get ``weight_alpha = None``.

    ``partition_dim`` 0 (ColumnParallelLinear): the steps' rows split like the weight's.
    ``partition_dim`` 1 (RowParallelLinear): a per-row step is whole on every rank (its
    initial statistic and gradient reduced over the TP group); a grouped one is split with
    the weight's columns, and a group size must divide the local columns."""
    weight = getattr(module, "weight", None)
    spec = paretoq_spec(fmt)
    if spec is None or weight is None:
        module.register_parameter("weight_alpha", None)
        return
    group = spec[1]
    tp = _tp_size(module, partition_dim)
    out_local, in_local = weight.shape
    if group is not None and partition_dim == 1 and tp > 1 and in_local % group:
        raise ValueError(
            f"{fmt}: the group size {group} does not divide the {in_local} input columns each "
            f"of the {tp} tensor-parallel ranks holds in {type(module).__name__}; choose a "
            "group size that divides them."
        )
    alpha = torch.nn.Parameter(
        torch.ones(
            out_local, alpha_columns(fmt, in_local), dtype=weight.dtype, device=weight.device
        )
    )
    split = partition_dim == 0 or group is not None
    # Megatron's parallel attributes (the optimizer, grad clipping and checkpoints read them)
    attrs = {
        "tensor_model_parallel": split and tp > 1,
        "partition_dim": partition_dim if split else -1,
        "partition_stride": 1,
        "allreduce": getattr(weight, "allreduce", True),
    }
    for name, value in attrs.items():
        setattr(alpha, name, value)
    module.register_parameter("weight_alpha", alpha)
    module.register_buffer(
        "weight_alpha_initialized", torch.zeros(1, dtype=torch.uint8, device=weight.device)
    )
    module.weight_alpha_format = fmt
    module.weight_alpha_numel = weight.numel() * tp
    module.weight_alpha_tp_axis = partition_dim if split else None
    reduce = partition_dim == 1 and group is None and tp > 1
    if reduce and getattr(module, "tp_group", None) is None:
        raise ValueError(
            f"{type(module).__name__} keeps no tensor-parallel group (megatron-core before "
            f"0.13), which a whole per-row ParetoQ step under tensor parallelism needs; use a "
            "grouped value (w2g128, ...) or TP = 1."
        )
    module.weight_alpha_reduce_group = module.tp_group if reduce else None


def paretoq_layer_weight(module: Any, weight: torch.Tensor) -> torch.Tensor:
    """The layer's quantized weight; the first call initialises the step from the weights
    unless a checkpoint brought it (the saved flag)."""
    alpha = module.weight_alpha
    fmt = module.weight_alpha_format
    group = module.weight_alpha_reduce_group
    flag = module.weight_alpha_initialized
    # the flag is read once (a device sync); a checkpoint loaded later brings its own step
    if not getattr(module, "_weight_alpha_ready", False) and not bool(flag.item()):
        with torch.no_grad():
            sums, counts, maxes = _init_stats(weight, fmt)
            if group is not None:
                torch.distributed.all_reduce(sums, group=group)
                torch.distributed.all_reduce(counts, group=group)
                torch.distributed.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX, group=group)
            alpha.copy_(_init_from_stats(fmt, sums, counts, maxes))
            flag.fill_(1)
    module._weight_alpha_ready = True
    return paretoq_weight(weight, alpha, fmt, numel=module.weight_alpha_numel, reduce_group=group)


def paretoq_linear(module: Any, impl: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The layer's linear function (``impl``) with its own weight quantized (a weight handed
    to the forward, such as a shared embedding, is not: it has no step) and the fused
    gradient accumulation off for that call (it would bypass the step's backward; Megatron's
    gradient hooks accumulate the weight's gradient instead)."""
    weight = kwargs.get("weight")
    own = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and own is weight:
        kwargs["weight"] = paretoq_layer_weight(module, own)
        if "gradient_accumulation_fusion" in kwargs:
            kwargs["gradient_accumulation_fusion"] = False
    return impl(*args, **kwargs)


def paretoq_sharded_state_dict(
    module: Any, make: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``make_sharded_tensors_for_checkpoint`` with the step sharded like the weight where it
    is split (ColumnParallelLinear's rows, grouped columns of RowParallelLinear); a whole
    per-row step stays replicated."""
    axis = module.weight_alpha_tp_axis
    if axis is not None:
        if "tensor_parallel_layers_axis_map" in kwargs or len(args) < 3:
            axes = dict(kwargs.get("tensor_parallel_layers_axis_map") or {})
            kwargs["tensor_parallel_layers_axis_map"] = {**axes, "weight_alpha": axis}
        else:
            args = (*args[:2], {**(args[2] or {}), "weight_alpha": axis}, *args[3:])
    return make(*args, **kwargs)
