"""Which code quantizes an MX, HiF8, NVFP4 or FP8 tensor (part of ``quantpatch_ops``' dispatch):
the fused Triton kernels of ``quantpatch_kernels.py`` and ``quantpatch_fp8_kernels.py``
(``QUANTPATCH_KERNELS``), the PyTorch
reference through ``torch.compile`` (``QUANTPATCH_COMPILE``), or the reference itself, slice by
slice on CPU. ``quantpatch_ops.fake_quant`` validates the value and hands every element format
to :func:`quantize` here.

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from . import quantpatch_env as env
from . import quantpatch_formats as formats
from .quantpatch_fp8 import (
    FP8_BLOCK,
    FP8_FORMATS,
    finite_amax,
    fp8_quantize,
    fp8_tensor_factored,
    tensor_codes,
    tensor_scales,
)
from .quantpatch_mx import BLOCK
from .quantpatch_mx import hifp8 as _hifp8
from .quantpatch_mx import mx as _mx
from .quantpatch_nvfp4 import (
    FOUR_OVER_SIX,
    NV_BLOCK,
    NVFP4_FORMATS,
    PLAIN,
    nvfp4_4over6_factored,
    nvfp4_factored,
    nvfp4_value,
    sr_bits,
    tensor_decode,
)

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

MX_ELEMENTS = {
    f.name: (
        formats.ELEMENTS[str(f.input)],
        formats.ELEMENTS[str(f.grad_output)],
        str(f.scale).removeprefix("e8m0-"),
    )
    for f in formats.SPECS
    if f.family == "mx"
}
"""The MX values of the spec: their elements (forward, ``backward=True``) and E8M0 scale rule
(``floor`` or ``rceil``)."""
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


_fp8_kernels_module: Any = None
_fp8_kernels_error: str | None = None


def _fp8_kernels() -> Any:
    """The FP8 kernels module beside this one (``quantpatch_fp8_kernels.py``), or None where it
    cannot be imported (an older checkout without it: the reference runs, unless
    ``QUANTPATCH_KERNELS=triton`` asked for kernels)."""
    global _fp8_kernels_module, _fp8_kernels_error
    if _fp8_kernels_module is None and _fp8_kernels_error is None:
        try:
            from . import quantpatch_fp8_kernels
        except Exception as exc:
            _fp8_kernels_error = f"{type(exc).__name__}: {exc}"
        else:
            _fp8_kernels_module = quantpatch_fp8_kernels
    if _fp8_kernels_module is None and _kernel_mode() == "triton":
        raise RuntimeError(f"QUANTPATCH_KERNELS=triton, but {_fp8_kernels_error}")
    return _fp8_kernels_module


_gemm_kernels_module: Any = None
_gemm_kernels_error: str | None = None


def _gemm_kernels() -> Any:
    """The quantized GEMM's module beside this one (``quantpatch_gemm_kernels.py``), or None
    where it or the kernels it shares cannot be imported (:func:`kernels_error` says why)."""
    global _gemm_kernels_module, _gemm_kernels_error
    if _kernels() is None:
        return None
    if _gemm_kernels_module is None and _gemm_kernels_error is None:
        try:
            from . import quantpatch_gemm_kernels
        except Exception as exc:  # an older checkout without it: the separate path runs
            _gemm_kernels_error = f"{type(exc).__name__}: {exc}"
        else:
            _gemm_kernels_module = quantpatch_gemm_kernels
    return _gemm_kernels_module


def _kernel_mode() -> str:
    return env.kernels()


def _interpreted() -> bool:
    """Whether Triton runs its kernels in its interpreter, the only way they read CPU tensors."""
    return env.triton_interpret()


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


MIN_CAPABILITY = (8, 0)
"""The oldest GPU generation the Triton kernels are built for (compute capability; Ampere):
every kernel is compiled for sm_80, sm_86, sm_89, sm_90, sm_100 and sm_120 in CI."""
_CAPABILITY_OK: set[Any] = set()


def require_capability(device: torch.device) -> None:
    """Refuse, in one sentence and before any kernel is built, a CUDA device older than
    :data:`MIN_CAPABILITY` (Triton has no bf16 tensor-core product there)."""
    if device in _CAPABILITY_OK:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise RuntimeError(
            f"quantpatch's Triton kernels need an NVIDIA GPU of compute capability 8.0 "
            f"(A100) or later, and this one ({device}) is {major}.{minor}; set "
            "QUANTPATCH_KERNELS=reference and QUANTPATCH_FLASH=0 to quantize with PyTorch "
            "and keep the stock attention."
        )
    _CAPABILITY_OK.add(device)


KERNELS_PATH_LINE = "[quantpatch] quant kernels: "
"""How the line that says which code quantizes a run's CUDA tensors begins: printed once per
process on rank 0 at the first CUDA tensor, ``triton`` or ``reference (why)`` (a failed Triton
import says its error there), as the attention path announces itself."""
_kernels_said: list[str] = []


def say_kernels(device: str = "cuda") -> None:
    """Print, once per process (on rank 0), which path ``fake_quant`` takes for tensors on
    ``device`` (:func:`kernels_in_use`)."""
    if _kernels_said or not env.first_rank():
        return
    _kernels_said.append(kernels_in_use(device))
    print(f"{KERNELS_PATH_LINE}{_kernels_said[0]}", file=sys.stderr, flush=True)


def _use_kernels(x: torch.Tensor) -> bool:
    if x.is_cuda and not _kernels_said:
        say_kernels(x.device.type)
    mode = _kernel_mode()
    if mode == "reference" or x.dtype not in _KERNEL_DTYPES:
        return False
    if x.is_cuda:
        require_capability(x.device)
    else:
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


_COMPILE = env.compile_reference()
_COMPILED: dict[tuple[str, bool], Callable[[torch.Tensor, int], torch.Tensor]] = {}


def quantize(x: torch.Tensor, fmt: str, dim: int = -1, backward: bool = False) -> torch.Tensor:
    """``x`` quantized to the element format ``fmt`` (``bf16``: ``x``) and dequantized, by the
    kernels or the reference; ``fmt`` checked by the caller (``quantpatch_ops.fake_quant``)."""
    if fmt == "bf16":
        return x
    formats.spec_of(fmt)  # an unknown name: one sentence, never another format's result
    if x.numel() == 0:
        return x.clone()
    rand = sr_bits(x) if backward and fmt in NVFP4_FORMATS else None
    if rand is not None and fmt in FOUR_OVER_SIX:  # TE's gradient slots take no 4over6
        fmt = PLAIN
    if _use_kernels(x):
        if fmt in FP8_FORMATS:
            fp8_kernels = _fp8_kernels()
            if fp8_kernels is not None:
                done: torch.Tensor = fp8_kernels.fake_quant(x, fmt, dim, backward)
                return done
        else:
            out: torch.Tensor = _kernels_module.fake_quant(x, fmt, dim, backward, rand)
            return out
    if fmt in NVFP4_FORMATS:  # random draws: not compiled
        return _fake_quant(x, fmt, dim, backward, rand)
    if _COMPILE:
        return _compiled(fmt, backward)(x, dim)
    return _fake_quant(x, fmt, dim, backward)


def _one_value(t: torch.Tensor, d: int, fmt: str = "", backward: bool = False) -> torch.Tensor:
    return _fake_quant(t, fmt, d, backward)


def _compiled(fmt: str, backward: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The compiled quantizer of one format and direction, made once, with a code object of
    its own: Dynamo keeps its graphs per code object, at most ``recompile_limit`` (8) of
    them, so one function shared by every value (a closure's constants are guards) was
    compiled again per value and, past the eighth, ran eagerly without a word."""
    key = (fmt, backward)
    if key not in _COMPILED:
        name = "fake_quant_" + "".join(c if c.isalnum() else "_" for c in fmt)
        code = _one_value.__code__.replace(co_name=name + ("_backward" if backward else ""))
        one = types.FunctionType(code, _one_value.__globals__, code.co_name, (fmt, backward))
        _COMPILED[key] = torch.compile(one, dynamic=True)
    return _COMPILED[key]


