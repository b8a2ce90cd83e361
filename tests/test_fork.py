"""The commands on a checkout shaped like the fork, exactly as its user has it: a clone made
with ``git clone -b quant`` (a branch named ``quant``, history, a ``CustomLinear...`` copy, a
label site before a shared Q.K^T/P.V site, the fork's own saver and its callers)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import git
import pytest

from quantpatch.checkout.worktrees import ensure_worktree
from quantpatch.launch.registry import load_registry
from quantpatch.sites.codemods.init_sites import Layout

from .conftest import git_out, snapshot
from .forklike import ATTENTION, LINEAR, build_fork, clone_quant

SCHEMES = {
    "bf16": ("bf16", "bf16", "bf16"),
    **{f"FA_{f}": ("bf16", f, "bf16") for f in ("mxfp8", "mxfp4", "hifp8")},
    **{f"linear_{f}": (f, "bf16", "bf16") for f in ("mxfp8", "mxfp4", "hifp8")},
    **{f"FA_linear_{f}": (f, f, "bf16") for f in ("mxfp8", "mxfp4", "hifp8")},
}


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory, trees: dict[str, Path]):
    return build_fork(tmp_path_factory.mktemp("fork") / "origin", trees["0.13.1"], full=False)


@pytest.fixture
def clone(origin, tmp_path: Path) -> Path:
    return clone_quant(origin, tmp_path / "Megatron-LM")


def _sites(run, root: Path) -> list[dict]:
    res = run("check", "--json", "--repo", root)
    assert res.code == 0, res
    return json.loads(res.out)["sites"]


def _attention(sites: list[dict]) -> list[tuple[str, str, str]]:
    return [(s["role"], s["value"], s["form"]) for s in sites if s["file"] == ATTENTION]


def test_headline_set_on_the_clone(run, clone):
    assert git_out(clone, "branch", "--show-current").strip() == "quant"
    before = _sites(run, clone)
    assert _attention(before) == [("qk+pv", "hifp8", "label"), ("qk+pv", "hifp8", "literal")]
    original = {rel: (clone / rel).read_bytes() for rel in (LINEAR, ATTENTION)}

    res = run("set", "--repo", clone, "--linear", "mxfp8", "--qk", "mxfp8", "--pv", "hifp8")
    assert res.code == 0, res
    assert git_out(clone, "branch", "--show-current").strip() == (
        "quantpatch/linear-mxfp8_qk-mxfp8_pv-hifp8"
    )
    # read back: the label takes the value of what it labels (Q.K^T), the shared site is
    # split right before the P.V dispatch, and only the literals changed
    after = _sites(run, clone)
    assert _attention(after) == [
        ("qk", "mxfp8", "label"),
        ("qk", "mxfp8", "literal"),
        ("pv", "hifp8", "literal"),
    ]
    text = (clone / ATTENTION).read_text()
    lines = text.splitlines()
    pv_line = next(s["line"] for s in after if s["role"] == "pv")
    assert lines[pv_line].strip() == "if custom_quant_type == 'mxfp8':"  # the fork's chain
    assert "fork_quant.bmm(attention_probs" in "\n".join(lines[pv_line : pv_line + 3])
    linear = [s for s in after if s["file"] == LINEAR]
    assert {s["value"] for s in linear} == {"mxfp8"} and len(linear) == 4
    assert all(s["function"].startswith("CustomLinear") for s in linear)
    changed = [
        i
        for i, (a, b) in enumerate(
            zip(
                original[LINEAR].splitlines(),
                (clone / LINEAR).read_bytes().splitlines(),
                strict=True,
            )
        )
        if a != b
    ]
    assert len(changed) == 4  # the four literals, nothing else

    assert run("restore", "--repo", clone).code == 0
    assert git_out(clone, "branch", "--show-current").strip() == "quant"
    assert {rel: (clone / rel).read_bytes() for rel in original} == original
    assert git_out(clone, "status", "--porcelain") == ""


def test_every_fa_scheme_and_no_split(run, clone):
    for scheme in ("FA_mxfp8", "FA_mxfp4", "FA_hifp8", "FA_linear_mxfp4"):
        res = run("set", "--repo", clone, "--scheme", scheme)
        assert res.code == 0, (scheme, res)
        want = SCHEMES[scheme]
        roles = json.loads(run("check", "--json", "--repo", clone).out)["roles"]
        assert (roles["linear"], roles["qk"], roles["pv"]) == want
    assert run("restore", "--repo", clone).code == 0
    before = snapshot(clone)
    res = run("set", "--repo", clone, "--scheme", "FA_mxfp8", "--no-split")
    governed = next(s for s in _sites(run, clone) if s["form"] == "literal" and "qk" in s["role"])
    assert res.code == 2 and f"{ATTENTION}:{governed['line']}:" in res.err
    assert snapshot(clone) == before


def test_environment_default_form(run, origin, tmp_path, trees):
    fork = build_fork(
        tmp_path / "env-origin",
        trees["0.13.1"],
        history=3,
        layout=Layout(value="hifp8", env=True, label=True),
        full=False,
    )
    root = clone_quant(fork, tmp_path / "env-clone")
    assert [s[2] for s in _attention(_sites(run, root))] == ["label", "env"]
    assert run("set", "--repo", root, "--scheme", "FA_linear_hifp8").code == 0
    text = (root / ATTENTION).read_text()
    assert text.count("os.environ.get('CUSTOM_QUANT_TYPE', 'hifp8')") == 2
    assert text.count("os.environ.get('CUSTOM_QUANT_TYPE', 'bf16')") == 1
    assert [(r, v) for r, v, _ in _attention(_sites(run, root))] == [
        ("qk", "hifp8"),
        ("qk", "hifp8"),
        ("pv", "bf16"),
    ]


@pytest.mark.slow  # 46 s: every scheme; the fast suite keeps the fork clone's other tests
def test_every_scheme_worktree_and_run_dry_run(run, clone):
    before = snapshot(clone)
    for scheme, (lin, qk, pv) in SCHEMES.items():
        res = run("worktree", "--repo", clone, "--scheme", scheme, "--path-only")
        assert res.code == 0, (scheme, res)
        wt = Path(res.out.strip())
        check = run("check", "--repo", wt, "--expect", f"linear={lin},qk={qk},pv={pv}")
        assert check.code == 0, (scheme, check)
        res = run(
            "run",
            "--repo",
            clone,
            "--model",
            "llama32-1b",
            "--dataset",
            "wikipedia",
            "--scheme",
            scheme,
            "--profile",
            "smoke",
            "--dry-run",
        )
        assert res.code == 0, (scheme, res)  # the script ran check --expect in the worktree
    after = snapshot(clone)
    assert after["files"] == before["files"] and after["head"] == before["head"]


def test_prefix_collision_is_refused_up_front(run, clone):
    (clone / "quantpatch.toml").write_text('branch_prefix = "quant"\n')
    before = snapshot(clone)
    for args in (
        ("set", "--scheme", "FA_mxfp8"),
        ("worktree", "--scheme", "FA_mxfp8"),
    ):
        res = run(*args[:1], "--repo", clone, *args[1:])
        assert res.code == 2, res
        assert "the branch 'quant' exists" in res.err and "branch_prefix" in res.err
        assert str(clone / "quantpatch.toml") in res.err
        assert snapshot(clone) == before
    (clone / "quantpatch.toml").write_text('branch_prefix = "exp/qp"\n')
    assert run("set", "--repo", clone, "--scheme", "FA_mxfp8").code == 0
    assert git_out(clone, "branch", "--show-current").strip().startswith("exp/qp/linear-bf16")


def test_legacy_quant_prefix_branch_restores(run, make_checkout):
    """A set made by quantpatch 0.1 (branch quant/..., record without 'pending') restores."""
    root = make_checkout()
    repo = git.Repo(root)
    base = repo.head.commit.hexsha
    repo.git.checkout("-q", "-b", "quant/linear-mxfp8_qk-bf16_pv-bf16")
    text = (root / "megatron/core/tensor_parallel/layers.py").read_text()
    (root / "megatron/core/tensor_parallel/layers.py").write_text(
        text.replace("custom_quant_type = 'bf16'", "custom_quant_type = 'mxfp8'")
    )
    repo.git.commit("-qam", "quantpatch: linear=mxfp8 qk=bf16 pv=bf16")
    state = {
        "version": 1,
        "mode": "branch",
        "base": {"branch": "main", "commit": base},
        "current": {"branch": "quant/linear-mxfp8_qk-bf16_pv-bf16", "values": {}},
        "history": [],
    }
    (root / ".git/quantpatch").mkdir(exist_ok=True)
    (root / ".git/quantpatch/state.json").write_text(json.dumps(state))
    assert run("restore", "--repo", root).code == 0
    assert repo.active_branch.name == "main" and repo.head.commit.hexsha == base


def test_moving_base_rebuilds_branch_and_worktrees(run, clone):
    repo = git.Repo(clone)
    values = {"linear": "mxfp8", "qk": "bf16", "pv": "bf16"}
    wts = {
        s: ensure_worktree(clone, dict(zip(("linear", "qk", "pv"), SCHEMES[s], strict=True)))
        for s in ("FA_mxfp8", "linear_hifp8", "bf16")
    }
    assert run("set", "--repo", clone, "--scheme", "linear_mxfp8").code == 0
    name = repo.active_branch.name
    first = repo.head.commit.hexsha
    # the user adds a commit on the scheme branch, then new work on the base
    (clone / "NOTES.md").write_text("run 1 notes\n")
    repo.git.add("NOTES.md")
    repo.git.commit("-qm", "notes for this scheme")
    assert run("restore", "--repo", clone).code == 0
    (clone / "README.md").write_text("new work on the base\n")
    repo.git.commit("-qam", "user: new work on quant")
    tip = repo.head.commit.hexsha

    res = run("set", "--repo", clone, "--scheme", "linear_mxfp8")
    assert res.code == 0 and "rebuilt" in res.out, res
    assert repo.active_branch.name == name
    chain = [c.summary for c in repo.iter_commits("HEAD", max_count=3)]
    assert chain == [
        "notes for this scheme",
        "quantpatch: linear=mxfp8 qk=bf16 pv=bf16",
        "user: new work on quant",
    ]
    assert repo.head.commit.parents[0].parents[0].hexsha == tip
    assert (clone / "NOTES.md").read_text() == "run 1 notes\n"
    assert (clone / "README.md").read_text() == "new work on the base\n"
    assert repo.head.commit.hexsha != first
    roles = json.loads(run("check", "--json", "--repo", clone).out)["roles"]
    assert roles == values

    # the three worktrees made before the move now sit on the new tip
    for scheme, old in wts.items():
        new = ensure_worktree(
            clone, dict(zip(("linear", "qk", "pv"), SCHEMES[scheme], strict=True))
        )
        assert new.path == old.path
        head = git.Repo(new.path).head.commit
        assert tip in {head.hexsha, *(p.hexsha for p in head.parents)}, scheme
        assert (new.path / "README.md").read_text() == "new work on the base\n"
    assert run("restore", "--repo", clone).code == 0


def test_user_commit_that_conflicts_is_named(run, clone):
    repo = git.Repo(clone)
    assert run("set", "--repo", clone, "--scheme", "FA_hifp8").code == 0
    (clone / "README.md").write_text("tweak on the scheme branch\n")
    repo.git.commit("-qam", "tweak README on scheme")
    assert run("restore", "--repo", clone).code == 0
    (clone / "README.md").write_text("different tweak on the base\n")
    repo.git.commit("-qam", "base README")
    before = snapshot(clone)
    res = run("set", "--repo", clone, "--scheme", "FA_hifp8")
    assert res.code == 2 and "'tweak README on scheme'" in res.err and "git rebase" in res.err
    assert snapshot(clone) == before


class _Killed(BaseException):
    """Stands in for SIGKILL inside the process: unwinds without any rollback."""


@pytest.mark.parametrize("step", ["checkout", "final-state"])
def test_set_killed_between_checkout_and_record(run, clone, monkeypatch, step):
    from quantpatch.git import repo as gitrepo

    real_run, real_save = gitrepo.run_git, gitrepo.save_state
    saves = []

    def run_git(repo, *args, **kw):
        out = real_run(repo, *args, **kw)
        if step == "checkout" and args[0] == "checkout":
            raise _Killed
        return out

    def save_state(checkout, state):
        saves.append(state)
        if step == "final-state" and len(saves) == 2:
            raise _Killed
        real_save(checkout, state)

    monkeypatch.setattr(gitrepo, "run_git", run_git)
    monkeypatch.setattr(gitrepo, "save_state", save_state)
    with pytest.raises(_Killed):
        run("set", "--repo", clone, "--scheme", "FA_mxfp8")
    monkeypatch.undo()
    repo = git.Repo(clone)
    assert repo.active_branch.name.startswith("quantpatch/")  # stranded, as after SIGKILL
    report = run("check", "--repo", clone)
    assert "base (branch): quant" in report.out and "interrupted" in report.out
    # a second set records nothing new as the base; restore goes back to the user's branch
    assert run("set", "--repo", clone, "--scheme", "FA_hifp8").code == 0
    assert run("restore", "--repo", clone).code == 0
    assert repo.active_branch.name == "quant"


def test_scheme_branch_with_no_record_recovers_the_base(run, clone):
    """What an older quantpatch left when killed before its record: on a scheme branch
    with no state. The base comes back from the commit, never the scheme branch itself."""
    assert run("set", "--repo", clone, "--scheme", "FA_mxfp8").code == 0
    (clone / ".git/quantpatch/state.json").unlink()
    res = run("set", "--repo", clone, "--scheme", "FA_hifp8")
    assert res.code == 0 and "recovered the base quant" in res.err
    assert run("restore", "--repo", clone).code == 0
    assert git.Repo(clone).active_branch.name == "quant"


MLA_SENTENCE = (
    "deepseek2_lite uses Multi-Latent Attention, which hands the local DotProductAttention its "
    f"k_channels and v_channels, but {ATTENTION} does not take them; `quantpatch init --repo "
    "{repo}` adds them."
)


def _stubbed(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ``torchrun`` is test_scripts' recording stub."""
    from .test_scripts import QUANTPATCH, STUB

    bin_dir, stub_dir = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub_dir.mkdir()
    (bin_dir / "torchrun").write_text(STUB)
    (bin_dir / "torchrun").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(stub_dir),
        "QUANTPATCH": QUANTPATCH,
        "OUTPUT_ROOT": str(tmp_path / "runs"),
    }
    return env, stub_dir


