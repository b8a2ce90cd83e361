"""Every internal step of every writing command, killed (SIGKILL after the step) and failed
(the step raises, as a failing git command or a full disk does), with the user's dirty, staged
and untracked files present. After each fault: the user's files are byte-identical, ``check``
tells the truth without a traceback, and one ordinary command (the same one again) brings the
checkout to a clean, recorded state; ``restore`` then gives back the exact start.

The steps are counted, not timed: ``QUANTPATCH_FAULT_TRACE`` lists them for a clean run, and
``QUANTPATCH_FAULT_AT=n`` strikes the n-th (see ``quantpatch/base/faults.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from quantpatch.base import faults

from .conftest import ATTENTION, LINEAR
from .oldrelease import make_flat_release, make_old_release

TARGETS = (LINEAR, ATTENTION)
LAYER = "megatron/core/transformer/transformer_layer.py"
USER_FILES = ("README.md", "staged.txt", "untracked.txt")


def qp(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("QUANTPATCH_FAULT")}
    full.update(env)
    if "QUANTPATCH_FAULT_AT" in env and env.get("QUANTPATCH_FAULT_KIND", "kill") == "kill":
        # SIGKILL leaves coverage no moment to save: measuring the process only slows it
        full = {k: v for k, v in full.items() if not k.startswith("COVERAGE_PROCESS")}
    return subprocess.run(
        [sys.executable, "-m", "quantpatch", "--repo", str(root), *args],
        cwd=root,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout


def dirty_user_files(root: Path, use_git: bool) -> None:
    """A modified tracked file, a staged new file and an untracked file: the user's work."""
    (root / "README.md").write_text("my unsaved notes\n")
    (root / "staged.txt").write_text("staged by me\n")
    (root / "untracked.txt").write_text("not even added\n")
    if use_git:
        git(root, "add", "staged.txt")


def user_view(root: Path, use_git: bool) -> dict[str, object]:
    view: dict[str, object] = {f: (root / f).read_bytes() for f in USER_FILES}
    if use_git:  # the user's part of the index (quantpatch's own paths are checked by done)
        view["index"] = git(root, "diff", "--cached", "--name-only", "--", *USER_FILES)
        view["staged blob"] = git(root, "show", ":staged.txt")
    return view


def start_view(root: Path, use_git: bool) -> dict[str, object]:
    """What restore must give back: the targets' bytes and, in git, the branch and HEAD."""
    view: dict[str, object] = {t: (root / t).read_bytes() for t in TARGETS}
    if use_git:
        view["branch"] = git(root, "branch", "--show-current")
        view["head"] = git(root, "rev-parse", "HEAD")
    return view


def _nothing(root: Path, run: object) -> None:
    pass


@dataclass
class Scenario:
    name: str
    command: tuple[str, ...]
    inject: bool = True
    use_git: bool = True
    extra: tuple[str, ...] = ()
    """More real files (the saver instruments transformer_layer.py too)."""
    undo_commits: bool = False
    """The undo is a new commit (init --remove, saver remove): HEAD moves on, bytes return."""
    prepare: tuple[tuple[str, ...], ...] = ()
    """Commands run (without faults) before the one under test."""
    done: Callable[[Path, object], None] = _nothing
    """Asserts the end state of a successful command."""
    undo: tuple[str, ...] | None = ("restore",)
    """The command that returns to the start afterwards (None: nothing to undo)."""
    old_release: bool = False
    """After ``prepare``: the installs made as the previous release made them (``upgrade``)."""
    flat_release: bool = False
    """After ``prepare``: the installs on the flat layout, as the last release before the
    runtime's package made them (``upgrade`` moves them into it)."""


def _roles(root: Path, run) -> dict[str, str | None]:
    res = run("--repo", root, "check", "--json")
    assert res.code in (0, 1), res
    data = json.loads(res.out)
    assert not data["warnings"], data["warnings"]
    return data["roles"]


def _holds(linear: str, qk: str, pv: str) -> Callable[[Path, object], None]:
    def check(root: Path, run) -> None:
        assert _roles(root, run) == {"linear": linear, "qk": qk, "pv": pv}

    return check


def _saver(installed: bool) -> Callable[[Path, object], None]:
    def check(root: Path, run) -> None:
        data = json.loads(run("--repo", root, "check", "--json").out)
        assert data["saver"]["installed"] is installed and not data["warnings"]
        if (root / ".git").exists():
            assert (
                git(root, "status", "--porcelain", "--untracked-files=no", "--", "megatron") == ""
            )

    return check


