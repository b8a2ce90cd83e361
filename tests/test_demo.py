"""The README's main job: a demo checkout of the whole megatron-core tree, walked end to end."""

from __future__ import annotations

import git
import pytest

from quantpatch.config import Targets
from quantpatch.demo import build_checkout
from quantpatch.errors import UserError
from quantpatch.sites import discover


def test_demo_walks_and_restores_byte_identical(run, tmp_path):
    dest = tmp_path / "demo"
    res = run("demo", dest)
    assert res.code == 0, res
    assert "target files byte-identical to before the first set: yes" in res.out
    assert "quant/linear-hifp8_qk-mxfp4_pv-mxfp8" in res.out
    repo = git.Repo(dest)
    assert repo.active_branch.name == "main" and not repo.is_dirty()
    assert {h.name for h in repo.heads} == {
        "main",
        "quant/linear-mxfp8_qk-mxfp8_pv-bf16",
        "quant/linear-hifp8_qk-mxfp4_pv-mxfp8",
    }
    # the whole package tree is there, not only the two target files
    assert len(list((dest / "megatron" / "core").rglob("*.py"))) > 200
    assert [c.summary for c in repo.iter_commits("main")] == [
        "Add fork-layout custom_quant_type sites",
        "megatron-core 0.13.1, unmodified",
    ]
    res = run("demo", dest)
    assert res.code == 2 and "not empty" in res.err


def test_demo_checkout_of_older_release(tmp_path):
    dest = build_checkout(tmp_path / "old", "0.11.0")
    sites = [s for f in discover(dest, Targets()) for s in f.sites]
    assert [s.role for s in sites] == ["linear", "linear", "linear", "qk", "pv"]


def test_unknown_release_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPATCH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"cannot fetch megatron-core 0\.0\.0"):
        build_checkout(tmp_path / "x", "0.0.0")