@pytest.fixture
def data_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``DATA_ROOT`` (in the environment) holding every model's dataset files, empty: what a
    user has before launching; the scripts, ``gen-scripts`` and ``sweep run`` check it."""
    from quantpatch.data_prep.layout import data_prefix
    from quantpatch.launch.registry import load_registry

    root = tmp_path / "data"
    reg = load_registry(None)
    for model in reg.models:
        for dataset in reg.datasets.values():
            prefix = data_prefix(dataset.prefix, model, {}, data_root=str(root))
            prefix.parent.mkdir(parents=True, exist_ok=True)
            for suffix in (".bin", ".idx"):
                Path(f"{prefix}{suffix}").write_bytes(b"")
    monkeypatch.setenv("DATA_ROOT", str(root))
    monkeypatch.delenv("DATA_PREFIX", raising=False)
    return root


def _warnings(res) -> list[str]:
    return [line for line in res.err.splitlines() if line.startswith("warning:")]


@pytest.mark.slow
def test_before_init_every_script_is_written_and_mla_ones_stop_before_torchrun(
    run, clone, tmp_path, data_root
):
    """The fork's local DotProductAttention does not take MLA's k_channels / v_channels (as
    stock Megatron): all 60 scripts are written with one warning line; a DeepSeek script stops
    before torchrun naming the file and `quantpatch init` (the stub is never called), `sweep
    run` refuses DeepSeek before it starts anything; after `init` (a commit on `quant`) the
    same script reaches torchrun, and a new generation has no warning."""
    out = tmp_path / "scripts"
    before = snapshot(clone)
    sentence = MLA_SENTENCE.format(repo=clone)
    res = run("gen-scripts", "--repo", clone, "--out", out)
    assert res.code == 0, res
    reg = load_registry()
    default = len(reg.pick("schemes", None))
    written = len(sorted(out.rglob("*.sh")))
    models, datasets = len(reg.pick("models", None)), len(reg.pick("datasets", None))
    assert written == default * models * datasets, (
        f"{written} scripts, not one per scheme ({default}), default model ({models}) and "
        f"dataset ({datasets})"
    )
    (warning,) = _warnings(res)
    assert sentence.removesuffix(".") in " ".join(warning.split())
    assert "20 scripts stop before torchrun" in warning
    assert snapshot(clone) == before  # gen-scripts writes scripts only
    env, stub_dir = _stubbed(tmp_path)
    script = out / "deepseek2_lite" / "pretrain_deepseek2_lite_wikipedia_bf16.sh"
    done = subprocess.run([str(script)], cwd=clone, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"[quantpatch] {sentence}"
    assert not list(stub_dir.iterdir())  # torchrun never started
    from .test_scripts import SHELLCHECK

    if Path(SHELLCHECK).exists():
        lint = subprocess.run([SHELLCHECK, str(script)], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout
    llama = out / "llama32-1b" / "pretrain_llama32-1b_wikipedia_bf16.sh"
    assert "k_channels" not in llama.read_text()  # the other models' scripts carry no check
    sweep = tmp_path / "sweep"
    res = run("sweep", "run", sweep, "--models", "deepseek2_lite,llama32-1b", "--datasets",
              "wikipedia", "--schemes", "bf16", "--profile", "smoke", "--repo", clone)  # fmt: skip
    assert res.code == 2 and " ".join(res.err.split()) == f"error: {sentence}", res
    assert not sweep.exists() and not list(stub_dir.iterdir())
    res = run("run", "--repo", clone, "--model", "deepseek2_lite", "--dataset", "wikipedia",
              "--scheme", "bf16", "--profile", "smoke")  # fmt: skip
    assert res.code == 2 and sentence in " ".join(res.err.split()), res
    # followed as written, from another directory: the command in the sentence
    command = re.search(r"`quantpatch (init --repo \S+)`", sentence)
    assert command, sentence
    res = run(*shlex.split(command[1]))
    assert res.code == 0, res
    done = subprocess.run([str(script)], cwd=clone, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr  # the same script: its worktree has them now
    assert len(list(stub_dir.glob("argv.*"))) == 1
    res = run("gen-scripts", "--repo", clone, "--out", out)
    assert res.code == 0 and _warnings(res) == [], res
    reg = load_registry()
    default = len(reg.pick("schemes", None))
    written = len(sorted(out.rglob("*.sh")))
    models, datasets = len(reg.pick("models", None)), len(reg.pick("datasets", None))
    assert written == default * models * datasets, (
        f"{written} scripts, not one per scheme ({default}), default model ({models}) and "
        f"dataset ({datasets})"
    )
    assert "k_channels" not in script.read_text()


def test_gen_scripts_for_the_clones_own_release(run, clone, tmp_path, data_root):
    """All 60 scripts, no warning, once `init` has given the fork's DotProductAttention MLA's
    head dims (with the rest of init, one commit on `quant`)."""
    assert run("init", "--repo", clone).code == 0
    assert "k_channels: int = None" in (clone / ATTENTION).read_text()
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--repo", clone, "--out", out)
    assert res.code == 0 and _warnings(res) == [], res
    assert "0.15.0rc3" in res.out + res.err
    scripts = sorted(out.rglob("*.sh"))
    assert len(scripts) == 60
    for script in scripts:
        text = script.read_text()
        assert "0.15.0rc3" in text.split("set -euo pipefail")[0], script
        assert (
            "--expert-model-parallel-size" not in text
            or text.count("--expert-model-parallel-size") == 1
        )
    assert git_out(clone, "status", "--porcelain") == ""


def test_an_earlier_init_gets_the_mla_head_dims_from_init(run, clone, monkeypatch):
    """A fork `init`ed by an earlier quantpatch (its record, no MLA head dims: that init left a
    fork's attention without them): `init` again adds just them as a commit of its own, a
    third `init` has nothing to do, and `init --remove` restores the fork's original bytes."""
    from quantpatch.checkout import init as init_module

    original = {rel: (clone / rel).read_bytes() for rel in (LINEAR, ATTENTION)}
    head = git_out(clone, "rev-parse", "HEAD").strip()
    with monkeypatch.context() as earlier:
        earlier.setattr(init_module, "with_mla_head_dims", lambda text, rel: None)
        assert run("init", "--repo", clone).code == 0
    first = (clone / ATTENTION).read_text()
    assert "k_channels" not in first and "quantpatch_ops" in first
    linear = (clone / LINEAR).read_bytes()
    res = run("init", "--repo", clone)
    assert res.code == 0, res
    assert f"initialised: {ATTENTION}; commit" in " ".join(res.out.split())
    log = git_out(clone, "log", "--format=%s", f"{head}..HEAD").splitlines()
    assert len(log) == 2 and "MLA's k_channels / v_channels" in log[0]
    assert git_out(clone, "diff", "--name-only", "HEAD~1", "HEAD").split() == [ATTENTION]
    assert (clone / LINEAR).read_bytes() == linear
    taught = (clone / ATTENTION).read_text()
    assert taught == init_module.with_mla_head_dims(first, ATTENTION)
    assert "k_channels: int = None" in taught and "v_channels: int = None" in taught
    res = run("init", "--repo", clone)
    assert res.code == 2 and "already initialised" in res.err
    assert (clone / ATTENTION).read_text() == taught
    res = run("init", "--repo", clone, "--remove")
    assert res.code == 0, res
    assert {rel: (clone / rel).read_bytes() for rel in original} == original
    assert git_out(clone, "status", "--porcelain") == ""


@pytest.mark.slow
def test_a_slurm_sweep_on_the_clone(run, clone, tmp_path, monkeypatch, data_root):
    """The launchers on the fork as its user has it (a `quant` clone with history, label
    sites, its own saver and a 0.15.0rc3 parser): worktrees prepared, an array task run by
    stub sbatch/srun/torchrun in the scheme's worktree, and a job refused once `quant` moves."""
    from .test_launchers import QUANTPATCH, STUBS, calls

    monkeypatch.chdir(clone)
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(record),
        "QUANTPATCH": QUANTPATCH,
        "OUTPUT_ROOT": str(tmp_path / "runs"),
        "STUB_ARRAY_TASK": "7",
    }
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out, "--launcher", "slurm", "--nodes", "2", "--prepare",
              "--models", "llama32-1b", "--datasets", "dolma")  # fmt: skip
    assert res.code == 0, res
    assert "validated against the checkout's Megatron 0.15.0rc3" in res.out
    res = subprocess.run(["sbatch", str(out / "sweep.sbatch")], cwd=clone, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pretrain_llama32-1b_dolma_FA_linear_mxfp8.sbatch" in res.stdout
    nodes = calls(record, "torchrun")
    assert len(nodes) == 2
    wt = Path(nodes[0][1])
    assert wt.name == "quantpatch__linear-mxfp8_qk-mxfp8_pv-bf16"
    held = [(s["role"], s["value"]) for s in _sites(run, wt) if s["file"] == ATTENTION]
    assert held == [("qk", "mxfp8"), ("qk", "mxfp8"), ("pv", "bf16")]  # label, qk, split pv
    assert git_out(clone, "branch", "--show-current").strip() == "quant"
    assert git_out(clone, "status", "--porcelain", "--untracked-files=no") == ""
    git_out(clone, "commit", "-q", "--allow-empty", "-m", "a fix on quant")
    res = subprocess.run(["sbatch", str(out / "sweep.sbatch")], cwd=clone, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 2 and "quant has moved on to" in res.stderr


def test_init_on_the_clone_keeps_check_green_and_the_roles(run, clone):
    """`init` on the fork inserts the ParetoQ constructor sites
    (`ColumnParallelLinear.__init__`, `RowParallelLinear.__init__`) with the linear role's
    current value, so `check` still exits 0 right after it, every role reads as before, and
    the documented partial `set --qk mxfp8` keeps the other roles' values."""
    before = json.loads(run("check", "--json", "--repo", clone).out)["roles"]
    assert before["linear"] == "hifp8"
    assert run("init", "--repo", clone).code == 0
    res = run("check", "--repo", clone)
    assert res.code == 0, res
    sites = _sites(run, clone)
    steps = [s for s in sites if s["function"].endswith("ParallelLinear.__init__")]
    assert len(steps) == 2 and {s["value"] for s in steps} == {"hifp8"}
    after = json.loads(run("check", "--json", "--repo", clone).out)["roles"]
    assert after == before
    res = run("set", "--repo", clone, "--qk", "mxfp8")
    assert res.code == 0, res
    roles = json.loads(run("check", "--json", "--repo", clone).out)["roles"]
    assert (roles["linear"], roles["qk"], roles["pv"]) == ("hifp8", "mxfp8", before["pv"])


def test_a_delayed_value_on_the_clone_reaches_every_linear_site(run, clone):
    """After `init` on the fork, `set --linear fp8-delayed` puts the value in the linear
    GEMMs' sites and in the constructor sites that give each layer its amax history; Q.K^T
    refuses it in one sentence, changing nothing."""
    assert run("init", "--repo", clone).code == 0
    res = run("set", "--repo", clone, "--linear", "fp8-delayed", "--no-branch")
    assert res.code == 0, res
    assert run("check", "--repo", clone, "--expect", "linear=fp8-delayed").code == 0
    linear = [s for s in _sites(run, clone) if s["role"] == "linear"]
    steps = [s for s in linear if s["function"].endswith("ParallelLinear.__init__")]
    assert len(steps) == 2 and {s["value"] for s in linear} == {"fp8-delayed"}
    before = (clone / ATTENTION).read_bytes()
    res = run("set", "--repo", clone, "--qk", "fp8-delayed", "--no-branch")
    assert res.code == 2 and "amax history" in res.err and res.err.count(". ") == 0, res
    assert (clone / ATTENTION).read_bytes() == before
