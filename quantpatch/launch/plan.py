"""``gen-scripts`` and ``layout`` as plain functions: the registry, the Megatron flags, the
layouts, the launcher's scripts, and the worktrees that Slurm jobs need before they start."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantpatch.base.errors import UserError
from quantpatch.launch.layout import Layout, LayoutError, check_rendezvous, derive, plan_from_text

if TYPE_CHECKING:  # jinja2 and the registry load only for the commands that render
    from quantpatch.launch.registry import Registry
    from quantpatch.launch.scripts import FlagSource, GenResult, Launcher, Script


@dataclass(frozen=True)
class GenRequest:
    out: Path
    models: list[str] | None
    datasets: list[str] | None
    schemes: list[str] | None
    profile: str = "full"
    launcher: str = "torchrun"
    parallel: Mapping[str, int | str | None] = field(default_factory=dict)
    release: str | None = None
    config: Path | None = None
    repo: Path | None = None
    swift: Path | None = None
    force: bool = False
    check: bool = False
    prepare: bool = False
    refuse_blocked: bool = False
    """Refuse (before anything is written) a model the checkout cannot build yet, with the
    sentence its scripts would stop with (``sweep run``); else its scripts are written."""
    slurm_nodes: str | None = None
    """With the slurm launcher, compare the scripts' nodes and GPUs with what the partition
    offers (``launch.slurm_nodes``): ``refuse`` (``sweep run``, before anything is written)
    or ``warn`` (``gen-scripts``); None: not asked."""
    attention: str = "auto"
    """The attention path of every script (``launch.attention``: auto, flash or stock)."""
    gpus: list[str] | None = None
    """The GPUs of this machine the runs take (a local sweep; [] for all of them): native
    schemes are refused on those without their format. None: not this machine's GPUs."""


@dataclass
class GenDone:
    result: GenResult
    flags: FlagSource
    validated: str
    """What the scripts were validated against (Megatron's flags, and ms-swift's)."""
    warnings: list[str]
    prepared: list[str]
    """``<branch> at <path>`` for each worktree made ready (``--prepare``)."""


def _launcher(name: str) -> Launcher:
    from quantpatch.launch.scripts import LAUNCHERS

    if name not in LAUNCHERS:  # narrows str to the launcher names
        raise UserError(f"--launcher: unknown launcher '{name}'; valid: {', '.join(LAUNCHERS)}.")
    return name


def generate_scripts(request: GenRequest, progress: Callable[[str], None] | None = None) -> GenDone:
    """Validate everything first (flags, layouts, launcher), prepare worktrees when asked,
    then write all scripts at once (or, with ``check``, compare)."""
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import flag_source, generate, render_all, writable

    launcher = _launcher(request.launcher)
    reg = load_registry(request.config)
    flags = flag_source(request.repo, request.release)
    scripts = render_all(
        reg,
        reg.pick("models", request.models),
        reg.pick("datasets", request.datasets),
        reg.pick("schemes", request.schemes),
        request.profile,
        flags,
        launcher,
        request.parallel,
        request.swift,
        request.attention,
    )
    from quantpatch.launch.native import refuse_unrunnable

    picked = list(dict.fromkeys(s.scheme.name for s in scripts))
    root = flags.root if flags.root is not None else request.repo
    refuse_unrunnable([reg.schemes[n] for n in picked], root, os.environ, request.gpus)
    blocked = {s.model: s.blocked for s in scripts if s.blocked is not None}
    if blocked and request.refuse_blocked:
        raise UserError(next(iter(blocked.values())))
    fit = _slurm_fit(reg, scripts, request) if launcher == "slurm" else None
    if fit is not None and request.slurm_nodes == "refuse":
        raise UserError(fit)
    validated = flags.describe()
    if launcher == "swift":
        from quantpatch.launch.swift import swift_source

        validated += f" and {swift_source(request.swift).describe()}"
    warnings = sorted(
        {f"{s.model}: {w}" for s in scripts if s.layout is not None for w in s.layout.warnings}
    )
    if blocked:  # one line for all of them: their scripts are written, and stop until fixed
        count = sum(1 for s in scripts if s.blocked is not None)
        why = next(iter(blocked.values())).rstrip(".")
        others = f" ({', '.join(sorted(blocked)[1:])} likewise)" if len(blocked) > 1 else ""
        warnings.append(f"{why}{others}; {count} scripts stop before torchrun until then.")
    if fit is not None:
        warnings.append(fit)
    data = _data_warning(reg, scripts, request.profile, launcher)
    if data is not None:
        warnings.append(data)
    prepared: list[str] = []
    if request.prepare and not request.check:
        writable(request.out)  # a write that would fail anyway prepares nothing first
        prepared = prepare_worktrees(request.repo, [s.scheme.values() for s in scripts], progress)
    result = generate(
        request.out,
        scripts,
        request.profile,
        flags,
        force=request.force,
        check=request.check,
        slurm=reg.slurm,
    )
    return GenDone(result, flags, validated, warnings, prepared)


