"""``quantpatch tensors summary | formats``: plain functions over a directory of saved tensors.

Files are streamed one at a time (memory holds a few tensors whatever the directory's size),
optionally in ``jobs`` worker processes; each file gives small sums that merge exactly into
groups (``--by``). Nothing is written anywhere.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpatch.analysis.limits import check_jobs
from quantpatch.analysis.tensor_files import (
    GROUPS,
    Skipped,
    StatsRecord,
    TensorMeta,
    discover_all,
    load_tensor,
    meta_of,
    read_stats_lines,
)
from quantpatch.base.config import QUANT_TYPES
from quantpatch.base.errors import UserError
from quantpatch.runtime.quantpatch_formats import names as spec_names

FORMATS = tuple(v for v in QUANT_TYPES if v != "bf16")
"""The candidates ``--formats`` takes; ParetoQ's weight values (``w<b>``, grouped ``w<b>g<N>``
too) apply to weights only, ``nvfp4-rht`` (the Hadamard-transformed NVFP4 of NVIDIA's recipe)
to the weight-gradient GEMM's operands only (other tensors show n/a). ``fp8-tensor`` takes
the whole tensor's amax (before sampling); ``fp8-delayed`` / ``fp8-delayed-e4m3`` the scale
their history settles on when it holds that amax (``settled_quantize``: a training step uses
earlier steps' amaxes instead); ``fp8-block`` is measured with 1 x 128 blocks on
every tensor, weights included (a sample of rows would cut its 128 x 128 weight tiles)."""
DEFAULT_FORMATS = spec_names(default_candidate=True)
"""The candidates when none are named (nvfp4 and nvfp4-2d are taken when named; nvfp4-2d
tiles a linear weight 16 x 16 and gives every other tensor nvfp4's 1-D blocks)."""
Progress = Callable[[int, int], None]  # (files done, files in all)


@dataclass
class Inventory:
    files: int = 0
    stats_records: int = 0
    bytes: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    layers: set[int | str] = field(default_factory=set)
    steps: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    formats: set[str] = field(default_factory=set)

    def see(self, meta: TensorMeta) -> None:
        for attr, values in (("layer", self.layers), ("step", self.steps), ("rank", self.ranks)):
            v = getattr(meta, attr)
            if v is not None:
                values.add(v)
        if meta.format:
            self.formats.add(meta.format)

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "stats_records": self.stats_records,
            "bytes": self.bytes,
            "skipped": [{"path": s.path, "reason": s.reason} for s in self.skipped],
            "layers": sorted_layers(self.layers),
            "micro_steps": sorted(self.steps),
            "ranks": sorted(self.ranks),
            "formats": sorted(self.formats),
        }


def _choices(
    value: str | None, allowed: tuple[str, ...], option: str, what: str
) -> tuple[str, ...]:
    """A comma list of names from ``allowed`` (``allowed`` itself when empty or absent)."""
    if not value:
        return allowed
    picked = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in picked if v not in allowed]
    if bad or not picked:
        raise UserError(
            f"{option} {value!r}: unknown {what} {', '.join(bad) or '(empty)'}; "
            f"choose from {', '.join(allowed)}."
        )
    return picked


def parse_by(value: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    return _choices(value, GROUPS, "--by", "grouping") if value else default


def parse_formats(value: str | None) -> tuple[str, ...]:
    from quantpatch.base.config import is_paretoq

    if value:  # grouped ParetoQ values are a pattern, not a list: allowed as named
        named = tuple(v.strip() for v in value.split(",") if v.strip() and is_paretoq(v.strip()))
        return _choices(value, (*FORMATS, *named), "--formats", "format")
    return _choices(value, FORMATS, "--formats", "format")


def check_dir(root: Path) -> Path:
    if not root.is_dir():
        raise UserError(f"{root}: no such directory.")
    return root.resolve()


# -- per-file work (run in worker processes with --jobs) -----------------------------------------


def _summarise_file(args: tuple[str, str]) -> tuple[TensorMeta, Any, int] | Skipped:
    from quantpatch.analysis.tensor_metrics import tensor_sums

    path, root = Path(args[0]), Path(args[1])
    try:
        t, md = load_tensor(path)
        meta = meta_of(path, md, root)
        return meta, tensor_sums(t), path.stat().st_size
    except Exception as exc:  # one file never stops the others: skipped, with why
        return Skipped(str(path.relative_to(root)), skip_reason(exc))


def skip_reason(exc: BaseException) -> str:
    """One line for a file that could not be read or analysed: a ``ValueError``'s reason
    as it is, anything else by its type and its first line."""
    if isinstance(exc, ValueError):
        return str(exc)
    text = str(exc).strip()
    first = text.splitlines()[0][:160] if text else ""
    return f"could not be analysed ({type(exc).__name__}{': ' + first if first else ''})"


def _formats_file(
    args: tuple[str, str, tuple[str, ...], int | None],
) -> tuple[TensorMeta, dict[str, Any], int] | Skipped:
    from quantpatch.analysis.tensor_metrics import (
        RHT,
        formats_sums,
        is_tiled_weight,
        is_wgrad_operand,
        nv_amax,
        reduction_of,
        rht_sums,
        sample_row_groups,
        sample_rows,
        tiles_weights,
    )
    from quantpatch.runtime.quantpatch_formats import spec_of
    from quantpatch.runtime.quantpatch_ops import NVFP4_FORMATS

    path, root, fmts, sample = Path(args[0]), Path(args[1]), args[2], args[3]
    try:
        t, md = load_tensor(path)
        meta = meta_of(path, md, root)
        if not t.is_floating_point():
            return Skipped(meta.path, f"not a floating-point tensor ({t.dtype})")
        dim, backward = reduction_of(meta.tensor, meta.operation)
        if t.dim() and not -t.dim() <= dim < t.dim():
            dim = -1
        # the whole tensor's amax, not the sample's
        whole = [
            f
            for f in fmts
            if f in NVFP4_FORMATS or spec_of(f).family in ("fp8-tensor", "fp8-delayed")
        ]
        amax = nv_amax(t) if whole else None
        rht = None
        if RHT in fmts:  # along the tokens: sampled as whole groups of consecutive tokens
            wgrad = is_wgrad_operand(meta.tensor, meta.operation, meta.kind) and t.dim() >= 2
            rows = sample_row_groups(t.reshape(-1, t.shape[-1]), sample) if wgrad else t
            rht = rht_sums(rows, wgrad)
            fmts = tuple(f for f in fmts if f != RHT)
        tiled = any(tiles_weights(f) for f in fmts) and is_tiled_weight(meta.tensor, t)
        if tiled:  # a sample of whole tiles
            t = sample_row_groups(t, sample)
        else:
            t, dim = sample_rows(t, dim if t.dim() else 0, sample)
        sums = formats_sums(t, fmts, dim, backward, amax, tiled, weight=meta.tensor == "weight")
        if rht is not None:
            sums = {**sums, RHT: rht}
        return meta, sums, path.stat().st_size
    except Exception as exc:  # one file never stops the others: skipped, with why
        return Skipped(str(path.relative_to(root)), skip_reason(exc))


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _map(fn: Callable[[Any], Any], items: list[Any], jobs: int) -> Iterator[Any]:
    if jobs <= 1 or len(items) < 2:
        yield from map(fn, items)
        return
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(jobs, initializer=_init_worker, initargs=(threads,)) as pool:
        yield from pool.map(fn, items, chunksize=1)


@dataclass
class SummaryResult:
    inventory: Inventory
    by: tuple[str, ...]
    rows: list[dict[str, Any]]


def summary(
    root: Path,
    by: tuple[str, ...] = ("kind", "tensor"),
    jobs: int = 1,
    progress: Progress | None = None,
) -> SummaryResult:
    """What is in ``root`` and grouped statistics of every tensor (and stats-only record)."""
    from quantpatch.analysis.tensor_metrics import TensorSums, sums_from_info

    check_jobs(jobs)
    root = check_dir(root)
    pts, jsonl, special = discover_all(root)
    inv = Inventory(skipped=special)
    groups: dict[tuple[Any, ...], TensorSums] = {}

    def add(meta: TensorMeta, sums: TensorSums) -> None:
        inv.see(meta)
        groups.setdefault(meta.key(by), TensorSums()).merge(sums)

    total = len(pts)
    for done, res in enumerate(_map(_summarise_file, [(str(p), str(root)) for p in pts], jobs), 1):
        if isinstance(res, Skipped):
            inv.skipped.append(res)
        else:
            meta, sums, size = res
            inv.files += 1
            inv.bytes += size
            add(meta, sums)
        if progress:
            progress(done, total)
    for path in jsonl:
        inv.bytes += path.stat().st_size
        for rec in read_stats_lines(path, root):
            if isinstance(rec, StatsRecord):
                s = sums_from_info(rec.info)
                if s is None:
                    inv.skipped.append(
                        Skipped(rec.meta.path, "stats record without min/max/mean/std")
                    )
                    continue
                inv.stats_records += 1
                add(rec.meta, s)
            else:
                inv.skipped.append(rec)
    rows = [
        {**dict(zip(by, key, strict=True)), **groups[key].summary()}
        for key in sorted(groups, key=_sort_key)
    ]
    return SummaryResult(inv, by, rows)


def _sort_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """Numbers first, in order, then names (a module outside the layers), then None."""
    return tuple(
        (v is None, not isinstance(v, int), v if isinstance(v, int) else str(v)) for v in key
    )


def sorted_layers(layers: Iterable[int | str | None]) -> list[int | str | None]:
    """Layer numbers in order, then modules outside the layers by name."""
    return [k[0] for k in sorted(((v,) for v in layers), key=_sort_key)]


@dataclass
class FormatsResult:
    inventory: Inventory
    by: tuple[str, ...]
    formats: tuple[str, ...]
    sample: int | None
    rows: list[dict[str, Any]]  # worst first (lowest SQNR)


def formats(
    root: Path,
    fmts: tuple[str, ...] = DEFAULT_FORMATS,
    by: tuple[str, ...] = ("layer", "kind", "operation", "tensor"),
    sample: int | None = None,
    jobs: int = 1,
    progress: Progress | None = None,
) -> FormatsResult:
    """What each candidate format does to the tensors in ``root``, grouped, worst first."""
    from quantpatch.analysis.tensor_metrics import FormatSums

    check_jobs(jobs)
    root = check_dir(root)
    if sample is not None and sample < 1:
        raise UserError(f"--sample {sample}: give a positive number of elements per tensor.")
    pts, jsonl, special = discover_all(root)
    inv = Inventory(skipped=special)
    groups: dict[tuple[Any, ...], dict[str, FormatSums]] = {}
    items = [(str(p), str(root), fmts, sample) for p in pts]
    for done, res in enumerate(_map(_formats_file, items, jobs), 1):
        if isinstance(res, Skipped):
            inv.skipped.append(res)
        else:
            meta, per_fmt, size = res
            inv.files += 1
            inv.bytes += size
            inv.see(meta)
            g = groups.setdefault(meta.key(by), {f: FormatSums() for f in fmts})
            for f, s in per_fmt.items():
                g[f].merge(s)
        if progress:
            progress(done, len(items))
    for path in jsonl:  # stats-only records hold no values to quantize
        n = 0
        for rec in read_stats_lines(path, root):
            if isinstance(rec, StatsRecord):
                n += 1
            else:
                inv.skipped.append(rec)
        inv.stats_records += n
        if n:
            inv.skipped.append(Skipped(str(path.relative_to(root)), f"{n} stats-only records"))
    rows = []
    for key, per_fmt in groups.items():
        for f, s in per_fmt.items():
            rows.append({**dict(zip(by, key, strict=True)), "candidate": f, **s.summary()})
    rows.sort(key=_worst_first)
    return FormatsResult(inv, by, fmts, sample, rows)


def _worst_first(r: dict[str, Any]) -> tuple[bool, float, float, float]:
    """Lowest SQNR first, then the most overflows and underflows; n/a rows last."""
    if not isinstance(r["sqnr_db"], float):
        return True, 0.0, 0.0, 0.0
    return False, _finite_or(r["sqnr_db"]), -r["overflows %"], -r["underflows %"]


def _finite_or(v: float) -> float:
    return v if not math.isnan(v) else math.inf
