"""``quantpatch upgrade``: bring every part an earlier quantpatch installed to this version.

From each install's kept originals (``init``'s, then ``saver install``'s on what ``init``
wrote), this version's installs are computed anew: runtime modules replaced (new ones added,
ones this version no longer installs put back as they were), codemods re-applied to the
original sources. The files, the install records and the kept originals change as one
recorded commit on the current branch (the base: no ``set`` may be active), so scheme branches
and worktrees made before it sit on an old tip and are rebuilt the next time they are used,
and ``init --remove`` / ``saver remove`` still restore the original bytes.

A file changed by hand since it was installed is refused by name; ``--force`` overwrites it
(the note names what is lost). Kill-safe: the files are written under a journal whose commit
point is the upgrade's own record, which the next ``upgrade`` (or install, or removal)
completes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantpatch import __version__
from quantpatch.base import faults
from quantpatch.base.config import Targets, load_targets
from quantpatch.base.edits import (
    Edit,
    apply_edits,
    journaled,
    read_exact,
    sha256_text,
    write_exact,
)
from quantpatch.base.errors import UserError
from quantpatch.checkout.parts import (
    INIT,
    RUNTIME_MODULES,
    SAVER,
    SAVER_MODULES,
    record_extra,
    runtime_source,
)
from quantpatch.git import repo as gitrepo
from quantpatch.git.installs import (
    InstallResult,
    finish_upgrade,
    preconditions,
    prune_empty_dirs,
    record_of,
    refuse_scheme_branch,
    upgrade_record,
    upgrade_record_text,
)


def _order(records: dict[str, dict[str, Any]], rel: str) -> list[str]:
    """The installs that wrote ``rel``, in the order they wrote it (each one's original is
    the previous one's output)."""
    names = [n for n in (INIT, SAVER) if n in records and rel in records[n]["files"]]
    if len(names) == 2:
        first, second = (records[n]["files"][rel] for n in names)
        if first.get("original_sha") == second["written"]:
            names.reverse()
    return names


def _new_modules(records: dict[str, dict[str, Any]]) -> list[str]:
    """The runtime files this version's installs copy (``init``'s, ``saver install``'s): a
    part new in this version is added by the upgrade (the single-file saver of earlier
    versions gains its parts)."""
    return [
        *(RUNTIME_MODULES if INIT in records else ()),
        *(SAVER_MODULES if SAVER in records else ()),
    ]


def _original(checkout: gitrepo.Checkout, name: str, rel: str, info: dict[str, Any]) -> str | None:
    if not info["existed"]:
        return None
    kept = checkout.state_dir / name / "originals" / rel
    text = read_exact(kept)
    want = info.get("original_sha")
    if text is None or (want and sha256_text(text) != want):
        raise UserError(
            f"{kept}: the kept original of {rel} is missing or altered; nothing was upgraded."
        )
    return text


def _output(name: str, rel: str, text: str | None, targets: Targets) -> str | None:
    """What this version's install ``name`` writes at ``rel`` given the text it finds there."""
    if name == INIT:
        if rel in RUNTIME_MODULES:
            return runtime_source(rel)
        if rel in targets.all_files and text is not None:
            from quantpatch.checkout.init import init_text

            new, _ = init_text(text, rel, targets.kind_of(rel))
            return text if new is None else new
        return text  # a module this version no longer installs: back as it was
    if rel in SAVER_MODULES:
        return runtime_source(rel)
    from quantpatch.checkout.saver import instrumented_files
    from quantpatch.sites.codemods.saver import instrument

    kind = instrumented_files(targets).get(rel)
    if kind is None or text is None:
        return text
    return instrument(text, rel, kind)


def _plan(
    checkout: gitrepo.Checkout, records: dict[str, dict[str, Any]], force: bool
) -> tuple[list[Edit], dict[str, str | None], list[str]]:
    root = checkout.root
    targets = load_targets(root)
    rels = list(dict.fromkeys(r for rec in records.values() for r in rec["files"]))
    rels += [r for r in _new_modules(records) if r not in rels]  # parts new in this version
    new_files: dict[str, dict[str, Any]] = {n: {} for n in records}
    head = gitrepo.head_commit(checkout.repo) if checkout.repo is not None else None
    state: dict[str, str | None] = {}
    edits: list[Edit] = []
    notes: list[str] = []
    for rel in rels:
        current = read_exact(root / rel)
        order = _order(records, rel) or [SAVER if rel in SAVER_MODULES else INIT]
        first = order[0]
        if rel in records[first]["files"]:
            text = _original(checkout, first, rel, records[first]["files"][rel])
            written = records[order[-1]]["files"][rel]["written"]
            if current is None or sha256_text(current) != written:
                if not force:
                    raise UserError(
                        f"{rel} was edited by hand since quantpatch installed it; 'quantpatch "
                        "upgrade --force' overwrites it (the edits are lost); nothing was "
                        "upgraded."
                    )
                # the edit is committed (an upgrade refuses uncommitted changes): say where
                kept = (
                    f"; the edited file stays in commit {head[:12]} ('git show {head[:12]}:{rel}')"
                    if head
                    else ""
                )
                notes.append(f"{rel}: its hand edits were overwritten (--force){kept}.")
        else:  # a module new in this version: nothing of the checkout's own may be there
            if current is not None and current != runtime_source(rel):
                raise UserError(
                    f"{rel}: a different file is already there; move it away first (nothing "
                    "was upgraded)."
                )
            text = None
        for name in order:
            out = _output(name, rel, text, targets)
            if out != text:
                new_files[name][rel] = {
                    "existed": text is not None,
                    "written": sha256_text(out or ""),
                    "original_sha": None if text is None else sha256_text(text),
                }
                if text is not None:
                    state[f"{name}/originals/{rel}"] = text
            text = out
        if text != current:
            edits.append(Edit(rel, current, text))
    for name, record in records.items():
        body = {**record, "files": new_files[name], **record_extra(name)}
        state[f"{name}/record.json"] = json.dumps(body, indent=2) + "\n"
    return edits, state, notes


def upgrade(path: Path | None, *, force: bool = False) -> InstallResult:
    checkout = gitrepo.find_checkout(path, need_git=False)
    with gitrepo.locked(checkout):
        gitrepo.recover(checkout)
        refuse_scheme_branch(checkout)
        finished = finish_upgrade(checkout)
        if finished is not None:  # killed after its files were written: now complete
            head = gitrepo.head_commit(checkout.repo) if checkout.repo is not None else None
            done = InstallResult([], head, removed=False)
            done.notes = [*finished, "completed the interrupted 'quantpatch upgrade'."]
            return done
        records = {n: r for n in (INIT, SAVER) if (r := record_of(checkout, n)) is not None}
        if not records:
            raise UserError(
                f"{checkout.root}: nothing installed by quantpatch ('init', 'saver install'); "
                "nothing to upgrade."
            )
        files = list(dict.fromkeys([*(r for rec in records.values() for r in rec["files"])]))
        files += [r for r in _new_modules(records) if r not in files]
        preconditions(checkout, files)
        edits, state, notes = _plan(checkout, records, force)
        if not edits and all(
            read_exact(checkout.state_dir / rel) == text for rel, text in state.items()
        ):
            return InstallResult([], None, removed=False, changed=False)
        message = f"quantpatch upgrade: the installed parts to quantpatch {__version__}"
        written = [e.rel for e in edits]
        if checkout.repo is not None and written and gitrepo.active_branch(checkout.repo) is None:
            notes.append(
                "HEAD is detached: the upgrade commit is on no branch; 'git branch <name>' "
                "keeps it before you check out another branch."
            )
        texts = {e.rel: e.new for e in edits}
        text = upgrade_record_text(state, written, message, notes, texts)
        journal = gitrepo.journal_dir(checkout)
        with journaled(journal, checkout.root, edits, upgrade_record(checkout), text):
            apply_edits(checkout.root, edits)
            faults.step("write upgrade record", done=False)
            write_exact(upgrade_record(checkout), text)
            faults.step("write upgrade record", done=True)
        finish_upgrade(checkout)
        prune_empty_dirs(checkout.root, [e.rel for e in edits if e.new is None])
        head = gitrepo.head_commit(checkout.repo) if checkout.repo is not None else None
        result = InstallResult(written, head if written else None, removed=False)
        result.notes = notes
        return result
