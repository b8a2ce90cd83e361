"""Every GPU figure of the project in one command, written as JSON and as a Markdown table.

Usage: python benchmarks/gpu_suite.py [--device cuda|cpu] [--out DIR] [--skip saver,e2e]
    [--megatron-lm PATH] [--size N] [--e2e-schemes bf16,FA_linear_nvfp4] [--e2e-steps N]

1. Fake quant (``fake_quant`` through the fused Triton kernels, and the PyTorch reference for
   comparison) on an 8192 x 8192 bf16 tensor: GB/s (input read + output written) next to a
   device-to-device copy of the same tensor in the same run, CUDA kernels per call (torch
   profiler) and peak extra memory per call against the output's size; NVFP4 (round to
   nearest, stochastic, 16 x 16 tiles) beside MXFP4.
2. The tensor saver (``saver_overhead.py --json``): disabled overhead as a share of a step, and
   the saving-step stall against a pinned device-to-host copy of the same bytes.
1b. ParetoQ weight quantization (``paretoq_quantize`` with the layer's step: w1.58, w2,
   w4g128) of a hidden x hidden bf16 weight against the linear layer's forward on TOKENS x
   hidden bf16 activations (quantization + GEMM): the quantization's share of that forward
   (hidden 4096, 8192 tokens on a GPU; 256 and 512 on CPU).
3. The tiny megatron-core GPT (``gpu_e2e.py --json``) from an ``init``ed checkout: step time per
   scheme (FA_linear_nvfp4 among them), bf16 = 1.0.
4. Flash attention: the attention core of one llama32-1b layer (32 query heads, 8
   key/value heads, head dim 64, batch 1, causal, bf16) at sequence 4096, forward + backward:
   the unfused local attention as Megatron's ``DotProductAttention`` computes it (repeated
   key/value heads, ``baddbmm`` scores, float32 softmax, ``bmm``) in bf16 and with
   ``quant_baddbmm`` (mxfp8), and ``quant_flash_attention`` in bf16 and mxfp8 (the FA_mxfp8
   route): time, ratio to the bf16 flash kernel and to the unfused bf16 attention, peak memory
   and the bytes kept for the backward.
5. The generated scripts, run (``pretrain_runs.py``): a Megatron-LM clone (``--megatron-lm``,
   core_v0.13.1) ``init``ed with the saver installed, ``smoke`` scripts for llama32-1b and
   deepseek2_lite run through ``torchrun pretrain_gpt.py`` (bf16, FA_linear_mxfp8 with the saver
   on, FA_linear_hifp8), then ``runs`` and ``report``: step time per scheme against bf16, finite
   losses, the commit each log names, the saver's files. Off a GPU a stub ``torchrun`` stands in.

5. The models' shapes: the fake-quant kernels (Triton only) at the models' shapes (8192 x 4096,
   8192 x 14336, 4096 x 128256) as % of a copy of the same tensor; the quantized GEMM at
   8192^3 and the models' shapes (tokens x hidden @ hidden x ffn, ffn x hidden, hidden x
   vocabulary), fused (operands quantized in the GEMM's tile loop) and separate (two
   fake-quant kernels + torch.matmul), each against a bf16 torch.matmul, and auto's choice;
   the weight cache over k micro-batches of Megatron's three linear GEMMs (hit ratio, bytes
   held, quantizations, step time with the cache on and off).

Bars: each op >= 30 % of the copy (goal 50 %), <= 2 kernels per MX call, extra memory <= one
output tensor; ParetoQ weight quantization < 10 % of the layer's forward; FA_linear_mxfp8 step
<= 1.3x bf16; saver stall <= 3x the pinned copy; disabled saver <= 1 % of a step. At the
models' shapes: every kernel >= 80 % of the copy; the quantized GEMM (the faster path) <= 1.08x
bf16; each weight quantized once per step
(hit ratio (k - 1) / k).

Without a GPU (``--device cpu``) the same suite runs end to end with the kernels in Triton's
interpreter and small sizes, so it runs first time on a GPU; CPU figures are not the bars'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
OPS = (  # name, format, backward, dim
    ("mxfp8 E4M3, rows", "mxfp8", False, -1),
    ("mxfp8 E5M2, rows", "mxfp8", True, -1),
    ("mxfp8 E4M3, columns", "mxfp8", False, 0),
    ("mxfp4 E2M1, rows", "mxfp4", False, -1),
    ("nvfp4 E2M1 (E4M3 scales), rows", "nvfp4", False, -1),
    ("nvfp4 stochastic (gradients), rows", "nvfp4", True, -1),
    ("nvfp4-2d 16x16 tiles", "nvfp4-2d", False, -1),
    ("hifp8", "hifp8", False, -1),
)
NVFP4 = ("nvfp4", "nvfp4-2d")
"""Reported beside MXFP4 but judged by no bar (the ops' bars are the MX and HiF8 ops'):
NVFP4's tensor amax is one torch reduction before its kernel, and stochastic rounding
draws its uniforms with torch.rand (one float32 tensor)."""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, iters: int) -> float:
    fn()  # warm-up (and compilation)
    samples = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def kernels_per_call(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def extra_memory(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def bench_ops(device: str, n: int, iters: int) -> dict[str, Any]:
    from quantpatch.runtime import quantpatch_ops as ops

    x = torch.randn(n, n, device=device).to(torch.bfloat16)
    nbytes = 2 * x.numel() * x.element_size()
    copy_s = timed(lambda: x.clone(), device, iters)
    rows = []
    for name, fmt, backward, dim in OPS:
        entry: dict[str, Any] = {"op": name, "format": fmt}
        for path in ("triton", "reference"):
            os.environ["QUANTPATCH_KERNELS"] = path

            def call(fmt: str = fmt, backward: bool = backward, dim: int = dim) -> torch.Tensor:
                return ops.fake_quant(x, fmt, dim=dim, backward=backward)

            s = timed(call, device, iters if path == "triton" else max(1, iters // 3))
            entry[f"{path}_ms"] = s * 1e3
            entry[f"{path}_gbs"] = nbytes / s / 1e9
            entry[f"{path}_pct_of_copy"] = 100 * copy_s / s
            if device == "cuda":
                entry[f"{path}_kernels"] = kernels_per_call(call)
                entry[f"{path}_extra_vs_output"] = extra_memory(call) / (x.numel() * 2)
        rows.append(entry)
    os.environ["QUANTPATCH_KERNELS"] = "auto"
    return {
        "shape": [n, n],
        "dtype": "bfloat16",
        "copy_ms": copy_s * 1e3,
        "copy_gbs": nbytes / copy_s / 1e9,
        "ops": rows,
    }


def unfused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str, scale: float
) -> torch.Tensor:
    """Megatron's local DotProductAttention (causal, the torch softmax path): [sq, b, h, dv]."""
    from quantpatch.runtime import quantpatch_ops as ops

    sq, b, h, _ = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    query = q.reshape(sq, b * h, -1).transpose(0, 1)
    key = k.reshape(sq, b * h, -1).transpose(0, 1).transpose(1, 2)
    buf = torch.empty((b * h, sq, sq), dtype=q.dtype, device=q.device)
    if fmt == "bf16":
        scores = torch.baddbmm(buf, query, key, beta=0.0, alpha=scale)
    else:
        scores = ops.quant_baddbmm(buf, query, key, beta=0.0, alpha=scale, fmt=fmt)
    mask = torch.ones(sq, sq, dtype=torch.bool, device=q.device).triu(1)
    x = scores.view(b, h, sq, sq).float().masked_fill(mask, -10000.0)
    probs = torch.softmax(x, dim=-1).to(q.dtype).view(b * h, sq, sq)
    ctx = torch.bmm(probs, v.reshape(sq, b * h, -1).transpose(0, 1))
    return ctx.view(b, h, sq, -1).permute(2, 0, 1, 3)


