"""Every command end to end through the real entry point, on real git repositories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import git
import pytest

from quantpatch import cli
from quantpatch.base import edits as edits_mod
from quantpatch.git import repo as repo_mod
from quantpatch.sites.codemods.init_sites import Layout

from .conftest import ATTENTION, LINEAR, git_out, snapshot


def _roles(run, root):
    res = run("check", "--json", "--repo", root)
    assert res.code in (0, 1), res
    return json.loads(res.out)["roles"]


def test_check_json_schema(run, make_checkout):
    root = make_checkout()
    res = run("--json", "check", "--repo", root)
    assert res.code == 0, res
    data = json.loads(res.out)
    assert data["roles"] == {"linear": "bf16", "qk": "bf16", "pv": "bf16"}
    assert {tuple(sorted(s)) for s in data["sites"]} == {
        ("file", "form", "function", "gemm", "line", "role", "source", "value")
    }
    first = data["sites"][0]
    assert first["file"] == LINEAR and first["function"].endswith(".forward")
    assert (
        Path(root, first["file"]).read_text().splitlines()[first["line"] - 1].strip()
        == "custom_quant_type = 'bf16'"
    )
    assert data["git"]["branch"] == "main" and data["git"]["clean"] is True
    assert data["base"] is None and data["saver"]["installed"] is False


def test_check_table_and_expect(run, make_checkout):
    root = make_checkout()
    res = run("check", "--repo", root)
    assert res.code == 0
    assert "DotProductAttention.forward" in res.out and f"{ATTENTION}:" in res.out
    assert "git: main @" in res.out and "base: none" in res.out
    assert run("check", "--repo", root, "--expect", "linear=bf16,qk=bf16").code == 0
    res = run("check", "--repo", root, "--expect", "qk=mxfp8")
    assert res.code == 1 and "qk is bf16, expected mxfp8" in res.err
    res = run("check", "--repo", root, "--expect", "attention=mxfp8")
    assert res.code == 2 and "--expect" in res.err


def test_check_flags_disagreeing_sites(run, make_checkout):
    # two sites of the same GEMM (one in each branch of an if): one edited by hand disagrees
    # (sites of different GEMMs may differ: set --fprop/--dgrad/--wgrad)
    root = make_checkout(layout=Layout(nested=True))
    p = root / LINEAR
    p.write_text(
        p.read_text().replace("custom_quant_type = 'bf16'", "custom_quant_type = 'hifp8'", 1)
    )
    res = run("check", "--repo", root)
    assert res.code == 1 and "the linear sites disagree" in res.err


def test_set_branch_commit_and_restore_byte_identical(run, make_checkout):
    root = make_checkout()
    before = snapshot(root)
    base = git_out(root, "rev-parse", "HEAD").strip()
    res = run("set", "--repo", root, "--scheme", "FA_linear_mxfp8")
    assert res.code == 0, res
    assert "quantpatch/linear-mxfp8_qk-mxfp8_pv-bf16" in res.out
    assert (
        git_out(root, "branch", "--show-current").strip()
        == "quantpatch/linear-mxfp8_qk-mxfp8_pv-bf16"
    )
    msg = git_out(root, "log", "-1", "--format=%B")
    assert msg.startswith("quantpatch: linear=mxfp8 qk=mxfp8 pv=bf16") and base in msg
    assert git_out(root, "rev-parse", "HEAD~1").strip() == base
    assert git_out(root, "show", "--stat", "--format=", "HEAD").count("|") == 2
    assert _roles(run, root) == {"linear": "mxfp8", "qk": "mxfp8", "pv": "bf16"}
    assert run("check", "--repo", root, "--expect", "linear=mxfp8,qk=mxfp8,pv=bf16").code == 0

    # a second set branches from the same base again (never stacks), pv differs from qk
    res = run("set", "--repo", root, "--linear", "hifp8", "--pv", "mxfp4")
    assert res.code == 0, res
    assert (
        git_out(root, "branch", "--show-current").strip()
        == "quantpatch/linear-hifp8_qk-mxfp8_pv-mxfp4"
    )
    assert git_out(root, "rev-parse", "HEAD~1").strip() == base
    assert _roles(run, root) == {"linear": "hifp8", "qk": "mxfp8", "pv": "mxfp4"}
    data = json.loads(run("check", "--json", "--repo", root).out)
    assert data["base"]["commit"] == base and data["base"]["branch"] == "main"

    # back to the first scheme: the existing branch is reused, no new commit
    tip = git_out(root, "rev-parse", "quantpatch/linear-mxfp8_qk-mxfp8_pv-bf16").strip()
    res = run("set", "--repo", root, "--scheme", "FA_linear_mxfp8")
    assert res.code == 0 and "reused" in res.out
    assert git_out(root, "rev-parse", "HEAD").strip() == tip

    res = run("restore", "--repo", root)
    assert res.code == 0, res
    after = snapshot(root)
    assert after["files"] == before["files"] and after["head"] == before["head"]
    assert after["state"] is None
    assert "quantpatch/linear-hifp8_qk-mxfp8_pv-mxfp4" in git_out(root, "branch")
    res = run("restore", "--repo", root)
    assert res.code == 2 and "nothing to restore" in res.err


def test_dry_run_prints_diff_and_changes_nothing(run, make_checkout):
    root = make_checkout()
    before = snapshot(root)
    res = run("set", "--repo", root, "--qk", "hifp8", "--dry-run")
    assert res.code == 0
    assert f"--- a/{ATTENTION}" in res.out
    assert "-        custom_quant_type = 'bf16'\n+        custom_quant_type = 'hifp8'" in res.out
    assert [
        ln for ln in res.out.splitlines() if ln.startswith("+") and not ln.startswith("+++")
    ] == ["+        custom_quant_type = 'hifp8'"]
    assert snapshot(root) == before


def test_shared_site_split_via_cli(run, make_checkout):
    root = make_checkout(layout=Layout(shared_attention=True))
    data = json.loads(run("check", "--json", "--repo", root).out)
    assert [s["role"] for s in data["sites"] if s["file"] == ATTENTION] == ["qk+pv"]
    before = snapshot(root)
    res = run("set", "--repo", root, "--qk", "mxfp8", "--no-split")
    assert res.code == 2 and "cannot differ with --no-split" in res.err
    assert snapshot(root) == before
    assert run("set", "--repo", root, "--qk", "mxfp8", "--pv", "mxfp8").code == 0
    assert _roles(run, root) == {"linear": "bf16", "qk": "mxfp8", "pv": "mxfp8"}
    assert run("set", "--repo", root, "--qk", "mxfp8", "--pv", "hifp8").code == 0
    assert _roles(run, root) == {"linear": "bf16", "qk": "mxfp8", "pv": "hifp8"}
    assert run("restore", "--repo", root).code == 0
    assert snapshot(root)["files"] == before["files"]


@pytest.mark.parametrize("use_git", [True, False])
def test_no_branch_in_place_set_and_restore(run, make_checkout, tmp_path, monkeypatch, use_git):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = make_checkout(use_git=use_git)
    before = snapshot(root)
    res = run("set", "--repo", root, "--no-branch", "--linear", "mxfp4")
    assert res.code == 0, res
    assert _roles(run, root)["linear"] == "mxfp4"
    assert run("set", "--repo", root, "--no-branch", "--qk", "hifp8").code == 0
    assert _roles(run, root) == {"linear": "mxfp4", "qk": "hifp8", "pv": "bf16"}
    if use_git:
        assert git_out(root, "branch", "--show-current").strip() == "main"
        res = run("set", "--repo", root, "--qk", "bf16")
        assert res.code == 2 and "restore" in res.err
    res = run("restore", "--repo", root)
    assert res.code == 0, res
    assert snapshot(root)["files"] == before["files"]
    assert not any((tmp_path / "state").rglob("state.json"))


def test_refusals_exit_2_and_change_nothing(run, make_checkout, tmp_path):
    root = make_checkout()
    before = snapshot(root)

    def refused(*args, match):
        res = run(*args)
        assert res.code == 2, res
        assert match in res.err, res
        assert "Traceback" not in res.err
        assert snapshot(root) == before

    refused(
        "set",
        "--repo",
        root,
        "--linear",
        "fp8",
        match="unknown quant type 'fp8'; valid values are bf16, mxfp8, mxfp4, hifp8",
    )
    refused(
        "set",
        "--repo",
        root,
        "--linear",
        "a'b",
        "--allow-unknown",
        match="not a valid quant type name",
    )
    refused("set", "--repo", root, "--scheme", "FA_fp8", match="unknown scheme 'FA_fp8'")
    refused("set", "--repo", root, match="nothing to set")
    refused("set", "--repo", root, "--bogus", match="No such option")

    # dirty target file: the message lists it; other dirty files are fine
    p = root / ATTENTION
    p.write_text(p.read_text() + "# local edit\n")
    dirty = snapshot(root)
    res = run("set", "--repo", root, "--qk", "mxfp8")
    assert res.code == 2 and f"uncommitted changes to {ATTENTION}" in res.err
    assert snapshot(root) == dirty
    git.Repo(root).git.checkout("--", ATTENTION)
    dirty_free = snapshot(root)

    # lock held by a live process (an OS lock: the kernel drops it when the holder dies)
    lock = root / ".git" / "quantpatch" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'4242 host'); print('held', "
            "flush=True); sys.stdin.read()",  # holds it until killed, however long that takes
            str(lock),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        res = run("set", "--repo", root, "--qk", "mxfp8")
        assert res.code == 2 and "another quantpatch (pid 4242) is working" in res.err
        assert snapshot(root) == dirty_free
    finally:
        holder.kill()
        holder.wait()
    # the holder died: nothing to take over, the lock is simply free (whatever the file holds)
    lock.write_bytes(b"")
    res = run("set", "--repo", root, "--qk", "mxfp8")
    assert res.code == 0, res


def test_not_a_git_repo_and_no_sites(run, make_checkout):
    plain = make_checkout(use_git=False)
    before = snapshot(plain)
    res = run("set", "--repo", plain, "--qk", "mxfp8")
    assert res.code == 2 and "not inside a git repository" in res.err
    assert snapshot(plain) == before
    stock = make_checkout(inject=False)
    res = run("check", "--repo", stock)
    assert res.code == 2 and "no custom_quant_type sites found" in res.err
    res = run("set", "--repo", stock, "--qk", "mxfp8")
    assert res.code == 2 and "no custom_quant_type sites found" in res.err
    res = run("check", "--repo", stock / "nope")
    assert res.code == 2


def test_syntax_error_is_refused_with_file_and_line(run, make_checkout):
    root = make_checkout()
    p = root / ATTENTION
    text = p.read_text().replace(
        "custom_quant_type = 'bf16'\n        if", "'hifp8'\n        elif", 1
    )
    p.write_text(text)
    repo = git.Repo(root)
    repo.git.commit("-qam", "the sed accident")
    before = snapshot(root)
    res = run("set", "--repo", root, "--qk", "mxfp8")
    assert res.code == 2 and f"{ATTENTION}:" in res.err and "does not parse" in res.err
    assert snapshot(root) == before
    assert run("check", "--repo", root).code == 2


def test_injected_failure_during_set_leaves_files_and_refs(run, make_checkout, monkeypatch):
    root = make_checkout()
    before = snapshot(root)
    real = os.replace
    calls = []

    def flaky(src, dst):
        if str(dst).endswith((LINEAR, ATTENTION)) and ".git" not in str(dst):
            calls.append(dst)
            if len(calls) == 2:  # the first target file is already replaced
                raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(edits_mod.os, "replace", flaky)
    res = run("set", "--repo", root, "--no-branch", "--scheme", "FA_linear_hifp8")
    # layers.py replaced, dot_product_attention.py failed, layers.py put back
    assert [
        str(c).endswith(r) for c, r in zip(calls, (LINEAR, ATTENTION, LINEAR), strict=True)
    ] == [True] * 3
    monkeypatch.setattr(edits_mod.os, "replace", real)
    assert res.code == 2 and "every file was left as it was" in res.err
    assert snapshot(root) == before


def test_detached_head_and_moved_base(run, make_checkout):
    root = make_checkout()
    repo = git.Repo(root)
    base = repo.head.commit.hexsha
    repo.git.checkout("--detach")
    res = run("set", "--repo", root, "--linear", "mxfp8")
    assert res.code == 0 and "detached" in res.err
    assert run("restore", "--repo", root).code == 0
    assert repo.head.is_detached and repo.head.commit.hexsha == base

    repo.git.checkout("main")
    assert run("set", "--repo", root, "--linear", "mxfp8").code == 0
    # the base branch moves on while the set is active
    repo.git.checkout("main")
    (root / "README.md").write_text("moved\n")
    repo.git.commit("-qam", "move main")
    moved = repo.head.commit.hexsha
    assert "moved on" in run("check", "--repo", root).out
    res = run("set", "--repo", root, "--linear", "hifp8")
    # the scheme branch always sits on the base's current tip, never on stale source
    assert res.code == 0 and "moved on" in res.err
    assert git_out(root, "rev-parse", "HEAD~1").strip() == moved
    res = run("restore", "--repo", root)
    assert res.code == 0
    assert repo.active_branch.name == "main" and repo.head.commit.hexsha == moved


def test_existing_branch_with_other_content_is_refused(run, make_checkout):
    root = make_checkout()
    repo = git.Repo(root)
    repo.git.checkout("-b", "quantpatch/linear-mxfp8_qk-bf16_pv-bf16")
    (root / LINEAR).write_text((root / LINEAR).read_text() + "# hand edit\n")
    repo.git.commit("-qam", "hand edit")
    repo.git.checkout("main")
    before = snapshot(root)
    res = run("set", "--repo", root, "--linear", "mxfp8")
    assert res.code == 2 and "carries your commit" in res.err and "'hand edit'" in res.err
    assert snapshot(root) == before


def test_config_paths_from_pyproject_and_quantpatch_toml(run, make_checkout):
    root = make_checkout()
    repo = git.Repo(root)
    new = "src/layers_fork.py"
    (root / "src").mkdir()
    repo.git.mv(LINEAR, new)
    (root / "pyproject.toml").write_text(f'[tool.quantpatch]\nlinear_file = "{new}"\n')
    repo.git.add("-A")
    repo.git.commit("-qm", "move")
    data = json.loads(run("check", "--json", "--repo", root).out)
    assert {s["file"] for s in data["sites"]} == {new, ATTENTION}
    assert run("set", "--repo", root, "--linear", "mxfp4").code == 0
    assert "mxfp4" in (root / new).read_text()
    (root / "quantpatch.toml").write_text('linear = ["nope.py"]\n')
    res = run("check", "--repo", root)
    assert res.code == 2 and "nope.py: target file not found" in res.err
    (root / "quantpatch.toml").write_text('lineer = "x.py"\n')
    res = run("check", "--repo", root)
    assert res.code == 2 and "unknown key 'lineer'" in res.err


def test_version_help_and_no_torch_at_startup(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(
        [sys.executable, "-m", "quantpatch", "--version"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert res.returncode == 0 and res.stdout.startswith("quantpatch ")
    code = (
        "import sys; sys.argv=['quantpatch','--help']\n"
        "from quantpatch.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy=('torch','libcst','git','megatron','rich','pydantic')\n"
        "bad=[m for m in heavy if m in sys.modules]\n"
        "print('LOADED', bad)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert "LOADED []" in res.stdout, res.stdout + res.stderr


def test_the_console_entry_keeps_exit_codes_and_output(tmp_path):
    """``run`` (the installed ``quantpatch`` and ``python -m quantpatch``) leaves without the
    interpreter's teardown: exit codes, messages and every byte of a long output survive,
    and a reader that goes away early costs no traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def qp(*args):
        return subprocess.run(
            [sys.executable, "-m", "quantpatch", *args],
            capture_output=True, text=True, env=env, check=False, cwd=tmp_path,
        )  # fmt: skip

    full = qp("--help")
    assert full.returncode == 0
    inproc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv=['quantpatch','--help']\n"
         "from quantpatch.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert full.stdout == inproc.stdout and len(full.stdout) > 500
    res = qp("check")  # not a git repository: a user error
    assert res.returncode == 2 and res.stderr.startswith("error: ") and not res.stdout
    res = qp("no-such-command")
    assert res.returncode == 2 and "No such command" in res.stderr
    # a reader that closes the pipe after the first line: no traceback, no hang
    proc = subprocess.Popen(
        [sys.executable, "-m", "quantpatch", "--help"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=60) in (0, 120) and b"Traceback" not in proc.stderr.read()
    proc.stderr.close()
    # started with its output closed: nothing to flush, and the command's own exit code
    for closed in (">&-", "2>&-"):
        res = subprocess.run(
            ["sh", "-c", f'exec "$0" -m quantpatch --version {closed}', sys.executable],
            capture_output=True, text=True, env=env, check=False, cwd=tmp_path,
        )  # fmt: skip
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


def test_lazy_command_building_shows_the_same_help(capsys):
    """``main`` builds only what a command line needs (the listing without parameters, or
    the one command named); what the user sees is what the fully built app shows."""
    import typer

    def shown(command, args):
        with pytest.raises(SystemExit):
            command.main(args=args, prog_name="quantpatch")
        return capsys.readouterr().out

    full = typer.main.get_command(cli.app)
    cli._full_short_help(full)
    for args in (
        ["--help"],
        [],
        ["check", "--help"],
        ["tensors", "--help"],
        ["--repo", "x", "set", "--help"],
    ):
        assert shown(cli.command_for(args), args) == shown(full, args), args
    listing = cli.command_for(["--help"])
    assert set(listing.commands) == set(full.commands)
    assert set(cli.command_for(["--repo", "x", "set"]).commands) == {"set"}
    assert cli.command_for(["nosuch"]).commands.keys() == full.commands.keys()


def test_state_lives_in_git_dir_not_work_tree(run, make_checkout):
    root = make_checkout()
    assert run("set", "--repo", root, "--qk", "mxfp4").code == 0
    assert (root / ".git" / "quantpatch" / "state.json").is_file()
    assert git_out(root, "status", "--porcelain", "--untracked-files=all") == ""
    state = repo_mod.load_state(repo_mod.find_checkout(root, need_git=True))
    assert state and state.current and state.current.values["qk"] == "mxfp4"
