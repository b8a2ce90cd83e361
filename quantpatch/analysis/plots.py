"""PNG figures for ``tensors plot``, ``runs --plot`` and ``report`` (matplotlib with the Agg
backend: the optional extra ``plot``). Every function returns the paths it wrote."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from quantpatch.analysis.tensor_files import Skipped, discover_all, load_tensor, meta_of
from quantpatch.analysis.tensors import sorted_layers
from quantpatch.base.errors import UserError
from quantpatch.runtime import quantpatch_formats as formats

P = ParamSpec("P")
R = TypeVar("R")
LO, HI, WIDTH = -48.0, 24.0, 0.25  # log2 bins
REL_LO = -40.0
# representable magnitudes: HiF8 absolutely; MX relative to the block's amax 2^E, where the
# scale is 2^(E - emax) and the smallest element magnitude 2^(emin - mbits)
HIFP8_RANGE = (-22.0, 15.0)
_HIFP8 = " / ".join(formats.names(family="hifp8"))


def _relative_floor(element: str) -> int:
    e = formats.ELEMENTS[element]
    return -e.emax + e.emin - e.mbits


MX_RELATIVE_FLOOR = {
    label: _relative_floor(element)
    for f in formats.SPECS
    if f.default_candidate and f.family == "mx" and f.input and f.grad_output
    for label, element in (
        [(f.name, f.input)]
        if f.input == f.grad_output
        else [
            (f"{f.name} ({f.input.upper()})", f.input),
            (f"{f.name} ({f.grad_output.upper()}, grads)", f.grad_output),
        ]
    )
}
"""The smallest magnitude each default MX candidate keeps, relative to its block's amax."""


MATPLOTLIB_INSTALL = "pip install 'matplotlib>=3.7'"
"""The line that installs the figures' library (quantpatch's ``plot`` extra), as it works
wherever quantpatch was installed from (its repository, not a package index)."""


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib() -> None:
    """Refuse up front (before any work) when matplotlib is missing."""
    if not have_matplotlib():
        raise UserError(f"plots need matplotlib: {MATPLOTLIB_INSTALL}.")


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_text(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with every text it draws taken as it is: no mathtext (a ``$`` in a tensor name
    or a log header's model stopped the plot), no TeX."""

    @functools.wraps(fn)
    def plain(*args: P.args, **kwargs: P.kwargs) -> R:
        require_matplotlib()
        import matplotlib

        with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
            return fn(*args, **kwargs)

    return plain


@dataclass
class Histograms:
    """Counts of log2|x| (absolute) and log2(|x| / block amax) per tensor kind."""

    absolute: dict[str, list[int]] = field(default_factory=dict)
    relative: dict[str, list[int]] = field(default_factory=dict)
    zeros: dict[str, int] = field(default_factory=dict)


def _bins(lo: float, hi: float) -> int:
    return int((hi - lo) / WIDTH)


def histograms(
    root: Path, sample: int | None = None, progress: Callable[[int, int], None] | None = None
) -> tuple[Histograms, list[Skipped]]:
    from quantpatch.analysis.tensors import skip_reason

    h = Histograms()
    pts, _, skipped = discover_all(root)
    for done, path in enumerate(pts, 1):
        try:
            t, md = load_tensor(path)
            _histogram_of(h, t, meta_of(path, md, root), sample)
        except Exception as exc:  # one file never stops the others: skipped, with why
            skipped.append(Skipped(str(path.relative_to(root)), skip_reason(exc)))
        if progress:
            progress(done, len(pts))
    return h, skipped


def _histogram_of(h: Histograms, t: Any, meta: Any, sample: int | None) -> None:
    """Add one tensor's magnitudes (absolute, and within its 32-block) to ``h``."""
    import torch

    from quantpatch.analysis.tensor_metrics import reduction_of, sample_rows

    kind = meta.tensor or "?"
    dim, _ = reduction_of(meta.tensor, meta.operation)
    if not t.is_floating_point() or t.dim() == 0:
        return
    if not -t.dim() <= dim < t.dim():
        dim = -1
    t, dim = sample_rows(t, dim, sample)
    x = t.detach().float().movedim(dim, -1)
    x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype)).abs()
    n = x.shape[-1]
    pad = (-n) % 32
    blocks = torch.nn.functional.pad(x, (0, pad)).reshape(-1, 32)
    amax = blocks.amax(dim=-1, keepdim=True)
    nz = blocks > 0
    a = torch.log2(blocks[nz])
    rel = (torch.log2(blocks) - torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0))))[nz]
    ab = torch.histc(a.clamp(LO, HI - 1e-3), _bins(LO, HI), LO, HI).long().tolist()
    rb = torch.histc(rel.clamp(REL_LO, 1 - 1e-3), _bins(REL_LO, 1), REL_LO, 1).long().tolist()
    for store, counts in ((h.absolute, ab), (h.relative, rb)):
        old = store.setdefault(kind, [0] * len(counts))
        store[kind] = [p + q for p, q in zip(old, counts, strict=True)]
    h.zeros[kind] = h.zeros.get(kind, 0) + int((x == 0).sum())