FLASH_ROWS = (  # name, path, format
    ("unfused bf16 (stock)", "unfused", "bf16"),
    ("unfused mxfp8 (QUANTPATCH_FLASH=0)", "unfused", "mxfp8"),
    ("flash bf16", "flash", "bf16"),
    ("flash mxfp8 (FA_mxfp8)", "flash", "mxfp8"),
)


def bench_flash(device: str, seq: int, heads: int, groups: int, dim: int, iters: int) -> dict:
    from quantpatch.runtime import quantpatch_ops as ops

    os.environ["QUANTPATCH_FLASH"] = "1"  # CPU tensors too, in the interpreter
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)

    q, k, v = rnd(seq, 1, heads, dim), rnd(seq, 1, groups, dim), rnd(seq, 1, groups, dim)
    grad = rnd(seq, 1, heads, dim)
    scale = dim**-0.5
    rows = []
    for name, path, fmt in FLASH_ROWS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def step(path: str = path, fmt: str = fmt, leaves: list = leaves) -> None:
            for t in leaves:
                t.grad = None
            if path == "flash":
                out = ops.quant_flash_attention(*leaves, fmt=fmt, causal=True, softmax_scale=scale)
            else:
                out = unfused_attention(*leaves, fmt, scale)
            out.backward(grad)

        kept: list[int] = []

        def pack(t: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
        entry: dict[str, Any] = {"row": name, "saved_mib": sum(kept) / 2**20}
        entry["ms"] = timed(step, device, iters) * 1e3
        if device == "cuda":
            entry["peak_mib"] = extra_memory(step) / 2**20
        rows.append(entry)
    os.environ.pop("QUANTPATCH_FLASH")
    by = {e["row"]: e for e in rows}
    for e in rows:
        e["vs_flash_bf16"] = e["ms"] / by["flash bf16"]["ms"]
        e["vs_unfused_bf16"] = e["ms"] / by["unfused bf16 (stock)"]["ms"]
    return {"seq": seq, "heads": heads, "groups": groups, "dim": dim, "rows": rows}


# the models' shapes. Fake quant: [rows, reduction] bf16 tensors; GEMM: (M, K, N)
KERNEL_SHAPES = ((8192, 8192), (8192, 4096), (8192, 14336), (4096, 128256))
GEMM_SHAPES = ((8192, 8192, 8192), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 128256))
GEMM_FORMATS = (("mxfp8", False), ("mxfp8", True), ("mxfp4", False), ("hifp8", False))
CPU_KERNEL_SHAPES = ((64, 64), (64, 32), (32, 112))
CPU_GEMM_SHAPES = ((40, 64, 48),)


