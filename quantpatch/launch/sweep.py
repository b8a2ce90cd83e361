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
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from quantpatch.base import faults
from quantpatch.base.edits import shared_mode
from quantpatch.base.errors import UserError
from quantpatch.launch import script_env, slurm
from quantpatch.launch.attention import check_choice
from quantpatch.launch.data_check import DATA_VARS, data_vars

RECORD = "sweep.json"
VERSION = 2
"""2: the runs' logs relative to the sweep's folder (1 kept them relative to the directory
``sweep run`` ran in; read, and migrated on the first write)."""
READS = (1, 2)
STATES = ("pending", "running", "finished", "failed", "interrupted", "submitted")
LAUNCHERS = ("local", "slurm")
STOP_GRACE_S = 10.0
"""How long a stopped run's processes get between SIGTERM and SIGKILL."""
_COMMIT = re.compile(r"\[quantpatch\] source commit ([0-9a-f]{40})")
FIRST_SEED = 1234
"""Megatron's default ``--seed``: a sweep's first seed (``--seeds N``: this and the next N-1)."""
MAX_SEEDS = 32


@dataclass(frozen=True)
class Selection:
    """What a sweep was made with; ``run`` without options resumes it."""

    models: list[str] | None = None
    datasets: list[str] | None = None
    schemes: list[str] | None = None
    profile: str = "smoke"
    launcher: str = "local"
    parallel: int = 1
    gpus: list[str] | None = None
    config: str | None = None
    extra: list[str] = field(default_factory=list)
    gpus_per_node: int | None = None
    """Over the profile's (``--gpus-per-node``); None: the profile's."""
    nodes: int | None = None
    """Over the profile's (``--nodes``); None: the profile's."""
    attention: str = "auto"
    """The attention path of every run (``launch.attention``: auto, flash or stock)."""
    seeds: int = 1
    """Runs of each combination, with Megatron's ``--seed`` ``FIRST_SEED``, the next, ..."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "models": self.models,
            "datasets": self.datasets,
            "schemes": self.schemes,
            "profile": self.profile,
            "launcher": self.launcher,
            "parallel": self.parallel,
            "gpus": self.gpus,
            "config": self.config,
            "extra": self.extra,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "attention": self.attention,
            "seeds": self.seeds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Selection:
        known = cls().as_dict()
        return cls(**{k: data[k] for k in known if k in data})


def selection_for(record: Mapping[str, Any] | None, given: Mapping[str, Any]) -> Selection | None:
    """The selection a ``sweep run`` asks for: the recorded one with the options given over it
    (a new sweep: the defaults under them); None resumes the record as it is."""
    chosen = {k: v for k, v in given.items() if v is not None}
    if not chosen and record is not None:
        return None
    base = Selection.from_dict(record["selection"]).as_dict() if record else Selection().as_dict()
    return Selection.from_dict({**base, **chosen})


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def record_path(sweep_dir: Path) -> Path:
    return sweep_dir / RECORD


def load(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep's record, or None where there is none yet."""
    path = record_path(sweep_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror}).") from None
    try:
        data = json.loads(text)
    except ValueError:
        raise UserError(
            f"{path} is not a sweep record (not JSON); move it away to start a new sweep."
        ) from None
    if not isinstance(data, dict) or data.get("version") not in READS or "runs" not in data:
        raise UserError(
            f"{path} is not a version {VERSION} sweep record; move it away to start a new sweep."
        )
    why = _malformed(data)
    if why is not None:
        raise UserError(
            f"{path}: {why}, which quantpatch never writes (edited by hand?); put it back, or "
            "move the file away to start a new sweep."
        )
    return _migrated(sweep_dir, data)


def stored(sweep_dir: Path, path: Path) -> str:
    """How the record keeps a path: relative to the sweep's folder where it is inside it (the
    folder can be moved, and read from any directory), else absolute."""
    full = Path(os.path.abspath(path))
    try:
        return full.relative_to(os.path.abspath(sweep_dir)).as_posix()
    except ValueError:
        return str(full)


def at(sweep_dir: Path, value: str) -> Path:
    """A path the record keeps, for this process: relative ones are the sweep folder's."""
    path = Path(value)
    return path if path.is_absolute() else sweep_dir / path


