"""The generated scripts, run: ``init`` a Megatron-LM checkout, install the saver, generate
``smoke`` scripts and run them through ``torchrun pretrain_gpt.py``, then ``runs`` and
``report`` on what they wrote.

Usage::

    python benchmarks/pretrain_runs.py --megatron-lm /path/to/Megatron-LM [--steps 20]
        [--out DIR] [--json FILE]
    python benchmarks/pretrain_runs.py --stub [--json FILE]      # no GPU: a stub torchrun

For llama32-1b and deepseek2_lite (wikipedia, mock data) it runs bf16, FA_linear_mxfp8 (saver
on) and FA_linear_hifp8, and reports per run: the exit status, the step time against bf16 (from
``quantpatch runs``), whether every logged loss is finite, the source commit the log names
(and that it is the scheme worktree's HEAD), and the saver's files. ``--megatron-lm`` names a
Megatron-LM clone (core_v0.13.1: its ``pretrain_gpt.py``, ``megatron/training``); it is copied,
never changed. ``--stub`` runs the same pipeline on CPU with a ``torchrun`` that prints
core_v0.13.1's log lines (and a megatron-core 0.13.1 tree from PyPI as the checkout), so that
everything but the training itself is exercised where no GPU is: its step times are the stub's.
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
'''


def quantpatch(*args: str | Path, cwd: Path | None = None) -> str:
    res = subprocess.run(
        [QUANTPATCH, *map(str, args)], cwd=cwd, capture_output=True, text=True, check=False
    )
    if res.returncode:
        raise SystemExit(f"quantpatch {' '.join(map(str, args))}: {res.stderr.strip()}")
    return res.stdout


def checkout(work: Path, megatron_lm: Path | None) -> Path:
    """A git checkout of the Megatron-LM clone (or, for the stub, of megatron-core 0.13.1)."""
    import git

    root = work / "Megatron-LM"
    if megatron_lm is not None:
        shutil.copytree(megatron_lm, root, ignore=shutil.ignore_patterns(".git"))
    else:
        from quantpatch.megatron_source import megatron_tree

        shutil.copytree(megatron_tree("0.13.1"), root / "megatron")
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "quantpatch benchmark")
        cw.set_value("user", "email", "bench@example.com")
    repo.git.add("-A")
    repo.git.commit("-qm", "Megatron-LM as given")
    quantpatch("--repo", root, "init")
    quantpatch("--repo", root, "saver", "install")
    return root


def run_scripts(
    root: Path, work: Path, steps: int, torchrun: str, timeout: float
) -> list[dict[str, Any]]:
    scripts = work / "scripts"
    quantpatch(
        "--repo", root, "gen-scripts", "--out", scripts, "--profile", "smoke",
        "--models", ",".join(MODELS), "--datasets", "wikipedia", "--schemes", ",".join(SCHEMES),
    )  # fmt: skip
    done = []
    for model in MODELS:
        for scheme in SCHEMES:
            script = scripts / model / f"pretrain_{model}_wikipedia_{scheme}.sh"
            env = {
                **os.environ,
                "OUTPUT_ROOT": str(work / "runs"),
                "QUANTPATCH": QUANTPATCH,
                "TORCHRUN": torchrun,
                "EXTRA_ARGS": f"--train-iters {steps}",
                "TENSOR_SAVE_ENABLED": "true" if scheme == SAVER_SCHEME else "false",
            }
            print(f"$ {script.name}", flush=True)
            start = time.perf_counter()
            try:
                res = subprocess.run(
                    ["bash", str(script)], cwd=root, env=env, capture_output=True, text=True,
                    timeout=timeout,
                )  # fmt: skip
                code, tail = res.returncode, (res.stdout + res.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                code, tail = 124, f"timed out after {timeout:.0f} s"
            run_dir = work / "runs" / f"{model}_wikipedia_{scheme}_smoke"
            logs = sorted((run_dir / "logs").glob("*.log"))
            text = logs[-1].read_text() if logs else ""
            commit = re.search(r"source commit ([0-9a-f]{40}) in (\S+)", text)
            head = None
            if commit:
                head = subprocess.run(
                    ["git", "-C", commit[2], "rev-parse", "HEAD"], capture_output=True, text=True
                ).stdout.strip()
            files = sorted((run_dir / "tensor_logs").rglob("*.pt"))
            done.append(
                {
                    "model": model,
                    "scheme": scheme,
                    "exit": code,
                    "wall_s": round(time.perf_counter() - start, 1),
                    "commit": commit[1] if commit else None,
                    "commit_is_worktree_head": bool(commit) and head == commit[1],
                    "saver_files": len(files),
                    "log": str(logs[-1]) if logs else None,
                    "tail": tail if code else "",
                }
            )
            print(f"  exit {code}, {done[-1]['wall_s']} s, {len(files)} saver files", flush=True)
    return done


def analyse(work: Path, done: list[dict[str, Any]]) -> dict[str, Any]:
    rows = json.loads(quantpatch("runs", "--json", work / "runs"))["runs"]
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
    report = work / "report.html"
    tensors = [d for d in done if d["saver_files"]]
    extra: list[str | Path] = []
    if tensors:
        run_dir = work / "runs" / f"{tensors[0]['model']}_wikipedia_{SAVER_SCHEME}_smoke"
        extra = ["--tensors", run_dir / "tensor_logs"]
    quantpatch("report", "--runs", work / "runs", *extra, "--out", report)
    return {"runs": done, "report": str(report), "report_bytes": report.stat().st_size}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| model | scheme | exit | step ms | vs bf16 | losses finite | commit = worktree HEAD "
        "| saver files |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for d in result["runs"]:
        step = f"{d['step_ms']:.1f}" if isinstance(d.get("step_ms"), float) else "n/a"
        vs = d.get("step_vs_bf16")
        ratio = f"{vs:.2f}" if isinstance(vs, float) and math.isfinite(vs) else "n/a"
        lines.append(
            f"| {d['model']} | {d['scheme']} | {d['exit']} | {step} | {ratio} | "
            f"{d['losses_finite']} ({d['losses']}) | {d['commit_is_worktree_head']} "
            f"({(d['commit'] or 'none')[:10]}) | {d['saver_files']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--megatron-lm", type=Path, help="a Megatron-LM clone (core_v0.13.1)")
    ap.add_argument("--stub", action="store_true", help="a stub torchrun (no GPU, no training)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
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
        done = run_scripts(root, work, args.steps, torchrun, args.timeout)
        result = {"stub": args.stub, **analyse(work, done)}
        print(markdown(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    failed = [f"{d['model']}/{d['scheme']}" for d in result["runs"] if d["exit"]]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
