"""What a new user hit first: exit codes, hints, help, narrow terminals, parse errors."""

from __future__ import annotations

import io
import re

import git
from rich.console import Console

from quantpatch.checkout.switch import check
from quantpatch.cli.render_check import print_check

from .conftest import ATTENTION, LINEAR, snapshot


def test_debug_keeps_user_errors_exit_2_without_traceback(run, make_checkout):
    root = make_checkout()
    res = run("--debug", "set", "--repo", root, "--qk", "mxfp9")
    assert res.code == 2 and "Traceback" not in res.err and "unknown quant type" in res.err


def test_no_git_hints_match_the_command(run, make_checkout):
    plain = make_checkout(use_git=False)
    res = run("set", "--repo", plain, "--qk", "mxfp8")
    assert res.code == 2 and "--no-branch" in res.err
    for args in (("worktree", "--scheme", "FA_mxfp8"),):
        res = run(args[0], "--repo", plain, *args[1:])
        assert res.code == 2 and "not inside a git repository" in res.err
        assert "--no-branch" not in res.err


def test_expect_with_an_unknown_value_is_a_usage_error(run, make_checkout):
    root = make_checkout()
    res = run("check", "--repo", root, "--expect", "linear=mxfp9")
    assert res.code == 2 and "bf16, mxfp8, mxfp4, hifp8" in res.err


def test_stock_checkout_suggests_init(run, make_checkout):
    res = run("check", "--repo", make_checkout(inject=False))
    assert res.code == 2 and "quantpatch init" in res.err and "demo" not in res.err


def test_init_on_detached_head_warns(run, make_checkout):
    root = make_checkout(inject=False)
    git.Repo(root).git.checkout("-q", "--detach")
    res = run("init", "--repo", root)
    assert res.code == 0 and "detached" in res.err and "git switch -c" in res.err


def test_help_texts(run):
    top = run("--help").out
    commands = top.split("Commands:", 1)[1]
    assert "..." not in commands and "…" not in commands
    assert "current tip" in top  # the worktree summary is whole
    set_help = run("set", "--help").out
    assert "bf16, mxfp8, mxfp4, hifp8" in set_help
    for command in ("worktree", "run"):
        text = run(command, "--help").out
        for option in re.findall(r"^\s+(--[a-z-]+)\s*(\S*)\s*$", text, re.MULTILINE):
            raise AssertionError(f"{command} {option[0]} has no help text")


def test_narrow_terminal_keeps_file_and_line(make_checkout):
    root = make_checkout()
    buf = io.StringIO()
    print_check(check(root), Console(file=buf, width=80, force_terminal=False))
    text = buf.getvalue()
    report = check(root)
    for site in report.sites:
        assert f"{site.file}:{site.line}" in text, (site.file, site.line)
    assert max(len(line) for line in text.splitlines()) <= 80


def test_parse_error_names_the_real_line(run, make_checkout):
    root = make_checkout()
    lines = (root / LINEAR).read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if i > 700 and line.startswith(("def ", "class ")))
    lines.insert(at, "x = 1 $ 2\n")  # a character Python has no use for, far down the file
    (root / LINEAR).write_text("".join(lines))
    git.Repo(root).git.commit("-qam", "bad character")
    before = snapshot(root)
    res = run("check", "--repo", root)
    assert res.code == 2 and f"{LINEAR}:{at + 1}:" in res.err
    assert snapshot(root) == before


def test_init_indents_the_added_arguments_like_the_others(run, make_checkout):
    root = make_checkout(inject=False)
    assert run("init", "--repo", root).code == 0
    lines = (root / ATTENTION).read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "quantpatch_ops.quant_baddbmm(" in line)
    call = lines[at : at + 10]
    fmt = next(line for line in call if "fmt=custom_quant_type" in line)
    alpha = next(line for line in call if "alpha=self.softmax_scale" in line)
    indent = len(alpha) - len(alpha.lstrip())
    assert len(fmt) - len(fmt.lstrip()) == indent
    assert fmt.strip() == "fmt=custom_quant_type,"
    closing = call[call.index(fmt) + 1]
    assert closing.strip() == ")" and len(closing) - len(closing.lstrip()) == indent - 4


def test_the_cache_directories_quantpatch_makes_are_private_under_umask_002(tmp_path):
    """The saver loads its compiled kernel from quantpatch's cache only while nobody else can
    rename a directory above it: the directories the CLI makes there are 0700, umask or not."""
    import os

    from quantpatch.base.megatron_source import make_private_dirs

    old = os.umask(0o002)
    try:
        make_private_dirs(tmp_path / "home" / ".cache" / "quantpatch" / "wheels")
    finally:
        os.umask(old)
    for d in ("home", "home/.cache", "home/.cache/quantpatch", "home/.cache/quantpatch/wheels"):
        assert (tmp_path / d).stat().st_mode & 0o777 == 0o700, d
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o775)
    make_private_dirs(tmp_path / "shared" / "q")  # an existing directory is left as it is
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o775


def test_two_processes_unpack_a_megatron_release_once(tmp_path, monkeypatch):
    """Two `demo` runs (or two test workers) on an empty cache: one fetches and unpacks the
    wheel, the other waits for it and takes the same tree, neither removing the other's."""
    import fcntl
    import threading
    import types
    import zipfile

    from quantpatch.base import megatron_source

    monkeypatch.setenv("QUANTPATCH_CACHE", str(tmp_path / "cache"))
    fetched: list[str] = []
    at_lock: list[int] = []
    both_at_lock = threading.Event()

    def flock(fd, op):  # counts the callers that reached the lock, past the cache check
        at_lock.append(op)
        if len(at_lock) == 2:
            both_at_lock.set()
        return fcntl.flock(fd, op)

    def slow_fetch(version: str, dest):
        fetched.append(version)
        # a barrier, not a sleep: the other caller has found no tree and reached the lock
        assert both_at_lock.wait(60), "the second caller never reached the lock"
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"megatron_core-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("megatron/core/__init__.py", "")
            zf.writestr("megatron/core/package_info.py", "MAJOR = 9\n")
        return wheel

    monkeypatch.setattr(megatron_source, "_installed", lambda version: None)
    monkeypatch.setattr(megatron_source, "fetch_wheel", slow_fetch)
    monkeypatch.setattr(
        megatron_source, "fcntl", types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX)
    )
    trees: list[object] = []
    workers = [
        threading.Thread(target=lambda: trees.append(megatron_source.megatron_tree("9.9.9")))
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert fetched == ["9.9.9"] and len(trees) == 2 and trees[0] == trees[1]
    assert (trees[0] / "core" / "package_info.py").read_text() == "MAJOR = 9\n"  # type: ignore[operator]
