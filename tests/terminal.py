"""A command run at a real terminal (a pty), as an interactive user runs it.

The child's output is read until end of file (the pty's other side closed by the exit), so
nothing here waits on time."""

from __future__ import annotations

import os
import pty
import re
import subprocess

from .test_scripts import QUANTPATCH

HIDE, SHOW = "\x1b[?25l", "\x1b[?25h"

# what a terminal interprets rather than shows: control sequences (colours, cursor moves,
# erase) and operating-system commands (hyperlinks, titles)
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def run_in_pty(*args: object, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``quantpatch ARGS`` with its stdin, stdout and stderr on a pty; its exit code and all
    it wrote there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [QUANTPATCH, *map(str, args)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color", **(env or {})},
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every holder of the other side has closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


def assert_cursor_shown(text: str, *, hidden: bool = True) -> None:
    assert "internal error" not in text, text
    assert "Traceback" not in text, text
    if hidden:
        assert HIDE in text, "the progress display never showed: the test tests nothing"
    if HIDE in text:
        assert SHOW in text and text.rindex(SHOW) > text.rindex(HIDE), repr(text[-400:])


def screen_lines(text: str) -> list[str]:
    """What a terminal shows of ``text``, line by line: escape sequences dropped, a carriage
    return (the pty's ``\\r\\n``, a spinner redrawn in place) ending a line."""
    return [line for line in _ESCAPES.sub("", text).splitlines() if line.strip()]
