"""A sweep on Slurm: one job array of the runs that are not finished, followed through Slurm.

``submit`` hands ``DIR/sweep.sbatch`` to ``sbatch`` with ``--array`` naming exactly the runs to
do (array task *i* is the sweep's *i*-th run, in every array of the sweep) and the tasks' output
under ``DIR/slurm/`` (never the checkout, which is the job's working directory). ``refresh``
asks Slurm how each submitted run stands (``sacct``; where accounting is off or forgot the job,
``squeue`` and ``scontrol show job``; last, the task's own output) and writes what it learns
into the record as a local run's: state, exit code, start and end (Slurm's), log and the
source commit the log names. ``cancel`` scancels the tasks still pending or running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from quantpatch.base.errors import UserError
from quantpatch.launch.sweep_record import RunState, SweepRecord, SweepRun

OUTPUT_DIR = "slurm"
_FINISHED = ("COMPLETED",)
_FAILED = ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE")
_INTERRUPTED = ("CANCELLED", "PREEMPTED", "REVOKED")
_PENDING = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SUSPENDED")
_RUNNING = ("RUNNING", "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT")
_COMMIT = re.compile(r"\[quantpatch\] source commit ([0-9a-f]{40})")
_EXITED = re.compile(r"\[quantpatch\] training exited with status ([0-9]+)")
_GPU_WORDS = ("gres", "gpu", "tres")


_STATES = (
    (_FINISHED, RunState.FINISHED),
    (_FAILED, RunState.FAILED),
    (_INTERRUPTED, RunState.INTERRUPTED),
    (_RUNNING, RunState.RUNNING),
    (_PENDING, RunState.PENDING),
)


def state_of(slurm_state: str) -> RunState:
    """quantpatch's state for Slurm's (``CANCELLED by 0`` reads as ``CANCELLED``)."""
    word = slurm_state.split()[0].rstrip("+") if slurm_state.strip() else ""
    for words, state in _STATES:
        if word in words:
            return state
    return RunState.SUBMITTED


@dataclass
class Task:
    """One array task as Slurm reports it."""

    state: str
    exit_code: int | None = None
    start: str | None = None
    end: str | None = None
    job_id: str | None = None
    """The task's own job id (``JobIDRaw``): the run's log is named after it."""
    source: str = "sacct"


def sbatch_exe() -> str:
    exe = shutil.which("sbatch")
    if exe is None:
        raise UserError(
            "sbatch is not on PATH: submit a Slurm sweep from a machine where `sbatch --version` "
            "answers (a cluster's login node; where Slurm comes as a module, `module load slurm` "
            "first), or run the sweep on this machine's GPUs with --launcher local instead "
            "of --launcher slurm."
        )
    return exe


def _time(text: str) -> str | None:
    """Slurm's local time (``2026-11-27T12:03:04``) as an ISO time in UTC; None for
    ``Unknown`` / ``None``."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    return moment.astimezone(timezone.utc).isoformat(timespec="seconds")


def _exit(text: str) -> int | None:
    """``3:0`` (code:signal) as the script's exit code; a signal as its negative, as Python
    reports a process a signal ended."""
    m = re.fullmatch(r"\s*([0-9]+):([0-9]+)\s*", text)
    if m is None:
        return None
    return -int(m[2]) if int(m[2]) else int(m[1])


