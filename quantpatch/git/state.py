"""The checkout's record of the active set (``.quantpatch/state.json``), typed.

A branch set records the base it left (``base``: the branch and commit ``restore`` goes
back to), the scheme branch it checked out (``current``), its history and, while it runs, its
intent (``pending``). An in-place set records, besides, each file it rewrote (``files``:
the kept original, its hash, and the hash of the text quantpatch wrote). The record is read
checked (``why_malformed``: a record quantpatch never writes is a one-sentence error) and
written with the same keys it was read with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypedDict


class Mode(str, Enum):
    """How the set was made: on a scheme branch, or by rewriting the files in place."""

    BRANCH = "branch"
    IN_PLACE = "in-place"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class HistoryEntry(TypedDict, total=False):
    """One set of the record's history: when, its values, and a branch set's branch and
    commit."""

    time: float
    values: dict[str, str]
    branch: str
    commit: str


@dataclass(frozen=True)
class Base:
    """Where ``restore`` goes back to: the branch (None: a detached HEAD) and its commit (an
    in-place set's: both None)."""

    branch: str | None = None
    commit: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"branch": self.branch, "commit": self.commit}


@dataclass(frozen=True)
class Current:
    """The set in force: its scheme branch and commit (a branch set's) and its values."""

    branch: str | None
    values: dict[str, str]
    commit: str | None = None

    def as_dict(self) -> dict[str, str | dict[str, str] | None]:
        out: dict[str, str | dict[str, str] | None] = {"branch": self.branch}
        if self.commit is not None:
            out["commit"] = self.commit
        out["values"] = self.values
        return out


@dataclass(frozen=True)
class KeptFile:
    """A file an in-place set rewrote: its kept original (relative to the state directory),
    the original's sha256 (records before it was kept: None) and the written text's."""

    original: str
    written: str
    original_sha: str | None = None

    def as_dict(self) -> dict[str, str]:
        out = {"original": self.original, "written": self.written}
        if self.original_sha is not None:
            out["original_sha"] = self.original_sha
        return out


@dataclass(frozen=True)
class Pending:
    """What a set was doing when it wrote the record first (``op``, the scheme ``branch``):
    a record with it names a set that was interrupted."""

    op: str
    branch: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"op": self.op, "branch": self.branch}


@dataclass
class CheckoutState:
    """``state.json``: the active set."""

    mode: Mode
    base: Base
    current: Current | None = None
    history: list[HistoryEntry] = field(default_factory=list)
    """One entry a set: its time, values and (a branch set's) branch and commit."""
    files: dict[str, KeptFile] | None = None
    """The files an in-place set rewrote (a branch set: None)."""
    pending: Pending | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys quantpatch does not know (and ``version``), kept as they were read."""

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode.value,
            "base": self.base.as_dict(),
            "current": self.current.as_dict() if self.current else None,
            "history": self.history,
        }
        if self.files is not None:
            out["files"] = {rel: f.as_dict() for rel, f in self.files.items()}
        if self.pending is not None:
            out["pending"] = self.pending.as_dict()
        return {**self.extra, **out}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckoutState:
        """The record from its (checked: ``why_malformed``) JSON."""
        base = data["base"]
        current = data.get("current")
        files = data.get("files") if data["mode"] == Mode.IN_PLACE.value else None
        pending = data.get("pending")
        return cls(
            mode=Mode(data["mode"]),
            base=Base(base.get("branch"), base.get("commit")),
            current=Current(current.get("branch"), current.get("values", {}), current.get("commit"))
            if current
            else None,
            history=list(data.get("history", [])),
            files={
                rel: KeptFile(f["original"], f["written"], f.get("original_sha"))
                for rel, f in files.items()
            }
            if files is not None
            else None,
            pending=Pending(str(pending.get("op")), pending.get("branch"))
            if isinstance(pending, dict)
            else None,
            extra={k: v for k, v in data.items() if k not in _KEYS},
        )


_KEYS = ("mode", "base", "current", "history", "files", "pending")


def _files_ok(files: object) -> bool:
    return isinstance(files, dict) and all(
        isinstance(v, dict) and isinstance(v.get("written"), str) and "original" in v
        for v in files.values()
    )


def _current_ok(current: object) -> bool:
    return current is None or (
        isinstance(current, dict)
        and all(isinstance(current.get(k), str | None) for k in ("branch", "commit"))
        and isinstance(current.get("values", {}), dict)
    )


def _outside(rel: str) -> bool:
    parts = Path(rel).parts
    return Path(rel).is_absolute() or ".." in parts or not parts


def why_malformed(data: object) -> str | None:
    """What is wrong with a record quantpatch never writes (the end of a sentence that starts
    "the quantpatch record"), or None."""
    if not isinstance(data, dict):
        return "is not a JSON object"
    mode, base = data.get("mode"), data.get("base")
    if mode not in (Mode.BRANCH.value, Mode.IN_PLACE.value) or not isinstance(base, dict):
        return "lacks its mode or base"
    if mode == Mode.BRANCH.value:
        commit, branch = base.get("commit"), base.get("branch")
        if not isinstance(commit, str) or (branch is not None and not isinstance(branch, str)):
            return "names no base commit"
    elif not _files_ok(data.get("files")):
        return "lacks the files of the in-place set"
    if not isinstance(data.get("history", []), list):
        return "has a malformed history"
    if not _current_ok(data.get("current")):
        return "has a malformed current set"
    # a record names target files inside the checkout, never a path that leaves it
    outside = [rel for rel in data.get("files", {}) if _outside(rel)] if mode == "in-place" else []
    if outside:
        return f"names a file outside the checkout ({outside[0]!r})"
    return None
