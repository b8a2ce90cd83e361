"""Weights quantized once per optimizer step, and the choice between the fused and the separate
quantized GEMM (part of ``quantpatch_ops``' products; the sections below say how each works).

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; torch and the standard library
only.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import quantpatch_env as env
from . import quantpatch_formats as formats
from .quantpatch_nvfp4 import NVFP4_FORMATS, sr_bits
from .quantpatch_quantize import KERNEL_DTYPES as _KERNEL_DTYPES
from .quantpatch_quantize import (
    factors,
    kernels_error,
    quantize,
    quantize_factored,
    require_capability,
)
from .quantpatch_quantize import gemm_kernels as _gemm_kernels
from .quantpatch_quantize import interpreted as _interpreted
from .quantpatch_quantize import kernel_mode as _kernel_mode


def _is_weight(t: torch.Tensor) -> bool:
    """A 2-D ``torch.nn.Parameter`` or a view of one (``weight.t()``)."""
    base = t._base if t._base is not None else t
    return t.dim() == 2 and isinstance(base, torch.nn.Parameter)


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
# its bits come from the generator's next draws, and a hit would skip them. HiF8, ``nvfp4-2d``,
# ``fp8-block`` (128 x 128 weight tiles) and ``fp8-tensor`` quantize a weight alike for the
# forward and dgrad (elementwise; square tiles): one entry and
# one quantization a step serve both, the transposed operand a view of it.

_WEIGHT_CACHE_DEFAULT_MB = 8192


class _WeightCache:
    """Quantized weights keyed by the weight's identity (see the section's comment)."""

    def __init__(self) -> None:
        # id(base weight) -> (weak reference to it, {operand key: (stamp, quantized, factor)})
        self.entries: dict[int, tuple[Any, dict[tuple[Any, ...], _Held]]] = {}
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
            self.bytes -= sum(_nbytes(held[1]) for held in entry[1].values())


_Held = tuple[Any, torch.Tensor, torch.Tensor | None]
"""A cache entry: (the weight's stamp and the kept tensor's version, the quantized weight,
its per-tensor factor where the products factor it out)."""
_WEIGHT_CACHE = _WeightCache()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _weight_cache_cap() -> int:
    mib = env.weight_cache_mb(_WEIGHT_CACHE_DEFAULT_MB)
    return int(mib * 2**20)


def weight_cache_enabled() -> bool:
    """Whether weight operands are cached (``QUANTPATCH_WEIGHT_CACHE``, default 1)."""
    return env.weight_cache()


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


def _layout_free(fmt: str, weight: torch.Tensor, backward: bool) -> bool:
    """Whether ``fmt`` quantizes a weight alike along either dimension and in either direction
    (HiF8: elementwise; ``nvfp4-2d``: 16 x 16 tiles of a matrix and its tensor-wide scale,
    rounded to nearest even, the only rounding a cached weight takes; ``fp8-block``'s weight
    tiles, 128 x 128, E4M3 both ways; ``fp8-tensor``: one scale, elementwise, E4M3 wherever a
    product quantizes a weight, i.e. without ``backward``)."""
    shared = formats.spec_of(fmt).weight_cache
    if shared == "forward":
        return not backward
    return shared == "elementwise" or (shared == "tiles" and weight.dim() == 2)


def _drop_collected(wid: int, _: object) -> None:
    _WEIGHT_CACHE.drop(wid)


def _weight_fake_quant(x: torch.Tensor, fmt: str, dim: int, backward: bool) -> torch.Tensor:
    """``quantize(x, ...)`` for a weight or a view of one, through the cache."""
    return _weight_quant(x, fmt, dim, backward, False)[0]


def _weight_factored(
    x: torch.Tensor, fmt: str, dim: int, backward: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``quantize_factored(x, ...)`` for a weight or a view of one, through the cache (a value
    whose products do not factor the weight's scale for its dtype: ``(fake-quantized, None)``)."""
    return _weight_quant(x, fmt, dim, backward, factors(fmt, x.dtype))


