"""``quantpatch upgrade``: a checkout set up by the previous release is brought to
this version in one recorded commit, scheme branches and worktrees follow, and the installs
still come off byte for byte."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import git
import libcst as cst
import pytest

from quantpatch.checkout.parts import (
    OPS_MODULE,
    OPS_MODULES,
    PACKAGE,
    RUNTIME_MODULES,
    SAVER_MODULE,
    SAVER_MODULES,
    flat,
    runtime_source,
)

from .conftest import ATTENTION, LINEAR
from .oldrelease import OLD_OPS, make_flat_release, make_old_release

pytestmark = pytest.mark.slow

LAYER = "megatron/core/transformer/transformer_layer.py"


def _parts(run, root: Path) -> dict[str, str]:
    res = run("check", "--json", "--repo", root)
    assert res.code in (0, 1), res
    return {p["part"]: p["status"] for p in json.loads(res.out)["parts"]}


def _old_checkout(run, make_checkout) -> tuple[Path, dict[str, bytes]]:
    root = make_checkout(inject=False, extra=(LAYER,))
    upstream = {rel: (root / rel).read_bytes() for rel in (LINEAR, ATTENTION, LAYER)}
    assert run("init", "--repo", root).code == 0
    assert run("saver", "install", "--repo", root).code == 0
    make_old_release(root)
    return root, upstream


def test_an_old_release_checkout_is_upgraded_in_one_commit(run, make_checkout):
    root, upstream = _old_checkout(run, make_checkout)
    repo = git.Repo(root)
    for scheme in ("FA_mxfp8", "linear_hifp8"):  # two scheme branches on the old base
        assert run("set", "--repo", root, "--scheme", scheme).code == 0
        assert run("restore", "--repo", root).code == 0
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp4", "--path-only")
    assert res.code == 0, res
    tree = Path(res.out.strip())
    assert (tree / flat(OPS_MODULE)).read_text() == OLD_OPS

    parts = _parts(run, root)
    assert parts["ops"] == parts["sites"] == parts["saver"] == "older"  # the single-file saver
    assert parts["kernels"] == parts["flash"] == "older"  # beside Megatron's files, not in
    res = run("check", "--repo", root, "--expect", "parts=current")
    assert res.code == 1 and "ops is older" in res.err
    assert "installed parts: ops older" in run("check", "--repo", root).out

    old_head = repo.head.commit
    res = run("upgrade", "--repo", root)
    assert res.code == 0, res
    assert repo.head.commit.parents == (old_head,) and not repo.is_dirty()
    assert repo.head.commit.message.startswith("quantpatch upgrade:")
    for rel in (*OPS_MODULES, *SAVER_MODULES):
        assert (root / rel).read_text() == runtime_source(rel), rel
    assert not (root / flat(OPS_MODULE)).exists()  # moved into the package
    assert set(_parts(run, root).values()) == {"current"}
    assert run("check", "--repo", root, "--expect", "parts=current").code == 0
    again = run("upgrade", "--repo", root)
    assert again.code == 0 and "nothing to upgrade" in again.out
    assert repo.head.commit.parents == (old_head,)

    # the next set rebuilds its branch on the new base; the worktree gets the new runtime
    res = run("set", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 0, res
    upgraded = repo.heads.main.commit
    assert repo.head.commit.parents == (upgraded,) and upgraded.parents == (old_head,)
    assert (root / OPS_MODULE).read_text() == runtime_source(OPS_MODULE)
    assert run("restore", "--repo", root).code == 0
    res = run("worktree", "--repo", root, "--scheme", "FA_mxfp4", "--path-only")
    assert res.code == 0, res
    for rel in OPS_MODULES:
        assert (Path(res.out.strip()) / rel).read_text() == runtime_source(rel), rel
    assert set(_parts(run, Path(res.out.strip())).values()) == {"current"}

    # the installs still come off, byte for byte to upstream
    assert run("saver", "remove", "--repo", root).code == 0
    res = run("init", "--repo", root, "--remove")
    assert res.code == 0, res
    for rel, data in upstream.items():
        assert (root / rel).read_bytes() == data, rel
    assert not any((root / rel).exists() for rel in (*OPS_MODULES, *SAVER_MODULES))


def test_a_hand_edited_ops_module_is_refused_by_name(run, make_checkout):
    root, _ = _old_checkout(run, make_checkout)
    ops = root / flat(OPS_MODULE)
    ops.write_text(OLD_OPS + "# my tweak\n")
    repo = git.Repo(root)
    repo.git.commit("-qam", "tweak the ops")
    assert _parts(run, root)["ops"] == "edited"
    head = repo.head.commit
    res = run("upgrade", "--repo", root)
    assert res.code == 2 and flat(OPS_MODULE) in res.err and "--force" in res.err
    assert repo.head.commit == head and ops.read_text() == OLD_OPS + "# my tweak\n"
    res = run("upgrade", "--repo", root, "--force")
    assert res.code == 0, res
    assert f"{flat(OPS_MODULE)}: its hand edits were overwritten" in res.out + res.err
    assert not ops.exists() and (root / OPS_MODULE).read_text() == runtime_source(OPS_MODULE)
    assert set(_parts(run, root).values()) == {"current"}


def test_upgrade_refuses_while_a_set_is_active_and_without_installs(run, make_checkout):
    root, _ = _old_checkout(run, make_checkout)
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0
    res = run("upgrade", "--repo", root)
    assert res.code == 2 and "restore" in res.err
    stock = make_checkout(inject=False)
    res = run("upgrade", "--repo", stock)
    assert res.code == 2 and "nothing to upgrade" in res.err


FLAT_FILES = (
    flat(OPS_MODULE),
    "megatron/core/quantpatch_kernels.py",
    "megatron/core/quantpatch_saver",
)


def _flat_left(root: Path) -> list[str]:
    """The runtime files of the flat layout still in ``megatron/core/``."""
    core = root / "megatron/core"
    return sorted(
        str(p.relative_to(root))
        for p in (*core.glob("quantpatch_*.py"), *core.glob("quantpatch_saver/*.py"))
    )


IMPORTS = """
import sys
import megatron.core.tensor_saver as by_path
from megatron.core.quantpatch import quantpatch_ops, tensor_saver
assert by_path is tensor_saver and sys.modules["megatron.core.tensor_saver"] is tensor_saver
assert quantpatch_ops.__name__ == "megatron.core.quantpatch.quantpatch_ops"
import megatron.core.quantpatch as package
assert "quant_matmul(a, b, fmt, roles=" in package.__doc__
print("ok")
"""


def test_a_checkout_on_the_flat_layout_moves_into_the_package(run, make_checkout, tmp_path):
    """The last release put every runtime file in ``megatron/core/`` beside Megatron's own and
    its sites called ``quant_matmul(..., backward=True, weight="b")``: such a checkout still
    sets its values before the upgrade (the modules its sites import answer), ``check`` calls
    every part older, and ``upgrade`` moves it into ``megatron/core/quantpatch/`` in one
    commit, the sites as ``init`` writes them now; the installs still come off byte for
    byte."""
    import subprocess
    import sys

    root = make_checkout(inject=False, extra=(LAYER,))
    upstream = {rel: (root / rel).read_bytes() for rel in (LINEAR, ATTENTION, LAYER)}
    assert run("init", "--repo", root).code == 0
    assert run("saver", "install", "--repo", root).code == 0
    fresh = {rel: (root / rel).read_text() for rel in (LINEAR, ATTENTION, LAYER)}
    make_flat_release(root)
    repo = git.Repo(root)
    assert not (root / PACKAGE).exists() and _flat_left(root)
    linear = (root / LINEAR).read_text()
    assert "from megatron.core import quantpatch_ops" in linear and 'weight="b"' in linear
    assert "roles=" not in linear and "megatron.core.quantpatch " not in linear
    parts = _parts(run, root)
    # every part but MLA's head dims (which import nothing): the package is this version's
    assert {part for part, st in parts.items() if st != "older"} == {"mla-params"}, parts
    # not upgraded yet: set still reads the values of the ops module its sites import
    res = run("set", "--repo", root, "--scheme", "FA_linear_nvfp4")
    assert res.code == 0, res
    assert run("restore", "--repo", root).code == 0

    old_head = repo.head.commit
    res = run("upgrade", "--repo", root)
    assert res.code == 0, res
    assert repo.head.commit.parents == (old_head,) and not repo.is_dirty(untracked_files=True)
    assert _flat_left(root) == [] and not (root / "megatron/core/quantpatch_saver").exists()
    for rel in (*RUNTIME_MODULES, *SAVER_MODULES):
        assert (root / rel).read_text() == runtime_source(rel), rel
    for rel, text in fresh.items():  # the sites as this version's init and saver write them
        assert (root / rel).read_text() == text, rel
    assert set(_parts(run, root).values()) == {"current"}
    assert run("check", "--repo", root, "--expect", "parts=current").code == 0
    torch = pytest.importorskip("torch")
    assert torch is not None
    got = subprocess.run(
        [sys.executable, "-c", IMPORTS], cwd=tmp_path, capture_output=True, text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr

    assert run("saver", "remove", "--repo", root).code == 0
    assert run("init", "--repo", root, "--remove").code == 0
    for rel, data in upstream.items():
        assert (root / rel).read_bytes() == data, rel
    assert not any((root / rel).exists() for rel in (*RUNTIME_MODULES, *SAVER_MODULES))
    assert _flat_left(root) == [] and not (root / SAVER_MODULE).exists()
    assert not (root / PACKAGE).exists() and not (root / "megatron/core/quantpatch_saver").exists()


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory, trees: dict[str, Path]):
    from .forklike import build_fork

    return build_fork(tmp_path_factory.mktemp("fork") / "origin", trees["0.13.1"], full=True)


def test_the_fork_clone_is_upgraded_and_its_own_saver_callers_keep_working(run, origin, tmp_path):
    from .conftest import run_probe, snapshot
    from .forklike import clone_quant
    from .test_saver_fork import CALL_PROBE, QUIET

    clone = clone_quant(origin, tmp_path / "Megatron-LM")
    before = snapshot(clone)["files"]
    assert run("init", "--repo", clone).code == 0
    assert run("saver", "install", "--force", "--repo", clone).code == 0
    make_old_release(clone)
    assert _parts(run, clone)["ops"] == "older"
    res = run("upgrade", "--repo", clone)
    assert res.code == 0, res
    assert set(_parts(run, clone).values()) == {"current"}
    for rel in OPS_MODULES:
        assert (clone / rel).read_text() == runtime_source(rel), rel

    got, err = run_probe(  # the fork's own call sites, with the upgraded checkout
        CALL_PROBE,
        clone,
        tmp_path / "calls.pt",
        TENSOR_SAVE_ENABLED="true",
        TENSOR_SAVE_DIR=str(tmp_path / "calls"),
        **QUIET,
    )
    assert (got["report"]["files"], got["report"]["failed"]) == (8, 0) and "Traceback" not in err

    assert run("saver", "remove", "--repo", clone).code == 0
    assert run("init", "--repo", clone, "--remove").code == 0
    assert snapshot(clone)["files"] == before  # every byte, the fork's own saver included


BEFORE_TE = Path(__file__).parent / "data/before_te_nvfp4"
"""``quantpatch_nvfp4.py`` and ``quantpatch_rht.py`` as the version before NVFP4 followed
TransformerEngine installed them (NVFP4 in its own order, uniform stochastic rounding, its own RHT
sign vector)."""


def test_a_checkout_with_the_nvfp4_runtime_before_te_numerics_is_older_and_upgraded(
    run, make_checkout
):
    """A checkout initialised before the NVFP4 arithmetic became TransformerEngine's keeps the
    old runtime files: ``check`` calls its ops part older (the installed files are not this
    version's), and ``upgrade`` installs the new ones in one commit."""
    root = make_checkout(inject=False)
    assert run("init", "--repo", root).code == 0
    state = root / ".git/quantpatch/init/record.json"
    record = json.loads(state.read_text())
    for name in ("quantpatch_nvfp4.py", "quantpatch_rht.py"):
        rel = f"megatron/core/quantpatch/{name}"
        text = (BEFORE_TE / name).read_text(encoding="utf-8")
        assert text != runtime_source(rel)
        (root / rel).write_text(text, encoding="utf-8")
        record["files"][rel]["written"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    state.write_text(json.dumps(record, indent=2) + "\n")
    repo = git.Repo(root)
    repo.git.add("-A", "megatron")
    repo.git.commit("-qm", "quantpatch init: (before TE's NVFP4 numerics)")
    old = (root / "megatron/core/quantpatch/quantpatch_nvfp4.py").read_text()
    assert "(bmax / 6.0) * g" in old and "torch.rand(" in old  # the old arithmetic, installed

    assert _parts(run, root)["ops"] == "older"
    res = run("check", "--repo", root, "--expect", "parts=current")
    assert res.code == 1 and "ops is older" in res.err
    head = repo.head.commit
    res = run("upgrade", "--repo", root)
    assert res.code == 0, res
    assert repo.head.commit.parents == (head,) and not repo.is_dirty()
    for rel in OPS_MODULES:
        assert (root / rel).read_text() == runtime_source(rel), rel
    new = (root / "megatron/core/quantpatch/quantpatch_nvfp4.py").read_text()
    assert "TransformerEngine 2.20.2" in new and "sr_bits" in new
    assert set(_parts(run, root).values()) == {"current"}


BEFORE_4OVER6 = Path(__file__).parent / "data/before_4over6"
"""The format spec and ``quantpatch_nvfp4.py`` as the version before the 4over6 values
installed them (no ``nvfp4-4over6-*`` entries, no 4over6 arithmetic)."""


def test_a_checkout_without_the_4over6_values_is_older_and_upgrade_teaches_them(run, make_checkout):
    """A checkout initialised before the 4over6 values: ``check`` calls its ops older, ``set
    --linear nvfp4-4over6-mae`` is refused naming ``upgrade`` (its installed spec lacks the
    value, so the site's dispatch would not know it) and changes nothing; ``upgrade`` installs
    this version's files in one commit, and the same ``set`` and ``check --expect`` pass."""
    root = make_checkout(inject=False)
    assert run("init", "--repo", root).code == 0
    state = root / ".git/quantpatch/init/record.json"
    record = json.loads(state.read_text())
    for name in ("quantpatch_formats.py", "quantpatch_nvfp4.py"):
        rel = f"megatron/core/quantpatch/{name}"
        text = (BEFORE_4OVER6 / name).read_text(encoding="utf-8")
        assert text != runtime_source(rel) and "4over6" not in text
        (root / rel).write_text(text, encoding="utf-8")
        record["files"][rel]["written"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    state.write_text(json.dumps(record, indent=2) + "\n")
    repo = git.Repo(root)
    repo.git.add("-A", "megatron")
    repo.git.commit("-qm", "quantpatch init: (before the 4over6 values)")

    assert _parts(run, root)["ops"] == "older"
    head = repo.head.commit
    res = run("set", "--repo", root, "--linear", "nvfp4-4over6-mae")
    assert res.code == 2, res
    said = " ".join(res.err.split())
    assert "not 'nvfp4-4over6-mae'" in said, said
    assert "'quantpatch upgrade' brings it to this version's values" in said, said
    assert repo.head.commit == head and not repo.is_dirty(untracked_files=True)
    res = run("upgrade", "--repo", root)  # the advice, followed
    assert res.code == 0, res
    assert repo.head.commit.parents == (head,) and not repo.is_dirty()
    for rel in OPS_MODULES:
        assert (root / rel).read_text() == runtime_source(rel), rel
    assert set(_parts(run, root).values()) == {"current"}
    res = run("set", "--repo", root, "--linear", "nvfp4-4over6-mae")
    assert res.code == 0, res
    assert run("check", "--repo", root, "--expect", "linear=nvfp4-4over6-mae").code == 0


# -- upgrade never commits where it should not --------------------------------------------


def test_upgrade_on_a_scheme_branch_is_refused_before_anything(run, make_checkout):
    root, _ = _old_checkout(run, make_checkout)
    repo = git.Repo(root)
    res = run("init", "--repo", root)  # an old release's init: the answer names upgrade
    assert res.code == 2 and "already initialised" in res.err, res
    assert "'quantpatch upgrade' brings an earlier release's install" in " ".join(res.err.split())
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0
    assert run("restore", "--repo", root).code == 0
    branch = next(h.name for h in repo.heads if "qk-mxfp8" in h.name)
    repo.git.checkout("-q", branch)
    head = repo.head.commit
    for force in ((), ("--force",)):
        res = run("upgrade", "--repo", root, *force)
        assert res.code == 2 and f"HEAD is on a scheme branch ({branch})" in res.err, res
        assert repo.head.commit == head and not repo.is_dirty(untracked_files=True)
    repo.git.checkout("-q", "main" if "main" in repo.heads else "master")
    assert _parts(run, root)["ops"] == "older"  # not "edited": nothing was written anywhere


def _upgrade_killed_after_its_record(root: Path, tmp_path: Path) -> None:
    """``quantpatch upgrade`` in a subprocess, SIGKILLed right after its record is written
    (the step found by tracing the same upgrade on a copy)."""
    import os
    import shutil
    import subprocess

    from .test_scripts import QUANTPATCH

    copy = tmp_path / "copy"
    shutil.copytree(root, copy, symlinks=True)
    trace = tmp_path / "trace"
    env = {**os.environ, "QUANTPATCH_FAULT_TRACE": str(trace)}
    res = subprocess.run([QUANTPATCH, "upgrade", "--repo", copy], env=env, capture_output=True)
    assert res.returncode == 0, res
    steps = [ln.split(" ", 1) for ln in trace.read_text().splitlines()]
    at = next(n for n, label in steps if label == "write upgrade record")
    env = {**os.environ, "QUANTPATCH_FAULT_AT": at}
    res = subprocess.run([QUANTPATCH, "upgrade", "--repo", root], env=env, capture_output=True)
    assert res.returncode == -9, res


def test_an_interrupted_upgrade_blocks_set_and_its_completion_checks_the_files(
    run, make_checkout, tmp_path
):
    root, _ = _old_checkout(run, make_checkout)
    repo = git.Repo(root)
    old_head = repo.head.commit
    _upgrade_killed_after_its_record(root, tmp_path)
    res = run("set", "--repo", root, "--scheme", "FA_mxfp8")
    assert res.code == 2 and "interrupted 'quantpatch upgrade' is unfinished" in res.err, res
    assert repo.head.commit == old_head
    # the half-written files discarded by hand: the completion writes them again
    repo.git.checkout("--", ".")
    repo.git.clean("-fdq", "--", "megatron")
    assert (root / flat(OPS_MODULE)).read_text() == OLD_OPS
    res = run("upgrade", "--repo", root)
    assert res.code == 0, res
    assert "written again" in res.out + res.err
    assert repo.head.commit.parents == (old_head,) and not repo.is_dirty()
    assert set(_parts(run, root).values()) == {"current"}
    assert run("set", "--repo", root, "--scheme", "FA_mxfp8").code == 0


def test_force_and_a_detached_head_say_where_the_old_commit_is(run, make_checkout):
    root, _ = _old_checkout(run, make_checkout)
    repo = git.Repo(root)
    (root / flat(OPS_MODULE)).write_text(OLD_OPS + "# my tweak\n")
    repo.git.commit("-qam", "tweak the ops")
    edited = repo.head.commit.hexsha
    repo.git.checkout("-q", "--detach")
    res = run("upgrade", "--repo", root, "--force")
    assert res.code == 0, res
    said = " ".join((res.out + res.err).split())
    assert f"the edited file stays in commit {edited[:12]}" in said, said
    assert "HEAD is detached: the upgrade commit is on no branch" in said, said


class _DropBf16Branch(cst.CSTTransformer):
    """The flash route as `init` wrote it before its bf16 branch (sites form 1)."""

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        orelse = updated_node.orelse
        if isinstance(orelse, cst.Else) and "QUANTPATCH_FLASH_BF16" in cst.Module([]).code_for_node(
            orelse
        ):
            return updated_node.with_changes(orelse=None)
        return updated_node


def test_a_flash_route_without_the_bf16_branch_is_older_and_upgrade_adds_it(run, make_checkout):
    """Giving every run of a set one attention path changed what `init` writes (sites form
    2): a checkout initialised before it is `sites older`, and `upgrade` gives it the branch
    that lets a bf16 baseline take the flash kernel, as `init` writes it now."""
    root = make_checkout(inject=False)
    assert run("init", "--repo", root).code == 0
    fresh = (root / ATTENTION).read_text()
    old = cst.parse_module(fresh).visit(_DropBf16Branch()).code
    branch = "os.environ.get('QUANTPATCH_FLASH_BF16')"
    assert branch in fresh and branch not in old
    (root / ATTENTION).write_text(old)
    path = root / ".git/quantpatch/init/record.json"
    rec = json.loads(path.read_text())
    rec["files"][ATTENTION]["written"] = hashlib.sha256(old.encode()).hexdigest()
    rec["forms"]["sites"] = 1
    path.write_text(json.dumps(rec, indent=2) + "\n")
    repo = git.Repo(root)
    repo.git.add(ATTENTION)
    repo.git.commit("-qm", "quantpatch init: (sites form 1)")
    assert _parts(run, root)["sites"] == "older"
    res = run("upgrade", "--repo", root)
    assert res.code == 0, res
    assert (root / ATTENTION).read_text() == fresh
    assert set(_parts(run, root).values()) == {"current"}