def _run(cmd: Sequence[str]) -> str | None:
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        res = subprocess.run(
            [exe, *cmd[1:]],
            capture_output=True,
            text=True,
            errors="replace",  # Slurm prints names and reasons as they were given
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def _sacct(jobs: Sequence[str]) -> dict[tuple[str, int], Task]:
    fields = "JobID,JobIDRaw,State,ExitCode,Start,End"
    text = _run(["sacct", "-n", "-P", "-X", "-j", ",".join(jobs), "-o", fields])
    found: dict[tuple[str, int], Task] = {}
    for line in (text or "").splitlines():
        parts = line.split("|")
        if len(parts) != 6:
            continue
        m = re.fullmatch(r"([0-9]+)_([0-9]+)", parts[0].strip())
        if m is None:
            continue
        found[(m[1], int(m[2]))] = Task(
            parts[2].strip(), _exit(parts[3]), _time(parts[4]), _time(parts[5]), parts[1].strip()
        )
    return found


def parse_squeue(text: str) -> dict[tuple[str, int], Task]:
    """``squeue -h -r -o '%i|%T|%A|%S'``: each array task's state, own job id and start
    (``N/A`` before it starts), so a task's first status already says when it started."""
    found: dict[tuple[str, int], Task] = {}
    for line in text.splitlines():
        parts = line.split("|")
        m = re.fullmatch(r"([0-9]+)_([0-9]+)", parts[0].strip()) if len(parts) in (3, 4) else None
        if m is not None:
            state = parts[1].strip()
            start = _time(parts[3]) if len(parts) == 4 and state_of(state) == "running" else None
            found[(m[1], int(m[2]))] = Task(
                state, start=start, job_id=parts[2].strip(), source="squeue"
            )
    return found


def _squeue(jobs: Sequence[str]) -> dict[tuple[str, int], Task]:
    text = _run(["squeue", "-h", "-r", "-j", ",".join(jobs), "-o", "%i|%T|%A|%S"])
    return parse_squeue(text or "")


def _scontrol(jobs: Sequence[str]) -> dict[tuple[str, int], Task]:
    found: dict[tuple[str, int], Task] = {}
    for job in jobs:
        for line in (_run(["scontrol", "show", "job", "-o", job]) or "").splitlines():
            kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
            array, task = kv.get("ArrayJobId"), kv.get("ArrayTaskId", "")
            if array != job or not task.isdigit():
                continue
            found[(job, int(task))] = Task(
                kv.get("JobState", ""),
                _exit(kv.get("ExitCode", "")),
                _time(kv.get("StartTime", "")),
                _time(kv.get("EndTime", "")),
                kv.get("JobId"),
                "scontrol",
            )
    return found


def output_file(sweep_dir: Path, job: str, task: int) -> Path:
    return sweep_dir / OUTPUT_DIR / f"{job}_{task}.out"


def _from_output(sweep_dir: Path, job: str, task: int) -> Task | None:
    """Where Slurm no longer knows the task: its output says how training ended."""
    path = output_file(sweep_dir, job, task)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = _EXITED.search(text)
    if m is None:
        return None
    code = int(m[1])
    end = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    return Task(
        "COMPLETED" if code == 0 else "FAILED",
        code,
        end=end.isoformat(timespec="seconds"),
        source="output",
    )


def query(sweep_dir: Path, tasks: Sequence[tuple[str, int]]) -> dict[tuple[str, int], Task]:
    """Slurm's word on each (array job, task): sacct, then squeue and scontrol for what
    accounting does not hold, then the task's output file."""
    found: dict[tuple[str, int], Task] = {}
    for ask in (_sacct, _squeue, _scontrol):
        missing = sorted({job for job, task in tasks if (job, task) not in found})
        if not missing:
            break
        for key, value in ask(missing).items():
            found.setdefault(key, value)
    for job, task in tasks:
        if (job, task) not in found and (seen := _from_output(sweep_dir, job, task)):
            found[(job, task)] = seen
    return found


def _log_of(sweep_dir: Path, run: SweepRun, task: Task) -> Path | None:
    logs = sweep_dir / (run.folder or f"runs/{run.name}") / "logs"
    if task.job_id:
        named = sorted(logs.glob(f"*_job{task.job_id}.log"))
        if named:
            return named[-1]
    return None


def _commit_of(*paths: Path | None) -> str | None:
    for path in paths:
        if path is None:
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")[:65536]
        except OSError:
            continue
        if m := _COMMIT.search(text):
            return m[1]
    return None


def refresh(sweep_dir: Path, record: SweepRecord) -> bool:
    """Bring the record's submitted runs up to Slurm's word; True where anything changed (the
    caller saves)."""
    follow = [r for r in record.runs if r.is_slurm_live and isinstance(r.array_task, int)]
    if not follow:
        return False
    seen = query(sweep_dir, [(str(r.slurm_job), int(r.array_task or 0)) for r in follow])
    changed = False
    for run in follow:
        job, index = str(run.slurm_job), int(run.array_task or 0)
        task = seen.get((job, index))
        if task is None:
            continue
        before = run.as_dict()
        state = state_of(task.state)
        run.update(slurm_state=task.state, state=state)
        if task.start:
            run.update(started=task.start)
        out = output_file(sweep_dir, job, index)
        if state.ended:
            run.update(
                exit_code=task.exit_code,
                ended=task.end,
                reason=None if state is RunState.FINISHED else task.state,
            )
        log = _log_of(sweep_dir, run, task)
        if log is not None:
            run.update(log=log.relative_to(sweep_dir).as_posix())  # the sweep folder's
        run.update(
            slurm_output=(
                out.relative_to(sweep_dir).as_posix() if out.is_file() else run.slurm_output
            )
        )
        run.update(commit=_commit_of(log, out) or run.commit)
        changed = changed or run.as_dict() != before
    return changed


@dataclass
class Submitted:
    job: str
    runs: list[str]


def _gpu_hint(message: str, gpu_request: str) -> str:
    if not any(w in message.lower() for w in _GPU_WORDS):
        return ""
    asked = {"gres": "--gres=gpu:N", "none": "no GPUs"}.get(gpu_request, "--gpus-per-node=N")
    return (
        f" (the scripts ask for {asked}: gpu_request in the [slurm] table of --config changes "
        "that, to gpus-per-node, gres, or none for a CPU partition)"
    )


def _refusal_hint(
    said: str,
    gpu_request: str,
    record: SweepRecord,
    partition: str | None,
    script: Path | None = None,
) -> str:
    """What to change: the node layout for sbatch's node-configuration refusal (with what
    the partition's nodes have, and the values that fit), the GPU request for a refusal that
    names GPUs."""
    from quantpatch.launch import slurm_nodes

    if "node configuration" in said.lower():
        text = script.read_text(encoding="utf-8", errors="replace") if script else ""
        cpus = re.search(r"^#SBATCH --cpus-per-task=([0-9]+)$", text, re.M)
        return slurm_nodes.sbatch_hint(
            said,
            record.gpus_per_node,
            record.nodes,
            slurm_nodes.query(partition),
            profile=record.selection.profile,
            cpus=int(cpus[1]) if cpus else None,
            gpu_request=gpu_request,
            gpu_partitions=slurm_nodes.gpu_partitions(),
        )
    return _gpu_hint(said, gpu_request)


def submit(
    sweep_dir: Path,
    record: SweepRecord,
    *,
    throttle: int,
    gpu_request: str,
    quantpatch_exe: str,
    partition: str | None = None,
) -> Submitted | None:
    """One job array of the record's pending runs (None where there is none); the record is
    updated, not saved."""
    todo = [
        i for i, r in enumerate(record.runs) if r.state is RunState.PENDING and not r.is_slurm_live
    ]
    if not todo:
        return None
    sbatch = sbatch_exe()
    here = sweep_dir.resolve()
    (here / OUTPUT_DIR).mkdir(parents=True, exist_ok=True)
    checkout = record.checkout
    from quantpatch.launch import script_env
    from quantpatch.launch.data_check import data_vars

    # sbatch --export=ALL hands the tasks this environment: the sweep's, not the shell's
    # (the scripts take the allocation from Slurm; launch.script_env)
    env, passed = script_env.for_runs(
        os.environ,
        {
            **data_vars(record.data_env),
            "OUTPUT_ROOT": str(here / "runs"),
            "MEGATRON_ROOT": checkout,
            "QUANTPATCH": quantpatch_exe,
        },
    )
    res = subprocess.run(
        [
            sbatch,
            "--parsable",
            f"--chdir={checkout}",
            f"--output={here / OUTPUT_DIR}/%A_%a.out",
            f"--array={','.join(map(str, todo))}%{throttle}",
            "--export=ALL",
            str(here / "sweep.sbatch"),
        ],
        capture_output=True,
        text=True,
        errors="replace",
        check=False,
        env=env,
    )
    job = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not re.fullmatch(r"[0-9]+", job):
        said = " ".join((res.stderr or res.stdout).split()) or f"exit status {res.returncode}"
        said = re.sub(r"^sbatch: error: ", "", said).rstrip(".")
        hint = _refusal_hint(said, gpu_request, record, partition, here / "sweep.sbatch")
        raise UserError(f"sbatch refused the sweep: {said}{hint}.")
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record.slurm_job = job
    names = []
    for i in todo:
        run = record.runs[i]
        run.update(
            state=RunState.SUBMITTED,
            slurm_job=job,
            array_task=i,
            slurm_state=None,
            submitted=stamp,
            started=None,
            ended=None,
            exit_code=None,
            reason=None,
            log=None,
            commit=None,
            slurm_output=None,
            env=passed,
        )
        names.append(run.name)
    return Submitted(job, names)


def cancel(sweep_dir: Path, record: SweepRecord) -> list[str]:
    """scancel every task of the sweep that is pending or running; those runs recorded
    interrupted (the record updated, not saved). The names cancelled."""
    runs = [r for r in record.runs if r.is_slurm_live]
    if not runs:
        return []
    exe = shutil.which("scancel")
    if exe is None:
        raise UserError("scancel is not on PATH: cancel the sweep from a machine with Slurm.")
    ids = [f"{r.slurm_job}_{r.array_task}" for r in runs]
    res = subprocess.run([exe, *ids], capture_output=True, text=True, errors="replace", check=False)
    if res.returncode != 0:
        said = " ".join((res.stderr or res.stdout).split()) or f"exit status {res.returncode}"
        raise UserError(f"scancel refused to cancel {', '.join(ids)}: {said}.")
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for run in runs:
        run.update(
            state=RunState.INTERRUPTED, slurm_state="CANCELLED", reason="CANCELLED", ended=stamp
        )
    return [r.name for r in runs]
