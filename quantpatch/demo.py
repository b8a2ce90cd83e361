"""The throw-away demo checkout: real megatron-core sources with fork-layout sites, in git."""

from __future__ import annotations

import shutil
from pathlib import Path

import git
from rich.console import Console

from quantpatch import repo as gitrepo
from quantpatch.codemods.init_sites import Layout, inject_sites
from quantpatch.config import Targets
from quantpatch.edits import Edit, apply_edits
from quantpatch.errors import UserError
from quantpatch.megatron_source import DEFAULT_VERSION, megatron_tree

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def build_checkout(
    dest: Path, version: str = DEFAULT_VERSION, layout: Layout | None = None, *, inject: bool = True
) -> Path:
    """A git repository at ``dest`` holding ``megatron/`` of megatron-core ``version``: one
    commit with the stock files, and (``inject``) one that adds fork-layout sites."""
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"{dest}: the directory exists and is not empty; choose another one.")
    tree = megatron_tree(version)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tree, dest / "megatron", ignore=_IGNORE)
    (dest / ".gitignore").write_text("__pycache__/\n*.pyc\ntensor_logs/\n")
    repo = git.Repo.init(dest, initial_branch="main")
    gitrepo.commit_paths(repo, [".gitignore", "megatron"], f"megatron-core {version}, unmodified")
    if inject:
        targets = Targets()
        edits = []
        for rel in targets.all_files:
            text = (dest / rel).read_text(encoding="utf-8")
            edits.append(Edit(rel, text, inject_sites(text, rel, targets.kind_of(rel), layout)))
        apply_edits(dest, edits)
        gitrepo.commit_paths(
            repo, list(targets.all_files), "Add fork-layout custom_quant_type sites"
        )
    return dest


def walk(dest: Path, console: Console) -> None:
    """check -> set -> check -> set (other values, same base) -> restore -> check, printed."""
    from quantpatch.cli import _print_check
    from quantpatch.switch import SetRequest, check, restore, set_values

    targets = Targets()
    before = {rel: (dest / rel).read_bytes() for rel in targets.all_files}

    def step(title: str) -> None:
        console.rule(title)

    step("quantpatch check")
    _print_check(check(dest))
    for values in (
        {"linear": "mxfp8", "qk": "mxfp8", "pv": "bf16"},
        {"linear": "hifp8", "qk": "mxfp4", "pv": "mxfp8"},
    ):
        args = " ".join(f"--{r} {v}" for r, v in values.items())
        step(f"quantpatch set {args}")
        result = set_values(dest, SetRequest(dict(values)))
        console.print(
            f"branch {result.branch} at {(result.commit or '')[:12]}, from base "
            f"{result.base and result.base['branch']} @ "
            f"{result.base and result.base['commit'][:12]}"
        )
        console.print(result.diff.rstrip(), markup=False)
        step("quantpatch check")
        _print_check(check(dest))
    step("quantpatch restore")
    restored = restore(dest)
    console.print(f"restored {restored.base['branch']} @ {restored.base['commit'][:12]}")
    same = all((dest / rel).read_bytes() == data for rel, data in before.items())
    console.print(f"target files byte-identical to before the first set: {'yes' if same else 'NO'}")
    repo = git.Repo(dest)
    console.print("branches: " + ", ".join(sorted(h.name for h in repo.heads)))
    step("quantpatch check")
    _print_check(check(dest))
    if not same:  # pragma: no cover - would be a bug in restore
        raise RuntimeError("restore did not reproduce the original bytes")
