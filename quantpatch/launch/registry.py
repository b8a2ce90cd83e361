"""The registries: models, datasets, run profiles and schemes, as data files shipped in the
package (``quantpatch/data/*.toml``), extended or overridden by a user's ``--config`` file.

A user file holds any of ``[models.X]``, ``[datasets.X]``, ``[profiles.X]``, ``[schemes.X]``
(and ``[common.args]``). An entry that exists is updated field by field (``args`` key by key);
a new entry must be complete. Every problem names the file, the entry and the field.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from quantpatch.base.config import (
    GEMMS,
    KEYS,
    linear_text,
    per_gemm,
    validate_bf16_layers,
    validate_value,
)
from quantpatch.base.errors import UserError

ArgValue = bool | int | float | str | list[int | float | str]
DEFAULT_RELEASE = "core_v0.13.1"


def _recipe_flags() -> dict[str, tuple[str, str]]:
    """value -> (``--fp8-format``, ``--fp8-recipe``) for every value the format spec says
    emulates a Megatron recipe (its ``megatron`` flags)."""
    from quantpatch.base.values import VALUES

    out: dict[str, tuple[str, str]] = {}
    for v in VALUES:
        words = (v["megatron"] or "").split()
        flags = dict(zip(words[::2], words[1::2], strict=False))
        if "--fp8-format" in flags:
            out[v["name"]] = (flags["--fp8-format"], flags.get("--fp8-recipe", "delayed"))
    return out


RECIPE_FLAGS: dict[str, tuple[str, str]] = _recipe_flags()
"""The values that compute what a Megatron recipe computes: ``--fp8-format``, ``--fp8-recipe``
(core_v0.13.1 ``fp8_utils.get_fp8_context``: TransformerEngine's DelayedScaling,
Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling in that format), from the
format spec's ``megatron`` flags."""
HONOURS_NO_FP8_WGRAD = ("delayed",)
"""The recipes Megatron hands ``--no-fp8-wgrad`` to (core_v0.13.1 passes
``override_linear_precision`` to ``TEDelayedScaling`` only)."""