def _worktree(root: Path, run) -> None:
    path = run("--repo", root, "worktree", "--scheme", "FA_mxfp8", "--path-only").out.strip()
    res = run("--repo", path, "check", "--expect", "linear=bf16,qk=mxfp8,pv=bf16")
    assert res.code == 0, res


SCENARIOS = [
    Scenario("set", ("set", "--scheme", "FA_linear_mxfp8"), done=_holds("mxfp8", "mxfp8", "bf16")),
    Scenario(
        "set-again",
        ("set", "--linear", "hifp8", "--qk", "mxfp4", "--pv", "mxfp8"),
        prepare=(("set", "--scheme", "FA_mxfp8"),),
        done=_holds("hifp8", "mxfp4", "mxfp8"),
    ),
    Scenario(
        "set-no-branch",
        ("set", "--no-branch", "--scheme", "linear_hifp8"),
        done=_holds("hifp8", "bf16", "bf16"),
    ),
    Scenario(
        "set-no-git",
        ("set", "--no-branch", "--scheme", "FA_linear_mxfp4"),
        use_git=False,
        done=_holds("mxfp4", "mxfp4", "bf16"),
    ),
    Scenario(
        "restore",
        ("restore",),
        prepare=(("set", "--scheme", "FA_linear_mxfp8"),),
        done=_holds("bf16", "bf16", "bf16"),
        undo=None,
    ),
    Scenario(
        "restore-in-place",
        ("restore",),
        prepare=(("set", "--no-branch", "--scheme", "FA_linear_mxfp8"),),
        done=_holds("bf16", "bf16", "bf16"),
        undo=None,
    ),
    Scenario("worktree", ("worktree", "--scheme", "FA_mxfp8"), done=_worktree, undo=None),
    Scenario(
        "saver-install",
        ("saver", "install"),
        extra=(LAYER,),
        done=_saver(True),
        undo=("saver", "remove"),
        undo_commits=True,
    ),
    Scenario(
        "saver-remove",
        ("saver", "remove"),
        extra=(LAYER,),
        prepare=(("saver", "install"),),
        done=_saver(False),
        undo=None,
    ),
    Scenario(
        "init",
        ("init",),
        inject=False,
        done=_holds("bf16", "bf16", "bf16"),
        undo=("init", "--remove"),
        undo_commits=True,
    ),
    Scenario(
        "init-remove",
        ("init", "--remove"),
        inject=False,
        prepare=(("init",),),
        done=_nothing,
        undo=None,
    ),
]


def _upgraded(root: Path, run) -> None:
    data = json.loads(run("--repo", root, "check", "--json").out)
    assert {p["status"] for p in data["parts"]} == {"current"} and not data["warnings"]
    assert git(root, "status", "--porcelain", "--untracked-files=no", "--", "megatron") == ""


SCENARIOS.append(
    Scenario(
        "upgrade",
        ("upgrade",),
        inject=False,
        extra=(LAYER,),
        prepare=(("init",), ("saver", "install")),
        old_release=True,
        done=_upgraded,
        undo=("saver", "remove"),
    )
)
SCENARIOS.append(
    Scenario(
        "upgrade-flat",
        ("upgrade",),
        inject=False,
        extra=(LAYER,),
        prepare=(("init",), ("saver", "install")),
        flat_release=True,
        done=_upgraded,
        undo=("saver", "remove"),
    )
)

CTRL_C = ("set", "set-no-branch", "saver-install")
"""Scenarios also interrupted (KeyboardInterrupt after each step, as Ctrl-C)."""


_BUILT: dict[str, tuple[Path, dict[str, object], list[str]]] = {}
"""Each scenario's start checkout, its start view and its steps, built once per process (a
worker) and shared read-only: every fault strikes a copy of it."""


@pytest.fixture
def template(make_checkout, tmp_path: Path):
    def build(sc: Scenario) -> tuple[Path, dict[str, object]]:
        if sc.name in _BUILT and _BUILT[sc.name][0].is_dir():
            return _BUILT[sc.name][0], _BUILT[sc.name][1]
        root = make_checkout(inject=sc.inject, use_git=sc.use_git, extra=sc.extra)
        start = start_view(root, sc.use_git)
        for prep in sc.prepare:
            res = qp(root, *prep)
            assert res.returncode == 0, (prep, res.stderr)
        if sc.old_release:
            make_old_release(root)
        if sc.flat_release:
            make_flat_release(root)
        dirty_user_files(root, sc.use_git)
        _BUILT[sc.name] = (root, start, _steps(root, sc, tmp_path))
        return root, start

    return build


