"""The ``quantpatch`` command line: parse, call a plain function, print. No logic lives here.

Heavy modules (libcst, GitPython, the codemods) are imported inside the commands so that
``quantpatch --help`` stays fast; torch is never imported by the CLI.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from quantpatch import __version__
from quantpatch.errors import CheckFailed, UserError

if TYPE_CHECKING:
    from quantpatch.switch import CheckReport

app = typer.Typer(
    name="quantpatch",
    help="Switch, record and instrument the low-precision formats of a Megatron-LM checkout.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
out = Console(highlight=False, soft_wrap=True)
if not out.is_terminal:  # piped or captured: never truncate file paths in tables
    out = Console(highlight=False, soft_wrap=True, width=200)
err = Console(stderr=True, highlight=False, soft_wrap=True)


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


def _emit_json(data: Any) -> None:
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


def _print_check(report: CheckReport) -> None:
    from rich.table import Table

    table = Table(title=f"custom_quant_type sites in {report.root}", title_justify="left")
    for col in ("role", "file:line", "function", "value", "form"):
        table.add_column(col)
    for s in report.sites:
        table.add_row(s.role, f"{s.file}:{s.line}", s.function, s.value or s.source, s.form)
    out.print(table)
    roles = "  ".join(f"{r}={v if v is not None else '?'}" for r, v in report.roles.items())
    out.print(f"roles: {roles}")
    if report.git:
        g = report.git
        head = g.head[:12] if g.head else "no commit"
        out.print(
            f"git: {g.branch or 'detached HEAD'} @ {head} ({'clean' if g.clean else 'dirty'})"
        )
    else:
        out.print("git: not a git repository")
    if report.base:
        b = report.base
        where = f"{b.get('branch') or 'detached'} @ {(b.get('commit') or '')[:12]}"
        out.print(
            f"base ({b['mode']}): {where}"
            if b["mode"] == "branch"
            else "base: in-place set active (originals kept under the state directory)"
        )
    else:
        out.print("base: none (no set active)")
    out.print(f"tensor saver: {'installed' if report.saver['installed'] else 'not installed'}")


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
    from quantpatch.switch import check as run_check
    from quantpatch.switch import parse_expect

    wanted = parse_expect(expect) if expect else None
    report = run_check(_repo(repo))
    problems = report.problems(wanted)
    if json_ or OPTS.json:
        _emit_json({**report.as_json(), "problems": problems})
    else:
        _print_check(report)
    if problems:
        raise CheckFailed(" ".join(problems))


@app.command("set")
def set_(
    linear: str | None = typer.Option(None, "--linear", help="Value of the linear sites."),
    qk: str | None = typer.Option(None, "--qk", help="Value of the Q.K^T site(s)."),
    pv: str | None = typer.Option(None, "--pv", help="Value of the P.V site(s)."),
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
    """Rewrite the named roles; in git, on branch quant/linear-X_qk-Y_pv-Z from the base."""
    from quantpatch.config import load_schemes
    from quantpatch.switch import SetRequest, set_values

    values: dict[str, str] = {}
    if scheme is not None:
        schemes = load_schemes(config)
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
    for note in result.notes:
        err.print(f"note: {note}", style="yellow")
    if dry_run:
        sys.stdout.write(result.diff)
        if not result.diff:
            err.print("no change: the checkout already holds these values.")
        return
    vals = " ".join(f"{r}={v}" for r, v in result.values.items())
    if result.branch:
        how = "reused" if result.reused else "created"
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
def restore(repo: Path | None = RepoOpt) -> None:
    """Put the checkout back on the recorded base, byte-identical, and clear the record."""
    from quantpatch.switch import restore as run_restore

    result = run_restore(_repo(repo))
    for note in result.notes:
        err.print(f"note: {note}", style="yellow")
    if result.mode == "branch":
        b = result.base
        out.print(f"restored: {b['branch'] or 'detached HEAD'} @ {b['commit'][:12]}")
    else:
        out.print(f"restored the original bytes of {', '.join(result.files)}")


@app.command()
def demo(
    directory: Path = typer.Argument(
        Path("quantpatch-demo"), help="Where to build the demo checkout (must be new or empty)."
    ),
    megatron_core: str = typer.Option("0.13.1", "--megatron-core", help="megatron-core release."),
) -> None:
    """Build a demo checkout from megatron-core and walk check -> set -> check -> restore."""
    from quantpatch.demo import build_checkout, walk

    out.rule(f"building {directory} from megatron-core {megatron_core}")
    build_checkout(directory, megatron_core)
    walk(directory, out)


def main() -> None:
    """Entry point: run the app, map errors onto exit codes and one-sentence messages."""
    debug = "--debug" in sys.argv[1:]
    command = typer.main.get_command(app)
    try:
        command.main(args=sys.argv[1:], prog_name="quantpatch", standalone_mode=False)
    except (UserError, CheckFailed) as exc:
        if debug:
            raise
        label = "error" if isinstance(exc, UserError) else "check failed"
        err.print(f"{label}: {exc}", style="red" if isinstance(exc, UserError) else "yellow")
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
        err.print(
            f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
            style="red",
        )
        sys.exit(3)
    sys.exit(0)