def requested_nodes(scripts: Sequence[Script]) -> tuple[int, int] | None:
    """The most GPUs per node and nodes any of the scripts asks for (None: no layout)."""
    plans = [s.layout.plan for s in scripts if s.layout is not None]
    if not plans:
        return None
    return max(p.gpus_per_node for p in plans), max(p.nodes for p in plans)


def _slurm_fit(reg: Registry, scripts: Sequence[Script], request: GenRequest) -> str | None:
    """The sentence ``slurm_nodes.refusal`` says for the scripts' request, where asked."""
    from quantpatch.launch import slurm_nodes

    asked = requested_nodes(scripts)
    if request.slurm_nodes is None or asked is None:
        return None
    partition = slurm_nodes.query(reg.slurm.partition)
    if partition is None:
        return None
    return slurm_nodes.refusal(
        partition,
        *asked,
        gpu_request=reg.slurm.gpu_request,
        profile=request.profile,
        cpus=max(s.cpus for s in scripts),
        gpu_partitions=slurm_nodes.gpu_partitions() if partition.most_gpus == 0 else (),
    )


def _data_warning(
    reg: Registry, scripts: Sequence[Script], profile: str, launcher: str
) -> str | None:
    """One line when the datasets the scripts read are missing here (made by `data prepare`)."""
    from quantpatch.launch.data_check import gen_warning

    models = list(dict.fromkeys(s.model for s in scripts))
    datasets = list(dict.fromkeys(s.dataset for s in scripts))
    return gen_warning(reg, models, datasets, profile, launcher)


def prepare_worktrees(
    repo: Path | None,
    values: list[dict[str, str]],
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Every distinct scheme's worktree, created (or brought to the base's tip) now."""
    from quantpatch.checkout.worktrees import ensure_worktree

    done: list[str] = []
    seen: set[tuple[tuple[str, str], ...]] = set()
    for wanted in values:
        key = tuple(sorted(wanted.items()))
        if key in seen:
            continue
        seen.add(key)
        result = ensure_worktree(repo, wanted)
        line = f"{result.branch} at {result.path}"
        if progress is not None:
            progress(f"prepared {line}")
        done.append(line)
    return done


def resolve_layout(
    model: str | None,
    profile: str,
    config: Path | None,
    gpus: str | None,
    given: Mapping[str, str | None],
    node_rank: str | None = None,
    master_addr: str | None = None,
    master_port: str | None = None,
) -> Layout:
    """``quantpatch layout``: a model's plan under a profile (or the facts given), with the
    given sizes over it, derived or refused."""
    base = None
    if model is not None:
        from quantpatch.launch.registry import load_registry
        from quantpatch.launch.scripts import model_plan

        reg = load_registry(config)
        reg.pick("models", [model])
        if profile not in reg.profiles:
            raise UserError(
                f"--profile: unknown profile '{profile}'; valid: {', '.join(reg.profiles)}."
            )
        base = model_plan(reg, model, profile)
    plan = plan_from_text(given, base, gpus)
    try:
        layout = derive(plan)
        check_rendezvous(plan.nodes, node_rank, master_addr, master_port)
        return layout
    except LayoutError as exc:
        if model is None:
            raise
        raise LayoutError(f"{model}/{profile}: {exc}") from None
