"""Throughput of each fake-quant op next to a plain copy of the same tensor, in one run.

Usage: python benchmarks/quant_ops.py [--size N] [--device cpu|cuda] [--compile] [--iters K]

GB/s counts the bytes of the input tensor read plus the output written (2 x numel x 2 bytes
for bf16), like the yardstick: a copy of the same tensor into a preallocated buffer. The
repetitions of every variant are interleaved (copy, op, copy, op, ...) and medians reported,
so machine noise hits all alike. On CPU the default path (large tensors worked slice by slice)
is shown next to the same arithmetic on the whole tensor at once (the path before slicing).
Default: 8192 x 8192 bf16 on CUDA when there is one, 4096 x 4096 on CPU. Bars: GPU each op >=
30 % of the copy; CPU each op >= 1 % of the copy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantpatch.runtime import quantpatch_ops as ops


def _once(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved(fns: dict[str, object], device: str, iters: int) -> dict[str, float]:
    """Median seconds of each function, the repetitions of all of them interleaved."""
    for fn in fns.values():
        fn()  # warm-up (and compilation)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            samples[k].append(_once(fn, device))
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile each op first")
    args = ap.parse_args()
    n = args.size or (8192 if args.device == "cuda" else 4096)
    x = torch.randn(n, n, device=args.device).to(torch.bfloat16)
    buf = torch.empty_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    print(
        f"{n} x {n} bf16 on {args.device} ({torch.__version__}, "
        f"{torch.get_num_threads()} threads){', compiled' if args.compile else ''}; "
        f"kernels: {ops.kernels_in_use(args.device)}"
    )
    fns: dict[str, object] = {"copy into a preallocated buffer": lambda: buf.copy_(x)}
    for fmt, backward in (("mxfp8", False), ("mxfp8", True), ("mxfp4", False), ("hifp8", False)):
        name = f"{fmt}{' (E5M2)' if backward else ''}"

        def op(fmt=fmt, backward=backward):
            return ops.fake_quant(x, fmt, backward=backward)

        fns[name] = torch.compile(op) if args.compile else op
        if args.device == "cpu" and not args.compile:

            def whole(fmt=fmt, backward=backward):
                return ops._whole(x, fmt, -1, backward)

            fns[f"{name}, whole tensor"] = whole
    med = interleaved(fns, args.device, args.iters)
    copy_s = med["copy into a preallocated buffer"]
    print(f"{'op':34s} {'ms':>9s} {'GB/s':>9s} {'% of copy':>10s}")
    for k, s in med.items():
        gbs = nbytes / s / 1e9
        print(f"{k:34s} {s * 1e3:9.2f} {gbs:9.3f} {100 * copy_s / s:10.2f}")


if __name__ == "__main__":
    main()