_CHUNK = 1 << 18  # elements per slice on CPU: the ~30 temporaries stay in cache


def _fake_quant(
    x: torch.Tensor, fmt: str, dim: int, backward: bool, rand: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference path (``rand``: the stochastic-rounding draws of ``nvfp4`` backward)."""
    if fmt in FP8_FORMATS:
        if x.device.type == "cpu" and x.numel() > 2 * _CHUNK and x.dim() >= 1:
            return _fp8_sliced(x, fmt, dim, backward)
        return fp8_quantize(x, fmt, dim, backward)
    if fmt in NVFP4_FORMATS:
        two_d, r = formats.spec_of(fmt).tiled, rand if backward else None
        if r is not None and fmt in FOUR_OVER_SIX:
            fmt = PLAIN
        if x.device.type == "cpu" and x.numel() > 2 * _CHUNK and x.dim() >= 1:
            return _nv_sliced(x, fmt, dim, two_d, r)
        return nvfp4_value(x, fmt, dim, two_d, r)
    if x.device.type == "cpu" and x.numel() > 2 * _CHUNK and x.dim() >= 1:
        return _sliced(x, fmt, dim, backward)
    return _whole(x, fmt, dim, backward)


def _by_slices(
    x: torch.Tensor,
    spanned: set[int],
    block: int,
    quantize_part: Callable[[int, int, int], torch.Tensor],
) -> torch.Tensor:
    """The same arithmetic slice by slice into one output: on CPU the temporaries of a slice
    fit in cache and their memory is reused, where a whole large tensor makes every pass a
    fresh allocation (page faults) and a trip to main memory. Slices never cut a block: they
    run along the largest dimension the blocks do not span (``spanned``), else along one they
    do in multiples of ``block``. ``quantize_part(split, start, n)`` quantizes
    ``x.narrow(split, start, n)``."""
    others = [i for i in range(x.dim()) if i not in spanned]
    split = max(others, key=lambda i: x.shape[i]) if others else min(spanned)
    per_index = x.numel() // max(1, x.shape[split])
    step = max(1, _CHUNK // max(1, per_index))
    if split in spanned:
        step = max(block, step - step % block)
    out = torch.empty_like(x)
    for start in range(0, x.shape[split], step):
        n = min(step, x.shape[split] - start)
        out.narrow(split, start, n).copy_(quantize_part(split, start, n))
    return out


def _sliced(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """MX and HiF8 slice by slice (:func:`_by_slices`; MX blocks of 32 along ``dim``)."""
    return _by_slices(
        x,
        {dim % x.dim()},
        BLOCK,
        lambda split, start, n: _whole(x.narrow(split, start, n), fmt, dim, backward),
    )


def _nv_sliced(
    x: torch.Tensor, fmt: str, dim: int, two_d: bool, rand: torch.Tensor | None
) -> torch.Tensor:
    """NVFP4 slice by slice (:func:`_by_slices`), every slice with the whole tensor's amax;
    blocks of 16 along ``dim``, or 16 x 16 tiles over the last two dimensions."""
    v = x.to(torch.float32)
    amax = torch.where(torch.isfinite(v), v.abs(), torch.zeros_like(v)).amax()
    del v
    spanned = {x.dim() - 2, x.dim() - 1} if two_d and x.dim() >= 2 else {dim % x.dim()}

    def part(split: int, start: int, n: int) -> torch.Tensor:
        r = None if rand is None else rand.narrow(split, start, n)
        return nvfp4_value(x.narrow(split, start, n), fmt, dim, two_d, r, amax)

    return _by_slices(x, spanned, NV_BLOCK, part)


def _fp8_sliced(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """FP8 slice by slice (:func:`_by_slices`): ``fp8-tensor`` with the whole tensor's amax;
    slices never cut an ``fp8-block`` block or tile (along a dimension it spans, multiples of
    128)."""
    spec = formats.spec_of(fmt)
    amax = finite_amax(x) if spec.family == "fp8-tensor" else None
    d = dim % x.dim()
    spanned = {d} if spec.family == "fp8-block" else set()
    if spec.tiled:
        spanned = {x.dim() - 2, x.dim() - 1} if x.dim() >= 2 else {d}
    return _by_slices(
        x,
        spanned,
        FP8_BLOCK,
        lambda split, start, n: fp8_quantize(x.narrow(split, start, n), fmt, dim, backward, amax),
    )


def _whole(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """An MX, FP8 or HiF8 tensor by the reference; any other name is an error (never another
    format's result)."""
    family = formats.spec_of(fmt).family
    if family == "mx":
        forward_elem, gradient_elem, rule = MX_ELEMENTS[fmt]
        return _mx(x, dim, gradient_elem if backward else forward_elem, rule)
    if fmt in FP8_FORMATS:
        return fp8_quantize(x, fmt, dim, backward)
    if family == "hifp8":
        return _hifp8(x)
    raise ValueError(f"{fmt!r} (family {family}) is not an element format the reference quantizes")


# -- the operands a product multiplies: code x block scale, the tensor's scale factored out ------
#
# A tensor core multiplies FP8/FP4 codes and applies their scales in float32: a power-of-two
# block scale (MX, fp8-block) or an E4M3 one (NVFP4) inside the product, a per-tensor float32
# scale (fp8-tensor, fp8-delayed, NVFP4's) to its float32 result. A fake-quantized operand of
# a bf16 or fp16 product is code x scale rounded to that dtype; code x block scale is exact
# there (at most 6 significant bits, within range), code x a float32 tensor scale mostly is
# not. So for the values with a per-tensor scale (``factors``) the products take each operand
# as ``(t, f)``: ``t`` code x block scale in the training dtype, exact, ``f`` its per-tensor
# float32 scale, and compute ``(t_a @ t_b)`` accumulated in float32 times ``f_a * f_b`` (one
# float32 multiplication of the float32 result, as TE's GEMMs apply ``alpha``), rounded once
# to the training dtype. Float32 and float64 products hold code x scale already and keep the
# fake-quantized operands. Gradients stay straight through: a product that needs them is
# differentiated as the product of the dequantized operands ``t * f`` (``ScaledProduct``).

TENSOR_SCALES = ("e4m3-fp32", "fp32", "fp32-delayed")
"""The spec's scale rules with a float32 per-tensor scale, which the products factor out."""
FACTORED_DTYPES = (torch.bfloat16, torch.float16)
"""The training dtypes whose products take factored operands."""


def factors(fmt: str, dtype: torch.dtype) -> bool:
    """Whether the products give ``fmt``'s operands of ``dtype`` as code x block scale with
    the per-tensor float32 scale applied to the float32 result (see the section's comment)."""
    spec = formats.spec_of(fmt)
    return dtype in FACTORED_DTYPES and spec.scale in TENSOR_SCALES and spec.family != "paretoq"


def quantize_factored(
    x: torch.Tensor,
    fmt: str,
    dim: int = -1,
    backward: bool = False,
    rand: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t, f)``: ``x`` quantized to ``fmt`` (``fp8-tensor``, or an NVFP4 value without the
    transform) as code x block scale in ``x``'s dtype, exactly, and its per-tensor float32
    decode scale (0-d), by the kernels or the reference; ``t * f`` in float32 is what
    :func:`quantize` rounds to ``x``'s dtype. ``rand``: NVFP4's random bits, where the caller
    drew them (default: drawn here under ``backward``, as :func:`quantize` draws them)."""
    spec = formats.spec_of(fmt)
    if spec.family == "fp8-tensor":
        elem = formats.ELEMENTS[str(spec.grad_output if backward else spec.input)]
        amax = finite_amax(x)
        scale, scale_inv = tensor_scales(amax, elem[2], x.dtype)
        if x.numel() and _use_kernels(x):
            fp8_kernels = _fp8_kernels()
            if fp8_kernels is not None:
                t: torch.Tensor = fp8_kernels.codes(x, scale, elem)
                return t, scale_inv.reshape(())
        if x.device.type == "cpu" and x.numel() > 2 * _CHUNK and x.dim() >= 1:
            return _by_slices(
                x, set(), 1, lambda sp, st, n: tensor_codes(x.narrow(sp, st, n), scale, elem)
            ), scale_inv.reshape(())
        return fp8_tensor_factored(x, backward, amax, fmt)
    if fmt not in NVFP4_FORMATS:
        raise ValueError(f"{fmt!r} has no per-tensor scale to factor out")
    if backward and fmt in FOUR_OVER_SIX:  # TE's gradient slots take no 4over6
        fmt = PLAIN
    if rand is None and backward:
        rand = sr_bits(x)
    bits = rand if backward else None
    if x.numel() == 0:
        return x.clone(), torch.ones((), dtype=torch.float32, device=x.device)
    two_d = formats.spec_of(fmt).tiled and x.dim() >= 2
    amax = finite_amax(x)
    if _use_kernels(x):
        done: torch.Tensor = _kernels_module.fake_quant(x, fmt, dim, backward, bits, factored=True)
        return done, tensor_decode(amax, fmt)

    def factored(t: torch.Tensor, r: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if fmt in FOUR_OVER_SIX:
            return nvfp4_4over6_factored(t, fmt, dim, two_d, amax)
        return nvfp4_factored(t, dim, two_d, r, amax)

    if x.device.type == "cpu" and x.numel() > 2 * _CHUNK and x.dim() >= 1:
        spanned = {x.dim() - 2, x.dim() - 1} if two_d else {dim % x.dim()}

        def part(split: int, start: int, n: int) -> torch.Tensor:
            r = None if bits is None else bits.narrow(split, start, n)
            return factored(x.narrow(split, start, n), r)[0]

        return _by_slices(x, spanned, NV_BLOCK, part), tensor_decode(amax, fmt)
    return factored(x, bits)


_OUT_DTYPE_MM: list[bool] = []  # whether CUDA's mm/bmm take out_dtype (asked once)


def f32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``torch.matmul``'s shapes) accumulated and returned in float32, for bf16 or
    fp16 operands that hold their values exactly: on CUDA the dtype's own GEMM with a float32
    output (``out_dtype``) where PyTorch has it, else the float32 product of the upcast
    operands (the same products, exact in float32)."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in FACTORED_DTYPES and _OUT_DTYPE_MM != [False]:
        try:
            if b.dim() == 2 and a.dim() >= 2:
                out = torch.mm(a.reshape(-1, a.shape[-1]), b, out_dtype=torch.float32)
                _OUT_DTYPE_MM[:] = [True]
                return out.reshape(*a.shape[:-1], b.shape[-1])
            if a.dim() == b.dim() == 3:
                out = torch.bmm(a, b, out_dtype=torch.float32)
                _OUT_DTYPE_MM[:] = [True]
                return out
        except (RuntimeError, TypeError, NotImplementedError):  # no out_dtype: upcast
            if _OUT_DTYPE_MM != [True]:
                _OUT_DTYPE_MM[:] = [False]
    return torch.matmul(a.to(torch.float32), b.to(torch.float32))


def scaled_matmul(
    ta: torch.Tensor, fa: torch.Tensor | None, tb: torch.Tensor, fb: torch.Tensor | None
) -> torch.Tensor:
    """``(ta @ tb) * (fa * fb)``: the product of factored operands accumulated in float32, the
    per-tensor scales (None: 1) multiplying the float32 result once, rounded once to the
    operands' dtype."""
    acc = f32_matmul(ta, tb)
    alpha = fa if fb is None else (fb if fa is None else fa * fb)
    if alpha is not None:
        acc = acc * alpha.to(acc.device)
    return acc.to(torch.promote_types(ta.dtype, tb.dtype))


def dequantized(t: torch.Tensor, f: torch.Tensor | None) -> torch.Tensor:
    """A factored operand's values ``t * f`` (float32), in ``t``'s dtype."""
    return t if f is None else (t.to(torch.float32) * f.to(t.device)).to(t.dtype)


class ScaledProduct(torch.autograd.Function):
    """Forward: :func:`scaled_matmul` of factored operands. Backward: the gradients of
    ``torch.matmul`` of the dequantized operands, reaching ``a`` and ``b`` straight through
    (as the product of fake-quantized operands gives them)."""

    @staticmethod
    def forward(
        ctx: Any,
        a: torch.Tensor,
        b: torch.Tensor,
        ta: torch.Tensor,
        fa: torch.Tensor | None,
        tb: torch.Tensor,
        fb: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(ta, tb)
        ctx.scales = (fa, fb)
        return scaled_matmul(ta, fa, tb, fb)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ta, tb = ctx.saved_tensors
        fa, fb = ctx.scales
        with torch.enable_grad():
            da = dequantized(ta, fa).detach().requires_grad_(bool(ctx.needs_input_grad[0]))
            db = dequantized(tb, fb).detach().requires_grad_(bool(ctx.needs_input_grad[1]))
            out = torch.matmul(da, db)
            wanted = [t for t in (da, db) if t.requires_grad]
            grads = list(torch.autograd.grad(out, wanted, grad)) if wanted else []
        ga = grads.pop(0) if da.requires_grad else None
        gb = grads.pop(0) if db.requires_grad else None
        return ga, gb, None, None, None, None


def factored_product(
    a: torch.Tensor,
    b: torch.Tensor,
    qa: tuple[torch.Tensor, torch.Tensor | None],
    qb: tuple[torch.Tensor, torch.Tensor | None],
) -> torch.Tensor:
    """The product of ``a`` and ``b`` from their factored operands ``qa``, ``qb``
    (:func:`scaled_matmul`), straight-through gradients where autograd asks for them."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        out: torch.Tensor = ScaledProduct.apply(a, b, qa[0], qa[1], qb[0], qb[1])  # type: ignore[no-untyped-call]
        return out
    return scaled_matmul(qa[0], qa[1], qb[0], qb[1])


# the names the other runtime modules use (nothing outside this module takes its private names)
KERNEL_DTYPES = _KERNEL_DTYPES
kernels = _kernels
gemm_kernels = _gemm_kernels
kernel_mode = _kernel_mode
interpreted = _interpreted


def kernels_error() -> str | None:
    """Why the Triton kernels (or the GEMM's, beside them) could not be imported (None: they
    were, or were not tried)."""
    return _kernels_error or _gemm_kernels_error
