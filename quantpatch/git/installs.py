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

from quantpatch.base import faults
from quantpatch.base.edits import (
    Edit,
    apply_edits,
    journal_record,
    journaled,
    read_exact,
    sha256_text,
    write_exact,
)
from quantpatch.base.errors import UserError
from quantpatch.git import repo as gitrepo
from quantpatch.sites.model import refuse_links


@dataclass
class InstallResult:
    files: list[str]
    commit: str | None
    removed: bool
    changed: bool = True
    notes: list[str] = field(default_factory=list)


def _record_path(checkout: gitrepo.Checkout, name: str) -> Path:
    return checkout.state_dir / name / "record.json"


def _read_record(checkout: gitrepo.Checkout, name: str) -> dict[str, Any] | None:
    path = _record_path(checkout, name)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise UserError(
            f"{path}: the record of 'quantpatch {name}' is unreadable; check the files it "
            "instrumented against git, then remove that directory."
        ) from None
    return data


def record_of(checkout: gitrepo.Checkout, name: str) -> dict[str, Any] | None:
    """The install's record, ``None`` when not installed (or its removal was completed)."""
    data = _read_record(checkout, name)
    return None if data is None or data.get("state") == "removed" else data


def _record_text(edits: Sequence[Edit], extra: dict[str, Any], message: str, state: str) -> str:
    files = {
        e.rel: {
            "existed": e.old is not None,
            "written": sha256_text(e.new or ""),
            "original_sha": None if e.old is None else sha256_text(e.old),
        }
        for e in edits
    }
    body = {"files": files, **extra, "message": message, "state": state}
    return json.dumps(body, indent=2) + "\n"


def _write_record_text(checkout: gitrepo.Checkout, name: str, text: str) -> None:
    faults.step(f"write {name} record", done=False)
    write_exact(_record_path(checkout, name), text)
    faults.step(f"write {name} record", done=True)


def run_install(
    path: Path | None,
    name: str,
    plan: Callable[[gitrepo.Checkout], list[Edit]],
    files: Callable[[gitrepo.Checkout], Sequence[str]],
    message: str,
    *,
    extra: dict[str, Any] | None = None,
    idempotent: bool = False,
) -> InstallResult:
    """Plan edits (under the lock, after the common checks), write them with a journal,
    record the originals, and commit the written files in a git checkout. A failing commit
    puts every file, the index and the record back as they were."""
    checkout = gitrepo.find_checkout(path, need_git=False)
    with gitrepo.locked(checkout):
        gitrepo.recover(checkout)
        finish_upgrade(checkout)  # an interrupted upgrade's records first
        if finish_interrupted(checkout, name) == "installed":
            return _completed(checkout, name)
        if idempotent and record_of(checkout, name) is not None:
            return InstallResult([], None, removed=False, changed=False)
        preconditions(checkout, files(checkout))
        edits = plan(checkout)
        record_dir = checkout.state_dir / name
        for e in edits:  # the original bytes, kept before anything is replaced
            if e.old is not None:
                write_exact(record_dir / "originals" / e.rel, e.old)
        text = _record_text(edits, extra or {}, message, "installed")
        written, commit = _write_and_commit(
            checkout, name, edits, text, message, lambda: shutil.rmtree(record_dir)
        )
        result = InstallResult(written, commit, removed=False)
        result.notes = _detached_note(checkout, result.commit)
        return result


def _completed(checkout: gitrepo.Checkout, name: str) -> InstallResult:
    """The same command, killed between its record and its commit: now complete."""
    head = gitrepo.head_commit(checkout.repo) if checkout.repo is not None else None
    done = InstallResult([], head, removed=False)
    done.notes = [f"completed the interrupted 'quantpatch {name}' (its commit was made now)."]
    return done


