"""Scheme branches built with git's plumbing, never through the user's work tree.

A scheme branch ``<prefix>/linear-X_qk-Y_pv-Z`` is always *quantpatch's one commit on the
base's current tip*, followed by whatever commits the user added on it:

- the commit is made from a private index (``read-tree`` of the base tip, the planned blobs
  put in with ``update-index``, ``write-tree``, ``commit-tree``), so the user's work tree,
  index and HEAD are untouched and a failure leaves nothing behind but unreferenced objects;
- an existing branch is reused while it already sits on the base tip with quantpatch's
  commit holding the planned files; when the base has moved on it is rebuilt: quantpatch's
  commit is made again on the new tip and the user's own commits are carried over with
  ``merge-tree`` (refused, naming each commit, when one does not apply cleanly);
- the ref moves with ``update-ref <new> <old>``, which fails if anyone moved it meanwhile.

Commits carry trailers (``Quantpatch-Base-Branch``, ``Quantpatch-Base-Commit``) so the base can
be recovered from the branch alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from io import BytesIO

import git
from gitdb import IStream  # type: ignore[import-untyped]

from quantpatch.base.config import (
    GEMMS,
    KEYS,
    LEGACY_BRANCH_PREFIX,
    Targets,
    linear_text,
    per_gemm,
)
from quantpatch.base.errors import UserError
from quantpatch.git import repo as gitrepo
from quantpatch.git.state import Base

SUBJECT_PREFIX = "quantpatch: linear="
_TRAILER_RE = re.compile(r"^Quantpatch-Base-(Branch|Commit): (\S+)$", re.MULTILINE)
_SCHEME_TAIL = re.compile(
    r"linear-[A-Za-z0-9_.+-]+_qk-[A-Za-z0-9_.+-]+_pv-[A-Za-z0-9_.+-]+"  # _bf16-... included
)


def branch_name(values: Mapping[str, str], prefix: str) -> str:
    """``<prefix>/linear-X_qk-Y_pv-Z``; where the linear GEMMs differ, X is
    ``fprop.A+dgrad.B+wgrad.C`` (a role without a value reads ``none``); a BF16 layer policy
    adds ``_bf16-first2.last8``."""
    full: dict[str, str | None] = {k: v for k, v in values.items() if k in KEYS}
    if any(g in full for g in GEMMS):
        full = dict(per_gemm({k: v for k, v in full.items() if v is not None}))
    full = {k: full.get(k) for k in KEYS}
    linear = linear_text(full) if full["linear"] or any(full[g] for g in GEMMS) else "none"
    tail = f"linear-{linear}_qk-{values.get('qk', 'none')}_pv-{values.get('pv', 'none')}"
    if values.get("bf16_layers"):  # the BF16 layer policy: first:2,last:8 -> bf16-first2.last8
        tail += "_bf16-" + values["bf16_layers"].replace(":", "").replace(",", ".")
    return f"{prefix}/{tail}"


def is_scheme_branch(name: str | None, prefix: str) -> bool:
    """A branch quantpatch names (with the configured or the 0.1 prefix)."""
    if not name:
        return False
    for p in {prefix, LEGACY_BRANCH_PREFIX}:
        if name.startswith(p + "/") and _SCHEME_TAIL.fullmatch(name[len(p) + 1 :]):
            return True
    return False


def check_prefix(repo: git.Repo, targets: Targets) -> None:
    """Refuse a prefix that collides with an existing branch: git cannot hold ``quant`` and
    ``quant/...`` at once (nothing has been changed when this runs)."""
    parts = targets.branch_prefix.split("/")
    for i in range(1, len(parts) + 1):
        ref = "/".join(parts[:i])
        if ref in repo.heads:
            setting = targets.where or "[tool.quantpatch] in pyproject.toml or quantpatch.toml"
            raise UserError(
                f"the branch '{ref}' exists, so git cannot create scheme branches "
                f"'{targets.branch_prefix}/...'; set branch_prefix to another name in {setting}."
            )


def commit_message(values: Mapping[str, str], base: Base, files: list[str]) -> str:
    base_name = base.branch or "detached HEAD"
    return (
        f"{SUBJECT_PREFIX}{linear_text(values, ':', ',')} qk={values.get('qk')} "
        f"pv={values.get('pv')}"
        + (f" bf16_layers={values['bf16_layers']}" if values.get("bf16_layers") else "")
        + "\n\n"
        f"Base: {base_name} @ {base.commit}\n"
        f"Files: {', '.join(files)}\n\n"
        f"Quantpatch-Base-Branch: {base.branch or '-'}\n"
        f"Quantpatch-Base-Commit: {base.commit}\n"
    )


def base_from_commit(repo: git.Repo, commit: str) -> Base | None:
    """The base recorded in a quantpatch commit's trailers (``None`` if it has none)."""
    message = str(repo.commit(commit).message)
    found = dict(_TRAILER_RE.findall(message))
    if "Commit" not in found:
        return None
    branch = found.get("Branch")
    return Base(None if branch in (None, "-") else branch, found["Commit"])


