"""The site record and role arithmetic, free of libcst so that cached reads stay light."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quantpatch.base.config import ROLES
from quantpatch.base.edits import read_exact
from quantpatch.base.errors import UserError

SITE_ROLES = ("linear", "qk", "pv", "qk+pv", "unknown")


@dataclass(frozen=True)
class Site:
    """One assignment to ``custom_quant_type`` as the user sees it."""

    role: str
    """linear, qk, pv, qk+pv or unknown."""
    file: str
    """Relative to the checkout root, posix separators."""
    line: int
    """1-based line of the assignment."""
    function: str
    """Enclosing ``Class.function`` (``<module>`` at top level)."""
    value: str | None
    """The literal (or the environment default); ``None`` for a dynamic site."""
    form: str
    """literal, env, dynamic or label."""
    kind: str
    """literal, env or dynamic: how the value is written (``form`` says label instead)."""
    governs: tuple[str, ...]
    """The products (qk, pv, linear) of the dispatches this site governs."""
    source: str
    """The assignment's value as written."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The contract roles (linear, qk, pv) this site's value feeds."""
        if self.role == "qk+pv":
            return ("qk", "pv")
        return (self.role,) if self.role in ROLES else ()

    def as_json(self) -> dict[str, object]:
        return {
            "role": self.role,
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "value": self.value,
            "form": self.form,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Site:
        return cls(**{**data, "governs": tuple(data["governs"])})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def role_values(sites: Sequence[Site]) -> tuple[dict[str, str | None], dict[str, list[Site]]]:
    """The value of each role (``None`` when it has no site or its sites disagree), and the
    sites of every role whose sites disagree."""
    values: dict[str, str | None] = {}
    mismatched: dict[str, list[Site]] = {}
    for role in ROLES:
        members = [s for s in sites if role in s.roles and s.kind != "dynamic"]
        distinct = {s.value for s in members}
        if len(distinct) == 1:
            values[role] = distinct.pop()
        else:
            values[role] = None
            if len(distinct) > 1:
                mismatched[role] = members
    return values, mismatched


def read_target(root: Path, rel: str) -> str:
    text = read_exact(root / rel) if (root / rel).is_file() else None
    if text is None:
        raise UserError(f"{rel}: target file not found under {root}.")
    return text


def refuse_links(root: Path, rels: Sequence[str]) -> None:
    """Writing commands edit regular files only: writing through a symbolic link would
    change a file elsewhere, and replacing the link would break it."""
    for rel in rels:
        path = root / rel
        if path.is_symlink():
            raise UserError(
                f"{rel}: is a symbolic link (to {os.readlink(path)}); quantpatch edits regular "
                "files only: point the [tool.quantpatch] paths at the real file."
            )
