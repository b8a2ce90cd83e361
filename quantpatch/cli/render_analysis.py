"""Rendering of the analysis results (``tensors``, ``runs``, ``report``) as rich tables, CSV
or JSON, and the progress display; the CLI calls these and nothing else."""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from quantpatch.analysis.outputs import format_value


@contextmanager
def progress_bar(err: Console, what: str) -> Iterator[Callable[[int, int], None]]:
    """A progress callback ``(done, total)``; the bar appears only on a terminal and only
    once the work has taken more than a second (``QUANTPATCH_PROGRESS_AFTER`` seconds: the
    pty tests set 0 to see it at once)."""
    import os

    from quantpatch.cli.app import real_console

    err = real_console(err)
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )
    task = bar.add_task(what, total=None)
    started = False
    try:
        after = float(os.environ.get("QUANTPATCH_PROGRESS_AFTER", "1"))
    except ValueError:
        after = 1.0

    def update(done: int, total: int) -> None:
        nonlocal started
        bar.update(task, completed=done, total=total)
        if (
            not started
            and err.is_terminal
            and bar.tasks[0].elapsed is not None
            and bar.tasks[0].elapsed >= after
        ):
            bar.start()
            started = True

    bar.start_task(task)
    try:
        yield update
    finally:
        if started:
            bar.stop()


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json_safe(x) for x in v]
    return v


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(_json_safe(data), indent=2) + "\n")


_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(v: Any) -> Any:
    """A CSV cell: a text that a spreadsheet would take for a formula (it starts with =, +,
    -, @, a tab or a carriage return) is quoted with a leading apostrophe; numbers stay
    numbers, missing values are empty."""
    if v is None:
        return ""
    if isinstance(v, str) and v.startswith(_FORMULA):
        return "'" + v
    return v


def emit_csv(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    w = csv.DictWriter(sys.stdout, fieldnames=[csv_cell(k) for k in rows[0]], lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({csv_cell(k): csv_cell(v) for k, v in r.items()})


def print_rows(out: Console, title: str, rows: list[dict[str, Any]], limit: int = 0) -> None:
    if not rows:
        out.print(f"{title}: nothing to show.", markup=False)
        return
    # every cell and header a Text: names from the files ("[/x]", "[bold]y") are never markup
    table = Table(title=Text(title), title_justify="left")
    for c in rows[0]:
        table.add_column(Text(c), justify="left" if isinstance(rows[0][c], str) else "right")
    shown = rows if not limit else rows[:limit]
    for r in shown:
        table.add_row(*(Text(format_value(v)) for v in r.values()))
    out.print(table)
    if limit and len(rows) > limit:
        out.print(
            f"... {len(rows) - limit} more rows (--all, --json or --csv for all)", style="dim"
        )


def print_count(err: Console, inv: Any) -> None:
    err.print(
        f"read {inv.files} tensor files and {inv.stats_records} stats records "
        f"({inv.bytes / 1e6:.1f} MB); skipped {len(inv.skipped)}",
        markup=False,
    )
    for s in inv.skipped[:20]:
        err.print(f"  skipped {s.path}: {s.reason}", style="yellow", markup=False)
    if len(inv.skipped) > 20:
        err.print(f"  ... and {len(inv.skipped) - 20} more", style="yellow", markup=False)


def _layers(layers: Any) -> list[Any]:
    from quantpatch.analysis.tensors import sorted_layers

    return sorted_layers(layers)


def print_inventory(out: Console, inv: Any) -> None:
    out.print(
        f"{inv.files} tensor files, {inv.stats_records} stats records, "
        f"{inv.bytes / 1e6:.1f} MB; layers {_layers(inv.layers) or '-'}; "
        f"micro-steps {sorted(inv.steps) or '-'}; ranks {sorted(inv.ranks) or '-'}; "
        f"saved under {', '.join(sorted(inv.formats)) or '-'}",
        markup=False,
    )


def skipped_logs(res: Any) -> list[dict[str, str]]:
    """The logs ``runs`` could not read, for JSON."""
    return [{"path": path, "reason": why} for path, why in res.skipped]


def print_skipped_logs(err: Console, res: Any) -> None:
    """One line per log ``runs`` could not read (at most 20), and their count."""
    if not res.skipped:
        return
    err.print(f"skipped {len(res.skipped)} of {res.logs} logs", style="yellow", markup=False)
    for path, why in res.skipped[:20]:
        err.print(f"  skipped {path}: {why}", style="yellow", markup=False)
    if len(res.skipped) > 20:
        err.print(f"  ... and {len(res.skipped) - 20} more", style="yellow", markup=False)


def nan_note(facts: dict[str, Any]) -> str:
    """What ``write_report``'s facts add to the line that names the report: how many runs
    went NaN (``runs``' status ``nan``), which a sweep's finished count does not say (a
    process that trained on through a NaN loss exits 0)."""
    n = facts.get("nan", 0)
    line = f"; {n} run{'s' if n != 1 else ''} went NaN (status nan in its runs table)" if n else ""
    if facts.get("figures") is False:
        from quantpatch.analysis.plots import MATPLOTLIB_INSTALL

        line += f"; no figures: matplotlib is not installed ({MATPLOTLIB_INSTALL} adds them)"
    return line


def runs_display(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs rows with short column names for a terminal (JSON and CSV keep the long)."""
    from quantpatch.analysis.report import RUN_LABELS

    # the validation columns only where a run validated (a terminal table has no room to spare)
    unused = {
        k
        for k in ("seed", "val_loss", "val_ppl", "val_at", "val_delta_vs_bf16")
        if all(r.get(k) is None or r.get(k) != r.get(k) for r in rows)
    }
    rows = [{k: v for k, v in r.items() if k not in unused} for r in rows]
    return [{RUN_LABELS.get(k, k): v for k, v in r.items() if k != "path"} for r in rows]
