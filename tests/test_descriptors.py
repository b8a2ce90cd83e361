"""Open descriptors: in-process commands leave none behind (a test process or a sweep runs
hundreds of them), and the tests' barriers wait on descriptors of any number."""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from quantpatch.checkout.switch import SetRequest, check, restore, set_values
from quantpatch.checkout.worktrees import ensure_worktree, left_out

from .conftest import MakeCheckout, Pipe, paused, readable, release, wait_exited


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_commands_in_process_leave_no_descriptor_open(make_checkout: MakeCheckout) -> None:
    """Each GitPython ``Repo`` holds ``git cat-file`` pipes and mapped pack files that only
    the garbage collector freed: 20 ``set`` calls left 6 more descriptors open, and a test
    process reached 1,024. Every command closes what it opened."""
    root = make_checkout()
    schemes = ("fp8-tensor", "bf16")
    scheme = {"linear": "mxfp8", "qk": "bf16", "pv": "bf16"}
    set_values(root, SetRequest({"linear": "mxfp4"}))  # the first of each: imports, caches
    set_values(root, SetRequest({"linear": "mxfp8"}, dry_run=True))
    check(root)
    ensure_worktree(root, scheme)
    left_out(root)
    gc.collect()
    before = _open_fds()
    gc.disable()  # what the collector would free is what leaked
    try:
        for value in schemes:
            set_values(root, SetRequest({"linear": value}))
            set_values(root, SetRequest({"qk": value}, dry_run=True))
            check(root)
        ensure_worktree(root, scheme)
        left_out(root)
        restore(root)
        after = _open_fds()
    finally:
        gc.enable()
    assert after <= before, (before, after)


@pytest.fixture
def high_descriptors() -> Iterator[None]:
    """The process holding more than 1,024 descriptors, so that the next one opened is
    above 1,023 (``select``'s limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft != resource.RLIM_INFINITY and soft < want:
        try:  # above the hard limit only with the privilege to raise it (root may)
            raised = want if hard == resource.RLIM_INFINITY else max(hard, want)
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, raised))
        except (ValueError, OSError):
            pytest.skip(f"the limit of open files is {hard}: no descriptor above 1,023")
    fillers: list[int] = []
    try:
        while not fillers or fillers[-1] < 1030:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("high_descriptors")
def test_the_barriers_wait_on_descriptors_above_1023(tmp_path: Path) -> None:
    """``Pipe.line``, ``paused`` and ``wait_exited`` with their descriptors above 1,023:
    ``select`` raised 'filedescriptor out of range' there, and the process under test was
    left paused on its pipe."""
    pipe = Pipe(tmp_path / "lines")
    try:
        assert pipe.fd > 1023
        subprocess.run(["sh", "-c", f"echo one > {pipe.path}"], check=True)
        assert pipe.line() == "one"
    finally:
        pipe.close()
    fifo = tmp_path / "barrier"
    os.mkfifo(fifo)
    env = {**os.environ, "QUANTPATCH_FAULT_PAUSE": str(fifo), "QUANTPATCH_FAULT_PAUSE_AT": "here"}
    code = "from quantpatch.base import faults; faults.pause('here')"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        assert paused(fifo) == f"{proc.pid} here"
        release(fifo)
        wait_exited([proc.pid])
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r, w = os.pipe()
    try:
        assert r > 1023 and not readable(r, 0)
        os.write(w, b"x")
        assert readable(r, 0)
    finally:
        os.close(r)
        os.close(w)
