"""The launch commands: ``list``, ``gen-scripts``, ``layout``, ``worktree``, ``run`` (and
the hidden ``extra-args`` the scripts call)."""

import sys
from pathlib import Path
from typing import Any

import typer

from quantpatch.base.errors import CheckFailed, UserError
from quantpatch.base.values import value_list
from quantpatch.cli.app import (
    OPTS,
    JsonOpt,
    RepoOpt,
    app,
    emit_json,
    err,
    out,
    print_notes,
    repo_root,
)

ConfigOpt = typer.Option(
    None, "--config", help="A TOML file adding or overriding models, datasets, schemes or profiles."
)
ReleaseOpt = typer.Option(
    None,
    "--megatron-release",
    help="Validate flags against this bundled release list (default: the checkout's own "
    "megatron/training/arguments.py, else core_v0.13.1).",
)


def csv_list(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


@app.command("list")
def list_(config: Path | None = ConfigOpt, json_: bool = JsonOpt) -> None:
    """Models, datasets, schemes (with their role values), run profiles, and every value a
    site may hold (its element, block, scale and reference: docs/formats.md)."""
    from rich.table import Table

    from quantpatch.base.values import TEXT_COLUMNS, text_rows
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import describe

    reg = load_registry(config)
    if json_ or OPTS.json:
        emit_json(describe(reg))
        return
    for title, cols, rows in (
        (
            "models",
            ("name", "description", "tokenizer", "recipe BF16 layers"),
            [
                (m.name, m.description, m.tokenizer_model, recipe_bf16_layers(m))
                for m in reg.models.values()
            ],
        ),
        (
            "datasets",
            ("name", "description", "prefix"),
            [(d.name, d.description, d.prefix) for d in reg.datasets.values()],
        ),
        (
            "schemes",
            ("name", "linear", "qk", "pv", "BF16 layers"),
            [
                (s.name, s.linear_text, s.qk, s.pv, s.bf16_layers or "-")
                for s in reg.schemes.values()
            ],
        ),
        (
            "profiles",
            ("name", "description", "GPUs/node", "mock data"),
            [
                (p.name, p.description, str(p.gpus_per_node), "yes" if p.mock_data else "no")
                for p in reg.profiles.values()
            ],
        ),
        ("values (references: list --json, docs/formats.md)", TEXT_COLUMNS, text_rows()),
    ):
        table = Table(title=title, title_justify="left")
        for col in cols:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        out.print(table)


def recipe_bf16_layers(model: Any) -> str:
    """The layers NVIDIA's recipe keeps in BF16 in ``model`` (``bf16_layers = recipe``): the
    paper's first 2 and last 8 of 62 blocks, rounded to the model's ``num-layers``."""
    from quantpatch.base.config import recipe_layers

    total = model.args.get("num-layers")
    if not isinstance(total, int) or isinstance(total, bool):
        return "?"
    first, last = recipe_layers(total)
    share = 100 * (first + last) / total
    return f"1-{first}, {total - last + 1}-{total} of {total} ({share:.0f} %)".replace("1-1,", "1,")


# sizes of a parallel layout: `layout` takes them as text (a script passes its environment),
# `gen-scripts` as numbers that override the profile's
def size_option(flag: str, what: str) -> Any:
    return typer.Option(None, flag, help=what, metavar="N")


GpusPerNodeOpt = size_option("--gpus-per-node", "GPUs per node (default: the profile's).")
NodesOpt = size_option("--nodes", "Nodes (default: the profile's, else 1).")
TpOpt = size_option("--tp", "Tensor-parallel size.")
PpOpt = size_option("--pp", "Pipeline-parallel size.")
CpOpt = size_option("--cp", "Context-parallel size.")
EpOpt = size_option("--ep", "Expert-parallel size.")
EtpOpt = size_option("--etp", "Expert tensor-parallel size (default: TP).")
VppOpt = size_option("--vpp", "Virtual pipeline stages per pipeline rank (interleaving).")
SpOpt = typer.Option(
    None, "--sequence-parallel", help="auto (on when TP > 1), on or off.", metavar="MODE"
)


AttentionHelp = (
    "The attention path of every run: auto (default: quantpatch's flash kernel for every run, "
    "the bf16 Q.K^T of the baseline included, when any of the schemes quantizes Q.K^T; else "
    "Megatron's stock attention), flash or stock. See docs/launch.md."
)


def parallel_sizes(*values: Any) -> dict[str, Any]:
    """The layout options, in the order both commands declare them, by field name."""
    names = ("gpus_per_node", "nodes", "tp", "pp", "cp", "ep", "etp", "vpp", "sequence_parallel")
    return dict(zip(names, values, strict=True))


@app.command("gen-scripts")
def gen_scripts(
    out_dir: Path = typer.Option(Path("scripts"), "--out", help="Output directory."),
    models: str | None = typer.Option(None, "--models", help="Comma-separated (default all)."),
    datasets: str | None = typer.Option(None, "--datasets", help="Comma-separated."),
    schemes: str | None = typer.Option(None, "--schemes", help="Comma-separated."),
    profile: str = typer.Option("full", "--profile", help="full, fast or smoke."),
    launcher: str = typer.Option(
        "torchrun",
        "--launcher",
        help="torchrun (one script per combination, run on every node), slurm (an sbatch "
        "script per combination and DIR/sweep.sbatch, a job array over all of them) or swift "
        "(ms-swift's `megatron pt`).",
    ),
    attention: str = typer.Option("auto", "--attention", help=AttentionHelp, metavar="PATH"),
    prepare: bool = typer.Option(
        False,
        "--prepare",
        help="Also create every scheme's worktree now (needed before Slurm jobs start: compute "
        "nodes only look worktrees up).",
    ),
    swift_source: Path | None = typer.Option(
        None,
        "--swift",
        help="ms-swift to read its argument names from: a wheel, an unpacked wheel or a "
        "site-packages directory (default: the installed one, else the bundled list).",
    ),
    gpus_per_node: int | None = GpusPerNodeOpt,
    nodes: int | None = NodesOpt,
    tp: int | None = TpOpt,
    pp: int | None = PpOpt,
    cp: int | None = CpOpt,
    ep: int | None = EpOpt,
    etp: int | None = EtpOpt,
    vpp: int | None = VppOpt,
    sequence_parallel: str | None = SpOpt,
    release: str | None = ReleaseOpt,
    config: Path | None = ConfigOpt,
    repo: Path | None = RepoOpt,
    force: bool = typer.Option(
        False,
        "--force",
        help="Overwrite scripts and index.md edited by hand (or an index.md of yours).",
    ),
    check_only: bool = typer.Option(
        False,
        "--check",
        help="Write nothing; exit 1 when the scripts on disk differ from what would be generated.",
    ),
) -> None:
    """Write a launch script for every model x dataset x scheme (and DIR/index.md)."""
    from quantpatch.launch.plan import GenRequest, generate_scripts

    request = GenRequest(
        out=out_dir,
        models=csv_list(models),
        datasets=csv_list(datasets),
        schemes=csv_list(schemes),
        profile=profile,
        launcher=launcher,
        slurm_nodes="warn" if launcher == "slurm" else None,
        parallel=parallel_sizes(gpus_per_node, nodes, tp, pp, cp, ep, etp, vpp, sequence_parallel),
        release=release,
        config=config,
        repo=repo_root(repo),
        swift=swift_source,
        force=force,
        check=check_only,
        prepare=prepare,
        attention=attention,
    )
    done = generate_scripts(request, progress=lambda line: err.print(line, markup=False))
    result, flags = done.result, done.flags
    out.print(f"validated against {done.validated}", markup=False)
    for warning in done.warnings:
        err.print(f"warning: {warning}", style="yellow", markup=False)
    if result.others:
        shown = ", ".join(result.others[:3]) + (" ..." if len(result.others) > 3 else "")
        err.print(
            f"note: {len(result.others)} other quantpatch script(s) in {out_dir} are not part "
            f"of this generation (another launcher, profile or selection wrote them): {shown}; "
            "they are left as they are.",
            style="yellow",
            markup=False,
        )
    if check_only:
        if result.differing:
            raise CheckFailed(
                f"{len(result.differing)} file(s) in {out_dir} differ from what "
                f"would be generated: {', '.join(result.differing[:5])}"
                f"{' ...' if len(result.differing) > 5 else ''}"
            )
        out.print(f"{len(result.unchanged)} file(s) in {out_dir} are up to date.")
        return
    sweep = f"; job array: {out_dir / 'sweep.sbatch'}" if launcher == "slurm" else ""
    out.print(
        f"{len(result.scripts)} {launcher} scripts ({profile}, Megatron-LM {flags.release}) in "
        f"{out_dir}: {len(result.written)} file(s) written, {len(result.unchanged)} unchanged "
        f"(scripts and index); index: {out_dir / 'index.md'}{sweep}"
    )
    if done.prepared:
        out.print(f"{len(done.prepared)} worktree(s) prepared for the jobs.")


@app.command("extra-args", hidden=True)
def extra_args_cmd(
    words: list[str] | None = typer.Argument(None, help="Arguments after --."),
    env_text: str = typer.Option("", "--env", help="EXTRA_ARGS, split as bash words."),
    release: str | None = ReleaseOpt,
    repo: Path | None = RepoOpt,
) -> None:
    """For the launch scripts: a run's own pretrain_gpt.py arguments, checked, printed as
    shell words (one line, quoted)."""
    import shlex

    from quantpatch.launch.scripts import extra_args

    checked = extra_args(repo_root(repo), release, env_text, words or [])
    sys.stdout.write(" ".join(shlex.quote(w) for w in checked) + "\n")


@app.command("layout")
def layout_(
    model: str | None = typer.Option(
        None, "--model", help="A model of `list`: its layers, heads, groups, experts."
    ),
    profile: str = typer.Option(
        "full", "--profile", help="Batch sizes, sequence length and sizes from this profile."
    ),
    config: Path | None = ConfigOpt,
    gpus: str | None = typer.Option(
        None, "--gpus", help="GPUs in all (sets the nodes).", metavar="N"
    ),
    gpus_per_node: str | None = GpusPerNodeOpt,
    nodes: str | None = NodesOpt,
    tp: str | None = TpOpt,
    pp: str | None = PpOpt,
    cp: str | None = CpOpt,
    ep: str | None = EpOpt,
    etp: str | None = EtpOpt,
    vpp: str | None = VppOpt,
    sequence_parallel: str | None = SpOpt,
    micro_batch: str | None = typer.Option(
        None, "--micro-batch", help="Micro batch size.", metavar="N"
    ),
    global_batch: str | None = typer.Option(
        None, "--global-batch", help="Global batch size.", metavar="N"
    ),
    num_layers: str | None = typer.Option(
        None, "--num-layers", help="Transformer layers.", metavar="N"
    ),
    heads: str | None = typer.Option(None, "--heads", help="Attention heads.", metavar="N"),
    query_groups: str | None = typer.Option(None, "--query-groups", help="Query groups (GQA)."),
    experts: str | None = typer.Option(None, "--experts", help="Experts (MoE).", metavar="N"),
    seq_length: str | None = typer.Option(
        None, "--seq-length", help="Sequence length.", metavar="N"
    ),
    transformer_impl: str | None = typer.Option(
        None, "--transformer-impl", help="local (default) or transformer_engine."
    ),
    normalization: str | None = typer.Option(
        None, "--normalization", help="LayerNorm (Megatron's default) or RMSNorm."
    ),
    node_rank: str | None = typer.Option(
        None,
        "--node-rank",
        help="This node's rank (a static rendezvous): 0 to nodes - 1.",
        metavar="N",
    ),
    master_addr: str | None = typer.Option(
        None, "--master-addr", help="The rendezvous host: every node must reach it."
    ),
    master_port: str | None = typer.Option(
        None, "--master-port", help="The rendezvous port: 1 to 65535.", metavar="N"
    ),
    line: bool = typer.Option(
        False, "--line", help="Print only the one-line summary (what the scripts log)."
    ),
    json_: bool = JsonOpt,
) -> None:
    """The parallel layout Megatron would build (DP, accumulation steps), or why it refuses."""
    from quantpatch.launch.plan import resolve_layout

    layout = resolve_layout(
        model,
        profile,
        config,
        gpus,
        {
            **parallel_sizes(gpus_per_node, nodes, tp, pp, cp, ep, etp, vpp, sequence_parallel),
            "micro_batch": micro_batch,
            "global_batch": global_batch,
            "layers": num_layers,
            "heads": heads,
            "query_groups": query_groups,
            "experts": experts,
            "seq_length": seq_length,
            "transformer_impl": transformer_impl,
            "normalization": normalization,
        },
        node_rank,
        master_addr,
        master_port,
    )
    for warning in layout.warnings:
        err.print(f"warning: {warning}", style="yellow", markup=False)
    if json_ or OPTS.json:
        emit_json(layout.as_dict())
    elif line:
        sys.stdout.write(layout.line() + "\n")
    else:
        from quantpatch.cli.render_layout import print_layout

        print_layout(layout, out)


@app.command()
def worktree(
    linear: str | None = typer.Option(
        None,
        "--linear",
        help=f"Linear value: {value_list('linear')} (the table: quantpatch list).",
    ),
    fprop: str | None = typer.Option(None, "--fprop", help="The linear forward GEMM's value."),
    dgrad: str | None = typer.Option(None, "--dgrad", help="The input-gradient GEMM's value."),
    wgrad: str | None = typer.Option(None, "--wgrad", help="The weight-gradient GEMM's value."),
    bf16_layers: str | None = typer.Option(
        None, "--bf16-layers", help="The BF16 layer policy (first:2,last:8, recipe, none)."
    ),
    qk: str | None = typer.Option(
        None,
        "--qk",
        help=f"Q.K^T value: {value_list('qk')} (the table: quantpatch list).",
    ),
    pv: str | None = typer.Option(
        None,
        "--pv",
        help=f"P.V value: {value_list('pv')} (the table: quantpatch list).",
    ),
    scheme: str | None = typer.Option(
        None, "--scheme", help="A named scheme (see `list`); --linear/--qk/--pv override it."
    ),
    config: Path | None = ConfigOpt,
    path_only: bool = typer.Option(False, "--path-only", help="Print only the path."),
    existing: bool = typer.Option(
        False,
        "--existing",
        help="Only look up a prepared worktree (exit 2 if there is none); never create or "
        "move one. For jobs on compute nodes.",
    ),
    repo: Path | None = RepoOpt,
) -> None:
    """The path of a git worktree holding these values, on the base's current tip.

    Its branch is built from the base without touching the checkout's own work tree."""
    from quantpatch.checkout.worktrees import ensure_worktree, existing_worktree
    from quantpatch.launch.registry import load_registry

    values: dict[str, str] = {}
    if scheme is not None:
        schemes = load_registry(config).schemes
        if scheme not in schemes:
            raise UserError(f"--scheme: unknown scheme '{scheme}'; valid: {', '.join(schemes)}.")
        values.update(schemes[scheme].values())
    if linear:  # --linear names all three GEMMs: a scheme's own GEMMs give way
        values = {k: v for k, v in values.items() if k not in ("fprop", "dgrad", "wgrad")}
    named = (("linear", linear), ("fprop", fprop), ("dgrad", dgrad), ("wgrad", wgrad))
    values.update({r: v for r, v in (*named, ("qk", qk), ("pv", pv)) if v})
    if bf16_layers is not None:
        values["bf16_layers"] = bf16_layers
    result = (existing_worktree if existing else ensure_worktree)(repo_root(repo), values)
    if path_only:
        sys.stdout.write(f"{result.path}\n")
        return
    how = "created" if result.created_worktree else "reused"
    out.print(f"{how} worktree {result.path} at {result.commit[:12]} ({result.branch})")


@app.command("run")
def run_(
    model: str = typer.Option(..., "--model", help="A model of `list` (e.g. llama32-1b)."),
    dataset: str = typer.Option(..., "--dataset", help="A dataset of `list` (e.g. wikipedia)."),
    scheme: str = typer.Option(..., "--scheme", help="A scheme of `list` (e.g. FA_mxfp8)."),
    profile: str = typer.Option("full", "--profile", help="full, fast or smoke."),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Prepare and verify the worktree, "
        "then print the exact training command instead of running it.",
    ),
    release: str | None = ReleaseOpt,
    config: Path | None = ConfigOpt,
    repo: Path | None = RepoOpt,
) -> None:
    """One combination, one shot: its worktree, verified, then the training command there."""
    from quantpatch.launch.registry import load_registry
    from quantpatch.launch.scripts import flag_source, launch, render_all

    reg = load_registry(config)
    flags = flag_source(repo_root(repo), release)
    (script,) = render_all(
        reg,
        reg.pick("models", [model]),
        reg.pick("datasets", [dataset]),
        reg.pick("schemes", [scheme]),
        profile,
        flags,
    )
    err.print(f"validated against {flags.describe()}", markup=False)
    from quantpatch.checkout.worktrees import left_out

    print_notes([note] if (note := left_out(repo_root(repo))) else [])
    code = launch(repo_root(repo) or Path.cwd(), script, dry_run=dry_run)
    if code:
        raise typer.Exit(code)


# -- analysis: saved tensors, training logs, the report ------------------------------------------
