"""Launch scripts rendered from the Jinja templates in ``templates/``.

One template (with macros) renders every model x dataset x scheme combination. Values that
reach the shell go through one quoting filter (``shlex.quote``); the environment is undefined-
strict, so a missing registry field fails loudly instead of rendering an empty flag. Each script
starts with a header naming the combination, the generator and the SHA-256 of its own body, so
``gen-scripts`` can tell a script it wrote from one a person edited.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from quantpatch import __version__
from quantpatch.base.edits import Edit, apply_edits, read_exact
from quantpatch.base.errors import UserError
from quantpatch.launch.attention import Attention, attention_for
from quantpatch.launch.layout import (
    Layout,
    LayoutError,
    Plan,
    derive,
    model_facts,
    parse_sequence_parallel,
)
from quantpatch.launch.registry import (
    DEFAULT_RELEASE,
    ArgValue,
    Dataset,
    Model,
    Profile,
    Registry,
    Scheme,
    Slurm,
    release_flags,
    releases,
)
from quantpatch.launch.shell_render import (
    BATCH_VARIABLES,
    ShellExpr,
    master_port,
    shell_quote,
    template_environment,
)

HASH_PREFIX = "# body-sha256: "
INDEX = "index.md"
SWEEP = "sweep.sbatch"
Launcher = Literal["torchrun", "slurm", "swift"]
LAUNCHERS: tuple[Launcher, ...] = ("torchrun", "slurm", "swift")
# flags the template itself passes (the rest come from the registry)
MOE_ONLY_FLAGS = ("expert-model-parallel-size", "expert-tensor-parallel-size")
TEMPLATE_FLAGS = (
    "tensor-model-parallel-size",
    "pipeline-model-parallel-size",
    "expert-model-parallel-size",
    "expert-tensor-parallel-size",
    "context-parallel-size",
    "num-virtual-stages-per-pipeline-rank",
    "num-layers-per-virtual-pipeline-stage",
    "sequence-parallel",
    "mock-data",
    "tokenizer-type",
    "vocab-size",
    "data-path",
    "split",
    "tokenizer-model",
    "save",
    "load",
    "tensorboard-dir",
)


@dataclass(frozen=True)
class FlagSource:
    """The ``--flags`` a script may hand to pretrain_gpt.py, and where that list came from:
    a bundled release list, or the checkout's own argument parser."""

    release: str
    """``core_v0.13.1`` (bundled) or the checkout's version (``0.15.0rc3``)."""
    flags: frozenset[str]
    files: tuple[str, ...] = ()
    """The checkout files the flags were read from (empty for a bundled list)."""
    root: Path | None = None
    """The checkout whose parser was read (``None`` for a bundled list)."""
    note: str = ""
    """Why a bundled list is used although no release was asked for."""
    unresolved: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """For each script's header and the index."""
        if self.root is None:
            return f"Megatron-LM {self.release} (bundled flag list)"
        return f"Megatron-LM {self.release} (flags read from the checkout's {self.files[0]})"

    def describe(self) -> str:
        """``the checkout's Megatron 0.15.0rc3 (megatron/training/arguments.py, 512 flags)``."""
        if self.root is None:
            note = f"; {self.note}" if self.note else ""
            return (
                f"the bundled Megatron-LM {self.release} flag list ({len(self.flags)} flags{note})"
            )
        return (
            f"the checkout's Megatron {self.release} "
            f"({', '.join(self.files)}, {len(self.flags)} flags)"
        )

    def where(self) -> str:
        """What an error names: the file read."""
        if self.root is None:
            return f"the bundled flag list pretrain-flags-{self.release}.txt"
        return str(self.root / self.files[0])


def bundled_flags(release: str) -> FlagSource:
    """A bundled release's list (``quantpatch/data/megatron/pretrain-flags-<release>.txt``)."""
    return FlagSource(release, release_flags(release))


def _source(release: str | FlagSource) -> FlagSource:
    """Callers may name a bundled release or pass a ``FlagSource``."""
    return bundled_flags(release) if isinstance(release, str) else release


def flag_source(repo: Path | None, release: str | None) -> FlagSource:
    """The flags scripts are validated against: the bundled list of ``release`` when one is
    named; else the parser of the checkout at ``repo`` (default: the git root above the
    current directory) when it has ``megatron/training/arguments.py``; else the bundled
    default list, saying why."""
    if release is not None:
        return bundled_flags(release)
    from quantpatch.git import repo as gitrepo
    from quantpatch.launch.megatron_files import ARGUMENTS
    from quantpatch.launch.megatron_release import checkout_release

    checkout = gitrepo.find_checkout(repo, need_git=False)
    found = checkout_release(checkout.root, checkout.state_dir / "cache")
    if found is None:
        return replace(bundled_flags(DEFAULT_RELEASE), note=f"no {ARGUMENTS} in {checkout.root}")
    return FlagSource(found.name, found.flags, found.files, found.root, unresolved=found.unresolved)


