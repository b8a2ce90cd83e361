"""Save the operands of the quantized GEMMs (forward and backward) with honest names.

Installed by ``quantpatch saver install`` as ``megatron/core/tensor_saver.py``; depends on torch
and the standard library only. The calls quantpatch inserts are guarded by ``ENABLED``, a
module-level boolean read once from the environment, so a disabled saver costs one attribute
test per call site.

Environment (read at import; ``configure()`` reads it again):

``TENSOR_SAVE_ENABLED``   ``true``/``1`` to save (default ``false``)
``TENSOR_SAVE_DIR``       where files go (default ``./tensor_logs``)
``CUSTOM_QUANT_TYPE``     label for call sites that have no site value (stock layouts)
``TENSOR_SAVE_STEPS``     micro-steps to save, e.g. ``0-1,100`` (default: all)
``TENSOR_SAVE_LAYERS``    layer numbers to save, e.g. ``1-2,27`` (default: all)
``TENSOR_SAVE_KINDS``     tensor names to save, e.g. ``input,grad_output`` (default: all)
``TENSOR_SAVE_MAX_BYTES`` stop saving once this many bytes were written (says so once)
``TENSOR_SAVE_STATS_ONLY`` ``true``: one JSON line per tensor in ``stats_rank{r}.jsonl``
``TENSOR_SAVE_QUEUE``     tensors waiting for the writer at most (default 64)
``TENSOR_SAVE_DROP``      ``true``: drop (and count) when the queue is full instead of waiting
``TENSOR_SAVE_WRITERS``   background writer threads (default: one per two cores, at most 2)
``TENSOR_SAVE_NICE``      how much lower the saver's threads are scheduled than training, on
                          Linux (0-19, default 10; 0: the same priority)
``TENSOR_SAVE_STATS_KERNEL`` ``false``: host statistics by torch's operators only, never by the
                          one-pass C kernel compiled on first use (default ``true``)
``TENSOR_SAVE_KERNEL_DIR`` where that kernel is cached (default ``kernels`` in
                          quantpatch's cache, ``~/.cache/quantpatch``)
``QUANTPATCH_SOURCE_COMMIT`` the source commit to record (default: ``git rev-parse HEAD``)

The saver never stops training: a variable it cannot read is reported in one line (name,
value, accepted syntax) and saving stays off; files that cannot be written are counted and
reported once at ``flush()`` / exit, and leave no partial file behind.

File name: ``{timestamp}_{counter:04d}_{layer_type}_L{layer_idx}_{operation}_{quant_type}
[_rank{r}]_{tensor_name}.pt`` holding ``{"tensor", "tensor_info", "metadata"}``, byte for byte
what ``torch.save`` writes in its non-zip format (``torch.load`` reads it, ``weights_only=True``
included; it cannot be memory-mapped) because the zip format's CRC-32 and records cost 2.7x
the write. That format holds the dtypes with a legacy storage class only: a tensor of any
other (float8, uint16/32/64, complex32, bits, packed fp4) is written in the zip format,
``torch.save``'s default; one torch cannot save at all (int1-7, uint1-7) is counted as
failed with torch's reason. ``tensor_info``'s min, max, mean and std are None for a dtype
without them (complex, bits, packed fp4, quantized).

On CUDA the training stream never waits for the host: statistics are computed on the device,
the tensor is copied into pinned host memory on a side stream, and a background thread waits
for that copy and writes the file. Pinned buffers are used again; while none of the right
shape is free, the background thread makes one (pinning memory is slow) and queues the copy.
A micro-step ends when a forward tensor of the same layer, operation and name is seen again
(recomputed activations count as a new micro-step). A tensor handed over twice in one
micro-step under the same layer, operation and name (the same storage, unchanged) is saved
once.

The API of a fork's own ``tensor_saver.py`` is served too, so that a checkout's existing
callers keep working when this module replaces it: the keywords ``phase``, ``component``,
``rank`` and ``attention_weights`` (and the same order when passed positionally after
``layer_idx``), ``get_tensor_saver()`` and ``TensorSaver`` (``save_tensor``, ``set_iteration``,
``enabled``, ``save_dir``, ``counter``, ``iteration``). Their calls are saved like the inserted
ones (asynchronously, with the layer number and module kind of a linear layer's weight); the
``save_*`` functions return the path each file will have once written (``None`` when a
tensor is not saved).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import json
import math
import os
import pickle
import queue
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import torch

_T = TypeVar("_T")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class _Invalid(ValueError):
    """A saver variable that cannot be read; the message is the accepted syntax."""


def _parse_flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _Invalid("expected true or false (also 1/0, yes/no, on/off)")


def _whole(low: int, high: int | None, syntax: str) -> Callable[[str], int]:
    """A parser of whole numbers from ``low`` to ``high`` (None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            raise _Invalid(syntax)
        return value

    return parse


def _positive(example: str) -> Callable[[str], int]:
    return _whole(1, None, f"expected a positive whole number, e.g. {example}")


_parse_nice = _whole(0, 19, "expected a whole number from 0 (no change) to 19, e.g. 10")


def _parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """``0-1,5`` as ``((0, 1), (5, 5))``: ranges stay ranges, whatever their length."""
    syntax = "expected numbers or low-high ranges separated by commas, e.g. 0-1,100"
    spans = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            low = int(lo)
            high = int(hi) if sep else low
        except ValueError:
            raise _Invalid(syntax) from None
        if low < 0 or high < low:
            raise _Invalid(f"{syntax}, each with low <= high")
        spans.append((low, high))
    if not spans:
        raise _Invalid(syntax)
    return tuple(spans)


def _ranges(text: str | None) -> tuple[tuple[int, int], ...] | None:
    """The selection in ``text`` (``None``: everything); raises ``_Invalid``."""
    return _parse_ranges(text) if text and text.strip() else None


def _in(spans: tuple[tuple[int, int], ...], value: int | None) -> bool:
    return value is not None and any(lo <= value <= hi for lo, hi in spans)


def _parse_kinds(text: str) -> frozenset[str]:
    names = frozenset(k.strip() for k in text.split(",") if k.strip())
    if not names or not all(n.isidentifier() for n in names):
        raise _Invalid(
            "expected tensor names separated by commas, e.g. input,grad_output (input, "
            "weight, grad_output, query, key, value, attention_probs)"
        )
    return names


class _Config:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.enabled = self._read("TENSOR_SAVE_ENABLED", _parse_flag, False)
        raw = os.environ.get("TENSOR_SAVE_ENABLED", "").strip().lower()
        self.wanted = bool(raw) and raw not in _FALSE
        self.save_dir = Path(os.environ.get("TENSOR_SAVE_DIR") or "./tensor_logs")
        self.default_quant = os.environ.get("CUSTOM_QUANT_TYPE") or "bf16"
        self.steps = self._read("TENSOR_SAVE_STEPS", _parse_ranges, None)
        self.layers = self._read("TENSOR_SAVE_LAYERS", _parse_ranges, None)
        self.kinds = self._read("TENSOR_SAVE_KINDS", _parse_kinds, None)
        self.max_bytes = self._read("TENSOR_SAVE_MAX_BYTES", _positive("2000000000"), None)
        self.stats_only = self._read("TENSOR_SAVE_STATS_ONLY", _parse_flag, False)
        self.queue_size = self._read("TENSOR_SAVE_QUEUE", _positive("64"), 64)
        self.drop = self._read("TENSOR_SAVE_DROP", _parse_flag, False)
        # one writer per two cores, at most two: on a 2-core host a second writer takes its
        # core from the training thread (its wait rose from 0.22x to 0.37x of the fork's)
        default_writers = min(2, max(1, (os.cpu_count() or 1) // 2))
        self.writers = self._read("TENSOR_SAVE_WRITERS", _positive("2"), default_writers)
        self.nice = self._read("TENSOR_SAVE_NICE", _parse_nice, 10)
        self.stats_kernel = self._read("TENSOR_SAVE_STATS_KERNEL", _parse_flag, True)

    def _read(self, name: str, parse: Callable[[str], _T], default: _T) -> _T:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            return parse(raw)
        except _Invalid as exc:
            self.errors.append(f"{name}={raw!r} is not valid ({exc})")
            return default


def _load_config() -> tuple[_Config, bool]:
    """The settings and whether saving is on: never when a variable is unreadable (each one
    is reported in one line, once, when saving was asked for)."""
    cfg = _Config()
    if cfg.errors and cfg.wanted:
        for err in cfg.errors:
            print(f"[tensor_saver] {err}; tensor saving is off for this run.", file=sys.stderr)
    return cfg, cfg.enabled and not cfg.errors


_CFG, ENABLED = _load_config()
"""``ENABLED``: the one test every inserted call makes."""


def _rank_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


_COMMIT: str | None = None


def _source_commit() -> str | None:
    global _COMMIT
    if _COMMIT is None:
        _COMMIT = os.environ.get("QUANTPATCH_SOURCE_COMMIT") or ""
        if not _COMMIT:
            try:
                _COMMIT = subprocess.run(
                    ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                _COMMIT = ""
    return _COMMIT or None


# -- which layer and which linear: filled by the TransformerLayer hook ------------------------

_LAYERS: dict[int, Any] = {}
_WEIGHTS: dict[int, tuple[int | None, str]] = {}


def enter_layer(layer: Any) -> None:
    """Called at the start of ``TransformerLayer.forward``: remember the layer so that the
    linear calls inside it can be named (layer number, qkv/proj/fc1/fc2/expert)."""
    _LAYERS[id(layer)] = layer


def _kind_from_name(name: str) -> str:
    parts = name.split(".")
    base = next(
        (p.replace("linear_", "") for p in reversed(parts) if p.startswith("linear_")),
        parts[-2] if len(parts) > 1 else name,
    )
    if "shared_experts" in parts:
        return f"shared_expert_{base}"
    if "experts" in parts or "local_experts" in parts:
        return f"expert_{base}"
    return base


def linear_meta(weight: torch.Tensor) -> dict[str, Any]:
    """Layer number and module kind of the linear layer that owns ``weight``."""
    key = id(weight)
    if key not in _WEIGHTS:
        found: tuple[int | None, str] = (None, "output_layer")
        for layer in list(_LAYERS.values()):
            for name, param in layer.named_parameters():
                if param is weight:
                    found = (getattr(layer, "layer_number", None), _kind_from_name(name))
                    break
            else:
                continue
            break
        _WEIGHTS[key] = found
    layer_idx, kind = _WEIGHTS[key]
    return {"layer_idx": layer_idx, "module_kind": kind}


# -- the writer ------------------------------------------------------------------------------


_NATIVE_STATS = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
"""Dtypes torch's reductions (``aminmax``, ``var_mean``, sums) take as they are."""

_RAW_COPY = frozenset(
    getattr(torch, name)
    for name in (
        "bits8",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "float4_e2m1fn_x2",
        *(f"int{b}" for b in range(1, 8)),
        *(f"uint{b}" for b in range(1, 8)),
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
)
"""Dtypes torch has no copy for (bits, packed fp4, sub-byte integers): their snapshots are
copied as the integers of their element size, byte for byte."""

_PACKED_QUANT = frozenset({torch.quint4x2, torch.quint2x4})
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a view of its bytes as the integer type of its element size where torch
    cannot copy its dtype (``_RAW_COPY``)."""
    return t.view(_SAME_SIZE[t.element_size()]) if t.dtype in _RAW_COPY else t


def _clone(t: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """A copy of ``t`` on its device (contiguous, or with ``t``'s strides where
    ``contiguous`` is False), whatever its dtype (a quantized tensor keeps
    its quantizer: it is never viewed as another dtype). Packed 4- and 2-bit quantized
    tensors, which torch has no copy for, are quantized again from their values, with their
    own scale and zero point: the same integers."""
    if t.is_quantized and t.dtype in _PACKED_QUANT and t.qscheme() == torch.per_tensor_affine:
        return torch.quantize_per_tensor(t.dequantize(), t.q_scale(), t.q_zero_point(), t.dtype)
    layout = torch.contiguous_format if contiguous else torch.preserve_format
    if t.dtype not in _RAW_COPY:
        return t.clone(memory_format=layout)
    return _raw(t).clone(memory_format=layout).view(t.dtype)


def _statable(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` where torch's reductions take its dtype; an exact float copy where its values
    are real numbers torch converts (float8 and uint16 as float32, which the one-pass kernel
    takes: 11 against 20 ms as float64 for a 1024x1024 float8 tensor on one thread here;
    uint32/64 as float64); None where min, max, mean and std have no meaning or no
    operators (complex, bits, packed fp4, sub-byte integers, quantized): its statistics are
    then recorded as None."""
    if t.dtype in _NATIVE_STATS:
        return t
    if t.dtype.is_complex or t.is_quantized or t.dtype in _RAW_COPY:
        return None
    exact = torch.float32 if t.dtype.is_floating_point or t.dtype == torch.uint16 else None
    try:
        return t.to(exact or torch.float64)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_DEVICE_CHUNK = 1 << 24
"""Elements of a device tensor in one float64 copy for its moments (128 MB of device memory,
what the float32 copy of a 64 MB bf16 tensor took before)."""


def _device_moments(t: torch.Tensor) -> torch.Tensor:
    """The statistics of device tensor ``t`` as kernels queued on its stream, none of which
    waits for the host: one tensor [min, max, then the mean and the population variance of
    each chunk of ``_DEVICE_CHUNK`` elements], float64, that ``_combine`` turns into min,
    max, mean, std on the host.

    Six kernels for a tensor up to 16M elements (min and max of ``t`` itself, exact; a
    float64 copy; ``var_mean``, whose Welford sums in float64 neither overflow nor underflow
    for any float32 value and keep the spread under a mean 1e7 times larger; one stack),
    where the scaled two-pass float32 formula queued 37 operators: their launches took 21.6
    ms of the training thread for the 32 tensors (1.6 GB) of a step on an H100, against a
    9.6 ms step. Float64 tensors take ``_two_pass``. A device without float64 (MPS) sums
    in float32: values beyond 1e19 in magnitude give an infinite std there."""
    acc = torch.float32 if t.device.type == "mps" else torch.float64
    values = _statable(t)
    if values is None:  # no statistics: ``_combine`` gives None for each
        return torch.empty(0, dtype=acc, device=t.device)
    flat = values.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if not flat.numel():
        return torch.zeros(2, dtype=acc, device=t.device)
    mn, mx = torch.aminmax(flat)
    parts = [mn.to(acc), mx.to(acc)]
    for start in range(0, flat.numel(), _DEVICE_CHUNK):
        chunk = flat[start : start + _DEVICE_CHUNK]
        if chunk.dtype != torch.float64:
            var, mean = torch.var_mean(chunk.to(acc), correction=0)
        else:  # the mean may dwarf the spread beyond what Welford's float64 keeps
            mean, var = _two_pass(chunk)
        parts += [mean, var]
    return torch.stack(parts)


def _two_pass(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population variance of float64 device values ``d`` from their deviations e
    from the mean m as computed, mean = m + sum(e)/k and k var = sum(e^2) - sum(e)^2/k: the
    corrected two-pass formula, which takes out the mean's rounding (1e10 plus a spread of
    1e-3: Welford's float64 ``var_mean`` gives a std 4e-4 off, this 7e-14). Float64
    tensors only (rare in training): it queues ten kernels where ``var_mean`` queues one."""
    k = d.numel()
    m = d.mean()
    e = d - m
    first = e.sum()
    return m + first / k, (torch.dot(e, e) - first * first / k) / k


def _float32s(*values: float) -> list[float]:
    """``values`` (Python floats) each rounded once to float32, as the files record them."""
    return torch.tensor(values, dtype=torch.float32).tolist()


def _combine(values: list[float], n: int) -> list[float | None]:
    """min, max, mean, std (float32 values) from ``_device_moments``'s numbers for a tensor of
    ``n`` elements: the chunks' means and variances are combined in Python floats (Chan's
    formula; weighted by k/n, so the sum stays within the largest mean). A value that is not
    finite makes the mean what the sum would be (inf, -inf, or NaN for both or for a NaN, in
    one chunk or in two) and the std NaN (0 for a single element), as on the host. No
    numbers at all (a dtype without statistics, ``_statable``): None for each."""
    if not n:
        return [0.0] * 4
    if not values:
        return [None] * 4
    mn, mx = values[0], values[1]
    sizes = [min(_DEVICE_CHUNK, n - start) for start in range(0, n, _DEVICE_CHUNK)]
    means, variances = values[2::2], values[3::2]
    if all(math.isfinite(m) for m in means):
        mean = math.fsum((k / n) * m for k, m in zip(sizes, means, strict=True))
        m2 = math.fsum(  # products overflow to inf (``**`` would raise)
            k * (max(v, 0.0) + (m - mean) * (m - mean))
            for k, m, v in zip(sizes, means, variances, strict=True)
        )
        std = math.sqrt(m2 / (n - 1)) if n > 1 else 0.0
    else:
        if math.isnan(mn) or math.isnan(mx) or (mn == -math.inf and mx == math.inf):
            mean = math.nan
        elif mx == math.inf or mn == -math.inf:
            mean = mx if mx == math.inf else mn
        else:  # finite values whose float64 sum overflowed: its sign
            mean = next(m for m in means if not math.isfinite(m))
        std = 0.0 if n == 1 else math.nan
    return list(_float32s(mn, mx, mean, std))


def _host_stats(t: torch.Tensor) -> list[float | None]:
    """min, max, mean, std of a host tensor as float32 values (``t`` is never written): by the
    one-pass kernel (``_fused_stats``) where it applies, else by torch's operators, with the
    reductions' results as Python floats (the dozen scalar tensor operations that combined
    them cost 60 us a tensor: 5 of 46 ms for 80 tensors of 1024x1024). A dtype without
    statistics (``_statable``) gets None for each; float8 and uint16/32/64 values are
    measured in a float copy (float32 for float8 and uint16, float64 for the others)."""
    if not t.numel():
        return [0.0] * 4
    values = _statable(t)
    if values is None:
        return [None] * 4
    t = values
    fused = _fused_stats(t)
    if fused is not None:
        return list(fused)
    d = _float_copy(t)
    mn, mx = (float(v) for v in torch.aminmax(d))
    mean, std = _moments_host(t, d, max(abs(mn), abs(mx)))
    return list(_float32s(mn, mx, mean, std))


def _moments_host(t: torch.Tensor, d: torch.Tensor, big: float) -> tuple[float, float]:
    """Mean and sample standard deviation of ``d`` (the float copy of host tensor ``t``,
    overwritten; ``big`` its largest magnitude) in one pass where that is exact enough, two
    where it is not.

    One pass: the sum and the sum of squares S2, and n*var = S2 - sum*mean. Each sum is
    within about 1e-7 of exact, so the difference is too as long as it keeps at least half
    of S2, i.e. the mean is small next to the spread (the usual activation, weight and
    gradient); then the deviations need no second pass (46 against 51 ms on one core for 80
    tensors of 1024x1024, interleaved). When the mean dominates (or a value is not finite)
    the copy is made again and the deviations from the mean are summed and squared
    (``_deviation_host``). Values whose squares would leave the float range (or whose sum
    of squares would) are scaled by a power of two first, within what the float type holds
    as a normal number (a float32 tensor of subnormals is scaled by 2**126, not by 2**128,
    which is inf); the sums are combined in float64 (Python floats), and the scale applied
    there too, so the float32 result rounds once."""
    n = d.numel()
    exponent = 0  # d holds the values times 2**-exponent, in [1, 2) at most when scaled
    if math.isfinite(big) and big and not 2.0**-40 <= big <= 2.0**40 / math.sqrt(n):
        info = torch.finfo(d.dtype)
        low, high = math.frexp(info.tiny)[1] - 1, math.frexp(info.max)[1] - 1
        exponent = min(max(math.frexp(big)[1] - 1, low), high)
        d.mul_(2.0**-exponent)
    total = float(d.sum())
    mean = total / n
    std = 0.0
    if n > 1:
        squares = float(d.square_().sum())
        deviation = squares - total * mean  # n-1 times the variance, if exact enough
        if deviation >= 0.5 * squares:  # also False for NaN (an inf or a NaN value)
            std = math.sqrt(deviation / (n - 1))
        else:
            d = _float_copy(t)
            if exponent:
                d.mul_(2.0**-exponent)
            mean, std = _deviation_host(d, mean, n)
    scale = 2.0**exponent
    return mean * scale, std * scale


def _deviation_host(d: torch.Tensor, mean: float, n: int) -> tuple[float, float]:
    """Mean and sample standard deviation of ``d`` (overwritten) from its deviations e from
    ``mean`` rounded to ``d``'s type, m: the corrected two-pass formula, mean = m + sum(e)/n
    and (n-1) var = sum(e^2) - sum(e)^2/n, which takes out what the rounding of the mean
    (and of the sum it came from) left. A constant tensor gets 0 (float32 ``Tensor.std``:
    2.4e-7 for 1000 times 3.3), integers near 1e7 their spread (1.04 where float32's
    ``Tensor.std`` gives 2.25) and their mean within 1e-9 (2e-7 off before)."""
    m = float(torch.tensor(mean, dtype=d.dtype))  # what d.sub_ subtracts
    d.sub_(m)
    first = float(d.sum())
    second = float(d.square_().sum())
    if not math.isfinite(first):  # an inf or a NaN value: the mean stays as it was (inf)
        return mean, math.nan
    return m + first / n, math.sqrt(max(second - first * first / n, 0.0) / (n - 1))


_SCRATCH = threading.local()
_SCRATCH_MAX = 16 << 20
"""Elements of the float32 copy a thread keeps for the statistics of host tensors (64 MB)."""


def _float_copy(t: torch.Tensor) -> torch.Tensor:
    """Host tensor ``t`` flattened into float32, in a buffer the calling thread uses again for
    every tensor up to ``_SCRATCH_MAX`` elements: a fresh 4 MB array is handed back to the
    kernel when freed and page-faulted in anew the next time, which made the copy cost 3x
    (50 against 15 ms for 80 tensors of 1024x1024 on one core). Larger ones and float64
    ones (copied as float64) get a copy of their own."""
    n = t.numel()
    if t.dtype == torch.float64:  # rare in training: its own copy, at its own precision
        return t.reshape(-1).to(torch.float64, copy=True)
    if n > _SCRATCH_MAX:
        return t.reshape(-1).to(torch.float32, copy=True)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH.buf = torch.empty(max(n, 1 << 20), dtype=torch.float32)
    return buf[:n].copy_(t.reshape(-1))


_STATS_C = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

/* kind: 0 bfloat16, 1 float16, 2 float32; each value is exact as a float and as a double */
#define QP_TARGET __attribute__((target("avx2,fma,f16c")))
#define QP_BLOCK 4096

int qp_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c");
}

QP_TARGET static inline __m256 qp_load8(const void *p, int64_t i, int kind) {
    if (kind == 2) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (kind == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

QP_TARGET static inline float qp_load1(const void *p, int64_t i, int kind) {
    if (kind == 2) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (kind == 1) return _cvtsh_ss(h);
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* out: min, max (float), sum and sum of squares (double: 16 accumulators per block of
   QP_BLOCK values, whose sums go into 4 running totals) */
QP_TARGET static void qp_stats_avx2(const void *p, int64_t n, int kind, double *out) {
    __m256 mn0 = _mm256_set1_ps(__builtin_inff()), mn1 = mn0;
    __m256 mx0 = _mm256_set1_ps(-__builtin_inff()), mx1 = mx0;
    __m256d ts = _mm256_setzero_pd(), tq = ts;
    int64_t i = 0;
    while (i + 16 <= n) {
        int64_t end = n - i > QP_BLOCK ? i + QP_BLOCK : n;
        __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
        __m256d q0 = s0, q1 = s0, q2 = s0, q3 = s0;
        for (; i + 16 <= end; i += 16) {
            __m256 a = qp_load8(p, i, kind), b = qp_load8(p, i + 8, kind);
            mn0 = _mm256_min_ps(mn0, a);
            mx0 = _mm256_max_ps(mx0, a);
            mn1 = _mm256_min_ps(mn1, b);
            mx1 = _mm256_max_ps(mx1, b);
            __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
            __m256d a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
            __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
            __m256d b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
            s0 = _mm256_add_pd(s0, a0);
            q0 = _mm256_fmadd_pd(a0, a0, q0);
            s1 = _mm256_add_pd(s1, a1);
            q1 = _mm256_fmadd_pd(a1, a1, q1);
            s2 = _mm256_add_pd(s2, b0);
            q2 = _mm256_fmadd_pd(b0, b0, q2);
            s3 = _mm256_add_pd(s3, b1);
            q3 = _mm256_fmadd_pd(b1, b1, q3);
        }
        ts = _mm256_add_pd(ts, _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
        tq = _mm256_add_pd(tq, _mm256_add_pd(_mm256_add_pd(q0, q1), _mm256_add_pd(q2, q3)));
    }
    float lo[8], hi[8];
    double s[4], q[4];
    _mm256_storeu_ps(lo, _mm256_min_ps(mn0, mn1));
    _mm256_storeu_ps(hi, _mm256_max_ps(mx0, mx1));
    _mm256_storeu_pd(s, ts);
    _mm256_storeu_pd(q, tq);
    float mn = lo[0], mx = hi[0];
    double sum = 0.0, squares = 0.0;
    for (int j = 0; j < 8; j++) {
        mn = lo[j] < mn ? lo[j] : mn;
        mx = hi[j] > mx ? hi[j] : mx;
    }
    for (int j = 0; j < 4; j++) {
        sum += s[j];
        squares += q[j];
    }
    for (; i < n; i++) {
        float x = qp_load1(p, i, kind);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
        sum += x;
        squares += (double)x * x;
    }
    out[0] = mn;
    out[1] = mx;
    out[2] = sum;
    out[3] = squares;
}

int qp_tensor_stats(const void *p, int64_t n, int kind, double *out) {
    if (!qp_supported() || kind < 0 || kind > 2 || n < 1) return 1;
    qp_stats_avx2(p, n, kind, out);
    return 0;
}
"""
"""The one-pass statistics of a host tensor (C, GCC/Clang with x86 intrinsics): the float32
minimum and maximum and the float64 sum and sum of squares of its bfloat16, float16 or
float32 values. torch's operators need five passes (a float32 copy, ``aminmax``, a sum, the
squares, their sum: 44-49 ms for 80 tensors of 1024x1024 bf16 on one core here); this needs
one over the 2-byte values (21-31 ms), which left the writer's other core to the files.
Compiled for AVX2/FMA/F16C by function attributes (not ``-march``), so one cached library
serves every x86-64 machine of a shared home; it asks the CPU before it runs."""
_STATS_CFLAGS = ("-O2", "-shared", "-fPIC")
_STATS_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_STATS_BLOCK = 4096
"""``QP_BLOCK`` in ``_STATS_C``."""
_COMPILE_TIMEOUT = 120.0
"""Seconds the compiler may take (in its own thread, never training's) before it and its
children are killed and torch's operators stay in use."""


def _sums_depth(n: int) -> float:
    """The most additions any value of an ``n``-element sum goes through in the kernel: the
    block's 16 accumulators (``_STATS_BLOCK``/16 each), the block totals (n/``_STATS_BLOCK``),
    and at most 25 more (combining the lanes, the last 15 values): each float64 sum is
    within depth * 2**-53 of the sum of the magnitudes."""
    return _STATS_BLOCK / 16 + n / _STATS_BLOCK + 25


def _exact_enough(n: int, squares: float, deviation: float) -> bool:
    """Whether n var = S2 - S*mean (``deviation``) from the kernel's float64 sums is within
    2**-27 of itself. Each sum is within depth * 2**-53 * S2 (``_sums_depth``; the sum of
    magnitudes times the mean is at most S2, by Cauchy-Schwarz), so the difference is within
    3 * depth * 2**-53 * S2: kept where that is at most 2**-27 of it (the std then within
    2**-28, below float32's rounding). On 2**20 values that keeps a mean up to about 200
    spreads, on 2**24 up to 70; past it the float32 path's two passes give the spread."""
    return deviation >= squares * 3 * _sums_depth(n) * 2.0**-26


def _kernel_dir() -> Path:
    """``TENSOR_SAVE_KERNEL_DIR``, else ``kernels`` in quantpatch's cache (``QUANTPATCH_CACHE``
    or ``XDG_CACHE_HOME``, then ``~/.cache``, each with ``quantpatch``: where the CLI keeps
    its own, as ``quantpatch.base.megatron_source.cache_dir`` finds it, which this installed
    module cannot import); a directory of its own, so that the CLI's (which the umask may
    leave group-writable) does not decide whether code may be loaded."""
    raw = (os.environ.get("TENSOR_SAVE_KERNEL_DIR") or "").strip()
    if raw:
        return Path(raw)
    base = (os.environ.get("QUANTPATCH_CACHE") or os.environ.get("XDG_CACHE_HOME") or "").strip()
    root = Path(base) / "quantpatch" if base else Path.home() / ".cache" / "quantpatch"
    return root / "kernels"


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_STALE_BUILD = 3600.0
"""Seconds after which a build directory in the cache is removed whoever left it (a
compile takes ``_COMPILE_TIMEOUT`` at most)."""


class _Refused(Exception):
    """The kernel cache is not used, for the reason given."""


def _ancestor_trusted(st: os.stat_result) -> bool:
    """Whether only root and this user can rename entries of a directory above the cache:
    it is theirs, and nobody else can write it, or it is sticky (``/tmp``), where others
    cannot rename what they do not own (the next directory down is checked for that)."""
    return st.st_uid in (0, os.geteuid()) and (
        not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX)
    )


def _open_child(parent: int, name: str, where: Path) -> int:
    """Directory ``name`` in ``parent`` opened without following a link (made, 0700 whatever
    the umask, where it is not there)."""
    try:
        return os.open(name, _DIR_OPEN, dir_fd=parent)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                raise _Refused(f"{where} is a symbolic link") from None
        raise _Refused(f"no cache directory: {where} is not a directory") from None
    with contextlib.suppress(FileExistsError):  # a rank beside this one made it first
        os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIR_OPEN, dir_fd=parent)
    if os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, 0o700)
    return fd


def _open_cache_dir(directory: Path) -> int:
    """A descriptor of the kernel cache ``directory`` (made where it is not there), or
    ``_Refused``. Opened a directory at a time from ``/``, following no link (those above it
    are resolved once, by name, first); every directory above it must pass
    ``_ancestor_trusted`` and it must be this user's, a directory, and not writable by
    group or others, each checked on its open descriptor: nothing renamed in between
    can change what is then read, written or loaded through it."""
    path = Path(os.path.abspath(directory))
    if path == path.parent:
        raise _Refused(f"{path} cannot hold the kernel cache")
    names = [*Path(os.path.realpath(path.parent)).parts[1:], path.name]
    fd = os.open("/", _DIR_OPEN)
    where = Path("/")
    try:
        for name in names:
            st = os.fstat(fd)
            if not _ancestor_trusted(st):
                raise _Refused(
                    f"{where} lets others rename what it holds (owner uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):o})"
                )
            where = where / name
            child = _open_child(fd, name, where)
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise _Refused(f"{directory} is not a directory of this user's alone")
        _proc_path(fd)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _proc_path(fd: int) -> str:
    """``/proc/self/fd/N`` for ``fd``, where that is the same file (else ``_Refused``): the
    kernel is loaded through it, never by a name that could be swapped."""
    path = f"/proc/self/fd/{fd}"
    own = os.fstat(fd)
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
        raise _Refused("no /proc/self/fd to load the kernel through a descriptor")
    return path


def _own_file(fd: int, shown: Path) -> None:
    """``_Refused`` unless ``fd`` is a regular file of this user that nobody else can
    write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _Refused(f"{shown} is not this user's alone")


_GENERIC_ISA = ("-march=x86-64", "-mtune=generic", "-mno-avx")
"""Passed after ``$CC``'s own words: the library's code outside the AVX2 functions (which
``QP_TARGET`` enables, and which run only where the CPU has them) is plain x86-64 whatever
``-march``/``-mavx*`` the user's compiler command holds (an AVX-512 build on a shared home
would stop an AVX2 node with SIGILL)."""


def _stats_cflags() -> tuple[str, ...]:
    return (*_STATS_CFLAGS, *_GENERIC_ISA)


def _source_key() -> str:
    import hashlib

    return hashlib.sha256("\0".join((_STATS_C, *_stats_cflags())).encode()).hexdigest()[:16]


def _kernel_name(cc: list[str], version: str) -> str:
    """The cache entry for the kernel's source and flags compiled by ``cc`` (its words and
    ``version``, the first line of its ``--version``): another compiler gets another entry."""
    import hashlib

    words = hashlib.sha256("\0".join((*cc, version)).encode()).hexdigest()[:12]
    return f"tensor_stats_{_source_key()}_{words}.so"


def _compiler_version(cc: list[str]) -> str:
    """The first line ``cc --version`` prints, or "" where it prints none or fails."""
    try:
        code, output = _run([*cc, "--version"])
    except OSError:  # then it cannot compile either, and says so
        return ""
    lines = output.strip().splitlines() if code == 0 else []
    return lines[0].strip() if lines else ""


class _Cache:
    """The kernel cache, opened (``_open_cache_dir``): its directory's descriptor, the name of
    the library for this source and compiler in it (None: no compiler here, any library of
    this source), and that library's descriptor if it is there (-1: it is not)."""

    def __init__(self, fd: int, directory: Path, name: str | None) -> None:
        self.fd, self.directory, self.name, self.lib = fd, directory, name, -1

    @property
    def target(self) -> Path:
        return self.directory / (self.name or f"tensor_stats_{_source_key()}_*.so")

    def close(self) -> None:
        for fd in (self.lib, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.lib = -1


def _cache_target(cc: list[str] | None) -> tuple[_Cache | None, str]:
    """The kernel cache, opened, with the library for ``cc`` (None: no compiler, then any
    library of this source, all built with ``_GENERIC_ISA``) opened if it is there; or None
    and why it is not used (no home directory, a directory that cannot be made, a directory
    or library that others could write or swap, no ``/proc``)."""
    try:
        directory = _kernel_dir()
        fd = _open_cache_dir(directory)
    except _Refused as exc:
        return None, str(exc)
    except (OSError, RuntimeError) as exc:  # RuntimeError: Path.home() found no home
        return None, f"no cache directory: {exc}"
    cache = _Cache(fd, directory, None if cc is None else _kernel_name(cc, _compiler_version(cc)))
    name = cache.name
    if name is None:
        prefix = f"tensor_stats_{_source_key()}_"
        found = sorted(n for n in os.listdir(fd) if n.startswith(prefix) and n.endswith(".so"))
        name = found[0] if found else None
    try:
        if name is not None:
            cache.lib = os.open(name, _FILE_OPEN, dir_fd=fd)
            cache.name = name
            _own_file(cache.lib, cache.target)
    except FileNotFoundError:
        pass
    except OSError as exc:
        cache.close()
        return None, f"{directory / name} is not this user's alone ({exc})" if name else str(exc)
    except _Refused as exc:
        cache.close()
        return None, str(exc)
    return cache, ""


def _compiler() -> list[str] | None:
    """``$CC`` (split as a shell would: ``ccache gcc`` is two words), else the first of cc,
    gcc and clang on PATH."""
    import shlex
    import shutil

    raw = (os.environ.get("CC") or "").strip()
    if raw:
        with contextlib.suppress(ValueError):
            return shlex.split(raw) or None
        return [raw]
    found = next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)
    return [found] if found else None


