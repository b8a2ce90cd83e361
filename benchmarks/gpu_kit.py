"""The GPU kit: everything a lent GPU machine lacks, gathered here on CPU, and the one run
made there.

    python benchmarks/gpu_kit.py prepare --megatron-lm PATH [--ref core_v0.13.1] [--kit .gpukit]
    bash benchmarks/gpu_run.sh           # on the GPU machine, the kit carried; results in $OUT

``prepare`` fills one ignored folder (``.gpukit/``) with what the device machine has not got
(it has Python 3.12, CUDA torch, Triton, transformers, einops, regex, six, jinja2, rich, typer,
pyyaml; no network): the cp312 wheels of quantpatch's own dependencies that are missing there
(libcst, GitPython, gitdb, smmap, typer < 0.29 and its two small needs) at the versions this
environment tests, quantpatch itself as a wheel, and Megatron-LM's ``megatron/`` and
``pretrain_gpt.py`` at ``--ref`` as ``megatron-lm.tar.gz`` (``PATH`` is a git directory, bare
or not, or a tree holding those two; nothing of it is committed here). It checks the kit and
the working tree together fit the device tool's 64 MiB and prints the exact call to make.

``run`` (what ``gpu_run.sh`` starts once the wheels are installed) makes, in order, each step
in its own process group under its own time budget, and rewrites ``summary.md`` and
``results.json`` in ``--out`` after every step, so a cut-off run still returns what finished:

1. ``setup``: the Megatron-LM tree unpacked and committed as the user's clone (its
   ``.gitignore`` too, so the helpers Megatron builds at its first start stay untracked),
   ``quantpatch init`` and ``saver install``;
2. ``smoke``: ``quantpatch sweep run`` (one per model and scheme, four at once) with the
   smoke profile through ``torchrun pretrain_gpt.py`` exactly as generated (llama32-1b and
   deepseek2_lite x bf16, FA_linear_mxfp8, FA_linear_nvfp4, and nvfp4_recipe where the
   registry has it), then ``runs`` and ``report`` over all of them: exit status, finite and
   falling loss, step time against bf16;
3. ``fast``: llama32-1b's ``fast`` script on one GPU with mock data at sequence 4096 (bf16,
   FA_mxfp8 on the flash route, FA_linear_mxfp8), a few iterations: step time and the peak
   memory Megatron's ``report_memory`` prints;
4. ``suite``: ``gpu_suite.py``'s kernel-shape, weight-cache, flash-attention and GEMM rows at
   their real shapes, each part under its own budget.

``--stub`` runs the same steps on CPU: a stub ``torchrun`` printing core_v0.13.1's log lines,
the kernels in Triton's interpreter at tiny sizes (``tests/test_gpu_kit.py``), so that nothing
but the GPU differs when the kit runs for real.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEVICE_LIMIT = 64 * 1024 * 1024  # the device tool's limit on what travels, working tree included
# quantpatch's dependencies the device machine lacks (or has at another version): typer < 0.29
# vendors click and needs annotated-doc and shellingham; libcst needs pyyaml, which it has.
CARRIED = ("libcst", "GitPython", "gitdb", "smmap", "typer", "annotated-doc", "shellingham")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
TREE_PATHS = ("megatron", "pretrain_gpt.py")
OPTIONAL_PATHS = (".gitignore",)  # a clone's: Megatron's built helpers (*.so) stay untracked
MODELS = ("llama32-1b", "deepseek2_lite")
SMOKE_SCHEMES = ("bf16", "FA_linear_mxfp8", "FA_linear_nvfp4")
RECIPE = "nvfp4_recipe"  # NVIDIA's NVFP4 recipe, run where the registry has it
FAST_SCHEMES = ("bf16", "FA_mxfp8", "FA_linear_mxfp8")
SUITE_PARTS = ("shapes", "cache", "flash", "gemm")
ALL_SUITE = ("ops", "paretoq", "shapes", "gemm", "cache", "flash", "saver", "e2e", "pretrain")
# Seconds: the most each step may take on the GPU, and what is kept back for each later step,
# all inside one deadline for the whole run (the device call ends within 10 minutes; the
# machine's start and the wheels' install come before it). Sized from the H200 run of
# 2026-11-27: setup 13 s, a smoke run 60-80 s (mostly Megatron's start), the fast step's
# three runs 59 + 47 + 80 s, gpu_suite's parts 19 / 28 / 11 / 67 s.
BUDGETS = {
    "setup": 90,
    "smoke": 270,
    "salvage": 45,
    "fast": 200,
    "shapes": 40,
    "cache": 40,
    "flash": 30,
    "gemm": 100,
}
FLOORS = {"smoke": 60, "fast": 60, "shapes": 20, "cache": 15, "flash": 20, "gemm": 30}
ORDER = ("setup", "smoke", "fast", *SUITE_PARTS)
DEADLINE_S = 575


# ------------------------------------------------------------------------------ prepare


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in CARRIED}


def download_wheels(dest: Path, python_version: str) -> list[Path]:
    """The carried dependencies as wheels for ``python_version`` on x86-64 Linux, each at the
    version this environment has (the one the tests ran)."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={v}" for n, v in _versions().items()]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", *platforms,
            "-d", str(dest), *pins,
        ],
        check=True,
    )  # fmt: skip
    return sorted(dest.glob("*.whl"))