@dataclass(frozen=True)
class Script:
    rel: str
    model: str
    dataset: str
    scheme: Scheme
    profile: str
    text: str
    flags: tuple[str, ...]
    """Every ``--flag`` the script can hand to pretrain_gpt.py (both data modes)."""
    launcher: Launcher = "torchrun"
    layout: Layout | None = None
    """The layout of the profile's values (the environment may override it at launch)."""
    blocked: str | None = None
    """Why the checkout cannot build the model yet and the command that fixes it (one
    sentence): the script stops with it before ``torchrun`` while that holds."""
    attention: Attention | None = None
    """The attention path the script exports (``launch.attention``; the swift scripts: None)."""
    cpus: int = 1
    """The CPUs its Slurm task asks for (``--cpus-per-task``: ``cpus_for``)."""


_SUFFIX: dict[Launcher, tuple[str, str]] = {
    "torchrun": ("pretrain", ".sh"),
    "slurm": ("pretrain", ".sbatch"),
    "swift": ("swift_pt", ".sh"),
}


MEGATRON_NUM_WORKERS = 2
"""Megatron's default ``--num-workers`` (data-loader processes of each rank)."""


def cpus_for(slurm: Slurm, gpus_per_node: int, args: Mapping[str, ArgValue]) -> int:
    """``--cpus-per-task`` of a node's task: ``[slurm] cpus_per_task`` where set, else what
    the node's ranks need, one CPU each and one per data-loader worker (``num-workers`` of
    the args, Megatron's 2 by default)."""
    if slurm.cpus_per_task is not None:
        return slurm.cpus_per_task
    workers = args.get("num-workers", MEGATRON_NUM_WORKERS)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        workers = MEGATRON_NUM_WORKERS
    return gpus_per_node * (1 + workers)


def script_name(model: str, dataset: str, scheme: str, launcher: Launcher = "torchrun") -> str:
    stem, ext = _SUFFIX[launcher]
    return f"{model}/{stem}_{model}_{dataset}_{scheme}{ext}"


