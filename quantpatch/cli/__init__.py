"""The ``quantpatch`` command line: parse, call a plain function, print. No logic lives here.

Heavy modules (libcst, GitPython, the codemods) are imported inside the commands so that
``quantpatch --help`` stays fast; torch is never imported by the CLI.

Each command group is a module (``checkout``, ``launch``, ``analysis``, ``sweep``, ``data``)
registering on ``app.app``; importing them here, in this order, is what orders ``--help``.
Renderers sit beside them (``render_check``, ``render_layout``, ``render_analysis``).
"""

import contextlib
import os
import sys
from typing import Any, NoReturn

import typer

from quantpatch.base.errors import CheckFailed, UserError

# isort: off
# the command groups register on `app` as they are imported: this order is --help's order
from quantpatch.cli import checkout  # noqa: F401
from quantpatch.cli import launch  # noqa: F401
from quantpatch.cli import analysis  # noqa: F401
from quantpatch.cli import sweep  # noqa: F401
from quantpatch.cli import data  # noqa: F401

# isort: on
from quantpatch.cli.app import OPTS, app, err, restore_cursor

__all__ = ["OPTS", "app", "command_for", "main", "run"]


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


def _names_keep_their_bytes() -> None:
    """A path or branch name that is not UTF-8 (held with surrogates, as Python decodes the
    file system's names) is printed as its own bytes, as ``ls`` prints it, where strict
    encoding raised (stderr's default, backslashreplace, is kept)."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            with contextlib.suppress(ValueError, OSError):  # one that cannot: left as it is
                stream.reconfigure(errors="surrogateescape")


def main() -> None:
    """Entry point: run the app, map errors onto exit codes and one-sentence messages."""
    _names_keep_their_bytes()
    debug = "--debug" in sys.argv[1:]
    if debug:
        OPTS.debug = True
    command = command_for(sys.argv[1:])
    try:
        _dispatch(command, debug)
    finally:
        restore_cursor()  # a progress display cut short by an error or Ctrl-C hid it


def _dispatch(command: Any, debug: bool) -> NoReturn:
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
    cov = sys.modules.get("coverage")  # run under coverage (the test suite's children):
    current = cov.Coverage.current() if cov is not None else None
    if current is not None:  # os._exit skips its exit handler, so save what it measured
        current.stop()
        current.save()
    os._exit(code or 0)