def run_amend(
    path: Path | None,
    name: str,
    plan: Callable[[gitrepo.Checkout, dict[str, Any]], list[Edit]],
    message: str,
    nothing_to_do: str,
) -> InstallResult:
    """Add edits to a recorded install (what an earlier quantpatch's install lacked), as a
    commit of its own. A file the install already wrote must still hold what it wrote (else
    the removal could not restore it either); its kept original stays the one from before
    the first install, so removing the install restores the original bytes of every file.
    A file new to the install has its current bytes kept as its original. ``plan`` gets the
    record; no edits is refused with ``nothing_to_do``."""
    checkout = gitrepo.find_checkout(path, need_git=False)
    with gitrepo.locked(checkout):
        gitrepo.recover(checkout)
        finish_upgrade(checkout)  # an interrupted upgrade's records first
        if finish_interrupted(checkout, name) == "installed":
            return _completed(checkout, name)
        record = record_of(checkout, name)
        if record is None:
            raise UserError(f"{checkout.root}: 'quantpatch {name}' was not run here.")
        preconditions(checkout, list(record["files"]))
        edits = plan(checkout, record)
        if not edits:
            raise UserError(nothing_to_do)
        preconditions(checkout, [e.rel for e in edits if e.rel not in record["files"]])
        files = dict(record["files"])
        record_dir = checkout.state_dir / name
        for e in edits:
            info = files.get(e.rel)
            if info is not None:
                if e.old is None or sha256_text(e.old) != info["written"]:
                    raise UserError(f"{e.rel} changed since 'quantpatch {name}'; revert it first.")
                continue
            if e.old is not None:
                write_exact(record_dir / "originals" / e.rel, e.old)
        for e in edits:
            before = files.get(e.rel)
            files[e.rel] = {
                "existed": e.old is not None if before is None else before["existed"],
                "written": sha256_text(e.new or ""),
                "original_sha": (
                    (None if e.old is None else sha256_text(e.old))
                    if before is None
                    else before.get("original_sha")
                ),
            }
        text = json.dumps({**record, "files": files, "message": message}, indent=2) + "\n"
        old_text = _record_path(checkout, name).read_text(encoding="utf-8")
        new_rels = [e.rel for e in edits if e.rel not in record["files"]]

        def undo_record() -> None:
            _write_record_text(checkout, name, old_text)
            for rel in new_rels:
                (record_dir / "originals" / rel).unlink(missing_ok=True)

        written, commit = _write_and_commit(checkout, name, edits, text, message, undo_record)
        result = InstallResult(written, commit, removed=False)
        result.notes = _detached_note(checkout, result.commit)
        return result


def _install_command(name: str) -> str:
    return "init" if name == "init" else f"{name} install"


def _remove_command(name: str) -> str:
    return "init --remove" if name == "init" else f"{name} remove"


def _written_by_another(
    checkout: gitrepo.Checkout, name: str, rel: str, current: str | None
) -> str | None:
    """The other recorded install whose last write ``rel`` holds (the saver's over init's),
    or None."""
    if current is None:
        return None
    for path in sorted(checkout.state_dir.glob("*/record.json")):
        other = path.parent.name
        try:
            record = record_of(checkout, other) if other != name else None
        except UserError:  # unreadable: not the one to name
            continue
        info = (record or {}).get("files", {}).get(rel)
        if isinstance(info, dict) and info.get("written") == sha256_text(current):
            return other
    return None


def run_remove(
    path: Path | None, name: str, message: str, *, missing_ok: bool = False
) -> InstallResult:
    """Restore the original bytes of a recorded install (refusing files changed since)."""
    checkout = gitrepo.find_checkout(path, need_git=False)
    with gitrepo.locked(checkout):
        gitrepo.recover(checkout)
        finish_upgrade(checkout)  # an interrupted upgrade's records first
        if finish_interrupted(checkout, name) == "removed":  # killed after its last change
            return InstallResult([], None, removed=True)
        record = record_of(checkout, name)
        if record is None:
            if missing_ok:
                return InstallResult([], None, removed=True, changed=False)
            raise UserError(f"{checkout.root}: not initialised by quantpatch; nothing to remove.")
        preconditions(checkout, list(record["files"]))
        edits = []
        for rel, info in record["files"].items():
            current = read_exact(checkout.root / rel)
            if current is None or sha256_text(current) != info["written"]:
                by = _written_by_another(checkout, name, rel, current)
                if by is not None:  # reverting it by hand would bypass that install's record
                    raise UserError(
                        f"{rel} was changed since 'quantpatch {name.replace('-', ' ')}' by "
                        f"'quantpatch {_install_command(by)}'; run 'quantpatch "
                        f"{_remove_command(by)}' first."
                    )
                raise UserError(
                    f"{rel} changed since 'quantpatch {name.replace('-', ' ')}'; revert it first."
                )
            original = None
            if info["existed"]:
                kept = checkout.state_dir / name / "originals" / rel
                original = read_exact(kept)
                want = info.get("original_sha")
                if original is None or (want and sha256_text(original) != want):
                    raise UserError(
                        f"{kept}: the kept original of {rel} is missing or altered; "
                        f"{rel} was left as it is."
                    )
            edits.append(Edit(rel, current, original))
        installed_text = _record_path(checkout, name).read_text(encoding="utf-8")
        removed_text = json.dumps({**record, "state": "removed"}, indent=2) + "\n"
        written, commit = _write_and_commit(
            checkout,
            name,
            edits,
            removed_text,
            message,
            lambda: _write_record_text(checkout, name, installed_text),
        )
        shutil.rmtree(checkout.state_dir / name)
        prune_empty_dirs(checkout.root, [e.rel for e in edits if e.new is None])
        result = InstallResult(written, commit, removed=True)
        result.notes = _detached_note(checkout, result.commit)
        return result