@dataclass(frozen=True)
class Scheme:
    name: str
    linear: str
    qk: str
    pv: str
    default: bool = True
    """Whether a run with no ``--schemes`` takes it (``all`` takes every scheme)."""
    fprop: str | None = None
    dgrad: str | None = None
    wgrad: str | None = None
    """A linear GEMM's own value where it differs from ``linear`` (TOML keys beside it)."""
    bf16_layers: str = ""
    """The BF16 layer policy (``first:2,last:8``, ``recipe``; '' none): ``set --bf16-layers``."""
    te_recipe: bool = False
    """Quantize exactly the GEMMs Megatron + TransformerEngine quantize under the recipe its
    value emulates (``RECIPE_FLAGS``): the transformer layers' linear GEMMs, the output layer
    in BF16 (``output`` joins the policy), and the two fields below."""
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    """Megatron's ``--first-last-layers-bf16`` and its two counts (``te_recipe`` only)."""
    fp8_wgrad: bool = True
    """False: Megatron's ``--no-fp8-wgrad`` (the weight-gradient GEMM in BF16; honoured by
    the delayed recipe only, so refused elsewhere)."""
    args: tuple[str, ...] = ()
    """The scheme's own pretrain_gpt.py arguments, after the profile's in every run's argv."""
    native: bool = False
    """Run TransformerEngine's own recipe (``--transformer-impl transformer_engine``) with
    every site in BF16, instead of quantpatch's emulation in the local layers."""
    emulates: str | None = None
    """A native scheme: the emulated scheme it is the twin of (its Megatron flags join the
    argv, and the report pairs the two)."""
    emulated_flags: tuple[str, ...] = ()
    """A native scheme: the Megatron flags of the scheme it ``emulates``."""

    def values(self) -> dict[str, str]:
        """Every value the scheme sets, in their one form: ``linear`` where its three GEMMs
        agree, else the three GEMMs (``per_gemm``)."""
        named = {"linear": self.linear, "qk": self.qk, "pv": self.pv}
        named.update({g: v for g, v in zip(GEMMS, self.gemms(), strict=True) if v is not None})
        if not self.fp8_wgrad:
            named["wgrad"] = "bf16"
        policy = self.policy()
        if policy:
            named["bf16_layers"] = policy
        return per_gemm(named)

    def policy(self) -> str:
        """The BF16 layer policy: ``bf16_layers``, and under ``te_recipe`` Megatron's BF16
        layers (``first:N,last:M``) and the output layer."""
        items = [p for p in self.bf16_layers.split(",") if p]
        if self.te_recipe:
            if self.first_last_layers_bf16:
                items += [
                    f"first:{self.num_layers_at_start_in_bf16}",
                    f"last:{self.num_layers_at_end_in_bf16}",
                ]
            items.append("output")
        return ",".join(dict.fromkeys(items))

    def megatron_flags(self) -> list[str]:
        """The Megatron flags whose TransformerEngine run this scheme emulates (``te_recipe``),
        else none."""
        if not self.te_recipe:
            return []
        fmt, recipe = RECIPE_FLAGS[self.linear]
        out = ["--fp8-format", fmt, "--fp8-recipe", recipe]
        if self.first_last_layers_bf16:
            out += [
                "--first-last-layers-bf16",
                "--num-layers-at-start-in-bf16",
                str(self.num_layers_at_start_in_bf16),
                "--num-layers-at-end-in-bf16",
                str(self.num_layers_at_end_in_bf16),
            ]
        if not self.fp8_wgrad:
            out.append("--no-fp8-wgrad")
        return out

    def transformer_impl(self) -> str | None:
        """The ``--transformer-impl`` the scheme's own argv gives (the last one), or None."""
        argv, found = self.argv(), None
        for i, word in enumerate(argv):
            if word == "--transformer-impl" and i + 1 < len(argv):
                found = argv[i + 1]
            elif word.startswith("--transformer-impl="):
                found = word.split("=", 1)[1]
        return found

    def argv(self) -> list[str]:
        """The scheme's own pretrain_gpt.py arguments: a native scheme's
        ``--transformer-impl transformer_engine`` (unless its args choose the implementation)
        and its twin's Megatron flags, then ``args``."""
        if not self.native:
            return list(self.args)
        chosen = any(a.split("=", 1)[0] == "--transformer-impl" for a in self.args)
        impl = [] if chosen else ["--transformer-impl", "transformer_engine"]
        return [*impl, *self.emulated_flags, *self.args]

    def gemms(self) -> tuple[str | None, str | None, str | None]:
        return self.fprop, self.dgrad, self.wgrad

    @property
    def linear_text(self) -> str:
        """The linear value for a person: ``linear``'s, or ``fprop:X,dgrad:Y,wgrad:Z``."""
        return linear_text(self.values(), ":", ",")

    def set_options(self) -> list[str]:
        """The options of ``quantpatch set`` / ``worktree`` that hold these values."""
        return [arg for k, v in self.values().items() for arg in (f"--{k.replace('_', '-')}", v)]

    def expect(self) -> str:
        """``check --expect``'s argument for these values."""
        return ",".join(f"{k}={v}" for k, v in self.values().items())


@dataclass(frozen=True)
class Model:
    name: str
    description: str
    tokenizer_type: str
    tokenizer_model: str
    vocab_size: int
    args: dict[str, ArgValue]
    profile_args: dict[str, dict[str, ArgValue]] = field(default_factory=dict)


@dataclass(frozen=True)
class Dataset:
    name: str
    description: str
    prefix: str
    split: str


PARALLEL_FIELDS: dict[str, type] = {
    "nodes": int,
    "tp": int,
    "pp": int,
    "cp": int,
    "ep": int,
    "etp": int,
    "vpp": int,
    "sequence_parallel": str,
}
"""A profile's ``parallel`` table: the layout its scripts default to (environment overrides)."""


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    gpus_per_node: int
    mock_data: bool
    args: dict[str, ArgValue]
    parallel: dict[str, int | str] = field(default_factory=dict)


