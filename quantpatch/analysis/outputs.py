"""Where the analysis commands write (``report --out``, ``tensors plot --out``, ``runs
--plot``): the destination is checked before any work, so that a bad one is one sentence
(exit 2) and not an internal error after minutes of work; a file is written through a temp
file of an unpredictable name created beside it (``O_EXCL``) and renamed over it, never
through a symbolic link, never over one of the command's own inputs."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpatch.base.edits import shared_mode
from quantpatch.base.errors import UserError


def _make_dirs(path: Path, what: str) -> list[Path]:
    """Create ``path`` and its missing parents; the ones created, outermost first."""
    missing: list[Path] = []
    p = path
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    if p.exists() and not p.is_dir():
        raise UserError(f"{what} {path}: {p} is not a directory.")
    created: list[Path] = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except OSError as exc:
            remove_dirs(created)
            raise UserError(f"{what} {path}: cannot create {d} ({exc.strerror or exc}).") from None
        created.append(d)
    return created


def remove_dirs(created: list[Path]) -> None:
    """Remove the directories ``_make_dirs`` created, innermost first, where still empty."""
    for d in reversed(created):
        with contextlib.suppress(OSError):
            d.rmdir()


def _probe(directory: Path, what: str, target: Path, created: list[Path]) -> None:
    """Create and remove a file in ``directory``: the one test of writability that holds
    for root and for /proc alike."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".quantpatch-", suffix=".probe")
    except OSError as exc:
        remove_dirs(created)
        raise UserError(f"{what} {target}: cannot write in {directory} "
                        f"({exc.strerror or exc}).") from None  # fmt: skip
    os.close(fd)
    os.unlink(name)


def prepare_dir(path: Path, what: str = "--out") -> list[Path]:
    """Check (and create) a directory to write figures in, before any work: one that is a
    file, or where nothing can be written, is refused. Returns the directories created
    (``remove_dirs`` undoes them if the work fails)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path}: exists and is not a directory; give a directory.")
    created = _make_dirs(path, what)
    _probe(path, what, path, created)
    return created


@contextlib.contextmanager
def output_dir(path: Path, what: str = "--out") -> Iterator[Path]:
    """``prepare_dir`` before the work; the directories it created removed again (where
    still empty) if the work fails."""
    created = prepare_dir(path, what)
    try:
        yield path
    except BaseException:
        remove_dirs(created)
        raise


@dataclass
class AtomicFile:
    """A file being written: ``write`` then ``commit`` renames it over the destination;
    ``discard`` (any failure) removes the temp file and the directories created for it."""

    out: Path
    tmp: Path
    fd: int
    created: list[Path] = field(default_factory=list)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.out)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            self.tmp.unlink()
        remove_dirs(self.created)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


@contextlib.contextmanager
def atomic_file(
    out: Path, inputs: Iterable[Path] = (), what: str = "--out"
) -> Iterator[AtomicFile]:
    """Check ``out`` before any work and yield the file to write it through: refused when it
    is a directory, a symbolic link, or one of ``inputs``; its directory is created and a
    temp file of an unpredictable name opened in it with ``O_EXCL`` (a link planted at a
    predictable ``out.tmp`` is never followed). Committed by the caller; removed with the
    directories created for it if the body fails."""
    if out.is_symlink():
        raise UserError(f"{what} {out}: is a symbolic link; give the file itself.")
    if out.is_dir():
        raise UserError(f"{what} {out}: is a directory; give a file name such as report.html.")
    if out.exists():
        for p in inputs:
            if _same_file(out, p):
                raise UserError(f"{what} {out}: is one of the inputs ({p}); give another file.")
    created = _make_dirs(out.parent, what)
    try:
        fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.fchmod(fd, shared_mode())  # a report is shared: the umask's mode, not mkstemp's 0600
    except OSError as exc:
        remove_dirs(created)
        raise UserError(f"{what} {out}: cannot write there ({exc.strerror or exc}).") from None
    f = AtomicFile(out, Path(name), fd, created)
    try:
        yield f
    except BaseException:
        f.discard()
        raise
    if f.fd >= 0:  # the body did not commit: nothing is written
        f.discard()


def format_value(v: Any) -> str:
    """One cell: 4 significant digits, '-' for missing, inf spelled out."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.4g}"
    return str(v)
