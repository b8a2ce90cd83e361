"""Recorded installs: a set of edits written all-or-nothing, with the original bytes kept under
``<state dir>/<name>/`` so that removing the install restores them exactly.

``init`` (sites + quant ops) and ``saver install`` (instrumentation + tensor saver) are both
recorded installs: same preconditions (no active ``set``, clean files), same commit handling,
same exact undo.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpatch import repo as gitrepo
from quantpatch.edits import Edit, apply_edits, read_exact, sha256_text, write_exact
from quantpatch.errors import UserError


@dataclass
class InstallResult:
    files: list[str]
    commit: str | None
    removed: bool
    changed: bool = True
    notes: list[str] = field(default_factory=list)


def record_of(checkout: gitrepo.Checkout, name: str) -> dict[str, Any] | None:
    path = checkout.state_dir / name / "record.json"
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def run_install(
    path: Path | None,
    name: str,
    plan: Callable[[gitrepo.Checkout], list[Edit]],
    files: Callable[[gitrepo.Checkout], Sequence[str]],
    message: str,
    *,
    extra: dict[str, Any] | None = None,
) -> InstallResult:
    """Plan edits (under the lock, after the common checks), write them, record the originals,
    and commit the written files in a git checkout."""
    checkout = gitrepo.find_checkout(path, need_git=False)
    with gitrepo.locked(checkout):
        _preconditions(checkout, files(checkout))
        edits = plan(checkout)
        written = apply_edits(checkout.root, edits)
        _write_record(checkout.state_dir / name, edits, extra or {})
        result = InstallResult(written, _commit(checkout, written, message), removed=False)
        result.notes = _detached_note(checkout, result.commit)
        return result


def run_remove(
    path: Path | None, name: str, message: str, *, missing_ok: bool = False
) -> InstallResult:
    """Restore the original bytes of a recorded install (refusing files changed since)."""
    checkout = gitrepo.find_checkout(path, need_git=False)
    with gitrepo.locked(checkout):
        record = record_of(checkout, name)
        if record is None:
            if missing_ok:
                return InstallResult([], None, removed=True, changed=False)
            raise UserError(f"{checkout.root}: not initialised by quantpatch; nothing to remove.")
        _preconditions(checkout, list(record["files"]))
        edits = []
        for rel, info in record["files"].items():
            current = read_exact(checkout.root / rel)
            if current is None or sha256_text(current) != info["written"]:
                raise UserError(
                    f"{rel} changed since 'quantpatch {name.replace('-', ' ')}'; revert it first."
                )
            original = None
            if info["existed"]:
                original = read_exact(checkout.state_dir / name / "originals" / rel)
            edits.append(Edit(rel, current, original))
        written = apply_edits(checkout.root, edits)
        shutil.rmtree(checkout.state_dir / name)
        result = InstallResult(written, _commit(checkout, written, message), removed=True)
        result.notes = _detached_note(checkout, result.commit)
        return result


def _detached_note(checkout: gitrepo.Checkout, commit: str | None) -> list[str]:
    """The warning ``set`` gives too: a commit on a detached HEAD is on no branch."""
    if commit is None or checkout.repo is None or not checkout.repo.head.is_detached:
        return []
    return [
        f"HEAD is detached: commit {commit[:12]} is on no branch; keep it with "
        "'git switch -c <branch>'."
    ]


def _preconditions(checkout: gitrepo.Checkout, files: Sequence[str]) -> None:
    if gitrepo.load_state(checkout):
        raise UserError("a quantpatch set is active; run 'quantpatch restore' first.")
    if checkout.repo is not None:
        dirty = gitrepo.dirty_paths(checkout.repo, files)
        if dirty:
            raise UserError(
                f"uncommitted changes to {', '.join(dirty)}; commit or stash them first."
            )


def _write_record(record_dir: Path, edits: Sequence[Edit], extra: dict[str, Any]) -> None:
    """The original bytes and the hash of what was written (after the write succeeded)."""
    for e in edits:
        if e.old is not None:
            write_exact(record_dir / "originals" / e.rel, e.old)
    files = {
        e.rel: {"existed": e.old is not None, "written": sha256_text(e.new or "")} for e in edits
    }
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / "record.json").write_text(
        json.dumps({"files": files, **extra}, indent=2) + "\n", encoding="utf-8"
    )


def _commit(checkout: gitrepo.Checkout, written: Sequence[str], message: str) -> str | None:
    if checkout.repo is None or not written or gitrepo.head_commit(checkout.repo) is None:
        return None
    return gitrepo.commit_paths(checkout.repo, list(written), message)
