"""Native schemes (``native = true``): TransformerEngine's own recipe, run beside quantpatch's
emulation of it. Refused before anything is written or submitted where TE cannot run it:
TransformerEngine not installed in the run's Python (asked of that Python itself), a
checkout without Megatron's TE layers, or, where the launch machine is the training machine
(a local sweep), a GPU whose compute capability lacks the recipe's format (TE 2.20.2's
``quantization.py`` checks: FP8 delayed and tensorwise 8.9, blockwise 9.0, MXFP8 10.0 up to
but not including 12.0, NVFP4 10.0).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from quantpatch.base.errors import UserError
from quantpatch.launch.registry import Scheme

TE_LAYERS = "megatron/core/extensions/transformer_engine.py"
"""Megatron's TransformerEngine layers: what ``--transformer-impl transformer_engine`` builds."""

_FIND_TE = (
    "import importlib.util, sys; "
    "sys.exit(0 if importlib.util.find_spec('transformer_engine') else 3)"
)
"""Asks a Python whether TransformerEngine is installed, without importing it (its
``__init__`` loads the CUDA library, which a login node may lack)."""


def _word(argv: Sequence[str], flag: str) -> str | None:
    """The value ``argv`` gives ``flag`` last (``--flag v`` or ``--flag=v``), or None."""
    found = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


def needs(argv: Sequence[str]) -> tuple[str, tuple[int, int], tuple[int, int] | None] | None:
    """The format a native argv runs and the compute capabilities TE runs it on (lowest,
    first one too high or None), or None for no low-precision recipe."""
    if _word(argv, "--fp4-format") is not None or _word(argv, "--fp4-recipe") is not None:
        return "NVFP4", (10, 0), None
    if _word(argv, "--fp8-format") is None:
        return None
    recipe = _word(argv, "--fp8-recipe") or "delayed"
    if recipe == "mxfp8":
        return "MXFP8", (10, 0), (12, 0)
    if recipe == "blockwise":
        return "FP8 blockwise", (9, 0), None
    return f"FP8 {recipe}", (8, 9), None


def run_python(environ: Mapping[str, str]) -> list[str]:
    """The training Python as the scripts choose it: ``PYTHON``, else the interpreter on
    the first line of ``TORCHRUN`` (default ``torchrun`` on ``PATH``), else python3."""
    if environ.get("PYTHON"):
        return shlex.split(environ["PYTHON"])
    torchrun = shutil.which(environ.get("TORCHRUN", "torchrun"), path=environ.get("PATH"))
    if torchrun is not None:
        try:
            with open(torchrun, "rb") as f:
                first = f.readline(4096).decode("utf-8", "replace").strip()
        except OSError:
            first = ""
        if first.startswith("#!") and "python" in first:
            return shlex.split(first[2:])
    return ["python3"]


def _te_installed(python: list[str], environ: Mapping[str, str]) -> bool:
    try:
        done = subprocess.run(
            [*python, "-c", _FIND_TE],
            env=dict(environ),
            capture_output=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def compute_capabilities(environ: Mapping[str, str]) -> list[tuple[int, int]] | None:
    """Each GPU's compute capability by index, from ``nvidia-smi``; None where this machine
    cannot tell (no nvidia-smi, or an answer it cannot read)."""
    exe = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "--query-gpu=compute_cap", "--format=csv,noheader"],
            env=dict(environ),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    caps: list[tuple[int, int]] = []
    for line in done.stdout.splitlines():
        major, dot, minor = line.strip().partition(".")
        if done.returncode != 0 or not dot or not (major.isdigit() and minor.isdigit()):
            return None
        caps.append((int(major), int(minor)))
    return caps or None


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPU indices ``CUDA_VISIBLE_DEVICES`` names (indices only), [] for all of them."""
    text = environ.get("CUDA_VISIBLE_DEVICES", "")
    return [g.strip() for g in text.split(",") if g.strip().isdigit()]


def _cc(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"


def refuse_unrunnable(
    schemes: Sequence[Scheme],
    root: Path | None,
    environ: Mapping[str, str],
    gpus: Sequence[str] | None = None,
    choose: str = "with --gpus",
) -> None:
    """One sentence for the first native scheme TransformerEngine cannot run here: a checkout
    without Megatron's TE layers, no TE in the run's Python, and, with ``gpus`` (the GPU
    indices the runs take on this machine, [] for all of them), a GPU without the format;
    ``choose`` says how to choose others (a sweep's ``--gpus``)."""
    native = [s for s in schemes if s.native]
    if not native:
        return
    names = ", ".join(s.name for s in native)
    if root is not None and not (root / TE_LAYERS).is_file():
        raise UserError(
            f"{names}: native schemes run --transformer-impl transformer_engine, which builds "
            f"Megatron's TransformerEngine layers from {TE_LAYERS}, and {root} has none; run "
            "them from a Megatron-LM checkout that has it, or leave them out."
        )
    python = run_python(environ)
    if not _te_installed(python, environ):
        shown = shlex.join(python)
        raise UserError(
            f"{names}: native schemes need TransformerEngine, which the training Python "
            f"({shown}, chosen as the scripts choose it: PYTHON, else TORCHRUN's interpreter) "
            f"does not have; install it there (pip install transformer_engine[pytorch]) or "
            "set PYTHON to a Python that has it."
        )
    if gpus is None:
        return
    caps = compute_capabilities(environ)
    if caps is None:
        return
    chosen = [int(g) for g in gpus if g.isdigit() and int(g) < len(caps)] or list(range(len(caps)))
    for s in native:
        _refuse_capability(s, caps, chosen, choose)


def _refuse_capability(
    scheme: Scheme, caps: Sequence[tuple[int, int]], chosen: Sequence[int], choose: str
) -> None:
    """One sentence where a chosen GPU's compute capability lacks the format the native
    scheme runs (with the GPUs that have it, if any)."""
    need = needs(scheme.argv())
    if need is None:
        return
    fmt, low, high = need

    def fits(cap: tuple[int, int]) -> bool:
        return cap >= low and (high is None or cap < high)

    bad = [i for i in chosen if not fits(caps[i])]
    if not bad:
        return
    good = [i for i, c in enumerate(caps) if fits(c)]
    span = f"{_cc(low)} or higher" + (f" and below {_cc(high)}" if high else "")
    advice = (
        f"choose GPUs {','.join(map(str, good))} {choose}"
        if good
        else "run it on a machine with such GPUs (or --launcher slurm)"
    )
    raise UserError(
        f"{scheme.name}: TransformerEngine runs {fmt} on compute capability {span}, and GPU "
        f"{bad[0]} of this machine is {_cc(caps[bad[0]])}; {advice}, or leave it out."
    )
