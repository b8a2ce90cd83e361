"""What a Megatron iteration line starts with, and how one of its values reads: shared by the
line-at-a-time reader (``training_logs``) and the column reader (``log_columns``), which
import it and never each other's internals."""

from __future__ import annotations

import math
import re

ITERATION = re.compile(rb"iteration +(\d{1,18}) */ *(\d{1,18}) *\|")
"""An iteration line's start as Megatron prints it (``' iteration {:8d}/{:8d} |'``)."""


def number(raw: bytes) -> float:
    """A value as Megatron printed it; NaN where it is not a number."""
    try:
        return float(raw)
    except ValueError:
        return math.nan  # 'nan', 'inf' parse; anything else is missing
