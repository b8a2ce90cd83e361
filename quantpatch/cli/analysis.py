"""The analysis commands: ``tensors summary|formats|plot``, ``runs``, ``report``."""

import contextlib
from pathlib import Path

import typer

from quantpatch.base.values import value_list
from quantpatch.cli.app import (
    OPTS,
    JsonOpt,
    app,
    err,
    out,
)
from quantpatch.cli.launch import (
    ConfigOpt,
)
from quantpatch.runtime.quantpatch_formats import names as spec_names

DEFAULT_CANDIDATES = ",".join(spec_names(default_candidate=True))
"""What ``tensors formats`` and ``tensors plot`` compare when no ``--formats`` is given."""

tensors_app = typer.Typer(
    help="What each format does to the tensors the saver wrote: summary, formats, plot.",
    no_args_is_help=True,
)
app.add_typer(tensors_app, name="tensors")
DirArg = typer.Argument(..., help="A directory of saved tensors (searched recursively).")
JobsOpt = typer.Option(1, "--jobs", "-j", help="Worker processes: 1 to 4 per CPU, 64 at most.")
SampleOpt = typer.Option(
    None, "--sample", help="At most about N elements per tensor (whole rows, MX blocks intact)."
)
CsvOpt = typer.Option(False, "--csv", help="Print CSV instead of a table.")
AllOpt = typer.Option(False, "--all", help="Show every row (default: the first 40).")


def _analysis_json(local: bool) -> bool:
    return local or OPTS.json


@tensors_app.command("summary")
def tensors_summary(
    directory: Path = DirArg,
    by: str = typer.Option(
        "kind,tensor", "--by", help="Group by any of layer,kind,operation,tensor,format,rank,step."
    ),
    jobs: int = JobsOpt,
    json_: bool = JsonOpt,
    csv_: bool = CsvOpt,
    all_: bool = AllOpt,
) -> None:
    """What is there (files, bytes, layers, micro-steps, ranks) and grouped statistics."""
    from quantpatch.analysis import tensors
    from quantpatch.cli import render_analysis as pa

    with pa.progress_bar(err, "reading tensors") as progress:
        res = tensors.summary(directory, tensors.parse_by(by, ()), jobs=jobs, progress=progress)
    if _analysis_json(json_):
        pa.emit_json({"inventory": res.inventory.as_dict(), "by": res.by, "groups": res.rows})
        return
    pa.print_count(err, res.inventory)
    if csv_:
        pa.emit_csv(res.rows)
        return
    pa.print_inventory(out, res.inventory)
    pa.print_rows(out, f"statistics by {', '.join(res.by)}", res.rows, 0 if all_ else 40)


@tensors_app.command("formats")
def tensors_formats(
    directory: Path = DirArg,
    formats: str = typer.Option(
        DEFAULT_CANDIDATES,
        "--formats",
        help=f"Candidate formats, comma-separated (of {value_list(with_bf16=False)}; the "
        "ParetoQ values apply to weights only).",
    ),
    by: str = typer.Option(
        "layer,kind,operation,tensor",
        "--by",
        help="Group by any of layer,kind,operation,tensor,format,rank,step.",
    ),
    sample: int | None = SampleOpt,
    jobs: int = JobsOpt,
    json_: bool = JsonOpt,
    csv_: bool = CsvOpt,
    all_: bool = AllOpt,
) -> None:
    """What each format does to each tensor (underflows, overflows, SQNR, ...), worst first."""
    from quantpatch.analysis import tensors
    from quantpatch.cli import render_analysis as pa

    fmts, groups = tensors.parse_formats(formats), tensors.parse_by(by, ())
    with pa.progress_bar(err, "quantizing") as progress:
        res = tensors.formats(directory, fmts, groups, sample=sample, jobs=jobs, progress=progress)
    if _analysis_json(json_):
        pa.emit_json({"inventory": res.inventory.as_dict(), "by": res.by, "rows": res.rows})
        return
    pa.print_count(err, res.inventory)
    if csv_:
        pa.emit_csv(res.rows)
        return
    pa.print_rows(out, "formats on the saved tensors, worst first", res.rows, 0 if all_ else 40)


