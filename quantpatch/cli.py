"""The ``quantpatch`` command line: parse, call a plain function, print. No logic lives here.

Heavy modules (libcst, GitPython, the codemods) are imported inside the commands so that
``quantpatch --help`` stays fast; torch is never imported by the CLI.
"""

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import typer

from quantpatch import __version__
from quantpatch.config import QUANT_TYPES
from quantpatch.errors import CheckFailed, UserError

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(
    name="quantpatch",
    help="Switch, record and instrument the low-precision formats of a Megatron-LM checkout.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class _OnFirstUse:
    """A rich ``Console`` made when something is first printed: importing rich costs about
    15 ms, which ``--help`` and a usage error never need."""

    def __init__(self, make: "Callable[[], Console]") -> None:
        self._make = make
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            self._console = self._make()
        return getattr(self._console, name)


def _make_out() -> "Console":
    from rich.console import Console

    # emoji off: a name such as ":smile:" (a file, a tensor) is printed as it is
    console = Console(highlight=False, soft_wrap=True, emoji=False)
    if not console.is_terminal:  # piped or captured: never truncate file paths in tables
        console = Console(highlight=False, soft_wrap=True, width=200, emoji=False)
    return console


def _make_err() -> "Console":
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


out = cast("Console", _OnFirstUse(_make_out))
err = cast("Console", _OnFirstUse(_make_err))


VALUES = ", ".join(QUANT_TYPES)


class Options:
    repo: Path | None = None
    json: bool = False
    debug: bool = False


OPTS = Options()

RepoOpt = typer.Option(
    None,
    "--repo",
    help="Checkout root (default: the git root above the current directory).",
    file_okay=False,
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of tables.")


def _repo(local: Path | None) -> Path | None:
    return local or OPTS.repo


def _commit_note(commit: str | None) -> str:
    return f"; commit {commit[:12]}" if commit else ""


def _notes(notes: list[str]) -> None:
    for note in notes:
        err.print(f"note: {note}", style="yellow", markup=False)


def _emit_json(data: Any) -> None:
    import json

    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _version(value: bool) -> None:
    if value:
        out.print(f"quantpatch {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    repo: Path | None = RepoOpt,
    json_: bool = typer.Option(False, "--json", help="JSON output for read commands."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    OPTS.repo, OPTS.json, OPTS.debug = repo, json_, debug


@app.command()
def check(
    expect: str | None = typer.Option(
        None,
        "--expect",
        metavar="linear=X,qk=Y,pv=Z",
        help="Exit 1 unless the roles hold these values.",
    ),
    repo: Path | None = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Show every site (role, file:line, function, value, form), git state, base and saver."""
    from quantpatch.switch import checking, parse_expect

    wanted = parse_expect(expect) if expect else None
    with checking(_repo(repo), fresh=wanted is not None) as report_of:
        # imported while git status runs and a cold cache is filled beside this process
        from quantpatch.present import print_check

        report = report_of()
    problems = report.problems(wanted)
    if json_ or OPTS.json:
        _emit_json({**report.as_json(), "problems": problems})
    else:
        print_check(report, out)
    if problems:
        raise CheckFailed(" ".join(problems))


@app.command("set")
def set_(
    linear: str | None = typer.Option(
        None, "--linear", help=f"Value of the linear sites: {VALUES}."
    ),
    qk: str | None = typer.Option(
        None, "--qk", help="Value of the Q.K^T site(s): bf16, mxfp8, mxfp4, hifp8, nvfp4."
    ),
    pv: str | None = typer.Option(
        None, "--pv", help="Value of the P.V site(s): bf16, mxfp8, mxfp4, hifp8, nvfp4."
    ),
    scheme: str | None = typer.Option(
        None,
        "--scheme",
        help="A named scheme (see `list`); --linear/--qk/--pv override its values.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the unified diff; change nothing."
    ),
    no_branch: bool = typer.Option(
        False,
        "--no-branch",
        help="Edit in place (no branch, no commit); still all-or-nothing and restorable.",
    ),
    no_split: bool = typer.Option(
        False, "--no-split", help="Refuse instead of splitting a shared qk+pv site."
    ),
    allow_unknown: bool = typer.Option(
        False, "--allow-unknown", help="Write a value that is not a known quant type."
    ),
    config: Path | None = typer.Option(None, "--config", help="Extra schemes (TOML)."),
    repo: Path | None = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Rewrite the named roles; in git, on branch quantpatch/linear-X_qk-Y_pv-Z on the base."""
    from quantpatch.registry import load_registry
    from quantpatch.switch import SetRequest, set_values

    values: dict[str, str] = {}
    if scheme is not None:
        schemes = load_registry(config).schemes
        if scheme not in schemes:
            raise UserError(f"--scheme: unknown scheme '{scheme}'; valid: {', '.join(schemes)}.")
        values.update(schemes[scheme].values())
    for role, value in (("linear", linear), ("qk", qk), ("pv", pv)):
        if value is not None:
            values[role] = value
    if not values:
        raise UserError("nothing to set: give --linear, --qk, --pv or --scheme.")
    result = set_values(
        _repo(repo), SetRequest(values, dry_run, not no_branch, not no_split, allow_unknown)
    )
    if json_ or OPTS.json:
        _emit_json(
            {
                "values": result.values,
                "branch": result.branch,
                "commit": result.commit,
                "base": result.base,
                "reused": result.reused,
                "dry_run": dry_run,
                "diff": result.diff,
                "notes": result.notes,
            }
        )
        return
    _notes(result.notes)
    if dry_run:
        sys.stdout.write(result.diff)
        if not result.diff:
            err.print("no change: the checkout already holds these values.")
        return
    vals = " ".join(f"{r}={v}" for r, v in result.values.items())
    if result.branch:
        how = result.how or ("reused" if result.reused else "created")
        out.print(
            f"{vals}: {how} branch {result.branch} at {(result.commit or '')[:12]} "
            f"(base {result.base and (result.base['branch'] or 'detached')} @ "
            f"{result.base and result.base['commit'][:12]})"
        )
    else:
        out.print(
            f"{vals}: written in place ({len([e for e in result.edits if e.changed])} "
            "file(s)); 'quantpatch restore' puts the originals back."
        )


@app.command()
def restore(
    forget: bool = typer.Option(
        False,
        "--forget",
        help="Drop quantpatch's record (an unreadable one, say) without touching files or "
        "branches.",
    ),
    repo: Path | None = RepoOpt,
) -> None:
    """Put the checkout back on the recorded base, byte-identical, and clear the record."""
    from quantpatch.switch import restore as run_restore

    result = run_restore(_repo(repo), forget=forget)
    if result.mode == "forget":
        _notes(result.notes)
        return
    _notes(result.notes)
    if result.mode == "branch":
        b = result.base
        out.print(f"restored: {b['branch'] or 'detached HEAD'} @ {b['commit'][:12]}")
    else:
        out.print(f"restored the original bytes of {', '.join(result.files)}")


saver_app = typer.Typer(help="The tensor saver: install, remove, status.", no_args_is_help=True)
app.add_typer(saver_app, name="saver")


@saver_app.command("install")
def saver_install(
    force: bool = typer.Option(False, "--force", help="Replace a different tensor_saver.py."),
    repo: Path | None = RepoOpt,
) -> None:
    """Install megatron/core/tensor_saver.py and insert the marked saver calls."""
    from quantpatch.saver import install

    result = install(_repo(repo), force=force)
    if not result.changed:
        out.print("the tensor saver is already installed; nothing to do.")
        return
    out.print(f"installed the tensor saver: {', '.join(result.files)}{_commit_note(result.commit)}")


@saver_app.command("remove")
def saver_remove(repo: Path | None = RepoOpt) -> None:
    """Remove the saver: every instrumented file back to its exact bytes."""
    from quantpatch.saver import remove

    result = remove(_repo(repo))
    if not result.changed:
        out.print("the tensor saver is not installed; nothing to do.")
        return
    out.print(f"removed the tensor saver: {', '.join(result.files)}{_commit_note(result.commit)}")


@saver_app.command("status")
def saver_status_cmd(repo: Path | None = RepoOpt, json_: bool = JsonOpt) -> None:
    """Whether the saver is installed, and in which files."""
    from quantpatch import repo as gitrepo
    from quantpatch.saver import status

    st = status(gitrepo.find_checkout(_repo(repo), need_git=False))
    if json_ or OPTS.json:
        _emit_json(st.as_json())
        return
    if st.installed:
        note = "" if st.module_matches else " (module differs from this quantpatch's)"
        out.print(f"installed: {st.module}{note}; instrumented: {', '.join(st.files)}")
    else:
        from quantpatch.present import saver_line

        out.print(saver_line(st.as_json()))


@app.command("init")
def init_(
    remove: bool = typer.Option(False, "--remove", help="Restore the stock files exactly."),
    repo: Path | None = RepoOpt,
) -> None:
    """Insert fork-layout sites (bf16) and the quant ops module into a stock checkout."""
    from quantpatch.init_checkout import init

    result = init(_repo(repo), remove=remove)
    _notes(result.notes)
    what = "restored" if result.removed else "initialised"
    out.print(f"{what}: {', '.join(result.files)}{_commit_note(result.commit)}")


@app.command()
def demo(
    directory: Path = typer.Argument(
        Path("quantpatch-demo"), help="Where to build the demo checkout (must be new or empty)."
    ),
    megatron_core: str = typer.Option("0.13.1", "--megatron-core", help="megatron-core release."),
) -> None:
    """Build a demo checkout from megatron-core and walk check, set, set again, restore."""
    from quantpatch.demo import build_checkout, walk

    out.rule(f"building {directory} from megatron-core {megatron_core}")
    with err.status(f"fetching megatron-core {megatron_core} (about 19 MB, once) and building"):
        build_checkout(directory, megatron_core)
    walk(directory, out)
    out.rule("next")
    out.print(
        f"try: cd {directory} && quantpatch check; quantpatch saver install; "
        "quantpatch set --scheme FA_linear_mxfp8; quantpatch gen-scripts --out scripts; "
        "quantpatch restore"
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


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


@app.command("list")
def list_(config: Path | None = ConfigOpt, json_: bool = JsonOpt) -> None:
    """Models, datasets, schemes (with their role values) and run profiles."""
    from rich.table import Table

    from quantpatch.registry import load_registry
    from quantpatch.scripts import describe

    reg = load_registry(config)
    if json_ or OPTS.json:
        _emit_json(describe(reg))
        return
    for title, cols, rows in (
        (
            "models",
            ("name", "description", "tokenizer"),
            [(m.name, m.description, m.tokenizer_model) for m in reg.models.values()],
        ),
        (
            "datasets",
            ("name", "description", "prefix"),
            [(d.name, d.description, d.prefix) for d in reg.datasets.values()],
        ),
        (
            "schemes",
            ("name", "linear", "qk", "pv"),
            [(s.name, s.linear, s.qk, s.pv) for s in reg.schemes.values()],
        ),
        (
            "profiles",
            ("name", "description", "GPUs/node", "mock data"),
            [
                (p.name, p.description, str(p.gpus_per_node), "yes" if p.mock_data else "no")
                for p in reg.profiles.values()
            ],
        ),
    ):
        table = Table(title=title, title_justify="left")
        for col in cols:
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        out.print(table)


# sizes of a parallel layout: `layout` takes them as text (a script passes its environment),
# `gen-scripts` as numbers that override the profile's
def _size_opt(flag: str, what: str) -> Any:
    return typer.Option(None, flag, help=what, metavar="N")


GpusPerNodeOpt = _size_opt("--gpus-per-node", "GPUs per node (default: the profile's).")
NodesOpt = _size_opt("--nodes", "Nodes (default: the profile's, else 1).")
TpOpt = _size_opt("--tp", "Tensor-parallel size.")
PpOpt = _size_opt("--pp", "Pipeline-parallel size.")
CpOpt = _size_opt("--cp", "Context-parallel size.")
EpOpt = _size_opt("--ep", "Expert-parallel size.")
EtpOpt = _size_opt("--etp", "Expert tensor-parallel size (default: TP).")
VppOpt = _size_opt("--vpp", "Virtual pipeline stages per pipeline rank (interleaving).")
SpOpt = typer.Option(
    None, "--sequence-parallel", help="auto (on when TP > 1), on or off.", metavar="MODE"
)


def _sizes(*values: Any) -> dict[str, Any]:
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
    from quantpatch.launch_plan import GenRequest, generate_scripts

    request = GenRequest(
        out=out_dir,
        models=_csv(models),
        datasets=_csv(datasets),
        schemes=_csv(schemes),
        profile=profile,
        launcher=launcher,
        parallel=_sizes(gpus_per_node, nodes, tp, pp, cp, ep, etp, vpp, sequence_parallel),
        release=release,
        config=config,
        repo=_repo(repo),
        swift=swift_source,
        force=force,
        check=check_only,
        prepare=prepare,
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

    from quantpatch.scripts import extra_args

    checked = extra_args(_repo(repo), release, env_text, words or [])
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
    from quantpatch.launch_plan import resolve_layout

    layout = resolve_layout(
        model,
        profile,
        config,
        gpus,
        {
            **_sizes(gpus_per_node, nodes, tp, pp, cp, ep, etp, vpp, sequence_parallel),
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
        _emit_json(layout.as_dict())
    elif line:
        sys.stdout.write(layout.line() + "\n")
    else:
        from quantpatch.present_layout import print_layout

        print_layout(layout, out)


@app.command()
def worktree(
    linear: str | None = typer.Option(
        None, "--linear", help="Linear value: bf16, mxfp8, mxfp4, hifp8, nvfp4, nvfp4-2d."
    ),
    qk: str | None = typer.Option(
        None, "--qk", help="Q.K^T value: bf16, mxfp8, mxfp4, hifp8, nvfp4."
    ),
    pv: str | None = typer.Option(
        None, "--pv", help="P.V value: bf16, mxfp8, mxfp4, hifp8, nvfp4."
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
    from quantpatch.registry import load_registry
    from quantpatch.worktrees import ensure_worktree, existing_worktree

    values: dict[str, str] = {}
    if scheme is not None:
        schemes = load_registry(config).schemes
        if scheme not in schemes:
            raise UserError(f"--scheme: unknown scheme '{scheme}'; valid: {', '.join(schemes)}.")
        values.update(schemes[scheme].values())
    values.update({r: v for r, v in (("linear", linear), ("qk", qk), ("pv", pv)) if v})
    result = (existing_worktree if existing else ensure_worktree)(_repo(repo), values)
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
    from quantpatch.registry import load_registry
    from quantpatch.scripts import flag_source, launch, render_all

    reg = load_registry(config)
    flags = flag_source(_repo(repo), release)
    (script,) = render_all(
        reg,
        reg.pick("models", [model]),
        reg.pick("datasets", [dataset]),
        reg.pick("schemes", [scheme]),
        profile,
        flags,
    )
    err.print(f"validated against {flags.describe()}", markup=False)
    from quantpatch.worktrees import left_out

    _notes([note] if (note := left_out(_repo(repo))) else [])
    code = launch(_repo(repo) or Path.cwd(), script, dry_run=dry_run)
    if code:
        raise typer.Exit(code)


# -- analysis: saved tensors, training logs, the report ------------------------------------------

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
    from quantpatch import present_analysis as pa
    from quantpatch.analysis import tensors

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
        "mxfp8,mxfp4,hifp8",
        "--formats",
        help="Candidate formats, comma-separated (of mxfp8, mxfp4, hifp8, nvfp4, nvfp4-2d).",
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
    from quantpatch import present_analysis as pa
    from quantpatch.analysis import tensors

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
        "mxfp8,mxfp4,hifp8", "--formats", help="Candidate formats (of mxfp8, mxfp4, hifp8, nvfp4)."
    ),
    sample: int | None = SampleOpt,
    jobs: int = JobsOpt,
) -> None:
    """PNGs: log2|x| histograms with each format's range, SQNR heatmap, underflow/overflow bars."""
    from quantpatch import present_analysis as pa
    from quantpatch.analysis import outputs, plots, tensors

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
    from quantpatch import present_analysis as pa
    from quantpatch.analysis import outputs, plots, training_logs
    from quantpatch.registry import load_registry

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
    from quantpatch.analysis import plots
    from quantpatch.analysis.report import write_report
    from quantpatch.registry import load_registry

    reg = load_registry(config)
    plots.require_matplotlib()
    facts = write_report(
        out_file, tensors_dir, runs, sample=sample, jobs=jobs, names=(reg.models, reg.datasets)
    )
    out.print(f"wrote {out_file} ({facts['bytes'] / 1e3:.0f} kB)", markup=False)


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
    only_pending: bool = typer.Option(
        False, "--only-pending", help="On resume, keep failed runs as they are."
    ),
    config: Path | None = ConfigOpt,
    repo: Path | None = RepoOpt,
) -> None:
    """Generate the scripts, prepare the worktrees, run (or submit) every combination, report."""
    from quantpatch import sweep

    given = {
        "models": _csv(models) or None,
        "datasets": _csv(datasets) or None,
        "schemes": _csv(schemes) or None,
        "profile": profile,
        "launcher": launcher,
        "parallel": parallel,
        "gpus": sweep.parse_gpus(gpus),
        "config": str(config.resolve()) if config else None,
        "extra": list(extra) if extra else None,
    }
    selection = sweep.selection_for(sweep.load(sweep_dir), given)
    prepared = sweep.prepare(
        sweep_dir,
        _repo(repo),
        selection,
        only_pending=only_pending,
        progress=lambda line: err.print(line, markup=False),
    )
    for note in prepared.notes:
        err.print(f"note: {note}", style="yellow", markup=False)
    record = prepared.record
    if record["launcher"] == "slurm":
        job = sweep.submit_slurm(sweep_dir, record)
        out.print(
            f"submitted {len(record['runs'])} runs as Slurm job array {job}; "
            f"`quantpatch sweep status {sweep_dir}` follows it.",
            markup=False,
        )
        return
    total = len(record["runs"])

    def changed(rec: dict[str, Any]) -> None:
        c = sweep.counts(rec)
        running = [r["name"] for r in rec["runs"] if r["state"] == "running"]
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
    if any(r.get("log") for r in record["runs"]):
        try:
            facts = _sweep_report(sweep_dir, record, sweep_dir / "report.html")
            report_note = f"; report {sweep_dir / 'report.html'} ({facts['bytes'] / 1e3:.0f} kB)"
        except UserError as exc:
            report_note = f"; no report ({exc})"
    out.print(
        f"sweep {sweep_dir}: {c['finished']} of {total} finished, {c['failed']} failed in "
        f"{time.monotonic() - start:.0f} s{report_note}",
        markup=False,
    )
    if c["finished"] != total:
        raise CheckFailed(f"{total - c['finished']} run(s) did not finish (see sweep status).")


def _sweep_report(sweep_dir: Path, record: dict[str, Any], out_file: Path) -> dict[str, Any]:
    from quantpatch import sweep
    from quantpatch.analysis import plots
    from quantpatch.analysis.report import write_report
    from quantpatch.registry import load_registry

    cfg = record["selection"].get("config")
    reg = load_registry(Path(cfg) if cfg else None)
    plots.require_matplotlib()
    logs = sweep.run_logs(sweep_dir, record)
    if not logs:
        raise UserError(f"{sweep_dir}: no run of the sweep has written a log yet.")
    tensors = sweep.tensor_dirs(sweep_dir, record)
    return write_report(
        out_file, tensors[0] if tensors else None, logs, names=(reg.models, reg.datasets)
    )


@sweep_app.command("status")
def sweep_status(
    sweep_dir: Path = SweepDirArg,
    watch: bool = typer.Option(False, "--watch", help="Redraw every 5 s until every run ended."),
    json_: bool = JsonOpt,
) -> None:
    """The sweep's runs and their states (with Slurm's, for a submitted sweep)."""
    from quantpatch import sweep

    while True:
        data = sweep.status(sweep_dir)
        if json_ or OPTS.json:
            _emit_json({"counts": data["counts"], "runs": data["runs"]})
        else:
            from rich.markup import escape as escape_markup
            from rich.table import Table

            table = Table(title=escape_markup(f"sweep {sweep_dir}"))
            for col in ("run", "state", "exit", "gpus", "started", "ended", "commit"):
                table.add_column(col)
            for r in data["runs"]:
                state = r["state"] + (f" ({r['slurm_state']})" if r.get("slurm_state") else "")
                table.add_row(
                    *(
                        escape_markup(str(v))
                        for v in (
                            r["name"],
                            state,
                            "" if r["exit_code"] is None else r["exit_code"],
                            r["gpus"] or "",
                            r["started"] or "",
                            r["ended"] or "",
                            (r["commit"] or "")[:10],
                        )
                    )
                )
            out.print(table)
            shown = ", ".join(f"{n} {k}" for k, n in data["counts"].items() if n)
            out.print(f"{len(data['runs'])} runs: {shown}", markup=False)
        busy = sum(data["counts"][k] for k in ("pending", "running", "submitted"))
        if not watch or not busy:
            return
        time.sleep(5)


@sweep_app.command("report")
def sweep_report(
    sweep_dir: Path = SweepDirArg,
    out_file: Path | None = typer.Option(
        None, "--out", help="The HTML file (default DIR/report.html)."
    ),
) -> None:
    """`runs` and `tensors formats` over exactly the sweep's runs, in one HTML file."""
    from quantpatch import sweep

    record = sweep.load(sweep_dir)
    if record is None:
        raise UserError(f"{sweep_dir} holds no sweep.json: not a sweep.")
    target = out_file or sweep_dir / "report.html"
    facts = _sweep_report(sweep_dir, record, target)
    out.print(f"wrote {target} ({facts['bytes'] / 1e3:.0f} kB)", markup=False)


def _full_short_help(command: Any) -> None:
    """Command summaries in ``--help`` whole (click cuts the docstring's first sentence at
    45 characters with '...')."""
    for sub in getattr(command, "commands", {}).values():
        if not sub.short_help and sub.help:
            sub.short_help = " ".join(sub.help.strip().split("\n\n")[0].split())
        _full_short_help(sub)


_VALUE_OPTIONS = frozenset({"--repo"})
"""Options of the top-level callback that take a value (the word after them is no command)."""


def _command_word(argv: list[str]) -> str | None:
    """The subcommand named on the command line, if any."""
    words = iter(argv)
    for word in words:
        if word in _VALUE_OPTIONS:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _name_of(info: Any) -> str:
    return str(info.name or typer.main.get_command_name(info.callback.__name__))


def _listing(full: typer.Typer) -> Any:
    """The top-level group as ``--help`` shows it, each plain command built without its
    parameters (typer builds every command's parameters up front, about 13 ms for all of
    them, and the listing shows only names and summaries). A test holds the text equal to
    the fully built group's."""
    import copy
    import inspect

    from typer.core import TyperCommand

    bare = copy.copy(full)
    bare.registered_commands = []
    group: Any = typer.main.get_command(bare)  # the callback's options and the sub-groups
    groups = dict(group.commands)
    group.commands.clear()
    for info in full.registered_commands:  # typer lists commands first, then groups
        doc = info.help
        group.add_command(
            TyperCommand(
                name=_name_of(info),
                help=inspect.getdoc(info.callback) if doc is None else inspect.cleandoc(doc),
                short_help=info.short_help,
                hidden=info.hidden,
                deprecated=info.deprecated,
                rich_markup_mode=None,
                rich_help_panel=info.rich_help_panel,
            )
        )
    group.commands.update(groups)
    return group


def command_for(argv: list[str]) -> Any:
    """The click command to run ``argv``: only the command being run is built (typer builds
    the parameters of every registered command up front, which one command never needs);
    the top-level listing gets names and summaries only; an unknown word gets the whole app,
    so its "no such command" message is unchanged."""
    import copy

    word = _command_word(argv)
    if not argv or (word is None and "--help" in argv):
        command = _listing(app)
    else:
        commands = [c for c in app.registered_commands if word == _name_of(c)]
        groups = [g for g in app.registered_groups if word is not None and g.name == word]
        only = app
        if commands or groups:
            only = copy.copy(app)
            only.registered_commands, only.registered_groups = commands, groups
        command = typer.main.get_command(only)
    _full_short_help(command)
    return command


def main() -> None:
    """Entry point: run the app, map errors onto exit codes and one-sentence messages."""
    debug = "--debug" in sys.argv[1:]
    if debug:
        OPTS.debug = True
    command = command_for(sys.argv[1:])
    try:
        code = command.main(args=sys.argv[1:], prog_name="quantpatch", standalone_mode=False)
    except (UserError, CheckFailed) as exc:
        # a user error is never a traceback, --debug or not: one sentence and its exit code
        label = "error" if isinstance(exc, UserError) else "check failed"
        err.print(
            f"{label}: {exc}", style="red" if isinstance(exc, UserError) else "yellow", markup=False
        )
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted.")
        sys.exit(130)
    except Exception as exc:
        show = getattr(exc, "show", None)
        if callable(show) and isinstance(getattr(exc, "exit_code", None), int):
            show()  # a usage error from the (possibly vendored) click parser
            sys.exit(2)
        if debug:
            raise
        err.print(  # the message may hold any text (a file name): never read as markup
            f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
            style="red",
            markup=False,
        )
        sys.exit(3)
    sys.exit(code if isinstance(code, int) else 0)  # typer.Exit(n) comes back as a value


def run() -> NoReturn:
    """The console entry point: ``main()``, then leave without the interpreter's teardown.

    Freeing every imported module at exit costs 8 ms of the 73 ms that ``import typer`` and
    its exit take here, and a ``check`` that imported libcst and GitPython pays more; the
    operating system reclaims the memory at once. Everything a command writes is done (and
    its locks released) inside ``main()``, which tests call directly; only the standard
    streams are left to flush."""
    try:
        main()
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what the interpreter does with a message
        code = 1
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: started with the descriptor closed
            with contextlib.suppress(OSError, ValueError):  # a reader that went away
                stream.flush()
    os._exit(code or 0)
