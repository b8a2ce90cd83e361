"""Per-scheme worktrees: creation without touching the checkout, reuse, and refusals."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import git

from quantpatch.checkout.worktrees import ensure_worktree

from .conftest import ATTENTION, LINEAR, snapshot

QUANTPATCH = str(Path(sys.executable).with_name("quantpatch"))
MXFP8 = "quantpatch/linear-bf16_qk-mxfp8_pv-bf16"
LAYER = "megatron/core/transformer/transformer_layer.py"


def test_created_from_the_base_without_touching_the_checkout(run, make_checkout):
    root = make_checkout()
    before = snapshot(root)
    res = run("worktree", "--repo", root, "--scheme", "FA_hifp8")
    assert res.code == 0 and "created worktree" in res.out
    after = snapshot(root)
    assert after["files"] == before["files"] and after["head"] == before["head"]
    wt = ensure_worktree(root, {"linear": "bf16", "qk": "hifp8", "pv": "bf16"})
    assert not wt.created_worktree and not wt.created_branch
    wt_repo = git.Repo(wt.path)
    assert wt_repo.head.is_detached
    assert wt_repo.head.commit.parents[0].hexsha == git.Repo(root).head.commit.hexsha
    assert run("worktree", "--repo", root, "--scheme", "FA_hifp8").out.startswith("reused")


def test_uses_an_existing_branch_and_the_recorded_base(run, make_checkout):
    root = make_checkout()
    base = git.Repo(root).head.commit.hexsha
    assert run("set", "--repo", root, "--linear", "mxfp4").code == 0  # branch + recorded base
    wt = ensure_worktree(root, {"linear": "mxfp4", "qk": "bf16", "pv": "bf16"})
    assert wt.created_worktree and not wt.created_branch
    assert git.Repo(wt.path).head.commit.hexsha == git.Repo(root).head.commit.hexsha
    other = ensure_worktree(root, {"linear": "hifp8", "qk": "bf16", "pv": "bf16"})
    assert git.Repo(other.path).head.commit.parents[0].hexsha == base


def test_refusals(run, make_checkout):
    root = make_checkout()
    res = run("worktree", "--repo", root, "--linear", "mxfp8")
    assert res.code == 2 and "give all three roles (missing: qk, pv)" in res.err
    res = run("worktree", "--repo", root, "--scheme", "nope")
    assert res.code == 2 and "unknown scheme 'nope'" in res.err
    res = run("worktree", "--repo", root, "--linear", "fp8", "--qk", "bf16", "--pv", "bf16")
    assert res.code == 2 and "unknown quant type 'fp8'" in res.err
    wt = ensure_worktree(root, {"linear": "mxfp8", "qk": "bf16", "pv": "bf16"})
    (wt.path / ATTENTION).write_text((wt.path / ATTENTION).read_text() + "# tampered\n")
    res = run("worktree", "--repo", root, "--linear", "mxfp8", "--qk", "bf16", "--pv", "bf16")
    assert res.code == 2 and f"uncommitted changes to {ATTENTION}" in res.err
    # a branch of that name carrying a commit of the user's that changes a target file
    repo = git.Repo(root)
    repo.git.checkout("-q", "-b", "quantpatch/linear-hifp8_qk-bf16_pv-bf16")
    (root / LINEAR).write_text((root / LINEAR).read_text() + "# mine\n")
    repo.git.commit("-qam", "my linear tweak")
    repo.git.checkout("-q", "main")
    res = run("worktree", "--repo", root, "--linear", "hifp8", "--qk", "bf16", "--pv", "bf16")
    assert res.code == 2 and "carries your commit" in res.err and "my linear tweak" in res.err


def _worktree(run, root: Path, scheme: str = "FA_mxfp8") -> Path:
    res = run("worktree", "--repo", root, "--scheme", scheme, "--path-only")
    assert res.code == 0, res
    return Path(res.out.strip())


def _commit(repo_dir: Path, rel: str, text: str, message: str) -> str:
    repo = git.Repo(repo_dir)
    (repo_dir / rel).write_text(text)
    repo.git.add("--", rel)
    repo.git.commit("-qm", message)
    return repo.head.commit.hexsha


def _on_branch(root: Path, commit: str) -> list[str]:
    return git.Repo(root).git.branch("--contains", commit, "--format=%(refname:short)").split()


def test_commits_made_in_a_worktree_are_kept(run, make_checkout):
    """A commit made in a scheme's worktree goes onto its branch (carried when the base moves
    on, like any commit of the user's there); one that is not on the branch is refused."""
    root = make_checkout()
    wt = _worktree(run, root)
    mine = _commit(wt, "NOTES", "a fix made while training\n", "my fix in the worktree")
    assert run("worktree", "--repo", root, "--scheme", "FA_mxfp8").code == 0  # base unmoved
    assert _on_branch(root, mine) == [MXFP8] and git.Repo(wt).head.commit.hexsha == mine
    _commit(root, "OTHER", "moved on\n", "the base moves on")
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 0, res
    tip = git.Repo(root).commit(MXFP8)
    assert tip.message == "my fix in the worktree\n" and tip.parents[0].parents[0] == (
        git.Repo(root).heads.main.commit
    )
    assert git.Repo(wt).head.commit == tip and (wt / "NOTES").is_file()
    # a commit changing a target file is refused, naming it; the branch stays where it was
    text = (
        (wt / LINEAR)
        .read_text()
        .replace("custom_quant_type = 'bf16'", "custom_quant_type = 'mxfp4'", 1)
    )
    bad = _commit(wt, LINEAR, text, "my linear tweak")
    before = snapshot(root)
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "my linear tweak" in res.err, res
    assert snapshot(root) == before and git.Repo(wt).head.commit.hexsha == bad
    # a commit off the branch (the worktree moved elsewhere by hand) is refused, naming it
    git.Repo(wt).git.checkout("-q", "--detach", "main")
    stray = _commit(wt, "STRAY", "x\n", "a stray commit")
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and f"{stray[:12]} 'a stray commit'" in res.err, res
    assert "on no branch" in res.err and res.err.count(". ") == 0
    assert snapshot(root) == before and git.Repo(wt).head.commit.hexsha == stray