@dataclass(frozen=True)
class Slurm:
    """``[slurm]``: what every sbatch script asks the scheduler for. Unset fields are left to
    sbatch (and its ``SBATCH_PARTITION``/``SBATCH_ACCOUNT``/``SBATCH_TIMELIMIT`` variables)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    throttle: int = 8
    """At most this many array tasks of a sweep run at once (``%N``)."""
    gpu_request: str = "gpus-per-node"
    """How the scripts ask for GPUs: ``gpus-per-node`` (``--gpus-per-node=N``), ``gres``
    (``--gres=gpu:N``, for clusters without GPU types configured for ``--gpus``) or ``none``
    (a CPU partition, or GPUs that come with the node)."""
    cpus_per_task: int | None = None
    """``--cpus-per-task`` of each node's one task (its torchrun and every GPU worker); None:
    what the run needs, ``cpus_for`` (one a GPU worker plus its data-loader workers)."""


@dataclass(frozen=True)
class Registry:
    models: dict[str, Model]
    datasets: dict[str, Dataset]
    profiles: dict[str, Profile]
    schemes: dict[str, Scheme]
    common_args: dict[str, ArgValue]
    slurm: Slurm = field(default_factory=Slurm)

    def pick(self, kind: str, names: list[str] | None) -> list[str]:
        """Validate a user's selection: every entry for ``all`` (but the native schemes, which
        need TransformerEngine: those by name); when ``names`` is empty every entry too, but
        for schemes only the default ones (``default = false`` leaves a scheme to ``all`` or
        its name)."""
        table: dict[str, Any] = getattr(self, kind)
        if names == ["all"] and "all" not in table:
            if kind == "schemes":  # native schemes need TransformerEngine: by name only
                return [n for n, s in self.schemes.items() if not s.native]
            return list(table)
        if not names:
            if kind == "schemes":
                return [n for n, s in self.schemes.items() if s.default]
            return list(table)
        unknown = [n for n in names if n not in table]
        if unknown:
            raise UserError(
                f"unknown {kind[:-1]} {', '.join(repr(u) for u in unknown)}; "
                f"valid: {', '.join(table)}{own_entry_hint(kind, unknown[0])}."
            )
        return names


_OWN_ENTRY = {
    "datasets": 'description, prefix (e.g. "{data_root}/NAME/{model}_text_document", where '
    "data prepare writes it), split (Megatron's --split train,valid,test weights, e.g. "
    '"949,50,1")',
    "models": "description, tokenizer_type, tokenizer_model, vocab_size, [models.NAME.args]",
    "schemes": "linear, qk, pv",
}


def own_entry_hint(kind: str, name: str) -> str:
    """How to add an entry of one's own: the config table and its fields (docs/commands.md)."""
    fields = _OWN_ENTRY.get(kind)
    if fields is None:
        return ""
    return (
        f"; one of your own is a [{kind}.{name}] table in a TOML file given with --config, "
        f"with {fields.replace('NAME', name)} (docs/commands.md, Configuration)"
    )


_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "models": {
        "description": str,
        "tokenizer_type": str,
        "tokenizer_model": str,
        "vocab_size": int,
        "args": dict,
        "profiles": dict,
    },
    "datasets": {"description": str, "prefix": str, "split": str},
    "profiles": {
        "description": str,
        "gpus_per_node": int,
        "mock_data": bool,
        "args": dict,
        "parallel": dict,
    },
    "schemes": {
        "linear": str,
        "qk": str,
        "pv": str,
        "default": bool,
        "fprop": str,
        "dgrad": str,
        "wgrad": str,
        "bf16_layers": str,
        "te_recipe": bool,
        "first_last_layers_bf16": bool,
        "num_layers_at_start_in_bf16": int,
        "num_layers_at_end_in_bf16": int,
        "fp8_wgrad": bool,
        "args": list,
        "native": bool,
        "emulates": str,
    },
}
_OPTIONAL = {
    "models": {"profiles"},
    "profiles": {"parallel"},
    "schemes": {
        "default",
        "fprop",
        "dgrad",
        "wgrad",
        "bf16_layers",
        "te_recipe",
        "first_last_layers_bf16",
        "num_layers_at_start_in_bf16",
        "num_layers_at_end_in_bf16",
        "fp8_wgrad",
        "args",
        "native",
        "emulates",
    },
}
SLURM_FIELDS: dict[str, type] = {
    "partition": str,
    "account": str,
    "qos": str,
    "time": str,
    "throttle": int,
    "gpu_request": str,
    "cpus_per_task": int,
}
GPU_REQUESTS = ("gpus-per-node", "gres", "none")
SLURM_VALUE_RE = re.compile(r"[A-Za-z0-9_.:,+-]{1,128}")
"""An ``#SBATCH`` value: sbatch reads directives without a shell, so no space or quote."""


