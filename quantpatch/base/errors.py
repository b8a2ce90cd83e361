"""The two kinds of failure a user sees, mapped onto the contract's exit codes."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad value, missing file, dirty tree, lock held): exit 2.

    The message is one sentence that names the file (and line) involved.
    """

    exit_code = 2


class CheckFailed(Exception):
    """A check that did not hold (``--expect``, sites of one role that disagree): exit 1."""

    exit_code = 1
