"""``Edit``: the one object that changes a file, its unified diff, and the atomic writer.

``apply_edits`` is all-or-nothing across files: every new content is first written to a
temporary file beside its target and flushed to disk; only then are the targets replaced, and
if any replacement fails every file already replaced is put back from the old text.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from quantpatch.errors import UserError


@dataclass(frozen=True)
class Edit:
    """Set the whole text of ``rel`` (relative to the checkout root).

    ``old is None``: the file does not exist yet (created); ``new is None``: it is deleted.
    """

    rel: str
    old: str | None
    new: str | None
    mode: int | None = None
    """Permission bits for the written file (default: keep the old file's, 0o644 if new)."""

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def diff(self) -> str:
        return "".join(
            difflib.unified_diff(
                (self.old or "").splitlines(keepends=True),
                (self.new or "").splitlines(keepends=True),
                fromfile="/dev/null" if self.old is None else f"a/{self.rel}",
                tofile="/dev/null" if self.new is None else f"b/{self.rel}",
            )
        )


def unified_diff(edits: Iterable[Edit]) -> str:
    return "".join(e.diff() for e in edits if e.changed)


def _write_temp(target: Path, text: str, mode: int | None = None) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".quantpatch-tmp", dir=target.parent
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is None:
            mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
        os.chmod(tmp, mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_exact(path: Path) -> str | None:
    """The file's text with its newlines as they are (CRLF kept); ``None`` if it is missing.
    A file that is not UTF-8 text, or cannot be read, is a ``UserError``."""
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            return fh.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except UnicodeDecodeError:
        raise UserError(f"{path}: the file is not UTF-8 text.") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}).") from None


def write_exact(path: Path, text: str) -> None:
    """Write ``text`` as it is (no newline translation), creating parent directories; for
    records under the state directory (checkout files go through ``apply_edits``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)


def _put(path: Path, text: str | None) -> None:
    if text is None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        os.replace(_write_temp(path, text), path)


def apply_edits(root: Path, edits: Sequence[Edit]) -> list[str]:
    """Write every changed edit or none; returns the relative paths written.

    Each target must still hold ``edit.old`` (a concurrent change is refused, nothing written).
    New contents go to temporary files beside their targets first; a failure while replacing
    puts back every file already replaced, so the checkout is never half-written.
    """
    todo = [e for e in edits if e.changed]
    for e in todo:
        if read_exact(root / e.rel) != e.old:
            raise UserError(f"{e.rel}: the file changed while quantpatch was planning; run again.")
    temps: list[tuple[Edit, Path | None]] = []
    try:
        for e in todo:
            temps.append((e, None if e.new is None else _write_temp(root / e.rel, e.new, e.mode)))
    except OSError as exc:
        for _, tmp in temps:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        raise UserError(f"{e.rel}: cannot write ({exc.strerror}); nothing was changed.") from None
    done: list[Edit] = []
    try:
        for e, tmp in temps:
            if tmp is None:
                (root / e.rel).unlink()
            else:
                os.replace(tmp, root / e.rel)
            done.append(e)
    except BaseException as exc:
        for e in reversed(done):
            _put(root / e.rel, e.old)
        for _, tmp in temps:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        if isinstance(exc, OSError):
            raise UserError(
                f"{exc.filename or 'a target file'}: write failed ({exc.strerror}); every file "
                "was left as it was."
            ) from None
        raise
    return [e.rel for e in todo]