def _steps(root: Path, sc: Scenario, tmp: Path) -> list[str]:
    """The steps of a clean run of the command (counted on a copy), once per scenario."""
    if sc.name in _BUILT and _BUILT[sc.name][0] == root:
        return _BUILT[sc.name][2]
    probe = tmp / "probe"
    shutil.copytree(root, probe, symlinks=True)
    trace = tmp / "trace.txt"
    res = qp(probe, *sc.command, QUANTPATCH_FAULT_TRACE=str(trace))
    assert res.returncode == 0, res.stderr
    return trace.read_text().splitlines() if trace.exists() else []


def _strike(
    sc: Scenario, root: Path, start: dict, user: dict, steps: list[str], kind: str, n: int,
    tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """One fault (``kind`` at step ``n``) on a copy of ``root``, then the recovery."""
    case = tmp_path / f"{kind}-{n}"
    shutil.copytree(root, case, symlinks=True)
    where = f"{sc.name}: {kind} at step {n} ({steps[n - 1]})"
    if kind == "kill":  # a real SIGKILL needs a process of its own
        hit = qp(case, *sc.command, QUANTPATCH_FAULT_AT=str(n), QUANTPATCH_FAULT_KIND=kind)
        assert hit.returncode == -9, (where, hit.returncode, hit.stderr)
    else:
        monkeypatch.setattr(faults, "_count", 0)
        monkeypatch.setenv("QUANTPATCH_FAULT_AT", str(n))
        monkeypatch.setenv("QUANTPATCH_FAULT_KIND", kind)
        hit_res = run("--repo", case, *sc.command)
        monkeypatch.delenv("QUANTPATCH_FAULT_AT")
        assert hit_res.code in ((0, 2) if kind == "fail" else (130,)), (where, hit_res)
        assert "internal error" not in hit_res.err, (where, hit_res.err)
    assert user_view(case, sc.use_git) == user, where
    seen = run("--repo", case, "check")
    assert seen.code in (0, 1, 2) and "internal error" not in seen.err, (where, seen)
    again = run("--repo", case, *sc.command)
    # a kill after the last change: the command already did it (init refuses twice)
    finished = ("nothing to restore" in again.err and sc.command == ("restore",)) or (
        "already initialised" in again.err and sc.command == ("init",)
    )
    assert again.code == 0 or finished, (where, again)  # a kill after the last step
    sc.done(case, run)
    assert user_view(case, sc.use_git) == user, where
    if sc.undo is not None:
        back = run("--repo", case, *sc.undo)
        assert back.code == 0, (where, back)
        if sc.prepare == ():
            now = start_view(case, sc.use_git)
            if sc.undo_commits:
                now["head"] = start["head"]
            assert now == start, where
        assert user_view(case, sc.use_git) == user, where
    shutil.rmtree(case)


CASES = [
    pytest.param(sc, kind, id=f"{sc.name}-{kind}")
    for sc in SCENARIOS
    for kind in (("kill", "fail", "interrupt") if sc.name in CTRL_C else ("kill", "fail"))
]


@pytest.mark.slow
@pytest.mark.parametrize(("sc", "kind"), CASES)
def test_every_step_killed_or_failed_is_recoverable(
    sc: Scenario, kind: str, template, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
):
    """Every step of the command, struck by one fault kind (one test per scenario and kind,
    so that the workers share the longest scenarios out)."""
    root, start = template(sc)
    steps = _steps(root, sc, tmp_path)
    assert steps, "the command changed nothing?"
    user = user_view(root, sc.use_git)
    for n in range(1, len(steps) + 1):
        _strike(sc, root, start, user, steps, kind, n, tmp_path, run, monkeypatch)
    # the count for the closing note: steps, all recovered
    print(f"{sc.name}: {len(steps)} steps x {kind} = {len(steps)} faults recovered")


ONE_PER_COMMAND = [
    pytest.param(sc, id=sc.name)
    for sc in SCENARIOS
    if sc.name in ("set", "restore", "worktree", "saver-install", "saver-remove", "init",
                   "init-remove", "upgrade")
]  # fmt: skip


@pytest.mark.parametrize("sc", ONE_PER_COMMAND)
def test_one_step_of_each_command_killed_is_recoverable(
    sc: Scenario, template, tmp_path: Path, run, monkeypatch: pytest.MonkeyPatch
):
    """The fast suite's share of the test above (which the full suite runs): each writing
    command killed once, at its middle step, and recovered."""
    root, start = template(sc)
    steps = _steps(root, sc, tmp_path)
    assert steps, "the command changed nothing?"
    user = user_view(root, sc.use_git)
    n = (len(steps) + 1) // 2
    _strike(sc, root, start, user, steps, "kill", n, tmp_path, run, monkeypatch)
