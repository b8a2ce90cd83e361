"""Start-up of two revisions of quantpatch side by side: did a change to the package's layout
(or anything else) slow the CLI down?

Usage: python benchmarks/layout_timing.py --before REV [--after REV] [--runs N]

Each revision is exported (``git worktree add --detach``) and byte-compiled, as an installed
wheel is; a demo checkout is built once. Then, alternating the two revisions run by run (so
that a machine busy with something else slows both alike), it times as fresh processes:

- ``import``: ``python -X importtime -c 'import quantpatch.cli'``, the cumulative import time
  of ``quantpatch.cli`` as the interpreter reports it (microseconds, summed by itself);
- ``--help``: ``python -m quantpatch --help``, wall time;
- ``check``: ``python -m quantpatch check --repo DEMO``, wall time (the warm, cached path).

It prints the median and the minimum of each, and after/before as a ratio of medians.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import wall  # benchmarks/_timing.py, beside this script

REPO = Path(__file__).resolve().parents[1]


def import_us(tree: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import quantpatch.cli"],
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
    ).stderr
    for line in out.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s+quantpatch\.cli$", line)
        if m:
            return int(m.group(1))
    raise SystemExit("no 'quantpatch.cli' line in -X importtime's output")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--runs", type=int, default=21)
    args = ap.parse_args()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    tmp = Path(tempfile.mkdtemp(prefix="qp-layout-"))
    trees = {}
    try:
        for label, rev in (("before", args.before), ("after", args.after)):
            trees[label] = tmp / label
            subprocess.run(
                ["git", "worktree", "add", "-q", "--detach", str(trees[label]), rev],
                cwd=REPO,
                check=True,
            )
            compileall.compile_dir(trees[label] / "quantpatch", quiet=1)
        demo = tmp / "demo"
        subprocess.run(
            [sys.executable, "-m", "quantpatch", "demo", str(demo)],
            cwd=trees["after"],
            env={**os.environ, "PYTHONPATH": str(trees["after"])},
            check=True,
            stdout=subprocess.DEVNULL,
        )
        times: dict[str, dict[str, list[float]]] = {
            k: {"import": [], "--help": [], "check": []} for k in trees
        }
        for _ in range(args.runs):
            for label, tree in trees.items():
                os.environ["PYTHONPATH"] = str(tree)
                cli = [sys.executable, "-m", "quantpatch"]
                times[label]["import"].append(import_us(tree) / 1e6)
                times[label]["--help"].append(wall([*cli, "--help"], cwd=tree))
                times[label]["check"].append(wall([*cli, "check", "--repo", str(demo)], cwd=tree))
        head = f"{'':8} {'before median':>14} {'after median':>13} {'ratio':>6}"
        print(head + "   (min before/after)")
        for what in ("import", "--help", "check"):
            b, a = times["before"][what], times["after"][what]
            mb, ma = statistics.median(b), statistics.median(a)
            print(
                f"{what:8} {mb * 1e3:11.1f} ms {ma * 1e3:10.1f} ms {ma / mb:6.3f}"
                f"   ({min(b) * 1e3:.1f} / {min(a) * 1e3:.1f} ms)"
            )
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
