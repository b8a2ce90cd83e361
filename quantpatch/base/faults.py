"""A fault-injection seam for the crash-safety tests (inert unless its variables are set).

Every internal step that changes something (each git command, each file swap, each record
write) calls ``step(label)``. With ``QUANTPATCH_FAULT_AT=n`` the n-th step of the process
fails: ``QUANTPATCH_FAULT_KIND=kill`` (default) sends the process SIGKILL *after* the step has
taken effect, as a power cut or ``kill -9`` would; ``fail`` raises the error a failing git
command or a full disk gives *instead of* the step; ``interrupt`` raises ``KeyboardInterrupt``
right after it, as Ctrl-C does; ``enospc`` raises the ``OSError`` of a full disk instead of
it. ``QUANTPATCH_FAULT_TRACE=FILE`` appends each step's label to FILE, so a test can count the
steps of a command and hit every one. ``pause(label)`` is a barrier the test controls
(``QUANTPATCH_FAULT_PAUSE``): the process stops there until the test lets it go or signals it,
so no test has to poll for a moment.
"""

from __future__ import annotations

import os
import signal

from quantpatch.base.errors import UserError

_count = 0


def step(label: str, *, done: bool) -> None:
    """Mark a step: call with ``done=False`` right before it (where ``fail`` strikes) and
    ``done=True`` right after it (where ``kill`` strikes)."""
    at = os.environ.get("QUANTPATCH_FAULT_AT")
    trace = os.environ.get("QUANTPATCH_FAULT_TRACE")
    if not at and not trace:
        return
    global _count
    if not done:
        _count += 1
        if trace:
            with open(trace, "a", encoding="utf-8") as fh:
                fh.write(f"{_count} {label}\n")
    if not at or int(at) != _count:
        return
    kind = os.environ.get("QUANTPATCH_FAULT_KIND", "kill")
    if kind == "enospc" and not done:
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if kind == "fail" and not done:
        raise UserError(f"{label} failed (injected fault at step {_count}).")
    if kind == "kill" and done:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "interrupt" and done:
        raise KeyboardInterrupt


def pause(label: str) -> None:
    """A barrier a test holds the process at, to act on it mid-way (send it a signal, look at
    what it has made so far) without polling. With ``QUANTPATCH_FAULT_PAUSE=FIFO`` (a named
    pipe the test made) and ``QUANTPATCH_FAULT_PAUSE_AT=label``, the process writes
    ``"<pid> <label>"`` into the pipe (blocking until the test reads it), then waits until
    the test has opened the pipe for writing and closed it again (nothing written: no line
    of the test's can be taken for the process's next one), or a signal ends it. Inert
    unless both are set."""
    fifo = os.environ.get("QUANTPATCH_FAULT_PAUSE")
    if not fifo or os.environ.get("QUANTPATCH_FAULT_PAUSE_AT") != label:
        return
    with open(fifo, "w", encoding="utf-8") as fh:
        fh.write(f"{os.getpid()} {label}\n")
    with open(fifo, encoding="utf-8") as fh:
        fh.read()  # end of file once the test's writer is closed