def _migrated(sweep_dir: Path, data: dict[str, Any]) -> dict[str, Any]:
    """A record of an earlier version brought to this one's paths: each run's log (relative to
    wherever that ``sweep run`` ran, or absolute) found in its run folder and kept relative
    to the sweep's. Saved by the next write."""
    for run in data["runs"]:
        log = run.get("log") if isinstance(run, dict) else None
        if not isinstance(log, str) or not log:
            continue
        own = sweep_dir / "runs" / str(run.get("name")) / "logs" / Path(log).name  # no seeds
        if data.get("version") == 1 or Path(log).is_absolute():
            if own.is_file():
                run["log"] = stored(sweep_dir, own)
            elif Path(log).is_file():
                run["log"] = str(Path(log).resolve())
    data["version"] = VERSION
    return data


_STR = (str,)
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
_OPT_DICT = (dict, type(None))
_TOP: dict[str, tuple[type, ...]] = {
    "checkout": _STR,
    "launcher": _STR,
    "selection": (dict,),
    "slurm_job": _OPT_STR,
    "created": _OPT_STR,
    "layout": _OPT_DICT,
    "attention": _OPT_DICT,
    "data": _OPT_DICT,
    "provenance": _OPT_DICT,
    "runs": (list,),
}
_SELECTION: dict[str, tuple[type, ...]] = {
    "models": (list, type(None)),
    "datasets": (list, type(None)),
    "schemes": (list, type(None)),
    "profile": _STR,
    "launcher": _STR,
    "parallel": (int,),
    "gpus": (list, type(None)),
    "config": _OPT_STR,
    "extra": (list,),
    "gpus_per_node": _OPT_INT,
    "nodes": _OPT_INT,
    "attention": _STR,
    "seeds": (int,),
}
_RUN: dict[str, tuple[type, ...]] = {
    "name": _STR,
    "model": _STR,
    "dataset": _STR,
    "scheme": _STR,
    "args": (list, type(None)),
    "profile": _STR,
    "script": _STR,
    "state": _STR,
    "exit_code": _OPT_INT,
    "log": _OPT_STR,
    "commit": _OPT_STR,
    "started": _OPT_STR,
    "ended": _OPT_STR,
    "gpus": _OPT_STR,
    "array_task": _OPT_INT,
    "pid": _OPT_INT,
    "attention": _OPT_STR,
    "slurm_job": _OPT_STR,
    "slurm_state": _OPT_STR,
    "slurm_output": _OPT_STR,
    "reason": _OPT_STR,
    "env": _OPT_DICT,
    "seed": _OPT_INT,
    "folder": _OPT_STR,
}
_KINDS = {str: "a string", int: "an integer", list: "a list", dict: "a table"}


def _wrong(where: str, value: object, want: tuple[type, ...]) -> str | None:
    ok = isinstance(value, want) and not (isinstance(value, bool) and bool not in want)
    if ok:
        return None
    kinds = " or ".join(_KINDS.get(t, "null") for t in want)
    return f"{where} is {json.dumps(value)[:60]}, not {kinds}"


def _malformed(data: Mapping[str, Any]) -> str | None:
    """The first field of a sweep record that is not what quantpatch writes there (its
    name and value), or None: every reader of a record (run, status, report, cancel) meets
    a hand-edited one here, before any of it is used."""
    checks: list[tuple[str, object, tuple[type, ...]]] = [
        (k, data[k], want) for k, want in _TOP.items() if k in data
    ]
    selection = data.get("selection")
    if isinstance(selection, dict):
        checks += [
            (f"selection.{k}", v, _SELECTION[k]) for k, v in selection.items() if k in _SELECTION
        ]
    layout = data.get("layout")
    if isinstance(layout, dict):
        checks += [(f"layout.{k}", v, _OPT_INT) for k, v in layout.items()]
    found = data.get("data")
    if isinstance(found, dict):
        checks += [
            ("data.env", found.get("env"), _OPT_DICT),
            ("data.checked", found.get("checked"), (list, type(None))),
        ]
        if isinstance(found.get("env"), dict):
            checks += [(f"data.env.{k}", v, _STR) for k, v in found["env"].items()]
    runs = data.get("runs")
    for i, run in enumerate(runs if isinstance(runs, list) else []):
        if not isinstance(run, dict):
            checks.append((f"runs[{i}]", run, (dict,)))
            continue
        checks += [
            (f"runs[{i}].{k}", run.get(k), want)
            for k, want in _RUN.items()
            if k in run or k in ("name", "state", "script")
        ]
        if run.get("state") not in (*STATES, None) and isinstance(run.get("state"), str):
            return f"runs[{i}].state is {json.dumps(run['state'])}, not one of {', '.join(STATES)}"
    for where, value, want in checks:
        why = _wrong(where, value, want)
        if why is not None:
            return why
    lists = [
        (f"selection.{k}", v)
        for k, v in (data.get("selection") or {}).items()
        if k in ("models", "datasets", "schemes", "gpus", "extra") and isinstance(v, list)
    ]
    for where, value in lists:
        for item in value:
            if not isinstance(item, str):
                return f"{where} holds {json.dumps(item)[:60]}, not a string"
    if data.get("launcher") not in LAUNCHERS:
        return f"launcher is {json.dumps(data.get('launcher'))[:60]}, not one of local, slurm"
    return None


