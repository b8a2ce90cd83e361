"""``quantpatch report``: one self-contained HTML file (plots embedded as data URIs, no
network, no JavaScript) with the runs table, the format comparison and the figures.

The page is rendered by jinja2 with autoescape on: every text that comes from the inputs
(directory and file names, log headers, metadata labels, reasons) is escaped, whatever it
holds; only our own style sheet is marked safe."""

from __future__ import annotations

import base64
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpatch.analysis.noise import NOISE_COLUMNS, NOISE_LABELS, noise_rows
from quantpatch.base.errors import UserError

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px;color:#222}
table{border-collapse:collapse;font-size:11px;margin:1em 0;max-width:100%}
th,td{border:1px solid #ccc;padding:2px 4px;text-align:right}
th{background:#f2f2f2;font-weight:600}td.t{text-align:left}tr.bad td{background:#fde8e8}
table.prov th{text-align:left}table.prov td{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.note{color:#666;font-size:13px}
"""

_PAGE = """<!doctype html><meta charset="utf-8">
<title>{% if title %}{{ title }} - {% endif %}quantpatch report</title>
<style>{{ style }}</style><h1>{{ title or "quantpatch report" }}</h1>
{%- for line in notes %}<p class="note">{{ line }}</p>{% endfor %}
{%- if header %}<table class="prov">
{%- for label, text, full in header %}<tr><th>{{ label }}</th>
<td{% if full %} title="{{ full }}"{% endif %}>{{ text | breakable }}</td></tr>
{%- endfor %}
</table>{% endif %}
{%- for s in sections %}
<h2>{{ s.title }}</h2>
{%- if s.note %}<p class="note">{{ s.note }}</p>{% endif %}
{%- if s.columns %}<table><tr>{% for c in s.columns %}<th>{{ s.labels.get(c, c) | column }}</th>
{%- endfor %}</tr>
{%- for r in s.rows %}<tr{% if r.bad %} class="bad"{% endif %}>
{%- for text, left, full in r.cells %}<td{% if left %} class="t"{% endif %}
{%- if full %} title="{{ full }}"{% endif %}>{{ text | breakable }}</td>
{%- endfor %}</tr>
{%- endfor %}</table>{% endif %}
{%- for alt, data in s.images %}
<img alt="{{ alt }}" src="data:image/png;base64,{{ data }}">
{%- endfor %}
{%- if s.skipped %}<h3>Skipped</h3><ul>
{%- for path, why in s.skipped %}<li>{{ path }}: {{ why }}</li>{% endfor %}</ul>{% endif %}
{%- endfor %}
"""


@dataclass
class Section:
    title: str
    note: str = ""
    columns: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # {"bad": bool, "cells": [...]}
    images: list[tuple[str, str]] = field(default_factory=list)  # (alt, base64 PNG)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # column -> its heading, if other


def render(
    sections: list[Section],
    notes: list[str] | None = None,
    header: list[tuple[str, Any]] | None = None,
    title: str | None = None,
) -> str:
    """The page, every text escaped (jinja2 with autoescape on); ``breakable`` lets the
    tables' long names and paths wrap, so a wide table fits the page."""
    import jinja2
    from markupsafe import Markup, escape

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["breakable"] = breakable
    env.filters["column"] = lambda name: Markup(str(escape(name)).replace("_", "_<wbr>"))
    page = env.from_string(_PAGE)
    return (
        page.render(
            style=Markup(_STYLE),
            sections=sections,
            notes=notes or [],
            header=[(h[0], str(h[1]), getattr(h[1], "full", "")) for h in header or []],
            title=title,
        )
        + "\n"
    )


LONG_NAME = 32
"""A text longer than this (without spaces) may break after its underscores."""


def breakable(text: object) -> Any:
    """``text`` escaped, with a break opportunity (``<wbr>``) after each slash, and after
    each underscore of a long name (a run's name): values such as ``FA_linear_mxfp8`` stay
    whole, and nothing breaks inside a word. (Column names break after every underscore.)"""
    from markupsafe import Markup, escape

    out = str(escape(text)).replace("/", "/<wbr>")
    words = [w.replace("_", "_<wbr>") if len(w) > LONG_NAME else w for w in out.split(" ")]
    return Markup(" ".join(words))


def no_figures_note() -> str:
    from quantpatch.analysis.plots import MATPLOTLIB_INSTALL

    return f"No figures: matplotlib is not installed ({MATPLOTLIB_INSTALL} adds them)."


@dataclass(frozen=True)
class Short:
    """A cell's short text (a path relative to the sweep or checkout, or its last parts), the
    full text shown on hover."""

    text: str
    full: str

    def __str__(self) -> str:
        return self.text


def short_path(path: object, *roots: Path) -> Short | str:
    """``path`` relative to the first of ``roots`` it lies in, else ``…/`` and its last two
    parts; the full path on hover. Not a path (``-``, a hub name): as it is."""
    text = str(path)
    if not text.startswith("/"):
        return text
    full = Path(text)
    for root in roots:
        try:
            return Short(full.relative_to(root).as_posix() or ".", text)
        except ValueError:
            continue
    if len(full.parts) <= 3:
        return text
    return Short("…/" + "/".join(full.parts[-2:]), text)


def table_rows(
    rows: list[dict[str, Any]], columns: list[str], bad: str | None = None
) -> list[dict[str, Any]]:
    """The cells of a table, as text, each with whether it is left-aligned (text)."""
    from quantpatch.analysis.outputs import format_value

    return [
        {
            "bad": bool(bad and r.get(bad)),
            "cells": [
                (
                    format_value(str(r[c]) if isinstance(r.get(c), Short) else r.get(c)),
                    isinstance(r.get(c), str | Short) or r.get(c) is None,
                    r[c].full if isinstance(r.get(c), Short) else "",
                )
                for c in columns
            ],
        }
        for r in rows
    ]


def _img(path: Path) -> tuple[str, str]:
    return path.stem, base64.b64encode(path.read_bytes()).decode("ascii")


RUN_COLUMNS = [
    "model", "dataset", "profile", "scheme", "attention", "iterations", "loss",
    "last_finite_iteration",
    "loss_delta_vs_bf16",
    "rel_delta_vs_bf16", "val_loss", "val_ppl", "val_delta_vs_bf16", "step_ms", "step_vs_bf16",
    "skipped", "nan_iterations", "diverged", "status",
]  # fmt: skip
RUN_LABELS = {
    "loss_delta_vs_bf16": "Δloss",
    "rel_delta_vs_bf16": "Δloss rel",
    "matched_iterations": "matched",
    "step_ms": "step ms",
    "step_vs_bf16": "step/bf16",
    "nan_iterations": "nan",
    "last_finite_iteration": "loss at",
    "unreadable_lines": "bad lines",
    "val_loss": "val loss",
    "val_ppl": "val ppl",
    "val_at": "val at",
    "val_delta_vs_bf16": "Δval loss",
}
"""The runs table's headings, as ``runs`` prints them in a terminal and the report shows them
(JSON and CSV keep the field names)."""
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
    header: list[tuple[str, str]] | None = None,
    lead: list[Section] | None = None,
    title: str | None = None,
    seeds: dict[str, int | None] | None = None,
    twins: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """Build the report; returns what went into it (counts). ``out`` is checked before any
    work and written atomically (``outputs.atomic_file``). ``header`` (label, text) lines and
    ``lead`` sections (a sweep's provenance) go first; ``twins`` (emulated, native) scheme
    pairs get a table of their own after the runs."""
    from quantpatch.analysis import outputs, plots, tensor_files, tensors, training_logs
    from quantpatch.analysis.limits import check_jobs
    from quantpatch.analysis.tensors import sorted_layers

    if tensors_dir is None and run_paths is None:
        raise UserError("report: give --tensors DIR, --runs PATH, or both.")
    check_jobs(jobs)
    inputs: list[Path] = []
    if run_paths is not None:
        inputs += run_paths + training_logs.find_logs(run_paths)
    if tensors_dir is not None:
        if not tensors_dir.is_dir():
            raise UserError(f"{tensors_dir}: no such directory.")
        pts, jsonl = tensor_files.discover(tensors_dir)
        inputs += pts + jsonl
    facts: dict[str, Any] = {"figures": plots.have_matplotlib()}
    sections: list[Section] = list(lead or [])
    notes = [] if facts["figures"] else [no_figures_note()]
    with outputs.atomic_file(out, inputs) as dest, tempfile.TemporaryDirectory() as tmp:
        figs = Path(tmp)
        if run_paths is not None:
            rr = training_logs.runs(run_paths, jobs=jobs, names=names)
            facts["runs"] = len(rr.rows)
            facts["nan"] = sum(1 for r in rr.rows if r["status"] == "nan")
            columns = list(RUN_COLUMNS)
            if any(r.get("seed") is not None for r in rr.rows):  # sweep run --seeds
                columns.insert(columns.index("scheme") + 1, "seed")
            sections.append(
                Section(
                    f"Runs ({rr.logs} logs)",
                    "loss: mean over the last window of logged iterations with a finite loss "
                    "(loss at: the last of them); deltas against the bf16 run of the same "
                    "model, dataset and profile at the iterations both logged; val loss and "
                    "val ppl: the last validation Megatron printed (lm loss value and PPL, "
                    "--eval-interval), Δval loss against bf16's at the last iteration both "
                    "validated; rows in red "
                    "diverged (status nan: the loss went NaN, printed or left out of the log; "
                    "skips the fp16 loss scaler recovered from are counted in nan only); "
                    "attention: the path the run's attention took, as its log says (flash: "
                    "quantpatch's flash kernel; stock: Megatron's unfused attention; "
                    "(asked): what its script asked for, where the log names no path).",
                    columns,
                    table_rows(rr.rows, columns, bad="diverged"),
                    [_img(p) for p in plots.plot_runs(rr, figs)] if facts["figures"] else [],
                    list(rr.skipped),
                    RUN_LABELS,
                )
            )
            noise = noise_rows(rr.rows, seeds or {})
            if noise:
                sections.append(
                    Section(
                        "Noise: each scheme over its seeds",
                        "mean, spread (highest minus lowest) and standard deviation of each "
                        "scheme's losses over its seeds (Megatron's --seed); Δ mean against "
                        "bf16's mean, marked outside where the mean lies beyond the bf16 "
                        "seeds' lowest to highest loss and within where it does not (seed "
                        "noise cannot tell it from bf16); validation losses where every run "
                        "has one, else final training losses (docs/analysis.md).",
                        NOISE_COLUMNS,
                        table_rows(noise, NOISE_COLUMNS, bad=None),
                        labels=NOISE_LABELS,
                    )
                )
            paired = training_logs.twin_rows(rr, twins or [])
            facts["twins"] = len(paired)
            if paired:
                sections.append(
                    Section(
                        f"Emulation beside the native recipe ({len(paired)} pairs)",
                        "each scheme that emulates a Megatron recipe beside its native twin "
                        "(TransformerEngine's own recipe, --transformer-impl "
                        "transformer_engine): loss difference emulated - native at every "
                        "iteration both logged (mean, largest size, and over the last window "
                        "as in the runs table), and the median step time of each.",
                        training_logs.TWIN_COLUMNS,
                        table_rows(paired, training_logs.TWIN_COLUMNS),
                    )
                )
        if tensors_dir is not None:
            fr = tensors.formats(tensors_dir, by=("layer", "tensor"), sample=sample, jobs=jobs)
            inv = fr.inventory
            facts["tensor_files"] = inv.files
            images: list[tuple[str, str]] = []
            if facts["figures"]:
                h, _ = plots.histograms(tensors_dir.resolve(), sample=sample)
                images = [_img(p) for p in plots.plot_formats(fr.rows, fr.formats, figs)]
                images += [_img(p) for p in plots.plot_histograms(h, figs)]
            sections.append(
                Section(
                    f"Formats on the saved tensors ({inv.files} files)",
                    f"{tensors_dir}: layers {sorted_layers(inv.layers)}, micro-steps "
                    f"{sorted(inv.steps)}, saved under {sorted(inv.formats)}; "
                    f"{len(inv.skipped)} skipped. Computed with the quant ops training runs, "
                    "along each tensor's reduction dimension; worst first.",
                    FORMAT_COLUMNS,
                    table_rows(fr.rows, FORMAT_COLUMNS),
                    images,
                    [(s.path, s.reason) for s in inv.skipped],
                )
            )
        data = render(sections, notes, header, title).encode("utf-8")
        dest.write(data)
        dest.commit()
    facts["bytes"] = len(data)
    return facts