_COMPILING: set[subprocess.Popen[str]] = set()
"""Compilers running now: killed with their children if the process exits first."""


def _kill_compilers() -> None:
    for proc in list(_COMPILING):
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, 9)


atexit.register(_kill_compilers)


def _run(command: list[str]) -> tuple[int | None, str]:
    """Run the compiler ``command`` in a session of its own (so that on a timeout its
    children, cc1, as, ld, are killed with it): its exit status (None: stopped after
    ``_COMPILE_TIMEOUT``) and output; ``OSError`` where it cannot run."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _COMPILING.add(proc)
    try:
        output, _ = proc.communicate(timeout=_COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, 9)
        proc.communicate()
        return None, ""
    finally:
        _COMPILING.discard(proc)
    return proc.returncode, output


def _compile_stats_kernel(build: int, cc: list[str]) -> tuple[int | None, str]:
    """``_STATS_C`` compiled by ``cc`` in the directory open as ``build`` (new, this process's
    own, 0700), named to the compiler through ``/proc/PID/fd``: a descriptor of the library
    (0700, checked to be this user's alone), or None and why not."""
    where = f"/proc/{os.getpid()}/fd/{build}"
    fd = os.open(
        "tensor_stats.c", os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_OPEN, 0o600, dir_fd=build
    )
    try:
        _write_all(fd, [_STATS_C.encode("utf-8")])
    finally:
        os.close(fd)
    command = [*cc, *_stats_cflags(), "-o", f"{where}/tensor_stats.so", f"{where}/tensor_stats.c"]
    try:
        code, output = _run(command)
    except OSError as exc:
        return None, f"{cc[0]} could not run ({type(exc).__name__}: {exc})"
    if code is None:
        return None, f"{cc[0]} took over {_COMPILE_TIMEOUT:g} s and was stopped"
    if code:
        lines = output.strip().splitlines() or ["no output"]
        return None, f"{cc[0]} failed ({lines[0][:200]})"
    lib = os.open("tensor_stats.so", _FILE_OPEN, dir_fd=build)
    try:
        os.fchmod(lib, 0o700)  # the compiler made it by the umask (0775 under 002)
        _own_file(lib, Path(where) / "tensor_stats.so")
    except BaseException:
        os.close(lib)
        raise
    return lib, ""


_StatsFn = Callable[[int, int, int], "tuple[float, ...] | None"]
_LOADED: list[int] = []
"""Descriptors of the libraries loaded, kept open: dlopen answers a name it has loaded
(``/proc/self/fd/N``) with what it loaded, so N must never name another library."""


def _load_stats_kernel(fd: int, shown: Path) -> tuple[_StatsFn | None, str, bool]:
    """The kernel open as ``fd`` (``shown`` in messages; the descriptor is taken over) as a
    Python function, checked on a known tensor; or None, why not, and whether compiling it
    again could help (not for a CPU without AVX2, FMA or F16C). Loaded through
    ``/proc/self/fd``: the file checked is the file loaded, whatever is renamed meanwhile.
    ctypes lets go of the GIL for the call, so the writer thread runs beside it."""
    import ctypes

    try:
        lib = ctypes.CDLL(_proc_path(fd))
    except (OSError, _Refused) as exc:
        os.close(fd)
        return None, f"{shown} does not load ({exc})", True
    _LOADED.append(fd)
    try:
        supported, fn = lib.qp_supported, lib.qp_tensor_stats
    except AttributeError as exc:
        return None, f"{shown} does not load ({exc})", True
    supported.restype = ctypes.c_int
    if not supported():
        return None, "the CPU lacks AVX2, FMA or F16C", False
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    out_type = ctypes.c_double * 4

    def stats(ptr: int, n: int, kind: int) -> tuple[float, ...] | None:
        out = out_type()
        return None if fn(ptr, n, kind, out) else tuple(out)

    probe = torch.tensor([1.5, -2.25, 0.5] * 7, dtype=torch.bfloat16)  # 16 at once, 5 alone
    got = stats(probe.data_ptr(), probe.numel(), _STATS_KINDS[torch.bfloat16])
    if got != (-2.25, 1.5, -1.75, 7 * (1.5**2 + 2.25**2 + 0.5**2)):
        return None, f"{shown} gives {got} on a known tensor", True
    return stats, str(shown), True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    return True


def _sweep_builds(cache: int) -> None:
    """Remove the build directories (``.build-HOST-PID-XXXX``) this user left in the cache
    open as ``cache``: those of a process of this host that has ended (killed while it
    compiled), and any older than ``_STALE_BUILD`` (another host's, or an older name)."""
    import shutil
    import socket

    host, now = socket.gethostname(), time.time()
    for entry in os.listdir(cache):
        if not entry.startswith(".build-"):
            continue
        try:
            st = os.stat(entry, dir_fd=cache, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        stale = now - st.st_mtime > _STALE_BUILD
        parts = entry[len(".build-") :].rsplit("-", 2)
        if not stale and len(parts) == 3 and parts[0] == host and parts[1].isdigit():
            stale = not _alive(int(parts[1]))
        if stale:
            shutil.rmtree(entry, dir_fd=cache, ignore_errors=True)


def _build_kernel(
    cache: _Cache | None, uncached: str, cc: list[str]
) -> tuple[_StatsFn | None, str]:
    """Compile (by ``cc``), load and check the kernel, then cache it (``cache`` None: not
    cached, for the reason ``uncached``). Built in a new directory of this process's own
    (``.build-HOST-PID-XXXX`` in the cache, after the ones a dead process left are swept;
    else in the system's temporary directory), reached through descriptors only and removed
    once the library is loaded: ranks that start together each build their own, and the last
    rename wins."""
    import secrets
    import shutil
    import socket
    import tempfile

    parent = -1
    if cache is not None:
        name = f".build-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            _sweep_builds(cache.fd)
            os.mkdir(name, 0o700, dir_fd=cache.fd)
            parent = os.dup(cache.fd)
        except OSError as exc:
            cache, uncached = None, f"the cache cannot be written: {exc}"
    if parent < 0:
        name = f"quantpatch-kernel-{os.getpid()}-{secrets.token_hex(4)}"
        parent = os.open(tempfile.gettempdir(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except BaseException:
            os.close(parent)
            raise
    try:
        build = os.open(name, _DIR_OPEN, dir_fd=parent)
        try:
            os.fchmod(build, 0o700)
            if os.fstat(build).st_uid != os.geteuid():
                return None, "the kernel's build directory is not this user's"
            _proc_path(build)
            lib, why = _compile_stats_kernel(build, cc)
            if lib is None:
                return None, why
            shown = cache.directory / str(cache.name) if cache else Path(name) / "tensor_stats.so"
            stats, note, _ = _load_stats_kernel(lib, shown)  # mapped: it survives its file
            if stats is None:
                return None, note
            if cache is None:
                return stats, f"compiled, not cached: {uncached}"
            try:
                os.replace(
                    "tensor_stats.so", str(cache.name), src_dir_fd=build, dst_dir_fd=cache.fd
                )
            except OSError as exc:
                return stats, f"compiled, not cached: {exc}"
            return stats, f"compiled: {shown}"
        finally:
            os.close(build)
    except _Refused as exc:
        return None, str(exc)
    finally:
        shutil.rmtree(name, dir_fd=parent, ignore_errors=True)
        os.close(parent)


def _find_kernel() -> tuple[_StatsFn | None, str]:
    """The cached kernel (this source, this compiler), else one compiled now (``_build_kernel``),
    or None and why there is none."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or sys.byteorder != "little":
        return None, f"not an x86-64 host ({platform.machine()})"
    cache = None
    try:
        cc = _compiler()
        cache, uncached = _cache_target(cc)
        if cache is not None and cache.lib >= 0:
            lib, cache.lib = cache.lib, -1
            stats, note, retry = _load_stats_kernel(lib, cache.target)
            if stats is not None:
                return stats, f"cached: {note}"
            if not retry:
                return None, note
    except Exception as exc:  # never let the saver fail for its kernel
        if cache is not None:
            cache.close()
        return None, f"the kernel could not be looked for ({type(exc).__name__}: {exc})"
    try:
        if cc is None:
            return None, "no C compiler (cc, gcc or clang) on PATH"
        return _build_kernel(cache, uncached, cc)
    except Exception as exc:  # never let the saver fail for its kernel
        return None, f"the kernel could not be built ({type(exc).__name__}: {exc})"
    finally:
        if cache is not None:
            cache.close()


_KERNEL_LOCK = threading.Lock()
_kernel: tuple[_StatsFn | None, str] | None = None
"""The kernel (or None) and where it came from (or why there is none), once known."""
_kernel_build: threading.Thread | None = None


def _stats_kernel(wait: bool = False) -> tuple[_StatsFn | None, str]:
    """The one-pass kernel and where it came from, or None and why there is none (yet).
    Looked for once per process, on the first host tensor measured, in a thread of its own:
    loaded from the cache when it is there (a few ms, with the compiler's ``--version``),
    else compiled (0.5 s), while torch's operators compute the statistics, so that neither
    training nor the saver ever waits for a compiler (``wait``: this caller does). Only a
    cache that passes ``_open_cache_dir`` and a library of this user that nobody else can
    write are used; otherwise it is compiled for this process alone. A cached kernel that
    does not load or gives a wrong answer on a known tensor is compiled again (and
    replaced); any error on the way leaves torch's operators in use."""
    global _kernel_build
    with _KERNEL_LOCK:
        if _kernel is None and _kernel_build is None:
            _kernel_build = threading.Thread(
                target=_find_kernel_thread, name="tensor_saver_kernel", daemon=True
            )
            _kernel_build.start()
        build = _kernel_build
    if wait and build is not None:
        build.join()
    found = _kernel
    return found if found is not None else (None, "being loaded or compiled")


def _find_kernel_thread() -> None:
    global _kernel
    found = _find_kernel()
    with _KERNEL_LOCK:
        _kernel = found


def _forget_stats_kernel() -> None:
    """Look for the kernel again on next use (tests and benchmarks; a build under way is
    waited for first)."""
    global _kernel, _kernel_build
    build = _kernel_build
    if build is not None:
        build.join()
    with _KERNEL_LOCK:
        _kernel, _kernel_build = None, None


def stats_kernel_status() -> str:
    """How host statistics are computed in this process (waiting for a compile under way):
    ``kernel (cached: PATH)``, ``kernel (compiled: PATH)``, ``kernel (compiled, not
    cached: WHY)`` or ``torch operators (WHY)``."""
    if not _CFG.stats_kernel:
        return "torch operators (TENSOR_SAVE_STATS_KERNEL is false)"
    stats, note = _stats_kernel(wait=True)
    return f"kernel ({note})" if stats is not None else f"torch operators ({note})"


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are where ``data_ptr`` says, one after the other: a plain (or
    parameter) tensor in host memory, dense, contiguous, with no lazy negation. A subclass
    that wraps others has no memory of its own there (its pointer is null or another's)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_neg()
        and t.data_ptr() != 0
    )


def _fused_stats(t: torch.Tensor) -> list[float] | None:
    """min, max, mean, std of host tensor ``t`` from one pass of the kernel, as float32 values;
    None where the kernel does not apply (another dtype, memory that is not plain and
    contiguous, no kernel yet, ``TENSOR_SAVE_STATS_KERNEL=false``) or where its sums are
    not exact enough for the spread (a value that is not finite, or a mean large next to
    the spread: ``_exact_enough``), which the float32 path then computes. The mean is
    within depth * 2**-53 of the values' root mean square (``_sums_depth``): within
    float32's rounding of itself unless the values nearly cancel (a mean below about 1e-7
    of that on 1M values), where it is still far closer than the float32 path's."""
    kind = _STATS_KINDS.get(t.dtype)
    if kind is None or not _CFG.stats_kernel or not _plain_memory(t):
        return None
    n = t.numel()
    if n > 1 and not _exact_enough(n, 1.0, 1.0):  # no spread could be kept: not worth a pass
        return None
    stats = _stats_kernel()[0]
    if stats is None:
        return None
    got = stats(t.data_ptr(), n, kind)
    if got is None:
        return None
    mn, mx, total, squares = got
    if not (math.isfinite(total) and math.isfinite(squares)):
        return None
    mean = total / n
    if n == 1:
        return _float32s(mn, mx, mean, 0.0)
    deviation = squares - total * mean
    if not _exact_enough(n, squares, deviation):
        return None
    return _float32s(mn, mx, mean, math.sqrt(deviation / (n - 1)))


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same data: storage, offset, dtype, version, and the elements
    they address in order (dimensions of size 1 dropped and mergeable ones merged, so that a
    view that only reshapes is the same tensor)."""
    try:
        ptr: Any = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        ptr = id(t)
    layout: list[tuple[int, int]] = []
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if size == 1:
            continue
        if layout and layout[-1][1] == size * stride:
            layout[-1] = (layout[-1][0] * size, stride)
        else:
            layout.append((size, stride))
    return (ptr, t.storage_offset(), t.dtype, t._version, tuple(layout))


_POOL_BYTES = 256 << 20
"""Host snapshot memory kept for reuse at most (CPU tensors)."""
_PINNED_POOL_BYTES = 4 << 30
"""Pinned host memory kept for the copies of device tensors at most (torch's own cache keeps
what is given back beyond it)."""
_HANDOVER_BYTES = 1 << 30
"""Device snapshots waiting for the statistics thread to give them a pinned host buffer at
most (device memory); beyond it the training thread makes the buffer itself."""


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer of ``t``'s shape and dtype (slow when torch has none cached)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class _HostPool:
    """Host snapshot buffers used again, by dtype and shape: pageable ones for CPU tensors
    (a fresh allocation of a few MiB is handed back to the OS when freed, so without reuse
    every snapshot page-faults its memory anew, which costs 4x the copy itself: 0.45 ms
    against 0.1 ms per 2 MiB here) and pinned ones for the copies of device tensors."""

    def __init__(self, cap: int) -> None:
        self.cap, self.bytes = cap, 0
        self.free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, t: torch.Tensor) -> torch.Tensor | None:
        """A free buffer of ``t``'s dtype and shape, or None (always for a quantized tensor,
        whose scale and zero point a buffer would not have, and which copies only from
        float)."""
        if t.is_quantized:
            return None
        key = (t.dtype, tuple(t.shape))
        with self.lock:
            bucket = self.free.get(key)
            buf = bucket.pop() if bucket else None
            if buf is not None:
                self.bytes -= buf.numel() * buf.element_size()
        return buf

    def snapshot(self, t: torch.Tensor) -> torch.Tensor:
        buf = self.take(t)
        if buf is None:
            return _clone(t)
        _raw(buf).copy_(_raw(t))
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        if buf.is_quantized:
            return
        nbytes = buf.numel() * buf.element_size()
        with self.lock:
            if self.bytes + nbytes <= self.cap:
                self.free.setdefault((buf.dtype, tuple(buf.shape)), []).append(buf)
                self.bytes += nbytes


_READY = 4
"""Tensors with their statistics waiting for a writer at most (host memory in flight)."""
_BEHIND = 2
"""Tensors waiting for a writer from which on the statistics thread writes the next file
itself (a writer takes the next one as soon as it is free, so one waiting is no backlog)."""


@functools.cache
def _openmp() -> Any:
    """torch's own OpenMP runtime, found among the libraries this process has loaded (None
    where there is none: another platform or another build). Looked up once per process: it
    took 1 ms, at the start of every statistics thread."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line and ".so" in line}
    except OSError:
        return None
    import ctypes

    for path in sorted(paths):
        if Path(path).name.split(".so")[0].split("-")[0] in ("libgomp", "libiomp5", "libomp"):
            with contextlib.suppress(OSError):
                lib = ctypes.CDLL(path)
                if hasattr(lib, "omp_set_num_threads"):
                    return lib
    return None


def _one_core() -> None:
    """torch's operators on one core in the calling thread, and in no other. OpenMP keeps
    the thread count per thread, but ``torch.set_num_threads`` also sets the count every
    thread inherits when it first runs an operator (the main thread too, before its first
    one), which cut a training process's later threads to one core; OpenMP's own call is
    made instead, after torch's set-up of this thread. Where torch's OpenMP runtime is not
    found, nothing changes."""
    torch.get_num_threads()  # torch's lazy per-thread set-up first, so it cannot undo this
    lib = _openmp()
    if lib is not None:
        lib.omp_set_num_threads(1)


def _yield_to_training() -> None:
    """Schedule the calling thread ``TENSOR_SAVE_NICE`` lower than the process (Linux sets
    priorities per thread). Where the saver and training compete for the cores, training
    goes first: on 2 cores its wait fell from 0.42x to 0.12x the fork's, and the saver
    finishes no later, since it runs whenever training waits for anything."""
    if not _CFG.nice or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):  # a sandbox that forbids it: the same priority
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _CFG.nice)


def _plain_host(host: torch.Tensor | None) -> bool:
    """Whether ``host`` is a plain tensor in host memory whose storage torch.save writes as
    it is in memory (little-endian)."""
    return (
        host is not None
        and type(host) is torch.Tensor
        and host.device.type == "cpu"
        and sys.byteorder == "little"
    )


class _Recorder:
    """The bytes of ``torch.save(obj)`` in its non-zip format, recorded instead of written, for
    the objects the plain pickler declines (``_plain_bytes``): the pickles are copied, and
    the host tensor's own bytes, which the format writes whole after them, are kept as a
    view of its memory (alive until the file is written). The file then goes out in one
    ``os.writev`` where torch.save made seven writes.

    The view is taken only where it is certainly the same bytes: ``host`` is a plain tensor
    in host memory, and the list of storage keys torch pickles last (before it flushes)
    holds one key, so the only storage written is ``host``'s own. A tensor in the metadata,
    a tensor subclass that wraps others, or a tensor on another device is copied as
    torch.save writes it."""

    def __init__(self, host: torch.Tensor | None) -> None:
        self.parts: list[Any] = []
        self.small = bytearray()
        self.host = host
        plain = _plain_host(host)
        self.nbytes = host.untyped_storage().nbytes() if plain and host is not None else -1
        self.last = 0  # where the last write before the flush begins in ``small``
        self.pickled = False  # torch.save flushes once its pickles are written
        self.single = False  # one storage to write: ``host``'s

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.single and size == self.nbytes >= _VIEW_MIN:
            assert self.host is not None
            if self.small:
                self.parts.append(self.small)
                self.small = bytearray()
            self.parts.append(_view(self.host))
            self.single = False  # once
        else:
            if not self.pickled:
                self.last = len(self.small)
            self.small += view
        return size

    def flush(self) -> None:
        if not self.pickled and self.nbytes >= _VIEW_MIN:
            try:  # torch's own pickle of a list of strings, made a moment ago
                keys = pickle.loads(self.small[self.last :])
            except Exception:
                keys = None
            self.single = isinstance(keys, list) and len(keys) == 1
        self.pickled = True

    def done(self) -> list[Any]:
        if self.small:
            self.parts.append(self.small)
            self.small = bytearray()
        return self.parts


_VIEW_MIN = 1 << 16
"""The smallest storage kept as a view of the tensor's memory rather than copied (bytes)."""


def _view(host: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor's storage, without a copy."""
    import ctypes

    storage = host.untyped_storage()
    memory = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    return memoryview(memory).cast("B")


class _NotPlain(Exception):
    """An object the plain pickler leaves to torch.save."""


_ATOMS = frozenset({dict, list, tuple, str, int, float, bool, type(None)})


class _PlainPickler(pickle.Pickler):
    """torch.save's legacy pickler for a dict of plain values and one plain host tensor.

    torch's own ``persistent_id`` (a Python closure, called for every object pickled: 61
    times for one saver file) and its per-call class and header set-up took 150 of the 190
    us a file cost; this one answers the same for the objects it knows and raises
    ``_NotPlain`` for any other (another tensor or storage, a module class, a subclass),
    which sends the whole object to torch.save. The persistent id is the tuple torch's
    legacy format writes for a typed storage: ``("storage", type, key, location, numel,
    None)``."""

    def __init__(self, file: IO[bytes], host: torch.Tensor) -> None:
        super().__init__(file, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.host = host
        self.storage = host.untyped_storage()
        self.known: tuple[Any, ...] = (host, torch._utils._rebuild_tensor_v2, OrderedDict)
        self.key: str | None = None

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMS:
            return None
        if kind is torch.storage.TypedStorage:
            storage = obj._untyped_storage
            if (
                self.key is not None
                or storage._cdata != self.storage._cdata
                or obj.dtype != self.host.dtype  # the element count is written in host's
            ):
                raise _NotPlain
            self.key = str(storage._cdata)
            storage_type = getattr(torch, obj._pickle_storage_type())
            self.known += (storage_type,)
            location = torch.serialization.location_tag(storage)
            return ("storage", storage_type, self.key, location, obj._size(), None)
        if (kind is OrderedDict and not obj) or any(obj is k for k in self.known):
            return None  # the tensor's own reduction: its rebuild function and empty hooks
        raise _NotPlain


@functools.cache
def _legacy_header() -> bytes:
    """The three pickles torch.save's legacy format starts with (magic number, protocol
    version, system information), taken from torch.save itself."""
    buffer = io.BytesIO()
    torch.save(None, buffer, _use_new_zipfile_serialization=False)
    buffer.seek(0)
    unpickler = pickle.Unpickler(buffer)
    for _ in range(3):
        unpickler.load()
    return buffer.getvalue()[: buffer.tell()]


def _plain_bytes(obj: Any, host: torch.Tensor) -> list[Any] | None:
    """What torch.save writes for ``obj`` (legacy format) when the plain pickler knows all of
    it, else None: the pickles, the keys of the one storage, its element count, and a view
    of its bytes."""
    buffer = io.BytesIO()
    buffer.write(_legacy_header())
    pickler = _PlainPickler(buffer, host)
    try:
        pickler.dump(obj)
    except _NotPlain:
        return None
    if pickler.key is None:
        return None
    pickle.dump([pickler.key], buffer, protocol=torch.serialization.DEFAULT_PROTOCOL)
    storage = pickler.storage
    buffer.write((storage.nbytes() // host.element_size()).to_bytes(8, "little"))
    return [buffer.getvalue(), _view(host)]


_LEGACY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.qint8,
        torch.quint8,
        torch.qint32,
        torch.quint4x2,
        torch.quint2x4,
    }
)
"""Dtypes torch's non-zip format can hold (those with a legacy storage class, such as
``torch.FloatStorage``). It writes any other (float8, uint16/32/64, complex32, bits, packed
fp4) under a storage class that does not exist, and ``torch.load`` then fails."""


def _torch_bytes(obj: Any, host: torch.Tensor | None) -> list[Any]:
    """What ``torch.save(obj, f, _use_new_zipfile_serialization=False)`` writes, in pieces;
    ``host`` is the tensor in ``obj``. torch.load (weights_only too) has always read this
    format, at 0.7 ms per 2 MiB against 1.9 ms for the zip format, whose CRC-32 and record
    layout cost more than the write itself. The saver's usual dict goes through the plain
    pickler (64 against 190 us a file); anything else through torch.save itself. A tensor
    of a dtype that format cannot hold (``_LEGACY_DTYPES``) is written in the zip format,
    ``torch.save``'s default; one torch cannot save at all (sub-byte integers) raises, and
    is counted as failed with torch's reason."""
    if host is not None and host.dtype not in _LEGACY_DTYPES:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return [buffer.getbuffer()]
    if _plain_host(host):
        assert host is not None
        parts = _plain_bytes(obj, host)
        if parts is not None:
            return parts
    recorder = _Recorder(host)
    torch.save(obj, cast(IO[bytes], recorder), _use_new_zipfile_serialization=False)
    return recorder.done()


def _write_all(fd: int, parts: list[Any]) -> None:
    """Write ``parts`` in order, in one ``os.writev`` unless it is cut short (a signal, a full
    disk), which releases the GIL while the bytes are copied."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        done = os.writev(fd, views) if len(views) > 1 else os.write(fd, views[0])
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][done:]


class _Item:
    __slots__ = ("cost", "device", "directory", "event", "host", "meta", "name", "stats")

    def __init__(
        self,
        name: str,
        host: torch.Tensor | None,
        stats: torch.Tensor | None,
        event: Any,
        meta: dict[str, Any],
        cost: int,
        directory: Path,
    ) -> None:
        self.name, self.host, self.stats, self.event = name, host, stats, event
        self.meta, self.cost, self.directory = meta, cost, directory
        self.device: torch.Tensor | None = None  # a device snapshot waiting for a host buffer


def _measure(item: _Item) -> None:
    """The statistics of ``item`` (of host snapshots: computed here), into its ``info``."""
    if item.stats is None:
        assert item.host is not None
        mn, mx, mean, std = _host_stats(item.host)
    else:
        if item.event is not None:  # the copies from the device: the statistics are read here
            item.event.synchronize()
        n = math.prod(item.meta["info"]["shape"])
        mn, mx, mean, std = _combine(item.stats.tolist(), n)
    item.meta["info"].update(min=mn, max=mx, mean=mean, std=std)


def _encode(item: _Item) -> list[Any]:
    """The bytes of ``item``'s file (or stats-only line), made by the thread that writes it:
    some are views of the snapshot, which goes back to the pool once they are written."""
    info = item.meta.pop("info")
    if _CFG.stats_only:
        line = json.dumps({"name": item.name, "tensor_info": info, "metadata": item.meta})
        return [(line + "\n").encode("utf-8")]
    obj = {"tensor": item.host, "tensor_info": info, "metadata": item.meta}
    return _torch_bytes(obj, item.host)


class _Saver:
    def __init__(self, pool: _HostPool | None = None, pinned: _HostPool | None = None) -> None:
        self.counter = 0
        # two stages: the statistics thread takes what training hands over, the writer
        # threads take what has its statistics; a few items wait between the two
        self.queue: queue.Queue[_Item | None] = queue.Queue(maxsize=_CFG.queue_size)
        self.ready: queue.Queue[_Item | None] = queue.Queue(maxsize=_READY)
        self.stats_thread: threading.Thread | None = None
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.append_lock = threading.Lock()  # stats-only lines: one writer at a time
        self.written_bytes = 0  # on disk
        self.pending_bytes = 0  # queued, counted against the cap until written or dropped
        self.files = 0
        self.dropped = 0
        self.drops_reported = 0
        self.failed = 0
        self.failures_reported = 0
        self.failure: tuple[Path, str] | None = None  # the first failed write since reported
        self.cap_reported = False
        self.micro_step = 0
        self.seen_forward: set[tuple[Any, ...]] = set()
        self.last_saved: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.stream: Any = None
        self.pool = pool or _HostPool(_POOL_BYTES)
        self.pinned = pinned or _HostPool(_PINNED_POOL_BYTES)
        self.handed_over = 0  # bytes of device snapshots waiting for a pinned buffer

    # micro-steps: a forward tensor seen again starts the next one
    def _step_for(self, key: tuple[Any, ...], operation: str) -> int:
        if operation == "forward":
            if key in self.seen_forward:
                self.micro_step += 1
                self.seen_forward.clear()
            self.seen_forward.add(key)
        return self.micro_step

    def _selected(self, step: int, layer_idx: int | None, name: str) -> bool:
        if _CFG.steps is not None and not _in(_CFG.steps, step):
            return False
        if _CFG.layers is not None and not _in(_CFG.layers, layer_idx):
            return False
        return _CFG.kinds is None or name in _CFG.kinds

    def _capped(self, cost: int) -> bool:
        total = self.written_bytes + self.pending_bytes
        if _CFG.max_bytes is None or total + cost <= _CFG.max_bytes:
            return False
        if not self.cap_reported:
            self.cap_reported = True
            print(
                f"[tensor_saver] TENSOR_SAVE_MAX_BYTES={_CFG.max_bytes} reached after "
                f"{total} bytes; no more tensors are saved.",
                file=sys.stderr,
            )
        return True

    def save(
        self,
        tensor: torch.Tensor,
        layer_type: str,
        operation: str,
        quant_type: str | None,
        tensor_name: str,
        layer_idx: int | None,
        metadata: Mapping[str, Any] | None,
        save_dir: Path | None = None,
    ) -> str | None:
        """Queue one tensor; the path its file will have, or ``None`` when not saved."""
        quant = quant_type or _CFG.default_quant
        md = dict(metadata or {})
        kind = md.get("module_kind")
        t = tensor.detach()
        # the same data handed over again in this micro-step with the same label (a fork's
        # own call next to an inserted one) is saved once
        same = (layer_type, layer_idx, kind, operation, tensor_name, quant)
        ident = _identity(t)
        before = self.last_saved.get(same)
        # an address means the same data only while the tensor seen there is alive: a freed
        # block is reused by the allocator for the next, different tensor
        if (
            before is not None
            and before[:2] == (ident, self.micro_step)
            and before[2]() is not None
        ):
            return None
        step_key = (layer_type, layer_idx, kind, tensor_name, md.get("phase"), md.get("component"))
        step = self._step_for(step_key, operation)
        self.last_saved[same] = (ident, step, weakref.ref(tensor))
        if not self._selected(step, layer_idx, tensor_name):
            return None
        nbytes = t.numel() * t.element_size()
        cost = 0 if _CFG.stats_only else nbytes
        with self.lock:
            if self._capped(cost):
                return None
            self.pending_bytes += cost
            self.counter += 1
            counter = self.counter
        rank, world = _rank_info()
        if md.get("rank") is not None:
            rank = md["rank"]
        stamp = time.strftime("%Y%m%d_%H%M%S")
        rank_part = f"_rank{rank}" if world > 1 else ""
        name = (
            f"{stamp}_{counter:04d}_{layer_type}_L{layer_idx}_{operation}_{quant}"
            f"{rank_part}_{tensor_name}"
        )
        meta: dict[str, Any] = {
            **md,
            "layer_type": layer_type,
            "operation": operation,
            "quant_type": quant,
            "tensor_name": tensor_name,
            "layer_idx": layer_idx,
            "save_time": time.time(),
            "micro_step": step,
            "rank": rank,
            "world_size": world,
            "git_commit": _source_commit(),
            "info": {
                "shape": list(t.shape),
                "dtype": str(t.dtype),
                "device": str(t.device),
                "requires_grad": tensor.requires_grad,
                "is_leaf": tensor.is_leaf,
            },
        }
        if _ITERATION is not None:
            meta["iteration"] = _ITERATION
        directory = save_dir or _CFG.save_dir
        try:
            item = self._capture(t, name, meta, cost, directory)
        except (RuntimeError, NotImplementedError) as exc:
            if t.dtype in _LEGACY_DTYPES and not t.is_quantized:
                raise
            # a dtype torch cannot copy (here, on this device): this tensor fails, not saving
            self._count_failure(cost, directory, exc)
            return None
        self._start()
        if _CFG.drop:
            try:
                self.queue.put_nowait(item)
            except queue.Full:
                with self.lock:
                    self.dropped += 1
                    self.pending_bytes -= cost
                self._release(item)  # its snapshot buffer serves the next tensor
                return None
        else:
            self.queue.put(item)
        return None if _CFG.stats_only else str(directory / f"{name}.pt")

    def _capture(
        self, t: torch.Tensor, name: str, meta: dict[str, Any], cost: int, directory: Path
    ) -> _Item:
        """Statistics on the tensor's device, and (unless stats-only) a host copy; on CUDA
        both leave on a side stream so the training stream does not wait."""
        if t.device.type != "cuda":
            # on the host the copy is the only work done here; the writer thread computes
            # the statistics from it
            return _Item(name, self.pool.snapshot(t), None, None, meta, cost, directory)
        stats = _device_moments(t)
        # a snapshot on the device, on the training stream: training may write into t right
        # after this call (a reused all-gather buffer, an in-place update), and an on-device
        # copy costs a fraction of the PCIe copy that then runs on the side stream
        snap = None if _CFG.stats_only else _clone(t, contiguous=False)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=t.device)  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream(t.device)
        self.stream.wait_stream(current)
        handed_over = None
        with torch.cuda.stream(self.stream):
            host_stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            host_stats.copy_(stats, non_blocking=True)
            host = None
            if snap is not None:
                host = self.pinned.take(snap)
                if host is None and self._hand_over(snap):
                    handed_over = snap
                elif host is None:  # the device holds enough snapshots already: made here
                    host = _pinned_like(snap)
                if host is not None:
                    _raw(host).copy_(_raw(snap), non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        if snap is not None:  # the allocator must not reuse the snapshot before the copy
            snap.record_stream(self.stream)
        stats.record_stream(self.stream)
        item = _Item(name, host, host_stats, event, meta, cost, directory)
        item.device = handed_over
        return item

    def _hand_over(self, snap: torch.Tensor) -> bool:
        """Whether the statistics thread makes ``snap``'s pinned host buffer and copies it.
        Pinning fresh host memory is the slow part of a copy from the device (an H100's VM:
        a step of 32 tensors, 1.6 GB, took 74-550 ms in the training thread until the
        buffers of a whole step had been made once, against 15-21 ms with them), so the
        training thread only takes free buffers, up to ``_HANDOVER_BYTES`` waiting."""
        nbytes = snap.numel() * snap.element_size()
        with self.lock:
            if self.handed_over + nbytes > _HANDOVER_BYTES:
                return False
            self.handed_over += nbytes
        return True

    def _copy_to_host(self, item: _Item) -> None:
        """The pinned buffer and the copy of a handed-over device snapshot (statistics
        thread), queued on the saver's stream behind what the training thread queued."""
        snap = item.device
        assert snap is not None
        # this thread's current device is 0 until set: the training process's GPU instead
        with torch.cuda.device(snap.device), torch.cuda.stream(self.stream):
            host = _pinned_like(snap)
            _raw(host).copy_(_raw(snap), non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        event.synchronize()
        item.host, item.event = host, event
        self._drop_device(item)

    def _drop_device(self, item: _Item) -> None:
        snap, item.device = item.device, None
        if snap is not None:
            with self.lock:
                self.handed_over -= snap.numel() * snap.element_size()

    def _start(self) -> None:
        if self.stats_thread is None or not self.stats_thread.is_alive():
            self.stats_thread = threading.Thread(
                target=self._prepare_all, name="tensor_saver_stats", daemon=True
            )
            self.stats_thread.start()
        if len(self.threads) == _CFG.writers and all(t.is_alive() for t in self.threads):
            return
        self.threads = [t for t in self.threads if t.is_alive()]
        while len(self.threads) < _CFG.writers:
            thread = threading.Thread(
                target=self._write_all, name=f"tensor_saver_{len(self.threads)}", daemon=True
            )
            thread.start()
            self.threads.append(thread)

    def _failed(self, item: _Item, exc: Exception) -> None:
        """Count a tensor that will not be written (training goes on; reported at flush)."""
        self._count_failure(item.cost, item.directory, exc)
        self._release(item)

    def _count_failure(self, cost: int, directory: Path, exc: Exception) -> None:
        with self.lock:
            self.pending_bytes -= cost
            self.failed += 1
            if self.failure is None:
                self.failure = (directory, f"{type(exc).__name__}: {exc}")

    def _release(self, item: _Item) -> None:
        """Give ``item``'s buffers back once it is written, failed or dropped (a dropped
        item's copy may still run: the next copy into its buffer is queued behind it)."""
        self._drop_device(item)
        if item.host is None:
            return
        if item.event is None:  # a CPU snapshot
            self.pool.give_back(item.host)
        else:
            self.pinned.give_back(item.host)

    def _prepare_all(self) -> None:
        """Stage one: the statistics of host snapshots (CUDA items come with theirs); a
        writer then writes the file. When the writers are behind (``_BEHIND`` waiting), this
        thread writes the file itself instead of queueing it (stats-only lines, tiny and in
        one shared file, always go to a writer). On 2 cores, 168 MB: the statistics take 21-31
        ms of a core by the one-pass kernel (45 by torch's operators) and the files 50-80
        (the pickles 5, the rest the operating system's); one writer
        alone left this thread idle once the statistics were done, and a writer slowed down
        (a core the host gave elsewhere, a slow copy into the page cache) took the whole
        pipeline with it: 110.8 ms median over 30 interleaved repetitions, 12 over 150 ms,
        against 78.2 ms and none over 150 when this thread writes too."""
        # one core for torch's operators in this thread: the writer thread needs the other,
        # and with two the three threads took turns (111-140 ms for 168 MB against 88-92)
        _one_core()
        _yield_to_training()
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                try:
                    if item.device is not None:
                        self._copy_to_host(item)
                    _measure(item)
                except Exception as exc:  # keep training alive; counted, reported at flush
                    self._failed(item, exc)
                    continue
                if not _CFG.stats_only and self.ready.qsize() >= _BEHIND:
                    self._finish(item)  # the writers are behind: written here
                else:
                    self.ready.put(item)
            finally:
                self.queue.task_done()

    def _write_all(self) -> None:
        """Stage two: the files (or stats-only lines)."""
        _yield_to_training()
        while True:
            item = self.ready.get()
            try:
                if item is None:
                    return
                self._finish(item)
            finally:
                self.ready.task_done()

    def _finish(self, item: _Item) -> None:
        """Write ``item``, and count it as written or failed."""
        try:
            self._write(item)
        except Exception as exc:  # keep training alive; counted, reported at flush
            self._failed(item, exc)
        else:
            with self.lock:
                self.pending_bytes -= item.cost
                self.written_bytes += item.cost
                self.files += 1
            self._release(item)

    def _write(self, item: _Item) -> None:
        parts = _encode(item)
        if _CFG.stats_only:
            with self.append_lock:
                _append(item.directory / f"stats_rank{item.meta['rank']}.jsonl", parts)
            return
        tmp = item.directory / f".{item.name}.pt.tmp"
        fd = _create(tmp, os.O_TRUNC)
        try:
            try:
                _write_all(fd, parts)
            finally:
                os.close(fd)
            os.replace(tmp, item.directory / f"{item.name}.pt")
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk must not keep a partial file
                tmp.unlink()
            raise

    def stop(self) -> None:
        """End the statistics and writer threads (after ``flush``), and wait for the side
        stream: a dropped tensor's copy may still run there, into a pinned buffer that the
        next saver (``configure()``) takes and copies into on a stream of its own."""
        if self.stream is not None:
            self.stream.synchronize()
        if self.stats_thread is not None and self.stats_thread.is_alive():
            self.queue.put(None)
            self.stats_thread.join()
        self.stats_thread = None
        alive = [t for t in self.threads if t.is_alive()]
        for _ in alive:
            self.ready.put(None)
        for thread in alive:
            thread.join()
        self.threads = []

    def flush(self) -> dict[str, Any]:
        if self.stats_thread is not None and self.stats_thread.is_alive():
            self.queue.join()
        if any(t.is_alive() for t in self.threads):
            self.ready.join()
        with self.lock:
            report = {
                "files": self.files,
                "bytes": self.written_bytes,
                "dropped": self.dropped,
                "failed": self.failed,
                "errors": [self.failure[1]] if self.failure else [],
            }
            failure, self.failure = self.failure, None
            new_failures = self.failed - self.failures_reported
            self.failures_reported = self.failed
            new_drops = self.dropped != self.drops_reported
            self.drops_reported = self.dropped
        if new_drops:
            print(
                f"[tensor_saver] dropped {self.dropped} tensor(s): the writer queue was full "
                "(TENSOR_SAVE_QUEUE / TENSOR_SAVE_DROP).",
                file=sys.stderr,
            )
        if new_failures and failure is not None:
            print(
                f"[tensor_saver] {new_failures} file(s) could not be written to {failure[0]} "
                f"and were dropped (first error: {failure[1]}).",
                file=sys.stderr,
            )
        return report


def _create(path: Path, mode: int) -> int:
    """``path`` opened for writing (``mode``: ``os.O_TRUNC`` or ``os.O_APPEND``), created if
    need be, with its directory: made on the first file there (or after it was removed), not
    looked up for every file."""
    flags = os.O_WRONLY | os.O_CREAT | mode
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, 0o644)


def _append(path: Path, parts: list[Any]) -> None:
    """Append ``parts`` whole or not at all (a failed write is cut off again)."""
    fd = _create(path, os.O_APPEND)
    try:
        start = os.fstat(fd).st_size
        try:
            _write_all(fd, parts)
        except BaseException:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


_SAVER = _Saver()
_ITERATION: int | None = None


def configure() -> None:
    """Read the environment again (tests and long-lived processes): everything queued is
    written first, then a fresh saver starts from the new settings, with the host snapshot
    buffers of the last (host and pinned): memory the process already has, where fresh
    buffers are faulted in (or pinned) anew (see ``_HostPool``)."""
    global ENABLED, _CFG, _SAVER
    flush()
    _SAVER.stop()
    _CFG, ENABLED = _load_config()
    _SAVER = _Saver(_SAVER.pool, _SAVER.pinned)


_FAILED = False


def _save(
    tensor: torch.Tensor | None,
    layer_type: str,
    operation: str,
    quant_type: str | None,
    tensor_name: str,
    layer_idx: int | None,
    metadata: Mapping[str, Any] | None,
    save_dir: Path | None = None,
) -> str | None:
    """Hand one tensor to the saver; an error inside it turns saving off, never training."""
    global ENABLED, _FAILED
    if tensor is None:
        return None
    try:
        if save_dir is None:
            return _SAVER.save(
                tensor, layer_type, operation, quant_type, tensor_name, layer_idx, metadata
            )
        return _SAVER.save(
            tensor, layer_type, operation, quant_type, tensor_name, layer_idx, metadata, save_dir
        )
    except Exception as exc:
        ENABLED = False
        if not _FAILED:
            _FAILED = True
            print(
                f"[tensor_saver] saving {layer_type} {operation} {tensor_name} failed "
                f"({type(exc).__name__}: {exc}); tensor saving is off for the rest of this run.",
                file=sys.stderr,
            )
        return None


# -- the public API: quantpatch's, and the one a fork's own saver has ------------------------

_FORK_ORDER = ("phase", "component", "rank", "metadata")


def _caller_order(
    func: str, extra: tuple[Any, ...], keywords: dict[str, Any], order: tuple[str, ...]
) -> dict[str, Any]:
    """The keywords, completed by the positional arguments after ``layer_idx``: one mapping
    (or ``None``) there is quantpatch's ``metadata``; anything else is in the order of a
    fork's saver (``phase, component, rank, metadata[, attention_weights]``)."""
    if not extra:
        return keywords
    if len(extra) == 1 and (extra[0] is None or isinstance(extra[0], Mapping)):
        order = ("metadata",)
    if len(extra) > len(order):
        raise TypeError(f"{func}() got {len(extra)} positional arguments after layer_idx")
    out = dict(keywords)
    for name, value in zip(order, extra, strict=False):
        if out.get(name) is not None:
            raise TypeError(f"{func}() got multiple values for argument '{name}'")
        out[name] = value
    return out


def _metadata(
    metadata: Mapping[str, Any] | None, phase: Any, component: Any, rank: Any
) -> dict[str, Any]:
    out = dict(metadata or {})
    for key, value in (("phase", phase), ("component", component), ("rank", rank)):
        if value is not None:
            out[key] = value
    return out


def save_tensor(
    tensor: torch.Tensor | None,
    layer_type: str,
    operation: str,
    quant_type: str | None,
    tensor_name: str,
    layer_idx: int | None = None,
    *args: Any,
    metadata: Mapping[str, Any] | None = None,
    phase: str | None = None,
    component: str | None = None,
    rank: int | None = None,
) -> str | None:
    """Save one tensor; the path its file will have (``None``: not saved)."""
    if not ENABLED or tensor is None:
        return None
    md = _save_tensor_metadata(args, metadata, phase, component, rank)
    return _save(tensor, layer_type, operation, quant_type, tensor_name, layer_idx, md)


def _save_tensor_metadata(
    args: tuple[Any, ...],
    metadata: Mapping[str, Any] | None,
    phase: str | None,
    component: str | None,
    rank: int | None,
) -> dict[str, Any]:
    """The metadata of a ``save_tensor`` call, whichever order (the contract's or the
    fork's) its positional arguments after ``layer_idx`` follow."""
    kw = _caller_order(
        "save_tensor",
        args,
        {"metadata": metadata, "phase": phase, "component": component, "rank": rank},
        _FORK_ORDER,
    )
    return _metadata(kw["metadata"], kw["phase"], kw["component"], kw["rank"])


def save_linear_tensors(
    input_tensor: torch.Tensor | None,
    weight: torch.Tensor | None,
    quant_type: str | None,
    operation: str = "forward",
    layer_idx: int | None = None,
    *args: Any,
    metadata: Mapping[str, Any] | None = None,
    phase: str | None = None,
    component: str | None = None,
    rank: int | None = None,
) -> dict[str, str | None]:
    """The operands of a linear GEMM: ``input`` and ``weight`` in the forward pass,
    ``grad_output`` and ``weight`` in the backward pass. Without a ``layer_idx`` the layer
    number and module kind are those of the layer that owns ``weight``."""
    first = "input" if operation == "forward" else "grad_output"
    if not ENABLED:
        return {first: None, "weight": None}
    kw = _caller_order(
        "save_linear_tensors",
        args,
        {"metadata": metadata, "phase": phase, "component": component, "rank": rank},
        _FORK_ORDER,
    )
    md = _metadata(kw["metadata"], kw["phase"], kw["component"], kw["rank"])
    if weight is not None and (layer_idx is None or "module_kind" not in md):
        found = linear_meta(weight)  # a fork's call names no layer: the weight's owner does
        if layer_idx is None:
            layer_idx = found["layer_idx"]
        md = {"module_kind": found["module_kind"], **md}
    return {
        first: _save(input_tensor, "linear", operation, quant_type, first, layer_idx, md),
        "weight": _save(weight, "linear", operation, quant_type, "weight", layer_idx, md),
    }


def save_attention_tensors(
    query: torch.Tensor | None,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    quant_type: str | None,
    operation: str = "forward",
    layer_idx: int | None = None,
    *args: Any,
    metadata: Mapping[str, Any] | None = None,
    phase: str | None = None,
    component: str | None = None,
    rank: int | None = None,
    attention_weights: torch.Tensor | None = None,
) -> dict[str, str | None]:
    """The operands of attention (``attention_weights``: the attention probabilities, saved
    as ``attention_probs``)."""
    names = ("query", "key", "value", "attention_weights")
    if not ENABLED:
        return dict.fromkeys(names)
    kw = _caller_order(
        "save_attention_tensors",
        args,
        {
            "metadata": metadata,
            "phase": phase,
            "component": component,
            "rank": rank,
            "attention_weights": attention_weights,
        },
        (*_FORK_ORDER, "attention_weights"),
    )
    md = {"module_kind": "core_attention"}
    md.update(_metadata(kw["metadata"], kw["phase"], kw["component"], kw["rank"]))
    tensors = (query, key, value, kw["attention_weights"])
    return {
        name: _save(
            tensor,
            "attention",
            operation,
            quant_type,
            "attention_probs" if name == "attention_weights" else name,
            layer_idx,
            md,
        )
        for name, tensor in zip(names, tensors, strict=True)
    }


class TensorSaver:
    """The object API of a fork's saver over this module: ``get_tensor_saver()`` returns the
    shared one (whose ``enabled`` and ``save_dir`` are this module's settings); one made
    directly may have its own directory and switch."""

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, enabled: Any = None):
        self._save_dir = Path(save_dir) if save_dir else None
        self._enabled = None if enabled is None else bool(enabled)

    @property
    def enabled(self) -> bool:
        return ENABLED if self._enabled is None else self._enabled

    @enabled.setter
    def enabled(self, value: Any) -> None:
        global ENABLED
        if self is _SHARED:
            ENABLED = bool(value)
        else:
            self._enabled = bool(value)

    @property
    def save_dir(self) -> str:
        return str(self._save_dir or _CFG.save_dir)

    @save_dir.setter
    def save_dir(self, value: str | os.PathLike[str]) -> None:
        if self is _SHARED:
            _CFG.save_dir = Path(value)
        else:
            self._save_dir = Path(value)

    @property
    def counter(self) -> int:
        return _SAVER.counter

    @property
    def iteration(self) -> int:
        return _ITERATION or 0

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.set_iteration(value)

    def set_iteration(self, iteration: int) -> None:
        """The training iteration, recorded in the metadata of every file from now on."""
        global _ITERATION
        _ITERATION = iteration

    def save_tensor(
        self,
        tensor: torch.Tensor | None,
        layer_type: str,
        operation: str,
        quant_type: str | None,
        tensor_name: str,
        layer_idx: int | None = None,
        *args: Any,
        metadata: Mapping[str, Any] | None = None,
        phase: str | None = None,
        component: str | None = None,
        rank: int | None = None,
    ) -> str | None:
        if not self.enabled or tensor is None:
            return None
        md = _save_tensor_metadata(args, metadata, phase, component, rank)
        return _save(
            tensor, layer_type, operation, quant_type, tensor_name, layer_idx, md, self._save_dir
        )

    def flush(self) -> dict[str, Any]:
        return flush()


_SHARED = TensorSaver()


def get_tensor_saver() -> TensorSaver:
    """The shared saver object (a fork's API)."""
    return _SHARED


def flush() -> dict[str, Any]:
    """Wait until every queued tensor is on disk; report files, bytes, drops and failed
    writes (each kind of loss said once on stderr)."""
    return _SAVER.flush()


atexit.register(flush)
