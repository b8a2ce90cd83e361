"""A sweep's record, typed: ``DIR/sweep.json`` read into a ``SweepRecord`` of ``SweepRun``\\ s
(each with a ``RunState``), checked field by field first, and written back with the same keys
in the same order (a key quantpatch does not know is kept as it was).

The record is replaced atomically after every change (``save``), so a sweep killed at any
moment leaves it readable.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, TypedDict

from quantpatch.base.edits import shared_mode
from quantpatch.base.errors import UserError

RECORD = "sweep.json"
VERSION = 2
"""2: the runs' logs relative to the sweep's folder (1 kept them relative to the directory
``sweep run`` ran in; read, and migrated on the first write)."""
READS = (1, 2)
LAUNCHERS = ("local", "slurm")


class RunState(str, Enum):
    """Where a run of the sweep stands; its value is the word ``sweep.json`` keeps."""

    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    SUBMITTED = "submitted"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def ended(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED, RunState.INTERRUPTED)


STATES = tuple(s.value for s in RunState)


class Layout(TypedDict):
    """The GPUs a node and the nodes the scripts ask for."""

    gpus_per_node: int | None
    nodes: int | None


class Manifest(TypedDict, total=False):
    """What a dataset's manifest (``data prepare``) says of it."""

    documents: int | None
    tokens: int | None
    sha256: dict[str, str] | None
    made_with: str | None
    tokenizer_hash: str | None
    vocab_size: int | None


class CheckedData(TypedDict, total=False):
    """A dataset the sweep checked before it ran: its prefix, tokenizer and manifest."""

    model: str
    dataset: str
    prefix: str
    tokenizer: str | None
    manifest: Manifest | None


class SweepData(TypedDict, total=False):
    """The data variables the runs get (``env``), whether they train on mock data, and the
    datasets checked (records before ``mock`` or ``checked`` lack them)."""

    env: dict[str, str]
    mock: bool
    checked: list[CheckedData]


class MadeFrom(TypedDict, total=False):
    """The checkout's base branch and commit a sweep ran from."""

    commit: str | None
    branch: str | None


class Provenance(TypedDict, total=False):
    """What the runs were made from: quantpatch's version, the Megatron release, the base,
    and each model's resolved arguments (``sweep.provenance_of``)."""

    quantpatch: str
    megatron: str
    base: MadeFrom
    args: dict[str, dict[str, object]]


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

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Selection:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def config_path(self) -> Path | None:
        return Path(self.config) if self.config else None


_NEW_RUN_KEYS = (
    "name",
    "seed",
    "folder",
    "model",
    "dataset",
    "scheme",
    "args",
    "profile",
    "script",
    "state",
    "exit_code",
    "log",
    "commit",
    "started",
    "ended",
    "gpus",
    "array_task",
    "pid",
    "attention",
)
"""The keys a new run is written with, in this order; the others come as they are set."""


