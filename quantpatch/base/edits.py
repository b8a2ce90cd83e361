"""``Edit``: the one object that changes a file, its unified diff, and the atomic writer.

``apply_edits`` is all-or-nothing across files: every new content is first written to a
temporary file beside its target and flushed to disk; only then are the targets replaced, and
if any replacement fails every file already replaced is put back from the old text.

Against SIGKILL and power loss the writer keeps a *journal* (``begin_journal``): copies of
every file as it was and the hash of the record that marks the operation complete, written and
synced before the first replacement. ``recover_journal``, run by the next command under the
lock, finishes nothing by guesswork: if the record is there the operation completed and the
journal is dropped, otherwise every file is put back as it was.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from quantpatch.base import faults
from quantpatch.base.errors import UserError


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


def umask() -> int:
    """The process's umask, read without changing it where Linux says it
    (``/proc/self/status``); elsewhere set and put back at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode() -> int:
    """The mode a new file the user shares gets, as ``open`` would make it: 0o666 under the
    umask (0644 under 022). ``mkstemp``'s temp files are 0600 whatever the umask."""
    return 0o666 & ~umask()


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


def _sweep_temps(target: Path) -> None:
    """Remove temporary files a killed writer left beside ``target`` (ours by name)."""
    with contextlib.suppress(OSError):
        for leftover in target.parent.glob(f".{target.name}.*.quantpatch-tmp"):
            leftover.unlink()


def _sync_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _sha_or_none(text: str | None) -> str | None:
    return None if text is None else sha256_text(text)


def begin_journal(
    journal: Path, edits: Sequence[Edit], record: Path, record_text: str | None
) -> None:
    """Write (and sync) the journal of a multi-file write before anything is replaced: the
    old text of each file, and the record whose presence marks the operation complete
    (``record_text=None``: complete when ``record`` is gone)."""
    if journal.exists():
        shutil.rmtree(journal)
    files = {}
    for e in edits:
        if e.old is not None:
            _sync_write(journal / "before" / e.rel, e.old)
        files[e.rel] = {"before": _sha_or_none(e.old), "after": _sha_or_none(e.new)}
    meta = {"files": files, "record": str(record), "record_sha": _sha_or_none(record_text)}
    faults.step("journal write", done=False)
    _sync_write(journal / "journal.json", json.dumps(meta, indent=1) + "\n")
    faults.step("journal write", done=True)


@contextlib.contextmanager
def journaled(
    journal: Path, root: Path, edits: Sequence[Edit], record: Path, record_text: str | None
) -> Iterator[None]:
    """Run a multi-file write and its record under a journal. Any exception inside (a full
    disk, Ctrl-C) rolls back at once; a kill leaves the journal to the next command."""
    begin_journal(journal, edits, record, record_text)
    try:
        yield
    except BaseException:
        recover_journal(journal, root)
        raise
    end_journal(journal)


def end_journal(journal: Path) -> None:
    faults.step("journal drop", done=False)
    shutil.rmtree(journal, ignore_errors=True)
    faults.step("journal drop", done=True)


def journal_record(journal: Path) -> Path | None:
    """The record an interrupted journaled write commits to (which command's write it was),
    None where there is no readable journal."""
    try:
        meta = json.loads((journal / "journal.json").read_text(encoding="utf-8"))
        return Path(meta["record"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recover_journal(journal: Path, root: Path) -> list[str]:
    """Finish what an interrupted writer left: drop the journal when its record shows the
    operation completed, else put every file back as it was. Returns the files put back."""
    meta_path = journal / "journal.json"
    if not meta_path.is_file():
        if journal.exists():  # killed while writing the journal: nothing was replaced yet
            shutil.rmtree(journal, ignore_errors=True)
        return []
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        files: dict[str, dict[str, str | None]] = meta["files"]
        record_now = read_exact(Path(meta["record"]))
    except (ValueError, KeyError, TypeError, OSError):
        raise UserError(
            f"{meta_path}: the journal of an interrupted write is unreadable; check the files it "
            "names, then remove it."
        ) from None
    put_back: list[str] = []
    if _sha_or_none(record_now) != meta["record_sha"]:
        edits = []
        for rel, info in files.items():
            current = read_exact(root / rel)
            now = _sha_or_none(current)
            if now == info["before"]:
                continue
            if now != info["after"]:
                raise UserError(
                    f"{rel}: changed after an interrupted quantpatch write, so quantpatch will "
                    f"not put it back; compare it with {journal / 'before' / rel}, then remove "
                    f"{journal}."
                )
            before = read_exact(journal / "before" / rel) if info["before"] else None
            edits.append(Edit(rel, current, before))
        put_back = apply_edits(root, edits)
    for rel in files:
        _sweep_temps(root / rel)
    shutil.rmtree(journal, ignore_errors=True)
    return put_back


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
            _sweep_temps(root / e.rel)
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
            faults.step(f"replace {e.rel}", done=False)
            if tmp is None:
                (root / e.rel).unlink()
            else:
                os.replace(tmp, root / e.rel)
            done.append(e)
            faults.step(f"replace {e.rel}", done=True)
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
