"""Wall time of `quantpatch gen-scripts` for all 60 combinations (bar: <= 1 s).

Usage: python benchmarks/gen_scripts.py [--runs N]

Reports, per profile, the median of a cold write into an empty directory, a no-op rerun (every
file unchanged) and `--check`, each as a fresh `quantpatch` process, next to `python3 -c pass`.
Then, inside a Megatron-LM checkout (a synthetic `megatron/training/arguments.py` of upstream's
shape, ~3150 lines, from the tests' builder): reading its flags in-process (libcst parse and
walk; libcst's import measured apart), and `gen-scripts` there with the flag cache cold
(deleted first) and warm.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import wall  # benchmarks/_timing.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' parser builder
from tests.megatron_parser import write_parser

READ = """
import time, sys
t0 = time.perf_counter()
import libcst
t1 = time.perf_counter()
from quantpatch.launch.megatron_args import read_release
from pathlib import Path
times = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter()
    release = read_release(Path(sys.argv[1]))
    times.append(time.perf_counter() - t)
print(t1 - t0, min(times), sorted(times)[len(times) // 2], len(release.flags))
"""


def checkout_rows(tmp: Path, qp: str, runs: int) -> None:
    root = tmp / "Megatron-LM"
    path = write_parser(root, extension=["--transformer-impl"])
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    n_lines = len(path.read_text().splitlines())
    out = subprocess.run(
        [sys.executable, "-c", READ, str(root), str(runs)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    imp, best, median, n_flags = float(out[0]), float(out[1]), float(out[2]), out[3]
    print(
        f"read the flags of a {n_lines}-line arguments.py ({n_flags} flags): "
        f"median {median * 1e3:.0f} ms, best {best * 1e3:.0f} ms in-process "
        f"(+ {imp * 1e3:.0f} ms to import libcst once)"
    )
    cache = root / ".git" / "quantpatch" / "cache"
    cmd = [qp, "gen-scripts", "--out", str(tmp / "in-checkout")]
    cold, warm = [], []
    for _ in range(runs):
        shutil.rmtree(cache, ignore_errors=True)
        start = time.perf_counter()
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        cold.append(time.perf_counter() - start)
        warm.append(wall(cmd, cwd=root))
    print(
        f"gen-scripts inside the checkout (full): {statistics.median(cold) * 1e3:.0f} ms with "
        f"the flag cache cold, {statistics.median(warm) * 1e3:.0f} ms warm"
    )


def launcher_rows(tmp: Path, qp: str, runs: int) -> None:
    """All 60 combinations per launcher (full profile, 2 nodes): a cold write, and the
    in-script layout check each launch script runs before anything starts."""
    print(f"{'launcher':9s} {'cold write ms':>14s} {'rerun ms':>10s}   files")
    for launcher in ("torchrun", "slurm", "swift"):
        cold, rerun = [], []
        for i in range(runs):
            out = tmp / f"{launcher}{i}"
            cmd = [qp, "gen-scripts", "--out", str(out), "--launcher", launcher, "--nodes", "2"]
            cold.append(wall(cmd))
            rerun.append(wall(cmd))
        n = sum(1 for p in (tmp / f"{launcher}0").rglob("*") if p.is_file())
        print(
            f"{launcher:9s} {statistics.median(cold) * 1e3:14.0f} "
            f"{statistics.median(rerun) * 1e3:10.0f}   {n}"
        )
    check = [
        qp, "layout", "--line", "--gpus-per-node", "8", "--nodes", "2", "--tp", "2",
        "--micro-batch", "1", "--global-batch", "256", "--num-layers", "32", "--heads", "32",
        "--query-groups", "8", "--seq-length", "4096",
    ]  # fmt: skip
    times = [wall(check) for _ in range(runs)]
    print(
        f"in-script layout check (quantpatch layout --line): "
        f"{statistics.median(times) * 1e3:.0f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    qp = str(Path(sys.executable).with_name("quantpatch"))
    tmp = Path(tempfile.mkdtemp(prefix="qp-gen-"))
    try:
        base = [wall([sys.executable, "-c", "pass"]) for _ in range(args.runs)]
        print(f"python3 -c pass: median {statistics.median(base) * 1e3:.0f} ms")
        print(f"{'profile':8s} {'cold write ms':>14s} {'rerun ms':>10s} {'--check ms':>11s}")
        for profile in ("full", "fast", "smoke"):
            cold, rerun, check = [], [], []
            for i in range(args.runs):
                out = tmp / f"{profile}{i}"
                cmd = [qp, "gen-scripts", "--out", str(out), "--profile", profile]
                cold.append(wall(cmd))
                rerun.append(wall(cmd))
                check.append(wall([*cmd, "--check"]))
            n = len(list((tmp / f"{profile}0").rglob("*.sh")))
            print(
                f"{profile:8s} {statistics.median(cold) * 1e3:14.0f} "
                f"{statistics.median(rerun) * 1e3:10.0f} {statistics.median(check) * 1e3:11.0f}"
                f"   ({n} scripts)"
            )
        launcher_rows(tmp, qp, args.runs)
        checkout_rows(tmp, qp, args.runs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