def bench_kernel_shapes(
    device: str, shapes: tuple[tuple[int, int], ...], iters: int
) -> list[dict[str, Any]]:
    """Each fake-quant kernel (Triton) as % of a copy of the same tensor, per shape."""
    from quantpatch.runtime import quantpatch_ops as ops

    os.environ["QUANTPATCH_KERNELS"] = "triton"
    out = []
    try:
        for rows, n in shapes:
            x = torch.randn(rows, n, device=device).to(torch.bfloat16)
            nbytes = 2 * x.numel() * x.element_size()
            copy_s = timed(lambda x=x: x.clone(), device, iters)
            entry: dict[str, Any] = {"shape": [rows, n], "copy_gbs": nbytes / copy_s / 1e9}
            for name, fmt, backward, dim in OPS:

                def call(
                    x: torch.Tensor = x, fmt: str = fmt, backward: bool = backward, dim: int = dim
                ) -> object:
                    return ops.fake_quant(x, fmt, dim=dim, backward=backward)

                s = timed(call, device, iters)
                entry[name] = {"gbs": nbytes / s / 1e9, "pct_of_copy": 100 * copy_s / s}
            out.append(entry)
            del x
    finally:
        os.environ["QUANTPATCH_KERNELS"] = "auto"
    return out


def bench_gemm(
    device: str,
    shapes: tuple[tuple[int, int, int], ...],
    iters: int,
    formats: tuple[tuple[str, bool], ...] = GEMM_FORMATS,
) -> list[dict[str, Any]]:
    """The quantized GEMM ``a @ weight.t()`` (bf16, no autograd: as in Megatron's linear
    function), fused and separate, against a bf16 ``torch.matmul``; the weight cache off, so
    both operands are quantized in every call."""
    from quantpatch.runtime import quantpatch_ops as ops

    saved = {k: os.environ.get(k) for k in ("QUANTPATCH_GEMM", "QUANTPATCH_WEIGHT_CACHE")}
    os.environ["QUANTPATCH_WEIGHT_CACHE"] = "0"
    out = []
    try:
        for m, k, n in shapes:
            a = torch.randn(m, k, device=device).to(torch.bfloat16)
            w = torch.nn.Parameter(torch.randn(n, k, device=device).to(torch.bfloat16))
            with torch.no_grad():
                bf16_s = timed(lambda a=a, w=w: torch.matmul(a, w.t()), device, iters)
                entry: dict[str, Any] = {"shape": [m, k, n], "bf16_ms": bf16_s * 1e3}
                for fmt, backward in formats:
                    row: dict[str, Any] = {}
                    for path in ("separate", "fused", "auto"):
                        if path == "auto" and device != "cuda":
                            continue  # auto takes the separate path on CPU
                        os.environ["QUANTPATCH_GEMM"] = path

                        def call(
                            a: torch.Tensor = a,
                            w: torch.Tensor = w,
                            fmt: str = fmt,
                            backward: bool = backward,
                        ) -> object:
                            return ops.quant_matmul(a, w.t(), fmt, backward=backward)

                        s = timed(call, device, iters)
                        row[f"{path}_ms"] = s * 1e3
                        row[f"{path}_vs_bf16"] = s / bf16_s
                    if device == "cuda":
                        row["auto_choice"] = [
                            v for key, v in ops.gemm_choices().items() if f"'{fmt}'" in key
                        ][-1:]
                    entry[f"{fmt}{' E5M2' if backward else ''}"] = row
            out.append(entry)
            del a, w
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out


