"""What this machine charges for page cache and for new files, apart from any writer.

Usage: python benchmarks/vm_memory.py [--mb 168] [--idle 4] [--reps 5] [DIR ...]

Four costs that the saver benchmarks (``saver_writer.py``, ``saver_overhead.py``) pay on some
machines and not on others, measured with nothing else running:

- Cores shared with others. A CPU-bound loop in one process, then in two at once: on a
  machine whose cores are its own each of the two takes as long as the one alone. The
  saver's writer runs its statistics and its writes in two threads; the raw write it is
  compared with needs one core.
- Page cache on memory the host took back. A VM guest with virtio-balloon free page
  reporting hands memory that stayed free for about 2 s back to its host; the first touch
  of such a page is a host page fault, which the guest sees only as a slow copy. --mb MB are
  written into a new file (2 MiB at a time) right after deleting a file of as many MB (its
  freed page cache is backed), and again after --idle seconds with nothing freed (what is
  free then has been reported). On bare metal both take the same time.
- Creating a file. ``os.open(O_CREAT)`` of empty files in each DIR (default: the temporary
  directory and the current one), 100 per directory, against opening an existing one.
- Creating files after a clean-up. --rounds rounds, each writing 80 files of 2 MiB into a new
  directory and then creating 80 empty files in another, the files of a round deleted
  before the next, or emptied (truncated to 0) and kept; the three runs go delete, empty,
  delete. On the VM this was written on creating a file took 100-330 us after deletions and
  25-68 us after emptying (``saver_writer.py`` empties for that reason: a training run deletes
  nothing).

Prints the figures and whether this kernel reports free pages (from sysfs).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

_BLOCK = os.urandom(2 << 20)


def _spin(n: int) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def cores(reps: int, n: int = 10_000_000) -> dict[str, list[float]]:
    """Seconds of a CPU-bound loop alone, and of each of two copies run at once."""
    rows: dict[str, list[float]] = {"alone": [], "two_at_once": []}
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_spin, [1, 1])  # both workers started
        for _ in range(reps):
            rows["alone"].append(pool.apply(_spin, (n,)))
            rows["two_at_once"].extend(pool.map(_spin, [n, n], chunksize=1))
    return rows


def _write(path: Path, mb: int) -> float:
    start = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(max(mb // 2, 1)):
            fh.write(_BLOCK)
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def page_cache(where: Path, mb: int, idle: float, reps: int) -> dict[str, list[float]]:
    """Seconds to write ``mb`` MB right after freeing as much, and after ``idle`` s idle."""
    rows: dict[str, list[float]] = {"after_free": [], "after_idle": []}
    for _ in range(reps):
        _write(where / "free.bin", mb)  # its page cache is freed when it is deleted
        rows["after_free"].append(_write(where / "a.bin", mb))
        time.sleep(idle)
        rows["after_idle"].append(_write(where / "b.bin", mb))
    return rows


def create_cost(where: Path, count: int = 100) -> tuple[float, float]:
    """Seconds per empty file created in ``where``, and per existing file opened."""
    scratch = Path(tempfile.mkdtemp(prefix="qp-create-", dir=where))
    try:
        start = time.perf_counter()
        for k in range(count):
            os.close(os.open(scratch / f"{k}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        created = time.perf_counter() - start
        start = time.perf_counter()
        for k in range(count):
            os.close(os.open(scratch / f"{k}", os.O_WRONLY))
        opened = time.perf_counter() - start
    finally:
        shutil.rmtree(scratch)
    return created / count, opened / count


def create_after_cleanup(where: Path, rounds: int, delete: bool) -> list[float]:
    """Seconds per empty file created in each round, the last round's files deleted (or
    emptied) first."""
    scratch = Path(tempfile.mkdtemp(prefix="qp-cleanup-", dir=where))
    made: list[Path] = []
    per_file: list[float] = []

    def fresh(name: str) -> Path:
        while made:
            old = made.pop()
            if delete:
                shutil.rmtree(old)
            else:
                for path in old.iterdir():
                    os.truncate(path, 0)
        d = scratch / name
        d.mkdir()
        made.append(d)
        return d

    try:
        for r in range(rounds):
            d = fresh(f"{r}-data")
            for k in range(80):
                with open(d / f"{k}", "wb") as fh:
                    fh.write(_BLOCK)
            d = fresh(f"{r}-empty")
            start = time.perf_counter()
            for k in range(80):
                os.close(os.open(d / f"{k}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            per_file.append((time.perf_counter() - start) / 80)
    finally:
        shutil.rmtree(scratch)
    return per_file


def reports_free_pages() -> str:
    """What sysfs says about free page reporting (Linux), in words."""
    order = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    if not order.exists():
        return "no page_reporting module (no free page reporting)"
    balloons = [
        d
        for d in Path("/sys/bus/virtio/devices").glob("*")
        if (d / "device").read_text().strip() == "0x0005"  # virtio-balloon
    ]
    for d in balloons:
        features = (d / "features").read_text().strip()
        if len(features) > 5 and features[5] == "1":  # VIRTIO_BALLOON_F_REPORTING
            return f"virtio-balloon reports free pages (order {order.read_text().strip()})"
    return "page_reporting present, no balloon with the reporting feature"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=168)
    ap.add_argument("--idle", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("dirs", nargs="*", type=Path)
    args = ap.parse_args()
    dirs = args.dirs or [Path(tempfile.gettempdir()), Path.cwd()]
    print(reports_free_pages())
    for name, values in cores(args.reps).items():
        s = " ".join(f"{v:.2f}" for v in values)
        print(f"  CPU-bound loop, {name:11s}: median {statistics.median(values):.2f} s  ({s})")
    work = Path(tempfile.mkdtemp(prefix="qp-vm-"))
    try:
        rows = page_cache(work, args.mb, args.idle, args.reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, values in rows.items():
        ms = " ".join(f"{v * 1e3:.0f}" for v in values)
        print(
            f"  {args.mb} MB into the page cache {name:10s}: median "
            f"{statistics.median(values) * 1e3:6.1f} ms  ({ms})"
        )
    for delete in (True, False, True):
        per_file = create_after_cleanup(Path(tempfile.gettempdir()), args.rounds, delete)
        us = " ".join(f"{v * 1e6:.0f}" for v in per_file)
        print(
            f"  create an empty file after the last round's files were "
            f"{'deleted' if delete else 'emptied':7s}: median "
            f"{statistics.median(per_file) * 1e6:5.0f} us  ({us})"
        )
    for d in dirs:
        created, opened = create_cost(d)
        print(
            f"  create an empty file in {d}: {created * 1e6:6.1f} us "
            f"(open an existing one: {opened * 1e6:.1f} us)"
        )


if __name__ == "__main__":
    main()
