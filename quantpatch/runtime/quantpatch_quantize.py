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
from .quantpatch_fp8 import FP8_BLOCK, FP8_FORMATS, finite_amax, fp8_quantize
from .quantpatch_mx import BLOCK
from .quantpatch_mx import hifp8 as _hifp8
from .quantpatch_mx import mx as _mx
from .quantpatch_nvfp4 import FOUR_OVER_SIX, NV_BLOCK, NVFP4_FORMATS, nvfp4_value, sr_bits

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
        fmt = "nvfp4"
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
            fmt = "nvfp4"
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


# the names the other runtime modules use (nothing outside this module takes its private names)
KERNEL_DTYPES = _KERNEL_DTYPES
kernels = _kernels
kernel_mode = _kernel_mode
interpreted = _interpreted


def kernels_error() -> str | None:
    """Why the Triton kernels could not be imported (None: they were, or were not tried)."""
    return _kernels_error
