"""Where a Megatron-LM checkout keeps its release and its training arguments, and the record
read from them: shared by the reader (``megatron_args``, libcst) and its cache
(``megatron_release``, which imports the reader only on a miss), so neither imports the other's
module for a name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ARGUMENTS = "megatron/training/arguments.py"
PACKAGE_INFO = "megatron/core/package_info.py"


@dataclass(frozen=True)
class CheckoutRelease:
    """What a checkout's own training argument parser accepts."""

    root: Path
    version: str | None
    """``0.15.0rc3`` from ``megatron/core/package_info.py``; ``None`` when it does not say."""
    flags: frozenset[str]
    files: tuple[str, ...]
    """The files flags were read from, relative to ``root``; ``arguments.py`` first."""
    unresolved: tuple[str, ...]
    """Dataclasses handed to ``ArgumentGroupFactory`` that are not in the checkout (their
    flags are unknown)."""
    inputs: tuple[tuple[str, str | None], ...]
    """Every file the reading looked at and the SHA-256 of its text (``None``: absent)."""

    @property
    def name(self) -> str:
        return self.version or "(version unknown)"