@_plain_text
def plot_histograms(h: Histograms, out: Path) -> list[Path]:
    plt = _pyplot()
    written = []
    for kind in sorted(h.absolute):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6))
        xs = [LO + WIDTH * (i + 0.5) for i in range(_bins(LO, HI))]
        ax1.bar(xs, h.absolute[kind], width=WIDTH, color="0.35")
        ax1.axvspan(
            *HIFP8_RANGE, color="tab:orange", alpha=0.15, label=f"{_HIFP8} range 2^-22..2^15"
        )
        ax1.set_xlabel("log2 |x|")
        ax1.set_ylabel("values")
        ax1.set_title(f"{kind}: magnitudes ({h.zeros.get(kind, 0)} zeros not shown)")
        ax1.legend(loc="upper left", fontsize=8)
        rx = [REL_LO + WIDTH * (i + 0.5) for i in range(_bins(REL_LO, 1))]
        ax2.bar(rx, h.relative[kind], width=WIDTH, color="0.35")
        colors = ("tab:blue", "tab:green", "tab:red")
        for (name, floor), c in zip(MX_RELATIVE_FLOOR.items(), colors, strict=True):
            ax2.axvline(floor - 1, color=c, ls="--", label=f"{name}: flushed below 2^{floor - 1}")
        ax2.set_xlabel("log2(|x| / 2^floor(log2 block amax))  (MX: per-block E8M0 scale)")
        ax2.set_title(f"{kind}: magnitude within its 32-block")
        ax2.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        path = out / f"hist_{_safe(kind)}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


