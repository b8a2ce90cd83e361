"""``quantpatch sweep``: from a checkout to a finished comparison of every selected scheme.

``run`` generates the launch scripts into the sweep's folder (as ``gen-scripts`` does),
prepares every scheme's worktree, then either runs the combinations on this machine as a
queue (``--parallel N`` at once, each on its own ``CUDA_VISIBLE_DEVICES`` slice) or submits the
folder's ``sweep.sbatch`` as one Slurm job array of the runs to do (quantpatch.launch.slurm).
``DIR/sweep.json`` records the sweep; it is replaced atomically after every change, so a sweep
killed at any moment leaves it readable, and ``run`` again resumes it: finished runs are kept
(unless their scheme branch moved since), failed and interrupted ones run again, and runs still
pending or running in Slurm are left to it. ``status`` reads the record (a Slurm sweep's
brought up to Slurm's word first); ``cancel`` scancels a Slurm sweep's live runs; ``report``
writes one HTML report over exactly the sweep's runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from quantpatch.base import faults
from quantpatch.base.errors import UserError
from quantpatch.launch import script_env, slurm
from quantpatch.launch.attention import check_choice
from quantpatch.launch.data_check import DATA_VARS, data_vars
from quantpatch.launch.sweep_record import (
    LAUNCHERS,
    READS,
    RECORD,
    STATES,
    VERSION,
    CheckedData,
    Layout,
    MadeFrom,
    Manifest,
    Provenance,
    RunState,
    Selection,
    SweepData,
    SweepRecord,
    SweepRun,
    at,
    load,
    record_path,
    save,
    stored,
)

__all__ = [
    "LAUNCHERS",
    "READS",
    "RECORD",
    "STATES",
    "VERSION",
    "RunState",
    "Selection",
    "SweepRecord",
    "SweepRun",
    "at",
    "load",
    "record_path",
    "save",
    "stored",
]

STOP_GRACE_S = 10.0
"""How long a stopped run's processes get between SIGTERM and SIGKILL."""
_COMMIT = re.compile(r"\[quantpatch\] source commit ([0-9a-f]{40})")
FIRST_SEED = 1234
"""Megatron's default ``--seed``: a sweep's first seed (``--seeds N``: this and the next N-1)."""
MAX_SEEDS = 32


def selection_for(record: SweepRecord | None, given: Mapping[str, Any]) -> Selection | None:
    """The selection a ``sweep run`` asks for: the recorded one with the options given over it
    (a new sweep: the defaults under them); None resumes the record as it is."""
    chosen = {k: v for k, v in given.items() if v is not None}
    if not chosen and record is not None:
        return None
    base = (record.selection if record else Selection()).as_dict()
    return Selection.from_dict({**base, **chosen})


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def counts(record: SweepRecord) -> dict[str, int]:
    return record.counts()


def detect_gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists, or one (``0``) where it is not there."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ["0"]
    res = subprocess.run([exe, "-L"], capture_output=True, text=True, errors="replace", check=False)
    found = [line for line in res.stdout.splitlines() if line.startswith("GPU ")]
    return [str(i) for i in range(len(found))] or ["0"]


def parse_gpus(text: str | None) -> list[str] | None:
    if text is None:
        return None
    gpus = [g.strip() for g in text.split(",")]
    if not gpus or any(not re.fullmatch(r"[0-9]{1,4}", g) for g in gpus):
        raise UserError(
            f"--gpus must be GPU indices separated by commas, e.g. 0,1,2,3 (got {text!r})."
        )
    if len(set(gpus)) != len(gpus):
        raise UserError(f"--gpus names a GPU twice ({text!r}).")
    return gpus


@dataclass
class Prepared:
    record: SweepRecord
    notes: list[str]
    per_run_gpus: int