def _flag_pairs(args: dict[str, ArgValue]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for flag, value in args.items():
        if value is False:
            continue
        if value is True:
            out.append((flag, None))
        elif isinstance(value, list):
            out.append((flag, " ".join(str(v) for v in value)))
        elif flag in BATCH_VARIABLES:
            out.append((flag, ShellExpr(f'"${BATCH_VARIABLES[flag]}"')))
        else:
            out.append((flag, str(value)))
    return out


def _data_prefix(dataset: Dataset, model: Model) -> str:
    """The dataset's prefix as a shell expression: ``{model}`` filled in, the literal parts
    quoted, ``{data_root}`` as ``"$DATA_ROOT"``."""
    parts = dataset.prefix.replace("{model}", model.name).split("{data_root}")
    return '"$DATA_ROOT"'.join(shell_quote(p) if p else "" for p in parts) or "''"


@dataclass(frozen=True)
class _Args:
    """A model's pretrain_gpt.py arguments under a profile, in the template's three groups."""

    groups: tuple[list[tuple[str, str | None]], ...]
    is_moe: bool
    flags: tuple[str, ...]
    """Every flag the script can pass (both data modes), without the dashes."""
    values: dict[str, ArgValue]
    """All args merged (model, profile, common)."""


def bf16_layers_text(policy: str | None, num_layers: object) -> str:
    """The BF16 layer policy as the run log's header names it: the policy and, where the
    model's layers are known, the layer numbers it keeps in BF16."""
    from quantpatch.base.config import bf16_layer_numbers, layer_ranges

    if not policy:
        return "none (every layer quantized as its values say)"
    if not isinstance(num_layers, int) or isinstance(num_layers, bool):
        return policy
    numbers = bf16_layer_numbers(policy, num_layers)
    output = " and the output layer" if "output" in policy.split(",") else ""
    return f"{policy} = layers {layer_ranges(numbers) or 'none'} of {num_layers}{output} in BF16"


def resolved_args(reg: Registry, model: str, profile: str) -> dict[str, ArgValue]:
    """Every pretrain_gpt.py argument a model's script passes under a profile (the model's,
    the profile's, the model's own for that profile, the common ones), before ``-- EXTRA``."""
    return dict(_model_args(reg, model, profile).values)


# a flag the script passes itself: the --config entry that sets it instead
_OWN_FLAG_ENTRY = {
    "tensor-model-parallel-size": ("tp", "parallel"),
    "pipeline-model-parallel-size": ("pp", "parallel"),
    "context-parallel-size": ("cp", "parallel"),
    "expert-model-parallel-size": ("ep", "parallel"),
    "expert-tensor-parallel-size": ("etp", "parallel"),
    "num-virtual-stages-per-pipeline-rank": ("vpp", "parallel"),
    "sequence-parallel": ("sequence_parallel", "parallel"),
    "mock-data": ("mock_data", "profile"),
    "tokenizer-type": ("tokenizer_type", "model"),
    "tokenizer-model": ("tokenizer_model", "model"),
    "vocab-size": ("vocab_size", "model"),
}


def _instead_of_own_flag(flag: str, value: ArgValue, model: str, profile: str) -> str:
    """Where a flag the script passes itself is set instead, as a --config entry (empty
    where the run gives it: the dataset's prefix and split, the run folder)."""
    if flag in ("data-path", "split"):
        return "the dataset's prefix and split in its [datasets.NAME] table give it"
    entry = _OWN_FLAG_ENTRY.get(flag)
    if entry is None:
        return "the run's folder gives it" if flag in ("save", "load", "tensorboard-dir") else ""
    key, where = entry
    if key == "sequence_parallel":
        shown = json.dumps("on" if value is True else "off" if value is False else str(value))
    elif key == "mock_data":
        shown = "true" if value is not False else "false"
    else:
        shown = json.dumps(value)
    table = {
        "parallel": f"profiles.{profile}.parallel",
        "profile": f"profiles.{profile}",
        "model": f"models.{model}",
    }[where]
    return f"{key} = {shown} in the [{table}] table sets it"


def _model_args(reg: Registry, model: str, profile: str) -> _Args:
    m, p = reg.models[model], reg.profiles[profile]
    model_args = {**m.args}
    training_args: dict[str, ArgValue] = {}
    for key, value in {**p.args, **m.profile_args.get(profile, {})}.items():
        (model_args if key in model_args else training_args)[key] = value
    impl_args = {
        k: v for k, v in reg.common_args.items() if k not in model_args and k not in training_args
    }
    own = [k for k in (*model_args, *training_args, *impl_args) if k in TEMPLATE_FLAGS]
    if own:
        tables = (
            (f"models.{model}.args", m.args),
            (f"profiles.{profile}.args", p.args),
            (f"models.{model}.profiles.{profile}.args", m.profile_args.get(profile, {})),
            ("common.args", reg.common_args),
        )
        fixes = []
        for flag in own:
            held = [name for name, args in tables if flag in args]
            value = next(args[flag] for _, args in tables if flag in args)
            instead = _instead_of_own_flag(flag, value, model, profile)
            fixes.append(
                f"drop {flag} from the [{'] and ['.join(held)}] table"
                f"{'s' if len(held) > 1 else ''}{f' ({instead})' if instead else ''}"
            )
        raise UserError(
            f"{model}/{profile}: {', '.join(own)} must not be set in args, since the script "
            f"passes {'it' if len(own) == 1 else 'them'} itself; {'; '.join(fixes)} in a "
            "--config."
        )
    groups = (_flag_pairs(model_args), _flag_pairs(training_args), _flag_pairs(impl_args))
    is_moe = "num-experts" in model_args
    flags = tuple(f for g in groups for f, _ in g) + tuple(
        f
        for f in TEMPLATE_FLAGS
        if (is_moe or f not in MOE_ONLY_FLAGS) and f != "num-layers-per-virtual-pipeline-stage"
    )
    return _Args(groups, is_moe, flags, {**model_args, **training_args, **impl_args})


PARALLEL_OVERRIDES = ("gpus_per_node", "nodes", "tp", "pp", "cp", "ep", "etp", "vpp")


def model_plan(
    reg: Registry,
    model: str,
    profile: str,
    parallel: Mapping[str, int | str | None] | None = None,
) -> Plan:
    """The layout inputs of ``model`` under ``profile``: model facts from its args, sizes from
    the profile's ``parallel`` table, then ``parallel`` (command-line overrides)."""
    p = reg.profiles[profile]
    facts = model_facts(_model_args(reg, model, profile).values, f"{model}/{profile}")
    given = {
        **p.parallel,
        **{k: v for k, v in (parallel or {}).items() if v is not None},
    }
    sizes: dict[str, Any] = {k: given[k] for k in PARALLEL_OVERRIDES if k in given}
    sizes.setdefault("gpus_per_node", p.gpus_per_node)
    sizes.setdefault("nodes", 1)
    return Plan(
        **sizes,
        **facts,
        sequence_parallel=parse_sequence_parallel(str(given.get("sequence_parallel", "auto"))),
    )


def scheme_layouts(
    reg: Registry,
    models: Sequence[str],
    schemes: Sequence[str],
    profile: str,
    parallel: Mapping[str, int | str | None] | None = None,
) -> dict[tuple[str, str], Layout]:
    """Each (model, scheme)'s layout: the model's under the profile, with the layer
    implementation the scheme's own argv chooses (a native scheme's TransformerEngine layers
    take context parallelism, the local ones do not); the first refusal names the model."""
    out: dict[tuple[str, str], Layout] = {}
    by_impl: dict[tuple[str, str], Layout] = {}
    for model in models:
        plan = model_plan(reg, model, profile, parallel)
        for scheme in schemes:
            impl = reg.schemes[scheme].transformer_impl() or plan.transformer_impl
            if (model, impl) not in by_impl:
                try:
                    by_impl[(model, impl)] = derive(replace(plan, transformer_impl=impl))
                except LayoutError as exc:
                    raise _named_refusal(reg, model, profile, parallel, exc) from None
            out[(model, scheme)] = by_impl[(model, impl)]
    return out


def plan_layout(
    reg: Registry,
    models: Sequence[str],
    profile: str,
    parallel: Mapping[str, int | str | None] | None = None,
) -> dict[str, Layout]:
    """Each model's layout under the profile, or the first refusal, naming the model."""
    out: dict[str, Layout] = {}
    for model in models:
        plan = model_plan(reg, model, profile, parallel)
        try:
            out[model] = derive(plan)
        except LayoutError as exc:
            raise _named_refusal(reg, model, profile, parallel, exc) from None
    return out


def _named_refusal(
    reg: Registry,
    model: str,
    profile: str,
    parallel: Mapping[str, int | str | None] | None,
    exc: LayoutError,
) -> LayoutError:
    """A layout refusal naming the model, and where it has a fix, how to ask for it (the
    option given, else the config table that sets it)."""
    if exc.fix is None:
        return LayoutError(f"{model}/{profile}: {exc}")
    how = generation_fix(reg, model, profile, parallel or {}, *exc.fix)
    return LayoutError(f"{model}/{profile}: {exc.said}; {how[0]} {exc.verdict} ({how[1]}).")


_FIX_NAMES = {
    "tp": "TP",
    "pp": "PP",
    "cp": "CP",
    "ep": "EP",
    "etp": "expert TP",
    "vpp": "VPP",
    "sequence_parallel": "sequence parallel",
    "global_batch": "global batch",
    "micro_batch": "micro batch",
}
_BATCH_FLAGS = {"global_batch": "global-batch-size", "micro_batch": "micro-batch-size"}


def generation_fix(
    reg: Registry,
    model: str,
    profile: str,
    parallel: Mapping[str, int | str | None],
    field: str,
    value: int | str,
) -> tuple[str, str]:
    """How ``gen-scripts`` and ``sweep run`` take a layout refusal's fix: the size, and the
    option given on their command line (that one wins over a config), else the line of a
    ``--config`` table that sets it (the table the value comes from: a model's own profile
    args win over the profile's)."""
    what = f"{_FIX_NAMES.get(field, field)} {value}"
    if parallel.get(field) is not None:
        option = field.replace("_", "-")
        return what, f"--{option} {value} instead of --{option} {parallel[field]}"
    shown = f'"{value}"' if isinstance(value, str) else str(value)
    flag = _BATCH_FLAGS.get(field)
    if flag is None:
        return what, f"{field} = {shown} in the [profiles.{profile}.parallel] table of a --config"
    own = reg.models[model].profile_args.get(profile, {})
    table = f"models.{model}.profiles.{profile}.args" if flag in own else f"profiles.{profile}.args"
    return what, f"{flag} = {shown} in the [{table}] table of a --config"


def check_flags(reg: Registry, models: Sequence[str], profile: str, source: FlagSource) -> None:
    """Every flag the models' scripts pass must be one the target release accepts."""
    _reject_unaccepted(
        {f"{m}/{profile}": _model_args(reg, m, profile).flags for m in models}, source, reg
    )


def check_scheme_args(
    reg: Registry, schemes: Sequence[str], source: FlagSource, launcher: Launcher
) -> None:
    """Every scheme's own arguments: flags the target release accepts, none the script
    passes itself, and none for ms-swift (whose scripts take no pretrain_gpt.py argv)."""
    used: dict[str, tuple[str, ...]] = {}
    for name in schemes:
        words = reg.schemes[name].argv()
        if not words:
            continue
        if launcher == "swift":
            raise UserError(
                f"scheme '{name}' carries Megatron arguments ({shlex.join(words)}), which "
                "ms-swift's scripts cannot pass; use --launcher torchrun or slurm for it."
            )
        flags = tuple(w.split("=", 1)[0][2:] for w in words if w.startswith("--"))
        own = [f for f in flags if f in TEMPLATE_FLAGS]
        if own:
            one = len(own) == 1
            raise UserError(
                f"scheme '{name}': args must not set --{', --'.join(own)}, since the script "
                f"passes {'it' if one else 'them'} itself; drop {'it' if one else 'them'} "
                f"(with {'its value' if one else 'their values'}) from the args of the "
                f"[schemes.{name}] table of the --config."
            )
        used[f"scheme {name}"] = flags
    _reject_unaccepted(used, source, reg)


def mla_unbuildable(
    root: Path, reg: Registry, models: Sequence[str], profile: str
) -> dict[str, tuple[str, str]]:
    """The models this checkout cannot build yet, each with the attention file that stops it
    and one sentence naming that file and the command that fixes it. Multi-Latent Attention
    builds its core attention with ``k_channels`` / ``v_channels``; with the local layers that
    is the checkout's ``DotProductAttention``, which must take them (``init`` adds them, on a
    stock checkout and on a fork). Found here rather than in model construction on the
    cluster."""
    from quantpatch.base.config import load_targets
    from quantpatch.git import repo as gitrepo

    mla = sorted(
        {
            m
            for m in models
            if (values := _model_args(reg, m, profile).values).get("multi-latent-attention") is True
            and values.get("transformer-impl", "local") == "local"
        }
    )
    if not mla:
        return {}
    for rel in load_targets(root).attention:
        path = root / rel
        if not path.is_file():
            continue
        cache = gitrepo.find_checkout(root, need_git=False).state_dir / "cache"
        if _takes_mla_head_dims(path.read_text(encoding="utf-8"), rel, cache) is False:
            return {
                m: (
                    rel,
                    f"{m} uses Multi-Latent Attention, which hands the local "
                    f"DotProductAttention its k_channels and v_channels, but {rel} does not "
                    f"take them; `quantpatch init --repo {shlex.quote(str(root))}` adds them.",
                )
                for m in mla
            }
    return {}


def _takes_mla_head_dims(text: str, rel: str, cache: Path) -> bool | None:
    """``takes_mla_head_dims`` of the file, cached by its content (a warm ``gen-scripts``
    parses nothing: libcst stays unloaded)."""
    key = hashlib.sha256(b"mla-head-dims-v1\0" + text.encode()).hexdigest()[:40]
    entry = cache / f"mla-{key}.json"
    try:
        value = json.loads(entry.read_text(encoding="utf-8"))
        if value is None or isinstance(value, bool):
            return value
    except (OSError, ValueError):
        pass
    from quantpatch.sites.codemods.init_sites import takes_mla_head_dims

    found = takes_mla_head_dims(text, rel)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(found), encoding="utf-8")
        tmp.replace(entry)
    except OSError:
        pass  # a cache that cannot be written only costs the next call a parse
    return found


