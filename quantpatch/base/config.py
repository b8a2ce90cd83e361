"""Configuration: quant types, roles, the scheme registry and the checkout's target paths.

Standard library only, so that every other module (and CLI start-up) can import it cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantpatch.base.errors import UserError
from quantpatch.runtime import quantpatch_formats as formats

PARETOQ_TYPES: tuple[str, ...] = formats.names(family="paretoq")
"""ParetoQ's extremely low-bit weights (binary, ternary, 2, 3, 4 bits, a learnable step per
output row), linear role only; each also takes a group suffix ``g<N>`` (``w2g128``: one step
per row and 128 input columns)."""

QUANT_TYPES: tuple[str, ...] = formats.VALUES
"""Values a site may hold, one entry each in the format spec
(:mod:`quantpatch.runtime.quantpatch_formats`, standard library only); bf16 is the
unquantized PyTorch path. The table of every value: :mod:`quantpatch.base.values`. Besides
these, the grouped ParetoQ values ``w<b>g<N>`` (:func:`is_known_value`)."""


def is_paretoq(value: str) -> bool:
    """A ParetoQ weight value, grouped or not."""
    return formats.base_of(value) in PARETOQ_TYPES


def is_known_value(value: str) -> bool:
    return formats.base_of(value) in QUANT_TYPES


ROLES: tuple[str, ...] = ("linear", "qk", "pv")
"""The three GEMM families a checkout's sites govern."""

GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
"""The three GEMMs of a linear layer (forward, input gradient, weight gradient): each may take
its own value (``set --fprop X --dgrad Y --wgrad Z``); ``linear`` names all three."""

KEYS: tuple[str, ...] = (*ROLES, *GEMMS)
"""Everything a value can be given for: the roles and the linear role's GEMMs."""


def per_gemm(values: dict[str, str]) -> dict[str, str]:
    """``values`` (roles and GEMMs) in their one form: ``linear`` where the three GEMMs agree,
    else the three GEMMs (each filled from ``linear`` where it is not named), never both."""
    if not any(g in values for g in GEMMS):
        return dict(values)
    out = {k: v for k, v in values.items() if k not in GEMMS and k != "linear"}
    linear = values.get("linear")
    gemms = {g: values.get(g, linear) for g in GEMMS}
    if None in gemms.values():
        missing = [g for g, v in gemms.items() if v is None]
        raise UserError(
            f"--{missing[0]}: give the value of every linear GEMM (or --linear for the "
            "ones not named), since the checkout's linear sites disagree or are missing."
        )
    delayed = sorted({v for v in gemms.values() if v in DELAYED_TYPES})
    if delayed and (
        gemms["fprop"] != delayed[0]
        or gemms["dgrad"] != delayed[0]
        or gemms["wgrad"] not in (delayed[0], "bf16")
    ):
        raise UserError(
            f"'{delayed[0]}' keeps one amax history for a layer's three GEMMs (the weight "
            f"gradient uses the input gradient's scale), so give it with --linear {delayed[0]} "
            "(and --wgrad bf16 for Megatron's --no-fp8-wgrad)."
        )
    if len(set(gemms.values())) == 1:
        out["linear"] = next(iter(gemms.values()))  # type: ignore[assignment]
    else:
        out.update(gemms)  # type: ignore[arg-type]
    order = ("linear", *GEMMS, "qk", "pv")
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9))


def linear_text(values: Mapping[str, str | None], sep: str = ".", join: str = "+") -> str:
    """The linear value for a name or a message: ``linear``'s where the GEMMs agree, else
    ``fprop.X+dgrad.Y+wgrad.Z`` (each GEMM and its value)."""
    if all(values.get(g) is None for g in GEMMS) or (
        values.get("linear") is not None
        and all(values.get(g) in (None, values["linear"]) for g in GEMMS)
    ):
        return str(values.get("linear"))
    return join.join(f"{g}{sep}{values.get(g)}" for g in GEMMS)


_BF16_LAYERS_ITEM = re.compile(r"(first|last):[0-9]+|[1-9][0-9]*(-[1-9][0-9]*)?|recipe|output")