def save(sweep_dir: Path, record: Mapping[str, Any]) -> None:
    """Replace the record atomically (a new file, synced, renamed over the old one)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".sweep-", suffix=".json", dir=sweep_dir)
    try:
        os.fchmod(fd, shared_mode())  # colleagues read it: the umask's mode, not 0600
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, record_path(sweep_dir))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(sweep_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def counts(record: Mapping[str, Any]) -> dict[str, int]:
    out = dict.fromkeys(STATES, 0)
    for run in record["runs"]:
        out[run["state"]] = out.get(run["state"], 0) + 1
    return out


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
    record: dict[str, Any]
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
    from quantpatch.checkout.worktrees import ensure_worktree
    from quantpatch.git import repo as gitrepo
    from quantpatch.launch.plan import GenRequest, generate_scripts, requested_nodes
    from quantpatch.launch.scripts import quantpatch_command

    old = load(sweep_dir)
    if given is None:
        if old is None:
            raise UserError(
                f"{sweep_dir} holds no {RECORD}: give the sweep's selection (--models, "
                "--datasets, --schemes, --profile) to start one."
            )
        selection = Selection.from_dict(old["selection"])
    else:
        selection = given
    if selection.launcher not in LAUNCHERS:
        raise UserError(
            f"--launcher: unknown launcher '{selection.launcher}'; valid: {', '.join(LAUNCHERS)}."
        )
    check_choice(selection.attention)
    if not 1 <= selection.parallel <= 64:
        raise UserError(f"--parallel must be from 1 to 64 (got {selection.parallel}).")
    _check_seeds(selection)
    checkout = gitrepo.find_checkout(repo, need_git=True)
    _refuse_live_runs(old)
    if selection.launcher == "slurm":
        slurm.sbatch_exe()
    quantpatch_command()  # the runs call quantpatch back: refused before anything is written
    if old is not None:
        _follow_slurm(sweep_dir, old, selection if given is not None else None)
    env = data_env((old or {}).get("data"), os.environ)
    checked = _refuse_missing_data(selection, {**os.environ, **env})
    mock = _mock_data(selection, {**os.environ, **env})
    _refuse_older_runtime(checkout, selection)
    if selection.launcher == "local":
        _refuse_unrunnable_local(selection)
    done = generate_scripts(
        GenRequest(
            out=sweep_dir,
            models=selection.models,
            datasets=selection.datasets,
            schemes=selection.schemes,
            profile=selection.profile,
            launcher="torchrun" if selection.launcher == "local" else "slurm",
            parallel={"gpus_per_node": selection.gpus_per_node, "nodes": selection.nodes},
            config=Path(selection.config) if selection.config else None,
            repo=checkout.root,
            refuse_blocked=True,
            slurm_nodes="refuse" if selection.launcher == "slurm" else None,
            attention=selection.attention,
            gpus=(selection.gpus or []) if selection.launcher == "local" else None,
        )
    )
    scripts = done.result.scripts
    made = provenance_of(checkout, selection, scripts, done.flags.release)
    asked = requested_nodes(scripts)
    layout = scripts[0].layout if scripts else None
    per_run = layout.plan.gpus_per_node if layout is not None else 1
    if selection.launcher == "local" and layout is not None and layout.plan.nodes > 1:
        raise UserError(
            f"the {selection.profile} profile runs on {layout.plan.nodes} nodes; a local sweep "
            "runs on this machine only (use --launcher slurm)."
        )
    commits: dict[str, str] = {}
    for s in scripts:
        key = json.dumps(s.scheme.values(), sort_keys=True)
        if key not in commits:
            result = ensure_worktree(checkout.root, s.scheme.values())
            commits[key] = result.commit
            if progress is not None:
                progress(f"worktree {result.branch} at {result.commit[:10]}")
    previous = {r["name"]: r for r in (old or {}).get("runs", [])}
    notes: list[str] = []
    runs = []
    seeded = [(s, seed) for s in scripts for seed in seeds_of(selection)]
    for s, seed in seeded:
        base_name = f"{s.model}_{s.dataset}_{s.scheme.name}_{s.profile}"
        first = seed is None or seed == FIRST_SEED
        name = base_name if first else f"{base_name}_seed{seed}"
        commit = commits[json.dumps(s.scheme.values(), sort_keys=True)]
        path = s.attention.path if s.attention is not None else None
        run: dict[str, Any] = {
            "name": name,
            "seed": seed,
            # where its script's RUN_NAME folder goes (OUTPUT_ROOT): another seed's apart
            "folder": f"runs/{base_name}" if first else f"runs/seed{seed}/{base_name}",
            "model": s.model,
            "dataset": s.dataset,
            "scheme": s.scheme.name,
            "args": s.scheme.argv(),  # the scheme's own Megatron arguments, in its argv
            "profile": s.profile,
            "script": s.rel,
            "state": "pending",
            "exit_code": None,
            "log": None,
            "commit": None,
            "started": None,
            "ended": None,
            "gpus": None,
            "array_task": None,
            "pid": None,
            "attention": path,
        }
        before = previous.get(name)
        if before is not None and slurm.live(before):
            run = dict(before)  # Slurm's still: followed, never submitted twice
        elif before is not None:
            state = before.get("state")
            # the same attention path as the others, or the comparison is of kernels (a run
            # recorded before the path was: kept, its log says which it took)
            was = before.get("attention")
            if state == "finished" and was not in (path, None):
                notes.append(
                    f"{name}: running it again, its attention path is {path} now (--attention "
                    f"{selection.attention}), it ran on {was}"
                )
            # (a finished Slurm run whose log named no commit: kept, nothing says it moved)
            elif state == "finished" and before.get("commit") in (commit, None):
                run = {**run, **before, "attention": path}
            elif state == "finished":
                upgraded = _upgrade_between(checkout.repo, before.get("commit"), commit)
                notes.append(
                    f"{name}: running it again, its scheme branch moved from "
                    f"{str(before.get('commit'))[:10]} to {commit[:10]} since it finished"
                    + (
                        f" (its source changed with 'quantpatch upgrade' at {upgraded[:10]})"
                        if upgraded
                        else ""
                    )
                )
            elif state == "failed" and only_pending:
                run = {**run, **before}
        runs.append(run)
    checkout.close()  # its git processes: none left open for the sweep's runs
    record = {
        "version": VERSION,
        "checkout": str(checkout.root),
        "launcher": selection.launcher,
        "selection": selection.as_dict(),
        "slurm_job": (old or {}).get("slurm_job"),
        "created": (old or {}).get("created") or now(),
        "layout": {"gpus_per_node": asked[0], "nodes": asked[1]} if asked else None,
        "attention": scripts[0].attention.as_dict() if scripts and scripts[0].attention else None,
        "provenance": made,
        "data": {
            "env": env,
            "mock": mock,
            "checked": [
                {
                    "model": n.model,
                    "dataset": n.dataset,
                    "prefix": str(n.prefix),
                    "tokenizer": n.tokenizer,
                    **manifest_facts(n.prefix),
                }
                for n in checked
            ],
        },
        "runs": runs,
    }
    if selection.launcher == "local":
        save(sweep_dir, record)  # a Slurm sweep's is saved once sbatch took the array
    return Prepared(record, notes, per_run)


def manifest_facts(prefix: Path) -> dict[str, Any]:
    """What the dataset's manifest says of it, for the report: documents, tokens, the files'
    sha256 (``data prepare``), the tokenizer's fingerprint and vocabulary size."""
    from quantpatch.data_prep.layout import read_manifest

    manifest = read_manifest(prefix) or {}
    tok = manifest.get("tokenizer") if isinstance(manifest.get("tokenizer"), dict) else {}
    assert isinstance(tok, dict)
    return {
        "manifest": {
            "documents": manifest.get("documents"),
            "tokens": manifest.get("tokens"),
            "sha256": manifest.get("sha256"),
            "made_with": tok.get("name"),
            "tokenizer_hash": tok.get("hash"),
            "vocab_size": tok.get("vocab_size"),
        }
        if manifest
        else None
    }