def _quantpatch(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a process: ``run`` starts the launch script, whose own quantpatch calls
    write to the real stderr."""
    return subprocess.run(
        [QUANTPATCH, "--repo", str(root), *args], capture_output=True, text=True, check=False
    )


RUN = ("run", "--model", "llama32-1b", "--dataset", "dolma", "--scheme", "FA_mxfp8")


def test_a_worktree_with_uncommitted_edits_is_refused(run, make_checkout):
    """A run there would not be the commit it logs (``--existing`` refuses the same)."""
    root = make_checkout()
    wt = _worktree(run, root)
    (wt / "README.md").write_text("edited in the worktree\n")
    before = snapshot(root)
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "uncommitted changes to README.md" in res.err
    assert f"git -C {wt} reset --hard" in res.err and snapshot(root) == before
    res = _quantpatch(root, *RUN, "--profile", "smoke", "--dry-run")
    assert res.returncode == 2 and "uncommitted changes to README.md" in res.stderr
    assert "torchrun" not in res.stdout
    git.Repo(wt).git.checkout("--", ".")
    assert run("worktree", "--repo", root, "--scheme", "FA_mxfp8").code == 0


def test_run_names_the_edits_of_the_checkout_it_leaves_out(make_checkout):
    root = make_checkout()
    res = _quantpatch(root, *RUN, "--profile", "smoke", "--dry-run")
    assert res.returncode == 0 and "not included" not in res.stderr, res.stderr
    (root / "README.md").write_text("edited in the checkout\n")
    (root / LINEAR).write_text((root / LINEAR).read_text() + "# mine\n")
    res = _quantpatch(root, *RUN, "--profile", "smoke", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert (
        f"note: the run trains committed code only: your uncommitted changes to README.md, "
        f"{LINEAR} in {root} are not included (commit them to include them).\n"
    ) in res.stderr


def test_an_operation_in_progress_is_refused(run, make_checkout, tmp_path):
    """In the middle of a rebase (or merge, cherry-pick, bisect) HEAD is an intermediate
    commit: ``worktree``, ``run`` and ``gen-scripts --prepare`` refuse to build on it."""
    root = make_checkout()
    repo = git.Repo(root)
    repo.git.checkout("-q", "-b", "other")
    _commit(root, "README.md", "theirs\n", "theirs")
    repo.git.checkout("-q", "main")
    _commit(root, "README.md", "ours\n", "ours")
    assert subprocess.run(["git", "rebase", "other"], cwd=root, capture_output=True).returncode
    before = snapshot(root)
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "a git rebase is in progress" in res.err
    assert "'git rebase --abort'" in res.err and res.err.count(". ") == 0
    out = tmp_path / "scripts"
    res = run("--repo", root, "gen-scripts", "--out", out, "--models", "llama32-1b",
              "--datasets", "dolma", "--schemes", "FA_mxfp8", "--prepare")  # fmt: skip
    assert res.code == 2 and "a git rebase is in progress" in res.err and not out.exists()
    res = _quantpatch(root, *RUN, "--profile", "smoke", "--dry-run")
    assert res.returncode == 2 and "a git rebase is in progress" in res.stderr
    assert snapshot(root) == before and MXFP8 not in repo.heads
    repo.git.rebase("--abort")
    repo.git.bisect("start")
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "a git bisect is in progress" in res.err and "bisect reset" in res.err
    repo.git.bisect("reset")
    assert run("worktree", "--repo", root, "--scheme", "FA_mxfp8").code == 0


def test_a_moved_checkout_keeps_its_worktrees(run, make_checkout, tmp_path):
    """After ``mv`` of the checkout its worktrees (under its git dir) are repaired, not pruned."""
    root = make_checkout()
    _worktree(run, root, "FA_mxfp8")
    _worktree(run, root, "FA_hifp8")
    moved = tmp_path / "moved"
    shutil.move(root, moved)
    res = run("worktree", "--repo", moved, "--scheme", "FA_mxfp8")
    assert res.code == 0 and res.out.startswith("reused"), res
    wt = _worktree(run, moved, "FA_hifp8")
    assert wt.is_relative_to(moved)
    assert run("check", "--repo", wt, "--expect", "linear=bf16,qk=hifp8,pv=bf16").code == 0
    # a link git cannot repair (an older quantpatch pruned its half): one sentence, exit 2
    shutil.rmtree(moved / ".git" / "worktrees" / wt.name)
    res = run("worktree", "--repo", moved, "--scheme", "FA_hifp8")
    assert res.code == 2 and "lost its link" in res.err and "internal error" not in res.err


def test_a_job_names_the_edited_file_and_what_removing_costs(run, make_checkout):
    root = make_checkout()
    wt = _worktree(run, root)
    (wt / "README.md").write_text("edited on a compute node\n")
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp8", "--existing")
    assert res.code == 2 and "uncommitted changes (README.md)" in res.err, res
    assert f"'git worktree remove --force {wt}' (this deletes those edits)" in res.err


def test_check_in_a_worktree_reports_the_saver_of_the_checkout(run, make_checkout):
    root = make_checkout(extra=(LAYER,))
    assert run("saver", "install", "--repo", root).code == 0
    wt = _worktree(run, root)
    data = json.loads(run("check", "--repo", wt, "--json").out)
    assert data["saver"]["installed"] and not data["saver"]["other"], data["saver"]
    res = run("saver", "status", "--repo", wt)
    assert res.code == 0 and res.out.startswith("installed: megatron/core/tensor_saver.py"), res