@_plain_text
def plot_formats(rows: list[dict[str, Any]], formats: tuple[str, ...], out: Path) -> list[Path]:
    """Heatmap layers x tensor kinds of SQNR per format, and underflow/overflow bars per kind
    (``rows`` from ``tensors.formats(..., by=("layer", "tensor"))``)."""
    plt = _pyplot()
    written: list[Path] = []
    rows = [r for r in rows if isinstance(r["sqnr_db"], float)]  # not n/a (ParetoQ on non-weights)
    layers = sorted_layers({r["layer"] for r in rows})
    kinds = sorted({str(r["tensor"]) for r in rows})
    if not rows:
        return written
    fig, axes = plt.subplots(1, len(formats), figsize=(4.2 * len(formats), 0.5 * len(layers) + 2.5))
    axes = axes if len(formats) > 1 else [axes]
    for ax, f in zip(axes, formats, strict=True):
        grid = [[math.nan] * len(kinds) for _ in layers]
        for r in rows:
            if r["candidate"] == f:
                v = r["sqnr_db"]
                grid[layers.index(r["layer"])][kinds.index(str(r["tensor"]))] = min(v, 99.0)
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=50)
        ax.set_xticks(range(len(kinds)), kinds, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(layers)), [str(v) for v in layers], fontsize=8)
        ax.set_title(f"SQNR (dB), {f}")
        ax.set_ylabel("layer")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, ax=axes, shrink=0.8)
    path = out / "sqnr_heatmap.png"
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    # underflow / overflow bars per tensor kind, pooled over layers
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    width = 0.8 / len(formats)
    for k, f in enumerate(formats):
        under, over = [], []
        for kind in kinds:
            sel = [r for r in rows if r["candidate"] == f and str(r["tensor"]) == kind]
            under.append(max((r["underflows %"] for r in sel), default=0.0))
            over.append(max((r["overflows %"] for r in sel), default=0.0))
        xs = [i + k * width for i in range(len(kinds))]
        ax1.bar(xs, under, width=width, label=f)
        ax2.bar(xs, over, width=width, label=f)
    for ax, what in ((ax1, "underflows % (worst layer)"), (ax2, "overflows % (worst layer)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))], kinds, rotation=30)
        ax.set_title(what)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "underflow_overflow.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    written.append(path)
    return written


def run_label(run: Any, status: dict[str, str]) -> str:
    """A run's name in the loss plot's legend: its scheme, and ``(nan)`` where ``runs`` says
    its loss went NaN (where its curve stops)."""
    return f"{run.scheme} (nan)" if status.get(run.path) == "nan" else str(run.scheme)


@_plain_text
def plot_runs(result: Any, out: Path) -> list[Path]:
    """Loss curves and relative difference to bf16 per model/dataset/profile, and step-time
    ratios (``result`` from ``training_logs.runs``)."""
    from quantpatch.analysis.training_logs import Run

    plt = _pyplot()
    written = []
    status = {row["path"]: row["status"] for row in result.rows}
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for r in result.runs:
        if r.iterations:
            groups.setdefault((r.model, r.dataset, r.profile), []).append(r)
    for key, rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        written.append(_plot_losses(plt, key, rs, status, out))
        validated = [r for r in sorted(rs, key=lambda r: str(r.scheme)) if r.validation]
        if validated:  # Megatron's validation (lm loss value) at each --eval-interval
            written.append(_plot_validation(plt, key, validated, status, out))
    ratios = [
        (f"{r['model']}/{r['dataset']}/{r['scheme']}", r["step_vs_bf16"])
        for r in result.rows
        if r["step_vs_bf16"] == r["step_vs_bf16"]
    ]
    if ratios:
        written.append(_plot_step_times(plt, ratios, out))
    return written


def _relative_to(base: dict[int, float], run: Any) -> list[tuple[int, float]]:
    """The run's (iteration, (loss - bf16) / bf16) where both are there and finite."""
    return [
        (i, (v - base[i]) / base[i])
        for i, v in zip(run.iterations, run.column("loss"), strict=True)
        if i in base and base[i] and math.isfinite(v)
    ]


def _plot_losses(
    plt: Any, key: tuple[Any, ...], rs: list[Any], status: dict[str, str], out: Path
) -> Path:
    """One group's loss curves, and each run's relative difference to its bf16 run."""
    model, dataset, profile = key
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    ref = next((r for r in rs if r.scheme == "bf16"), None)
    base = dict(zip(ref.iterations, ref.column("loss"), strict=True)) if ref else {}
    for r in sorted(rs, key=lambda r: str(r.scheme)):
        ax1.plot(r.iterations, r.column("loss"), label=run_label(r, status), lw=1)
        pts = _relative_to(base, r) if ref and r is not ref else []
        if pts:
            ax2.plot(*zip(*pts, strict=True), label=str(r.scheme), lw=1)
    ax1.set_title(f"{model} / {dataset} ({profile}): lm loss")
    ax1.set_xlabel("iteration")
    ax1.legend(fontsize=7)
    ax2.axhline(0, color="0.5", lw=0.8)
    ax2.set_title("(loss - bf16) / bf16")
    ax2.set_xlabel("iteration")
    if ax2.lines[1:]:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"loss_{_safe(f'{model}_{dataset}_{profile}')}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _plot_validation(
    plt: Any, key: tuple[Any, ...], validated: list[Any], status: dict[str, str], out: Path
) -> Path:
    model, dataset, profile = key
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for r in validated:
        its, losses = [v[0] for v in r.validation], [v[1] for v in r.validation]
        ax.plot(its, losses, marker="o", ms=3, label=run_label(r, status), lw=1)
    ax.set_title(f"{model} / {dataset} ({profile}): validation lm loss")
    ax.set_xlabel("iteration")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"val_loss_{_safe(f'{model}_{dataset}_{profile}')}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _plot_step_times(plt: Any, ratios: list[tuple[str, float]], out: Path) -> Path:
    """Horizontal bars: every label whole and level, however many runs."""
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.6 + 0.28 * len(ratios))))
    ax.barh(range(len(ratios)), [v for _, v in ratios], color="tab:blue")
    ax.axvline(1.0, color="0.3", lw=0.8)
    ax.set_yticks(range(len(ratios)), [k for k, _ in ratios], fontsize=8)
    ax.invert_yaxis()  # the first run on top, as in the table
    ax.set_title("step time / bf16")
    fig.tight_layout()
    path = out / "step_time.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80] or "x"