def _reject_unaccepted(
    used: dict[str, tuple[str, ...]], source: FlagSource, reg: Registry | None = None
) -> None:
    """One sentence naming the flags the release does not accept, the model/profile using
    each, the file the accepted flags came from, and what to give instead: a bundled release
    whose list has every flag used, the ``flag = false`` entries of a --config that leave the
    flags out."""
    users: dict[str, list[str]] = {}
    for user, flags in used.items():
        for flag in flags:
            if f"--{flag}" not in source.flags:
                users.setdefault(f"--{flag}", []).append(user)
    if not users:
        return
    by_users: dict[tuple[str, ...], list[str]] = {}
    for flag, who in sorted(users.items()):
        by_users.setdefault(tuple(who), []).append(flag)
    unknown = ", ".join(  # the flags most models use first
        f"{', '.join(flags)} (used by {', '.join(who)})"
        for who, flags in sorted(by_users.items(), key=lambda item: (-len(item[0]), item[1]))
    )
    remedy = ", or ".join(_remedies(users, used, source, reg))
    if source.unresolved:
        remedy += (
            f" (the parser also builds flags from {', '.join(source.unresolved)}, which "
            "quantpatch could not find in the checkout)"
        )
    raise UserError(
        f"Megatron-LM {source.release} does not accept {unknown}, checked against "
        f"{source.where()}; {remedy}."
    )


