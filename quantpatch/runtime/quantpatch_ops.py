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
* ``hifp8``: per tensor, no scale: 3/2/1 mantissa bits for |e| <= 3/7/15, powers of two
  2^-22..2^-16 below 2^-15, zero below, saturation at 2^15, ties away from zero.
* ``bf16``: the identity.

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

``QUANTPATCH_COMPILE=1`` runs the PyTorch code through ``torch.compile`` (one fused kernel per
format instead of ~30 elementwise passes; bit-identical results, tested).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

FORMATS = ("bf16", "mxfp8", "mxfp4", "hifp8", "nvfp4", "nvfp4-2d")
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
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")
    if x.numel() == 0:
        return x.clone()
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
    """Forward: the fake-quantized tensor, exactly. Backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
        return fake_quant(x, fmt, dim=dim, backward=backward)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


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


def _q(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    if fmt == "bf16":
        return x
    if x.requires_grad and torch.is_grad_enabled():
        out: torch.Tensor = _StraightThrough.apply(x, fmt, dim, backward)  # type: ignore[no-untyped-call]
        return out
    return fake_quant(x, fmt, dim=dim, backward=backward)


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
    bdim = -2 if b.dim() > 1 else -1
    return torch.matmul(
        _q(a, _operand_fmt(a, fmt, _named_weight(weight, "a")), -1, backward),
        _q(
            b,
            _operand_fmt(b, fmt, _named_weight(weight, "b")),
            bdim,
            backward and fmt not in NVFP4_FORMATS,
        ),
    )


def quant_bmm(
    a: torch.Tensor, b: torch.Tensor, fmt: str, *, backward: bool = False
) -> torch.Tensor:
    """``torch.bmm(a, b)`` with both operands quantized along the reduction dimension (NVFP4:
    ``a`` alone stochastically under ``backward``)."""
    nv = fmt in NVFP4_FORMATS
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
    q1 = _q(batch1, _operand_fmt(batch1, fmt), -1, backward)
    q2 = _q(batch2, _operand_fmt(batch2, fmt), -2, backward and not nv)
    if beta == 0:
        out = torch.bmm(q1, q2)
        return out if alpha == 1 else out * alpha
    return torch.baddbmm(input, q1, q2, beta=beta, alpha=alpha)