def validate_bf16_layers(spec: str, where: str = "--bf16-layers") -> str:
    """A BF16 layer policy: comma-separated ``first:N``, ``last:N``, Megatron layer numbers
    ``K`` or ranges ``A-B``, ``recipe`` (NVIDIA's proportion, scaled per model), or ``output``
    (the GEMMs outside every transformer layer: the output layer); ``none`` (or empty) for no
    policy, returned as ''. Anything else is refused."""
    spec = spec.replace(" ", "")
    if spec in ("", "none"):
        return ""
    for part in spec.split(","):
        if not _BF16_LAYERS_ITEM.fullmatch(part):
            raise UserError(
                f"{where}: '{part}' is not first:N, last:N, a layer number K, a range A-B, "
                "recipe or output (e.g. first:2,last:8,output or 1,2,25-32)."
            )
        lo, _, hi = part.partition("-")
        if hi and lo.isdigit() and int(hi) < int(lo):
            raise UserError(f"{where}: the range '{part}' runs backwards.")
    return spec


RECIPE_BF16_LAYERS = (2, 8, 62)
"""NVIDIA's NVFP4 recipe (arXiv 2509.25149): the first 2 and the last 8 of the 12 B model's 62
blocks stay in BF16; ``bf16_layers = recipe`` scales that to each model (the runtime's
``quantpatch_layers.recipe_counts`` computes the same)."""


def recipe_layers(num_layers: int) -> tuple[int, int]:
    """(first, last) BF16 layers of the recipe for ``num_layers``: 2 / 62 and 8 / 62 of the
    model rounded half up, at least one each, never the whole model."""
    first_n, last_n, of = RECIPE_BF16_LAYERS
    first = max(1, int(first_n * num_layers / of + 0.5))
    last = max(1, int(last_n * num_layers / of + 0.5))
    while first + last >= num_layers and last > 1:
        last -= 1
    return first, last


def bf16_layer_numbers(spec: str, num_layers: int) -> list[int]:
    """The layer numbers (1-based) a BF16 layer policy keeps in BF16 in a model of
    ``num_layers`` (as the runtime's ``quantpatch_layers.resolve`` does; numbers beyond the
    model dropped); ``spec`` as ``validate_bf16_layers`` returns it."""
    out: set[int] = set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        if part == "output":
            continue  # the GEMMs outside every transformer layer: no layer number
        if part == "recipe":
            first, last = recipe_layers(num_layers)
            out |= set(range(1, first + 1)) | set(range(num_layers - last + 1, num_layers + 1))
        elif part.startswith("first:"):
            out |= set(range(1, int(part[6:]) + 1))
        elif part.startswith("last:"):
            out |= set(range(max(1, num_layers - int(part[5:]) + 1), num_layers + 1))
        else:
            lo, _, hi = part.partition("-")
            out |= set(range(int(lo), int(hi or lo) + 1))
    return sorted(n for n in out if 1 <= n <= num_layers)


def layer_ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


SITE_NAME = "custom_quant_type"
"""The variable whose assignments are sites."""

DEFAULT_LINEAR_FILE = "megatron/core/tensor_parallel/layers.py"
DEFAULT_ATTENTION_FILE = "megatron/core/transformer/dot_product_attention.py"

# A value is written into a string literal: keep it to characters that need no escaping.
_VALUE_RE = re.compile(r"[A-Za-z0-9_.+-]+")


DEFAULT_BRANCH_PREFIX = "quantpatch"
"""Scheme branches are ``<prefix>/linear-X_qk-Y_pv-Z``. Not ``quant``: forks commonly have a
branch of that name, and git cannot hold both ``quant`` and ``quant/...``."""

LEGACY_BRANCH_PREFIX = "quant"
"""The prefix of scheme branches made by quantpatch 0.1 (still recognised)."""

