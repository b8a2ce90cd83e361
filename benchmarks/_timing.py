"""Shared by the benchmark scripts: the wall time of one command as a fresh process."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wall(cmd: list[str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start
