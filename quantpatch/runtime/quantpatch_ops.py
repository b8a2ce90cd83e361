"""Fake quantization for every format of the spec, ``quantpatch_formats.py`` (MX, NVFP4,
TransformerEngine's FP8 recipes, HiFP8, ParetoQ: quantize, then dequantize to the working
dtype), and the quantized products that fork-layout sites dispatch to.

Installed by ``quantpatch init`` in the package ``megatron/core/quantpatch/`` (its
``__init__.py`` says what each module is), with the modules it imports beside it, one
concern each: ``quantpatch_formats.py`` (the format spec: every value
and what it quantizes with, standard library only), ``quantpatch_env.py`` (every environment
variable the runtime reads), ``quantpatch_mx.py`` (MX and HiF8),
``quantpatch_fp8.py`` (fp8-tensor, fp8-block), ``quantpatch_delayed.py`` (fp8-delayed, its
per-layer state), ``quantpatch_nvfp4.py`` (NVFP4 and its
stochastic rounding), ``quantpatch_paretoq.py`` (ParetoQ), ``quantpatch_quantize.py`` (which
code quantizes a tensor: the Triton kernels or the reference) and ``quantpatch_weights.py``
(the weight cache and the GEMM choice); this module holds the dispatch, the products and flash
attention, and every public name below. Torch and the standard library only. Public API::

    fake_quant(x, fmt, *, dim=-1, role=None) -> Tensor
    quant_matmul(a, b, fmt, *, roles=None) -> Tensor   # roles=("grad_output", "weight")
    quant_baddbmm(input, batch1, batch2, *, beta=1.0, alpha=1.0, fmt, backward=False) -> Tensor
    quant_bmm(a, b, fmt, *, backward=False) -> Tensor

Formats: one entry each in ``quantpatch_formats.py`` (its family, element per operand role,
block, scale rule, roles, what a backward GEMM quantizes, rounding, transform, the reference it
equals and the Megatron flags it emulates; ``bf16`` is the identity). The arithmetic of each
family is in its module: ``quantpatch_mx.py`` (OCP MX's FLOOR and NVIDIA's RCEIL scale rules,
HiFloat8), ``quantpatch_fp8.py`` (TE's current and blockwise FP8 scaling),
``quantpatch_delayed.py`` (TE's delayed scaling: each linear layer keeps the amax history and
scales of its operands, so ``fake_quant`` and the attention products refuse it),
``quantpatch_nvfp4.py`` (TE 2.20.2's NVFP4 and the stochastic rounding of gradients, seeded
with ``QUANTPATCH_SR_SEED`` + ``RANK``; ``reset_sr_generators()``), ``quantpatch_rht.py``
(the random Hadamard transform; ``fake_quant`` takes its result back through the inverse
transform) and ``quantpatch_paretoq.py`` (ParetoQ's weights: the layer holds the step and
quantizes its weight itself, so the products leave ParetoQ operands as they are).

The products quantize both operands along the reduction dimension. In bf16 and fp16 a value
with a per-tensor float32 scale (``fp8-tensor``, the delayed values, NVFP4) hands each operand
to the product as code x block scale, exact in that dtype, and its per-tensor scale multiplies
the float32 result once, as a tensor core applies it (``quantpatch_quantize``'s section on
factored operands); other values and float32 products multiply the fake-quantized operands.
A gradient GEMM (``roles`` naming its first operand ``grad_output``: Megatron's dgrad and
wgrad) gives the gradient element and rounding to both operands where an entry's ``backward``
is ``all``, and to the first alone where it is ``grad_output`` (``GRADIENT_OPERAND_ONLY``), the
other keeping its forward element and nearest-even rounding. A value with an operand format of
its own for weights (``nvfp4-2d``'s 16 x 16 tiles, ``fp8-block``'s 128 x 128) gives it to the
weight alone: the operand ``quant_matmul``'s ``roles`` call ``weight`` (init's linear sites
do), else a 2-D ``torch.nn.Parameter`` or a view of one such as ``weight.t()``.

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

import sys
import weakref
from typing import Any

import torch

# the parts, one concern each (the names below are the public API, unchanged for the sites)
from . import quantpatch_env as env
from . import quantpatch_formats as formats

# the parts, one concern each (the names below are the public API, unchanged for the sites)
from .quantpatch_delayed import (
    DELAYED_FORMATS,
    add_delayed_state,
    delayed_matmul,
    is_delayed,
    settled_quantize,
)
from .quantpatch_delayed import refuse_delayed as _refuse_delayed
from .quantpatch_fp8 import FP8_BLOCK, fp8_tensor
from .quantpatch_mx import BLOCK, E2M1, E4M3, E5M2, SCALE_MAX, SCALE_MIN, round_element
from .quantpatch_nvfp4 import (
    NV_BLOCK,
    NVFP4_FORMATS,
    nv_global_scale,
    nvfp4,
    nvfp4_value,
    reset_sr_generators,
    sr_bits,
    sr_seed,
)
from .quantpatch_paretoq import (
    ALPHA_MIN,
    PARETOQ_BITS,
    alpha_columns,
    grad_scale,
    is_paretoq,
    paretoq_clipped,
    paretoq_fake_quant,
    paretoq_grads,
    paretoq_init_alpha,
    paretoq_layer_weight,
    paretoq_linear,
    paretoq_quantize,
    paretoq_sharded_state_dict,
    paretoq_spec,
    paretoq_weight,
)
from .quantpatch_paretoq import add_weight_scales as _paretoq_add_weight_scales
from .quantpatch_quantize import factored_product as _factored_product
from .quantpatch_quantize import factors as _factors
from .quantpatch_quantize import interpreted as _interpreted
from .quantpatch_quantize import kernels_in_use, quantize, quantize_factored, require_capability
from .quantpatch_weights import fused_product as _fused_product
from .quantpatch_weights import (
    gemm_choices,
    weight_cache_clear,
    weight_cache_enabled,
    weight_cache_reset_stats,
    weight_cache_stats,
)
from .quantpatch_weights import is_weight as _is_weight
from .quantpatch_weights import weight_factored as _weight_factored
from .quantpatch_weights import weight_fake_quant as _weight_fake_quant

NV_FORMATS = formats.names(family="nvfp4")
"""The NVFP4 values, ``nvfp4-rht`` included (``NVFP4_FORMATS``: those ``quantpatch_nvfp4``
quantizes itself, without the transform)."""
FORMATS = formats.VALUES
"""Every base value (ParetoQ's ``w<b>`` also take a ``g<N>`` suffix: ``GROUPED_FORMATS``)."""
GROUPED_FORMATS = formats.GROUPED
"""The ParetoQ values that accept a ``g<N>`` group suffix (all of them)."""
GRADIENT_OPERAND_ONLY = formats.names(backward="grad_output")
"""Values whose ``backward=True`` treatment (stochastic rounding, E5M2) the products give
their first operand alone (at Megatron's dgrad and wgrad sites: the output gradient); the
second (the weight, or the saved input) keeps the forward's element, as TE's HYBRID recipes
do. ``mxfp8`` keeps its E5M2 for both operands of a backward GEMM, as it always has."""

__all__ = [
    "ALPHA_MIN",
    "ATTENTION_PATH_LINE",
    "BLOCK",
    "DELAYED_FORMATS",
    "E2M1",
    "E4M3",
    "E5M2",
    "FLASH_MODES",
    "FORMATS",
    "FP8_BLOCK",
    "GRADIENT_OPERAND_ONLY",
    "GROUPED_FORMATS",
    "NVFP4_FORMATS",
    "NV_BLOCK",
    "PARETOQ_BITS",
    "SCALE_MAX",
    "SCALE_MIN",
    "add_delayed_state",
    "add_weight_scales",
    "alpha_columns",
    "fake_quant",
    "flash_bf16",
    "flash_dot_product_attention",
    "flash_eligible",
    "flash_refusal",
    "fp8_tensor",
    "gemm_choices",
    "grad_scale",
    "is_delayed",
    "is_paretoq",
    "kernels_in_use",
    "nv_global_scale",
    "nvfp4",
    "nvfp4_value",
    "paretoq_clipped",
    "paretoq_fake_quant",
    "paretoq_grads",
    "paretoq_init_alpha",
    "paretoq_layer_weight",
    "paretoq_linear",
    "paretoq_quantize",
    "paretoq_sharded_state_dict",
    "paretoq_spec",
    "paretoq_weight",
    "quant_baddbmm",
    "quant_bmm",
    "quant_flash_attention",
    "quant_matmul",
    "reset_sr_generators",
    "round_element",
    "settled_quantize",
    "sr_bits",
    "sr_seed",
    "weight_cache_clear",
    "weight_cache_enabled",
    "weight_cache_reset_stats",
    "weight_cache_stats",
]


def add_weight_scales(module: Any, fmt: str, *, partition_dim: int) -> None:
    """What a linear layer's constructor site asks for its value: ParetoQ's step
    (``quantpatch_paretoq.add_weight_scales``; ``weight_alpha = None`` for other values) and a
    delayed value's amax history and scales (``quantpatch_delayed.add_delayed_state``)."""
    _paretoq_add_weight_scales(module, fmt, partition_dim=partition_dim)
    if is_delayed(fmt):
        add_delayed_state(module, fmt)


def _operand_roles(
    roles: tuple[str, str] | None, backward: bool, weight: str | None
) -> tuple[bool, str | None]:
    """``roles`` (a product's operands named as TransformerEngine names them: ``input``,
    ``weight``, ``grad_output``) as the ``backward`` and ``weight`` the products compute
    with: a product with a ``grad_output`` is a gradient GEMM, and a ``weight`` is the operand
    its format's weight treatment goes to. Without ``roles``, the earlier keywords as given."""
    if roles is None:
        return backward, weight
    if backward or weight is not None:
        raise TypeError("name the operands with roles= alone, not with backward= or weight=")
    if (
        not isinstance(roles, tuple)
        or len(roles) != 2
        or not set(roles) <= set(formats.OPERANDS)
        or roles.count("weight") > 1
        or roles[1] == "grad_output"
    ):
        raise ValueError(
            f"roles={roles!r}; expected two of {', '.join(formats.OPERANDS)}, at most one "
            "weight, and the output gradient, where there is one, first"
        )
    named = {0: "a", 1: "b"}.get(roles.index("weight")) if "weight" in roles else None
    return roles[0] == "grad_output", named


def fake_quant(
    x: torch.Tensor,
    fmt: str,
    *,
    dim: int = -1,
    role: str | None = None,
    backward: bool = False,
) -> torch.Tensor:
    """``x`` quantized to ``fmt`` and dequantized: same shape, same dtype. ``role`` names
    which operand ``x`` is (``input``, ``weight`` or ``grad_output``): a ``grad_output``
    takes the format's gradient element and rounding, a ``weight`` the format's weight
    operand (``nvfp4-2d``'s 16 x 16 tiles, ``fp8-block``'s 128 x 128), an ``input`` the other
    operands' (``nvfp4-2d``: 1 x 16 blocks). Without it, ``fmt``'s own quantization.
    ``backward=True`` is the earlier spelling of ``role="grad_output"``, accepted through the
    next release for code written against it."""
    if role is not None:
        if backward or role not in formats.OPERANDS:
            raise ValueError(
                f"role={role!r}; expected one of {', '.join(formats.OPERANDS)} (without backward=)"
            )
        backward = role == "grad_output"
    if fmt == "bf16":
        return x
    spec = formats.spec_of(fmt)  # an unknown name: one sentence
    if spec.family == "paretoq":  # a weight [out, in], with its layer's initial step
        return paretoq_fake_quant(x, fmt)
    if not spec.roles:
        raise ValueError(f"{fmt!r} is an operand format of the products, not a value")
    _refuse_delayed(fmt, "fake_quant (a tensor without its layer)")
    if spec.rht and x.numel():  # Hadamard-transformed NVFP4: quantpatch_rht.py
        from . import quantpatch_rht

        return quantpatch_rht.fake_quant_rht(x, dim, backward=backward)
    if role is not None:  # the operand format the products give that operand
        fmt = spec.operands[0] if role == "weight" else spec.operands[1]
    return quantize(x, fmt, dim, backward)


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


def _operand_fmt(t: torch.Tensor, fmt: str, weight: bool | None = None) -> str:
    """``nvfp4-2d`` tiles weights only; every other operand takes 1-D ``nvfp4`` blocks.
    ``fp8-block`` gives a weight 128 x 128 tiles (the operand format ``fp8-block-2d``), every
    other operand 1 x 128 blocks. ``weight``: whether the caller named ``t`` the weight
    (``None``: it did not say, and a 2-D Parameter or a view of one is taken for the weight)."""
    weight_fmt, other = formats.spec_of(fmt).operands
    if weight_fmt == other:
        return other
    is_weight = _is_weight(t) if weight is None else weight
    return weight_fmt if is_weight else other


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


def _qf(
    x: torch.Tensor, fmt: str, dim: int, backward: bool, weight: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x``'s operand for a product that factors its per-tensor scale out
    (``quantpatch_quantize``'s section on factored operands): code x block scale in ``x``'s
    dtype and the float32 scale; a weight (as ``_q`` tells it) through the once-per-step
    cache. Gradients are the product's (``factored_product``)."""
    with torch.no_grad():
        if _is_weight(x) if weight is None else weight:
            return _weight_factored(x, fmt, dim, backward)
        return quantize_factored(x, fmt, dim, backward)


def _factored(fmt: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the product of ``a`` and ``b`` under ``fmt`` takes factored operands."""
    return a.dtype == b.dtype and _factors(fmt, a.dtype)


def _cached_q(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """``_q`` for a weight operand (a weight or a view of one): quantized once per step
    through the cache, the straight-through gradient reaching the weight under autograd."""
    if fmt == "bf16":
        return x
    if x.requires_grad and torch.is_grad_enabled():
        out: torch.Tensor = _StraightThrough.apply(x, fmt, dim, backward, True)  # type: ignore[no-untyped-call]
        return out
    return _weight_fake_quant(x, fmt, dim, backward)


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
    roles: tuple[str, str] | None = None,
    backward: bool = False,
    weight: str | None = None,
) -> torch.Tensor:
    """``torch.matmul(a, b)`` with both operands quantized along the reduction dimension
    (the last of ``a``, the second to last of ``b``). ``roles`` names the operands as
    TransformerEngine does, ``(a's, b's)`` of ``input``, ``weight`` and ``grad_output``:
    init's linear sites pass ``("input", "weight")`` in the forward, ``("grad_output",
    "weight")`` for the input gradient and ``("grad_output", "input")`` for the weight
    gradient, since Megatron's autograd function hands the weight over as a plain tensor. A
    ``grad_output`` (the first operand) takes the gradient's element and rounding (NVFP4 rounds
    it alone stochastically), and the other operand too where the format's ``backward`` is
    ``all``; the ``weight`` takes the format's weight operand (``nvfp4-2d``'s tiles). Without
    ``roles``, a 2-D Parameter or a view of one is taken for the weight.

    ``backward=True`` and ``weight="a"|"b"`` are the earlier spelling (a gradient GEMM, and
    which operand is the weight), which the sites of checkouts not yet upgraded still call;
    accepted through the next release."""
    backward, weight = _operand_roles(roles, backward, weight)
    spec = formats.spec_of(fmt)  # an unknown name: one sentence
    if _bf16_layer(backward, weight):  # the BF16 layer policy: quantpatch_layers.py
        return torch.matmul(a, b)
    if is_delayed(fmt):  # the layer's amax history and scales: quantpatch_delayed.py
        return delayed_matmul(a, b, fmt, backward=backward, weight=weight)
    if spec.rht:  # both operands Hadamard-transformed first: quantpatch_rht.py
        from . import quantpatch_rht

        return quantpatch_rht.rht_matmul(a, b, backward=backward)
    bdim = -2 if b.dim() > 1 else -1
    wa, wb = _named_weight(weight, "a"), _named_weight(weight, "b")
    fa, fb = _operand_fmt(a, fmt, wa), _operand_fmt(b, fmt, wb)
    b_backward = backward and spec.backward == "all"
    fused = _fused_product(a, b, fmt, backward, b_backward, fa, fb)
    if fused is not None:
        return fused
    if _factored(fmt, a, b):  # code x block scale; the tensor scales on the float32 result
        qa = _qf(a, fa, -1, backward, wa)
        return _factored_product(a, b, qa, _qf(b, fb, bdim, b_backward, wb))
    return torch.matmul(_q(a, fa, -1, backward, wa), _q(b, fb, bdim, b_backward, wb))


def quant_bmm(
    a: torch.Tensor, b: torch.Tensor, fmt: str, *, backward: bool = False
) -> torch.Tensor:
    """``torch.bmm(a, b)`` with both operands quantized along the reduction dimension (NVFP4:
    ``a`` alone stochastically under ``backward``)."""
    _refuse_delayed(fmt, "an attention product")
    nv = formats.spec_of(fmt).backward == "grad_output"
    fa, fb = _operand_fmt(a, fmt), _operand_fmt(b, fmt)
    if a.dim() == b.dim() == 3:
        fused = _fused_product(a, b, fmt, backward, backward and not nv, fa, fb)
        if fused is not None:
            return fused
    if _factored(fmt, a, b):
        qa = _qf(a, fa, -1, backward)
        return _factored_product(a, b, qa, _qf(b, fb, -2, backward and not nv))
    return torch.bmm(_q(a, fa, -1, backward), _q(b, fb, -2, backward and not nv))


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
    _refuse_delayed(fmt, "an attention product")
    nv = formats.spec_of(fmt).backward == "grad_output"
    f1, f2 = _operand_fmt(batch1, fmt), _operand_fmt(batch2, fmt)
    if beta == 0 and batch1.dim() == batch2.dim() == 3:
        fused = _fused_product(batch1, batch2, fmt, backward, backward and not nv, f1, f2)
        if fused is not None:
            return fused if alpha == 1 else fused * alpha
    if beta == 0 and _factored(fmt, batch1, batch2):
        q1f = _qf(batch1, f1, -1, backward)
        out = _factored_product(batch1, batch2, q1f, _qf(batch2, f2, -2, backward and not nv))
        return out if alpha == 1 else out * alpha
    q1 = _q(batch1, f1, -1, backward)
    q2 = _q(batch2, f2, -2, backward and not nv)
    if beta == 0:
        out = torch.bmm(q1, q2)
        return out if alpha == 1 else out * alpha
    return torch.baddbmm(input, q1, q2, beta=beta, alpha=alpha)


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
# ``QUANTPATCH_FLASH_BF16=1`` sends a bf16 Q.K^T through the same kernel (nothing quantized), so
# a bf16 baseline runs the attention of the FA schemes it is compared with; unset or ``0``, the
# patched forward's guard keeps bf16 on the stock path without importing this module. The first
# decision of each kind (flash, stock) is printed once per process on rank 0 as
# ``[quantpatch] attention path: flash (...)`` / ``stock (why)``, which ``quantpatch runs`` reads.

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
    return env.flash()


def flash_bf16() -> bool:
    """Whether ``QUANTPATCH_FLASH_BF16=1`` asks for a bf16 Q.K^T on the flash kernel."""
    return env.flash_bf16()


ATTENTION_PATH_LINE = "[quantpatch] attention path: "
"""How the line that says which attention path a run took begins (read by ``quantpatch runs``)."""
_paths_said: set[str] = set()


def _say_path(qk: str, pv: str, why: str | None) -> None:
    """Print, once per process and kind of path (on rank 0), which path attention took."""
    path = "stock" if why is not None else "flash"
    if path in _paths_said or not env.first_rank():
        return
    _paths_said.add(path)
    detail = why if why is not None else f"Q.K^T {qk}, P.V {pv}"
    print(f"{ATTENTION_PATH_LINE}{path} ({detail})", file=sys.stderr, flush=True)


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
    _refuse_delayed(fmt, "an attention product")
    flash = _flash()
    if flash is None:
        raise RuntimeError(f"flash attention needs its Triton kernels: {_flash_error}")
    q = _q(query, _operand_fmt(query, fmt), -1, False)
    k = _q(key, _operand_fmt(key, fmt), -1, False)
    out: torch.Tensor = flash.flash_attention(q, k, value, causal=causal, scale=softmax_scale)
    return out


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
    if qk == "bf16" and not flash_bf16():
        return "Q.K^T is bf16: the stock attention runs (QUANTPATCH_FLASH_BF16=1 takes the kernel)"
    if pv != "bf16":
        return f"P.V is quantized ({pv}): the flash kernel keeps P.V in bf16"
    if qk not in FORMATS:
        return f"unknown format {qk!r}"
    if env.tensor_save():
        return "the tensor saver is on (it saves the attention probabilities)"
    if query.is_cuda:
        require_capability(query.device)
    else:
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
    ``flash_dot_product_attention`` (see :func:`flash_refusal` for the reasons it may not);
    the first answer of each kind is printed once per process (``ATTENTION_PATH_LINE``)."""
    why = flash_refusal(attention, query, key, value, attention_mask, qk=qk, pv=pv)
    _say_path(qk, pv, why)
    return why is None


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
