"""Throughput of each fake-quant op next to a plain copy of the same tensor, in one run.

Usage: python benchmarks/quant_ops.py [--size N] [--device cpu|cuda] [--compile] [--iters K]

GB/s counts the bytes of the input tensor read plus the output written (2 x numel x 2 bytes
for bf16), like the copy it is compared with. Default: 8192 x 8192 bf16 on CUDA when there is
one, 2048 x 2048 on CPU (CI-sized). Bar (issue 5, GPU only): each op >= 30 % of the copy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantpatch.runtime.quantpatch_ops import fake_quant


def timed(fn, device: str, iters: int) -> float:
    fn()  # warm-up (and compilation)
    samples = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile each op first")
    args = ap.parse_args()
    n = args.size or (8192 if args.device == "cuda" else 2048)
    x = torch.randn(n, n, device=args.device).to(torch.bfloat16)
    nbytes = 2 * x.numel() * x.element_size()
    print(
        f"{n} x {n} bf16 on {args.device} ({torch.__version__}, "
        f"{torch.get_num_threads()} threads){', compiled' if args.compile else ''}"
    )
    copy_s = timed(lambda: x.clone(), args.device, args.iters)
    copy_gbs = nbytes / copy_s / 1e9
    print(f"{'op':18s} {'ms':>9s} {'GB/s':>9s} {'% of copy':>10s}")
    print(f"{'copy (clone)':18s} {copy_s * 1e3:9.2f} {copy_gbs:9.2f} {100.0:10.1f}")
    for fmt, backward in (("mxfp8", False), ("mxfp8", True), ("mxfp4", False), ("hifp8", False)):

        def op(fmt=fmt, backward=backward):
            return fake_quant(x, fmt, backward=backward)

        fn = torch.compile(op) if args.compile else op
        s = timed(fn, args.device, args.iters)
        gbs = nbytes / s / 1e9
        name = f"{fmt}{' (E5M2)' if backward else ''}"
        print(f"{name:18s} {s * 1e3:9.2f} {gbs:9.2f} {100 * gbs / copy_gbs:10.1f}")


if __name__ == "__main__":
    main()