def build_quantpatch_wheel(dest: Path) -> Path:
    before = set(dest.glob("quantpatch-*.whl"))
    for old in before:
        old.unlink()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(REPO)],
        check=True,
    )
    (wheel,) = dest.glob("quantpatch-*.whl")
    return wheel


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def megatron_archive(source: Path, ref: str, dest: Path) -> dict[str, Any]:
    """``megatron/`` and ``pretrain_gpt.py`` of Megatron-LM at ``ref`` (a git directory) or as
    they are (a tree), as one gzipped tar with fixed times, so the kit is the same each time."""
    buf = io.BytesIO()
    if _is_git_dir(source) or (source / ".git").exists():
        git_dir = source if _is_git_dir(source) else source / ".git"
        commit = subprocess.run(
            ["git", "--git-dir", str(git_dir), "rev-parse", f"{ref}^{{commit}}"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        raw = subprocess.run(
            ["git", "--git-dir", str(git_dir), "archive", "--format=tar", commit,
             *TREE_PATHS, *OPTIONAL_PATHS],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        buf.write(raw)
        origin = {"git": str(source), "ref": ref, "commit": commit}
    else:
        missing = [p for p in TREE_PATHS if not (source / p).exists()]
        if missing:
            raise SystemExit(f"{source} has no {' or '.join(missing)}: name a Megatron-LM clone")
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name in (*TREE_PATHS, *OPTIONAL_PATHS):
                if (source / name).exists():
                    tar.add(source / name, arcname=name, filter=_fixed)
        origin = {"tree": str(source), "ref": None, "commit": None}
    with gzip.GzipFile(dest, "wb", mtime=0) as gz:
        gz.write(buf.getvalue())
    return {**origin, "bytes": dest.stat().st_size}


def _fixed(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if "__pycache__" in info.name:
        return None
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def working_tree_bytes() -> int:
    """What the device tool sends besides the carried paths: tracked files and untracked ones
    git does not ignore."""
    names = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def prepare(kit: Path, megatron_lm: Path, ref: str, python_version: str) -> dict[str, Any]:
    kit.mkdir(parents=True, exist_ok=True)
    wheels = kit / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    deps = download_wheels(wheels, python_version)
    own = build_quantpatch_wheel(wheels)
    tree = megatron_archive(megatron_lm, ref, kit / "megatron-lm.tar.gz")
    kit_bytes = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    manifest = {
        "python_version": python_version,
        "wheels": [p.name for p in deps if p != own],
        "quantpatch_wheel": own.name,
        "quantpatch_commit": _head(),
        "megatron": tree,
        "kit_bytes": kit_bytes,
        "working_tree_bytes": working_tree_bytes(),
    }
    (kit / "kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _head() -> str | None:
    res = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (res.stdout.strip() + ("+dirty" if dirty else "")) if res.returncode == 0 else None


def run_call(kit: Path) -> str:
    rel = os.path.relpath(kit, REPO)
    return json.dumps(
        {"command": "bash benchmarks/gpu_run.sh", "carry": [rel], "timeout_s": 595}, indent=1
    )


# ------------------------------------------------------------------------------ run


class Run:
    """The device run: steps in order, each in its own process group under a budget, and the
    results rewritten to ``out`` after each."""

    def __init__(self, kit: Path, out: Path, work: Path, stub: bool, scale: float) -> None:
        self.kit, self.out, self.work, self.stub = kit, out, work, stub
        self.scale = scale
        self.deadline = time.monotonic() + DEADLINE_S * scale
        self.results: dict[str, Any] = {"stub": stub, "steps": {}}
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = self.out / "run.log"

    def save(self) -> None:
        _atomic(self.out / "results.json", json.dumps(self.results, indent=1, default=str))
        _atomic(self.out / "summary.md", summary(self.results))

    def budget(self, name: str) -> float:
        """The step's own cap, or less: what is left before the deadline once every later
        step's floor is kept back (never under 10 s)."""
        later = ORDER[ORDER.index(name) + 1 :] if name in ORDER else ()
        reserve = sum(FLOORS.get(n, 0) for n in later) * self.scale
        left = self.deadline - time.monotonic() - reserve
        return max(10.0, min(BUDGETS[name] * self.scale, left))

    def step(self, name: str, args: list[str]) -> dict[str, Any]:
        budget = self.budget(name)
        start = time.monotonic()
        with open(self.log, "a") as log:
            log.write(f"\n===== {name} (budget {budget:.0f} s) =====\n")
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "step", name,
                 "--kit", str(self.kit), "--work", str(self.work),
                 *(["--stub"] if self.stub else []), *args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                code: int | None = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                code = None
                _kill_group(proc)
                _kill_strays(self.work)
        took = time.monotonic() - start
        result_file = self.work / f"{name}.json"
        data: dict[str, Any] = {}
        if result_file.exists():
            data = json.loads(result_file.read_text())
        state = "ok" if code == 0 else ("timed out" if code is None else f"exit {code}")
        entry = {"state": state, "seconds": round(took, 1), "budget": budget, **data}
        if state != "ok" and name == "smoke":  # what the sweep finished before it was cut off
            salvage = self.step("salvage", [])
            entry.update({k: v for k, v in salvage.items() if k not in ("state", "seconds")})
            self.results["steps"].pop("salvage", None)
        self.results["steps"][name] = entry
        self.save()
        print(f"[gpu_kit] {name}: {state} in {took:.0f} s", flush=True)
        return entry


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _kill_strays(work: Path) -> None:
    """A sweep starts each run in a process group of its own: after a step is cut off, end
    whatever still runs in the work folder (the runs' scripts, torchrun and its workers)."""
    mine = os.getpid()
    for pid_dir in Path("/proc").glob("[0-9]*"):
        pid = int(pid_dir.name)
        if pid == mine:
            continue
        with contextlib.suppress(OSError):
            cwd = os.readlink(pid_dir / "cwd")
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if cwd.startswith(str(work)) or str(work) in cmd:
                os.kill(pid, signal.SIGKILL)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
    }
    with contextlib.suppress(Exception):
        import triton

        env["triton"] = triton.__version__
    import quantpatch

    env["quantpatch"] = quantpatch.__version__
    env["quantpatch_from"] = str(Path(quantpatch.__file__).parent)
    env["git"] = subprocess.run(["git", "--version"], capture_output=True, text=True).stdout.strip()
    env["torchrun"] = shutil.which("torchrun")
    env["cpus"] = os.cpu_count()
    return env


def _quantpatch_bin() -> str:
    found = shutil.which("quantpatch") or str(Path(sys.executable).with_name("quantpatch"))
    return os.environ.get("QUANTPATCH") or found


def _pretrain_runs() -> Any:
    os.environ.setdefault("QUANTPATCH", _quantpatch_bin())
    sys.path.insert(0, str(HERE))
    import pretrain_runs

    return pretrain_runs


def _torchrun(work: Path, stub: bool) -> str:
    if not stub:
        return os.environ.get("TORCHRUN", "torchrun")
    pr = _pretrain_runs()
    path = work / "bin" / "torchrun"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(pr.STUB.replace("#!/usr/bin/env python3", f"#!{sys.executable}", 1))
        path.chmod(0o755)
    return str(path)


def step_setup(kit: Path, work: Path, stub: bool) -> dict[str, Any]:
    """Unpack Megatron-LM, commit it as the user's checkout, ``init`` and install the saver
    (Megatron builds its dataset helpers itself, at its first start in each worktree)."""
    pr = _pretrain_runs()
    root = work / "Megatron-LM"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    with tarfile.open(kit / "megatron-lm.tar.gz") as tar:
        tar.extractall(root, filter="data")
    pr.commit_all(root, "Megatron-LM as given")
    timings = {}
    for what in (["init"], ["saver", "install"]):
        t = time.perf_counter()
        print(pr.quantpatch("--repo", root, *what), flush=True)
        timings[" ".join(what)] = round(time.perf_counter() - t, 2)
    check = pr.quantpatch("--repo", root, "check")
    return {
        "environment": environment(),
        "quantpatch_seconds": timings,
        "check_tail": check[-1500:],
    }


def _gather(work: Path) -> Path:
    """Every smoke run's folder (``runs/<name>``, each from its own sweep) copied into one
    folder, so that ``runs`` compares each scheme with its model's bf16 run."""
    gathered = work / "smoke" / "all"
    runs = gathered / "sweep" / "runs"
    if runs.exists():
        shutil.rmtree(runs)
    runs.mkdir(parents=True)
    for run in sorted((work / "smoke").glob("*/sweep/runs/*")):
        if run.is_dir() and not run.is_relative_to(gathered):
            shutil.copytree(run, runs / run.name, ignore=shutil.ignore_patterns("*.pt"))
    return gathered


def step_salvage(work: Path) -> dict[str, Any]:
    """The smoke sweeps' finished runs, read back after the step was cut off."""
    pr = _pretrain_runs()
    env = {**os.environ, "QUANTPATCH": pr.QUANTPATCH}
    rows: list[dict[str, Any]] = []
    for record in sorted((work / "smoke").glob("*/sweep/sweep.json")):
        rows += [d for d in pr.sweep_rows(work / "Megatron-LM", record.parent, env) if d["log"]]
    if not rows:
        return {"runs": [], "markdown": "(the sweeps recorded nothing)\n"}
    result = pr.analyse(_gather(work), rows, sweep_report=False)
    _tails(result["runs"])
    return {**result, "markdown": pr.markdown(result)}


def _schemes_here() -> tuple[str, ...]:
    from quantpatch.launch.registry import load_registry

    return (*SMOKE_SCHEMES, *([RECIPE] if RECIPE in load_registry().schemes else []))


SMOKE_AT_ONCE = 4
"""Smoke runs at once on the one GPU: a smoke run is mostly Megatron's start (imports, the
dataset helpers' build, Triton's compiles), on the machine's 16 cores."""


def step_smoke(kit: Path, work: Path, stub: bool, steps: int) -> dict[str, Any]:
    """One ``sweep run`` per model and scheme, ``SMOKE_AT_ONCE`` at a time, over scheme
    worktrees made first, one at a time; then ``runs`` and ``report`` over all of them."""
    from concurrent.futures import ThreadPoolExecutor

    pr = _pretrain_runs()
    root = work / "Megatron-LM"
    torchrun = _torchrun(work, stub)
    schemes = _schemes_here()
    partial = {"schemes": list(schemes), "models": list(MODELS), "steps": steps}
    _atomic(work / "smoke.json", json.dumps({**partial, "runs": []}))
    for scheme in schemes:
        pr.quantpatch("--repo", root, "worktree", "--scheme", scheme, "--path-only")

    def sweep(unit: tuple[str, str]) -> list[dict[str, Any]]:
        model, scheme = unit
        unit_work = work / "smoke" / f"{model}__{scheme}"
        rows: list[dict[str, Any]] = pr.run_sweeps(
            root, unit_work, steps, torchrun, (scheme,), (model,), saver=False
        )
        return rows

    units = [(m, s) for m in MODELS for s in schemes]
    with ThreadPoolExecutor(SMOKE_AT_ONCE) as pool:
        done = [d for rows in pool.map(sweep, units) for d in rows]
    result = pr.analyse(_gather(work), done, sweep_report=False)
    _tails(result["runs"])
    return {**partial, **result, "at_once": SMOKE_AT_ONCE, "markdown": pr.markdown(result)}


def failure(text: str) -> str:
    """Where a failed run's log says why: its first traceback (torchrun's own report of the
    child's exit comes after it and says nothing), else its end."""
    at = text.find("Traceback (most recent call last)")
    return text[max(0, at - 200) : at + 2500] if at >= 0 else text[-2500:]


def _tails(rows: list[dict[str, Any]]) -> None:
    """The end of each failed run's log, so a failure on the GPU reads without its files."""
    for d in rows:
        if d.get("exit") != 0 and d.get("log") and Path(d["log"]).exists():
            d["tail"] = failure(Path(d["log"]).read_text(errors="replace"))


ATTENTION_PATH = re.compile(r"^\[quantpatch\] attention path: (flash|stock)\b", re.M)
"""The runtime's line saying which attention path a run took (quantpatch_ops.flash_eligible)."""
MEMORY = re.compile(r"\(after \d+ iterations\) memory \(MB\).*?\| max allocated: ([0-9.eE+-]+)")
ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
    r"(?:.*?lm loss: (\S+) \|)?"
)


def parse_megatron_log(text: str) -> dict[str, Any]:
    """Step times, losses and peak memory of a core_v0.13.1 log (``training_log`` and
    ``report_memory``'s lines), and the attention paths the runtime said it took (``flash``,
    ``stock``, ``flash+stock``; None: it said none, as a stock bf16 run does)."""
    times, losses = [], []
    for m in ITERATION.finditer(text):
        times.append((int(m[1]), float(m[2])))
        if m[3] is not None:
            losses.append(float(m[3]))
    later = [t for i, t in times if i > 2] or [t for _, t in times]
    mem = MEMORY.search(text)
    return {
        "iterations": len(times),
        "step_ms": statistics.median(later) if later else None,
        "losses": losses,
        "losses_finite": bool(losses) and all(x == x and abs(x) != float("inf") for x in losses),
        "peak_mb": float(mem[1]) if mem else None,
        "attention": "+".join(dict.fromkeys(ATTENTION_PATH.findall(text))) or None,
    }


def step_fast(kit: Path, work: Path, stub: bool, iters: int) -> dict[str, Any]:
    """llama32-1b's fast script, one GPU, mock data, sequence 4096: step time and peak memory
    per scheme, each run exactly as generated but for the settings named here."""
    pr = _pretrain_runs()
    root = work / "Megatron-LM"
    scripts = work / "fast-scripts"
    pr.quantpatch(
        "--repo", root, "gen-scripts", "--out", scripts, "--profile", "fast",
        "--models", "llama32-1b", "--datasets", "wikipedia", "--schemes", ",".join(FAST_SCHEMES),
    )  # fmt: skip
    env = {
        **os.environ,
        "QUANTPATCH": pr.QUANTPATCH,
        "TORCHRUN": _torchrun(work, stub),
        "MEGATRON_ROOT": str(root),
        "OUTPUT_ROOT": str(work / "fast-runs"),
        "MOCK_DATA": "1",
        "GPUS_PER_NODE": "1",
        "GLOBAL_BATCH_SIZE": "8",
    }
    # a few iterations: no checkpoint, no evaluation, and no warm-up longer than the run
    # (Megatron asserts lr_warmup_steps < lr_decay_steps)
    extra = ["--save", "", "--load", "", "--seq-length", "4096", "--train-iters", str(iters),
             "--eval-iters", "0", "--lr-warmup-iters", "0"]  # fmt: skip
    rows = []
    chosen = os.environ.get("GPU_KIT_FAST_SCHEMES", ",".join(FAST_SCHEMES)).split(",")
    for scheme in chosen:
        (script,) = scripts.glob(f"llama32-1b/*_{scheme}.sh")
        t = time.perf_counter()
        res = subprocess.run(
            ["bash", str(script), "--", *extra], env=env, capture_output=True, text=True
        )
        text = res.stdout + res.stderr
        (work / f"fast-{scheme}.log").write_text(text)
        row = {"scheme": scheme, "exit": res.returncode, "wall_s": round(time.perf_counter() - t)}
        row.update(parse_megatron_log(text))
        if res.returncode:
            row["tail"] = failure(text)
        rows.append(row)
        _ratios(rows)
        _atomic(work / "fast.json", json.dumps({"runs": rows}))
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return {"runs": rows, "seq_length": 4096, "global_batch": 8, "iterations": iters}


def _ratios(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if r["scheme"] == "bf16" and r["step_ms"]), None)
    for r in rows:
        if base and r["step_ms"]:
            r["step_vs_bf16"] = r["step_ms"] / base["step_ms"]
        if base and r["peak_mb"] and base["peak_mb"]:
            r["peak_vs_bf16"] = r["peak_mb"] / base["peak_mb"]


def step_suite(kit: Path, work: Path, stub: bool, part: str) -> dict[str, Any]:
    out = work / f"suite-{part}"
    skip = ",".join(p for p in ALL_SUITE if p != part)
    cmd = [sys.executable, str(HERE / "gpu_suite.py"), "--skip", skip, "--out", str(out)]
    if stub:
        cmd += ["--device", "cpu"]
    subprocess.run(cmd, check=True)
    data = json.loads((out / "gpu_suite.json").read_text())
    return {
        "suite": {k: v for k, v in data.items() if k not in ("bars",)},
        "bars": data.get("bars", []),
        "markdown": (out / "gpu_suite.md").read_text(),
    }


def run_step(name: str, kit: Path, work: Path, stub: bool) -> None:
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "setup": lambda: step_setup(kit, work, stub),
        "smoke": lambda: step_smoke(kit, work, stub, 10),
        "fast": lambda: step_fast(kit, work, stub, 6),
        "salvage": lambda: step_salvage(work),
        **{p: (lambda p=p: step_suite(kit, work, stub, p)) for p in SUITE_PARTS},
    }
    result = steps[name]()
    _atomic(work / f"{name}.json", json.dumps(result, indent=1, default=str))


def summary(results: dict[str, Any]) -> str:
    steps = results["steps"]
    env = steps.get("setup", {}).get("environment", {})
    lines = [
        f"# GPU kit run: {env.get('device_name', '?')}"
        + (" (stub torchrun, Triton interpreter)" if results["stub"] else ""),
        "",
        f"python {env.get('python')}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"quantpatch {env.get('quantpatch')}, {env.get('cpus')} CPUs",
        "",
        "| step | state | seconds | budget |",
        "| --- | --- | ---: | ---: |",
    ]
    for name, e in steps.items():
        lines.append(f"| {name} | {e['state']} | {e['seconds']} | {e['budget']:.0f} |")
    smoke = steps.get("smoke", {})
    if smoke.get("markdown"):
        lines += ["", "## Smoke sweep (generated scripts, torchrun pretrain_gpt.py)", ""]
        lines += [smoke["markdown"]]
    fast = steps.get("fast", {})
    if fast.get("runs"):
        lines += [
            "",
            "## Fast-shaped step (llama32-1b, seq 4096, 1 GPU, global batch 8, mock data)",
            "",
            "| scheme | exit | step ms | vs bf16 | peak MB | vs bf16 | losses finite |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in fast["runs"]:
            lines.append(
                f"| {r['scheme']} | {r['exit']} | {_f(r.get('step_ms'), '.1f')} | "
                f"{_f(r.get('step_vs_bf16'), '.3f')} | {_f(r.get('peak_mb'), '.0f')} | "
                f"{_f(r.get('peak_vs_bf16'), '.3f')} | {r.get('losses_finite')} |"
            )
        lines += ["", *fast_bars(fast["runs"], judged=not results["stub"])]
    for part in SUITE_PARTS:
        e = steps.get(part, {})
        if e.get("markdown"):
            lines += ["", f"## gpu_suite: {part}", "", e["markdown"]]
    return "\n".join(lines) + "\n"


def fast_bars(rows: list[dict[str, Any]], judged: bool = True) -> list[str]:
    """The kit's per-step bars; a stub's figures are the stub's, judged by none."""
    by = {r["scheme"]: r for r in rows}
    out = []

    def bar(ok: bool | None, text: str) -> None:
        verdict = "unmeasured" if ok is None else "met" if ok else "MISSED"
        out.append(f"- {verdict if judged else 'not judged (stub)'}: {text}")

    lin, fa = by.get("FA_linear_mxfp8", {}), by.get("FA_mxfp8", {})
    r = lin.get("step_vs_bf16")
    bar(None if r is None else r <= 1.10, f"FA_linear_mxfp8 <= 1.10x bf16 per step ({_f(r)})")
    r = fa.get("step_vs_bf16")
    bar(None if r is None else r <= 1.05, f"FA_mxfp8 <= 1.05x bf16 per step ({_f(r)})")
    p = fa.get("peak_vs_bf16")
    bar(None if p is None else p < 1.0, f"FA_mxfp8 peak memory below bf16's ({_f(p)})")
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def run(
    kit: Path, out: Path, work: Path | None, stub: bool, scale: float, only: set[str] | None = None
) -> int:
    work = work or Path(tempfile.mkdtemp(prefix="qp-gpukit-"))
    r = Run(kit, out, work, stub, scale)
    r.results["kit"] = json.loads((kit / "kit.json").read_text())
    setup = r.step("setup", [])
    if setup["state"] != "ok":
        print(summary(r.results))
        return 1
    for name in ORDER[1:]:
        if only and name not in only:
            continue
        r.step(name, [])
    report = work / "smoke" / "all" / "sweep" / "report.html"
    if report.exists() and report.stat().st_size < 16 * 1024 * 1024:
        shutil.copyfile(report, out / "report.html")
    text = summary(r.results)
    print(text)
    return 0 if all(e["state"] == "ok" for e in r.results["steps"].values()) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="gather the kit (here, on CPU)")
    p.add_argument("--kit", type=Path, default=REPO / ".gpukit")
    p.add_argument("--megatron-lm", type=Path, required=True, help="git directory or tree")
    p.add_argument("--ref", default="core_v0.13.1")
    p.add_argument("--python-version", default="3.12", help="the device machine's Python")
    r = sub.add_parser("run", help="the steps, on the GPU machine (gpu_run.sh starts it)")
    r.add_argument("--kit", type=Path, default=REPO / ".gpukit")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-kit-out"))
    r.add_argument("--work", type=Path, help="working folder (default: a new temporary one)")
    r.add_argument("--stub", action="store_true", help="CPU: stub torchrun, Triton interpreter")
    r.add_argument("--budget-scale", type=float, default=1.0, help="multiply every budget")
    r.add_argument("--only", default="", help="comma list of steps after setup (default: all)")
    s = sub.add_parser("step", help=argparse.SUPPRESS)
    s.add_argument("name", choices=sorted(BUDGETS))
    s.add_argument("--kit", type=Path, required=True)
    s.add_argument("--work", type=Path, required=True)
    s.add_argument("--stub", action="store_true")
    args = ap.parse_args()
    if args.cmd == "prepare":
        m = prepare(args.kit.resolve(), args.megatron_lm, args.ref, args.python_version)
        total = m["kit_bytes"] + m["working_tree_bytes"]
        print(json.dumps(m, indent=1))
        print(
            f"kit {m['kit_bytes'] / 2**20:.1f} MiB + working tree "
            f"{m['working_tree_bytes'] / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of the device "
            f"tool's {DEVICE_LIMIT / 2**20:.0f} MiB"
        )
        if total > DEVICE_LIMIT:
            raise SystemExit("the kit and the working tree exceed what the device tool carries")
        print("the device call (tool `run`):")
        print(run_call(args.kit.resolve()))
    elif args.cmd == "run":
        if args.stub:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        only = set(filter(None, args.only.split(","))) or None
        raise SystemExit(run(args.kit, args.out, args.work, args.stub, args.budget_scale, only))
    else:
        if args.stub:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        run_step(args.name, args.kit, args.work, args.stub)


if __name__ == "__main__":
    main()