def _is_ours(commit: git.Commit) -> bool:
    return str(commit.message).startswith(SUBJECT_PREFIX)


def _store_blob(repo: git.Repo, text: str) -> str:
    data = text.encode("utf-8")
    stream = repo.odb.store(IStream(b"blob", len(data), BytesIO(data)))
    return str(stream.hexsha.decode("ascii"))


class _PrivateIndex:
    """A temporary index file under the git dir (the user's index is never read or written)."""

    def __enter__(self) -> dict[str, str]:
        fd, self.path = tempfile.mkstemp(prefix="quantpatch-index-", dir=self.git_dir)
        os.close(fd)
        os.unlink(self.path)  # read-tree wants to create it
        return {"GIT_INDEX_FILE": self.path}

    def __init__(self, repo: git.Repo) -> None:
        self.git_dir = repo.git_dir
        self.path = ""

    def __exit__(self, *exc: object) -> None:
        for leftover in (self.path, self.path + ".lock"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _merge_trees(repo: git.Repo, base: str, ours: str, theirs: str) -> str | None:
    """The tree of ``theirs``'s change (from ``base``) applied on ``ours`` when no file is
    changed on both sides; ``None`` otherwise. A three-way ``read-tree`` in a private index:
    works on every git quantpatch supports (``merge-tree --merge-base`` needs git 2.40)."""
    with _PrivateIndex(repo) as env:
        gitrepo.run_git(repo, "read-tree", "-i", "-m", "--aggressive", base, ours, theirs, env=env)
        if gitrepo.run_git(repo, "ls-files", "--unmerged", env=env).strip():
            return None
        return gitrepo.run_git(repo, "write-tree", env=env).strip()


def _tree_with(repo: git.Repo, parent: str, planned: Mapping[str, str]) -> str:
    """The tree of ``parent`` with the planned files replaced (modes kept)."""
    tree = repo.commit(parent).tree
    with _PrivateIndex(repo) as env:
        gitrepo.run_git(repo, "read-tree", parent, env=env)
        for rel, text in planned.items():
            try:
                mode = f"{tree[rel].mode:o}"
            except KeyError:
                mode = "100644"
            blob = _store_blob(repo, text)
            gitrepo.run_git(repo, "update-index", "--cacheinfo", f"{mode},{blob},{rel}", env=env)
        return gitrepo.run_git(repo, "write-tree", env=env).strip()


def _commit_tree(
    repo: git.Repo, tree: str, parent: str, message: str, env: dict[str, str] | None = None
) -> str:
    fd, msg_path = tempfile.mkstemp(prefix="quantpatch-msg-", dir=repo.git_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(message)
        sign = ["-S"] if _wants_signing(repo) else []  # commit-tree ignores commit.gpgSign
        return gitrepo.run_git(
            repo, "commit-tree", *sign, tree, "-p", parent, "-F", msg_path, env=env
        ).strip()
    finally:
        os.unlink(msg_path)


def _wants_signing(repo: git.Repo) -> bool:
    """The user's ``commit.gpgSign``: quantpatch's commits are signed like their own."""
    try:
        value = repo.config_reader().get_value("commit", "gpgsign", False)
    except Exception:
        return False
    return value is True or str(value).lower() in ("true", "yes", "on", "1")


def _author_env(commit: git.Commit) -> dict[str, str]:
    return {
        "GIT_AUTHOR_NAME": commit.author.name or "",
        "GIT_AUTHOR_EMAIL": commit.author.email or "",
        "GIT_AUTHOR_DATE": f"{commit.authored_date} {_tz(int(commit.author_tz_offset))}",
    }


def _tz(offset_seconds_west: int) -> str:
    east = -offset_seconds_west
    sign = "+" if east >= 0 else "-"
    east = abs(east)
    return f"{sign}{east // 3600:02d}{(east % 3600) // 60:02d}"


@dataclass
class SchemeCommit:
    """What a scheme branch should point at, and how that came about."""

    name: str
    commit: str
    old_tip: str | None
    """The branch's tip before (``None``: the branch did not exist)."""
    state: str
    """``created``, ``reused`` or ``rebuilt``."""
    carried: list[str] = field(default_factory=list)
    """The user's commits carried over onto the new tip (new ids)."""

    @property
    def moves(self) -> bool:
        return self.commit != self.old_tip


def _short(commit: git.Commit) -> str:
    return f"{commit.hexsha[:12]} '{commit.summary!s}'"


def plan_scheme_commit(
    repo: git.Repo,
    name: str,
    base: Base,
    tip: str,
    planned: Mapping[str, str],
    values: Mapping[str, str],
) -> SchemeCommit:
    """The commit branch ``name`` must point at: quantpatch's commit (``planned`` files) on
    ``tip`` plus the user's own commits already on the branch. Creates objects only."""
    tip_tree = repo.commit(tip).tree
    changed = {}
    for rel, text in planned.items():
        try:
            same = tip_tree[rel].data_stream.read() == text.encode("utf-8")
        except KeyError:
            same = False
        if not same:
            changed[rel] = text
    old_tip = gitrepo.branch_tip(repo, name)
    wanted_tree = _tree_with(repo, tip, changed) if changed else tip_tree.hexsha

    if old_tip is not None:
        user = _user_commits_since(repo, tip, old_tip)
        if user is not None:  # the branch already sits on the base tip
            ours, own = user
            if ours is None and not changed:
                ours_ok = True
            else:
                ours_ok = ours is not None and ours.tree.hexsha == wanted_tree
            if ours_ok:
                _refuse_user_edits(repo, name, old_tip, own, planned)
                return SchemeCommit(name, old_tip, old_tip, "reused")
    message = commit_message(values, base, sorted(changed))
    new = _commit_tree(repo, wanted_tree, tip, message) if changed else tip
    if old_tip is None:
        return SchemeCommit(name, new, None, "created")
    carried = []
    own = _user_commits(repo, tip, old_tip)
    for commit in own:
        parent = commit.parents[0].hexsha if commit.parents else tip
        tree = _merge_trees(repo, parent, new, commit.hexsha)
        if tree is None:
            raise UserError(
                f"branch {name} carries your commit {_short(commit)}, which does not apply on "
                f"the base's new tip {tip[:12]}; rebase it by hand "
                f"('git rebase --onto {tip[:12]} {parent[:12]} {name}') or move it to another "
                "branch, then run this again."
            )
        new = _commit_tree(repo, tree, new, str(commit.message), env=_author_env(commit))
        carried.append(new)
    if carried:  # a carried commit that changes a site would run other values than asked
        _refuse_user_edits(repo, name, new, own, planned)
    return SchemeCommit(name, new, old_tip, "rebuilt", carried)


def _refuse_user_edits(
    repo: git.Repo, name: str, tip: str, own: list[git.Commit], planned: Mapping[str, str]
) -> None:
    """A reused branch whose own commits changed a target file would run other values."""
    tree = repo.commit(tip).tree
    for rel, text in planned.items():
        if tree[rel].data_stream.read() != text.encode("utf-8"):
            culprit = next(
                (c for c in reversed(own) if rel in c.stats.files), own[-1] if own else None
            )
            who = f"your commit {_short(culprit)}" if culprit else "a commit"
            raise UserError(
                f"branch {name} carries {who}, which changes {rel}; quantpatch will not "
                "overwrite it: revert that change or move it to another branch."
            )


def _user_commits_since(
    repo: git.Repo, tip: str, old_tip: str
) -> tuple[git.Commit | None, list[git.Commit]] | None:
    """When ``old_tip`` is ``tip`` plus commits: (quantpatch's first commit or None, the
    user's commits after it); ``None`` when the branch does not sit on ``tip``."""
    if old_tip == tip:
        return None, []
    chain = list(repo.iter_commits(f"{tip}..{old_tip}", first_parent=True, reverse=True))
    if not chain or not chain[0].parents or chain[0].parents[0].hexsha != tip:
        return None
    if not _is_ours(chain[0]):
        return None
    if any(_is_ours(c) for c in chain[1:]):
        return None
    return chain[0], chain[1:]


def _user_commits(repo: git.Repo, tip: str, old_tip: str) -> list[git.Commit]:
    """The commits on the branch that quantpatch did not make (oldest first), since the
    branch left the base's history."""
    merge_base = repo.merge_base(tip, old_tip)
    start = merge_base[0].hexsha if merge_base else None
    rng = f"{start}..{old_tip}" if start else old_tip
    commits = list(repo.iter_commits(rng, reverse=True))
    merges = [c for c in commits if len(c.parents) > 1]
    if merges:
        raise UserError(
            f"the scheme branch carries the merge commit {_short(merges[0])}; quantpatch "
            "cannot carry merges onto the base's new tip: move your work to another branch."
        )
    return [c for c in commits if not _is_ours(c)]


def move_ref(repo: git.Repo, plan: SchemeCommit) -> None:
    """Point the branch at the planned commit, failing if it moved since it was read."""
    if not plan.moves:
        return
    old = plan.old_tip or "0" * 40
    gitrepo.run_git(repo, "update-ref", f"refs/heads/{plan.name}", plan.commit, old)


def unmove_ref(repo: git.Repo, plan: SchemeCommit) -> None:
    """Undo ``move_ref`` (best effort: only while the branch still points where we put it)."""
    if not plan.moves:
        return
    ref = f"refs/heads/{plan.name}"
    with contextlib.suppress(UserError):
        if plan.old_tip is None:
            gitrepo.run_git(repo, "update-ref", "-d", ref, plan.commit)
        else:
            gitrepo.run_git(repo, "update-ref", ref, plan.old_tip, plan.commit)


def values_at(repo: git.Repo, commit: str, targets: Targets) -> dict[str, str | None]:
    """The role values the target files hold at ``commit``."""
    from quantpatch.sites.discovery import discover_sites
    from quantpatch.sites.model import role_values

    sites = []
    for rel in targets.all_files:
        text = gitrepo.read_at(repo, commit, rel)
        sites += discover_sites(text, rel, targets.kind_of(rel))
    got, _ = role_values(sites)
    return {r: got.get(r) for r in KEYS}


__all__ = [
    "SchemeCommit",
    "base_from_commit",
    "branch_name",
    "check_prefix",
    "commit_message",
    "is_scheme_branch",
    "move_ref",
    "plan_scheme_commit",
    "values_at",
]
