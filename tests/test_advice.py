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
    "label",
    [
        "replace megatron/core/quantpatch_ops.py",  # the flat module of the release, removed
        "replace megatron/core/quantpatch/quantpatch_mx.py",
        "write upgrade record",
        "git commit",
    ],
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


@pytest.mark.slow
def test_a_value_the_previous_releases_ops_lacks_names_upgrade_and_upgrade_teaches_it(
    run, make_checkout
):
    """The previous release's quantpatch_ops.py knows no fp8-tensor: the refusal said "'quantpatch
    init' teaches it the quantpatch values", and init then refused (already initialised)."""
    root = _old_checkout(run, make_checkout)
    news = [("set", "--linear", v) for v in ("fp8-tensor", "fp8-tensor-e4m3", "fp8-block-hybrid")]
    for args in (*news, ("set", "--wgrad", "nvfp4-rht")):
        res = run(*args, "--repo", root)
        assert res.code == 2, res
        said = " ".join(res.err.split())
        assert "'quantpatch upgrade' brings it to this version's values" in said, said
        assert "quantpatch init" not in said, said
    assert run("upgrade", "--repo", root).code == 0  # the advice, followed
    for args in news:
        res = run(*args, "--repo", root)
        assert res.code == 0, res
        assert run("check", "--repo", root, "--expect", f"linear={args[-1]}").code == 0
    assert run("set", "--wgrad", "nvfp4-rht", "--repo", root).code == 0


def test_a_value_unknown_to_a_forks_own_chain_still_names_init_and_init_teaches_it(run, tmp_path):
    """A fork's explicit chain that hands nothing on to quantpatch_ops.py: init is what
    teaches it the values (upgrade would find nothing installed)."""
    from .test_dispatch_knows import _fork

    root = _fork(tmp_path)
    res = run("set", "--repo", root, "--linear", "nvfp4")
    assert res.code == 2, res
    said = " ".join(res.err.split())
    assert "'quantpatch init' teaches it the quantpatch values" in said and "upgrade" not in said
    assert run("init", "--repo", root).code == 0  # the advice, followed
    assert run("set", "--repo", root, "--linear", "nvfp4").code == 0


@pytest.mark.slow
def test_init_remove_under_the_saver_names_saver_remove_and_that_is_accepted(run, make_checkout):
    """The saver rewrites files init wrote: init --remove said "layers.py changed since
    'quantpatch init'; revert it first", and a revert by hand would bypass the saver's
    record. It names 'saver remove', after which init --remove restores the stock files."""
    root = make_checkout(inject=False, extra=(LAYER,))
    stock = {p: p.read_bytes() for p in root.rglob("*.py")}
    assert run("init", "--repo", root).code == 0
    assert run("saver", "install", "--repo", root).code == 0
    before = git.Repo(root).head.commit.hexsha
    res = run("init", "--remove", "--repo", root)
    assert res.code == 2, res
    said = " ".join(res.err.split())
    assert said == (
        "error: megatron/core/tensor_parallel/layers.py was changed since 'quantpatch init' by "
        "'quantpatch saver install'; run 'quantpatch saver remove' first."
    ), said
    assert git.Repo(root).head.commit.hexsha == before and not git.Repo(root).is_dirty()
    assert run("saver", "remove", "--repo", root).code == 0  # the advice, followed
    assert run("init", "--remove", "--repo", root).code == 0
    assert {p: p.read_bytes() for p in root.rglob("*.py")} == stock


# -- data prepare on a read-only file system ---------------------------------------------------

_RO = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'


def _read_only(folder: Path, *cmd: object) -> subprocess.CompletedProcess[str]:
    """``cmd`` run with ``folder`` a read-only file system (a bind mount remounted read-only
    in a mount namespace of its own, as an unprivileged user may make one)."""
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _RO, "sh", folder,
         *map(str, cmd)],
        capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.slow  # about 25 s: a tokenizer trained, four CLI runs
def test_data_prepare_on_a_read_only_file_system(tmp_path):
    """An up-to-date dataset on a read-only file system: "up to date", exit 0 (it said
    "permission denied", exit 2: its lock file could not be made). A dataset to write there:
    one sentence naming the folder and the reason, exit 2; its advice, another --data-root,
    followed and accepted."""
    from .test_data_prepare import make_tokenizer

    probe = _read_only(tmp_path, "true")
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged mount namespace here: {probe.stderr.strip()}")
    tok = make_tokenizer(tmp_path / "tok")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(50)))
    data, other = tmp_path / "data", tmp_path / "other"
    args = ["data", "prepare", "wikipedia", "--input", src, "--models", "llama32-1b",
            "--tokenizer", f"llama32-1b={tok}"]  # fmt: skip
    made = subprocess.run([QUANTPATCH, *map(str, args), "--data-root", data], capture_output=True)
    assert made.returncode == 0, made
    before = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    res = _read_only(data, QUANTPATCH, *args, "--data-root", data)
    assert res.returncode == 0, res
    assert "up to date" in res.stdout, res
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file()} == before

    src.write_text(src.read_text() + '{"text": "one more"}\n')  # now it must be written
    res = _read_only(data, QUANTPATCH, *args, "--data-root", data)
    said = " ".join(res.stderr.split())
    assert res.returncode == 2, res
    assert said == (
        f"error: {data / 'wikipedia'} is not writable (read-only file system): choose --data-root."
    ), said
    res = _read_only(data, QUANTPATCH, *args, "--data-root", other)  # the advice, followed
    assert res.returncode == 0, res
    assert (other / "wikipedia" / "llama32-1b_text_document.idx").is_file()