def _check_parallel(table: Any, where: str) -> dict[str, int | str]:
    if not isinstance(table, dict):
        raise UserError(f"{where}: 'parallel' must be a table of size = value.")
    for key, value in table.items():
        want = PARALLEL_FIELDS.get(key)
        if want is None:
            raise UserError(
                f"{where}: parallel.{key} is unknown (known: {', '.join(PARALLEL_FIELDS)})."
            )
        if want is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"{where}: parallel.{key} must be a positive integer.")
        if want is str and value not in ("auto", "on", "off"):
            raise UserError(f"{where}: parallel.{key} must be auto, on or off.")
    return dict(table)


def _check_slurm(table: Any, where: str, old: Slurm) -> Slurm:
    if not isinstance(table, dict):
        raise UserError(f"{where}: [slurm] must be a table.")
    values: dict[str, Any] = {}
    for key, value in table.items():
        want = SLURM_FIELDS.get(key)
        if want is None:
            raise UserError(f"{where}: slurm.{key} is unknown (known: {', '.join(SLURM_FIELDS)}).")
        if want is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{where}: slurm.{key} must be a positive integer.")
        elif not isinstance(value, str) or not SLURM_VALUE_RE.fullmatch(value):
            raise UserError(
                f"{where}: slurm.{key} must be one word of letters, digits and '_.:,+-' "
                "(it becomes an #SBATCH line)."
            )
        if key == "gpu_request" and value not in GPU_REQUESTS:
            raise UserError(
                f"{where}: slurm.gpu_request must be one of {', '.join(GPU_REQUESTS)} "
                f"(got {value!r})."
            )
        values[key] = value
    return replace(old, **values)


def _check_args(args: Any, where: str) -> dict[str, ArgValue]:
    if not isinstance(args, dict):
        raise UserError(f"{where}: 'args' must be a table of flag = value.")
    for key, value in args.items():
        ok = isinstance(value, (bool, int, float, str)) or (
            isinstance(value, list)
            and all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value)
        )
        if key.startswith("-") or not ok:
            raise UserError(
                f"{where}: args.{key} must be a flag name without dashes and a bool, number, "
                "string or list of them."
            )
    return dict(args)


def _check_words(words: Any, where: str) -> list[str]:
    """A scheme's ``args``: pretrain_gpt.py's words as its argv gets them."""
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise UserError(
            f"{where}: args must be a list of pretrain_gpt.py's words, e.g. "
            '["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"].'
        )
    bad = [w for w in words if "\n" in w or "\0" in w]
    if bad:
        raise UserError(f"{where}: args word {bad[0]!r} holds a newline or NUL.")
    return list(words)


def _check_scheme(name: str, e: dict[str, Any], where: str, names: set[str]) -> None:
    """The recipe and native fields of scheme ``name``: what Megatron can run, or one
    sentence."""
    recipe_only = [
        f
        for f in (
            "first_last_layers_bf16",
            "num_layers_at_start_in_bf16",
            "num_layers_at_end_in_bf16",
            "fp8_wgrad",
        )
        if f in e
    ]
    if recipe_only and not e.get("te_recipe"):
        linear = e.get("linear")
        # te_recipe takes one recipe value on every linear GEMM and BF16 attention (below)
        takes_recipe = (
            linear in RECIPE_FLAGS
            and all(e.get(g, linear) == linear for g in GEMMS if g != "wgrad")
            and (e.get("qk"), e.get("pv")) == ("bf16", "bf16")
        )
        add = (
            "add te_recipe = true (its GEMMs then follow Megatron's policy) or "
            if takes_recipe
            else ""
        )
        raise UserError(
            f"{where}: scheme '{name}' sets {recipe_only[0]}, a field of Megatron's FP8 recipes; "
            f"{add}drop {', '.join(recipe_only)}."
        )
    for count in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        if e.get(count, 1) < 0:
            raise UserError(f"{where}: scheme '{name}': {count} must be 0 or more.")
    if e.get("te_recipe"):
        _check_recipe(name, e, where)
    _check_native(name, e, where, names)