# One or more path components of letters, digits and '._-', none starting with '.' or '-'
# and none ending in '.lock' (a subset of what git check-ref-format accepts).
_PREFIX_RE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*/)*[A-Za-z0-9_][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class Targets:
    """The files that hold sites, relative to the checkout root (posix separators), and the
    prefix of scheme branches (settings of the same ``[tool.quantpatch]`` table)."""

    linear: tuple[str, ...] = (DEFAULT_LINEAR_FILE,)
    attention: tuple[str, ...] = (DEFAULT_ATTENTION_FILE,)
    branch_prefix: str = DEFAULT_BRANCH_PREFIX
    where: str = ""
    """The file the settings came from (empty: defaults)."""

    @property
    def all_files(self) -> tuple[str, ...]:
        return self.linear + self.attention

    def kind_of(self, rel: str) -> str:
        """``linear`` or ``attention``: which role family a target file holds."""
        return "linear" if rel in self.linear else "attention"


_TARGET_KEYS = {
    "linear": "linear",
    "linear_file": "linear",
    "attention": "attention",
    "attention_file": "attention",
}


def _path_list(raw: Any, where: str, key: str) -> tuple[str, ...]:
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
        raise UserError(f"{where}: '{key}' must be a path or a non-empty list of paths.")
    return tuple(Path(i).as_posix() for i in items)


def load_targets(root: Path) -> Targets:
    """Read ``[tool.quantpatch]`` from ``pyproject.toml`` or ``quantpatch.toml`` at the root.

    ``quantpatch.toml`` wins when both exist. Unknown keys are refused so that a typo does not
    silently fall back to the defaults.
    """
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    table: dict[str, Any] | None = None
    where = ""
    for name in ("quantpatch.toml", "pyproject.toml"):
        path = root / name
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"{path}: not valid TOML ({exc}).") from None
        except RecursionError:
            raise UserError(f"{path}: nested too deeply to be valid configuration.") from None
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text.") from None
        found = data.get("tool", {}).get("quantpatch")
        if found is None and name == "quantpatch.toml":
            found = data  # quantpatch.toml may hold the keys at top level
        if found is not None:
            table, where = found, str(path)
            break
    if table is None:
        return Targets()
    values: dict[str, tuple[str, ...]] = {}
    prefix = DEFAULT_BRANCH_PREFIX
    for key, raw in table.items():
        if key == "branch_prefix":
            prefix = _branch_prefix(raw, where)
            continue
        if key not in _TARGET_KEYS:
            known = sorted([*_TARGET_KEYS, "branch_prefix"])
            raise UserError(
                f"{where}: unknown key '{key}' in the quantpatch table (known: {', '.join(known)})."
            )
        values[_TARGET_KEYS[key]] = _path_list(raw, where, key)
    return Targets(**values, branch_prefix=prefix, where=where)


def _branch_prefix(raw: Any, where: str) -> str:
    if (
        not isinstance(raw, str)
        or not _PREFIX_RE.fullmatch(raw)
        or ".." in raw
        or any(part.endswith(".lock") for part in raw.split("/"))
    ):
        raise UserError(
            f"{where}: branch_prefix {raw!r} is not a branch name prefix "
            "(letters, digits and '._-' in '/'-separated parts)."
        )
    return raw


LINEAR_ONLY: tuple[str, ...] = tuple(
    f.name for f in formats.SPECS if f.roles and "qk" not in f.roles
)
"""Values only the linear role may hold (each says why in the spec: ``linear_only``)."""

DELAYED_TYPES: tuple[str, ...] = formats.names(family="fp8-delayed")
"""Values whose scales come from a linear layer's amax history (TE's delayed scaling): the
layer keeps the state of its three GEMMs together, and attention has none to keep."""


def validate_value(
    value: str, *, allow_unknown: bool, where: str = "value", role: str | None = None
) -> str:
    """Refuse a quant type that is not known (unless allowed), cannot sit in a literal, or
    (given the ``role``) does not belong to that role."""
    spec = formats.SPEC.get(formats.base_of(value))
    if role is not None and spec is not None and spec.roles and role not in spec.roles:
        raise UserError(f"{where}: '{value}' {spec.linear_only.format(role=role)}.")
    if not _VALUE_RE.fullmatch(value):
        raise UserError(
            f"{where}: {value!r} is not a valid quant type name (letters, digits, '_.+-' only)."
        )
    if not is_known_value(value) and not allow_unknown:
        raise UserError(
            f"{where}: unknown quant type '{value}'; valid values are "
            f"{', '.join(QUANT_TYPES)} and w<b>g<N> (--allow-unknown writes it anyway)."
        )
    return value
