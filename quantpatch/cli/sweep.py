"""The sweep commands: ``sweep run``, ``sweep status``, ``sweep report``, ``sweep cancel``."""

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from quantpatch.base.errors import CheckFailed, UserError
from quantpatch.cli.app import OPTS, JsonOpt, RepoOpt, app, emit_json, err, out, repo_root
from quantpatch.cli.launch import AttentionHelp, ConfigOpt, csv_list

if TYPE_CHECKING:
    from quantpatch.launch.sweep import Status
    from quantpatch.launch.sweep_record import SweepRecord, SweepRun

sweep_app = typer.Typer(
    help="Every scheme from one command: run (local queue or Slurm), status, report.",
    no_args_is_help=True,
)
app.add_typer(sweep_app, name="sweep")
SweepDirArg = typer.Argument(..., help="The sweep's folder (scripts, sweep.json, runs/).")


@sweep_app.command("run")
def sweep_run(
    sweep_dir: Path = SweepDirArg,
    extra: list[str] | None = typer.Argument(
        None, help="pretrain_gpt.py arguments for every run, after --."
    ),
    models: str | None = typer.Option(None, "--models", help="Comma-separated (default all)."),
    datasets: str | None = typer.Option(None, "--datasets", help="Comma-separated."),
    schemes: str | None = typer.Option(None, "--schemes", help="Comma-separated."),
    profile: str | None = typer.Option(None, "--profile", help="full, fast or smoke."),
    launcher: str | None = typer.Option(
        None, "--launcher", help="local (a queue on this machine, default) or slurm (a job array)."
    ),
    parallel: int | None = typer.Option(
        None, "--parallel", help="Runs at once (local; each on its own GPUs)."
    ),
    gpus: str | None = typer.Option(
        None, "--gpus", help="The GPUs to use, e.g. 0,1,2,3 (default: all nvidia-smi lists)."
    ),
    gpus_per_node: int | None = typer.Option(
        None,
        "--gpus-per-node",
        help="GPUs per node (default: the profile's); a Slurm sweep is checked against "
        "the partition's nodes (sinfo) before anything is submitted.",
        metavar="N",
    ),
    nodes: int | None = typer.Option(
        None, "--nodes", help="Nodes per run (default: the profile's, else 1).", metavar="N"
    ),
    attention: str | None = typer.Option(
        None, "--attention", help=f"{AttentionHelp} Recorded: a resume keeps it.", metavar="PATH"
    ),
    seeds: int | None = typer.Option(
        None,
        "--seeds",
        help="Runs of each combination, with Megatron's --seed 1234, 1235, ... (local); the "
        "report shows each scheme's mean and spread.",
        metavar="N",
    ),
    only_pending: bool = typer.Option(
        False, "--only-pending", help="On resume, keep failed runs as they are."
    ),
    config: Path | None = ConfigOpt,
    repo: Path | None = RepoOpt,
) -> None:
    """Generate the scripts, prepare the worktrees, run (or submit) every combination, report."""
    from quantpatch.launch import sweep

    given = {
        "models": csv_list(models) or None,
        "datasets": csv_list(datasets) or None,
        "schemes": csv_list(schemes) or None,
        "profile": profile,
        "launcher": launcher,
        "parallel": parallel,
        "gpus": sweep.parse_gpus(gpus),
        "config": str(config.resolve()) if config else None,
        "extra": list(extra) if extra else None,
        "gpus_per_node": gpus_per_node,
        "nodes": nodes,
        "attention": attention,
        "seeds": seeds,
    }
    selection = sweep.selection_for(sweep.load(sweep_dir), given)
    prepared = sweep.prepare(
        sweep_dir,
        repo_root(repo),
        selection,
        only_pending=only_pending,
        progress=lambda line: err.print(line, markup=False),
    )
    for note in prepared.notes:
        err.print(f"note: {note}", style="yellow", markup=False)
    record = prepared.record
    if record.launcher == "slurm":
        done = sweep.submit_slurm(sweep_dir, record)
        c = sweep.counts(record)
        ahead = sum(c[k] for k in ("pending", "running", "submitted")) - len(
            done.runs if done else []
        )
        kept = f"{c['finished']} finished" + (
            f", {ahead} still pending or running in Slurm" if ahead else ""
        )
        if done is None:
            failed = f", {c['failed']} failed (kept by --only-pending)" if c["failed"] else ""
            out.print(
                f"nothing to submit: of {len(record.runs)} runs {kept}{failed}.", markup=False
            )
            return
        out.print(
            f"submitted {len(done.runs)} runs as Slurm job array {done.job} ({kept}); "
            f"`quantpatch sweep status {sweep_dir}` follows it.",
            markup=False,
        )
        return
    total = len(record.runs)

    def changed(rec: sweep.SweepRecord) -> None:
        c = sweep.counts(rec)
        running = [r.name for r in rec.runs if r.state is sweep.RunState.RUNNING]
        err.print(
            f"[{c['finished']}/{total} finished, {c['failed']} failed, {c['running']} running, "
            f"{c['pending']} pending] {', '.join(running) or '-'}",
            markup=False,
        )

    start = time.monotonic()
    try:
        record = sweep.run_local(sweep_dir, record, prepared.per_run_gpus, changed)
    except sweep.Interrupted:
        c = sweep.counts(sweep.load(sweep_dir) or record)
        err.print(
            f"stopped: {c['interrupted']} run(s) interrupted, {c['finished']} finished; "
            f"`quantpatch sweep run {sweep_dir}` resumes.",
            markup=False,
        )
        raise typer.Exit(130) from None
    c = sweep.counts(record)
    report_note = ""
    if any(r.log for r in record.runs):
        try:
            from quantpatch.cli import render_analysis

            facts = _sweep_report(sweep_dir, record, sweep_dir / "report.html")
            report_note = f"; report {sweep_dir / 'report.html'} ({facts['bytes'] / 1e3:.0f} kB)"
            report_note += render_analysis.nan_note(facts)
        except UserError as exc:
            report_note = f"; no report ({exc})"
    out.print(
        f"sweep {sweep_dir}: {c['finished']} of {total} finished, {c['failed']} failed in "
        f"{time.monotonic() - start:.0f} s{report_note}",
        markup=False,
    )
    if c["finished"] != total:
        raise CheckFailed(f"{total - c['finished']} run(s) did not finish (see sweep status).")