def _check_recipe(name: str, e: dict[str, Any], where: str) -> None:
    """A ``te_recipe`` scheme: one value of a Megatron recipe on every linear GEMM, BF16
    attention, and recipe fields the recipe honours."""
    gemms = {e.get(g, e["linear"]) for g in GEMMS if g != "wgrad" or e.get("fp8_wgrad", True)}
    linear = e["linear"]
    attention = (e["qk"], e["pv"])
    if linear not in RECIPE_FLAGS or gemms != {linear} or attention != ("bf16", "bf16"):
        raise UserError(
            f"{where}: scheme '{name}' has te_recipe = true, which needs one value of a "
            f"Megatron recipe ({', '.join(RECIPE_FLAGS)}) on every linear GEMM and qk = pv "
            '= "bf16" (Megatron keeps the attention core in BF16).'
        )
    recipe = RECIPE_FLAGS[linear][1]
    if recipe == "delayed" and e.get("first_last_layers_bf16"):
        raise UserError(
            f"{where}: scheme '{name}' sets first_last_layers_bf16 with the delayed "
            "recipe, which Megatron refuses (fp8_utils.get_fp8_context: delayed scaling "
            "does not support first / last layers in BF16); drop first_last_layers_bf16."
        )
    if e.get("fp8_wgrad") is False and recipe not in HONOURS_NO_FP8_WGRAD:
        honour = [v for v, (_, r) in RECIPE_FLAGS.items() if r in HONOURS_NO_FP8_WGRAD]
        raise UserError(
            f"{where}: scheme '{name}' sets fp8_wgrad = false, but Megatron hands "
            f"--no-fp8-wgrad to its {' and '.join(HONOURS_NO_FP8_WGRAD)} recipe only and "
            f"runs --fp8-recipe {recipe} with an FP8 weight gradient; drop fp8_wgrad, or "
            f"take a value of that recipe ({' or '.join(honour)}: the schemes "
            "te_delayed_hybrid and te_delayed_e4m3), whose schemes honour it."
        )


def _check_native(name: str, e: dict[str, Any], where: str, names: set[str]) -> None:
    """A native scheme (TransformerEngine's own layers) sets no site, and only it names the
    twin it ``emulates``."""
    if e.get("native"):
        sites = {r: e[r] for r in ("linear", "qk", "pv", *GEMMS) if r in e and e[r] != "bf16"}
        if sites or e.get("bf16_layers") or e.get("te_recipe"):
            keys = [*sites, *(k for k in ("bf16_layers", "te_recipe") if e.get(k))]
            # without native the scheme is one of quantpatch values: those three it needs
            plain = all(k in e for k in ("linear", "qk", "pv")) and "emulates" not in e
            raise UserError(
                f"{where}: scheme '{name}' is native (TransformerEngine's own layers), where no "
                f"site runs; leave out {', '.join(keys)}{', or drop native' if plain else ''}."
            )
    twin = e.get("emulates")
    if twin is not None and not e.get("native"):
        raise UserError(f"{where}: scheme '{name}': emulates names a twin for native schemes only.")
    if twin is not None and twin not in names:
        raise UserError(
            f"{where}: scheme '{name}' emulates '{twin}', which is no scheme; valid: "
            f"{', '.join(sorted(names))}."
        )


def _merge(
    kind: str, name: str, old: dict[str, Any] | None, new: Any, where: str
) -> dict[str, Any]:
    if not isinstance(new, dict):
        raise UserError(f"{where}: {kind}.{name} must be a table.")
    fields = _FIELDS[kind]
    _check_types(kind, name, new, where)
    merged = _combined(kind, name, dict(old or {}), new, where)
    missing = [f for f in fields if f not in merged and f not in _OPTIONAL.get(kind, set())]
    if missing:
        raise UserError(f"{where}: {kind}.{name} is missing field '{missing[0]}'.")
    if "args" in merged and kind != "schemes":
        merged["args"] = _check_args(merged["args"], f"{where}: {kind}.{name}")
    if "parallel" in merged:
        merged["parallel"] = _check_parallel(merged["parallel"], f"{where}: {kind}.{name}")
    return merged