class _Linear(torch.autograd.Function):
    """Megatron's linear autograd function as ``quantpatch init`` patches it: forward
    ``x @ w.t()``, dgrad ``gy @ w`` and wgrad ``gy.t() @ x`` (``backward=True``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
        from quantpatch.runtime import quantpatch_ops as ops

        ctx.save_for_backward(x, w)
        ctx.fmt = fmt
        return ops.quant_matmul(x, w.t(), fmt)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        from quantpatch.runtime import quantpatch_ops as ops

        x, w = ctx.saved_tensors
        dgrad = ops.quant_matmul(gy, w, ctx.fmt, backward=True)
        wgrad = ops.quant_matmul(gy.t(), x, ctx.fmt, backward=True)
        return dgrad, wgrad, None


def bench_weight_cache(
    device: str, hidden: int, ffn: int, tokens: int, micro_batches: int, steps: int
) -> dict[str, Any]:
    """An MLP stack (hidden -> ffn -> hidden, bf16 weights, SGD) trained ``steps`` steps of
    ``micro_batches`` micro-batches through the patched linear function, mxfp8, with the
    weight cache on and off: hit ratio, bytes held, quantizations and step time."""
    from quantpatch.runtime import quantpatch_ops as ops

    saved = os.environ.get("QUANTPATCH_WEIGHT_CACHE")
    result: dict[str, Any] = {
        "hidden": hidden,
        "ffn": ffn,
        "tokens": tokens,
        "micro_batches": micro_batches,
        "weight_bytes": 2 * 2 * hidden * ffn,
    }
    try:
        for cache in ("1", "0"):
            os.environ["QUANTPATCH_WEIGHT_CACHE"] = cache
            ops.weight_cache_clear()
            ops.weight_cache_reset_stats()
            gen = torch.Generator(device=device).manual_seed(0)
            ws = [
                torch.nn.Parameter(
                    (torch.randn(o, i, device=device, generator=gen) * i**-0.5).to(torch.bfloat16)
                )
                for o, i in ((ffn, hidden), (hidden, ffn))
            ]
            opt = torch.optim.SGD(ws, lr=1e-3)
            x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
            samples = []
            for _ in range(steps):
                _sync(device)
                start = time.perf_counter()
                for _ in range(micro_batches):
                    h = x.requires_grad_()
                    for w in ws:
                        h = _Linear.apply(h, w, "mxfp8")
                    h.float().square().mean().backward()
                bytes_held = ops.weight_cache_stats()["bytes"]
                opt.step()
                opt.zero_grad()
                _sync(device)
                samples.append(time.perf_counter() - start)
            stats = ops.weight_cache_stats()
            key = "on" if cache == "1" else "off"
            result[f"step_ms_{key}"] = statistics.median(samples) * 1e3
            if cache == "1":
                result["hit_ratio"] = stats["hit_ratio"]
                result["hits"], result["misses"] = stats["hits"], stats["misses"]
                result["bytes_held"] = bytes_held
                result["quantizations_per_step"] = stats["misses"] / steps
            else:
                result["quantizations_per_step_off"] = stats["bypassed"] / steps
    finally:
        if saved is None:
            os.environ.pop("QUANTPATCH_WEIGHT_CACHE", None)
        else:
            os.environ["QUANTPATCH_WEIGHT_CACHE"] = saved
        ops.weight_cache_clear()
    result["step_on_vs_off"] = result["step_ms_on"] / result["step_ms_off"]
    return result


def bench_rht(device: str, rows: int, cols: int, iters: int) -> dict[str, Any]:
    """The fused RHT + NVFP4 kernel (``nvfp4-rht``, the wgrad operands) against the
    NVFP4 kernel alone on a [rows, cols] bf16 tensor, round to nearest and stochastic, in ms
    (the kernels: on CPU in Triton's interpreter)."""
    from quantpatch.runtime import quantpatch_ops as ops
    from quantpatch.runtime import quantpatch_rht as rht

    saved = os.environ.get("QUANTPATCH_KERNELS")
    os.environ["QUANTPATCH_KERNELS"] = "triton"
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, cols, generator=gen).to(device, torch.bfloat16)
        out = []
        for backward in (False, True):
            nv_s = timed(lambda b=backward: ops.fake_quant(x, "nvfp4", backward=b), device, iters)
            rht_s = timed(lambda b=backward: rht.rht_fake_quant(x, -1, backward=b), device, iters)
            out.append(
                {
                    "rounding": "stochastic" if backward else "nearest",
                    "nvfp4_ms": nv_s * 1e3,
                    "rht_nvfp4_ms": rht_s * 1e3,
                    "rht_vs_nvfp4": rht_s / nv_s,
                }
            )
    finally:
        if saved is None:
            os.environ.pop("QUANTPATCH_KERNELS", None)
        else:
            os.environ["QUANTPATCH_KERNELS"] = saved
    return {"shape": [rows, cols], "rows": out}


