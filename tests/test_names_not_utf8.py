"""Names that are not UTF-8 (a directory from an old Latin-1 file system, a branch made by
another tool): git's output is decoded as Python decodes the file system's names, and such a
path is printed as its own bytes; each was an internal error (UnicodeDecodeError, then
UnicodeEncodeError), exit 3."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import git

from .test_scripts import QUANTPATCH


def test_a_checkout_whose_path_is_not_utf8(run, make_checkout, tmp_path):
    weird = bytes(tmp_path) + b"/ch\xffeck"
    shutil.copytree(make_checkout(), os.fsdecode(weird), symlinks=True)
    res = subprocess.run([QUANTPATCH, "check", "--repo", weird], capture_output=True)
    assert res.returncode == 0 and res.stderr == b"", res
    assert weird in res.stdout  # its own bytes, as ls prints it
    root = Path(os.fsdecode(weird))
    assert run("set", "--linear", "mxfp8", "--repo", root).code == 0
    res = subprocess.run([QUANTPATCH, "check", "--json", "--repo", weird], capture_output=True)
    assert res.returncode == 0 and b'"linear": "mxfp8"' in res.stdout, res
    assert run("restore", "--repo", root).code == 0


def test_a_branch_whose_name_is_not_utf8_is_named_and_renaming_it_is_accepted(run, make_checkout):
    root = make_checkout()
    repo = git.Repo(root)
    repo.git.checkout("-q", "-b", "latin")
    heads = bytes(root / ".git" / "refs" / "heads")
    os.rename(heads + b"/latin", heads + b"/latin\xe9")
    (root / ".git" / "HEAD").write_bytes(b"ref: refs/heads/latin\xe9\n")
    res = subprocess.run([QUANTPATCH, "check", "--repo", root], capture_output=True)
    assert res.returncode == 0 and b"git: latin\xe9 @ " in res.stdout, res
    res = run("set", "--linear", "mxfp8", "--repo", root)
    assert res.code == 2, res
    assert " ".join(res.err.split()) == (
        "error: the checked-out branch's name is not UTF-8, which quantpatch cannot record; "
        "rename it ('git branch -m <new name>') and run this again."
    )
    subprocess.run(["git", "branch", "-m", "latin-1"], cwd=root, check=True)  # the advice
    assert run("set", "--linear", "mxfp8", "--repo", root).code == 0
    assert run("restore", "--repo", root).code == 0
    assert git.Repo(root).active_branch.name == "latin-1"
