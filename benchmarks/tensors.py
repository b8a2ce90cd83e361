"""The analysis at sweep scale, each figure next to its yardstick in the same run.

Usage: python benchmarks/tensors.py [--gb 1.0] [--logs 60] [--lines 250000] [--jobs 2]
                                   [--skip tensors,runs]

1. ``tensors formats`` over ``--gb`` of bf16 tensors saved as the saver saves them (16M
   elements a file, 3 candidate formats), against a loop that only runs the quant ops on the
   same tensors already in memory; and the peak memory of the analysis (bounded by a few
   tensors, whatever the directory holds). Bar: analysis <= 2x the ops alone.
2. ``runs`` over ``--logs`` generated Megatron logs of ``--lines`` iteration lines each, in
   ``training_log``'s exact format (step times and grad norms of several widths; a checkpoint
   saved and a validation every 1000 iterations, as in a real run). Bar: 60 logs of 250k
   lines in under 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from quantpatch.analysis import tensors, training_logs
from quantpatch.analysis.tensor_files import discover, load_tensor
from quantpatch.runtime.quantpatch_ops import fake_quant

LINE = (
    " [2026-11-22 11:25:39] iteration {it:8d}/{total:8d} | consumed samples: {cs:12d} | "
    "elapsed time per iteration (ms): {ms:.1f} | learning rate: 6.666667E-05 | "
    "global batch size:     8 | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {gn:.3f} | "
    "number of skipped iterations:   0 | number of nan iterations:   0 |\n"
)
# every 1000 iterations a real run saves a checkpoint and validates (core_v0.13.1's wording)
EVERY_1000 = (
    "saving checkpoint at iteration {it:7d} to /ckpt in torch_dist format\n"
    "  successfully saved checkpoint from iteration {it:7d} to /ckpt [ t 1/1, p 1/1 ]\n"
    + "-"
    * 99
    + "\n validation loss at iteration {it} on validation set | lm loss value: 3.162278E+00 | "
    "lm loss PPL: 2.362298E+01 | \n" + "-" * 99 + "\n"
)
NAMES = ("input", "weight", "grad_output", "query")


def _ops_share(paths: list[Path], fmts: tuple[str, ...], threads: int) -> float:
    """Seconds of the quant ops alone on ``paths``, loaded into memory first (not timed)."""
    from quantpatch.analysis.tensor_metrics import reduction_of

    torch.set_num_threads(threads)
    loaded = [load_tensor(p) for p in paths]
    a = time.perf_counter()
    for t, md in loaded:
        dim, backward = reduction_of(md.get("tensor_name"), md.get("operation"))
        for f in fmts:
            fake_quant(t, f, dim=dim, backward=backward)
    return time.perf_counter() - a


def ops_alone(paths: list[Path], fmts: tuple[str, ...], jobs: int) -> float:
    """The quant ops alone, with the analysis's own layout: ``jobs`` processes side by side,
    each on its share of the files with the analysis workers' torch threads (one process
    with all threads took 64 s against 22 s here, which flattered the analysis). The slowest
    share's op time is the figure."""
    if jobs <= 1:
        return _ops_share(paths, fmts, torch.get_num_threads())
    from concurrent.futures import ProcessPoolExecutor

    threads = max(1, (os.cpu_count() or 1) // jobs)
    shares = [paths[k::jobs] for k in range(jobs)]
    with ProcessPoolExecutor(jobs) as pool:
        return max(pool.map(_ops_share, shares, [fmts] * jobs, [threads] * jobs))


def bench_tensors(gb: float, jobs: int, tmp: Path) -> None:
    per_file = 4096 * 4096  # elements; 32 MiB of bf16
    n_files = max(1, round(gb * 1e9 / (per_file * 2)))
    d = tmp / "tensor_logs"
    d.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(n_files):
        name = NAMES[i % len(NAMES)]
        t = (torch.randn(4096, 4096, generator=gen) * 2.0 ** (i % 7 - 3)).to(torch.bfloat16)
        meta = {"tensor_name": name, "layer_idx": i % 4, "operation": "forward"}
        torch.save({"tensor": t, "tensor_info": {}, "metadata": meta}, d / f"{i:04d}_{name}.pt")
    size = sum(p.stat().st_size for p in d.glob("*.pt"))
    fmts = ("mxfp8", "mxfp4", "hifp8")

    def peak_kb() -> int:  # this process or, with --jobs, its largest worker
        return max(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        )

    rss0 = peak_kb()
    a = time.perf_counter()
    res = tensors.formats(d, fmts, jobs=jobs)
    analysis_s = time.perf_counter() - a
    rss1 = peak_kb()
    # the yardstick: the same quant ops (same reduction dims) on the same tensors, in memory,
    # laid out as the analysis runs them (--jobs processes, its torch threads in each)
    ops_s = ops_alone(discover(d)[0], fmts, jobs)
    print(
        f"tensors formats: {n_files} files, {size / 1e9:.2f} GB bf16, {len(fmts)} formats, "
        f"{jobs} job(s), torch {torch.get_num_threads()} threads"
    )
    print(f"  analysis   {analysis_s:8.2f} s  ({size / analysis_s / 1e6:.0f} MB/s)")
    print(f"  ops alone  {ops_s:8.2f} s  (fake_quant only, tensors in memory)")
    print(f"  ratio      {analysis_s / ops_s:8.2f}x  (bar <= 2x)")
    print(
        f"  peak resident memory of a process: {rss0 / 1024:.0f} MB before, "
        f"{rss1 / 1024:.0f} MB after ({size / 1e6:.0f} MB analysed; one file is "
        f"{per_file * 2 / 1e6:.0f} MB)"
    )
    print(f"  rows: {len(res.rows)}; skipped {len(res.inventory.skipped)}")


def bench_runs(logs: int, lines: int, jobs: int, tmp: Path) -> None:
    schemes = ["bf16", "FA_mxfp8", "FA_mxfp4", "FA_hifp8", "linear_mxfp8", "linear_mxfp4",
               "linear_hifp8", "FA_linear_mxfp8", "FA_linear_mxfp4", "FA_linear_hifp8"]  # fmt: skip
    root = tmp / "runs"
    a = time.perf_counter()
    body = "".join(
        LINE.format(it=i, total=lines, cs=8 * i, ms=96.9 + 9.1 * (i % 7), loss=3 + 10 / (i + 9),
                    gn=0.5 + 30 / (i + 9))
        + (EVERY_1000.format(it=i) if i % 1000 == 0 else "")
        for i in range(1, lines + 1)
    )  # fmt: skip
    total_bytes = 0
    for k in range(logs):
        model = ("llama32-1b", "qwen25-1.5b", "deepseek2_lite")[k // 20 % 3]
        dataset = ("wikipedia", "c4")[k // 10 % 2]
        scheme = schemes[k % 10]
        p = root / f"{model}_{dataset}_{scheme}_full" / "logs" / f"x_{scheme}.log"
        p.parent.mkdir(parents=True)
        head = f"[quantpatch] {model} / {dataset} / {scheme} (full): linear=bf16 qk=bf16 pv=bf16\n"
        text = head + body + "[quantpatch] training exited with status 0\n"
        p.write_text(text)
        total_bytes += len(text)
    made = time.perf_counter() - a
    a = time.perf_counter()
    res = training_logs.runs([root], jobs=jobs)
    parse_s = time.perf_counter() - a
    a = time.perf_counter()
    for p in sorted(root.rglob("*.log")):
        p.read_bytes()
    read_s = time.perf_counter() - a
    print(
        f"runs: {logs} logs x {lines} lines ({total_bytes / 1e9:.2f} GB, written in {made:.1f} s), "
        f"{jobs} job(s)"
    )
    print(
        f"  parse + compare  {parse_s:6.2f} s  (bar < 10 s); reading the files alone {read_s:.2f} s"
    )
    print(f"  rows: {len(res.rows)}; iterations in the first: {res.rows[0]['iterations']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--logs", type=int, default=60)
    ap.add_argument("--lines", type=int, default=250_000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--skip", default="")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="qp-analysis-"))
    try:
        if "tensors" not in skip:
            bench_tensors(args.gb, args.jobs, tmp)
        if "runs" not in skip:
            bench_runs(args.logs, args.lines, args.jobs, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
