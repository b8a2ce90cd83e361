"""ParetoQ's extremely low-bit weights (part of ``quantpatch_ops``; the section below says how):
the quantizers, their gradients, the initial step, and the linear layers' step parameter and
forward / checkpoint helpers that init's sites call through ``quantpatch_ops``.

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from . import quantpatch_formats as formats

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

PARETOQ_BITS = {f.name: f.w_bits for f in formats.SPECS if f.w_bits is not None}
"""Each ParetoQ value's ``w_bits`` in ParetoQ's code (0: ternary), from the spec."""
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
