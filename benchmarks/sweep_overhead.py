"""What ``quantpatch sweep`` costs around the training itself: a 60-run sweep (3 models x 2
datasets x 10 schemes, smoke profile) of an ``init``ed megatron-core 0.13.1 checkout, every
run a stub ``torchrun`` that prints four core_v0.13.1 log lines and exits, then ``status`` and
``report``.

    python benchmarks/sweep_overhead.py [--parallel 2] [--json FILE]

Prints the wall time of ``sweep run`` (scripts, worktrees, 60 runs, the report at its end),
the time per run, and the times of ``sweep status`` and ``sweep report``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUANTPATCH = os.environ.get("QUANTPATCH") or str(Path(sys.executable).with_name("quantpatch"))
STUB = """#!/usr/bin/env bash
for i in 1 2 3 4; do
    printf ' [2026-11-22 11:25:39] iteration %9d/%8d | consumed samples: %12d | elapsed time per \
iteration (ms): 96.9 | learning rate: 6.666667E-05 | global batch size: %5d | lm loss: \
%.6E | loss scale: 1.0 | grad norm: 2.105 | number of skipped iterations: %3d | number of \
nan iterations: %3d |\\n' "$i" 4 "$((2 * i))" 2 "$((10 - i))" 0 0
done
"""


def timed(*args: str | Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    res = subprocess.run([QUANTPATCH, *map(str, args)], env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"quantpatch {' '.join(map(str, args))}: {res.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from pretrain_runs import commit_all

    from quantpatch.base.megatron_source import megatron_tree

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root = work / "Megatron-LM"
        shutil.copytree(megatron_tree("0.13.1"), root / "megatron")
        commit_all(root, "megatron-core 0.13.1")
        (work / "bin").mkdir()
        (work / "bin" / "torchrun").write_text(STUB)
        (work / "bin" / "torchrun").chmod(0o755)
        env = {
            **os.environ,
            "PATH": f"{work / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "QUANTPATCH": QUANTPATCH,
        }
        timed("--repo", root, "init", env=env)
        gpus = ",".join(str(i) for i in range(args.parallel))
        sweep = work / "sweep"
        run_s = timed(
            "sweep", "run", sweep, "--profile", "smoke", "--parallel", str(args.parallel),
            "--gpus", gpus, "--repo", root, env=env,
        )  # fmt: skip
        record = json.loads((sweep / "sweep.json").read_text())
        finished = sum(r["state"] == "finished" for r in record["runs"])
        status_s = min(timed("sweep", "status", sweep, "--json", env=env) for _ in range(3))
        report_s = timed("sweep", "report", sweep, "--out", work / "r.html", env=env)
        result = {
            "runs": len(record["runs"]),
            "finished": finished,
            "parallel": args.parallel,
            "sweep_run_s": round(run_s, 1),
            "per_run_s": round(run_s / len(record["runs"]), 2),
            "status_s": round(status_s, 2),
            "report_s": round(report_s, 1),
        }
    print(
        f"sweep run: {result['runs']} runs ({result['finished']} finished), --parallel "
        f"{result['parallel']}: {result['sweep_run_s']} s = {result['per_run_s']} s a run "
        f"(scripts, worktrees, queue, report); sweep status: {result['status_s']} s; "
        f"sweep report: {result['report_s']} s"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
