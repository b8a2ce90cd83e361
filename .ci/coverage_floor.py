"""The per-module coverage floor of CI: after the full suite (its coverage combined, the
processes it started counted), no module of quantpatch/ is under FLOOR % but those that run
only on a GPU. Reads the .coverage file pytest-cov left; prints every module under the floor."""

from __future__ import annotations

import sys
from pathlib import Path

import coverage

FLOOR = 80.0
GPU_ONLY = {"quantpatch/runtime/quantpatch_saver/device_copy.py"}
"""Modules that run only on a GPU (the saver's CUDA side stream; Triton's interpreter runs the
kernels on CPU, so they are measured)."""


def main() -> int:
    cov = coverage.Coverage()
    cov.load()
    low = []
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "quantpatch").rglob("*.py")):  # a module never run counts too
        rel = path.relative_to(root).as_posix()
        if rel in GPU_ONLY:
            continue
        _, statements, _, missing, _ = cov.analysis2(str(path))
        if statements:
            pct = 100.0 * (len(statements) - len(missing)) / len(statements)
            if pct < FLOOR:
                low.append(f"{rel}: {pct:.1f} % ({len(missing)} of {len(statements)} lines missed)")
    for line in low:
        print(f"under {FLOOR:.0f} %: {line}")
    print(f"coverage floor: {len(low)} module(s) of quantpatch/ under {FLOOR:.0f} %")
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