def _sweep_report(
    sweep_dir: Path, record: "SweepRecord", out_file: Path, title: str | None = None
) -> dict[str, Any]:
    from quantpatch.analysis.report import Section, table_rows, write_report
    from quantpatch.launch import provenance, sweep
    from quantpatch.launch.registry import load_registry, twin_pairs

    reg = load_registry(record.selection.config_path)
    logs = sweep.run_logs(sweep_dir, record)
    if not logs:
        raise UserError(f"{sweep_dir}: no run of the sweep has written a log yet.")
    tensors = sweep.tensor_dirs(sweep_dir, record)
    roots = (sweep_dir.resolve(), Path(record.checkout or "/"))
    where = Section(
        f"Where the runs came from ({len(record.runs)} runs)",
        "each run's scheme values (linear, Q.K^T, P.V, the BF16 layer policy) and its own "
        "Megatron arguments (a native scheme's: TransformerEngine's recipe), the attention "
        "path the sweep gave it (--attention; the runs table says which its log names), the source "
        "commit its log names, the data prefix and tokenizer the sweep checked, its GPUs and "
        "its Slurm job (array task and Slurm's state); from sweep.json.",
        provenance.RUN_COLUMNS,
        table_rows(
            _shortened(provenance.run_rows(record, reg.schemes), roots), provenance.RUN_COLUMNS
        ),
    )
    layers = provenance.bf16_layer_lines(record, reg.schemes)
    legend = Section(
        "What each value computes",
        "each value the sweep's schemes use: its row of the values table (quantpatch list; "
        "docs/formats.md) and the library reference it is bit-identical to"
        + (f". BF16 layers: {'; '.join(layers)}" if layers else "")
        + ".",
        provenance.LEGEND_COLUMNS,
        table_rows(provenance.legend_rows(record, reg.schemes), provenance.LEGEND_COLUMNS),
    )
    lead = [where, legend]
    data_rows = provenance.data_rows(record)
    if data_rows:
        lead.append(
            Section(
                "The data",
                "each dataset the runs read, as its manifest (data prepare) records it: "
                "documents, tokens, the .bin's sha256 (sha256sum checks it), the tokenizer it "
                "was made with, its fingerprint (every file of a tokenizer folder) and "
                "vocabulary size; hashes cut to 16 hex digits.",
                provenance.DATA_COLUMNS,
                table_rows(_shortened(data_rows, roots), provenance.DATA_COLUMNS),
            )
        )
    return write_report(
        out_file,
        tensors[0] if tensors else None,
        logs,
        names=(reg.models, reg.datasets),
        header=provenance.header(sweep_dir, record),
        lead=lead,
        title=title,
        seeds={str(sweep.at(sweep_dir, r.log)): r.seed for r in record.runs if r.log},
        twins=twin_pairs(reg.schemes, [r.scheme for r in record.runs]),
    )


