"""The tensor saver's writer next to the fork's synchronous saver and the disk, in one run.

Usage: python benchmarks/saver_writer.py [--tensors 16] [--side 1024] [--steps 5] [--reps 15]
                                         [--dir DIR] [--json]

The scenario: per step 16 tensors of 1024 x 1024 bf16 (2 MiB each), 5 steps
(168 MB), on the CPU. Every variant writes the same bytes into a fresh directory of --dir
(default: a temporary directory on the same disk) after an ``os.sync()`` (so that no variant
is throttled for another's dirty pages); the variants run interleaved, --reps times, each
repetition starting one variant later than the last (the same order, rotated), and the
medians are printed with the fastest and slowest repetition.

On the 2-core VM this was written on (a Firecracker guest) the writer's median moved between
runs (78.8-106.6 ms against a raw write of 41.6-51.0 ms, at the same code), and before its
statistics thread also wrote files, 2-8 of 15 repetitions took 2-6x the median (0 over
150 ms since, in thirteen runs). What was measured there (``benchmarks/vm_memory.py``), none of
which a writer controls:

- The host does not always give the guest two cores. Two CPU-bound processes at once took
  0.33-0.37 s each against 0.34-0.36 s alone in most probes, 0.64-0.67 against 0.35-0.49
  in others. The writer runs the statistics and the writes in two threads and needs both
  cores (for 168 MB, per run: 46-53 ms of statistics, 40-74 ms in ``writev``, 7-47 ms
  creating the files, 9 ms of pickles); the raw write needs one.
- Creating a file cost 9-590 us, with the directory, the hour and the files deleted just
  before (below).
- The guest hands memory that stays free for about 2 s back to its host (virtio-balloon free
  page reporting), and the first touch of such a page is a host page fault: 168 MB went into
  the page cache in 40 ms right after as much was freed, and in 192-356 ms after 4 s idle.
  Writing and deleting a scratch file before every variant (tried in an interleaved run of
  24 repetitions each, not kept as a script) took the raw write's slow repetitions away (0
  against 1 of 24) but not the writer's (12 against 5 over 1.5x its fastest, medians 115
  against 113 ms), so the benchmark does not do it.

The cost of creating a file in --dir is printed too (empty files, as many as tensors): on
that VM's ext4 it varied from 9 to 590 us a file with the directory, the hour and the files
deleted just before (3-18 us in others on the same disk), and any writer of one file per
tensor pays it. Each variant's files are emptied, not deleted, before the next variant runs
(see ``fresh`` in ``main``), and the directory is deleted at the end:

- raw sequential write: the same bytes written into one file, 2 MiB at a time (the yardstick;
  its fsync is timed separately, and not counted against anyone);
- raw files: the same bytes, one file per tensor (created under a temporary name, written,
  closed, renamed): what the file layout alone costs, the floor for any per-tensor writer;
- fork synchronous: the fork's saver, per tensor ``.detach().cpu()``, four ``.item()``
  statistics and ``torch.save`` of ``{"tensor", "tensor_info"}`` on the training thread;
- quantpatch: ``save_tensor`` (the training thread's wait) and ``flush()`` (everything on
  disk), end to end = wait + flush; and the writer alone: the same saves queued first, then
  the writer threads timed until everything is on disk. Bar: writer >= 50 % of the raw write.

File formats, each writing the same tensors with their statistics from one thread: the
``torch.save`` dict in the zip format (the fork's) and in the non-zip format, the same
non-zip bytes from quantpatch's plain pickler in one ``os.writev`` (all three read by the
fork's ``torch.load``), a raw tensor file with a small JSON header
and safetensors when it is installed (neither of which the fork's readers can load). The
statistics alone are timed too: quantpatch's (by its one-pass kernel, compiled on first use
where a C compiler and an x86-64 CPU are there; what that first use cost is printed), the
same with torch's operators only, and the fork's four reductions, each on its own float
copy. ``TENSOR_SAVE_ACCELERATORS`` (``none`` by default, ``stats-kernel``, ``pickler`` or
``all``) decides what the end-to-end quantpatch variants use; the statistics and format
timings name what each used.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantpatch.runtime import tensor_saver
from quantpatch.runtime.quantpatch_saver import ondisk, settings, stats, stats_kernel


def _tensors(n: int, side: int, steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        [torch.randn(side, side, generator=gen).to(torch.bfloat16) for _ in range(n)]
        for _ in range(steps)
    ]


def raw_write(data: list[list[torch.Tensor]], where: Path) -> tuple[float, float]:
    """Seconds to write the bytes sequentially into one file, and then to fsync it."""
    start = time.perf_counter()
    with open(where / "raw.bin", "wb") as fh:
        for step in data:
            for t in step:
                fh.write(memoryview(t.view(torch.int16).numpy()).cast("B"))
        written = time.perf_counter()
        os.fsync(fh.fileno())
    return written - start, time.perf_counter() - written


def create_files(count: int, where: Path) -> float:
    """Seconds to create ``count`` empty files (and close them): what the directory charges
    per file, whatever is written into it."""
    start = time.perf_counter()
    for k in range(count):
        os.close(os.open(where / f"{k:06d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return time.perf_counter() - start


def raw_files(data: list[list[torch.Tensor]], where: Path) -> float:
    """Seconds to write the same bytes as one file per tensor, as any per-tensor writer must
    (each created under a temporary name, written, closed and renamed, as quantpatch does):
    the floor the file layout itself sets (what creating a file costs: ``create_files``)."""
    start = time.perf_counter()
    k = 0
    for step in data:
        for t in step:
            k += 1
            tmp = where / f".{k:06d}.pt.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, memoryview(t.view(torch.int16).numpy()).cast("B"))
            finally:
                os.close(fd)
            os.replace(tmp, where / f"{k:06d}.pt")
    return time.perf_counter() - start


def fork_sync(data: list[list[torch.Tensor]], where: Path) -> float:
    """The fork's saver: everything on the training thread."""
    start = time.perf_counter()
    k = 0
    for step in data:
        for t in step:
            c = t.detach().cpu()
            info = {
                "min": c.float().min().item(),
                "max": c.float().max().item(),
                "mean": c.float().mean().item(),
                "std": c.float().std().item(),
            }
            k += 1
            torch.save({"tensor": c, "tensor_info": info}, where / f"{k:06d}.pt")
    return time.perf_counter() - start