def prepare(
    sweep_dir: Path,
    repo: Path | None,
    given: Selection | None,
    *,
    only_pending: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Prepared:
    """The scripts written, every scheme's worktree made ready, and the record that says what
    is to run: a new sweep from ``given``, or the recorded one resumed (``given`` None)."""
    from quantpatch.git import repo as gitrepo
    from quantpatch.launch.scripts import quantpatch_command

    old = load(sweep_dir)
    selection = _selection_of(sweep_dir, old, given)
    checkout = gitrepo.find_checkout(repo, need_git=True)
    _refuse_live_runs(old)
    if selection.launcher == "slurm":
        slurm.sbatch_exe()
    quantpatch_command()  # the runs call quantpatch back: refused before anything is written
    if old is not None:
        _follow_slurm(sweep_dir, old, selection if given is not None else None)
    env = data_env(old.data if old else None, os.environ)
    checked = _refuse_missing_data(selection, {**os.environ, **env})
    mock = _mock_data(selection, {**os.environ, **env})
    _refuse_older_runtime(checkout, selection)
    if selection.launcher == "local":
        _refuse_unrunnable_local(selection)
    scripts, release = _scripts(sweep_dir, checkout.root, selection)
    made = provenance_of(checkout, selection, scripts, release)
    layout = scripts[0].layout if scripts else None
    per_run = layout.plan.gpus_per_node if layout is not None else 1
    if selection.launcher == "local" and layout is not None and layout.plan.nodes > 1:
        raise UserError(
            f"the {selection.profile} profile runs on {layout.plan.nodes} nodes; a local sweep "
            "runs on this machine only (use --launcher slurm)."
        )
    commits = _worktree_commits(checkout.root, scripts, progress)
    plan = Resume(
        previous={r.name: r for r in (old.runs if old else [])},
        selection=selection,
        repo=checkout.repo,
        only_pending=only_pending,
    )
    runs = [
        plan.run(_new_run(s, seed), commits[_values_key(s)])
        for s in scripts
        for seed in seeds_of(selection)
    ]
    checkout.close()  # its git processes: none left open for the sweep's runs
    record = SweepRecord(
        checkout=str(checkout.root),
        launcher=selection.launcher,
        selection=selection,
        slurm_job=old.slurm_job if old else None,
        created=(old.created if old else None) or now(),
        layout=_asked_layout(scripts),
        attention=scripts[0].attention.as_dict() if scripts and scripts[0].attention else None,
        provenance=made,
        data=SweepData(env=env, mock=mock, checked=[_checked_facts(n) for n in checked]),
        runs=runs,
    )
    if selection.launcher == "local":
        save(sweep_dir, record)  # a Slurm sweep's is saved once sbatch took the array
    return Prepared(record, plan.notes, per_run)


def _selection_of(sweep_dir: Path, old: SweepRecord | None, given: Selection | None) -> Selection:
    """The selection to run (the given one, else the recorded one), checked."""
    selection = given if given is not None else old.selection if old is not None else None
    if selection is None:
        raise UserError(
            f"{sweep_dir} holds no {RECORD}: give the sweep's selection (--models, "
            "--datasets, --schemes, --profile) to start one."
        )
    if selection.launcher not in LAUNCHERS:
        raise UserError(
            f"--launcher: unknown launcher '{selection.launcher}'; valid: {', '.join(LAUNCHERS)}."
        )
    check_choice(selection.attention)
    if not 1 <= selection.parallel <= 64:
        raise UserError(f"--parallel must be from 1 to 64 (got {selection.parallel}).")
    _check_seeds(selection)
    return selection


def _scripts(sweep_dir: Path, root: Path, selection: Selection) -> tuple[list[Any], str]:
    """The selection's launch scripts written into the sweep's folder (as ``gen-scripts``),
    and the checkout's Megatron release."""
    from quantpatch.launch.plan import GenRequest, generate_scripts

    local = selection.launcher == "local"
    done = generate_scripts(
        GenRequest(
            out=sweep_dir,
            models=selection.models,
            datasets=selection.datasets,
            schemes=selection.schemes,
            profile=selection.profile,
            launcher="torchrun" if local else "slurm",
            parallel={"gpus_per_node": selection.gpus_per_node, "nodes": selection.nodes},
            config=selection.config_path,
            repo=root,
            refuse_blocked=True,
            slurm_nodes=None if local else "refuse",
            attention=selection.attention,
            gpus=(selection.gpus or []) if local else None,
        )
    )
    return list(done.result.scripts), done.flags.release


def _asked_layout(scripts: Sequence[Any]) -> Layout | None:
    from quantpatch.launch.plan import requested_nodes

    asked = requested_nodes(scripts)
    return Layout(gpus_per_node=asked[0], nodes=asked[1]) if asked else None


def _values_key(script: Any) -> str:
    return json.dumps(script.scheme.values(), sort_keys=True)


def _worktree_commits(
    root: Path, scripts: Sequence[Any], progress: Callable[[str], None] | None
) -> dict[str, str]:
    """Each scheme's worktree made ready: its commit, by the scheme's values."""
    from quantpatch.checkout.worktrees import ensure_worktree

    commits: dict[str, str] = {}
    for s in scripts:
        key = _values_key(s)
        if key not in commits:
            result = ensure_worktree(root, s.scheme.values())
            commits[key] = result.commit
            if progress is not None:
                progress(f"worktree {result.branch} at {result.commit[:10]}")
    return commits


def _new_run(script: Any, seed: int | None) -> SweepRun:
    """A pending run of the script (with its seed)."""
    s = script
    base_name = f"{s.model}_{s.dataset}_{s.scheme.name}_{s.profile}"
    first = seed is None or seed == FIRST_SEED
    return SweepRun(
        name=base_name if first else f"{base_name}_seed{seed}",
        seed=seed,
        # where its script's RUN_NAME folder goes (OUTPUT_ROOT): another seed's apart
        folder=f"runs/{base_name}" if first else f"runs/seed{seed}/{base_name}",
        model=s.model,
        dataset=s.dataset,
        scheme=s.scheme.name,
        args=s.scheme.argv(),  # the scheme's own Megatron arguments, in its argv
        profile=s.profile,
        script=s.rel,
        state=RunState.PENDING,
        attention=s.attention.path if s.attention is not None else None,
    )


@dataclass
class Resume:
    """What an earlier record's runs keep when the sweep runs again, and why one runs again."""

    previous: dict[str, SweepRun]
    selection: Selection
    repo: Any
    only_pending: bool
    notes: list[str] = field(default_factory=list)

    def run(self, run: SweepRun, commit: str) -> SweepRun:
        """``run`` as the sweep is to run it: the earlier one kept where it still stands."""
        before = self.previous.get(run.name)
        if before is None:
            return run
        if before.is_slurm_live:
            return before.copy()  # Slurm's still: followed, never submitted again
        if before.state is RunState.FAILED and self.only_pending:
            return run.merged(before)
        if before.state is not RunState.FINISHED:
            return run
        # the same attention path as the others, or the comparison is of kernels (a run
        # recorded before the path was: kept, its log says which it took)
        if before.attention not in (run.attention, None):
            self.notes.append(
                f"{run.name}: running it again, its attention path is {run.attention} now "
                f"(--attention {self.selection.attention}), it ran on {before.attention}"
            )
            return run
        # (a finished Slurm run whose log named no commit: kept, nothing says it moved)
        if before.commit in (commit, None):
            return run.merged(before, attention=run.attention)
        upgraded = _upgrade_between(self.repo, before.commit, commit)
        self.notes.append(
            f"{run.name}: running it again, its scheme branch moved from "
            f"{str(before.commit)[:10]} to {commit[:10]} since it finished"
            + (
                f" (its source changed with 'quantpatch upgrade' at {upgraded[:10]})"
                if upgraded
                else ""
            )
        )
        return run


def _checked_facts(need: Any) -> CheckedData:
    return CheckedData(
        model=need.model,
        dataset=need.dataset,
        prefix=str(need.prefix),
        tokenizer=need.tokenizer,
        **manifest_facts(need.prefix),
    )


def manifest_facts(prefix: Path) -> CheckedData:
    """What the dataset's manifest says of it, for the report: documents, tokens, the files'
    sha256 (``data prepare``), the tokenizer's fingerprint and vocabulary size."""
    from quantpatch.data_prep.layout import read_manifest

    manifest = read_manifest(prefix) or {}
    tok = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else {}
    assert isinstance(tok, dict)
    return CheckedData(
        manifest=Manifest(
            documents=manifest.get("documents"),
            tokens=manifest.get("tokens"),
            sha256=manifest.get("sha256"),
            made_with=tok.get("name"),
            tokenizer_hash=tok.get("hash"),
            vocab_size=tok.get("vocab_size"),
        )
        if manifest
        else None
    )


def provenance_of(
    checkout: Any, selection: Selection, scripts: Sequence[Any], release: str
) -> Provenance:
    """What the report says the runs were made from, as ``sweep run`` found it: quantpatch's
    version, the checkout's Megatron release (its own argument parser's) and base commit, and
    each model's resolved pretrain_gpt.py arguments under the profile (``-- EXTRA`` after)."""
    from quantpatch import __version__
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import resolved_args

    reg = load_registry(Path(selection.config) if selection.config else None)
    base = MadeFrom(commit=None, branch=None)
    repo = checkout.repo
    if repo is not None:
        with suppress(ValueError, TypeError):  # a repository without commits, a detached head
            base["commit"] = str(repo.head.commit.hexsha)
            base["branch"] = None if repo.head.is_detached else str(repo.active_branch.name)
    models = sorted({s.model for s in scripts})
    return Provenance(
        quantpatch=__version__,
        megatron=release,
        base=base,
        args={
            m: {k: v for k, v in resolved_args(reg, m, selection.profile).items()}
            for m in models
            if m in reg.models and selection.profile in reg.profiles
        },
    )


def seeds_of(selection: Selection) -> list[int | None]:
    """Each combination's seeds: None (the script's own, Megatron's default) for one run,
    else ``FIRST_SEED`` and the next ``seeds - 1``."""
    if selection.seeds <= 1:
        return [None]
    return [FIRST_SEED + k for k in range(selection.seeds)]


def _check_seeds(selection: Selection) -> None:
    if not 1 <= selection.seeds <= MAX_SEEDS:
        raise UserError(f"--seeds must be from 1 to {MAX_SEEDS} (got {selection.seeds}).")
    if selection.seeds > 1 and any(
        a == "--seed" or a.startswith("--seed=") for a in selection.extra
    ):
        raise UserError(
            "--seeds gives each run its --seed: drop --seed from the arguments after --."
        )
    if selection.seeds > 1 and selection.launcher != "local":
        raise UserError(
            "--seeds runs on the local launcher only (a Slurm job array runs each script once); "
            "give --launcher local, or one seed."
        )


def run_folder(sweep_dir: Path, run: SweepRun) -> Path:
    """The run's folder (logs, checkpoints, tensors): ``runs/<name>``, another seed's
    ``runs/seed<N>/<name>`` (a record made before seeds: ``runs/<name>``)."""
    return at(sweep_dir, run.folder or f"runs/{run.name}")


def _refuse_unrunnable_local(selection: Selection) -> None:
    """A local sweep that could never start a run (more GPUs a run than this machine has,
    or several nodes), refused before a script, a worktree or a record is written."""
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import plan_layout

    reg = load_registry(Path(selection.config) if selection.config else None)
    if selection.profile not in reg.profiles:
        return  # the script generation refuses it with its own sentence
    models = reg.pick("models", selection.models)
    sizes = {"gpus_per_node": selection.gpus_per_node, "nodes": selection.nodes}
    layouts = plan_layout(reg, models, selection.profile, sizes)
    nodes = max(layout.plan.nodes for layout in layouts.values())
    if nodes > 1:
        raise UserError(
            f"the {selection.profile} profile runs on {nodes} nodes; a local sweep runs on "
            "this machine only (use --launcher slurm)."
        )
    local_gpus(selection, max(layout.plan.gpus_per_node for layout in layouts.values()))


def local_gpus(selection: Selection, per_run: int) -> list[str]:
    """The GPUs a local sweep shares among its runs (``--gpus``, else the machine's), refused
    in one sentence where a run needs more than there are."""
    gpus = selection.gpus or detect_gpus()
    if per_run > len(gpus):
        raise UserError(
            f"each run needs {per_run} GPUs (the {selection.profile} profile's GPUS_PER_NODE"
            f"{', --gpus-per-node' if selection.gpus_per_node else ''}) and this machine has "
            f"{len(gpus)} ({','.join(gpus)}); name more with --gpus, or give --gpus-per-node "
            f"{len(gpus)}."
        )
    return gpus


def _follow_slurm(sweep_dir: Path, old: SweepRecord, asked: Selection | None) -> None:
    """The old record brought up to Slurm's word (saved); a different selection refused while
    any of its runs is still pending or running in Slurm."""
    if slurm.refresh(sweep_dir, old):
        save(sweep_dir, old)
    live = [r for r in old.runs if r.is_slurm_live]
    if live and asked is not None and asked != old.selection:
        jobs = ", ".join(sorted({str(r.slurm_job) for r in live}))
        raise UserError(
            f"{sweep_dir} still has {len(live)} run(s) pending or running in Slurm (job array "
            f"{jobs}), so it cannot take a different selection now; wait for them, or `quantpatch "
            f"sweep cancel {sweep_dir}`, or give a new folder."
        )


UPGRADE_MESSAGE = "quantpatch upgrade:"
"""How ``quantpatch upgrade`` begins its commit message (``quantpatch.checkout.upgrade``)."""


def _upgrade_between(repo: Any, old: object, new: str) -> str | None:
    """The ``quantpatch upgrade`` commit among those a run's source moved over (from ``old``,
    a scheme branch's commit or, for a scheme whose values are the base's, the base tip, to
    ``new``), None where there is none or the old commit is gone."""
    if repo is None or not isinstance(old, str):
        return None
    from git import GitCommandError

    try:
        for c in repo.iter_commits(f"{old}..{new}"):
            if str(c.message).startswith(UPGRADE_MESSAGE):
                return str(c.hexsha)
    except (GitCommandError, ValueError):  # a commit git no longer has, or no parent
        return None
    return None


def data_env(recorded: Mapping[str, Any] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The data variables a sweep's runs get and its record keeps: the environment's, else
    the ones the sweep recorded when it started (a resume from a new shell needs no export
    again). Folders and prefixes are made absolute: the runs start in the checkout."""
    saved = (recorded or {}).get("env") or {}
    out: dict[str, str] = {}
    for key in DATA_VARS:
        value = environ.get(key) or saved.get(key)
        if not value:
            continue
        if key in ("DATA_ROOT", "DATA_PREFIX") or (
            key == "TOKENIZER_MODEL" and Path(value).is_dir()
        ):
            value = os.path.abspath(value)
        out[key] = str(value)
    return out


def _refuse_missing_data(selection: Selection, env: Mapping[str, str]) -> list[Any]:
    """Every combination's dataset (and its manifest's tokenizer) checked before a script is
    written or a worktree made: a sweep over missing data starts and submits nothing. What
    was checked (``data_prep.layout.Need``)."""
    from quantpatch.launch.data_check import refuse_missing

    return refuse_missing(
        Path(selection.config) if selection.config else None,
        selection.models,
        selection.datasets,
        selection.profile,
        env,
    )


def _mock_data(selection: Selection, env: Mapping[str, str]) -> bool:
    """Whether the runs train on mock data, as their scripts decide it: ``MOCK_DATA`` from the
    environment, else the profile's default (smoke: 1), whatever ``DATA_ROOT`` says."""
    from quantpatch.launch.data_check import mock_data
    from quantpatch.launch.registry import load_registry

    reg = load_registry(Path(selection.config) if selection.config else None)
    return mock_data(reg, selection.profile, env)


def _refuse_older_runtime(checkout: Any, selection: Selection) -> None:
    """A checkout whose runtime cannot take the path the runs are to take (and the record
    would name): refused before anything is written (``launch.attention``)."""
    from quantpatch.launch.attention import attention_for, refuse_older_runtime
    from quantpatch.launch.registry import load_registry

    reg = load_registry(Path(selection.config) if selection.config else None)
    try:
        names = reg.pick("schemes", selection.schemes)
    except UserError:
        return  # the script generation refuses it with its own sentence
    picked = [reg.schemes[n] for n in names]
    refuse_older_runtime(checkout, attention_for(selection.attention, picked))


def group_alive(pgid: object) -> bool:
    """Whether a process of the group still runs (zombies, which an init that never reaps
    keeps, do not count); ``kill(-pgid, 0)`` where there is no ``/proc``."""
    if not isinstance(pgid, int) or pgid <= 0:
        return False
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = text[text.rindex(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _refuse_live_runs(record: SweepRecord | None) -> None:
    """A run recorded as running whose process group still lives (a sweep killed with
    SIGKILL leaves its children): refused, never started twice."""
    for run in record.runs if record else []:
        if run.state is RunState.RUNNING and group_alive(run.pid):
            raise UserError(
                f"{run.name} is still running (process group {run.pid}) from an earlier "
                f"sweep run; wait for it or stop it (kill -TERM -- -{run.pid}) first."
            )


class Interrupted(Exception):
    """Ctrl-C or SIGTERM stopped the sweep (its runs stopped and marked interrupted)."""


@contextmanager
def _stop_signals() -> Iterator[list[int]]:
    """SIGINT and SIGTERM set a flag the queue loop reads (handlers restored after)."""
    got: list[int] = []

    def handler(signum: int, frame: object) -> None:
        got.append(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each run's whole process group (the script, torchrun and its workers),
    SIGKILL to what is left after the grace period."""
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    # a script (the group's leader) may end before the rest of its group (torchrun and its
    # workers, still handling the SIGTERM): they get what is left of the grace period too
    while time.monotonic() < deadline and any(group_alive(p.pid) for p in procs):
        time.sleep(0.05)
    for p in procs:
        with suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _finish(run: SweepRun, sweep_dir: Path, code: int, started: float) -> None:
    logs = sorted(
        (p for p in (run_folder(sweep_dir, run) / "logs").glob("*.log")),
        key=lambda p: p.stat().st_mtime,
    )
    fresh = [p for p in logs if p.stat().st_mtime >= started - 1]
    log = fresh[-1] if fresh else None
    run.update(log=stored(sweep_dir, log) if log else None)
    if log is not None:
        found = _COMMIT.search(log.read_text(encoding="utf-8", errors="replace")[:65536])
        run.update(commit=found[1] if found else None)
    run.update(
        exit_code=code,
        state=RunState.FINISHED if code == 0 else RunState.FAILED,
        ended=now(),
        pid=None,
    )


def run_local(
    sweep_dir: Path,
    record: SweepRecord,
    per_run_gpus: int,
    on_change: Callable[[SweepRecord], None] | None = None,
    quantpatch_exe: str | None = None,
) -> SweepRecord:
    """Run the record's pending runs as a queue, ``parallel`` at once, each on its own slice
    of ``per_run_gpus`` GPUs; the record is saved after every change."""
    from quantpatch.launch.scripts import quantpatch_command

    sel = record.selection
    gpus = local_gpus(sel, per_run_gpus)  # prepare refused this already; the machine may differ
    slices = [
        gpus[i : i + per_run_gpus] for i in range(0, len(gpus) - per_run_gpus + 1, per_run_gpus)
    ]
    slots = min(sel.parallel, len(slices))
    free = list(range(len(slices)))
    queue = [r for r in record.runs if r.state in (RunState.PENDING, RunState.INTERRUPTED)]
    for r in queue:
        r.update(state=RunState.PENDING)
    active: dict[int, tuple[subprocess.Popen[bytes], SweepRun, float]] = {}
    checkout = Path(record.checkout)
    # what the sweep planned, whatever the shell exports (launch.script_env)
    env_base, passed = script_env.for_runs(
        os.environ,
        {
            **data_vars(record.data_env),
            "OUTPUT_ROOT": str(sweep_dir.resolve() / "runs"),
            "MEGATRON_ROOT": str(checkout),
            "QUANTPATCH": quantpatch_exe or quantpatch_command(),
            "GPUS_PER_NODE": str(per_run_gpus),
            "NNODES": "1",
        },
    )
    console = sweep_dir / "console"
    console.mkdir(parents=True, exist_ok=True)

    def changed() -> None:
        save(sweep_dir, record)
        if on_change is not None:
            on_change(record)

    with _stop_signals() as stop:
        try:
            while queue or active:
                if stop:
                    raise Interrupted
                while queue and len(active) < slots and free:
                    run = queue.pop(0)
                    slot = free.pop(0)
                    env = {
                        **env_base,
                        "CUDA_VISIBLE_DEVICES": ",".join(slices[slot]),
                        "OUTPUT_ROOT": str(run_folder(sweep_dir.resolve(), run).parent),
                    }
                    seed = ["--seed", str(run.seed)] if run.seed is not None else []
                    with (console / f"{run.name}.out").open("ab") as out:
                        proc = subprocess.Popen(
                            [
                                "bash",
                                str(sweep_dir.resolve() / run.script),
                                "--",
                                *sel.extra,
                                *seed,
                            ],
                            cwd=checkout,
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    started = time.time()
                    run.update(
                        state=RunState.RUNNING,
                        started=now(),
                        ended=None,
                        exit_code=None,
                        gpus=",".join(slices[slot]),
                        pid=proc.pid,
                        log=None,
                        commit=None,
                        env=passed,
                    )
                    active[slot] = (proc, run, started)
                    changed()
                    faults.pause("run started")  # tests hold the sweep here (inert otherwise)
                for slot, (proc, run, started) in list(active.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    del active[slot]
                    free.append(slot)
                    free.sort()
                    _finish(run, sweep_dir, code, started)
                    changed()
                time.sleep(0.1)
        except (Interrupted, KeyboardInterrupt):
            _stop([proc for proc, _, _ in active.values()])
            for proc, run, _ in active.values():
                run.update(
                    state=RunState.INTERRUPTED, exit_code=proc.returncode, ended=now(), pid=None
                )
            changed()
            raise Interrupted from None
    return record


def submit_slurm(
    sweep_dir: Path, record: SweepRecord, quantpatch_exe: str | None = None
) -> slurm.Submitted | None:
    """One job array of the record's runs that are to run (None where every run is finished
    or still Slurm's), from the checkout; the record saved once sbatch took it."""
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import quantpatch_command

    settings = load_registry(record.selection.config_path).slurm
    done = slurm.submit(
        sweep_dir,
        record,
        throttle=settings.throttle,
        gpu_request=settings.gpu_request,
        partition=settings.partition,
        quantpatch_exe=quantpatch_exe or os.environ.get("QUANTPATCH") or quantpatch_command(),
    )
    save(sweep_dir, record)
    return done


@dataclass
class Status:
    """How a sweep stands: its runs (a Slurm run's GPUs: its allocation's shape) and the
    number of runs in each state."""

    runs: list[SweepRun]
    counts: dict[str, int]
    launcher: str


def status(sweep_dir: Path) -> Status:
    """The record's runs, a Slurm sweep's brought up to Slurm's word first (and saved), and
    the counts."""
    record = load(sweep_dir)
    if record is None:
        raise UserError(f"{sweep_dir} holds no {RECORD}: not a sweep (start one with sweep run).")
    if slurm.refresh(sweep_dir, record):
        save(sweep_dir, record)
    runs = [r.copy() for r in record.runs]
    per = record.gpus_per_node
    for r in runs:  # a Slurm run's GPUs: its allocation's shape, as the scripts asked for it
        if not r.gpus and r.slurm_job and per:
            nodes = int(record.nodes or 1)
            r.update(
                gpus=f"{per} GPU{'s' if per != 1 else ''}"
                + (f" x {nodes} nodes" if nodes > 1 else "")
            )
    return Status(runs, record.counts(), record.launcher)


def cancel(sweep_dir: Path) -> list[str]:
    """scancel the sweep's runs that are pending or running in Slurm, recorded interrupted."""
    record = load(sweep_dir)
    if record is None:
        raise UserError(f"{sweep_dir} holds no {RECORD}: not a sweep (start one with sweep run).")
    slurm.refresh(sweep_dir, record)
    names = slurm.cancel(sweep_dir, record)
    save(sweep_dir, record)
    return names


def run_logs(sweep_dir: Path, record: SweepRecord) -> list[Path]:
    """Exactly the sweep's logs: each run's recorded log, else (Slurm) its run folder's."""
    out: list[Path] = []
    for run in record.runs:
        if run.log:
            out.append(at(sweep_dir, run.log))
            continue
        logs = sorted((run_folder(sweep_dir, run) / "logs").glob("*.log"))
        out.extend(logs[-1:])
    return [p for p in out if p.is_file()]


def tensor_dirs(sweep_dir: Path, record: SweepRecord) -> list[Path]:
    return [
        d
        for run in record.runs
        if (d := run_folder(sweep_dir, run) / "tensor_logs").is_dir() and any(d.rglob("*.pt"))
    ]
