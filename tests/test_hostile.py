"""Hostile and unlucky inputs: paths with '$', names that try to reach the shell, git
configured against us, corrupt records, concurrent runs. Each case ends in one clear
sentence (exit 2) or in success, and never costs the user a byte of their own work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import git
import pytest

from .conftest import ATTENTION, LINEAR, git_out, snapshot


def _user_work(root: Path) -> dict[str, bytes | str]:
    (root / "README.md").write_text("my unsaved notes\n")
    (root / "new.txt").write_text("staged by me\n")
    git.Repo(root).git.add("new.txt")
    (root / "scratch.txt").write_text("untracked\n")
    return _user_view(root)


def _user_view(root: Path) -> dict[str, bytes | str]:
    view: dict[str, bytes | str] = {
        f: (root / f).read_bytes() for f in ("README.md", "new.txt", "scratch.txt")
    }
    view["index"] = git_out(root, "diff", "--cached", "--name-only")
    return view


# -- security ---------------------------------------------------------------------------------


def test_dollar_in_the_path_is_a_name_not_a_variable(run, make_checkout, tmp_path, monkeypatch):
    victim = make_checkout()
    ev = tmp_path / "ev"
    ev.mkdir()
    victim = victim.rename(ev / "victim")
    literal = make_checkout().rename(ev / "$QPX")
    monkeypatch.setenv("QPX", "victim")
    before = snapshot(victim)
    res = run("set", "--repo", literal, "--scheme", "FA_mxfp8")
    assert res.code == 0, res
    assert snapshot(victim) == before
    assert git_out(literal, "branch", "--show-current").startswith("quantpatch/")
    monkeypatch.chdir(literal)
    assert run("restore").code == 0
    assert git_out(literal, "branch", "--show-current").strip() == "main"


@pytest.mark.parametrize(
    "name",
    ["x\\ntouch /tmp/PWNED\\n#", "../../escaped", "a b", "quote'd", "", "-flag"],
)
def test_config_names_are_identifiers(run, tmp_path, name):
    config = tmp_path / "extra.toml"
    config.write_text(
        f'[models."{name}"]\ndescription = "d"\ntokenizer_type = "NullTokenizer"\n'
        'tokenizer_model = "x"\nvocab_size = 8\n[models."{name}".args]\nnum-layers = 2\n'.replace(
            "{name}", name
        )
    )
    out = tmp_path / "out"
    res = run("gen-scripts", "--config", config, "--out", out)
    assert res.code == 2 and "is not an identifier" in res.err, res
    assert not out.exists() and not (tmp_path / "escaped").exists()
    assert not Path("/tmp/PWNED").exists()


def test_value_with_a_trailing_newline_is_refused(run, make_checkout):
    root = make_checkout()
    before = snapshot(root)
    res = run("set", "--repo", root, "--allow-unknown", "--linear", "mxfp9\n")
    assert res.code == 2 and "is not a valid quant type name" in res.err
    assert snapshot(root) == before


# -- git configured against us: the user's work survives -------------------------------------


def test_commit_signing_that_fails_changes_nothing(run, make_checkout):
    root = make_checkout()
    user = _user_work(root)
    repo = git.Repo(root)
    with repo.config_writer() as cw:
        cw.set_value("commit", "gpgsign", "true")
        cw.set_value("gpg", "program", "false")  # a signer that always fails
    before = snapshot(root)
    res = run("set", "--repo", root, "--scheme", "FA_linear_mxfp8")
    assert res.code == 2 and "git commit-tree failed" in res.err, res
    assert snapshot(root) == before and _user_view(root) == user
    for command in (("saver", "install"), ("init",)):
        res = run(*command[:1], "--repo", root, *command[1:])
        assert res.code == 2, res
        assert _user_view(root) == user


def test_saver_install_whose_commit_fails_puts_everything_back(run, make_checkout):
    root = make_checkout(full=True)
    user = _user_work(root)
    repo = git.Repo(root)
    with repo.config_writer() as cw:
        cw.set_value("commit", "gpgsign", "true")
        cw.set_value("gpg", "program", "false")
    before = snapshot(root)
    res = run("saver", "install", "--repo", root)
    assert res.code == 2 and "Nothing was changed" in res.err, res
    assert snapshot(root) == before and _user_view(root) == user
    assert not (root / ".git/quantpatch/saver").exists()
    with repo.config_writer() as cw:
        cw.set_value("commit", "gpgsign", "false")
    assert run("saver", "install", "--repo", root).code == 0
    assert run("saver", "remove", "--repo", root).code == 0
    assert _user_view(root) == user


def test_autocrlf_and_a_failing_post_checkout_hook(run, make_checkout):
    root = make_checkout()
    user = _user_work(root)
    repo = git.Repo(root)
    with repo.config_writer() as cw:
        cw.set_value("core", "autocrlf", "true")
    hook = root / ".git/hooks/post-checkout"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text("#!/bin/sh\necho 'git-lfs not found' >&2\nexit 1\n")
    hook.chmod(0o755)
    start = {t: (root / t).read_bytes() for t in (LINEAR, ATTENTION)}
    res = run("set", "--repo", root, "--scheme", "FA_linear_hifp8")
    assert res.code == 0 and "checked out all the same" in res.err, res
    roles = json.loads(run("check", "--json", "--repo", root).out)["roles"]
    assert roles == {"linear": "hifp8", "qk": "hifp8", "pv": "bf16"}
    hook.unlink()
    assert run("restore", "--repo", root).code == 0
    # git's own checkout converts line ends under autocrlf; the content is the start's
    assert {t: (root / t).read_bytes().replace(b"\r\n", b"\n") for t in start} == start
    assert git_out(root, "status", "--porcelain", "--untracked-files=no", "--", LINEAR) == ""
    assert _user_view(root) == user


def test_a_branch_name_git_cannot_create_changes_nothing(run, make_checkout):
    root = make_checkout()
    user = _user_work(root)
    (root / "quantpatch.toml").write_text(f'branch_prefix = "{"p" * 300}"\n')  # > NAME_MAX
    before = snapshot(root)
    res = run("set", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "Nothing was changed" in res.err, res
    assert snapshot(root) == before and _user_view(root) == user


def test_stale_index_lock_is_named_with_gits_advice(run, make_checkout):
    root = make_checkout()
    (root / ".git/index.lock").write_text("")
    before = snapshot(root)
    res = run("set", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "index.lock" in res.err and "remove the file" in res.err, res
    assert snapshot(root) == before
    (root / ".git/index.lock").unlink()
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0


# -- without git: a missing original is an error, never a deletion ----------------------------


def test_missing_original_is_an_error(run, make_checkout, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    root = make_checkout(use_git=False)
    assert run("set", "--repo", root, "--no-branch", "--scheme", "FA_mxfp8").code == 0
    for kept in (tmp_path / "state").rglob("originals/**/*.py"):
        kept.unlink()
    written = (root / ATTENTION).read_bytes()
    res = run("restore", "--repo", root)
    assert res.code == 2 and "missing or altered" in res.err
    assert (root / ATTENTION).read_bytes() == written


def test_unwritable_state_home_is_one_sentence(run, make_checkout, tmp_path, monkeypatch):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "not-a-dir"))
    root = make_checkout(use_git=False)
    before = snapshot(root)
    res = run("set", "--repo", root, "--no-branch", "--scheme", "FA_mxfp8")
    assert res.code == 2 and "internal error" not in res.err, res
    assert snapshot(root) == before


# -- the lock ---------------------------------------------------------------------------------


def test_an_empty_lock_file_wedges_nothing(run, make_checkout):
    root = make_checkout()
    (root / ".git/quantpatch").mkdir()
    (root / ".git/quantpatch/lock").write_bytes(b"")
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0
    assert run("worktree", "--repo", root, "--scheme", "bf16").code == 0


def test_concurrent_sets_never_interleave(make_checkout):
    root = make_checkout()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "quantpatch", "--repo", str(root), "set", "--scheme", scheme],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for scheme in ("FA_mxfp8", "linear_hifp8", "FA_linear_mxfp4")
    ]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    assert all(code in (0, 2) for code, _ in results), results
    assert any(code == 0 for code, _ in results)
    for code, err in results:
        assert code == 0 or "another quantpatch" in err, err
    state = json.loads((root / ".git/quantpatch/state.json").read_text())
    assert "pending" not in state
    branch = git_out(root, "branch", "--show-current").strip()
    assert branch == state["current"]["branch"]
    roles = json.loads(
        subprocess.run(
            [sys.executable, "-m", "quantpatch", "--repo", str(root), "check", "--json"],
            capture_output=True,
            text=True,
        ).stdout
    )["roles"]
    assert roles == state["current"]["values"]


# -- the record, read defensively -------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not utf-8",
        b"[1, 2]",
        b'{"mode": "branch"}',
        b'{"mode": "branch", "base": null}',
        b'{"mode": "branch", "base": {"branch": "main", "commit": "' + b"ab" * 20 + b'"}}',
        b'{"mode": "in-place", "base": {}, "files": {"x": 1}}',
    ],
)
def test_a_corrupt_record_is_one_sentence_and_forgettable(run, make_checkout, content):
    root = make_checkout()
    (root / ".git/quantpatch").mkdir()
    (root / ".git/quantpatch/state.json").write_bytes(content)
    for command in (("set", "--scheme", "FA_mxfp8"), ("restore",)):
        res = run(command[0], "--repo", root, *command[1:])
        assert res.code == 2 and "quantpatch restore --forget" in res.err, res
    seen = run("check", "--repo", root)  # read-only: still works, and says what is wrong
    assert seen.code == 0 and "restore --forget" in seen.out, seen
    assert run("restore", "--repo", root, "--forget").code == 0
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0


def test_state_directory_that_is_a_file(run, make_checkout):
    root = make_checkout()
    (root / ".git/quantpatch").write_text("oops")
    res = run("set", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "not a directory" in res.err, res
    assert run("check", "--repo", root).code == 0


def test_deeply_nested_toml_is_one_sentence(run, make_checkout, tmp_path):
    root = make_checkout()
    (root / "quantpatch.toml").write_text("x = " + "[" * 100_000)
    res = run("check", "--repo", root)
    assert res.code == 2 and "internal error" not in res.err, res
    config = tmp_path / "deep.toml"
    config.write_text("x = " + "[" * 100_000)
    res = run("list", "--config", config)
    assert res.code == 2 and "internal error" not in res.err, res


def test_a_tampered_cache_entry_is_not_believed(run, make_checkout):
    root = make_checkout()
    assert run("check", "--repo", root).code == 0  # fills the cache
    for entry in (root / ".git/quantpatch/cache").glob("sites-*.json"):
        text = entry.read_text()
        entry.write_text(text.replace('"bf16"', '"mxfp8"').replace("'bf16'", "'mxfp8'"))
    res = run("check", "--repo", root, "--expect", "linear=mxfp8")
    assert res.code == 1  # the files say bf16, whatever the cache says
    assert run("check", "--repo", root, "--expect", "linear=bf16,qk=bf16,pv=bf16").code == 0


# -- files as they are ------------------------------------------------------------------------


def test_symlinked_target_is_refused(run, make_checkout):
    root = make_checkout()
    real = root / "real_attention.py"
    os.replace(root / ATTENTION, real)
    (root / ATTENTION).symlink_to(real)
    repo = git.Repo(root)
    repo.git.add("-A")
    repo.git.commit("-qm", "attention behind a link")
    before = snapshot(root)
    for args in (("set", "--scheme", "FA_mxfp8"), ("set", "--no-branch", "--scheme", "FA_mxfp8")):
        res = run(args[0], "--repo", root, *args[1:])
        assert res.code == 2 and "symbolic link" in res.err, res
        assert snapshot(root) == before and (root / ATTENTION).is_symlink()


@pytest.mark.parametrize("mode", ["branch", "--no-branch"])
def test_a_byte_order_mark_survives(run, make_checkout, mode):
    root = make_checkout()
    for t in (LINEAR, ATTENTION):
        (root / t).write_bytes(b"\xef\xbb\xbf" + (root / t).read_bytes())
    repo = git.Repo(root)
    repo.git.commit("-qam", "files with a BOM")
    start = {t: (root / t).read_bytes() for t in (LINEAR, ATTENTION)}
    args = ["set", "--repo", root, "--scheme", "FA_linear_mxfp8"]
    if mode != "branch":
        args.append(mode)
    assert run(*args).code == 0
    for t in start:
        data = (root / t).read_bytes()
        assert data.startswith(b"\xef\xbb\xbf") and data.count(b"\xef\xbb\xbf") == 1
    assert run("restore", "--repo", root).code == 0
    assert {t: (root / t).read_bytes() for t in start} == start


# -- found by an adversarial pass over the finished crash-safety work ---------------------------


def test_a_checkout_git_could_not_write_is_refused_and_switched_back(run, make_checkout):
    """git exits 0 when it cannot replace a file (a read-only directory): a post-checkout
    hook that puts the old bytes back stands in for it (root ignores permissions)."""
    root = make_checkout()
    user = _user_work(root)
    hooks = root / ".git" / "hooks"
    hooks.mkdir(exist_ok=True)
    old = (root / ATTENTION).read_bytes()
    keep = root.parent / "old_attention.py"
    keep.write_bytes(old)
    hook = hooks / "post-checkout"
    hook.write_text(f"#!/bin/sh\ncp '{keep}' '{root / ATTENTION}'\n")
    hook.chmod(0o755)
    before = snapshot(root)
    res = run("set", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and f"could not write {ATTENTION}" in res.err, res
    assert "Nothing was changed" in res.err
    assert git_out(root, "branch", "--show-current").strip() == "main"
    assert snapshot(root)["files"] == before["files"] and _user_view(root) == user
    assert not (root / ".git/quantpatch/state.json").exists()
    hook.unlink()
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0
    # restore meets the same: refused, still on the scheme branch, the record kept
    hook.write_text(f"#!/bin/sh\n[ \"$3\" = 1 ] && cp '{root / LINEAR}' /dev/null\n"
                    f"git show quantpatch/linear-bf16_qk-mxfp8_pv-bf16:{ATTENTION} "
                    f"> '{root / ATTENTION}'\n")  # fmt: skip
    hook.chmod(0o755)
    res = run("restore", "--repo", root)
    assert res.code == 2 and "record is kept" in res.err, res
    assert git_out(root, "branch", "--show-current").startswith("quantpatch/")
    hook.unlink()
    assert run("restore", "--repo", root).code == 0
    assert _user_view(root) == user


def test_check_expect_never_believes_the_cache(run, make_checkout):
    """Even an entry rewritten with a valid checksum cannot make --expect pass."""
    from quantpatch.sites import cache as site_cache

    root = make_checkout()
    assert run("set", "--repo", root, "--pv", "mxfp8").code == 0
    assert run("check", "--repo", root).code == 0
    for entry in (root / ".git/quantpatch/cache").glob("sites-*.json"):
        data = json.loads(entry.read_text())
        qk = [s for s in data["sites"] if s["role"] == "qk"]
        pv = [s for s in data["sites"] if s["role"] == "pv"]
        if qk and pv:
            qk[0].update(line=pv[0]["line"], value=pv[0]["value"], source=pv[0]["source"])
            data["digest"] = site_cache._digest(data["key"], data["sites"])
            entry.write_text(json.dumps(data))
    res = run("check", "--repo", root, "--expect", "qk=mxfp8")
    assert res.code == 1 and "qk is bf16" in res.err, res
    # a malformed entry is a miss, never a crash
    for entry in (root / ".git/quantpatch/cache").glob("sites-*.json"):
        data = json.loads(entry.read_text())
        data["sites"][0]["line"] = "x"
        data["digest"] = site_cache._digest(data["key"], data["sites"])
        entry.write_text(json.dumps(data))
    res = run("check", "--repo", root)
    assert res.code == 0 and "internal error" not in res.err, res


@pytest.mark.parametrize("current", ['"x"', "[1]", '{"branch": 3}'])
def test_a_malformed_current_set_is_one_sentence(run, make_checkout, current):
    root = make_checkout()
    assert run("set", "--repo", root, "--qk", "mxfp8").code == 0
    path = root / ".git/quantpatch/state.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "current": json.loads(current)}))
    for args in (("check",), ("restore",)):
        res = run(*args, "--repo", root)
        assert res.code in (0, 2) and "internal error" not in res.err, res
        assert "restore --forget" in res.err + res.out


def test_a_record_cannot_send_restore_outside_the_checkout(run, make_checkout, tmp_path):
    root = make_checkout()
    assert run("set", "--repo", root, "--no-branch", "--qk", "mxfp8").code == 0
    path = root / ".git/quantpatch/state.json"
    data = json.loads(path.read_text())
    outside = root.parent / "outside.txt"
    outside.write_text("precious\n")
    info = next(iter(data["files"].values()))
    data["files"] = {"../outside.txt": info}
    path.write_text(json.dumps(data))
    res = run("restore", "--repo", root)
    assert res.code == 2 and "outside the checkout" in res.err, res
    assert outside.read_text() == "precious\n"


def test_a_lock_file_planted_as_a_link_is_never_written_through(run, make_checkout):
    root = make_checkout()
    (root / ".git/quantpatch").mkdir(parents=True, exist_ok=True)
    victim = root.parent / "victim.txt"
    victim.write_text("keep me\n")
    (root / ".git/quantpatch/lock").symlink_to(victim)
    assert run("set", "--repo", root, "--qk", "mxfp8").code == 0
    assert victim.read_text() == "keep me\n"
    assert not (root / ".git/quantpatch/lock").is_symlink()


def test_saver_install_with_a_stale_index_lock_changes_nothing(run, make_checkout):
    root = make_checkout(full=True)
    lock = root / ".git/index.lock"
    lock.write_text("")
    before = snapshot(root)
    res = run("saver", "install", "--repo", root)
    assert res.code == 2 and "index.lock" in res.err and "Nothing was changed" in res.err, res
    assert snapshot(root) == before and not (root / ".git/quantpatch/saver").exists()
    lock.unlink()
    assert run("saver", "install", "--repo", root).code == 0
    assert run("saver", "remove", "--repo", root).code == 0
    assert snapshot(root)["files"] == before["files"]


def test_a_carried_commit_that_changes_a_site_is_refused_on_rebuild(run, make_checkout):
    root = make_checkout()
    repo = git.Repo(root)
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0
    p = root / ATTENTION
    p.write_text(p.read_text().replace("'mxfp8'", "'hifp8'", 1))
    repo.git.commit("-qam", "qk by hand")
    assert run("restore", "--repo", root).code == 0
    (root / "README.md").write_text("the base moves on\n")
    repo.git.add("README.md")
    repo.git.commit("-qm", "base moved")
    branches = git_out(root, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads")
    res = run("set", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "'qk by hand'" in res.err and f"changes {ATTENTION}" in res.err, res
    assert git_out(root, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads") == (
        branches
    )
    assert git_out(root, "branch", "--show-current").strip() == "main"


def test_init_killed_between_its_record_and_its_commit_completes_on_rerun(make_checkout, tmp_path):
    root = make_checkout(inject=False)
    trace = tmp_path / "trace"
    env = {**os.environ, "QUANTPATCH_FAULT_TRACE": str(trace)}
    probe = make_checkout(inject=False)
    cmd = [sys.executable, "-m", "quantpatch", "init", "--repo"]
    subprocess.run([*cmd, str(probe)], env=env, check=True, capture_output=True)
    steps = trace.read_text().splitlines()
    at = next(int(s.split()[0]) for s in steps if "commit" in s)
    killed = subprocess.run(
        [*cmd, str(root)],
        env={**os.environ, "QUANTPATCH_FAULT_AT": str(at - 1), "QUANTPATCH_FAULT_KIND": "kill"},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -9
    again = subprocess.run([*cmd, str(root)], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "completed the interrupted" in again.stderr + again.stdout
    assert git_out(root, "status", "--porcelain", "--untracked-files=no") == ""
    assert git_out(root, "log", "-1", "--format=%s").startswith("quantpatch init")


def test_a_state_directory_that_is_a_file_is_set_aside_by_forget(run, make_checkout):
    root = make_checkout()
    (root / ".git/quantpatch").write_text("not a directory\n")
    res = run("check", "--repo", root)
    assert res.code == 0 and "restore --forget" in res.out, res
    res = run("restore", "--repo", root, "--forget")
    assert res.code == 0, res
    assert (root / ".git/quantpatch").exists() is False or (root / ".git/quantpatch").is_dir()
    aside = list((root / ".git").glob("quantpatch.not-a-directory.*"))
    assert len(aside) == 1 and aside[0].read_text() == "not a directory\n"
    assert run("set", "--repo", root, "--qk", "mxfp8").code == 0
