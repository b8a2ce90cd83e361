"""Run-to-run noise: a scheme run with several seeds (``sweep run --seeds N``) summarised as
the mean and spread of its losses, and its difference from bf16 marked as within or outside
the bf16 seeds' spread.

The statistic is the bf16 seeds' range (lowest to highest loss): with the two to five seeds a
sweep affords, a standard deviation is itself too uncertain to trust (its estimate from two
runs can be off by a factor of several) and a t-test would assume the losses normal; the
range is what was observed, needs no assumption, and says plainly whether a scheme's mean loss
lies among the bf16 runs' own. A scheme is ``outside`` when its mean lies beyond the bf16
range; ``within`` says the sweep cannot tell it from seed noise, not that it equals bf16.
The losses compared are the validation losses where every run of both has one, else each
run's final training loss (the mean over its last window of logged iterations)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

NOISE_COLUMNS = [
    "model", "dataset", "profile", "scheme", "seeds", "compared", "mean", "spread", "std",
    "delta_vs_bf16", "vs_bf16_seeds",
]  # fmt: skip
NOISE_LABELS = {
    "mean": "mean loss",
    "spread": "spread (max-min)",
    "std": "std",
    "delta_vs_bf16": "Δ mean vs bf16",
    "vs_bf16_seeds": "vs bf16 seeds' spread",
}


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def noise_rows(
    rows: Sequence[Mapping[str, Any]], seed_of: Mapping[str, int | None]
) -> list[dict[str, Any]]:
    """One row a (model, dataset, profile, scheme) of ``runs``' rows, where it or its bf16
    has several seeds (``seed_of``: a row's path -> its seed); none where no group has."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in rows:
        if str(r.get("path")) in seed_of:
            key = (r.get("model"), r.get("dataset"), r.get("profile"), r.get("scheme"))
            groups.setdefault(key, []).append(r)
    if not any(len(g) > 1 for g in groups.values()):
        return []
    out = []
    for key, group in sorted(groups.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        ref = groups.get((*key[:3], "bf16"), [])
        both = [*group, *ref]
        field = (
            "val_loss" if len(_finite([r.get("val_loss") for r in both])) == len(both) else "loss"
        )
        mine = _finite([r.get(field) for r in group])
        theirs = _finite([r.get(field) for r in ref])
        mean = statistics.fmean(mine) if mine else math.nan
        row: dict[str, Any] = {
            "model": key[0],
            "dataset": key[1],
            "profile": key[2],
            "scheme": key[3],
            "seeds": len(group),
            "compared": "validation loss" if field == "val_loss" else "final training loss",
            "mean": mean,
            "spread": max(mine) - min(mine) if mine else math.nan,
            "std": statistics.stdev(mine) if len(mine) > 1 else math.nan,
            "delta_vs_bf16": math.nan,
            "vs_bf16_seeds": "-",
        }
        if key[3] != "bf16" and theirs and mine:
            row["delta_vs_bf16"] = mean - statistics.fmean(theirs)
            if len(theirs) > 1:
                low, high = min(theirs), max(theirs)
                row["vs_bf16_seeds"] = "within" if low <= mean <= high else "outside"
            else:
                row["vs_bf16_seeds"] = "one bf16 seed: no spread"
        out.append(row)
    return out