def quantpatch_saver(data: list[list[torch.Tensor]], where: Path) -> tuple[float, float, int]:
    """(training-thread wait, flush, files) of quantpatch's saver."""
    os.environ.update(
        {
            "TENSOR_SAVE_ENABLED": "1",
            "TENSOR_SAVE_DIR": str(where),
            "QUANTPATCH_SOURCE_COMMIT": "0" * 40,
            "TENSOR_SAVE_QUEUE": "256",
        }
    )
    tensor_saver.configure()
    wait = 0.0
    start = time.perf_counter()
    for layer, step in enumerate(data):
        for i, t in enumerate(step):
            a = time.perf_counter()
            tensor_saver.save_tensor(t, "linear", "forward", "bf16", f"t{i}", layer)
            wait += time.perf_counter() - a
    flushed = time.perf_counter()
    report = tensor_saver.flush()
    end = time.perf_counter()
    del start
    return wait, end - flushed, int(report["files"])


def quantpatch_writer_alone(data: list[list[torch.Tensor]], where: Path) -> float:
    """Seconds the background writers need for everything once it is queued (the saves run
    first with the writers held back): the writer's own throughput, without the training
    thread's snapshot copies competing for the same cores."""
    os.environ.update({"TENSOR_SAVE_DIR": str(where), "TENSOR_SAVE_QUEUE": str(10**6)})
    tensor_saver.configure()
    saver = tensor_saver._SAVER
    start_writers = saver._start
    saver._start = lambda: None  # type: ignore[method-assign]
    for layer, step in enumerate(data):
        for i, t in enumerate(step):
            tensor_saver.save_tensor(t, "linear", "forward", "bf16", f"t{i}", layer)
    begin = time.perf_counter()
    start_writers()
    tensor_saver.flush()
    return time.perf_counter() - begin


