"""The ``quantpatch`` app every command group registers on, its two consoles (made on
first use), the global options, and the small printing helpers the groups share."""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import typer

from quantpatch import __version__
from quantpatch.base.config import QUANT_TYPES

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

    def made(self) -> "Console":
        """The rich ``Console`` itself (made now if it was not yet)."""
        if self._console is None:
            self._console = self._make()
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.made(), name)

    # dunder methods are looked up on the type, never through __getattr__: rich's Live and
    # Progress use the console as a context manager (``with console:``)
    def __enter__(self) -> "Console":
        return self.made().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.made().__exit__(*exc)


def real_console(console: "Console") -> "Console":
    """The rich ``Console`` behind ``out`` or ``err``: what rich's ``Progress``, ``Live`` and
    ``status`` must be handed (they check its type and use it as a context manager)."""
    return console.made() if isinstance(console, _OnFirstUse) else console


def restore_cursor() -> None:
    """Show the terminal's cursor again if a progress display hid it and was cut short (an
    error, Ctrl-C): nothing where ``err`` was never made or is not a terminal."""
    made = err._console if isinstance(err, _OnFirstUse) else err
    if made is not None and made.is_terminal:
        made.show_cursor(True)


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


def repo_root(local: Path | None) -> Path | None:
    return local or OPTS.repo


def commit_note(commit: str | None) -> str:
    return f"; commit {commit[:12]}" if commit else ""


def print_notes(notes: list[str]) -> None:
    for note in notes:
        err.print(f"note: {note}", style="yellow", markup=False)


def emit_json(data: Any) -> None:
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
