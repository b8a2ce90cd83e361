"""The data commands: ``data prepare`` (raw text to the indexed datasets the scripts read) and
``data status``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from quantpatch.base.errors import UserError
from quantpatch.cli.app import OPTS, JsonOpt, app, emit_json, err, out, real_console
from quantpatch.cli.launch import ConfigOpt, csv_list

data_app = typer.Typer(
    help="Datasets for the scripts: prepare (tokenize raw text as Megatron does), status.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")
DataRootOpt = typer.Option(
    None, "--data-root", help="Where the datasets live (default: DATA_ROOT, else /data)."
)


def _tokenizers(given: list[str] | None) -> dict[str, str]:
    out_: dict[str, str] = {}
    for item in given or []:
        model, sep, name = item.partition("=")
        if not sep or not model.strip() or not name.strip():
            raise UserError(f"--tokenizer takes MODEL=NAME_OR_PATH (got {item!r}).")
        out_[model.strip()] = name.strip()
    return out_


@contextmanager
def _progress(quiet: bool) -> Iterator[Callable[[str], Any] | None]:
    """A progress bar per tokenization (documents, tokens, MB/s) on a terminal."""
    if quiet or not err.is_terminal:
        yield None
        return
    import time

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[line]}"),
        TimeElapsedColumn(),
        console=real_console(err),
        transient=False,
    ) as bar:

        def start(label: str) -> Callable[[int, int, int], None]:
            task = bar.add_task(f"tokenizing for {label}", line="", total=None)
            began = time.monotonic()

            def update(docs: int, tokens: int, done: int) -> None:
                secs = max(time.monotonic() - began, 1e-6)
                line = f"{docs:,} documents, {tokens:,} tokens, {done / secs / 1e6:.1f} MB/s"
                bar.update(task, line=line)

            return update

        yield start


@data_app.command("prepare")
def data_prepare(
    dataset: str = typer.Argument(..., help="The dataset's registry name (datasets.toml)."),
    inputs: list[Path] = typer.Option(
        ...,
        "--input",
        help="JSON Lines (.jsonl/.json, .gz, .zst), Parquet, or a `save_to_disk` folder; "
        "repeat for more (read in the order given).",
    ),
    models: str = typer.Option(..., "--models", help="Comma-separated models (or all)."),
    tokenizer: list[str] | None = typer.Option(
        None,
        "--tokenizer",
        help="MODEL=NAME_OR_PATH instead of the model's registry tokenizer (TOKENIZER_MODEL "
        "for a single model).",
    ),
    data_root: Path | None = DataRootOpt,
    text_key: str = typer.Option("text", "--text-key", help="The field holding the text."),
    workers: int = typer.Option(
        max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1),
        "--workers",
        help="Tokenizer threads (default: the usable cores).",
    ),
    config: Path | None = ConfigOpt,
    json_: bool = JsonOpt,
) -> None:
    """Tokenize raw text into each model's dataset (byte-identical to Megatron's
    preprocess_data.py), at the prefix the scripts read, with a manifest beside it."""
    from quantpatch.data_prep.inputs import resolved
    from quantpatch.data_prep.layout import data_prefix, tokenizer_for
    from quantpatch.data_prep.prepare import Target, capped_workers, prepare
    from quantpatch.launch.registry import load_registry

    reg = load_registry(config)
    names = reg.pick("models", csv_list(models))
    reg.pick("datasets", [dataset])
    chosen = _tokenizers(tokenizer)
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise UserError(f"--tokenizer names {', '.join(unknown)}, which --models does not list.")
    env = dict(os.environ)
    if len(names) > 1:  # one DATA_PREFIX / TOKENIZER_MODEL cannot serve several models
        env.pop("DATA_PREFIX", None)
        env.pop("TOKENIZER_MODEL", None)
    targets = [
        Target(
            m,
            data_prefix(
                reg.datasets[dataset].prefix,
                m,
                env,
                str(resolved(data_root)) if data_root else None,
            ),
            chosen.get(m) or tokenizer_for(reg.models[m].tokenizer_model, env),
        )
        for m in names
    ]
    quiet = json_ or OPTS.json
    workers, warning = capped_workers(workers)
    if warning:
        err.print(f"warning: {warning}", style="yellow", markup=False)
    with _progress(quiet) as progress:
        done = prepare(
            dataset, inputs, targets, text_key=text_key, workers=workers, progress=progress
        )
    if quiet:
        emit_json({"dataset": dataset, "datasets": [o.as_dict() for o in done]})
        return
    for o in done:
        if o.state == "up to date":
            out.print(
                f"{o.model}: {o.prefix} is up to date ({o.documents:,} documents, "
                f"{o.tokens:,} tokens; same inputs and tokenizer), nothing rewritten",
                markup=False,
            )
        else:
            rate = o.tokens / o.seconds if o.seconds > 0 else 0.0
            shared = f", tokenized once for {', '.join(o.shared_with)}" * (len(o.shared_with) > 1)
            out.print(
                f"{o.model}: wrote {o.prefix}.bin/.idx ({o.documents:,} documents, "
                f"{o.tokens:,} tokens in {o.seconds:.1f} s, {rate / 1e6:.2f} M tokens/s{shared})",
                markup=False,
            )


@data_app.command("status")
def data_status(
    models: str | None = typer.Option(None, "--models", help="Comma-separated (default all)."),
    datasets: str | None = typer.Option(None, "--datasets", help="Comma-separated."),
    data_root: Path | None = DataRootOpt,
    config: Path | None = ConfigOpt,
    json_: bool = JsonOpt,
) -> None:
    """For each model x dataset: the prefix, whether it exists, its documents and tokens, and
    whether its manifest's tokenizer is the one the scripts pass."""
    from quantpatch.data_prep.inputs import resolved
    from quantpatch.data_prep.layout import data_prefix, tokenizer_for
    from quantpatch.data_prep.prepare import status
    from quantpatch.launch.registry import load_registry

    reg = load_registry(config)
    env = dict(os.environ)
    root = str(resolved(data_root)) if data_root else None
    needs = [
        (
            m,
            d,
            data_prefix(reg.datasets[d].prefix, m, env, root),
            tokenizer_for(reg.models[m].tokenizer_model, env),
        )
        for m in reg.pick("models", csv_list(models))
        for d in reg.pick("datasets", csv_list(datasets))
    ]
    rows = status(needs)
    if json_ or OPTS.json:
        emit_json({"datasets": rows})
        _refuse_mismatch(rows)
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("model", "dataset", "prefix", "exists", "documents", "tokens", "tokenizer"):
        table.add_column(col)
    for r in rows:
        if r["manifest"] and not r["manifest_well_formed"]:
            tok = "malformed manifest (edited?): data prepare rewrites it"
        elif r["files_match"] is False:
            tok = "MISMATCH: the files are not those data prepare made (see below)"
        elif r["tokenizer_matches"] is None:
            tok = "no manifest" if r["exists"] else "-"
        elif r["tokenizer_matches"]:
            tok = f"{r['tokenizer']} (matches)"
        else:
            made = r["made_with"] if isinstance(r["made_with"], str) else "?"
            tok = f"MISMATCH: made with {made}, scripts pass {r['tokenizer']}"
        table.add_row(
            r["model"],
            r["dataset"],
            r["prefix"],
            "yes" if r["exists"] else "no",
            "-" if r["documents"] is None else f"{r['documents']:,}",
            "-" if r["tokens"] is None else f"{r['tokens']:,}",
            tok,
        )
    out.print(table)
    _refuse_mismatch(rows)


def _refuse_mismatch(rows: list[dict[str, Any]]) -> None:
    """Exit 1 where a dataset was made with another tokenizer than the scripts pass (a
    malformed manifest says nothing reliable of its tokenizer: its row says so, and the next
    ``data prepare`` rewrites it)."""
    from quantpatch.base.errors import CheckFailed

    changed = [r for r in rows if r["files_match"] is False]
    if changed:
        r = changed[0]
        raise CheckFailed(
            f"{len(changed)} dataset(s) are not what data prepare made: "
            f"{r['files_problem']} ({r['model']} on {r['dataset']}); make it again with "
            f"`quantpatch data prepare {r['dataset']} --input CORPUS --models {r['model']}`."
        )
    bad = [r for r in rows if r["tokenizer_matches"] is False and r["manifest_well_formed"]]
    if bad:
        r = bad[0]
        raise CheckFailed(
            f"{len(bad)} dataset(s) were made with another tokenizer than the scripts pass "
            f"({r['model']} on {r['dataset']}: made with {r['made_with']}, the scripts pass "
            f"{r['tokenizer']}); export TOKENIZER_MODEL, or set tokenizer_model in the "
            "[models.NAME] table of a --config, to the tokenizer it was made with "
            "(docs/data.md)."
        )