def _remedies(
    users: Mapping[str, Sequence[str]],
    used: Mapping[str, tuple[str, ...]],
    source: FlagSource,
    reg: Registry | None,
) -> list[str]:
    """What to give instead of flags the release does not accept: a bundled release whose
    list has them all, the --config entries that leave them out, a --schemes without the
    schemes whose recipe passes them; else another Megatron-LM."""
    remedies = []
    if source.root is None:  # a bundled list: another bundled release may have them all
        every = {f"--{f}" for flags in used.values() for f in flags}
        fits = [r for r in releases() if r != source.release and every <= release_flags(r)]
        if fits:
            best = DEFAULT_RELEASE if DEFAULT_RELEASE in fits else fits[-1]
            remedies.append(f"give --megatron-release {best}, whose flag list has them all")
    dropped = _drop_entries(users, reg)
    if dropped:
        remedies.append(f"set {dropped} of a --config to leave them out")
    everyone = [u for who in users.values() for u in who]
    if not remedies and all(u.startswith("scheme ") for u in everyone):
        # flags of the schemes' recipes (a native scheme's --fp8-recipe ...): run without them
        schemes = sorted({u.removeprefix("scheme ") for u in everyone})
        remedies.append(
            f"give --schemes without {', '.join(schemes)} (their recipe passes "
            f"{'it' if len(users) == 1 else 'them'})"
        )
    if not remedies:  # the script's own flags (or a recipe's beside a table's): the checkout
        own = [f for f in users if f[2:] in TEMPLATE_FLAGS]
        them = "it" if len(users) == 1 else "them"
        remedies.append(
            (f"the scripts pass {', '.join(own)} themselves, so " if own else "")
            + f"run them from a Megatron-LM checkout that has {them} (--repo names one)"
            + ("" if source.root is not None else f" (bundled lists: {', '.join(releases())})")
        )
    return remedies


def _drop_entries(users: Mapping[str, Sequence[str]], reg: Registry | None) -> str:
    """``a = false, b = false in the [profiles.full.args] table`` (one table per profile, or a
    model's own profile table where that holds the flag; a scheme's ``args`` list without
    them): the entries that leave each flag out of the scripts ("" where a flag is the
    script's own or one of a scheme's recipe)."""
    if reg is None:
        return ""
    tables: dict[str, list[str]] = {}
    schemes: dict[str, list[str]] = {}  # a scheme's args: its list without the flags
    for flag, who in users.items():
        name = flag[2:]
        if name in TEMPLATE_FLAGS:
            return ""
        for user in who:
            if user.startswith("scheme "):
                scheme = reg.schemes.get(user.removeprefix("scheme "))
                if scheme is None or flag not in (w.split("=", 1)[0] for w in scheme.args):
                    return ""  # a flag of its recipe, not of its args
                schemes.setdefault(scheme.name, [])
                continue
            model, sep, profile = user.partition("/")
            if not sep or model not in reg.models:
                return ""
            own = reg.models[model].profile_args.get(profile, {})
            table = (
                f"models.{model}.profiles.{profile}.args"
                if name in own
                else (f"profiles.{profile}.args")
            )
            if f"{name} = false" not in tables.setdefault(table, []):
                tables[table].append(f"{name} = false")
    for scheme_name in schemes:
        kept: list[str] = []
        dropping = False
        for word in reg.schemes[scheme_name].args:
            if word.startswith("--"):
                dropping = word.split("=", 1)[0] in users
            if not dropping:
                kept.append(word)
        tables[f"schemes.{scheme_name}"] = [f"args = {json.dumps(kept)}"]
    return "; ".join(f"{', '.join(keys)} in the [{table}] table" for table, keys in tables.items())


