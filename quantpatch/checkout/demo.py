"""The throw-away demo checkout: real megatron-core sources with fork-layout sites, in git."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import git
from rich.console import Console

from quantpatch.base.config import DELAYED_TYPES, QUANT_TYPES, Targets, is_paretoq
from quantpatch.base.edits import Edit, apply_edits
from quantpatch.base.errors import UserError
from quantpatch.base.megatron_source import DEFAULT_VERSION, megatron_tree
from quantpatch.git import repo as gitrepo
from quantpatch.runtime.quantpatch_formats import SPECS
from quantpatch.runtime.quantpatch_formats import names as spec_names
from quantpatch.sites.codemods.init_sites import Layout, inject_sites

if TYPE_CHECKING:
    from quantpatch.checkout.switch import CheckReport

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def build_checkout(
    dest: Path, version: str = DEFAULT_VERSION, layout: Layout | None = None, *, inject: bool = True
) -> Path:
    """A git repository at ``dest`` holding ``megatron/`` of megatron-core ``version``: one
    commit with the stock files, and (``inject``) one that adds fork-layout sites: with the
    default layout that is ``quantpatch init`` (sites, dispatches and the quant ops module);
    another ``layout`` (tests) injects sites written in that form instead."""
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"{dest}: the directory exists and is not empty; choose another one.")
    tree = megatron_tree(version)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tree, dest / "megatron", ignore=_IGNORE)
    (dest / ".gitignore").write_text("__pycache__/\n*.pyc\ntensor_logs/\n")
    repo = git.Repo.init(dest, initial_branch="main", expand_vars=False)
    gitrepo.commit_paths(repo, [".gitignore", "megatron"], f"megatron-core {version}, unmodified")
    if inject and layout is None:
        from quantpatch.checkout.init import init

        init(dest)
    elif inject:
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


def walk(dest: Path, console: Console, print_check: Callable[[CheckReport, Console], None]) -> None:
    """check -> set -> check -> set (other values, same base) -> restore -> check, printed
    (each check's table by ``print_check``: the CLI's renderer)."""
    from quantpatch.checkout.switch import SetRequest, check, restore, set_values

    targets = Targets()
    before = {rel: (dest / rel).read_bytes() for rel in targets.all_files}

    def step(title: str) -> None:
        console.rule(title)

    step("quantpatch check")
    print_check(check(dest), console)
    mx8, mx4, hif8 = spec_names(default_candidate=True)  # the formats analysis compares first
    for values in (
        {"linear": mx8, "qk": mx8, "pv": "bf16"},
        {"linear": hif8, "qk": mx4, "pv": mx8},
    ):
        args = " ".join(f"--{r} {v}" for r, v in values.items())
        step(f"quantpatch set {args}")
        result = set_values(dest, SetRequest(dict(values)))
        console.print(
            f"branch {result.branch} at {(result.commit or '')[:12]}, from base "
            f"{result.base and result.base.branch} @ "
            f"{result.base and str(result.base.commit)[:12]}"
        )
        console.print(result.diff.rstrip(), markup=False)
        step("quantpatch check")
        print_check(check(dest), console)
    step("quantpatch restore")
    restored = restore(dest)
    base = restored.base
    console.print(f"restored {base and base.branch} @ {base and str(base.commit)[:12]}")
    same = all((dest / rel).read_bytes() == data for rel, data in before.items())
    console.print(f"target files byte-identical to before the first set: {'yes' if same else 'NO'}")
    repo = gitrepo.open_repo(dest)
    console.print("branches: " + ", ".join(sorted(h.name for h in repo.heads)))
    repo.close()
    step("quantpatch check")
    print_check(check(dest), console)
    if not same:  # pragma: no cover - would be a bug in restore
        raise RuntimeError("restore did not reproduce the original bytes")
    step("the patched linear layer on CPU, per format (relative error against bf16)")
    print_linear_errors(dest, console)


_NOT_DEMOED = spec_names(tiled=True) + spec_names(rht=True)
DEMO_FORMATS = (
    *(f for f in QUANT_TYPES if f not in _NOT_DEMOED and not is_paretoq(f)),
    *(f.name for f in SPECS if f.w_bits in (0, 2)),
)
"""The demo's linear formats, each one the whole layer's: nvfp4-2d tiles a weight Parameter,
which the probe's plain weight tensor is not, so its row would repeat nvfp4's; nvfp4-rht is
meant for the weight-gradient GEMM alone (``--wgrad nvfp4-rht``), not a whole layer's format;
of ParetoQ's weight values, those of the schemes ``paretoq_w1.58`` and ``paretoq_w2`` (ternary
and 2-bit weights). A delayed value's row is its second step on the same inputs (the first
step's amaxes in the history)."""


def linear_errors(
    dest: Path, formats: tuple[str, ...] = DEMO_FORMATS
) -> dict[str, dict[str, float]]:
    """Run Megatron's real linear autograd function (forward, input grad, weight grad) from
    each format's worktree of ``dest`` on identical seeded bf16 inputs; return, per format
    and GEMM, ||y - y_bf16|| / ||y_bf16||."""
    import subprocess
    import sys
    import tempfile

    import torch

    from quantpatch.checkout.worktrees import ensure_worktree

    probe = Path(__file__).parents[1] / "runtime" / "linear_probe.py"
    results: dict[str, dict[str, torch.Tensor]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            wt = ensure_worktree(dest, {"linear": fmt, "qk": "bf16", "pv": "bf16"})
            out = Path(tmp) / f"{fmt}.pt"
            weights = ["--weights", fmt] if is_paretoq(fmt) else []
            if fmt in DELAYED_TYPES:  # the weight keeps a layer's state: one step fills it
                weights = ["--delayed", fmt]
            subprocess.run(
                [sys.executable, str(probe), str(out), *weights],
                check=True,
                cwd=wt.path,
                env={**_clean_env(), "PYTHONPATH": str(wt.path)},
            )
            results[fmt] = torch.load(out)
    ref = results["bf16"]
    return {
        fmt: {
            gemm: float((t.float() - ref[gemm].float()).norm() / ref[gemm].float().norm())
            for gemm, t in res.items()
        }
        for fmt, res in results.items()
    }


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUSTOM_QUANT_TYPE")}


def print_linear_errors(dest: Path, console: Console) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        console.print("torch is not installed: pip install 'torch>=2.1' numpy to see the numbers.")
        return
    from rich.table import Table

    with console.status(
        "running Megatron's linear layer forward and backward on CPU in each format (~30 s)"
    ):
        errors = linear_errors(dest)
    table = Table(
        title="relative error of each GEMM against bf16 (256 tokens, 512 -> 512)",
        title_justify="left",
    )
    for col in ("linear format", "forward (E4M3 / E2M1 / HiF8)", "input grad", "weight grad"):
        table.add_column(col, justify="right")
    for fmt, row in errors.items():
        table.add_row(fmt, *(f"{row[g]:.2e}" for g in ("forward", "dgrad", "wgrad")))
    console.print(table)
