"""The saver's settings: every ``TENSOR_SAVE_*`` variable read and checked in one place, the
rank and the source commit recorded with each file, and the training iteration.

``CFG`` is the settings in force; ``reload()`` reads the environment again (the tensor saver's
``configure()``). A variable that cannot be read is reported in one line (name, value, the
accepted syntax) and saving stays off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

_T = TypeVar("_T")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class _Invalid(ValueError):
    """A saver variable that cannot be read; the message is the accepted syntax."""


def _parse_flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise _Invalid("expected true or false (also 1/0, yes/no, on/off)")


def _whole(low: int, high: int | None, syntax: str) -> Callable[[str], int]:
    """A parser of whole numbers from ``low`` to ``high`` (None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            raise _Invalid(syntax)
        return value

    return parse


def _positive(example: str) -> Callable[[str], int]:
    return _whole(1, None, f"expected a positive whole number, e.g. {example}")


_parse_nice = _whole(0, 19, "expected a whole number from 0 (no change) to 19, e.g. 10")


def _parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """``0-1,5`` as ``((0, 1), (5, 5))``: ranges stay ranges, whatever their length."""
    syntax = "expected numbers or low-high ranges separated by commas, e.g. 0-1,100"
    spans = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            low = int(lo)
            high = int(hi) if sep else low
        except ValueError:
            raise _Invalid(syntax) from None
        if low < 0 or high < low:
            raise _Invalid(f"{syntax}, each with low <= high")
        spans.append((low, high))
    if not spans:
        raise _Invalid(syntax)
    return tuple(spans)


def _ranges(text: str | None) -> tuple[tuple[int, int], ...] | None:
    """The selection in ``text`` (``None``: everything); raises ``_Invalid``."""
    return _parse_ranges(text) if text and text.strip() else None


def in_spans(spans: tuple[tuple[int, int], ...], value: int | None) -> bool:
    return value is not None and any(lo <= value <= hi for lo, hi in spans)


def _parse_kinds(text: str) -> frozenset[str]:
    names = frozenset(k.strip() for k in text.split(",") if k.strip())
    if not names or not all(n.isidentifier() for n in names):
        raise _Invalid(
            "expected tensor names separated by commas, e.g. input,grad_output (input, "
            "weight, grad_output, query, key, value, attention_probs)"
        )
    return names


ACCELERATORS = ("stats-kernel", "pickler")
"""The opt-in accelerators (``TENSOR_SAVE_ACCELERATORS``): the one-pass C statistics kernel
(``stats_kernel.py``) and the plain pickler (``pickler.py``). Without them the statistics
come from torch's operators and the files from ``torch.save``."""
NONE: frozenset[str] = frozenset()


def _parse_accelerators(text: str) -> frozenset[str]:
    names = frozenset(n.strip().lower() for n in text.split(",") if n.strip())
    if names == {"all"}:
        return frozenset(ACCELERATORS)
    if names == {"none"}:
        return NONE
    if not names or not names <= set(ACCELERATORS):
        raise _Invalid(
            f"expected all, none, or names separated by commas from {', '.join(ACCELERATORS)}"
        )
    return names


class Config:
    def __init__(self) -> None:
        self.errors: list[str] = []
        self.enabled = self._read("TENSOR_SAVE_ENABLED", _parse_flag, False)
        raw = os.environ.get("TENSOR_SAVE_ENABLED", "").strip().lower()
        self.wanted = bool(raw) and raw not in _FALSE
        self.save_dir = Path(os.environ.get("TENSOR_SAVE_DIR") or "./tensor_logs")
        self.default_quant = os.environ.get("CUSTOM_QUANT_TYPE") or "bf16"
        self.steps = self._read("TENSOR_SAVE_STEPS", _parse_ranges, None)
        self.layers = self._read("TENSOR_SAVE_LAYERS", _parse_ranges, None)
        self.kinds = self._read("TENSOR_SAVE_KINDS", _parse_kinds, None)
        self.max_bytes = self._read("TENSOR_SAVE_MAX_BYTES", _positive("2000000000"), None)
        self.stats_only = self._read("TENSOR_SAVE_STATS_ONLY", _parse_flag, False)
        self.queue_size = self._read("TENSOR_SAVE_QUEUE", _positive("64"), 64)
        self.drop = self._read("TENSOR_SAVE_DROP", _parse_flag, False)
        # one writer per two cores, at most two: on a 2-core host a second writer takes its
        # core from the training thread (its wait rose from 0.22x to 0.37x of the fork's)
        default_writers = min(2, max(1, (os.cpu_count() or 1) // 2))
        self.writers = self._read("TENSOR_SAVE_WRITERS", _positive("2"), default_writers)
        self.nice = self._read("TENSOR_SAVE_NICE", _parse_nice, 10)
        self.accelerators = self._read("TENSOR_SAVE_ACCELERATORS", _parse_accelerators, NONE)

    def _read(self, name: str, parse: Callable[[str], _T], default: _T) -> _T:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            return parse(raw)
        except _Invalid as exc:
            self.errors.append(f"{name}={raw!r} is not valid ({exc})")
            return default


def _load() -> tuple[Config, bool]:
    """The settings and whether saving is on: never when a variable is unreadable (each one
    is reported in one line, once, when saving was asked for)."""
    cfg = Config()
    if cfg.errors and cfg.wanted:
        for err in cfg.errors:
            print(f"[tensor_saver] {err}; tensor saving is off for this run.", file=sys.stderr)
    return cfg, cfg.enabled and not cfg.errors


CFG, _enabled = _load()
"""The settings in force (``reload()`` replaces them)."""
ENABLED_AT_IMPORT = _enabled
"""Whether saving was on when the settings were first read (the tensor saver's ``ENABLED``
starts from it)."""


def reload() -> bool:
    """Read the environment again; whether saving is on."""
    global CFG
    CFG, enabled = _load()
    return enabled


def accelerated(name: str) -> bool:
    """Whether the accelerator ``name`` (one of ``ACCELERATORS``) was asked for."""
    return name in CFG.accelerators


def rank_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


_COMMIT: str | None = None


def source_commit() -> str | None:
    global _COMMIT
    if _COMMIT is None:
        _COMMIT = os.environ.get("QUANTPATCH_SOURCE_COMMIT") or ""
        if not _COMMIT:
            try:
                _COMMIT = subprocess.run(
                    ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                _COMMIT = ""
    return _COMMIT or None


_ITERATION: int | None = None


def set_iteration(value: int | None) -> None:
    """The training iteration, recorded in the metadata of every file from now on."""
    global _ITERATION
    _ITERATION = value


def iteration() -> int | None:
    return _ITERATION