def _shortened(rows: list[dict[str, Any]], roots: tuple[Path, ...]) -> list[dict[str, Any]]:
    """The rows' paths (data prefix, tokenizer folder) shortened, the full path on hover."""
    from quantpatch.analysis.report import short_path

    keys = ("data", "prefix", "tokenizer")
    return [{k: short_path(v, *roots) if k in keys else v for k, v in r.items()} for r in rows]


@sweep_app.command("status")
def sweep_status(
    sweep_dir: Path = SweepDirArg,
    watch: bool = typer.Option(
        False,
        "--watch",
        help="Follow the sweep until every run ended: the table redrawn on a terminal; "
        "elsewhere (a file, a pipe) the table once, then one line per change of state.",
    ),
    interval: float = typer.Option(
        5.0, "--interval", help="Seconds between looks (--watch).", metavar="S", min=0.1
    ),
    json_: bool = JsonOpt,
) -> None:
    """The sweep's runs and their states (with Slurm's, for a submitted sweep)."""
    import sys

    from quantpatch.launch import sweep

    changes_only = watch and not (json_ or OPTS.json) and not sys.stdout.isatty()
    seen: dict[str, str] | None = None
    while True:
        data = sweep.status(sweep_dir)
        states = {r.name: _state_text(r) for r in data.runs}
        if json_ or OPTS.json:
            emit_json({"counts": data.counts, "runs": [r.as_dict() for r in data.runs]})
        elif changes_only and seen is not None:
            stamp = time.strftime("%H:%M:%S")
            for name, state in states.items():
                if seen.get(name) != state:
                    out.print(f"{stamp} {name}: {seen.get(name, '-')} -> {state}", markup=False)
        else:
            _status_table(sweep_dir, data)
        followed, seen = seen is not None, states
        busy = sum(data.counts[k] for k in ("pending", "running", "submitted"))
        if not watch or not busy:
            if changes_only and followed:
                shown = ", ".join(f"{n} {k}" for k, n in data.counts.items() if n)
                out.print(f"{len(data.runs)} runs: {shown}", markup=False)
            return
        time.sleep(interval)


def _state_text(r: "SweepRun") -> str:
    return r.state.value + (f" ({r.slurm_state})" if r.slurm_state else "")


def _status_table(sweep_dir: Path, data: "Status") -> None:
    from rich.markup import escape as escape_markup
    from rich.table import Table

    table = Table(title=escape_markup(f"sweep {sweep_dir}"))
    for col in ("run", "state", "exit", "gpus", "started", "ended", "commit"):
        table.add_column(col)
    for r in data.runs:
        table.add_row(
            *(
                escape_markup(str(v))
                for v in (
                    r.name,
                    _state_text(r),
                    "" if r.exit_code is None else r.exit_code,
                    r.gpus or "",
                    r.started or "",
                    r.ended or "",
                    (r.commit or "")[:10],
                )
            )
        )
    out.print(table)
    shown = ", ".join(f"{n} {k}" for k, n in data.counts.items() if n)
    out.print(f"{len(data.runs)} runs: {shown}", markup=False)


@sweep_app.command("report")
def sweep_report(
    sweep_dir: Path = SweepDirArg,
    out_file: Path | None = typer.Option(
        None, "--out", help="The HTML file (default DIR/report.html)."
    ),
    title: str | None = typer.Option(
        None, "--title", help="The report's title (its heading and the browser tab's)."
    ),
) -> None:
    """`runs` and `tensors formats` over exactly the sweep's runs, in one HTML file."""
    from quantpatch.cli import render_analysis
    from quantpatch.launch import sweep

    if sweep.load(sweep_dir) is None:
        raise UserError(f"{sweep_dir} holds no sweep.json: not a sweep.")
    sweep.status(sweep_dir)  # a Slurm sweep's record brought up to date first
    record = sweep.load(sweep_dir)
    assert record is not None
    target = out_file or sweep_dir / "report.html"
    facts = _sweep_report(sweep_dir, record, target, title)
    out.print(
        f"wrote {target} ({facts['bytes'] / 1e3:.0f} kB){render_analysis.nan_note(facts)}",
        markup=False,
    )


@sweep_app.command("cancel")
def sweep_cancel(sweep_dir: Path = SweepDirArg) -> None:
    """Cancel a Slurm sweep's pending and running runs (scancel); `sweep run` resumes them."""
    from quantpatch.launch import sweep

    names = sweep.cancel(sweep_dir)
    if not names:
        out.print(f"nothing to cancel: no run of {sweep_dir} is pending or running in Slurm.")
        return
    out.print(
        f"cancelled {len(names)} run(s), recorded interrupted: {', '.join(names)}; "
        f"`quantpatch sweep run {sweep_dir}` resumes them.",
        markup=False,
    )
