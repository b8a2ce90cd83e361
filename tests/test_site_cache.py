"""The content-addressed discovery cache: hits skip libcst, any change misses, bad entries heal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantpatch.base.config import Targets
from quantpatch.sites import cache as site_cache
from quantpatch.sites.discovery import discover_source

from .conftest import ATTENTION, LINEAR, group_members, paused, wait_exited


def test_hit_equals_fresh_discovery_and_any_change_misses(make_checkout, tmp_path):
    root = make_checkout()
    cache = tmp_path / "cache"
    first = site_cache.read_sites(root, Targets(), cache)
    assert len(list(cache.glob("sites-*.json"))) == 2
    assert site_cache.read_sites(root, Targets(), cache) == first
    text = (root / ATTENTION).read_text()
    assert first[1] == discover_source(text, ATTENTION, "attention").sites
    # one changed byte: a different key, so the stale entry can never be used
    changed = text.replace("custom_quant_type = 'bf16'", "custom_quant_type = 'hifp8'", 1)
    (root / ATTENTION).write_text(changed)
    again = site_cache.read_sites(root, Targets(), cache)
    assert [s.value for s in again[1]] == ["hifp8", "bf16"]
    assert len(list(cache.glob("sites-*.json"))) == 3


def test_corrupt_entry_is_rediscovered(make_checkout, tmp_path):
    root = make_checkout()
    cache = tmp_path / "cache"
    good = site_cache.read_sites(root, Targets(), cache)
    for entry in cache.glob("sites-*.json"):
        entry.write_text("{not json")
    assert site_cache.read_sites(root, Targets(), cache) == good
    for entry in cache.glob("sites-*.json"):
        assert isinstance(json.loads(entry.read_text())["sites"], list)


def test_cache_is_pruned(tmp_path):
    for i in range(site_cache.KEEP + 5):
        site_cache.store(tmp_path, LINEAR, "linear", f"x = {i}\n", [])
    assert len(list(tmp_path.glob("sites-*.json"))) == site_cache.KEEP


@pytest.mark.parametrize("after_set", [False, True])
def test_warm_check_imports_no_parser_and_no_gitpython(run, make_checkout, after_set):
    """A warm check reads the cache and asks git directly: no libcst, no GitPython, no
    pydantic (the CLI's start-up bar), before a set and with a set's record to verify."""
    root = make_checkout()
    if after_set:
        assert run("set", "--repo", root, "--qk", "mxfp4").code == 0  # also primes the cache
    else:
        assert run("check", "--repo", root).code == 0  # primes the cache
    code = (
        "import sys\nsys.argv=['quantpatch','check','--repo',sys.argv[1]]\n"
        "from quantpatch.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('LOADED', [m for m in ('libcst','git','pydantic','torch') if m in sys.modules])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=False
    )
    assert "LOADED []" in res.stdout, res.stdout + res.stderr
    if after_set:
        assert "_qk-mxfp4_" in res.stdout and "base (branch): main @" in res.stdout


def _check_in_a_process(root, *args, env=None):
    """``check`` in a fresh interpreter (no other thread: a child may be forked), reporting
    whether the command's own process imported libcst."""
    code = (
        "import sys\nsys.argv=['quantpatch','check','--json','--repo',*sys.argv[1:]]\n"
        "from quantpatch.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    print('EXIT', e.code)\n"
        "print('LIBCST', 'libcst' in sys.modules)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(root), *args],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip


def test_a_cold_check_parses_in_a_child_and_reports_the_same(run, make_checkout, tmp_path):
    """A cold cache is filled by a forked child while the command goes on: the command's own
    process never imports libcst, the cache holds both files once it has exited, and the
    report is the one a warm check gives. ``--expect`` (fresh) has its child fill a private
    directory: the checkout's cache stays untouched and nothing is left behind."""
    import os

    root = make_checkout()
    cache = root / ".git" / "quantpatch" / "cache"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    cold = _check_in_a_process(root, env=env)
    assert "EXIT 0" in cold.stdout and "LIBCST False" in cold.stdout, cold.stdout + cold.stderr
    assert len(list(cache.glob("sites-*.json"))) == 2
    report = json.loads(cold.stdout.split("EXIT")[0])
    warm = run("check", "--json", "--repo", root)
    assert warm.code == 0 and json.loads(warm.out) == report
    expect = ",".join(f"{role}={value}" for role, value in sorted(report["roles"].items()))
    for entry in cache.iterdir():
        entry.unlink()
    fresh = _check_in_a_process(root, "--expect", expect, env=env)
    assert "EXIT 0" in fresh.stdout and "LIBCST False" in fresh.stdout, fresh.stdout + fresh.stderr
    assert json.loads(fresh.stdout.split("EXIT")[0])["sites"] == report["sites"]
    assert not list(cache.iterdir()) and not list(tmp.iterdir())


def test_a_file_the_child_cannot_parse_is_reported_by_the_command(make_checkout):
    root = make_checkout()
    path = root / ATTENTION
    path.write_text(path.read_text() + "\ndef broken(:\n    pass\n")
    res = _check_in_a_process(root)
    assert "EXIT 2" in res.stdout and "LIBCST True" in res.stdout, res.stdout + res.stderr
    assert f"{ATTENTION}:" in res.stderr and "does not parse as Python" in res.stderr
    assert res.stderr.count("does not parse") == 1  # said once, by the command


@pytest.mark.parametrize("how", ["threading", "_thread"])
def test_no_child_is_forked_beside_other_threads(make_checkout, tmp_path, how):
    """Threads of any origin count (``_thread`` and C extensions bypass ``threading``)."""
    import _thread
    import threading

    root = make_checkout()
    stop, stopped = threading.Event(), threading.Event()

    def wait() -> None:
        stop.wait()
        stopped.set()

    if how == "threading":
        threading.Thread(target=wait).start()
    else:
        _thread.start_new_thread(wait, ())
    try:
        assert not site_cache.can_fork()
        assert site_cache.discover_ahead(root, Targets(), tmp_path / "cache") is None
    finally:
        stop.set()
        stopped.wait(10)


def test_a_terminated_fresh_check_leaves_nothing_behind(make_checkout, tmp_path):
    """SIGTERM (``timeout``, a cancelled job) while the child parses for ``check --expect``:
    the command stops its child and removes its private directory, as on Ctrl-C. The command
    is held at its ``parsing ahead`` barrier (a named pipe) while the signal is sent."""
    import os
    import signal

    root = make_checkout()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    barrier = tmp_path / "barrier"
    os.mkfifo(barrier)
    env = {
        **os.environ, "TMPDIR": str(tmp),
        "QUANTPATCH_FAULT_PAUSE": str(barrier), "QUANTPATCH_FAULT_PAUSE_AT": "parsing ahead",
    }  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantpatch", "check", "--repo", str(root),
         "--expect", "linear=bf16,qk=bf16,pv=bf16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert paused(barrier).split() == [str(proc.pid), "parsing", "ahead"]  # held there
        assert [p.name[:17] for p in tmp.iterdir()] == ["quantpatch-check-"]
        children = [
            int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat") if _ppid(p) == proc.pid
        ]
        assert len(children) == 1, children  # the child that parses ahead, forked by now
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:  # a failed assertion never leaves the command held at its barrier
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, (proc.returncode, err)
    assert b"Traceback" not in err
    wait_exited(group_members(children[0]))  # its group: the child and any helper it forked
    assert not list(tmp.iterdir())


def _ppid(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_the_files_are_shared_out_by_size():
    files = [(f"f{i}", "linear", "x" * size) for i, size in enumerate([50, 10, 30, 30, 5])]
    shares = site_cache._shares(files, 2)
    assert sorted(len(s[2]) for share in shares for s in share) == [5, 10, 30, 30, 50]
    assert sorted(sum(len(f[2]) for f in share) for share in shares) == [60, 65]
    assert site_cache._shares(files, 1) == [sorted(files, key=lambda f: -len(f[2]))]


def test_a_fresh_check_without_a_temporary_directory_parses_itself(make_checkout, monkeypatch):
    import tempfile

    from quantpatch.checkout.switch import check

    root = make_checkout()
    want = check(root, fresh=True).sites

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(site_cache, "can_fork", lambda: True)
    assert check(root, fresh=True).sites == want
    assert not (root / ".git" / "quantpatch" / "cache").exists()