def _stats_fork(t: torch.Tensor) -> list[float]:
    return [
        t.float().min().item(),
        t.float().max().item(),
        t.float().mean().item(),
        t.float().std().item(),
    ]


def _with(accelerators: set[str], work: Callable[[], Any]) -> Any:
    """``work()`` with exactly ``accelerators`` on (whatever the environment asked for)."""
    cfg = settings.CFG
    cfg.accelerators, kept = frozenset(accelerators), cfg.accelerators
    try:
        return work()
    finally:
        cfg.accelerators = kept


def _stats_quantpatch(t: torch.Tensor) -> list[float]:
    """quantpatch's statistics by the one-pass kernel (the stats-kernel accelerator), where
    it can run here."""
    return list(_with({"stats-kernel"}, lambda: stats.host_stats(t)))


def _stats_operators(t: torch.Tensor) -> list[float]:
    """quantpatch's statistics by torch's operators (the default)."""
    return list(_with(set(), lambda: stats.host_stats(t)))


def kernel_first_use() -> tuple[float, float, str]:
    """Seconds to get the statistics kernel with an empty cache (compiled) and then from the
    cache (loaded), each as a new process would, and how the saver computes statistics."""
    kept = os.environ.get("TENSOR_SAVE_KERNEL_DIR")
    scratch = tempfile.mkdtemp(prefix="qp-kernel-")
    times = []
    try:
        os.environ["TENSOR_SAVE_KERNEL_DIR"] = scratch
        for _ in range(2):
            stats_kernel.forget()
            start = time.perf_counter()
            stats_kernel.kernel(wait=True)
            times.append(time.perf_counter() - start)
    finally:
        if kept is None:
            os.environ.pop("TENSOR_SAVE_KERNEL_DIR", None)
        else:
            os.environ["TENSOR_SAVE_KERNEL_DIR"] = kept
        stats_kernel.forget()
        shutil.rmtree(scratch, ignore_errors=True)
    return times[0], times[1], stats_kernel.status()


def _fmt_torch_zip(t: torch.Tensor, info: dict[str, Any], path: Path) -> None:
    torch.save({"tensor": t, "tensor_info": info, "metadata": {}}, path)


def _fmt_torch_legacy(t: torch.Tensor, info: dict[str, Any], path: Path) -> None:
    obj = {"tensor": t, "tensor_info": info, "metadata": {}}
    torch.save(obj, path, _use_new_zipfile_serialization=False)


def _fmt_quantpatch(accelerators: set[str]) -> Callable[[torch.Tensor, dict[str, Any], Path], None]:
    def write(t: torch.Tensor, info: dict[str, Any], path: Path) -> None:
        obj = {"tensor": t, "tensor_info": info, "metadata": {}}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            ondisk.write_all(fd, _with(accelerators, lambda: ondisk.torch_bytes(obj, t)))
        finally:
            os.close(fd)

    return write


def _fmt_raw(t: torch.Tensor, info: dict[str, Any], path: Path) -> None:
    header = json.dumps({"tensor_info": info, "dtype": str(t.dtype), "shape": list(t.shape)})
    with open(path, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header.encode())
        fh.write(memoryview(t.view(torch.int16).numpy()).cast("B"))


