"""The generated scripts, run: ``init`` a Megatron-LM checkout, install the saver, and
``quantpatch sweep run`` the ``smoke`` scripts through ``torchrun pretrain_gpt.py``, then
``runs`` and ``sweep report`` on what they wrote.

Usage::

    python benchmarks/pretrain_runs.py --megatron-lm /path/to/Megatron-LM [--steps 20]
        [--out DIR] [--json FILE]
    python benchmarks/pretrain_runs.py --stub [--json FILE]      # no GPU: a stub torchrun

For llama32-1b and deepseek2_lite (wikipedia, mock data) one sweep runs bf16, FA_linear_mxfp8
and FA_linear_hifp8 with the saver off (so the step times compare like with like) and a second
runs FA_linear_mxfp8 with the saver on. Per run it reports the exit status, the step time
against bf16 (from ``quantpatch runs``), whether every logged loss is finite, the source
commit the log names (and that it is the scheme worktree's HEAD), and the saver's files.

``--megatron-lm`` names a Megatron-LM clone (core_v0.13.1: its ``pretrain_gpt.py``,
``megatron/training``); it is copied, never changed. ``--stub`` runs the same pipeline on CPU
with a ``torchrun`` that prints core_v0.13.1's log lines (and a megatron-core 0.13.1 tree from
PyPI as the checkout), so that everything but the training itself is exercised where no GPU
is: its step times are the stub's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = ("llama32-1b", "deepseek2_lite")
SCHEMES = ("bf16", "FA_linear_mxfp8", "FA_linear_hifp8")
SAVER_SCHEME = "FA_linear_mxfp8"
QUANTPATCH = os.environ.get("QUANTPATCH") or str(Path(sys.executable).with_name("quantpatch"))

# core_v0.13.1's training_log line (training/training.py), as the real log sample prints it
STUB = r'''#!/usr/bin/env python3
"""A stand-in for torchrun: checks it was started in a scheme worktree holding
pretrain_gpt.py's arguments, and prints core_v0.13.1's iteration lines."""
import os, sys, time
args = sys.argv[1:]
assert "pretrain_gpt.py" in args, args
argv = args[args.index("pretrain_gpt.py") + 1 :]
iters = int(argv[len(argv) - 1 - argv[::-1].index("--train-iters") + 1])
scheme = os.path.basename(os.getcwd())
slow = 1.0 + 0.1 * scheme.count("mxfp8") + 0.05 * scheme.count("hifp8")
for i in range(1, iters + 1):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    loss = 11.0 * 0.97 ** i
    print(f" [{stamp}] iteration {i:>9}/{iters:>8} | consumed samples: {2 * i:>12} | "
          f"elapsed time per iteration (ms): {50.0 * slow:.1f} | learning rate: 1.000000E-04 | "
          f"global batch size: {2:>5} | lm loss: {loss:.6E} | loss scale: 1.0 | "
          f"grad norm: 1.234 | number of skipped iterations: {0:>3} | "
          f"number of nan iterations: {0:>3} |", flush=True)
    if i == 1:  # training_log's report_memory after the first logged iteration (rank 0)
        print(f"[Rank 0] (after 1 iterations) memory (MB) | allocated: {900.0 * slow:.1f} | "
              f"max allocated: {1200.0 * slow:.1f} | reserved: 1400.0 | max reserved: 1400.0",
              flush=True)
'''


def quantpatch(*args: str | Path, cwd: Path | None = None) -> str:
    res = subprocess.run(
        [QUANTPATCH, *map(str, args)], cwd=cwd, capture_output=True, text=True, check=False
    )
    if res.returncode:
        raise SystemExit(f"quantpatch {' '.join(map(str, args))}: {res.stderr.strip()}")
    return res.stdout


def commit_all(root: Path, message: str) -> None:
    """``root`` made a git repository holding everything in it as one commit."""
    import git

    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "quantpatch benchmark")
        cw.set_value("user", "email", "bench@example.com")
    repo.git.add("-A")
    repo.git.commit("-qm", message)


def checkout(work: Path, megatron_lm: Path | None) -> Path:
    """A git checkout of the Megatron-LM clone (or, for the stub, of megatron-core 0.13.1)."""
    root = work / "Megatron-LM"
    if megatron_lm is not None:
        shutil.copytree(megatron_lm, root, ignore=shutil.ignore_patterns(".git"))
    else:
        from quantpatch.base.megatron_source import megatron_tree

        shutil.copytree(megatron_tree("0.13.1"), root / "megatron")
    commit_all(root, "Megatron-LM as given")
    quantpatch("--repo", root, "init")
    quantpatch("--repo", root, "saver", "install")
    return root


def _sweep(
    root: Path,
    sweep_dir: Path,
    schemes: tuple[str, ...],
    steps: int,
    env: dict[str, str],
    models: tuple[str, ...] = MODELS,
) -> tuple[int, float]:
    """``quantpatch sweep run`` over ``models`` and ``schemes`` (smoke, local queue); its output
    goes to ``<sweep_dir>.log`` as it comes, so a run cut off by a time limit leaves it."""
    start = time.perf_counter()
    log = sweep_dir.with_name(sweep_dir.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        res = subprocess.run(
            [
                QUANTPATCH, "--repo", str(root), "sweep", "run", str(sweep_dir),
                "--models", ",".join(models), "--datasets", "wikipedia", "--profile", "smoke",
                "--schemes", ",".join(schemes), "--", "--train-iters", str(steps),
            ],
            env=env, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip
    print(log.read_text()[-4000:], end="", flush=True)
    return res.returncode, time.perf_counter() - start


def run_sweeps(
    root: Path,
    work: Path,
    steps: int,
    torchrun: str,
    schemes: tuple[str, ...] = SCHEMES,
    models: tuple[str, ...] = MODELS,
    saver: bool = True,
) -> list[dict[str, Any]]:
    """Two sweeps: every scheme with the saver off (the step times compare like with like),
    then (``saver``) FA_linear_mxfp8 again with the saver on (its files)."""
    env = {**os.environ, "QUANTPATCH": QUANTPATCH, "TORCHRUN": torchrun}
    code, wall = _sweep(root, work / "sweep", schemes, steps, env, models)
    saver_code = None
    files: dict[str, int] = {}
    if saver:
        saver_code, _ = _sweep(
            root,
            work / "saver",
            (SAVER_SCHEME,),
            steps,
            {**env, "TENSOR_SAVE_ENABLED": "true"},
            models,
        )
        saved = json.loads((work / "saver" / "sweep.json").read_text())
        runs_dir = work / "saver" / "runs"
        files = {
            r["model"]: len(list((runs_dir / r["name"] / "tensor_logs").rglob("*.pt")))
            for r in saved["runs"]
        }
    print(f"sweep: exit {code} in {wall:.0f} s; saver sweep: exit {saver_code}", flush=True)
    return sweep_rows(root, work / "sweep", env, files)


def sweep_rows(
    root: Path, sweep_dir: Path, env: dict[str, str], files: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """One row per run of ``sweep_dir/sweep.json``, as far as the sweep got: its exit status,
    state, the commit its log names and whether that is the scheme worktree's HEAD."""
    record = json.loads((sweep_dir / "sweep.json").read_text())
    done = []
    for r in record["runs"]:
        head = None
        if r["commit"]:
            wt = subprocess.run(
                [QUANTPATCH, "--repo", str(root), "worktree", "--scheme", r["scheme"],
                 "--path-only"],
                capture_output=True, text=True, env=env,
            ).stdout.strip()  # fmt: skip
            head = subprocess.run(
                ["git", "-C", wt, "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
        done.append(
            {
                "model": r["model"],
                "scheme": r["scheme"],
                "exit": r["exit_code"],
                "state": r["state"],
                "commit": r["commit"],
                "commit_is_worktree_head": bool(r["commit"]) and head == r["commit"],
                "saver_files": (files or {}).get(r["model"], 0)
                if r["scheme"] == SAVER_SCHEME
                else 0,
                # sweep.json keeps a log relative to the sweep's folder
                "log": str(sweep_dir / r["log"]) if r["log"] else r["log"],
            }
        )
    return done


def analyse(work: Path, done: list[dict[str, Any]], sweep_report: bool = True) -> dict[str, Any]:
    """``runs`` over ``work/sweep/runs`` joined to ``done``, and the report: ``sweep report``
    of the sweep there, or (``sweep_report`` False: run folders gathered from several sweeps)
    ``report --runs`` over those folders."""
    rows = json.loads(quantpatch("runs", "--json", work / "sweep" / "runs"))["runs"]
    by = {(r["model"], r["scheme"]): r for r in rows}
    for d in done:
        r = by.get((d["model"], d["scheme"]), {})
        d["step_ms"] = r.get("step_ms")
        d["step_vs_bf16"] = r.get("step_vs_bf16")
        d["iterations"] = r.get("iterations")
        d["status"] = r.get("status")
        d["diverged"] = r.get("diverged")
        losses = []
        if d["log"]:
            losses = [
                float(m[1]) for m in re.finditer(r"lm loss: (\S+) \|", Path(d["log"]).read_text())
            ]
        d["losses"] = len(losses)
        d["losses_finite"] = bool(losses) and all(math.isfinite(x) for x in losses)
        d["loss_first"] = losses[0] if losses else None
        d["loss_last"] = losses[-1] if losses else None
        d["loss_falls"] = len(losses) > 1 and losses[-1] < losses[0]
    report = work / "sweep" / "report.html"
    if sweep_report:
        quantpatch("sweep", "report", work / "sweep", "--out", report)
    else:
        quantpatch("report", "--runs", work / "sweep" / "runs", "--out", report)
    tensors = sorted((work / "saver" / "runs").glob("*/tensor_logs"))
    with_tensors = work / "report-with-tensors.html"
    if any(any(t.rglob("*.pt")) for t in tensors):
        quantpatch(
            "report", "--runs", work / "sweep" / "runs", "--tensors", tensors[0],
            "--out", with_tensors,
        )  # fmt: skip
    return {
        "runs": done,
        "report": str(report),
        "report_bytes": report.stat().st_size,
        "report_with_tensors": str(with_tensors) if with_tensors.exists() else None,
    }


def _loss(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| model | scheme | exit | step ms | vs bf16 | losses finite | first → last loss "
        "| commit = worktree HEAD | saver files |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for d in result["runs"]:
        step = f"{d['step_ms']:.1f}" if isinstance(d.get("step_ms"), float) else "n/a"
        vs = d.get("step_vs_bf16")
        ratio = f"{vs:.2f}" if isinstance(vs, float) and math.isfinite(vs) else "n/a"
        lines.append(
            f"| {d['model']} | {d['scheme']} | {d['exit']} | {step} | {ratio} | "
            f"{d['losses_finite']} ({d['losses']}) | {_loss(d.get('loss_first'))} → "
            f"{_loss(d.get('loss_last'))} | {d['commit_is_worktree_head']} "
            f"({(d['commit'] or 'none')[:10]}) | {d['saver_files']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--megatron-lm", type=Path, help="a Megatron-LM clone (core_v0.13.1)")
    ap.add_argument("--stub", action="store_true", help="a stub torchrun (no GPU, no training)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, help="keep the checkout, logs and report here")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.stub == (args.megatron_lm is not None):
        ap.error("give exactly one of --megatron-lm and --stub")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        torchrun = "torchrun"
        if args.stub:
            stub = work / "bin" / "torchrun"
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text(STUB.replace("#!/usr/bin/env python3", f"#!{sys.executable}", 1))
            stub.chmod(0o755)
            torchrun = str(stub)
        root = checkout(work, args.megatron_lm)
        done = run_sweeps(root, work, args.steps, torchrun)
        result = {"stub": args.stub, **analyse(work, done)}
        print(markdown(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    failed = [f"{d['model']}/{d['scheme']}" for d in result["runs"] if d["state"] != "finished"]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
