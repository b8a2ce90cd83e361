"""One git worktree per quantization scheme, so that many runs can start from one checkout.

``ensure_worktree`` gives the path of a worktree whose files hold the requested values: it
builds the scheme's branch ``<prefix>/linear-X_qk-Y_pv-Z`` on the base's current tip with git's
plumbing (``scheme_branch``), so that the user's own work tree, index and HEAD are never
touched, and reuses the branch and the worktree while they sit on that tip.
Worktrees live under ``<git common dir>/quantpatch/worktrees/`` (or ``$QUANTPATCH_WORKTREES``)
and are always detached at the branch tip, so one scheme can also be checked out by ``set``.
Creation is serialized by the checkout's lock (waited for, not refused).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import git

from quantpatch.base.config import (
    GEMMS,
    ROLES,
    Targets,
    load_targets,
    per_gemm,
    validate_bf16_layers,
    validate_value,
)
from quantpatch.base.errors import UserError
from quantpatch.checkout.switch import base_tip, plan_from_base
from quantpatch.git import repo as gitrepo
from quantpatch.git import scheme_branch
from quantpatch.git.state import Base, Mode
from quantpatch.sites import cache as site_cache
from quantpatch.sites.model import role_values

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


def _wrong_values(
    path: Path, values: Mapping[str, str]
) -> tuple[gitrepo.Checkout, Targets, dict[str, str | None]]:
    """The worktree at ``path``, its targets, and the roles whose values differ from
    ``values``."""
    wt = gitrepo.find_checkout(path, need_git=True)
    targets = load_targets(wt.root)
    sites = [s for f in site_cache.read_sites(wt.root, targets, wt.state_dir / "cache") for s in f]
    got, _ = role_values(sites)
    from quantpatch.checkout.switch import policy_in

    policy = policy_in(wt.root, targets)
    got["bf16_layers"] = (policy.value or None) if policy is not None else None
    want = {**values, "bf16_layers": values.get("bf16_layers") or None}
    return wt, targets, {r: got.get(r) for r in want if got.get(r) != want[r]}


def _verify(path: Path, values: Mapping[str, str], name: str) -> None:
    wt, targets, wrong = _wrong_values(path, values)
    with wt:
        dirty = gitrepo.dirty_paths(wt.git(), targets.all_files)
    if wrong or dirty:
        raise UserError(
            f"{path}: the worktree does not hold {name} "
            f"({'dirty: ' + ', '.join(dirty) if dirty else f'found {wrong}'}); remove it with "
            f"'git worktree remove --force {path}' (which discards its uncommitted edits)."
        )


def _checked_out_here(repo: git.Repo, name: str) -> bool:
    return gitrepo.active_branch(repo) == name


def _all_gemms(values: Mapping[str, str]) -> bool:
    return all(g in values for g in GEMMS)


def scheme_values(values: Mapping[str, str]) -> dict[str, str]:
    """``values`` in their one form (``per_gemm``): a worktree's branch, its commit and its
    check all read the linear GEMMs the same way however they were named."""
    out = per_gemm(dict(values))
    if "bf16_layers" in out:  # 'none' and '' are no policy: no key, as set resolves it
        out["bf16_layers"] = validate_bf16_layers(out["bf16_layers"])
        if not out["bf16_layers"]:
            del out["bf16_layers"]
    return out


def _locate(
    path: Path | None, values: Mapping[str, str], *, allow_unknown: bool
) -> tuple[gitrepo.Checkout, git.Repo, Targets, str, Path]:
    """The checkout, its targets, the scheme's branch name and its worktree's path."""
    missing = [r for r in ROLES if r not in values and (r != "linear" or not _all_gemms(values))]
    if missing:
        raise UserError(f"worktree: give all three roles (missing: {', '.join(missing)}).")
    for role, value in values.items():
        if role == "bf16_layers":
            validate_bf16_layers(value)
            continue
        where = "linear" if role in GEMMS else role
        validate_value(value, allow_unknown=allow_unknown, where=f"--{role}", role=where)
    checkout = gitrepo.find_checkout(path, need_git=True)
    repo = checkout.git()
    targets = load_targets(checkout.root)
    name = scheme_branch.branch_name(values, targets.branch_prefix)
    return checkout, repo, targets, name, worktrees_root(repo) / name.replace("/", "__")


def ensure_worktree(
    path: Path | None,
    values: Mapping[str, str],
    *,
    split: bool = True,
    allow_unknown: bool = False,
    wait: float = LOCK_WAIT_S,
) -> WorktreeResult:
    """The scheme's worktree, detached at its branch, which always sits on the base's current
    tip (rebuilt when the base has moved on, the user's own commits on it carried over).
    Commits made in the worktree itself are put on the branch first, so they are carried
    too; a worktree with uncommitted changes, or a checkout in the middle of a rebase, merge,
    cherry-pick or bisect, is refused before anything is changed."""
    values = scheme_values(values)
    checkout, repo, targets, name, wt_path = _locate(path, values, allow_unknown=allow_unknown)
    with gitrepo.locked(checkout, wait=wait), contextlib.ExitStack() as opened:
        gitrepo.refuse_operation_in_progress(checkout)
        scheme_branch.check_prefix(repo, targets)
        state = gitrepo.load_state(checkout)
        head = gitrepo.head_commit(repo)
        if state and state.mode is Mode.BRANCH:
            base = state.base
        elif head is not None and not scheme_branch.is_scheme_branch(
            gitrepo.active_branch(repo), targets.branch_prefix
        ):
            base = Base(gitrepo.active_branch(repo), head)
        elif head is not None:
            raise UserError(
                f"HEAD is on the scheme branch {gitrepo.active_branch(repo)} with no quantpatch "
                "record; run 'quantpatch set' (which recovers the base) or check out your branch."
            )
        else:
            raise UserError(f"{checkout.root}: the repository has no commit yet.")
        tip = base_tip(repo, base)
        base = replace(base, commit=tip)
        _, planned = plan_from_base(
            repo,
            tip,
            targets,
            values,
            split,
            checkout.state_dir / "cache",
            known=None if allow_unknown else values,
        )
        wt = _open_worktree(repo, checkout.root, wt_path)
        if wt is not None:
            opened.callback(wt.close)  # its git processes end with the command
            _refuse_dirty(wt, wt_path, name)
        kept = _keep_worktree_commits(repo, wt, wt_path, name) if wt is not None else None
        try:
            plan = scheme_branch.plan_scheme_commit(repo, name, base, tip, planned, values)
            if plan.moves and _checked_out_here(repo, name):
                raise UserError(
                    f"{name} is checked out in {checkout.root} and the base has moved on; run "
                    "'quantpatch set' there (it rebuilds the branch with your changes kept) first."
                )
        except UserError:
            if kept is not None:  # the branch back where it was: nothing changed
                with contextlib.suppress(UserError):
                    old, new = kept
                    gitrepo.run_git(repo, "update-ref", f"refs/heads/{name}", old, new)
            raise
        scheme_branch.move_ref(repo, plan)
        created = _place_worktree(repo, wt_path, wt, plan.commit)
        _verify(wt_path, values, name)
        return WorktreeResult(wt_path, name, plan.commit, plan.state != "reused", created)


def left_out(path: Path | None) -> str | None:
    """What a run from the checkout at ``path`` will not include: it trains the scheme's
    worktree, built from commits, so the checkout's uncommitted changes to tracked files
    (target files too) are left out. One sentence naming them, or ``None``."""
    with gitrepo.find_checkout(path, need_git=False) as checkout:
        if not checkout.has_git:
            return None  # the script itself says that it needs a git checkout
        dirty = gitrepo.dirty_paths(checkout.git(), [])
    if not dirty:
        return None
    shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
    return (
        f"the run trains committed code only: your uncommitted changes to {shown} in "
        f"{checkout.root} are not included (commit them to include them)."
    )


def _linked(wt_path: Path) -> bool:
    """Whether the worktree's ``.git`` file and its administrative directory in the checkout
    name each other (a moved checkout leaves both pointing at the old place)."""
    try:
        link = (wt_path / ".git").read_text(encoding="utf-8").strip().removeprefix("gitdir: ")
        admin = (wt_path / link).resolve()
        back = (admin / "gitdir").read_text(encoding="utf-8").strip()
    except OSError:
        return False
    return (admin / back).resolve() == (wt_path / ".git").resolve()


def _reconnect(repo: git.Repo, root: Path) -> None:
    """``git worktree repair`` for quantpatch's worktrees whose links broke (the checkout was
    moved), then ``prune``: pruning first would delete what repair needs."""
    broken = []
    if root.is_dir():
        broken = [str(p) for p in sorted(root.iterdir()) if (p / ".git").is_file()]
        broken = [p for p in broken if not _linked(Path(p))]
    if broken:
        with contextlib.suppress(UserError):  # one it cannot repair is named below
            gitrepo.run_git(repo, "worktree", "repair", *broken)
    gitrepo.run_git(repo, "worktree", "prune")


def _open_worktree(repo: git.Repo, checkout_root: Path, wt_path: Path) -> git.Repo | None:
    """The scheme's worktree as it is (``None`` when there is none yet). A directory left by
    an interrupted ``worktree add`` is removed; links broken by a move are repaired."""
    if wt_path.exists() and not (wt_path / ".git").is_file():
        shutil.rmtree(wt_path)  # ours, under the git dir: an add that never finished
    _reconnect(repo, wt_path.parent)
    if not (wt_path / ".git").is_file():
        return None
    try:
        return gitrepo.open_repo(wt_path)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise UserError(
            f"{wt_path}: the worktree lost its link to {checkout_root} (was the checkout "
            f"moved?) and 'git worktree repair' could not restore it; move away or delete that "
            "directory (its commits are on its scheme branch or in git's objects) and run this "
            "again."
        ) from None


def _refuse_dirty(wt: git.Repo, wt_path: Path, name: str) -> None:
    """A run in a worktree with uncommitted edits would not be the commit it logs."""
    dirty = gitrepo.dirty_paths(wt, [])
    if dirty:
        shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
        raise UserError(
            f"{wt_path}: the worktree of {name} has uncommitted changes to {shown}, so a run "
            "there would not be the commit it records; commit them there (quantpatch keeps "
            f"them on {name}) or discard them with 'git -C {wt_path} reset --hard', then run "
            "this again."
        )


def _keep_worktree_commits(
    repo: git.Repo, wt: git.Repo, wt_path: Path, name: str
) -> tuple[str, str] | None:
    """Commits made in the detached worktree are on no branch: moving the worktree would
    orphan them. When they sit on the scheme branch's tip, the branch is moved onto them
    (``set`` and this command then carry them like any commit of the user's on the branch);
    otherwise the command is refused, naming them. Returns (old tip, new tip) when moved."""
    head = gitrepo.head_commit(wt)
    if head is None or not wt.head.is_detached:
        return None  # a worktree switched to a branch of its own: its commits have a ref
    lost = gitrepo.run_git(repo, "rev-list", "--single-worktree", head, "--not", "--all").split()
    if not lost:
        return None
    tip = gitrepo.branch_tip(repo, name)
    if (
        tip is not None
        and not _checked_out_here(repo, name)
        and gitrepo.run_git(repo, "merge-base", tip, head).strip() == tip
    ):
        gitrepo.run_git(repo, "update-ref", f"refs/heads/{name}", head, tip)
        return tip, head
    shown = ", ".join(f"{c[:12]} '{repo.commit(c).summary!s}'" for c in list(reversed(lost))[:5])
    raise UserError(
        f"{wt_path}: the worktree holds {len(lost)} commit(s) on no branch ({shown}) that "
        f"are not on {name}; keep them with 'git -C {wt_path} branch <name>' (or "
        f"cherry-pick them onto {name}), then run this again."
    )


def _place_worktree(repo: git.Repo, wt_path: Path, wt: git.Repo | None, commit: str) -> bool:
    """Make the detached worktree at ``commit``, or move ``wt`` (the existing one, clean and
    with no commits of its own left off the branch) there; True when it was created."""
    if wt is not None:
        if wt.head.commit.hexsha != commit:
            gitrepo.run_git(wt, "checkout", "--quiet", "--detach", commit)
        return False
    wt_path.parent.mkdir(parents=True, exist_ok=True)
    gitrepo.run_git(repo, "worktree", "add", "--quiet", "--detach", str(wt_path), commit)
    return True


def existing_worktree(path: Path | None, values: Mapping[str, str]) -> WorktreeResult:
    """The scheme's worktree as it was prepared (``gen-scripts --prepare`` or ``worktree``),
    verified without taking the lock or writing anything (git runs without optional locks):
    what a job on a compute node does, so that jobs sharing one filesystem never race to
    create or move a worktree. Refused unless it is exactly its branch's tip, clean, holds the
    values, and still sits on the base's current tip (a base that moved on means the job
    would train code older than the checkout's)."""
    values = scheme_values(values)
    checkout, repo, targets, name, wt_path = _locate(path, values, allow_unknown=False)
    again = "run 'quantpatch gen-scripts --prepare' (or 'quantpatch worktree') in the checkout"
    if not (wt_path / ".git").is_file():
        raise UserError(
            f"{name} has no prepared worktree in {checkout.root} (looked for {wt_path}); "
            f"{again} before submitting."
        )

    def plain(cwd: Path, *args: str) -> str:
        return gitrepo.git_plain(cwd, *args).stdout.strip()

    head = plain(wt_path, "rev-parse", "HEAD")
    tip = plain(checkout.root, "rev-parse", "--verify", "-q", f"refs/heads/{name}")
    if not head or head != tip:
        raise UserError(
            f"{wt_path}: the worktree is at {head[:12] or 'no commit'} but {name} is at "
            f"{tip[:12] or 'nothing'}; {again}."
        )
    # not plain(): stripping the output would cut the status column of the first line
    dirty = gitrepo.git_plain(wt_path, "status", "--porcelain", "--untracked-files=no").stdout
    if dirty.strip():
        raise UserError(
            f"{wt_path}: the worktree has uncommitted changes "
            f"({', '.join(line[3:] for line in dirty.splitlines()[:3])}); commit them there, "
            f"or discard them by removing it with 'git worktree remove --force {wt_path}' "
            f"(this deletes those edits), and {again}."
        )
    state = gitrepo.load_state(checkout)
    base: Base | None = None
    if state and state.mode is Mode.BRANCH:
        base = state.base
    else:
        branch = gitrepo.active_branch(repo)
        if branch and not scheme_branch.is_scheme_branch(branch, targets.branch_prefix):
            base = Base(branch, gitrepo.head_commit(repo))
    if base is not None:
        base_commit = base_tip(repo, base)
        if gitrepo.git_plain(wt_path, "merge-base", "--is-ancestor", base_commit, head).returncode:
            raise UserError(
                f"{base.branch or 'the base'} has moved on to {base_commit[:12]} since "
                f"the worktree of {name} was prepared (at {head[:12]}): the job would train "
                f"older code; {again}."
            )
    _, _, wrong = _wrong_values(wt_path, values)
    if wrong:
        raise UserError(f"{wt_path}: the worktree does not hold {name} (found {wrong}); {again}.")
    return WorktreeResult(wt_path, name, head, False, False)