def _check_types(kind: str, name: str, new: dict[str, Any], where: str) -> None:
    """Each field of an entry known and of its type, or one sentence."""
    fields = _FIELDS[kind]
    for key, value in new.items():
        if key not in fields:
            raise UserError(
                f"{where}: {kind}.{name} has unknown field '{key}' (known: {', '.join(fields)})."
            )
        want = fields[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            expected = (
                want.__name__ if isinstance(want, type) else "/".join(t.__name__ for t in want)
            )
            raise UserError(
                f"{where}: {kind}.{name}.{key} has the wrong type (expected {expected}, got "
                f"{type(value).__name__})."
            )


def _combined(
    kind: str, name: str, merged: dict[str, Any], new: dict[str, Any], where: str
) -> dict[str, Any]:
    """An entry's fields over the earlier definition's (``args``, ``parallel`` and a
    profile's overrides merged key by key)."""
    if kind == "schemes" and new.get("native") is True:  # no site runs: every role bf16
        for role in ("linear", "qk", "pv"):
            merged.setdefault(role, "bf16")
    for key, value in new.items():
        if kind == "schemes" and key == "args":
            merged[key] = _check_words(value, f"{where}: {kind}.{name}")
        elif key in ("args", "parallel") and key in merged:
            merged[key] = {**merged[key], **value}
        elif key == "profiles" and key in merged:
            merged[key] = {
                p: {**merged[key].get(p, {}), **v} for p, v in {**merged[key], **value}.items()
            }
        else:
            merged[key] = value
    return merged


NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""Model, dataset, profile and scheme names: they become paths and lines of shell scripts,
so no '/', '..', whitespace, newline or quote can get in."""


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path}: config file not found.")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML ({exc}).") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text.") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to be a quantpatch config.") from None


def _package_data(name: str) -> dict[str, Any]:
    return tomllib.loads(resources.files("quantpatch").joinpath(f"data/{name}").read_text("utf-8"))


def load_registry(extra: Path | None = None) -> Registry:
    raw: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in _FIELDS}
    common: dict[str, Any] = {}
    slurm = Slurm()
    sources = [
        (f"{n}.toml", _package_data(f"{n}.toml"))
        for n in ("models", "datasets", "profiles", "schemes")
    ]
    if extra is not None:
        sources.append((str(extra), _read_toml(extra)))
    for where, data in sources:
        for top, table in data.items():
            if top == "common":
                common = {**common, **_check_args(table.get("args", {}), f"{where}: common")}
                continue
            if top == "slurm":
                slurm = _check_slurm(table, where, slurm)
                continue
            if top not in raw or not isinstance(table, dict):
                raise UserError(
                    f"{where}: unknown table '{top}' "
                    f"(known: {', '.join([*raw, 'common', 'slurm'])})."
                )
            for name, entry in table.items():
                if not isinstance(name, str) or not NAME_RE.fullmatch(name):
                    raise UserError(
                        f"{where}: {top} name {name!r} is not an identifier (letters, digits "
                        "and '_.-', starting with a letter or digit, at most 64): names become "
                        "file names and script lines."
                    )
                raw[top][name] = _merge(top, name, raw[top].get(name), entry, where)
    schemes = {}
    where = str(extra) if extra is not None else "schemes.toml"
    for name, e in raw["schemes"].items():
        for role in KEYS:
            if role in e:
                kind = "linear" if role in GEMMS else role
                validate_value(e[role], allow_unknown=False, where=f"scheme '{name}'", role=kind)
        _check_scheme(name, e, where, set(raw["schemes"]))
        schemes[name] = Scheme(
            name,
            e["linear"],
            e["qk"],
            e["pv"],
            e.get("default", True),
            fprop=e.get("fprop"),
            dgrad=e.get("dgrad"),
            wgrad=e.get("wgrad"),
            bf16_layers=validate_bf16_layers(e.get("bf16_layers", ""), f"scheme '{name}'"),
            te_recipe=e.get("te_recipe", False),
            first_last_layers_bf16=e.get("first_last_layers_bf16", False),
            num_layers_at_start_in_bf16=e.get("num_layers_at_start_in_bf16", 1),
            num_layers_at_end_in_bf16=e.get("num_layers_at_end_in_bf16", 1),
            fp8_wgrad=e.get("fp8_wgrad", True),
            args=tuple(e.get("args", ())),
            native=e.get("native", False),
            emulates=e.get("emulates"),
        )
    for name, s in schemes.items():
        if s.emulates is not None:
            schemes[name] = replace(s, emulated_flags=tuple(schemes[s.emulates].megatron_flags()))
    models = {}
    for name, e in raw["models"].items():
        prof = {
            p: _check_args(v.get("args", {}), f"models.{name}.profiles.{p}")
            for p, v in e.get("profiles", {}).items()
        }
        models[name] = Model(
            name,
            e["description"],
            e["tokenizer_type"],
            e["tokenizer_model"],
            e["vocab_size"],
            e["args"],
            prof,
        )
    return Registry(
        models=models,
        datasets={
            n: Dataset(n, e["description"], e["prefix"], e["split"])
            for n, e in raw["datasets"].items()
        },
        profiles={
            n: Profile(
                n,
                e["description"],
                e["gpus_per_node"],
                e["mock_data"],
                e["args"],
                e.get("parallel", {}),
            )
            for n, e in raw["profiles"].items()
        },
        schemes=schemes,
        common_args=common,
        slurm=slurm,
    )


def twin_pairs(schemes: dict[str, Scheme], ran: list[str]) -> list[tuple[str, str]]:
    """(emulated, native) for each native scheme in ``ran`` whose twin is in it too (the
    report's pairs)."""
    return [
        (s.emulates, s.name)
        for name in dict.fromkeys(ran)
        if (s := schemes.get(name)) is not None and s.native and s.emulates in ran
    ]


FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""core_v0.13.1's ``--fp8-recipe`` choices (``fp8_utils.get_fp8_recipe``), each taken with
``--fp8-format e4m3`` or ``hybrid``."""


def recipe_table(reg: Registry) -> str:
    """Every (``--fp8-format``, ``--fp8-recipe``) pair: the value that emulates it, the
    ``te_recipe`` scheme and its native twin, as docs/formats.md and docs/launch.md show them
    (a test keeps the three equal)."""
    lines = [
        "| `--fp8-format` | `--fp8-recipe` | value | scheme (emulation) | native twin |",
        "| --- | --- | --- | --- | --- |",
    ]
    for recipe in FP8_RECIPES:
        for fmt in ("e4m3", "hybrid"):
            value = next((v for v, f in RECIPE_FLAGS.items() if f == (fmt, recipe)), None)
            scheme = next(
                (n for n, s in reg.schemes.items() if s.te_recipe and s.linear == value), None
            )
            twin = next(
                (n for n, s in reg.schemes.items() if s.native and s.emulates == scheme), None
            )
            cells = [fmt, recipe, value, scheme, twin]
            lines.append("| " + " | ".join(f"`{c}`" if c else "-" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def releases() -> list[str]:
    folder = resources.files("quantpatch").joinpath("data/megatron")
    return sorted(
        p.name[len("pretrain-flags-") : -len(".txt")]
        for p in folder.iterdir()
        if p.name.startswith("pretrain-flags-")
    )


@cache
def release_flags(release: str) -> frozenset[str]:
    """Every ``--flag`` that Megatron-LM's training argument parser accepts at ``release``."""
    if release not in releases():
        raise UserError(
            f"--megatron-release: unknown release '{release}'; known: {', '.join(releases())}."
        )
    text = (
        resources.files("quantpatch")
        .joinpath(f"data/megatron/pretrain-flags-{release}.txt")
        .read_text("utf-8")
    )
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


def scheme_values(name: str, extra: Path | None = None) -> dict[str, str]:
    """The values of the scheme ``name`` (``set --scheme``), refused in one sentence where no
    scheme has that name."""
    schemes = load_registry(extra).schemes
    if name not in schemes:
        raise UserError(f"--scheme: unknown scheme '{name}'; valid: {', '.join(schemes)}.")
    return dict(schemes[name].values())
