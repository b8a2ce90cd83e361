"""One git worktree per quantization scheme, so that many runs can start from one checkout.

``ensure_worktree`` gives the path of a worktree whose files hold the requested values: it
makes the scheme's branch ``quant/linear-X_qk-Y_pv-Z`` from the recorded base (or HEAD) when it
does not exist yet, committing inside a fresh detached worktree so that the user's own work
tree, index and HEAD are never touched, and reuses the branch and the worktree afterwards.
Worktrees live under ``<git common dir>/quantpatch/worktrees/`` (or ``$QUANTPATCH_WORKTREES``)
and are always detached at the branch tip, so one scheme can also be checked out by ``set``.
Creation is serialized by the checkout's lock (waited for, not refused).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import git

from quantpatch import repo as gitrepo
from quantpatch import site_cache
from quantpatch.config import ROLES, load_targets, validate_value
from quantpatch.edits import Edit, apply_edits
from quantpatch.errors import UserError
from quantpatch.site_model import role_values
from quantpatch.switch import branch_name, commit_message, plan_from_base

LOCK_WAIT_S = 300.0


@dataclass
class WorktreeResult:
    path: Path
    branch: str
    commit: str
    created_branch: bool
    created_worktree: bool


def worktrees_root(repo: git.Repo) -> Path:
    override = os.environ.get("QUANTPATCH_WORKTREES")
    return Path(override) if override else Path(repo.common_dir) / "quantpatch" / "worktrees"


def _verify(path: Path, values: Mapping[str, str]) -> None:
    wt = gitrepo.find_checkout(path, need_git=True)
    targets = load_targets(wt.root)
    sites = [s for f in site_cache.read_sites(wt.root, targets, wt.state_dir / "cache") for s in f]
    got, _ = role_values(sites)
    wrong = {r: got[r] for r in values if got.get(r) != values[r]}
    dirty = gitrepo.dirty_paths(wt.git(), targets.all_files)
    if wrong or dirty:
        raise UserError(
            f"{path}: the worktree does not hold {branch_name(values)} "
            f"({'dirty: ' + ', '.join(dirty) if dirty else f'found {wrong}'}); remove it with "
            f"'git worktree remove --force {path}'."
        )


def ensure_worktree(
    path: Path | None,
    values: Mapping[str, str],
    *,
    split: bool = True,
    allow_unknown: bool = False,
    wait: float = LOCK_WAIT_S,
) -> WorktreeResult:
    missing = [r for r in ROLES if r not in values]
    if missing:
        raise UserError(f"worktree: give all three roles (missing: {', '.join(missing)}).")
    for role in ROLES:
        validate_value(values[role], allow_unknown=allow_unknown, where=f"--{role}")
    checkout = gitrepo.find_checkout(path, need_git=True)
    repo = checkout.git()
    name = branch_name(values)
    wt_path = worktrees_root(repo) / name.replace("/", "__")
    with gitrepo.locked(checkout, wait=wait):
        if (wt_path / ".git").exists():
            _verify(wt_path, values)
            commit = git.Repo(wt_path).head.commit.hexsha
            return WorktreeResult(wt_path, name, commit, False, False)
        state = gitrepo.load_state(checkout)
        head = gitrepo.head_commit(repo)
        if state and state["mode"] == "branch":
            base = dict(state["base"])
        elif head is not None:
            base = {"branch": gitrepo.active_branch(repo), "commit": head}
        else:
            raise UserError(f"{checkout.root}: the repository has no commit yet.")
        targets = load_targets(checkout.root)
        base_texts, planned = plan_from_base(
            repo, base["commit"], targets, values, split, checkout.state_dir / "cache"
        )
        tip = gitrepo.branch_tip(repo, name)
        if tip is not None:
            differs = [r for r in planned if gitrepo.read_at(repo, tip, r) != planned[r]]
            if differs:
                raise UserError(
                    f"branch {name} exists but its {', '.join(differs)} differ from what the "
                    f"base {base['commit'][:12]} would give; delete the branch or restore first."
                )
            gitrepo.run_git(repo, "worktree", "add", "--quiet", "--detach", str(wt_path), tip)
            _verify(wt_path, values)
            return WorktreeResult(wt_path, name, tip, False, True)
        wt_path.parent.mkdir(parents=True, exist_ok=True)
        gitrepo.run_git(
            repo, "worktree", "add", "--quiet", "--detach", str(wt_path), base["commit"]
        )
        try:
            written = apply_edits(wt_path, [Edit(r, base_texts[r], planned[r]) for r in planned])
            wt_repo = git.Repo(wt_path)
            commit = base["commit"]
            if written:
                commit = gitrepo.commit_paths(
                    wt_repo, written, commit_message(values, base, written)
                )
            gitrepo.run_git(repo, "branch", name, commit)
        except BaseException:
            with contextlib.suppress(UserError):
                gitrepo.run_git(repo, "worktree", "remove", "--force", str(wt_path))
            raise
        _verify(wt_path, values)
        return WorktreeResult(wt_path, name, commit, True, True)
