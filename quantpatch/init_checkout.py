"""``quantpatch init``: make a stock Megatron checkout a quantization test bed, and undo it.

``init`` inserts fork-layout sites (value ``bf16``, so the checkout computes exactly as before)
into the two target files and installs ``megatron/core/quantpatch_ops.py`` (a verbatim copy of
``quantpatch/runtime/quantpatch_ops.py``), all-or-nothing, committed on the current branch in a
git checkout. The original bytes are kept under the state directory, so ``init --remove``
restores them exactly (refusing if the files changed since).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from quantpatch import repo as gitrepo
from quantpatch.codemods.init_sites import inject_sites
from quantpatch.config import Targets, load_targets
from quantpatch.edits import Edit, apply_edits
from quantpatch.errors import UserError
from quantpatch.site_model import read_target

OPS_MODULE = "megatron/core/quantpatch_ops.py"
RECORD = "init"


def ops_source() -> str:
    return resources.files("quantpatch").joinpath("runtime/quantpatch_ops.py").read_text("utf-8")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class InitResult:
    files: list[str]
    commit: str | None
    removed: bool


def _read_optional(root: Path, rel: str) -> str | None:
    return read_target(root, rel) if (root / rel).exists() else None


def init(path: Path | None, *, remove: bool = False) -> InitResult:
    checkout = gitrepo.find_checkout(path, need_git=False)
    with gitrepo.locked(checkout):
        if gitrepo.load_state(checkout):
            raise UserError("a quantpatch set is active; run 'quantpatch restore' first.")
        targets = load_targets(checkout.root)
        files = [*targets.all_files, OPS_MODULE]
        if checkout.repo is not None:
            dirty = gitrepo.dirty_paths(checkout.repo, files)
            if dirty:
                raise UserError(
                    f"uncommitted changes to {', '.join(dirty)}; commit or stash them first."
                )
        record_dir = checkout.state_dir / RECORD
        if remove:
            edits = _remove_edits(checkout.root, record_dir)
            message = "quantpatch init --remove: restore the stock sources"
        else:
            edits = _init_edits(checkout.root, record_dir, targets)
            message = (
                "quantpatch init: fork-layout custom_quant_type sites (bf16) and "
                "megatron/core/quantpatch_ops.py"
            )
        written = apply_edits(checkout.root, edits)
        if remove:
            shutil.rmtree(record_dir)
        else:
            _write_record(record_dir, edits)
        commit = None
        if checkout.repo is not None and written and gitrepo.head_commit(checkout.repo):
            commit = gitrepo.commit_paths(checkout.repo, written, message)
        return InitResult(written, commit, remove)


def _init_edits(root: Path, record_dir: Path, targets: Targets) -> list[Edit]:
    if (record_dir / "record.json").exists():
        raise UserError(f"{root}: already initialised by quantpatch ('init --remove' undoes it).")
    edits = []
    for rel in targets.all_files:
        text = read_target(root, rel)
        edits.append(Edit(rel, text, inject_sites(text, rel, targets.kind_of(rel))))
    current = _read_optional(root, OPS_MODULE)
    if current is not None and current != ops_source():
        raise UserError(f"{OPS_MODULE}: a different file is already there; move it away first.")
    edits.append(Edit(OPS_MODULE, current, ops_source()))
    return edits


def _write_record(record_dir: Path, edits: list[Edit]) -> None:
    """The original bytes and the hash of what was written (after the write succeeded)."""
    for e in edits:
        if e.old is not None:
            dest = record_dir / "originals" / e.rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(dest, "w", encoding="utf-8", newline="") as fh:
                fh.write(e.old)
    record = {e.rel: {"existed": e.old is not None, "written": _sha(e.new or "")} for e in edits}
    (record_dir / "record.json").write_text(json.dumps(record, indent=2) + "\n")


def _remove_edits(root: Path, record_dir: Path) -> list[Edit]:
    try:
        record = json.loads((record_dir / "record.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{root}: not initialised by quantpatch; nothing to remove.") from None
    edits = []
    for rel, info in record.items():
        current = _read_optional(root, rel)
        if current is None or _sha(current) != info["written"]:
            raise UserError(f"{rel} changed since 'quantpatch init'; revert it first.")
        original = None
        if info["existed"]:
            with open(record_dir / "originals" / rel, encoding="utf-8", newline="") as fh:
                original = fh.read()
        edits.append(Edit(rel, current, original))
    return edits
