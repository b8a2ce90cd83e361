"""Wall time of `quantpatch gen-scripts` for all 60 combinations (bar: <= 1 s).

Usage: python benchmarks/gen_scripts.py [--runs N]

Reports, per profile, the median of a cold write into an empty directory, a no-op rerun (every
file unchanged) and `--check`, each as a fresh `quantpatch` process, next to `python3 -c pass`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _timing import wall  # benchmarks/_timing.py, beside this script


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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
