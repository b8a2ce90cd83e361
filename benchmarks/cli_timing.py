"""Median wall time of the CLI on a full checkout, next to `python3 -c pass` in the same run.

Usage: python benchmarks/cli_timing.py [--runs N] [--layout fork|demo] [--history N]

`--layout fork` (default): a `git clone -b quant` of a fork-shaped origin (tests/forklike.py)
with the full megatron-core tree, `--history` upstream commits (default 3000), a branch named
`quant`, label and shared sites, the fork's saver. `--layout demo`: the demo checkout.

Bars (as ratios to `python3 -c pass` in the same run): --help <= 6x, warm check
<= 12x, cold check <= 25x; set and restore <= 1.0 s on the fork clone. `check` reads discovery
results from a content-addressed cache when the target files are unchanged (the usual case:
`set` primes it); the cold row deletes the cache first, so it pays libcst's import (the
`import libcst` row) and parses the excerpt of each target file that can hold sites, in a
forked child (and one grandchild per further core) while the command imports rich and git
status runs.

quantpatch's own modules are byte-compiled first, as `pip install` does for a wheel (an
editable install under PYTHONDONTWRITEBYTECODE=1 would otherwise recompile them on every
start, which no installed copy does).
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import wall  # benchmarks/_timing.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/forklike.py

import quantpatch
from quantpatch.base.megatron_source import megatron_tree
from quantpatch.checkout.demo import build_checkout
from tests.forklike import build_fork, clone_quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--megatron-core", default="0.13.1")
    ap.add_argument("--layout", choices=("fork", "demo"), default="fork")
    ap.add_argument("--history", type=int, default=3000)
    args = ap.parse_args()
    qp = shutil.which("quantpatch") or str(Path(sys.executable).with_name("quantpatch"))
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    compileall.compile_dir(Path(quantpatch.__file__).parent, quiet=1)
    tmp = Path(tempfile.mkdtemp(prefix="qp-bench-"))
    try:
        if args.layout == "fork":
            fork = build_fork(
                tmp / "origin", megatron_tree(args.megatron_core), history=args.history
            )
            root = clone_quant(fork, tmp / "Megatron-LM")
        else:
            root = build_checkout(tmp / "checkout", args.megatron_core)
        n_commits = int(
            subprocess.run(
                ["git", "rev-list", "--count", "HEAD"], cwd=root, capture_output=True, text=True
            ).stdout
        )
        n_py = len(list((root / "megatron").rglob("*.py")))
        rows: dict[str, list[float]] = {
            k: []
            for k in (
                "python3 -c pass",
                "python3 -c 'import libcst'",
                "quantpatch --help",
                "quantpatch check",
                "quantpatch check (cold cache)",
                "quantpatch set (+commit)",
                "quantpatch check (after set)",
                "quantpatch restore",
            )
        }
        schemes = ["FA_linear_mxfp8", "linear_hifp8"]
        for i in range(args.runs):
            rows["python3 -c pass"].append(wall([sys.executable, "-c", "pass"], root))
            # the floor of any command that parses: libcst's own import
            rows["python3 -c 'import libcst'"].append(
                wall([sys.executable, "-c", "import libcst"], root)
            )
            rows["quantpatch --help"].append(wall([qp, "--help"], root))
            rows["quantpatch check"].append(wall([qp, "check"], root))
            shutil.rmtree(root / ".git" / "quantpatch" / "cache", ignore_errors=True)
            rows["quantpatch check (cold cache)"].append(wall([qp, "check"], root))
            # a fresh branch each time: delete the one this run would reuse
            subprocess.run(
                [
                    "git",
                    "branch",
                    "-q",
                    "-D",
                    f"quantpatch/linear-{'mxfp8' if i % 2 == 0 else 'hifp8'}"
                    f"_qk-{'mxfp8' if i % 2 == 0 else 'bf16'}_pv-bf16",
                ],
                cwd=root,
                stderr=subprocess.DEVNULL,
                check=False,
            )
            rows["quantpatch set (+commit)"].append(
                wall([qp, "set", "--scheme", schemes[i % 2]], root)
            )
            rows["quantpatch check (after set)"].append(wall([qp, "check"], root))
            rows["quantpatch restore"].append(wall([qp, "restore"], root))
        print(
            f"{args.layout} checkout of megatron-core {args.megatron_core}: {n_py} .py files, "
            f"{n_commits} commits; {args.runs} runs each; python {sys.version.split()[0]}"
        )
        base = statistics.median(rows["python3 -c pass"])
        bars: dict[str, tuple[str, float]] = {
            "quantpatch --help": ("x", 6),
            "quantpatch check": ("x", 12),
            "quantpatch check (after set)": ("x", 12),
            "quantpatch check (cold cache)": ("x", 25),
            "quantpatch set (+commit)": ("s", 1.0),
            "quantpatch restore": ("s", 1.0),
        }
        print(
            f"{'command':30s} {'median ms':>10s} {'min ms':>8s} {'max ms':>8s} {'x pass':>7s}  bar"
        )
        for name, values in rows.items():
            med = statistics.median(values)
            verdict = ""
            if name in bars:
                unit, limit = bars[name]
                ok = med / base <= limit if unit == "x" else med <= limit
                shown = f"<= {limit:g}x" if unit == "x" else f"<= {limit:g} s"
                verdict = f"{shown} {'met' if ok else 'MISSED'}"
            print(
                f"{name:30s} {med * 1e3:10.0f} {min(values) * 1e3:8.0f} "
                f"{max(values) * 1e3:8.0f} {med / base:7.1f}  {verdict}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
