"""Bounds on what the analysis commands are asked for."""

from __future__ import annotations

import os

from quantpatch.base.errors import UserError

JOBS_CAP = 64
JOBS_PER_CPU = 4


def max_jobs() -> int:
    """The most worker processes ``--jobs`` may ask for: 4 per CPU, 64 in all."""
    return min(JOBS_CAP, JOBS_PER_CPU * (os.cpu_count() or 1))


def check_jobs(jobs: int) -> int:
    """``jobs`` if it is 1 to ``max_jobs()``; a one-sentence refusal otherwise (10000 forked
    until the process limit, failed, and left workers running)."""
    top = max_jobs()
    if not 1 <= jobs <= top:
        raise UserError(
            f"--jobs {jobs}: give 1 to {top} worker processes "
            f"(at most {JOBS_PER_CPU} per CPU and {JOBS_CAP} in all)."
        )
    return jobs