def _write_and_commit(
    checkout: gitrepo.Checkout,
    name: str,
    edits: Sequence[Edit],
    record_text: str,
    message: str,
    undo_record: Callable[[], None],
) -> tuple[list[str], str | None]:
    """Write the edits and the record under a journal, then commit. A failing commit puts
    the files and the index back and calls ``undo_record``: nothing was changed."""
    journal = gitrepo.journal_dir(checkout)
    with journaled(journal, checkout.root, edits, _record_path(checkout, name), record_text):
        written = apply_edits(checkout.root, edits)
        _write_record_text(checkout, name, record_text)
    try:
        return written, _commit(checkout, written, message)
    except UserError as exc:
        undo_record()  # first: whatever the undo meets, no record claims the install
        _undo(checkout, edits, written)
        raise UserError(f"{exc}\nNothing was changed.") from None


def finish_interrupted(checkout: gitrepo.Checkout, name: str) -> str | None:
    """Complete an install or removal that was killed between its record and its commit:
    the files hold exactly what the record says, so the commit is made now. Returns
    ``removed`` when a removal was completed (its record is dropped), else ``None``."""
    data = _read_record(checkout, name)
    if data is None:
        return None
    removed = data.get("state") == "removed"
    completed = False
    if checkout.repo is not None and gitrepo.head_commit(checkout.repo) is not None:
        dirty = gitrepo.dirty_paths(checkout.repo, list(data["files"]), untracked=True)
        if dirty:
            key = "original_sha" if removed else "written"
            if all(
                _sha_of(checkout.root / rel) == data["files"][rel].get(key)
                or (removed and key == "original_sha" and not data["files"][rel]["existed"])
                for rel in dirty
            ):
                gitrepo.commit_paths(checkout.repo, dirty, str(data.get("message", name)))
                completed = True
    if removed:
        shutil.rmtree(checkout.state_dir / name, ignore_errors=True)
        return "removed"
    return "installed" if completed else None


def prune_empty_dirs(root: Path, removed: Sequence[str]) -> None:
    """The folders that removing the files ``removed`` (relative to ``root``) left empty, gone
    too (the runtime's package, its saver's parts), up to the first that holds anything else:
    an install leaves no trace. Safe to skip (a kill before it leaves empty folders only)."""
    for rel in removed:
        folder = (root / rel).parent
        while folder != root and root in folder.parents:
            try:
                folder.rmdir()  # only an empty one
            except OSError:
                break
            folder = folder.parent


def _sha_of(path: Path) -> str | None:
    text = read_exact(path)
    return None if text is None else sha256_text(text)


def _undo(checkout: gitrepo.Checkout, edits: Sequence[Edit], written: Sequence[str]) -> None:
    """Put the written files back and take them out of the index again (only those paths:
    the user's own staged changes are never touched)."""
    back = [Edit(e.rel, e.new, e.old) for e in edits if e.rel in written]
    apply_edits(checkout.root, back)
    if checkout.repo is not None and written and gitrepo.head_commit(checkout.repo):
        try:
            gitrepo.run_git(checkout.repo, "reset", "--quiet", "--", *written)
        except UserError as exc:  # the files are back; say what git could not unstage
            raise UserError(
                f"{exc}\nThe files are back as they were, but git could not unstage "
                f"{', '.join(written)}: run 'git reset -- {' '.join(written)}'."
            ) from None


def _detached_note(checkout: gitrepo.Checkout, commit: str | None) -> list[str]:
    """The warning ``set`` gives too: a commit on a detached HEAD is on no branch."""
    if commit is None or checkout.repo is None or not checkout.repo.head.is_detached:
        return []
    return [
        f"HEAD is detached: commit {commit[:12]} is on no branch; keep it with "
        "'git switch -c <branch>'."
    ]


def preconditions(checkout: gitrepo.Checkout, files: Sequence[str]) -> None:
    """What every install, removal and upgrade requires: no links among ``files``, no
    git index lock, no active ``set``, and ``files`` without uncommitted changes."""
    refuse_links(checkout.root, files)
    if checkout.repo is not None:
        gitrepo.refuse_index_lock(checkout.repo)
    if gitrepo.load_state(checkout):
        raise UserError("a quantpatch set is active; run 'quantpatch restore' first.")
    if checkout.repo is not None:
        dirty = gitrepo.dirty_paths(checkout.repo, files)
        if dirty:
            raise UserError(
                f"uncommitted changes to {', '.join(dirty)}; commit or stash them first."
            )


def _commit(checkout: gitrepo.Checkout, written: Sequence[str], message: str) -> str | None:
    if checkout.repo is None or not written or gitrepo.head_commit(checkout.repo) is None:
        return None
    return gitrepo.commit_paths(checkout.repo, list(written), message)


# -- upgrades: every install's files, records and originals replaced as one change -------------

UPGRADE_RECORD = "upgrade.json"