def _formats() -> dict[str, Callable[[torch.Tensor, dict[str, Any], Path], None]]:
    formats = {
        "torch.save zip (fork's)": _fmt_torch_zip,
        "torch.save non-zip": _fmt_torch_legacy,
        "non-zip, quantpatch's torch.save path": _fmt_quantpatch(set()),
        "non-zip, plain pickler (accelerator)": _fmt_quantpatch({"pickler"}),
        "raw + JSON header": _fmt_raw,
    }
    try:
        from safetensors.torch import save_file
    except ImportError:
        return formats

    def _fmt_safetensors(t: torch.Tensor, info: dict[str, Any], path: Path) -> None:
        save_file({"tensor": t}, str(path), metadata={"tensor_info": json.dumps(info)})

    formats["safetensors"] = _fmt_safetensors
    return formats


def format_time(
    data: list[list[torch.Tensor]],
    where: Path,
    write: Callable[[torch.Tensor, dict[str, Any], Path], None],
) -> float:
    start = time.perf_counter()
    k = 0
    for step in data:
        for t in step:
            k += 1
            mn, mx, mean, std = _stats_quantpatch(t)
            write(t, {"min": mn, "max": mx, "mean": mean, "std": std}, where / f"{k:06d}.bin")
    return time.perf_counter() - start


def stats_time(data: list[list[torch.Tensor]], fn: Callable[[torch.Tensor], list[float]]) -> float:
    start = time.perf_counter()
    for step in data:
        for t in step:
            fn(t)
    return time.perf_counter() - start


