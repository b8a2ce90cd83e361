"""``quantpatch report``: one self-contained HTML file (plots embedded as data URIs, no
network, no JavaScript) with the runs table, the format comparison and the figures."""

from __future__ import annotations

import base64
import html
import tempfile
from pathlib import Path
from typing import Any

from quantpatch.errors import UserError

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f2f2f2}td.t{text-align:left}tr.bad td{background:#fde8e8}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.note{color:#666;font-size:13px}
"""


def _cell(v: Any) -> str:
    from quantpatch.present_analysis import format_value

    return html.escape(format_value(v))


def table(rows: list[dict[str, Any]], columns: list[str], bad: str | None = None) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cls = ' class="bad"' if bad and r.get(bad) else ""
        cells = "".join(
            f'<td class="t">{_cell(r.get(c))}</td>'
            if isinstance(r.get(c), str) or r.get(c) is None
            else f"<td>{_cell(r.get(c))}</td>"
            for c in columns
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


RUN_COLUMNS = [
    "model", "dataset", "profile", "scheme", "iterations", "loss", "loss_delta_vs_bf16",
    "rel_delta_vs_bf16", "step_ms", "step_vs_bf16", "skipped", "nan_iterations", "diverged",
    "status",
]  # fmt: skip
FORMAT_COLUMNS = [
    "layer", "tensor", "candidate", "sqnr_db", "rel_error", "cosine", "underflows %",
    "overflows %", "blocks saturated %", "blocks scale clipped %", "mse",
]  # fmt: skip


def write_report(
    out: Path,
    tensors_dir: Path | None,
    run_paths: list[Path] | None,
    sample: int | None = None,
    jobs: int = 1,
    names: Any = None,
) -> dict[str, Any]:
    """Build the report; returns what went into it (counts)."""
    from quantpatch.analysis import plots, tensors, training_logs

    if tensors_dir is None and run_paths is None:
        raise UserError("report: give --tensors DIR, --runs PATH, or both.")
    if out.exists() and out.is_dir():
        raise UserError(f"{out}: is a directory; give a file name such as report.html.")
    parts = [f"<!doctype html><meta charset='utf-8'><title>quantpatch report</title>"
             f"<style>{_STYLE}</style><h1>quantpatch report</h1>"]  # fmt: skip
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        figs = Path(tmp)
        if run_paths is not None:
            rr = training_logs.runs(run_paths, jobs=jobs, names=names)
            facts["runs"] = len(rr.rows)
            parts.append(f"<h2>Runs ({rr.logs} logs)</h2>")
            parts.append(
                "<p class='note'>loss: mean over the last window of logged iterations; deltas "
                "against the bf16 run of the same model, dataset and profile at the iterations "
                "both logged; rows in red diverged.</p>"
            )
            parts.append(table(rr.rows, RUN_COLUMNS, bad="diverged"))
            parts += [_img(p) for p in plots.plot_runs(rr, figs)]
        if tensors_dir is not None:
            fr = tensors.formats(tensors_dir, by=("layer", "tensor"), sample=sample, jobs=jobs)
            inv = fr.inventory
            facts["tensor_files"] = inv.files
            parts.append(f"<h2>Formats on the saved tensors ({inv.files} files)</h2>")
            parts.append(
                f"<p class='note'>{tensors_dir}: layers {inv.layers and sorted(inv.layers)}, "
                f"micro-steps {sorted(inv.steps)}, saved under {sorted(inv.formats)}; "
                f"{len(inv.skipped)} skipped. Computed with the quant ops training runs, "
                "along each tensor's reduction dimension; worst first.</p>"
            )
            parts.append(table(fr.rows, FORMAT_COLUMNS))
            parts += [_img(p) for p in plots.plot_formats(fr.rows, fr.formats, figs)]
            h, _ = plots.histograms(tensors_dir, sample=sample)
            parts += [_img(p) for p in plots.plot_histograms(h, figs)]
            if inv.skipped:
                items = "".join(
                    f"<li>{html.escape(s.path)}: {html.escape(s.reason)}</li>" for s in inv.skipped
                )
                parts.append(f"<h3>Skipped</h3><ul>{items}</ul>")
        text = "".join(parts) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(text, encoding="utf-8")
    tmp_out.replace(out)
    facts["bytes"] = len(text.encode())
    return facts