def _header(lines: Sequence[str], body: str) -> str:
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            *lines,
            f"{HASH_PREFIX}{hashlib.sha256(body.encode()).hexdigest()}",
            "",
        ]
    )


def render_script(
    reg: Registry,
    model: str,
    dataset: str,
    scheme: str,
    profile: str,
    release: str | FlagSource = DEFAULT_RELEASE,
    launcher: Launcher = "torchrun",
    layout: Layout | None = None,
    swift_path: Path | None = None,
    blocked: tuple[str, str] | None = None,
    attention: Attention | None = None,
) -> Script:
    """One script; ``blocked`` (the attention file, the sentence): the checkout cannot build
    the model yet, so the script stops with the sentence before ``torchrun`` while the
    worktree's file is still so."""
    source = _source(release)
    stop = None if blocked is None else {"file": blocked[0], "sentence": blocked[1]}
    args = _model_args(reg, model, profile)
    _reject_unaccepted({f"{model}/{profile}": args.flags}, source, reg)
    if layout is None:
        layout = plan_layout(reg, [model], profile)[model]
    m, d, s, p = (
        reg.models[model],
        reg.datasets[dataset],
        reg.schemes[scheme],
        reg.profiles[profile],
    )
    run_name = f"{model}_{dataset}_{scheme}_{profile}"
    cpus = cpus_for(reg.slurm, layout.plan.gpus_per_node, args.values)
    if attention is None:
        attention = attention_for("auto", [s])
    if launcher == "swift":
        from quantpatch.launch import swift

        body = swift.render_body(
            reg,
            model,
            dataset,
            scheme,
            profile,
            layout,
            run_name,
            swift_path,
            args.values,
            args.is_moe,
            stop,
        )
    else:
        body = (
            template_environment()
            .get_template("pretrain.sh.j2")
            .render(
                launcher=launcher,
                slurm=reg.slurm,
                cpus=cpus,
                model=m,
                dataset=d,
                scheme=s,
                profile=p,
                plan=layout.plan,
                run_name=run_name,
                data_prefix=_data_prefix(d, m),
                master_port=master_port(run_name),
                model_args=args.groups[0],
                training_args=args.groups[1],
                impl_args=args.groups[2],
                is_moe=args.is_moe,
                scheme_args=s.argv(),
                release_option=(
                    "" if source.root is not None else f"--megatron-release {source.release} "
                ),
                persist_off=args.values.get("no-persist-layer-norm") is True,
                blocked=stop,
                attention=attention,
                bf16_layers=bf16_layers_text(s.policy(), args.values.get("num-layers")),
            )
        )
    header = _header(
        [
            f"# quantpatch launch script ({launcher}): model={model} dataset={dataset} "
            f"scheme={scheme} (linear={s.linear_text} qk={s.qk} pv={s.pv}) profile={profile}",
            f"# generated by quantpatch {__version__} for {source.label}; regenerate with "
            "`quantpatch gen-scripts` rather than editing",
        ],
        body,
    )
    return Script(
        script_name(model, dataset, scheme, launcher),
        model,
        dataset,
        s,
        profile,
        header + body,
        args.flags,
        launcher,
        layout,
        None if blocked is None else blocked[1],
        None if launcher == "swift" else attention,
        cpus,
    )


def extra_args(
    repo: Path | None, release: str | None, env_text: str, words: Sequence[str]
) -> list[str]:
    """A script's own arguments for pretrain_gpt.py: ``EXTRA_ARGS`` split as bash splits
    words (quotes, no expansion), then the words given after ``--``. Every ``--flag`` must be
    one the checkout's parser accepts (its ``megatron/training/arguments.py``), or, in a
    checkout without one, one of the bundled list of ``release``; else one sentence refuses
    the launch, naming them."""
    try:
        split = shlex.split(env_text)
    except ValueError as exc:
        raise UserError(
            f"EXTRA_ARGS cannot be split as bash words ({exc}): {env_text!r}."
        ) from None
    found = flag_source(repo, None)
    source = found if found.root is not None or release is None else bundled_flags(release)
    extra = [*split, *words]
    unknown = sorted(
        {
            w.split("=", 1)[0]
            for w in extra
            if w.startswith("--") and w != "--" and w.split("=", 1)[0] not in source.flags
        }
    )
    if unknown:
        raise UserError(
            f"pretrain_gpt.py of Megatron-LM {source.release} does not accept "
            f"{', '.join(unknown)} (from EXTRA_ARGS or the arguments after --), checked against "
            f"{source.where()}; nothing was started."
        )
    return extra


def body_matches_header(text: str) -> bool:
    """True when a script's body is exactly what its header's hash says (nobody edited it)."""
    _, sep, body = text.partition("\n" + HASH_PREFIX)
    if not sep:
        return False
    digest, _, rest = body.partition("\n")
    return hashlib.sha256(rest.encode()).hexdigest() == digest.strip()


INDEX_HASH = "<!-- quantpatch body-sha256: "


def index_with_hash(text: str) -> str:
    """The index with a last line holding its hash (an HTML comment: not rendered), so that
    a hand-edited index, like a script, is overwritten only with ``--force``."""
    body = text if text.endswith("\n") else text + "\n"
    return f"{body}\n{INDEX_HASH}{hashlib.sha256(body.encode()).hexdigest()} -->\n"