@tensors_app.command("plot")
def tensors_plot(
    directory: Path = DirArg,
    out_dir: Path = typer.Option(..., "--out", help="Directory for the PNG files."),
    formats: str = typer.Option(
        DEFAULT_CANDIDATES,
        "--formats",
        help=f"Candidate formats (of {value_list(with_bf16=False)}: as tensors formats).",
    ),
    sample: int | None = SampleOpt,
    jobs: int = JobsOpt,
) -> None:
    """PNGs: log2|x| histograms with each format's range, SQNR heatmap, underflow/overflow bars."""
    from quantpatch.analysis import outputs, plots, tensors
    from quantpatch.cli import render_analysis as pa

    fmts = tensors.parse_formats(formats)
    plots.require_matplotlib()
    tensors.check_dir(directory)
    with outputs.output_dir(out_dir):
        with pa.progress_bar(err, "quantizing") as progress:
            res = tensors.formats(
                directory, fmts, ("layer", "tensor"), sample=sample, jobs=jobs, progress=progress
            )
        with pa.progress_bar(err, "histograms") as progress:
            hist, _ = plots.histograms(directory.resolve(), sample=sample, progress=progress)
        written = plots.plot_formats(res.rows, fmts, out_dir)
        written += plots.plot_histograms(hist, out_dir)
    pa.print_count(err, res.inventory)
    for p in written:
        out.print(str(p), markup=False)


@app.command("runs")
def runs_cmd(
    paths: list[Path] | None = typer.Argument(
        None, help="Logs or directories of logs (default: $OUTPUT_ROOT or ~/quantpatch-runs)."
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write loss and step-time PNGs here."),
    jobs: int = JobsOpt,
    json_: bool = JsonOpt,
    csv_: bool = CsvOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """Loss and speed of every run against bf16 at matched iterations, from the training logs."""
    from quantpatch.analysis import outputs, plots, training_logs
    from quantpatch.cli import render_analysis as pa
    from quantpatch.launch.registry import load_registry

    reg = load_registry(config)
    if plot is not None:
        plots.require_matplotlib()
    with contextlib.ExitStack() as stack:
        if plot is not None:  # checked (and made) before the logs are read
            stack.enter_context(outputs.output_dir(plot, "--plot"))
        res = training_logs.runs(paths or None, jobs=jobs, names=(reg.models, reg.datasets))
        if plot is not None:
            figures = plots.plot_runs(res, plot)
    if _analysis_json(json_):
        pa.emit_json({"logs": res.logs, "runs": res.rows, "skipped": pa.skipped_logs(res)})
    elif csv_:
        pa.print_skipped_logs(err, res)
        pa.emit_csv(res.rows)
    else:
        err.print(f"read {res.logs} logs", markup=False)
        pa.print_skipped_logs(err, res)
        pa.print_rows(
            out, "runs against bf16 (same model, dataset, profile)", pa.runs_display(res.rows)
        )
    if plot is not None:
        for p in figures:
            err.print(str(p), markup=False)


@app.command("report")
def report_cmd(
    out_file: Path = typer.Option(Path("report.html"), "--out", help="The HTML file to write."),
    tensors_dir: Path | None = typer.Option(None, "--tensors", help="Saved tensors."),
    runs: list[Path] | None = typer.Option(None, "--runs", help="Logs or directories of logs."),
    sample: int | None = SampleOpt,
    jobs: int = JobsOpt,
    config: Path | None = ConfigOpt,
) -> None:
    """One self-contained HTML file: the runs table, the format comparison and the plots."""
    from quantpatch.analysis.report import write_report
    from quantpatch.cli import render_analysis as pa
    from quantpatch.launch.registry import load_registry

    reg = load_registry(config)
    facts = write_report(
        out_file, tensors_dir, runs, sample=sample, jobs=jobs, names=(reg.models, reg.datasets)
    )
    out.print(f"wrote {out_file} ({facts['bytes'] / 1e3:.0f} kB){pa.nan_note(facts)}", markup=False)