def provenance_of(
    checkout: Any, selection: Selection, scripts: Sequence[Any], release: str
) -> dict[str, Any]:
    """What the report says the runs were made from, as ``sweep run`` found it: quantpatch's
    version, the checkout's Megatron release (its own argument parser's) and base commit, and
    each model's resolved pretrain_gpt.py arguments under the profile (``-- EXTRA`` after)."""
    from quantpatch import __version__
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import resolved_args

    reg = load_registry(Path(selection.config) if selection.config else None)
    base: dict[str, Any] = {"commit": None, "branch": None}
    repo = checkout.repo
    if repo is not None:
        with suppress(ValueError, TypeError):  # a repository without commits, a detached head
            base["commit"] = str(repo.head.commit.hexsha)
            base["branch"] = None if repo.head.is_detached else str(repo.active_branch.name)
    models = sorted({s.model for s in scripts})
    return {
        "quantpatch": __version__,
        "megatron": release,
        "base": base,
        "args": {
            m: {k: v for k, v in resolved_args(reg, m, selection.profile).items()}
            for m in models
            if m in reg.models and selection.profile in reg.profiles
        },
    }


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


def run_folder(sweep_dir: Path, run: Mapping[str, Any]) -> Path:
    """The run's folder (logs, checkpoints, tensors): ``runs/<name>``, another seed's
    ``runs/seed<N>/<name>`` (a record made before seeds: ``runs/<name>``)."""
    return at(sweep_dir, str(run.get("folder") or f"runs/{run['name']}"))


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
    per_run = max(layout.plan.gpus_per_node for layout in layouts.values())
    gpus = selection.gpus or detect_gpus()
    if per_run > len(gpus):
        raise UserError(
            f"each run needs {per_run} GPUs (the {selection.profile} profile's GPUS_PER_NODE"
            f"{', --gpus-per-node' if selection.gpus_per_node else ''}) and this machine has "
            f"{len(gpus)} ({','.join(gpus)}); name more with --gpus, or give --gpus-per-node "
            f"{len(gpus)}."
        )