def index_is_ours(text: str) -> bool:
    """An index quantpatch wrote and nobody edited since (one written before the index
    carried a hash is recognised by its opening lines); a user's own index.md is not."""
    body, sep, tail = text.rpartition("\n" + INDEX_HASH)
    if sep:
        return tail == f"{hashlib.sha256(body.encode()).hexdigest()} -->\n"
    return text.startswith("# Launch scripts\n\nGenerated by quantpatch ")


def render_all(
    reg: Registry,
    models: Sequence[str],
    datasets: Sequence[str],
    schemes: Sequence[str],
    profile: str,
    release: str | FlagSource,
    launcher: Launcher = "torchrun",
    parallel: Mapping[str, int | str | None] | None = None,
    swift_path: Path | None = None,
    attention: str = "auto",
) -> list[Script]:
    """Every combination's script; ``attention`` (``launch.attention``) is resolved over the
    whole set of schemes, so a bf16 baseline takes the path of the FA schemes beside it."""
    if profile not in reg.profiles:
        raise UserError(
            f"--profile: unknown profile '{profile}'; valid: {', '.join(reg.profiles)}."
        )
    if launcher not in LAUNCHERS:
        raise UserError(
            f"--launcher: unknown launcher '{launcher}'; valid: {', '.join(LAUNCHERS)}."
        )
    source = _source(release)
    path = attention_for(attention, [reg.schemes[s] for s in schemes])
    check_flags(reg, models, profile, source)  # every model at once: one sentence
    check_scheme_args(reg, schemes, source, launcher)
    blocked = {} if source.root is None else mla_unbuildable(source.root, reg, models, profile)
    layouts = scheme_layouts(reg, models, schemes, profile, parallel)
    if launcher == "swift":
        from quantpatch.launch import swift

        swift.check_models(reg, models, profile, swift_path)
    scripts = [
        render_script(
            reg,
            m,
            d,
            s,
            profile,
            source,
            launcher,
            layouts[(m, s)],
            swift_path,
            blocked.get(m) if layouts[(m, s)].plan.transformer_impl == "local" else None,
            path,
        )
        for m in models
        for d in datasets
        for s in schemes
    ]
    _refuse_collisions(scripts)
    return scripts


def _refuse_collisions(scripts: Sequence[Script]) -> None:
    """Names join model, dataset and scheme with '_': two combinations must not meet on one
    script path or one run folder (``dolma`` + ``FA_x`` vs ``dolma_FA`` + ``x``)."""
    seen: dict[str, Script] = {}
    for s in scripts:
        for key in (s.rel, f"run:{s.model}_{s.dataset}_{s.scheme.name}"):
            other = seen.setdefault(key, s)
            if other is not s:
                raise UserError(
                    f"{other.model}/{other.dataset}/{other.scheme.name} and "
                    f"{s.model}/{s.dataset}/{s.scheme.name} would share "
                    f"{s.rel if key == s.rel else 'one run folder (checkpoints, logs)'}; rename "
                    "one of the datasets or schemes in the --config file."
                )


def render_index(scripts: Sequence[Script], profile: str, release: str | FlagSource) -> str:
    return (
        template_environment()
        .get_template("index.md.j2")
        .render(
            scripts=scripts,
            profile=profile,
            release=_source(release).label,
            version=__version__,
            launcher=scripts[0].launcher if scripts else "torchrun",
            sweep=SWEEP if scripts and scripts[0].launcher == "slurm" else None,
            layouts=list({s.model: s.layout for s in scripts}.items()),
        )
    )


def render_sweep(slurm: Slurm, scripts: Sequence[Script], out: Path) -> str:
    """``sweep.sbatch``: one Slurm job array over every combination; array task i runs the
    i-th script of the index (the sbatch scripts are run as plain bash inside the task)."""
    layout = scripts[0].layout
    assert layout is not None
    body = (
        template_environment()
        .get_template("sweep.sbatch.j2")
        .render(
            scripts=scripts,
            slurm=slurm,
            plan=layout.plan,
            cpus=max(s.cpus for s in scripts),
            profile=scripts[0].profile,
            sweep_dir=str(out.resolve()),
        )
    )
    return (
        _header(
            [
                f"# quantpatch sweep: a Slurm job array over the {len(scripts)} combinations of "
                f"the {INDEX} beside it (profile {scripts[0].profile})",
                f"# generated by quantpatch {__version__}; submit with `sbatch {SWEEP}` from the "
                "Megatron-LM checkout",
            ],
            body,
        )
        + body
    )


@dataclass
class GenResult:
    out: Path
    scripts: list[Script]
    written: list[str]
    unchanged: list[str]
    differing: list[str]
    """With ``check``: files that are missing or differ from what would be generated."""
    others: list[str] = field(default_factory=list)
    """quantpatch scripts in the directory that this generation does not hold (another
    launcher, profile or selection wrote them): left as they are, and said."""


def writable(out: Path) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(
            f"{out}: the output directory cannot be written ({probe} is not a "
            "writable directory); nothing was written."
        )