@dataclass(eq=False)
class SweepRun:
    """One run of the sweep: a combination (and seed) of model, dataset, scheme and profile,
    its script, where it stands, and what it left (exit code, log, the source commit)."""

    name: str
    script: str
    state: RunState
    model: str = ""
    dataset: str = ""
    scheme: str = ""
    profile: str = ""
    seed: int | None = None
    folder: str | None = None
    """Its script's RUN_NAME folder, relative to the sweep's (None: ``runs/<name>``)."""
    args: list[str] | None = None
    """The scheme's own Megatron arguments, in its argv."""
    exit_code: int | None = None
    log: str | None = None
    commit: str | None = None
    started: str | None = None
    ended: str | None = None
    gpus: str | None = None
    array_task: int | None = None
    pid: int | None = None
    attention: str | None = None
    slurm_job: str | None = None
    slurm_state: str | None = None
    slurm_output: str | None = None
    submitted: str | None = None
    reason: str | None = None
    env: dict[str, str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys quantpatch does not know, kept as they were read."""
    keys: list[str] = field(default_factory=lambda: list(_NEW_RUN_KEYS))
    """The record's keys in their order (a field set later is appended, as a dict would)."""

    def update(self, **values: Any) -> None:
        """Set fields as ``dict.update`` sets keys: a new one goes last in the record."""
        for key, value in values.items():
            if key not in _RUN_FIELDS:
                raise AttributeError(f"a sweep run has no field {key!r}")
            if key == "state":
                value = RunState(value)
            setattr(self, key, value)
            if key not in self.keys:
                self.keys.append(key)

    def as_dict(self) -> dict[str, object]:
        """The run as ``sweep.json`` keeps it."""
        out: dict[str, object] = {}
        for key in self.keys:
            if key in _RUN_FIELDS:
                value = getattr(self, key)
                out[key] = value.value if isinstance(value, RunState) else value
            elif key in self.extra:
                out[key] = self.extra[key]
        for key in _RUN_FIELDS:  # a field set by assignment rather than update
            if key not in out and getattr(self, key) not in (None, ""):
                value = getattr(self, key)
                out[key] = value.value if isinstance(value, RunState) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepRun:
        """A run from its (checked) record."""
        known = {k: v for k, v in data.items() if k in _RUN_FIELDS}
        known["state"] = RunState(data["state"])
        return cls(
            **known,
            extra={k: v for k, v in data.items() if k not in _RUN_FIELDS},
            keys=list(data),
        )

    def copy(self) -> SweepRun:
        return SweepRun.from_dict(self.as_dict())

    def merged(self, other: SweepRun, **over: Any) -> SweepRun:
        """This run's keys with ``other``'s values over them (and ``over`` over both), as
        ``{**self, **other, **over}``."""
        return SweepRun.from_dict({**self.as_dict(), **other.as_dict(), **over})

    @property
    def is_slurm_live(self) -> bool:
        """Pending or running in Slurm: never submitted again, only followed."""
        return bool(self.slurm_job) and self.state in _LIVE


_RUN_FIELDS = frozenset(f.name for f in fields(SweepRun)) - {"extra", "keys"}
_LIVE = (RunState.SUBMITTED, RunState.PENDING, RunState.RUNNING)

_TOP_KEYS = (
    "version",
    "checkout",
    "launcher",
    "selection",
    "slurm_job",
    "created",
    "layout",
    "attention",
    "provenance",
    "data",
    "runs",
)


@dataclass(eq=False)
class SweepRecord:
    """``sweep.json``: the checkout, the selection, what the runs were made from, the runs."""

    checkout: str
    launcher: str
    selection: Selection
    runs: list[SweepRun]
    version: int = VERSION
    slurm_job: str | None = None
    """The last job array submitted (a Slurm sweep)."""
    created: str | None = None
    layout: Layout | None = None
    attention: dict[str, str] | None = None
    """The attention path the sweep gave its runs (``launch.attention``'s ``as_dict``)."""
    provenance: Provenance | None = None
    data: SweepData | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    keys: list[str] = field(default_factory=lambda: list(_TOP_KEYS))

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for key in self.keys:
            if key == "selection":
                out[key] = self.selection.as_dict()
            elif key == "runs":
                out[key] = [r.as_dict() for r in self.runs]
            elif key in _TOP_FIELDS:
                out[key] = getattr(self, key)
            elif key in self.extra:
                out[key] = self.extra[key]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepRecord:
        """A record from its (checked) ``sweep.json``; keys it lacks are written once set."""
        known = {k: v for k, v in data.items() if k in _TOP_FIELDS}
        known["selection"] = Selection.from_dict(data.get("selection") or {})
        known["runs"] = [SweepRun.from_dict(r) for r in data["runs"]]
        known.setdefault("checkout", "")
        known.setdefault("launcher", "local")
        return cls(
            **known,
            extra={k: v for k, v in data.items() if k not in _TOP_FIELDS},
            keys=list(data),
        )

    @property
    def gpus_per_node(self) -> int | None:
        """The GPUs a node the scripts ask for (None: not recorded)."""
        return self.layout.get("gpus_per_node") if self.layout else None

    @property
    def nodes(self) -> int | None:
        """The nodes the scripts ask for (None: not recorded)."""
        return self.layout.get("nodes") if self.layout else None

    @property
    def data_env(self) -> dict[str, str]:
        """The data variables the sweep recorded for its runs (none for an older record)."""
        return dict((self.data or {}).get("env") or {})

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for run in self.runs:
            out[run.state.value] += 1
        return out


_TOP_FIELDS = frozenset(f.name for f in fields(SweepRecord)) - {"extra", "keys"}


def record_path(sweep_dir: Path) -> Path:
    return sweep_dir / RECORD


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


def load(sweep_dir: Path) -> SweepRecord | None:
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
    return SweepRecord.from_dict(_migrated(sweep_dir, data))


def _migrated(sweep_dir: Path, data: dict[str, Any]) -> dict[str, Any]:
    """A record of an earlier version brought to this one's paths: each run's log (relative to
    wherever that ``sweep run`` ran, or absolute) found in its run folder and kept relative
    to the sweep's. Saved by the next write."""
    for run in data["runs"]:
        log = run.get("log")
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


def save(sweep_dir: Path, record: SweepRecord) -> None:
    """Replace the record atomically (a new file, synced, renamed over the old one)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".sweep-", suffix=".json", dir=sweep_dir)
    try:
        os.fchmod(fd, shared_mode())  # colleagues read it: the umask's mode, not 0600
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(record.as_dict(), fh, indent=1)
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


_STR = (str,)
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
_OPT_DICT = (dict, type(None))
_OPT_LIST = (list, type(None))
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
    "models": _OPT_LIST,
    "datasets": _OPT_LIST,
    "schemes": _OPT_LIST,
    "profile": _STR,
    "launcher": _STR,
    "parallel": (int,),
    "gpus": _OPT_LIST,
    "config": _OPT_STR,
    "extra": (list,),
    "gpus_per_node": _OPT_INT,
    "nodes": _OPT_INT,
    "attention": _STR,
    "seeds": (int,),
}
_SELECTION_LISTS = ("models", "datasets", "schemes", "gpus", "extra")
_RUN: dict[str, tuple[type, ...]] = {
    "name": _STR,
    "model": _STR,
    "dataset": _STR,
    "scheme": _STR,
    "args": _OPT_LIST,
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
_RUN_REQUIRED = ("name", "state", "script")
_KINDS = {str: "a string", int: "an integer", list: "a list", dict: "a table"}
_Check = tuple[str, object, tuple[type, ...]]


def _wrong(where: str, value: object, want: tuple[type, ...]) -> str | None:
    ok = isinstance(value, want) and not (isinstance(value, bool) and bool not in want)
    if ok:
        return None
    kinds = " or ".join(_KINDS.get(t, "null") for t in want)
    return f"{where} is {json.dumps(value)[:60]}, not {kinds}"


def _nested_checks(data: Mapping[str, Any]) -> list[_Check]:
    """The selection's, the layout's and the data's fields, each with what it must be."""
    checks: list[_Check] = []
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
        env = found.get("env")
        checks += [("data.env", env, _OPT_DICT), ("data.checked", found.get("checked"), _OPT_LIST)]
        if isinstance(env, dict):
            checks += [(f"data.env.{k}", v, _STR) for k, v in env.items()]
    return checks


def _run_checks(i: int, run: object) -> tuple[list[_Check], str | None]:
    """Run ``i``'s fields with what each must be, and what is wrong with its state (a word
    that is no ``RunState``), if anything."""
    if not isinstance(run, dict):
        return [(f"runs[{i}]", run, (dict,))], None
    checks: list[_Check] = [
        (f"runs[{i}].{k}", run.get(k), want)
        for k, want in _RUN.items()
        if k in run or k in _RUN_REQUIRED
    ]
    state = run.get("state")
    if isinstance(state, str) and state not in STATES:
        return checks, f"runs[{i}].state is {json.dumps(state)}, not one of {', '.join(STATES)}"
    return checks, None


def _bad_list_item(selection: object) -> str | None:
    for key, value in (selection if isinstance(selection, dict) else {}).items():
        if key not in _SELECTION_LISTS or not isinstance(value, list):
            continue
        for item in value:
            if not isinstance(item, str):
                return f"selection.{key} holds {json.dumps(item)[:60]}, not a string"
    return None


def _malformed(data: Mapping[str, Any]) -> str | None:
    """The first field of a sweep record that is not what quantpatch writes there (its
    name and value), or None: every reader of a record (run, status, report, cancel) meets
    a hand-edited one here, before any of it is used."""
    checks: list[_Check] = [(k, data[k], want) for k, want in _TOP.items() if k in data]
    checks += _nested_checks(data)
    runs = data.get("runs")
    for i, run in enumerate(runs if isinstance(runs, list) else []):
        found, bad_state = _run_checks(i, run)
        if bad_state is not None:
            return bad_state
        checks += found
    for where, value, want in checks:
        why = _wrong(where, value, want)
        if why is not None:
            return why
    why = _bad_list_item(data.get("selection"))
    if why is not None:
        return why
    if data.get("launcher") not in LAUNCHERS:
        return f"launcher is {json.dumps(data.get('launcher'))[:60]}, not one of local, slurm"
    return None