PARETOQ = ("w1.58", "w2", "w4g128")


def bench_paretoq(device: str, hidden: int, tokens: int, iters: int) -> dict[str, Any]:
    """Per ParetoQ value: the weight quantization alone and the layer's forward (quantization
    then the GEMM, as Column/RowParallelLinear run it), in ms, and the quantization's share."""
    from quantpatch.runtime import quantpatch_ops as ops

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(hidden, hidden, generator=gen) * hidden**-0.5).to(device, torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    gemm_s = timed(lambda: x @ w.t(), device, iters)
    rows = []
    for fmt in PARETOQ:
        alpha = ops.paretoq_init_alpha(w, fmt).to(torch.bfloat16)
        quant_s = timed(lambda f=fmt, a=alpha: ops.paretoq_quantize(w, a, f), device, iters)
        fwd_s = timed(lambda f=fmt, a=alpha: x @ ops.paretoq_quantize(w, a, f).t(), device, iters)
        rows.append(
            {
                "format": fmt,
                "quant_ms": quant_s * 1e3,
                "forward_ms": fwd_s * 1e3,
                "quant_pct_of_forward": 100 * quant_s / fwd_s,
            }
        )
    return {"hidden": hidden, "tokens": tokens, "gemm_ms": gemm_s * 1e3, "rows": rows}


def _script(name: str, args: list[str], out: Path) -> dict[str, Any] | None:
    cmd = [sys.executable, str(HERE / name), *args, "--json", str(out)]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    res = subprocess.run(cmd, text=True, capture_output=True)
    print(res.stdout, end="", flush=True)
    if res.returncode:
        print(res.stderr[-3000:], file=sys.stderr)
        return {"error": f"{name} exited {res.returncode}: {res.stderr.strip()[-500:]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def markdown(r: dict[str, Any]) -> str:
    gpu = r["device"] == "cuda"
    lines = [f"# quantpatch GPU suite: {r['device_name']}", ""]
    rh = r.get("rht")
    if rh:
        lines += [
            f"RHT: the fused Hadamard transform + NVFP4 kernel against the NVFP4 "
            f"kernel alone, {rh['shape'][0]}x{rh['shape'][1]} bf16.",
            "",
            "| rounding | nvfp4 ms | nvfp4-rht ms | rht / nvfp4 |",
            "| --- | ---: | ---: | ---: |",
            *(
                f"| {e['rounding']} | {e['nvfp4_ms']:.3f} | {e['rht_nvfp4_ms']:.3f} | "
                f"{e['rht_vs_nvfp4']:.2f} |"
                for e in rh["rows"]
            ),
            "",
        ]
    o = r.get("ops")
    if o:
        lines += [
            f"Fake quant, {o['shape'][0]}x{o['shape'][1]} bf16; device-to-device copy "
            f"{o['copy_gbs']:.0f} GB/s ({o['copy_ms']:.3f} ms).",
            "",
            "| op | Triton GB/s | % of copy | kernels | extra memory / output "
            "| reference GB/s | % of copy | kernels | extra / output |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for e in o["ops"]:

            def cells(p: str, e: dict[str, Any] = e) -> str:
                k = e.get(f"{p}_kernels", "n/a")
                m = e.get(f"{p}_extra_vs_output")
                mem = f"{m:.2f}" if m is not None else "n/a"
                return f"{e[f'{p}_gbs']:.3g} | {e[f'{p}_pct_of_copy']:.3g} | {k} | {mem}"

            lines.append(f"| {e['op']} | {cells('triton')} | {cells('reference')} |")
        lines.append("")
    pq = r.get("paretoq")
    if pq:
        lines += [
            f"ParetoQ weight quantization, {pq['hidden']}x{pq['hidden']} bf16 weight, "
            f"{pq['tokens']} tokens (bf16 GEMM alone {pq['gemm_ms']:.3f} ms):",
            "",
            "| value | quantization ms | layer forward ms | share of the forward |",
            "| --- | ---: | ---: | ---: |",
        ]
        for e in pq["rows"]:
            lines.append(
                f"| {e['format']} | {e['quant_ms']:.3f} | {e['forward_ms']:.3f} "
                f"| {e['quant_pct_of_forward']:.1f} % |"
            )
        lines.append("")
    s = r.get("saver")
    if s and "error" not in s:
        lines += [
            f"Tensor saver ({s['bytes_per_step'] / 1e6:.1f} MB per saving step): disabled "
            f"{s['disabled_overhead_pct']:+.2f} % of a step (the guard itself "
            f"{s['guard_pct_of_step']:.4f} %); stall {s['stall_s'] * 1e3:.1f} ms = "
            f"{s['stall_vs_copy']:.2f}x the {'pinned ' if gpu else ''}copy "
            f"({s['copy_s'] * 1e3:.1f} ms); files {s['files']}/{s['files_expected']}, "
            f"bit-exact {s['bit_exact']}.",
            "",
        ]
    elif s:
        lines += [f"Tensor saver: {s['error']}", ""]
    e2e = r.get("e2e")
    if e2e and "error" not in e2e:
        lines += [
            f"Tiny megatron-core GPT ({e2e['config']['layers']} layers, hidden "
            f"{e2e['config']['hidden']}, seq {e2e['config']['seq']}), fake quant: "
            f"{', '.join(e2e['kernels'])}.",
            "",
            "| scheme | step ms | vs bf16 | final loss |",
            "| --- | ---: | ---: | ---: |",
        ]
        for k, v in e2e["step_s"].items():
            lines.append(
                f"| {k} | {v * 1e3:.1f} | {e2e['step_vs_bf16'][k]:.2f} "
                f"| {e2e['losses'][k][-1]:.4f} |"
            )
        lines.append("")
    elif e2e:
        lines += [f"End to end: {e2e['error']}", ""]
    fl = r.get("flash")
    if fl:
        lines += [
            f"Attention core, forward + backward: sequence {fl['seq']}, {fl['heads']} query "
            f"heads, {fl['groups']} key/value heads, head dim {fl['dim']}, batch 1, causal, bf16.",
            "",
            "| path | ms | vs flash bf16 | vs unfused bf16 | peak MiB | kept for backward MiB |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for e in fl["rows"]:
            peak = f"{e['peak_mib']:.0f}" if "peak_mib" in e else "n/a"
            lines.append(
                f"| {e['row']} | {e['ms']:.3g} | {e['vs_flash_bf16']:.2f} "
                f"| {e['vs_unfused_bf16']:.2f} | {peak} | {e['saved_mib']:.3g} |"
            )
        lines.append("")
    pre = r.get("pretrain")
    if pre and "error" not in pre:
        from pretrain_runs import markdown as runs_table

        kind = "stub torchrun (no training)" if pre["stub"] else "torchrun pretrain_gpt.py"
        lines += [f"Generated smoke scripts through {kind}:", "", runs_table(pre)]
    elif pre:
        lines += [f"Generated scripts: {pre['error']}", ""]
    lines += shapes_markdown(r)
    lines += ["Bars:", ""] + [f"- {b}" for b in r["bars"]]
    return "\n".join(lines) + "\n"


def shapes_markdown(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    shapes = r.get("kernel_shapes")
    if shapes:
        names = [name for name, *_ in OPS]
        lines += [
            "Fake-quant kernels (Triton) at the models' shapes, % of a copy of the same tensor:",
            "",
            "| shape | copy GB/s | " + " | ".join(names) + " |",
            "| --- | ---: | " + " | ".join("---:" for _ in names) + " |",
        ]
        for e in shapes:
            cells = " | ".join(f"{e[name]['pct_of_copy']:.1f}" for name in names)
            lines.append(f"| {e['shape'][0]}x{e['shape'][1]} | {e['copy_gbs']:.0f} | {cells} |")
        lines.append("")
    gemm = r.get("gemm")
    if gemm:
        lines += [
            "Quantized GEMM (a @ weight.t(), bf16, both operands quantized every call) against a "
            "bf16 torch.matmul:",
            "",
            "| M x K x N | bf16 ms | format | separate ms | x bf16 | fused ms | x bf16 | auto |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for e in gemm:
            shape = "x".join(map(str, e["shape"]))
            for fmt, row in e.items():
                if not isinstance(row, dict):
                    continue
                auto = ", ".join(row.get("auto_choice", [])) or "n/a"
                lines.append(
                    f"| {shape} | {e['bf16_ms']:.3f} | {fmt} | {row['separate_ms']:.3f} | "
                    f"{row['separate_vs_bf16']:.2f} | {row['fused_ms']:.3f} | "
                    f"{row['fused_vs_bf16']:.2f} | {auto} |"
                )
        lines.append("")
    c = r.get("weight_cache")
    if c:
        lines += [
            f"Weight cache, mxfp8, {c['micro_batches']} micro-batches a step, MLP "
            f"{c['hidden']} -> {c['ffn']} -> {c['hidden']} ({c['tokens']} tokens): hit ratio "
            f"{c['hit_ratio']:.3f}, {c['quantizations_per_step']:.0f} weight quantizations a "
            f"step (off: {c['quantizations_per_step_off']:.0f}), {c['bytes_held'] / 2**20:.1f} "
            f"MiB held ({c['bytes_held'] / c['weight_bytes']:.2f}x the weights); step "
            f"{c['step_ms_on']:.1f} ms on, {c['step_ms_off']:.1f} ms off "
            f"({c['step_on_vs_off']:.2f}x).",
            "",
        ]
    return lines


def shapes_bars(r: dict[str, Any], say: Callable[[bool, str], None]) -> None:
    shapes = r.get("kernel_shapes")
    if shapes:
        worst = min(
            (e[name]["pct_of_copy"], f"{name} at {e['shape'][0]}x{e['shape'][1]}")
            for e in shapes
            for name, *_ in OPS
        )
        say(
            worst[0] >= 80, f"every kernel >= 80 % of the copy (worst {worst[0]:.1f} %, {worst[1]})"
        )
    gemm = r.get("gemm")
    if gemm:
        ratios = [
            (min(row["separate_vs_bf16"], row["fused_vs_bf16"]), f"{fmt} at {e['shape']}")
            for e in gemm
            for fmt, row in e.items()
            if isinstance(row, dict)
        ]
        worst_gemm = max(ratios)
        say(
            worst_gemm[0] <= 1.08,
            f"quantized GEMM <= 1.08x bf16 (worst {worst_gemm[0]:.2f}x, {worst_gemm[1]})",
        )
    c = r.get("weight_cache")
    if c:
        k = c["micro_batches"]
        say(
            c["hit_ratio"] >= (k - 1) / k - 1e-9,
            f"each weight quantized once per step (hit ratio {c['hit_ratio']:.3f})",
        )


def bars(r: dict[str, Any]) -> list[str]:
    out = []

    def say(ok: bool, text: str) -> None:
        out.append(f"{'met' if ok else 'MISSED'}: {text}")

    if r["device"] != "cuda":
        return ["not judged: no GPU (CPU figures, kernels in Triton's interpreter)"]
    o = r.get("ops")
    if o:
        judged = [e for e in o["ops"] if e.get("format") not in NVFP4]
        worst = min(e["triton_pct_of_copy"] for e in judged)
        say(worst >= 30, f"every MX/HiF8 op >= 30 % of the copy (worst {worst:.1f} %)")
        mx = max(e["triton_kernels"] for e in judged if e["op"].startswith("mx"))
        say(mx <= 2, f"<= 2 kernels per MX call (most {mx})")
        mem = max(e["triton_extra_vs_output"] for e in judged)
        say(mem <= 1.0 + 1e-6, f"extra memory <= one output (most {mem:.2f})")
        out.extend(nvfp4_line(o))
    shapes_bars(r, say)
    pq = r.get("paretoq")
    if pq:
        worst = max(e["quant_pct_of_forward"] for e in pq["rows"])
        say(worst < 10, f"ParetoQ weight quantization < 10 % of the forward (most {worst:.1f} %)")
    e2e = r.get("e2e")
    if e2e and "error" not in e2e and "FA_linear_mxfp8" in e2e["step_vs_bf16"]:
        ratio = e2e["step_vs_bf16"]["FA_linear_mxfp8"]
        say(ratio <= 1.3, f"FA_linear_mxfp8 step <= 1.3x bf16 ({ratio:.2f}x)")
    if e2e and "error" not in e2e and "FA_linear_nvfp4" in e2e["step_vs_bf16"]:
        ratio = e2e["step_vs_bf16"]["FA_linear_nvfp4"]
        out.append(f"reported (no bar): FA_linear_nvfp4 step {ratio:.2f}x bf16")
    fl = r.get("flash")
    if fl:
        by = {e["row"]: e for e in fl["rows"]}
        fa, stock = by["flash mxfp8 (FA_mxfp8)"], by["unfused bf16 (stock)"]
        say(
            fa["vs_flash_bf16"] <= 1.05,
            f"FA_mxfp8 flash attention <= 1.05x the bf16 flash kernel ({fa['vs_flash_bf16']:.2f}x)",
        )
        say(
            fa["vs_unfused_bf16"] <= 1.0,
            f"FA_mxfp8 flash attention <= 1.0x the unfused bf16 attention "
            f"({fa['vs_unfused_bf16']:.2f}x)",
        )
        say(
            fa["peak_mib"] < stock["peak_mib"],
            f"FA_mxfp8 peak memory below the unfused bf16 attention's at sequence {fl['seq']} "
            f"({fa['peak_mib']:.0f} vs {stock['peak_mib']:.0f} MiB)",
        )
    pre = r.get("pretrain")
    if pre and "error" not in pre and not pre["stub"]:
        ran = [d for d in pre["runs"] if d["exit"] == 0 and d["losses_finite"]]
        say(
            len(ran) == len(pre["runs"]),
            f"every generated smoke script trained with finite losses ({len(ran)} of "
            f"{len(pre['runs'])})",
        )
    s = r.get("saver")
    if s and "error" not in s:
        stall = s["stall_vs_copy"]
        say(stall <= 3, f"saver stall <= 3x the pinned copy ({stall:.2f}x)")
        say(
            s["disabled_overhead_pct"] <= 1,
            f"disabled saver <= 1 % of a step ({s['disabled_overhead_pct']:+.2f} %)",
        )
    return out


def nvfp4_line(o: dict[str, Any]) -> list[str]:
    """NVFP4's figures beside MXFP4's, reported and judged by no bar."""
    nv = [e for e in o["ops"] if e.get("format") in NVFP4]
    if not nv:
        return []
    worst = min(e["triton_pct_of_copy"] for e in nv)
    kernels = max(e["triton_kernels"] for e in nv)
    mem = max(e["triton_extra_vs_output"] for e in nv)
    return [
        f"reported (no bar): NVFP4 worst {worst:.1f} % of the copy, at most {kernels} "
        f"kernels a call, extra memory at most {mem:.2f} outputs"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("gpu-suite"))
    ap.add_argument("--size", type=int, default=None, help="square tensor side for the ops")
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of: ops, rht, paretoq, shapes, gemm, cache, flash, saver, e2e, pretrain",
    )
    ap.add_argument("--e2e-schemes", default=None, help="gpu_e2e.py's --schemes (default: all)")
    ap.add_argument("--e2e-steps", type=int, default=None, help="Adam steps per e2e scheme")
    ap.add_argument(
        "--megatron-lm",
        type=Path,
        help="a Megatron-LM clone (core_v0.13.1) for the generated scripts' real runs",
    )
    args = ap.parse_args()
    gpu = args.device == "cuda"
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    r: dict[str, Any] = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)",
        "torch": torch.__version__,
    }
    if "ops" not in skip:
        r["ops"] = bench_ops(args.device, args.size or (8192 if gpu else 256), 20 if gpu else 2)
        print(json.dumps(r["ops"], indent=1), flush=True)
    if "flash" not in skip:
        shape = (4096, 32, 8, 64) if gpu else (64, 4, 2, 32)
        r["flash"] = bench_flash(args.device, *shape, iters=10 if gpu else 1)
        print(json.dumps(r["flash"], indent=1), flush=True)

    if "shapes" not in skip:
        r["kernel_shapes"] = bench_kernel_shapes(
            args.device, KERNEL_SHAPES if gpu else CPU_KERNEL_SHAPES, 20 if gpu else 1
        )
    if "gemm" not in skip:
        r["gemm"] = bench_gemm(
            args.device, GEMM_SHAPES if gpu else CPU_GEMM_SHAPES, 10 if gpu else 1
        )
    if "cache" not in skip:
        sizes = (4096, 14336, 8192, 4) if gpu else (64, 128, 32, 4)
        r["weight_cache"] = bench_weight_cache(args.device, *sizes, steps=5 if gpu else 2)
    if "rht" not in skip:
        shape = (8192, 4096) if gpu else (64, 128)
        r["rht"] = bench_rht(args.device, *shape, 20 if gpu else 1)
        print(json.dumps(r["rht"], indent=1), flush=True)
    if "paretoq" not in skip:
        sizes = (4096, 8192) if gpu else (256, 512)
        r["paretoq"] = bench_paretoq(args.device, *sizes, 20 if gpu else 3)
        print(json.dumps(r["paretoq"], indent=1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        small = [] if gpu else ["--hidden", "128", "--tokens", "256", "--layers", "2"]
        if "saver" not in skip:
            r["saver"] = _script(
                "saver_overhead.py",
                ["--device", args.device, "--steps", "5" if gpu else "2", "--repeats", "3", *small],
                Path(tmp) / "saver.json",
            )
        if "e2e" not in skip:
            steps = args.e2e_steps or (20 if gpu else 4)
            chosen = ["--schemes", args.e2e_schemes] if args.e2e_schemes else []
            r["e2e"] = _script(
                "gpu_e2e.py",
                ["--device", args.device, "--steps", str(steps), "--no-saving-run", *chosen],
                Path(tmp) / "e2e.json",
            )
        if "pretrain" not in skip:
            if gpu and args.megatron_lm is None:
                r["pretrain"] = {
                    "error": "not run: --megatron-lm names the Megatron-LM clone to train with"
                }
            else:
                r["pretrain"] = _script(
                    "pretrain_runs.py",
                    ["--megatron-lm", str(args.megatron_lm)] if gpu else ["--stub"],
                    Path(tmp) / "pretrain.json",
                )
    r["bars"] = bars(r)
    (args.out / "gpu_suite.json").write_text(json.dumps(r, indent=1))
    md = markdown(r)
    (args.out / "gpu_suite.md").write_text(md)
    print(md)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    main()
