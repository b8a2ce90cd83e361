"""Refusals and warnings that name the command which resolves them, each followed in the test
and shown accepted: an upgrade killed mid-way, a checkout of the previous release, the saver
installed under init, a read-only file system under data prepare."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import git
import pytest

from .oldrelease import make_old_release
from .test_scripts import QUANTPATCH

LAYER = "megatron/core/transformer/transformer_layer.py"


def _old_checkout(run, make_checkout) -> Path:
    root = make_checkout(inject=False, extra=(LAYER,))
    assert run("init", "--repo", root).code == 0
    assert run("saver", "install", "--repo", root).code == 0
    make_old_release(root)
    return root


def _steps(root: Path, tmp_path: Path, *args: str) -> list[list[str]]:
    """The fault steps of ``quantpatch <args>`` traced on a copy of ``root``."""
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, symlinks=True)
    trace = tmp_path / "trace"
    env = {**os.environ, "QUANTPATCH_FAULT_TRACE": str(trace)}
    res = subprocess.run([QUANTPATCH, *args, "--repo", copy], env=env, capture_output=True)
    assert res.returncode == 0, res
    shutil.rmtree(copy)
    return [ln.split(" ", 1) for ln in trace.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "label", ["replace megatron/core/quantpatch_mx.py", "write upgrade record", "git commit"]
)
def test_check_after_an_upgrade_killed_mid_way_names_it_and_upgrade_finishes_it(
    run, make_checkout, tmp_path, label
):
    """``kill -9`` while the upgrade writes its files, right after its record, and after its
    commit: ``check`` named no upgrade (the files it wrote were "changed by hand since it was
    installed", and "the next set or restore finishes it"); now it names the upgrade, and
    following its advice completes it."""
    root = _old_checkout(run, make_checkout)
    old_head = git.Repo(root).head.commit.hexsha
    at = next(n for n, lab in _steps(root, tmp_path, "upgrade") if lab == label)
    env = {**os.environ, "QUANTPATCH_FAULT_AT": at}
    res = subprocess.run([QUANTPATCH, "upgrade", "--repo", root], env=env, capture_output=True)
    assert res.returncode == -9, res
    res = run("check", "--repo", root)
    assert res.code == 0, res
    said = " ".join((res.out + res.err).split())
    assert "changed by hand" not in said and "next set or restore" not in said, said
    assert "a quantpatch upgrade was interrupted; run 'quantpatch upgrade' again" in said, said
    res = run("check", "--json", "--repo", root)
    parts = {p["part"]: p for p in json.loads(res.out)["parts"]}
    assert {p["status"] for p in parts.values()} <= {"current", "older"}

    res = run("upgrade", "--repo", root)  # the advice, followed
    assert res.code == 0, res
    repo = git.Repo(root)
    assert [c.hexsha for c in repo.head.commit.parents] == [old_head] and not repo.is_dirty()
    res = run("check", "--json", "--repo", root)
    report = json.loads(res.out)
    assert {p["status"] for p in report["parts"]} == {"current"}
    assert not report["warnings"], report["warnings"]