def _quantize(
    x: torch.Tensor, fmt: str, dim: int, backward: bool, factored: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if factored:
        return quantize_factored(x, fmt, dim=dim, backward=backward)
    return quantize(x, fmt, dim=dim, backward=backward), None


def _weight_quant(
    x: torch.Tensor, fmt: str, dim: int, backward: bool, factored: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    cache = _WEIGHT_CACHE
    if (
        (backward and fmt in NVFP4_FORMATS)  # draws from the generator: never skipped
        or torch.is_inference_mode_enabled()  # inference tensors cannot be saved for backward
        or x.is_inference()
        or not weight_cache_enabled()
    ):
        cache.counts["bypassed"] += 1
        return _quantize(x, fmt, dim, backward, factored)
    _hook_optimizer_steps()
    base = x._base if x._base is not None else x
    if _layout_free(fmt, base, backward):
        # one entry per weight: a view of it (``weight.t()``) is the same view of its quantized
        # values, and neither the dimension nor the direction changes them (nor the tensor's
        # scale)
        if x is not base and x.numel() == base.numel() and base.is_contiguous():
            q_base, f_base = _weight_quant(base, fmt, -1, False, factored)
            if q_base.stride() == base.stride():
                offset = q_base.storage_offset() + x.storage_offset() - base.storage_offset()
                return q_base.as_strided(x.shape, x.stride(), offset).detach(), f_base
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
        factored,
    )
    stamp = (x._version, x.data_ptr())
    if entry is not None and key in entry[1]:
        (old_stamp, q_version), q, f = entry[1][key]
        if old_stamp == stamp and q._version == q_version:
            cache.counts["hits"] += 1
            return q.detach(), f  # a new alias each time: autograd never touches the kept one
        del entry[1][key]
        cache.bytes -= _nbytes(q)
        stale = True
    else:
        stale = False
    q, f = _quantize(x, fmt, dim, backward, factored)
    if cache.bytes + _nbytes(q) > _weight_cache_cap():
        cache.counts["over_cap"] += 1
        return q, f
    cache.counts["stale" if stale else "misses"] += 1
    if entry is None:
        ref = weakref.ref(base, functools.partial(_drop_collected, wid))
        entry = (ref, {})
        cache.entries[wid] = entry
    entry[1][key] = ((stamp, q._version), q, f)
    cache.bytes += _nbytes(q)
    return q.detach(), f


# -- the quantized GEMM: operands quantized in the GEMM's tile loop, or separately -------------
#
# ``quant_matmul``, ``quant_bmm`` and ``quant_baddbmm`` (``beta == 0``) have two ways to
# compute a quantized product: *separate* (two fake-quant kernels, then ``torch.matmul`` of
# the quantized operands: the path above) and *fused* (``quantpatch_gemm_kernels.quant_gemm``,
# one Triton GEMM that quantizes each operand tile as it loads it; no quantized copy is
# written).
# ``QUANTPATCH_GEMM`` chooses: ``auto`` (default: on CUDA, both are timed once per problem,
# i.e. shapes, layouts, dtype, format and direction, on its first call, and the faster is kept
# for the process, see ``gemm_choices()``; CPU tensors and ``QUANTPATCH_KERNELS=reference``
# take the separate path), ``separate`` (always), ``fused`` (wherever the GEMM applies; CPU
# tensors need ``TRITON_INTERPRET=1``). The fused GEMM applies to the values whose spec entry
# says ``fused_gemm`` (``_GEMM_FORMATS``; every other value takes the separate path, whatever
# ``QUANTPATCH_GEMM`` says; ``nvfp4-rht`` reaches it from ``quantpatch_rht`` with its operands
# transformed first, as NVFP4 operands), for a bf16, fp16 or fp32
# product outside autograd (Megatron's linear layer computes its forward, dgrad and wgrad
# products inside its own autograd function: there it applies; a product whose operands need
# gradients keeps the quantized operands for its backward, so it is separate). Each operand
# takes the separate path's format (a weight's 128 x 128 ``fp8-block`` or 16 x 16 ``nvfp4-2d``
# tiles, the gradient's E5M2 or stochastic rounding); the per-tensor amax of ``fp8-tensor`` and
# NVFP4 is one torch reduction before the launch (in bf16 and fp16 their tiles are code x block
# scale and the tensor scales multiply the float32 accumulator once, as the separate path's
# ``scaled_matmul`` does), and stochastic rounding reads the random
# bits the separate path would draw, in its order. ``auto`` never fuses a product that rounds
# stochastically (timing both paths would draw its bits twice). A weight operand that the
# weight cache holds enters the fused GEMM already quantized (only the other operand is
# quantized in the loop). Both paths quantize bit for bit alike; the product differs only in
# the order of its float32 sums (a few units in the last place of float32 before the output's
# rounding), so auto's choice changes results within that.

_GEMM_FORMATS = formats.names(fused_gemm=True)
_FP8_TILES = formats.names(family="fp8-block", tiled=True, values_only=False)
"""fp8-block's weight tiles, an operand format: 128 x 128 tiles of a matrix."""
_GEMM_CHOICES: dict[tuple[Any, ...], str] = {}


def _gemm_mode() -> str:
    return env.gemm()


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


def _gemm_operand(
    t: torch.Tensor, fmt: str, dim: int, backward: bool, factored: bool
) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """The operand as the GEMM reads it: a weight the cache may hold, already quantized (and,
    ``factored``, its per-tensor scale)."""
    if _is_weight(t) and weight_cache_enabled() and not torch.is_inference_mode_enabled():
        q, f = _weight_quant(t, fmt, dim, backward, factored and factors(fmt, t.dtype))
        return q, "bf16", f
    return t, fmt, None


def _fusable(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: str,
    mode: str,
    fmts: tuple[str, str],
    backward: tuple[bool, bool],
) -> bool:
    """Whether the fused GEMM may compute ``a @ b`` in ``fmt`` under ``QUANTPATCH_GEMM``'s
    ``mode``, the operands' formats ``fmts`` and gradient roles ``backward`` (see the section's
    comment; otherwise the separate path does)."""
    (a_fmt, b_fmt), (a_backward, b_backward) = fmts, backward
    if mode == "separate" or fmt not in _GEMM_FORMATS:
        return False
    drawn = (a_backward and a_fmt in NVFP4_FORMATS) or (b_backward and b_fmt in NVFP4_FORMATS)
    if mode == "auto" and drawn:  # measuring both paths would draw the random bits twice
        return False
    if (b_fmt in _FP8_TILES and b.dim() == 3) or a_fmt in _FP8_TILES:
        return False  # 128 x 128 tiles of a matrix: the weight of a 2-D product only
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return False
    if not _shapes_fuse(a, b):
        return False
    return not (mode == "auto" and (not _auto_fuses(a) or _kernel_mode() == "reference"))


def _shapes_fuse(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the fused GEMM takes ``a @ b``'s dtypes, shapes and devices: one kernel dtype,
    a 2-D or 3-D ``b`` (3-D: batched like ``a``), one reduction length, one device."""
    if a.dtype != b.dtype or a.dtype not in _KERNEL_DTYPES or a.dim() < 2 or b.dim() not in (2, 3):
        return False
    if b.dim() == 3 and (a.dim() != 3 or a.shape[0] != b.shape[0]):
        return False
    return a.shape[-1] == b.shape[-2] and a.device == b.device


def _fused_product(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: str,
    a_backward: bool,
    b_backward: bool,
    a_fmt: str | None = None,
    b_fmt: str | None = None,
) -> torch.Tensor | None:
    """``matmul(q(a, a_fmt, dim=-1), q(b, b_fmt, dim=-2))`` through the fused GEMM, or None
    where the separate path computes it (see the section's comment); ``a_fmt`` / ``b_fmt``:
    the operands' formats as the separate path gives them (a weight's tiles), ``fmt`` by
    default."""
    mode = _gemm_mode()
    a_fmt, b_fmt = a_fmt or fmt, b_fmt or fmt
    if not _fusable(a, b, fmt, mode, (a_fmt, b_fmt), (a_backward, b_backward)):
        return None
    if a.is_cuda:
        require_capability(a.device)
    elif not _interpreted():
        raise RuntimeError(
            f"QUANTPATCH_GEMM=fused, but the tensors are on {a.device.type} and compiled Triton "
            "kernels run on CUDA tensors only; set TRITON_INTERPRET=1 to interpret them on CPU "
            "tensors, or QUANTPATCH_GEMM=auto."
        )
    if _gemm_kernels() is None:
        if mode == "fused":
            raise RuntimeError(f"QUANTPATCH_GEMM=fused, but {kernels_error()}")
        return None
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1]) if b.dim() == 2 and a.dim() > 2 else a
    factored = factors(fmt, a.dtype)
    # the random bits drawn in the separate path's order: a's, then b's
    qa, fa, sa = _gemm_operand(a2, a_fmt, -1, a_backward, factored)
    a_rand = sr_bits(qa) if a_backward and fa in NVFP4_FORMATS else None
    qb, fb, sb = _gemm_operand(b, b_fmt, -2, b_backward, factored)
    b_rand = sr_bits(qb) if b_backward and fb in NVFP4_FORMATS else None

    def fused() -> torch.Tensor:
        out: torch.Tensor = _gemm_kernels().quant_gemm(
            qa, qb, fa, fb, a_backward, b_backward, a_rand, b_rand, factored, sa, sb
        )
        return out

    if mode == "auto":

        def separate() -> torch.Tensor:
            if factored:
                from .quantpatch_quantize import scaled_matmul

                ta, ga = (qa, sa) if fa == "bf16" else _quantize(qa, fa, -1, a_backward, True)
                tb, gb = (qb, sb) if fb == "bf16" else _quantize(qb, fb, -2, b_backward, True)
                return scaled_matmul(ta, ga, tb, gb)
            return torch.matmul(
                quantize(qa, fa, dim=-1, backward=a_backward),
                quantize(qb, fb, dim=-2, backward=b_backward),
            )

        key = (
            tuple(a2.shape), a2.stride(), tuple(b.shape), b.stride(), a.dtype, fmt, a_backward,
            b_backward, fa, fb, str(a.device),
        )  # fmt: skip
        if _choose_gemm(key, fused, separate) == "separate":
            return None
    out = fused()
    return out.reshape(*lead, b.shape[-1]) if out.dim() != len(lead) + 1 else out


# the names quantpatch_ops uses (nothing outside this module takes its private names)
is_weight = _is_weight
weight_fake_quant = _weight_fake_quant
weight_factored = _weight_factored
fused_product = _fused_product
