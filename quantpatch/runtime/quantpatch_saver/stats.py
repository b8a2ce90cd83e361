"""The statistics recorded with each tensor (min, max, mean, std, as float32 values), by
torch's operators: on the device for a device tensor, queued on its stream without waiting
for the host (``device_moments``, combined on the host by ``combine``); on the host for a
host tensor (``host_stats``). The one-pass C kernel of ``stats_kernel.py`` answers for host
tensors instead where ``TENSOR_SAVE_ACCELERATORS`` holds ``stats-kernel`` and it applies."""

from __future__ import annotations

import math
import threading

import torch

from . import settings, stats_kernel
from .dtypes import NATIVE_STATS, RAW_COPY, float32s


def statable(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` where torch's reductions take its dtype; an exact float copy where its values
    are real numbers torch converts (float8 and uint16 as float32, which the one-pass kernel
    takes: 11 against 20 ms as float64 for a 1024x1024 float8 tensor on one thread here;
    uint32/64 as float64); None where min, max, mean and std have no meaning or no
    operators (complex, bits, packed fp4, sub-byte integers, quantized): its statistics are
    then recorded as None."""
    if t.dtype in NATIVE_STATS:
        return t
    if t.dtype.is_complex or t.is_quantized or t.dtype in RAW_COPY:
        return None
    exact = torch.float32 if t.dtype.is_floating_point or t.dtype == torch.uint16 else None
    try:
        return t.to(exact or torch.float64)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


DEVICE_CHUNK = 1 << 24
"""Elements of a device tensor in one float64 copy for its moments (128 MB of device memory,
what the float32 copy of a 64 MB bf16 tensor took before)."""


def device_moments(t: torch.Tensor) -> torch.Tensor:
    """The statistics of device tensor ``t`` as kernels queued on its stream, none of which
    waits for the host: one tensor [min, max, then the mean and the population variance of
    each chunk of ``DEVICE_CHUNK`` elements], float64, that ``combine`` turns into min,
    max, mean, std on the host.

    Six kernels for a tensor up to 16M elements (min and max of ``t`` itself, exact; a
    float64 copy; ``var_mean``, whose Welford sums in float64 neither overflow nor underflow
    for any float32 value and keep the spread under a mean 1e7 times larger; one stack),
    where the scaled two-pass float32 formula queued 37 operators: their launches took 21.6
    ms of the training thread for the 32 tensors (1.6 GB) of a step on an H100, against a
    9.6 ms step. Float64 tensors take ``_two_pass``. A device without float64 (MPS) sums
    in float32: values beyond 1e19 in magnitude give an infinite std there."""
    acc = torch.float32 if t.device.type == "mps" else torch.float64
    values = statable(t)
    if values is None:  # no statistics: ``combine`` gives None for each
        return torch.empty(0, dtype=acc, device=t.device)
    flat = values.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if not flat.numel():
        return torch.zeros(2, dtype=acc, device=t.device)
    mn, mx = torch.aminmax(flat)
    parts = [mn.to(acc), mx.to(acc)]
    for start in range(0, flat.numel(), DEVICE_CHUNK):
        chunk = flat[start : start + DEVICE_CHUNK]
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


def combine(values: list[float], n: int) -> list[float | None]:
    """min, max, mean, std (float32 values) from ``device_moments``'s numbers for a tensor of
    ``n`` elements: the chunks' means and variances are combined in Python floats (Chan's
    formula; weighted by k/n, so the sum stays within the largest mean). A value that is not
    finite makes the mean what the sum would be (inf, -inf, or NaN for both or for a NaN, in
    one chunk or in two) and the std NaN (0 for a single element), as on the host. No
    numbers at all (a dtype without statistics, ``statable``): None for each."""
    if not n:
        return [0.0] * 4
    if not values:
        return [None] * 4
    mn, mx = values[0], values[1]
    sizes = [min(DEVICE_CHUNK, n - start) for start in range(0, n, DEVICE_CHUNK)]
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
    return list(float32s(mn, mx, mean, std))


def host_stats(t: torch.Tensor) -> list[float | None]:
    """min, max, mean, std of a host tensor as float32 values (``t`` is never written): by the
    one-pass kernel (``stats_kernel.fused_stats``) where it is on and applies, else by
    torch's operators, with the reductions' results as Python floats (the dozen scalar
    tensor operations that combined them cost 60 us a tensor: 5 of 46 ms for 80 tensors of
    1024x1024). A dtype without statistics (``statable``) gets None for each; float8 and
    uint16/32/64 values are measured in a float copy (float32 for float8 and uint16, float64
    for the others)."""
    if not t.numel():
        return [0.0] * 4
    values = statable(t)
    if values is None:
        return [None] * 4
    t = values
    if settings.accelerated("stats-kernel"):
        fused = stats_kernel.fused_stats(t)
        if fused is not None:
            return list(fused)
    d = _float_copy(t)
    mn, mx = (float(v) for v in torch.aminmax(d))
    mean, std = _moments_host(t, d, max(abs(mn), abs(mx)))
    return list(float32s(mn, mx, mean, std))


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