def _follow_slurm(sweep_dir: Path, old: dict[str, Any], asked: Selection | None) -> None:
    """The old record brought up to Slurm's word (saved); a different selection refused while
    any of its runs is still pending or running in Slurm."""
    if slurm.refresh(sweep_dir, old):
        save(sweep_dir, old)
    live = [r for r in old["runs"] if slurm.live(r)]
    if live and asked is not None and asked != Selection.from_dict(old["selection"]):
        jobs = ", ".join(sorted({str(r["slurm_job"]) for r in live}))
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


def _refuse_live_runs(record: Mapping[str, Any] | None) -> None:
    """A run recorded as running whose process group still lives (a sweep killed with
    SIGKILL leaves its children): refused, never started twice."""
    for run in (record or {}).get("runs", []):
        if run.get("state") == "running" and group_alive(run.get("pid")):
            raise UserError(
                f"{run['name']} is still running (process group {run['pid']}) from an earlier "
                f"sweep run; wait for it or stop it (kill -TERM -- -{run['pid']}) first."
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


def _finish(run: dict[str, Any], sweep_dir: Path, code: int, started: float) -> None:
    logs = sorted(
        (p for p in (run_folder(sweep_dir, run) / "logs").glob("*.log")),
        key=lambda p: p.stat().st_mtime,
    )
    fresh = [p for p in logs if p.stat().st_mtime >= started - 1]
    log = fresh[-1] if fresh else None
    run["log"] = stored(sweep_dir, log) if log else None
    if log is not None:
        found = _COMMIT.search(log.read_text(encoding="utf-8", errors="replace")[:65536])
        run["commit"] = found[1] if found else None
    run["exit_code"] = code
    run["state"] = "finished" if code == 0 else "failed"
    run["ended"] = now()
    run["pid"] = None


def run_local(
    sweep_dir: Path,
    record: dict[str, Any],
    per_run_gpus: int,
    on_change: Callable[[dict[str, Any]], None] | None = None,
    quantpatch_exe: str | None = None,
) -> dict[str, Any]:
    """Run the record's pending runs as a queue, ``parallel`` at once, each on its own slice
    of ``per_run_gpus`` GPUs; the record is saved after every change."""
    from quantpatch.launch.scripts import quantpatch_command

    sel = Selection.from_dict(record["selection"])
    gpus = sel.gpus or detect_gpus()
    if per_run_gpus > len(gpus):
        raise UserError(
            f"each run needs {per_run_gpus} GPUs (the {sel.profile} profile's GPUS_PER_NODE) "
            f"and this machine has {len(gpus)} ({','.join(gpus)}); name more with --gpus."
        )
    slices = [
        gpus[i : i + per_run_gpus] for i in range(0, len(gpus) - per_run_gpus + 1, per_run_gpus)
    ]
    slots = min(sel.parallel, len(slices))
    free = list(range(len(slices)))
    queue = [r for r in record["runs"] if r["state"] in ("pending", "interrupted")]
    for r in queue:
        r["state"] = "pending"
    active: dict[int, tuple[subprocess.Popen[bytes], dict[str, Any], float]] = {}
    checkout = Path(record["checkout"])
    # what the sweep planned, whatever the shell exports (launch.script_env)
    env_base, passed = script_env.for_runs(
        os.environ,
        {
            **data_vars(record),
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
                    seed = ["--seed", str(run["seed"])] if run.get("seed") is not None else []
                    with (console / f"{run['name']}.out").open("ab") as out:
                        proc = subprocess.Popen(
                            [
                                "bash",
                                str(sweep_dir.resolve() / run["script"]),
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
                        state="running",
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
                run.update(state="interrupted", exit_code=proc.returncode, ended=now(), pid=None)
            changed()
            raise Interrupted from None
    return record


def submit_slurm(
    sweep_dir: Path, record: dict[str, Any], quantpatch_exe: str | None = None
) -> slurm.Submitted | None:
    """One job array of the record's runs that are to run (None where every run is finished
    or still Slurm's), from the checkout; the record saved once sbatch took it."""
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import quantpatch_command

    cfg = record["selection"].get("config")
    settings = load_registry(Path(cfg) if cfg else None).slurm
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


def status(sweep_dir: Path) -> dict[str, Any]:
    """The record's runs, a Slurm sweep's brought up to Slurm's word first (and saved), and
    the counts."""
    record = load(sweep_dir)
    if record is None:
        raise UserError(f"{sweep_dir} holds no {RECORD}: not a sweep (start one with sweep run).")
    if slurm.refresh(sweep_dir, record):
        save(sweep_dir, record)
    runs = [dict(r) for r in record["runs"]]
    layout = record.get("layout") or {}
    for r in runs:  # a Slurm run's GPUs: its allocation's shape, as the scripts asked for it
        if not r.get("gpus") and r.get("slurm_job") and layout.get("gpus_per_node"):
            nodes, per = int(layout.get("nodes") or 1), int(layout["gpus_per_node"])
            r["gpus"] = f"{per} GPU{'s' if per != 1 else ''}" + (
                f" x {nodes} nodes" if nodes > 1 else ""
            )
    return {"counts": counts(record), "runs": runs, "launcher": record["launcher"]}


def cancel(sweep_dir: Path) -> list[str]:
    """scancel the sweep's runs that are pending or running in Slurm, recorded interrupted."""
    record = load(sweep_dir)
    if record is None:
        raise UserError(f"{sweep_dir} holds no {RECORD}: not a sweep (start one with sweep run).")
    slurm.refresh(sweep_dir, record)
    names = slurm.cancel(sweep_dir, record)
    save(sweep_dir, record)
    return names


def run_logs(sweep_dir: Path, record: Mapping[str, Any]) -> list[Path]:
    """Exactly the sweep's logs: each run's recorded log, else (Slurm) its run folder's."""
    out: list[Path] = []
    for run in record["runs"]:
        if run.get("log"):
            out.append(at(sweep_dir, str(run["log"])))
            continue
        logs = sorted((run_folder(sweep_dir, run) / "logs").glob("*.log"))
        out.extend(logs[-1:])
    return [p for p in out if p.is_file()]


def tensor_dirs(sweep_dir: Path, record: Mapping[str, Any]) -> list[Path]:
    return [
        d
        for run in record["runs"]
        if (d := run_folder(sweep_dir, run) / "tensor_logs").is_dir() and any(d.rglob("*.pt"))
    ]
