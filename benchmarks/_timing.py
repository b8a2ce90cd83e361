"""Shared by the benchmark scripts: the wall time of one command as a fresh process."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wall(cmd: list[str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def worker_pythonpath(checkout: Path) -> str:
    """PYTHONPATH for a worker that imports the checkout's ``megatron`` (first) and
    quantpatch itself (installed or not: a device machine carries it on PYTHONPATH)."""
    import os

    import quantpatch

    parts = [str(checkout), str(Path(quantpatch.__file__).resolve().parents[1])]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)
