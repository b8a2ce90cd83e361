"""The checkout and its git repository: locating it, reading files at commits, branches,
commits, the recorded state and the lock. Git work that changes something goes through
GitPython, imported on first use; the read-only facts ``check`` and the start of every command
need (where the checkout is, HEAD, clean or not, a branch tip) come from one plain ``git`` call
each, so that a read-only command never pays GitPython's 40 ms import.

State lives in the repository's git directory (``.git/quantpatch/``), never in the work tree;
for a checkout without git (``--no-branch`` mode only) it lives under
``$XDG_STATE_HOME/quantpatch/<hash of the path>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantpatch.base import faults
from quantpatch.base.errors import UserError
from quantpatch.git.state import CheckoutState, Mode, why_malformed

if TYPE_CHECKING:
    import git

STATE_VERSION = 1


@dataclass
class Checkout:
    root: Path
    git_dir: Path | None
    state_dir: Path
    _repo: git.Repo | None = field(default=None, repr=False, compare=False)

    @property
    def has_git(self) -> bool:
        return self.git_dir is not None

    @property
    def repo(self) -> git.Repo | None:
        """The GitPython ``Repo``, opened (and GitPython imported) on first use."""
        if self.git_dir is None:
            return None
        if self._repo is None:
            self._repo = open_repo(self.root)
        return self._repo

    def git(self) -> git.Repo:
        if self.repo is None:  # pragma: no cover - callers check has_git first
            raise UserError(f"{self.root}: not a git repository.")
        return self.repo

    def close(self) -> None:
        """End the ``Repo``'s git processes and memory maps now (a later use opens it
        again). A ``Repo`` holds descriptors (its ``git cat-file`` pipes, mapped pack files)
        that only the garbage collector would free otherwise: a process that runs many
        commands, a test suite or a sweep, would run out of them."""
        repo, self._repo = self._repo, None
        if repo is not None:
            repo.close()

    def __enter__(self) -> Checkout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _user_state_home() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "quantpatch"


def open_repo(path: Path, *, search_parent_directories: bool = False) -> git.Repo:
    """A GitPython ``Repo`` that takes ``path`` literally: a '$VAR' in it is part of a
    directory name, never a variable (GitPython expands variables in the repository path
    unless told not to, and always in the working directory of its git commands, so that a
    checkout at ``ev/$QPX`` would run git in ``ev/victim``)."""
    import git

    repo = git.Repo(path, search_parent_directories=search_parent_directories, expand_vars=False)
    if repo.working_tree_dir is not None:
        repo.git._working_dir = str(repo.working_tree_dir)
    return repo


def git_plain(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``git <args>`` run directly in ``cwd`` (taken literally), for read-only facts: no
    GitPython import, no optional index lock (``--no-optional-locks``, so a read never
    competes with the user's own git). Its output is decoded as the file system's names are
    (``surrogateescape``): a path or branch that is not UTF-8 keeps its bytes."""
    return subprocess.run(
        ["git", "--no-optional-locks", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        errors="surrogateescape",
        check=False,
    )


_NOT_A_CHECKOUT = ("not a git repository", "must be run in a work tree")


def find_checkout(path: Path | None, *, need_git: bool, no_branch_hint: bool = False) -> Checkout:
    """The checkout at ``path`` (default: the git root above the current directory)."""
    start = (path or Path.cwd()).resolve()
    if not start.exists():
        raise UserError(f"{start}: no such directory.")
    if not start.is_dir():
        raise UserError(f"{start}: not a directory.")
    try:
        found = git_plain(start, "rev-parse", "--show-toplevel", "--absolute-git-dir")
    except FileNotFoundError:  # no git installed: only --no-branch work is possible
        found = None
    lines = found.stdout.splitlines() if found is not None and found.returncode == 0 else []
    if len(lines) != 2:
        why = found.stderr.strip() if found is not None else ""
        if found is not None and why and not any(m in why for m in _NOT_A_CHECKOUT):
            # e.g. git's "dubious ownership": its own sentence says what to do
            raise UserError(f"{start}: git refuses this repository: {why.splitlines()[0]}")
        if need_git:
            hint = " or use --no-branch" if no_branch_hint else ""
            raise UserError(f"{start}: not inside a git repository; run 'git init' there{hint}.")
        digest = hashlib.sha256(str(start).encode()).hexdigest()[:16]
        return Checkout(start, None, _user_state_home() / digest)
    git_dir = Path(lines[1])
    return Checkout(Path(lines[0]), git_dir, git_dir / "quantpatch")


# -- git facts ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GitInfo:
    branch: str | None
    head: str | None
    clean: bool

    def as_json(self) -> dict[str, Any]:
        return {"branch": self.branch, "head": self.head, "clean": self.clean}


_NOT_UTF8_BRANCH = (
    "the checked-out branch's name is not UTF-8, which quantpatch cannot record; rename it "
    "('git branch -m <new name>') and run this again."
)


def head_commit(repo: git.Repo) -> str | None:
    try:
        return repo.head.commit.hexsha
    except UnicodeDecodeError:  # GitPython reads the symbolic ref as UTF-8
        raise UserError(_NOT_UTF8_BRANCH) from None
    except ValueError:  # no commit yet
        return None


def active_branch(repo: git.Repo) -> str | None:
    try:
        return None if repo.head.is_detached else repo.active_branch.name
    except UnicodeDecodeError:
        raise UserError(_NOT_UTF8_BRANCH) from None


def git_info(checkout: Checkout) -> GitInfo:
    """Branch, HEAD and clean-or-not from one ``git status`` (tracked files only)."""
    with git_info_started(checkout) as result:
        return result()


@contextlib.contextmanager
def git_info_started(checkout: Checkout) -> Iterator[Callable[[], GitInfo]]:
    """``git_info``, started on entry and read when called: git walks the tree on the other
    core while this process reads and parses the target files. Left unread, it is stopped."""
    proc = subprocess.Popen(
        ["git", "--no-optional-locks", "status", "--porcelain=v2", "--branch",
         "--untracked-files=no"],
        cwd=checkout.root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="surrogateescape",  # a branch name that is not UTF-8 keeps its bytes
    )  # fmt: skip

    def result() -> GitInfo:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise UserError(f"git status failed: {err.strip() or 'unknown error'}")
        return _parse_status(out)

    try:
        yield result
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _parse_status(stdout: str) -> GitInfo:
    branch = head = None
    clean = True
    for line in stdout.splitlines():
        if line.startswith("# branch.oid "):
            oid = line.removeprefix("# branch.oid ")
            head = None if oid == "(initial)" else oid
        elif line.startswith("# branch.head "):
            name = line.removeprefix("# branch.head ")
            branch = None if name == "(detached)" else name
        elif not line.startswith("#"):
            clean = False
    return GitInfo(branch, head, clean)


_HEX_COMMIT = re.compile(r"[0-9a-f]{7,64}")


def commit_exists(checkout: Checkout, commit: str) -> bool:
    """Whether ``commit`` (a hex object name, never an option or a revision expression)
    names a commit git has."""
    if not _HEX_COMMIT.fullmatch(commit):
        return False
    return git_plain(checkout.root, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def dirty_paths(repo: git.Repo, paths: Sequence[str], *, untracked: bool = False) -> list[str]:
    """Those of ``paths`` with uncommitted changes (staged or not; new files too when
    ``untracked``)."""
    mode = "--untracked-files=all" if untracked else "--untracked-files=no"
    # without rename detection: a staged move (a killed commit after its 'git add') is the
    # deletion of its old path and the addition of its new one, and both are to be committed
    out = repo.git.status("--porcelain", "--no-renames", mode, "--", *paths)
    return [line[3:].strip('"') for line in out.splitlines()]


def refuse_index_lock(repo: git.Repo) -> None:
    """A leftover ``index.lock`` (a git killed mid-write) makes every index change fail: say
    so up front, with git's own advice, before anything is written."""
    lock = Path(repo.git_dir) / "index.lock"
    if lock.exists():
        raise UserError(
            f"{lock} exists: another git process seems to be running in this repository. "
            "If no git process is running, a git crashed in it earlier: remove the file "
            "manually to continue. Nothing was changed."
        )


_IN_PROGRESS = (
    ("rebase-merge", "rebase", "continue"),
    ("rebase-apply", "rebase", "continue"),
    ("MERGE_HEAD", "merge", "continue"),
    ("CHERRY_PICK_HEAD", "cherry-pick", "continue"),
    ("REVERT_HEAD", "revert", "continue"),
    ("BISECT_LOG", "bisect", "reset"),
)
"""Files git keeps in the git dir while an operation is stopped half-way: HEAD is then an
intermediate commit (or a bisect's candidate), not the user's branch."""


def refuse_operation_in_progress(checkout: Checkout) -> None:
    """Refuse to build on a checkout whose rebase, merge, cherry-pick, revert or bisect is
    stopped half-way (one sentence: what is going on and how to end it)."""
    if checkout.git_dir is None:
        return
    for name, op, end in _IN_PROGRESS:
        if (checkout.git_dir / name).exists():
            if name == "rebase-apply" and (checkout.git_dir / name / "applying").exists():
                op = "am"
            how = (
                f"end it with 'git {op} reset'"
                if end == "reset"
                else f"finish it ('git {op} --continue') or abort it ('git {op} --abort')"
            )
            raise UserError(
                f"{checkout.root}: a git {op} is in progress there (quantpatch would build on "
                f"a commit in the middle of it); {how}, then run this again."
            )


def shared_state_dir(checkout: Checkout) -> Path:
    """The state directory of the repository's main checkout. A linked worktree has a git
    dir of its own whose ``commondir`` file names the shared one (what ``git rev-parse
    --git-common-dir`` reads; no git process is started); elsewhere it is ``state_dir``."""
    if checkout.git_dir is None:
        return checkout.state_dir
    try:
        common = (checkout.git_dir / "commondir").read_text(encoding="utf-8").strip()
    except OSError:
        return checkout.state_dir
    return (checkout.git_dir / common).resolve() / "quantpatch"


def read_at(repo: git.Repo, commit: str, rel: str) -> str:
    try:
        blob = repo.commit(commit).tree / rel
    except KeyError:
        raise UserError(f"{rel}: not present at commit {commit[:12]}.") from None
    data: bytes = blob.data_stream.read()
    return data.decode("utf-8")


def branch_exists(repo: git.Repo, name: str) -> bool:
    return name in repo.heads


def branch_tip(repo: git.Repo, name: str) -> str | None:
    return repo.heads[name].commit.hexsha if name in repo.heads else None


def branch_tip_plain(checkout: Checkout, name: str) -> str | None:
    """``branch_tip`` for read-only commands, without GitPython."""
    done = git_plain(checkout.root, "rev-parse", "-q", "--verify", f"refs/heads/{name}^{{commit}}")
    return (done.stdout.strip() or None) if done.returncode == 0 else None


@contextlib.contextmanager
def _identity(repo: git.Repo) -> Iterator[None]:
    """Commit as the user when git knows who they are, else as ``quantpatch``."""
    reader = repo.config_reader()
    has = reader.has_option("user", "name") and reader.has_option("user", "email")
    if has or os.environ.get("GIT_AUTHOR_EMAIL"):
        yield
        return
    env = {
        "GIT_AUTHOR_NAME": "quantpatch",
        "GIT_AUTHOR_EMAIL": "quantpatch@localhost",
        "GIT_COMMITTER_NAME": "quantpatch",
        "GIT_COMMITTER_EMAIL": "quantpatch@localhost",
    }
    with repo.git.custom_environment(**env):
        yield


def _git_reason(exc: Any) -> str:
    """git's own message, every line that says something (the file list of 'would be
    overwritten', the advice about index.lock), without GitPython's decoration."""
    raw = exc.stderr if isinstance(exc.stderr, str) and exc.stderr.strip() else str(exc)
    lines = []
    for line in raw.strip().splitlines():
        line = line.strip().removeprefix("stderr: ").strip().strip("'").strip()
        if line and not line.startswith(("Cmd('git')", "cmdline:")):
            lines.append(line)
    return "\n  ".join(lines) or "unknown error"


_READ_ONLY_GIT = frozenset(
    {"status", "ls-files", "rev-parse", "rev-list", "log", "diff", "show", "cat-file", "merge-base"}
)
"""git commands that change nothing: not fault-injection steps."""


def run_git(repo: git.Repo, *args: str, env: dict[str, str] | None = None) -> str:
    """``git <args>`` with a git failure turned into a ``UserError`` that keeps git's lines."""
    import git

    label = f"git {args[0]}"
    mutating = args[0] not in _READ_ONLY_GIT
    if mutating:
        faults.step(label, done=False)
    try:
        with _identity(repo):
            if env:
                with repo.git.custom_environment(**env):
                    out: str = repo.git.execute(["git", *args])
            else:
                out = repo.git.execute(["git", *args])
    except git.GitCommandError as exc:
        raise UserError(f"git {args[0]} failed: {_git_reason(exc)}") from None
    if mutating:
        faults.step(label, done=True)
    return out


def commit_paths(repo: git.Repo, paths: Sequence[str], message: str) -> str:
    """Commit exactly ``paths`` (other staged or dirty files are left as they are)."""
    root = Path(str(repo.working_tree_dir))
    indexed = set(repo.git.ls_files("--", *paths).splitlines())
    in_head = set()
    if head_commit(repo) is not None:
        in_head = set(repo.git.ls_tree("-r", "--name-only", "HEAD", "--", *paths).splitlines())
    # git add takes what is on disk or in the index; commit --only also takes a deletion
    # that is already staged (a new file deleted again is in neither and left out)
    to_add = [p for p in paths if p in indexed or (root / p).exists()]
    paths = [p for p in paths if p in to_add or p in in_head]
    if to_add:
        run_git(repo, "add", "--", *to_add)
    run_git(repo, "commit", "--no-verify", "--only", "-m", message, "--", *paths)
    return repo.head.commit.hexsha


# -- state --------------------------------------------------------------------------------


FORGET = "quantpatch restore --forget"


def _bad_record(path: Path, why: str) -> UserError:
    return UserError(
        f"{path}: the quantpatch record {why}; '{FORGET}' drops it (your files and branches "
        "stay as they are)."
    )


def load_state(checkout: Checkout) -> CheckoutState | None:
    """The record of the active set, checked before it is trusted: a record that is not
    what quantpatch writes is a one-sentence error naming the repair, never a traceback."""
    path = checkout.state_dir / "state.json"
    try:
        if not path.is_file():
            if path.exists() or (checkout.state_dir.exists() and not checkout.state_dir.is_dir()):
                raise _bad_record(path, "is not a regular file")
            return None
        raw = path.read_bytes()
    except PermissionError:
        raise UserError(f"{path}: cannot read the quantpatch record (permission denied).") from None
    except NotADirectoryError:
        raise _bad_record(path, f"directory {checkout.state_dir} is not a directory") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _bad_record(path, "is not valid JSON") from None
    why = why_malformed(data)
    if why is not None:
        raise _bad_record(path, why)
    state = CheckoutState.from_dict(data)
    commit = state.base.commit
    if state.mode is Mode.BRANCH and checkout.has_git and not commit_exists(checkout, str(commit)):
        raise _bad_record(path, f"names a base commit {str(commit)[:12]} git does not have")
    return state


def state_text(state: CheckoutState) -> str:
    return (
        json.dumps({"version": STATE_VERSION, **state.as_dict()}, indent=2, sort_keys=True) + "\n"
    )


def _state_dir_ready(checkout: Checkout) -> None:
    try:
        checkout.state_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(
            f"{checkout.state_dir}: exists and is not a directory; move it away (quantpatch keeps "
            "its record there)."
        ) from None
    except OSError as exc:
        raise UserError(
            f"{checkout.state_dir}: cannot create quantpatch's state directory ({exc.strerror})."
        ) from None


def save_state(checkout: Checkout, state: CheckoutState) -> None:
    _state_dir_ready(checkout)
    tmp = checkout.state_dir / "state.json.tmp"
    faults.step("write record", done=False)
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(state_text(state))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, checkout.state_dir / "state.json")
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise UserError(
            f"{checkout.state_dir / 'state.json'}: cannot write the quantpatch record "
            f"({exc.strerror}); nothing was changed."
        ) from None
    faults.step("write record", done=True)


def clear_state(checkout: Checkout) -> None:
    faults.step("clear record", done=False)
    with contextlib.suppress(FileNotFoundError):
        (checkout.state_dir / "state.json").unlink()
    faults.step("clear record", done=True)
    originals = checkout.state_dir / "originals"
    if originals.is_dir():
        shutil.rmtree(originals, ignore_errors=True)


def journal_dir(checkout: Checkout) -> Path:
    return checkout.state_dir / "journal"


def recover(checkout: Checkout) -> list[str]:
    """Finish an interrupted multi-file write (under the lock, before any new work)."""
    from quantpatch.base.edits import recover_journal

    return recover_journal(journal_dir(checkout), checkout.root)


# -- lock ---------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(checkout: Checkout, wait: float = 0.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<state dir>/lock`` for the duration.

    The kernel releases the lock when its holder exits, however it dies, so there is no
    stale lock to judge or take over and no window in which two processes both take it; the
    file itself is never removed (removing it would let a second process lock a new inode).
    A held lock is refused (exit 2) or, with ``wait``, waited for up to that many seconds.
    """
    _state_dir_ready(checkout)
    lock = checkout.state_dir / "lock"
    if lock.is_symlink():  # quantpatch's own file: never follow a link planted in its place
        with contextlib.suppress(OSError):
            lock.unlink()
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise UserError(
            f"{checkout.state_dir}: cannot create quantpatch's lock file ({exc.strerror})."
        ) from None
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
                    who = f" (pid {holder[0]})" if holder and holder[0].isdigit() else ""
                    raise UserError(
                        f"{checkout.state_dir / 'lock'}: another quantpatch{who} is working on "
                        "this checkout; wait for it to finish."
                    ) from None
                time.sleep(0.05)
        with contextlib.suppress(OSError):  # who holds it, for the message above
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {os.uname().nodename}\n".encode(), 0)
        yield
    finally:
        checkout.close()  # the command's git work is done: its descriptors with it
        os.close(fd)  # releases the flock