def _exact(where: Path, data: list[list[torch.Tensor]], tensors: int) -> bool:
    """Every file quantpatch wrote loads with weights_only and holds the bytes it was given."""
    by_name = {f"t{i}": i for i in range(tensors)}
    files = sorted(where.rglob("*.pt"))
    exact = len(files) == sum(len(step) for step in data)
    for f in files:
        obj = torch.load(f, weights_only=True)
        meta = obj["metadata"]
        src = data[meta["layer_idx"]][by_name[meta["tensor_name"]]]
        exact = exact and torch.equal(obj["tensor"], src) and obj["tensor"].dtype == src.dtype
    return exact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    data = _tensors(args.tensors, args.side, args.steps)
    tensor_saver.configure()
    compile_s, load_s, kernel = kernel_first_use()
    nbytes = sum(t.numel() * t.element_size() for step in data for t in step)
    count = args.tensors * args.steps
    root = Path(tempfile.mkdtemp(prefix="qp-writer-", dir=args.dir))
    rows: dict[str, list[float]] = {}
    formats = _formats()

    made: list[Path] = []
    serial = itertools.count()

    def fresh(name: str) -> Path:
        # the previous variant's files are emptied first: on this VM (a Firecracker guest)
        # page cache that lands on guest memory not used lately costs a host fault per page,
        # and the copy into it was measured 5x slower (48 against 240 ms for these bytes)
        # once two earlier variants' files were still cached; without this the variants run
        # later in a repetition pay for the files of those before them. Emptied (truncated
        # to 0 and kept), not deleted: on that VM's ext4 creating a file cost 100-330 us
        # after deletions and 25-68 us after emptying (vm_memory.py; in runs of the raw
        # files alone, cleaned up one way then the other: 57-61 against 51-52 ms), which
        # charged every variant of one file per tensor, and not the one-file raw write, for
        # the benchmark's own clean-up. A training run deletes nothing. Every variant writes
        # into a new directory, so that no file it writes exists before.
        while made:
            for path in made.pop().iterdir():
                os.truncate(path, 0)
        d = root / f"{next(serial):05d}-{name}"
        d.mkdir(parents=True)
        made.append(d)
        # every variant starts with no dirty pages waiting: the kernel throttles a writer
        # once enough are pending, which would charge one variant for another's bytes
        os.sync()
        return d

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    exact = False

    def run_raw() -> None:
        written, synced = raw_write(data, fresh("raw"))
        add("raw_write_s", written)
        add("raw_fsync_s", synced)

    def run_quantpatch() -> None:
        nonlocal exact
        where = fresh("quantpatch")
        wait, flush_s, files = quantpatch_saver(data, where)
        if files != count:
            raise SystemExit(f"quantpatch wrote {files} files, expected {count}")
        add("quantpatch_wait_s", wait)
        add("quantpatch_flush_s", flush_s)
        add("quantpatch_total_s", wait + flush_s)
        if len(rows["quantpatch_total_s"]) == args.reps:  # loading them once is enough
            exact = _exact(where, data, args.tensors)

    variants: list[Callable[[], None]] = [
        run_raw,
        lambda: add("raw_files_s", raw_files(data, fresh("files"))),
        lambda: add("create_empty_files_s", create_files(count, fresh("create"))),
        lambda: add("fork_sync_s", fork_sync(data, fresh("fork"))),
        run_quantpatch,
        lambda: add("quantpatch_writer_alone_s", quantpatch_writer_alone(data, fresh("alone"))),
    ]
    for name, write in formats.items():
        variants.append(
            lambda name=name, write=write: add(
                f"format {name}", format_time(data, fresh("fmt"), write)
            )
        )
    try:
        for rep in range(args.reps):
            # each repetition starts at another variant (the same order, rotated): a slow
            # repetition on this VM tends to follow what ran just before, and no variant is
            # to sit in the same place every time
            start = rep % len(variants)
            for run in variants[start:] + variants[:start]:
                run()
            add("stats quantpatch, stats-kernel", stats_time(data, _stats_quantpatch))
            add("stats quantpatch, torch operators", stats_time(data, _stats_operators))
            add("stats fork (4 reductions)", stats_time(data, _stats_fork))
        med = {k: statistics.median(v) for k, v in rows.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pct = 100 * med["raw_write_s"] / med["quantpatch_total_s"]
    alone_pct = 100 * med["raw_write_s"] / med["quantpatch_writer_alone_s"]
    files_pct = 100 * med["raw_files_s"] / med["quantpatch_writer_alone_s"]
    result = {
        "bytes": nbytes,
        "tensors": count,
        "torch_threads": torch.get_num_threads(),
        "medians_s": med,
        "samples_s": rows,
        "end_to_end_pct_of_raw_write": pct,
        "writer_pct_of_raw_write": alone_pct,
        "writer_pct_of_raw_files": files_pct,
        "wait_vs_fork": med["quantpatch_wait_s"] / med["fork_sync_s"],
        "files_exact_weights_only": exact,
        "stats": kernel,
        "stats_kernel_compile_s": compile_s,
        "stats_kernel_load_s": load_s,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    mb = nbytes / 1e6
    print(
        f"{count} tensors of {args.side}x{args.side} bf16 ({mb:.0f} MB), {args.reps} "
        f"interleaved repetitions, medians; torch threads {torch.get_num_threads()}"
    )
    print(
        f"statistics: {kernel}; the kernel's first use cost {compile_s * 1e3:.0f} ms with an "
        f"empty cache (compiled) and {load_s * 1e3:.1f} ms from the cache"
    )
    print(f"  {'':38s} {'median':>11s} {'(min-max)':>15s} {'per tensor':>13s} {'MB/s':>7s}")
    for name, value in med.items():
        per = value / count * 1e3
        low, high = min(rows[name]) * 1e3, max(rows[name]) * 1e3
        spread = f"({low:.0f}-{high:.0f})"
        print(
            f"  {name:38s} {value * 1e3:8.1f} ms {spread:>15s} {per:6.2f} ms/tensor "
            f"{mb / value:7.0f}"
        )
    print(
        f"quantpatch writer alone: {alone_pct:.0f}% of the raw sequential write (bar >= 50%), "
        f"{files_pct:.0f}% of the same bytes written raw as one file per tensor; "
        f"end to end (saves + flush): {pct:.0f}%; training "
        f"thread waits {result['wait_vs_fork']:.2f}x as long as with the fork's saver; total "
        f"{med['quantpatch_total_s'] * 1e3:.0f} ms vs the fork's {med['fork_sync_s'] * 1e3:.0f} "
        f"ms; files load with weights_only=True and are byte-exact: {exact}"
    )


if __name__ == "__main__":
    main()