def upgrade_record(checkout: gitrepo.Checkout) -> Path:
    return checkout.state_dir / UPGRADE_RECORD


def upgrade_interrupted(checkout: gitrepo.Checkout) -> bool:
    """Whether a ``quantpatch upgrade`` was killed before it finished: while writing its files
    (its journal's commit point is the upgrade's record) or after (the record is there). Its
    files then differ from the install records until ``quantpatch upgrade`` completes it."""
    if upgrade_record(checkout).exists():
        return True
    return journal_record(gitrepo.journal_dir(checkout)) == upgrade_record(checkout)


def upgrade_record_text(
    state: dict[str, str | None],
    files: Sequence[str],
    message: str,
    notes: Sequence[str],
    texts: dict[str, str | None] | None = None,
) -> str:
    """The upgrade's commit point: the state files it leaves (records and kept originals,
    relative to the state directory; None: removed), the work-tree files to commit, the
    commit message, and what it writes in each of those files (``texts``: the completion
    checks the files against it, not the record's word)."""
    body = {
        "state": state,
        "files": list(files),
        "message": message,
        "notes": list(notes),
        "texts": texts or {},
    }
    return json.dumps(body, indent=2) + "\n"


def refuse_scheme_branch(checkout: gitrepo.Checkout) -> None:
    """An upgrade (or the completion of an interrupted one) commits on the current branch,
    which must be the base: never one of quantpatch's scheme branches."""
    if checkout.repo is None:
        return
    from quantpatch.base.config import load_targets
    from quantpatch.git import scheme_branch

    branch = gitrepo.active_branch(checkout.repo)
    if scheme_branch.is_scheme_branch(branch, load_targets(checkout.root).branch_prefix):
        if gitrepo.load_state(checkout):  # a set put it there: restore is the way back
            raise UserError("a quantpatch set is active; run 'quantpatch restore' first.")
        raise UserError(
            f"HEAD is on a scheme branch ({branch}): quantpatch's own commit is there, and "
            "the upgrade belongs on your branch; check it out ('git checkout <branch>') and "
            "run upgrade again (nothing was upgraded)."
        )


def refuse_pending_upgrade(checkout: gitrepo.Checkout, doing: str) -> None:
    """An interrupted ``upgrade`` blocks ``doing`` (a ``set`` would build scheme branches on
    a half-upgraded base) until ``quantpatch upgrade`` completes it."""
    if upgrade_record(checkout).is_file():
        raise UserError(
            f"an interrupted 'quantpatch upgrade' is unfinished; run 'quantpatch upgrade' to "
            f"complete it before {doing} (nothing was changed)."
        )


def finish_upgrade(checkout: gitrepo.Checkout) -> list[str] | None:
    """Complete an upgrade whose files are written (its record is the commit point): write
    the install records and kept originals it names, commit its files, drop its record.
    Idempotent, so a kill anywhere in it is finished by the next call. Returns the upgrade's
    notes, None where no upgrade was pending."""
    path = upgrade_record(checkout)
    if not path.is_file():
        return None
    refuse_scheme_branch(checkout)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        state: dict[str, str | None] = data["state"]
        files: list[str] = data["files"]
        message = str(data["message"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise UserError(
            f"{path}: the record of an interrupted 'quantpatch upgrade' is unreadable; check "
            "the installed files against git, then remove it."
        ) from None
    notes = [str(n) for n in data.get("notes", [])]
    texts = data.get("texts") or {}
    if not isinstance(texts, dict):
        texts = {}
    stale = [
        Edit(rel, current, want)
        for rel, want in texts.items()
        if rel in files and (current := read_exact(checkout.root / rel)) != want
    ]
    if stale:  # the files as the upgrade wrote them, checked anew (discarded by hand, say)
        apply_edits(checkout.root, stale)
        notes += [
            f"{e.rel} was not as the interrupted upgrade wrote it: written again." for e in stale
        ]
    for rel, text in state.items():
        target = checkout.state_dir / rel
        if read_exact(target) == text:
            continue
        faults.step(f"write upgrade state {rel}", done=False)
        if text is None:
            target.unlink(missing_ok=True)
        else:
            write_exact(target, text)
        faults.step(f"write upgrade state {rel}", done=True)
    if checkout.repo is not None and gitrepo.head_commit(checkout.repo) is not None:
        dirty = gitrepo.dirty_paths(checkout.repo, files, untracked=True)
        if dirty:
            try:
                gitrepo.commit_paths(checkout.repo, dirty, message)
            except UserError as exc:
                raise UserError(
                    f"{exc}\nThe upgrade is written but not committed; run 'quantpatch "
                    "upgrade' again to commit it."
                ) from None
    faults.step("drop upgrade record", done=False)
    path.unlink()
    faults.step("drop upgrade record", done=True)
    return notes