def generate(
    out: Path,
    scripts: Sequence[Script],
    profile: str,
    release: str | FlagSource,
    *,
    force: bool = False,
    check: bool = False,
    slurm: Slurm | None = None,
) -> GenResult:
    """Write the scripts and the index (and, for Slurm, the sweep's job array), all or
    nothing; or, with ``check``, only compare."""
    if not check:
        writable(out)
    files: list[tuple[str, str, int]] = [(s.rel, s.text, 0o755) for s in scripts]
    files.append((INDEX, index_with_hash(render_index(scripts, profile, release)), 0o644))
    if scripts and scripts[0].launcher == "slurm":
        files.append((SWEEP, render_sweep(slurm or Slurm(), scripts, out), 0o755))
    edits: list[Edit] = []
    unchanged: list[str] = []
    edited_by_hand: list[str] = []
    for rel, text, mode in files:
        old = read_exact(out / rel)
        if old == text:
            unchanged.append(rel)
            continue
        if old is not None and not (index_is_ours if rel == INDEX else body_matches_header)(old):
            edited_by_hand.append(rel)
        edits.append(Edit(rel, old, text, mode))
    result = GenResult(
        out, list(scripts), [], unchanged, [e.rel for e in edits], _others(out, files)
    )
    if check:
        return result
    if edited_by_hand and not force:
        shown = ", ".join(edited_by_hand[:3]) + (" ..." if len(edited_by_hand) > 3 else "")
        raise UserError(
            f"{out}: {len(edited_by_hand)} file(s) were edited by hand or not written by "
            f"quantpatch ({shown}); --force overwrites them."
        )
    result.written = apply_edits(out, edits)
    return result


def _others(out: Path, files: Sequence[tuple[str, str, int]]) -> list[str]:
    """Scripts quantpatch wrote into ``out`` earlier that are not among ``files``."""
    if not out.is_dir():
        return []
    ours = {rel for rel, _, _ in files}
    found = []
    for pattern in ("*/pretrain_*.sh", "*/pretrain_*.sbatch", "*/swift_pt_*.sh", SWEEP):
        for path in sorted(out.glob(pattern)):
            rel = path.relative_to(out).as_posix()
            if rel in ours or not path.is_file():
                continue
            with path.open("rb") as fh:
                head = fh.read(512)
            if b"\n# quantpatch " in head and HASH_PREFIX.encode() in head:
                found.append(rel)
    return found


def scheme_megatron(s: Scheme) -> str:
    """What ``list`` says of a scheme's Megatron side: the flags whose TransformerEngine run
    it emulates (``emulates: ...``), a native scheme's own argv (``runs: ...``), else '-'."""
    if s.native:
        return f"runs: {shlex.join(s.argv())}"
    parts = []
    if s.megatron_flags():
        parts.append(f"emulates: {shlex.join(s.megatron_flags())}")
    if s.args:
        parts.append(f"args: {shlex.join(s.args)}")
    return "; ".join(parts) or "-"


def describe(reg: Registry) -> dict[str, Any]:
    """The registry as plain data (``list --json``), with the table of every value
    (``quantpatch.base.values``)."""
    from quantpatch.base.values import VALUES

    return {
        "models": {
            n: {
                "description": m.description,
                "tokenizer": m.tokenizer_model,
                "vocab_size": m.vocab_size,
                "args": m.args,
            }
            for n, m in reg.models.items()
        },
        "datasets": {
            n: {"description": d.description, "prefix": d.prefix, "split": d.split}
            for n, d in reg.datasets.items()
        },
        "schemes": {n: s.values() for n, s in reg.schemes.items()},
        "scheme_runs": {
            n: {
                "megatron": " ".join(s.megatron_flags()) or None,
                "args": s.argv(),
                "native": s.native,
                "emulates": s.emulates,
            }
            for n, s in reg.schemes.items()
        },
        "values": [dict(v) for v in VALUES],
        "profiles": {
            n: {
                "description": p.description,
                "gpus_per_node": p.gpus_per_node,
                "mock_data": p.mock_data,
                "args": p.args,
            }
            for n, p in reg.profiles.items()
        },
    }


__all__ = ["Dataset", "Model", "Profile", "Script", "generate", "render_all", "render_script"]


def quantpatch_command() -> str:
    """The quantpatch executable a script should call back: this very installation."""
    explicit = os.environ.get("QUANTPATCH")
    if explicit:
        return explicit
    sibling = Path(sys.executable).with_name("quantpatch")
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    found = shutil.which("quantpatch")
    if found is None:
        raise UserError("cannot find the quantpatch executable; set QUANTPATCH to its path.")
    return found


def launch(root: Path, script: Script, *, dry_run: bool) -> int:
    """Run one combination's script from ``root`` (its text is kept under the state directory
    for the record); with ``dry_run`` the script prints the exact command instead. A model
    the checkout cannot build yet is refused before anything starts, with the sentence."""
    from quantpatch.git import repo as gitrepo

    if script.blocked is not None:
        raise UserError(script.blocked)

    checkout = gitrepo.find_checkout(root, need_git=True)
    exe = quantpatch_command()  # refused before the script is kept
    path = checkout.state_dir / "scripts" / script.rel
    apply_edits(path.parent, [Edit(path.name, read_exact(path), script.text, 0o755)])
    env = {**os.environ, "MEGATRON_ROOT": str(checkout.root), "QUANTPATCH": exe}
    if dry_run:
        env["QUANTPATCH_DRY_RUN"] = "1"
    return subprocess.run(["bash", str(path)], env=env, check=False).returncode
