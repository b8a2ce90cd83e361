"""Configuration: quant types, roles, the scheme registry and the checkout's target paths.

Standard library only, so that every other module (and CLI start-up) can import it cheaply.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from quantpatch.errors import UserError

QUANT_TYPES: tuple[str, ...] = ("bf16", "mxfp8", "mxfp4", "hifp8")
"""Values a site may hold: bf16 is the unquantized PyTorch path."""

ROLES: tuple[str, ...] = ("linear", "qk", "pv")
"""The three GEMM families a checkout's sites govern."""

SITE_NAME = "custom_quant_type"
"""The variable whose assignments are sites."""

DEFAULT_LINEAR_FILE = "megatron/core/tensor_parallel/layers.py"
DEFAULT_ATTENTION_FILE = "megatron/core/transformer/dot_product_attention.py"

# A value is written into a string literal: keep it to characters that need no escaping.
_VALUE_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class Targets:
    """The files that hold sites, relative to the checkout root (posix separators)."""

    linear: tuple[str, ...] = (DEFAULT_LINEAR_FILE,)
    attention: tuple[str, ...] = (DEFAULT_ATTENTION_FILE,)

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
        found = data.get("tool", {}).get("quantpatch")
        if found is None and name == "quantpatch.toml":
            found = data  # quantpatch.toml may hold the keys at top level
        if found is not None:
            table, where = found, str(path)
            break
    if table is None:
        return Targets()
    values: dict[str, tuple[str, ...]] = {}
    for key, raw in table.items():
        if key not in _TARGET_KEYS:
            raise UserError(
                f"{where}: unknown key '{key}' in the quantpatch table "
                f"(known: {', '.join(sorted(_TARGET_KEYS))})."
            )
        values[_TARGET_KEYS[key]] = _path_list(raw, where, key)
    return Targets(**values)


def validate_value(value: str, *, allow_unknown: bool, where: str = "value") -> str:
    """Refuse a quant type that is not known (unless allowed) or cannot sit in a literal."""
    if not _VALUE_RE.match(value):
        raise UserError(
            f"{where}: '{value}' is not a valid quant type name (letters, digits, '_.+-' only)."
        )
    if value not in QUANT_TYPES and not allow_unknown:
        raise UserError(
            f"{where}: unknown quant type '{value}'; valid values are "
            f"{', '.join(QUANT_TYPES)} (--allow-unknown writes it anyway)."
        )
    return value
