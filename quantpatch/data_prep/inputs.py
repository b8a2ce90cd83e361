"""The documents of the inputs, in order, each with where it came from (file and line, or
file and row): JSON Lines (``.jsonl`` / ``.json``, plain, ``.gz`` or ``.zst``), Parquet, and a
folder written by Hugging Face ``datasets``' ``save_to_disk`` (its Arrow files, in the order
its ``state.json`` lists them). JSON lines are read as Megatron's ``tools/preprocess_data.py``
reads them (text mode, UTF-8, ``json.loads`` per line); the text is the ``text_key`` field, a
string or a list of strings (Megatron's sentences)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

from quantpatch.base.errors import UserError

Text = str | list[str]


def kind_of(path: Path) -> str:
    """``jsonl``, ``parquet`` or ``hf`` (a ``save_to_disk`` folder); refused otherwise."""
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_info.json").is_file():
            return "hf"
        raise UserError(
            f"{path}: a folder that is not a Hugging Face `save_to_disk` dataset "
            "(no state.json or dataset_info.json)."
        )
    name = path.name.lower()
    for ending in (".gz", ".zst"):
        name = name.removesuffix(ending)
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    raise UserError(
        f"{path}: unknown input format (JSON Lines .jsonl/.json, optionally .gz or .zst, "
        "Parquet .parquet, or a `save_to_disk` folder)."
    )


def resolved(path: Path) -> Path:
    """``path`` made absolute, its symlinks resolved; a symlink loop refused."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        raise UserError(f"{path}: a symlink loop (it resolves to itself).") from None


def absolute(path: Path) -> Path:
    """``path`` made absolute with its own name kept (a symlink such as a Hugging Face hub
    cache's ``train.jsonl.zst -> ../../blobs/9f2c1e`` is known by its name, not its blob's)."""
    return Path(os.path.abspath(path))


def check_readable(path: Path) -> None:
    """Refused unless ``path`` is a readable input: a regular file (a FIFO or device is read
    twice, once to fingerprint it and once to tokenize it) or a ``save_to_disk`` folder."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if path.is_symlink():
            target = os.readlink(path)
            raise UserError(f"{path}: a symlink to {target}, which does not exist.") from None
        raise UserError(f"{path}: no such input.") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror}).") from None
    if stat.S_ISDIR(st.st_mode):
        kind_of(path)
        return
    if not stat.S_ISREG(st.st_mode):
        raise UserError(
            f"{path}: not a regular file (a FIFO, socket or device cannot be read twice, "
            "once to fingerprint it and once to tokenize it)."
        )
    kind_of(path)
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror}).") from None


def content_hash(path: Path) -> tuple[int, str]:
    """Size in bytes and sha256 of an input (a folder: its files, by relative name)."""
    h = hashlib.sha256()
    size = 0
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
                size += len(chunk)
    return size, "sha256:" + h.hexdigest()


class _Zstd(io.RawIOBase):
    """A ``.zst`` decompressed frame after frame to the end of the file (``zstandard``'s
    ``stream_reader`` stops after the first frame and takes a file cut short for a whole
    one): a file that ends inside a frame, or is no zstd, raises ``ValueError``."""

    def __init__(self, path: Path, zstandard: Any) -> None:
        self._fh = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._zstd = zstandard
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False  # bytes of the current frame seen and its end not yet
        self._pending = b""
        self._eof = False

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        while not self._pending and not self._eof:
            chunk = self._fh.read(1 << 20)
            if not chunk:
                self._eof = True
                if self._in_frame:
                    raise ValueError("the file ends inside a zstd frame: it was cut short")
                return
            while chunk:
                self._in_frame = True
                try:
                    self._pending += self._obj.decompress(chunk)
                except self._zstd.ZstdError as exc:
                    raise ValueError(f"not zstd, or corrupt: {exc}") from None
                if not self._obj.eof:
                    break
                chunk = self._obj.unused_data  # the next frame starts here
                self._obj = self._dctx.decompressobj()
                self._in_frame = False

    def readinto(self, buffer: Any) -> int:
        self._fill()
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def _open_binary(path: Path) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith(".gz"):
        import gzip

        return cast(IO[bytes], gzip.open(path, "rb"))
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise UserError(
                f"{path}: reading .zst needs zstandard (pip install 'zstandard>=0.22')."
            ) from None
        return cast(IO[bytes], io.BufferedReader(_Zstd(path, zstandard), 1 << 20))
    return open(path, "rb")


def _bad_utf8_line(path: Path) -> int:
    """The line holding the first byte that is not UTF-8, lines counted as text mode counts
    them (a line feed, a carriage return, or both together end a line)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    lines = 1
    last_cr = False
    with _open_binary(path) as fh:
        while chunk := fh.read(1 << 20):
            try:
                decoder.decode(chunk)
                good, bad = chunk, False
            except UnicodeDecodeError as exc:
                good, bad = chunk[: max(exc.start, 0)], True
            if last_cr and good.startswith(b"\n"):  # a \r\n across two chunks: one break
                good = good[1:]
            lines += good.count(b"\n") + good.count(b"\r") - good.count(b"\r\n")
            if good:
                last_cr = good.endswith(b"\r")
            if bad:
                break
    return lines


def _text_of(record: Any, key: str, where: str) -> Text:
    if not isinstance(record, dict):
        raise UserError(f"{where}: the record is a {type(record).__name__}, not a JSON object.")
    if key not in record:
        raise UserError(f"{where}: the record has no '{key}' field (--text-key).")
    text = record[key]
    if isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text)):
        try:  # JSON's "\ud800" escape gives a lone surrogate, which no tokenizer takes
            for part in [text] if isinstance(text, str) else text:
                part.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise UserError(
                f"{where}: '{key}' holds a lone surrogate (U+{ord(exc.object[exc.start]):04X}), "
                "which is not a character and cannot be tokenized."
            ) from None
        return text
    raise UserError(f"{where}: '{key}' is a {type(text).__name__}, not a string.")


def _jsonl(path: Path, key: str) -> Iterator[tuple[Text, int]]:
    raw = _open_binary(path)
    # text mode as Megatron opens its input (universal newlines), UTF-8
    with io.TextIOWrapper(raw, encoding="utf-8") as fh:
        number = 0
        while True:
            try:
                line = fh.readline()
            except UnicodeDecodeError as exc:
                # the text layer decodes ahead of the line it returns: count the lines anew
                at = _bad_utf8_line(path)
                raise UserError(f"{path}:{at}: not UTF-8 ({exc.reason}).") from None
            except (OSError, EOFError, ValueError) as exc:
                raise UserError(f"{path}: cannot be decompressed ({exc}).") from None
            if not line:
                return
            number += 1
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise UserError(f"{path}:{number}: not a JSON line ({exc}).") from None
            except RecursionError:
                raise UserError(f"{path}:{number}: JSON nested too deeply to read.") from None
            yield _text_of(record, key, f"{path}:{number}"), len(line)


def _arrow_rows(path: Path, batches: Iterator[Any], key: str) -> Iterator[tuple[Text, int]]:
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # pyarrow's ArrowInvalid, OSError (a corrupt page), ...
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"{path}: cut short or corrupt after row {row:,} ({first}).") from None
        if batch is None:
            return
        if key not in batch.schema.names:
            raise UserError(f"{path}: no '{key}' column (--text-key); it has {batch.schema.names}.")
        for value in batch.column(key).to_pylist():
            row += 1
            if value is None:
                raise UserError(f"{path}: row {row}: '{key}' is null, not a string.")
            text = _text_of({key: value}, key, f"{path}: row {row}")
            yield text, len(text) if isinstance(text, str) else sum(map(len, text))


def _parquet(path: Path, key: str) -> Iterator[tuple[Text, int]]:
    pq = _pyarrow_parquet(path)
    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:
        raise UserError(f"{path}: not a Parquet file ({exc}).") from None
    yield from _arrow_rows(path, iter(reader.iter_batches(batch_size=4096, columns=None)), key)


def _pyarrow_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"{path}: reading Parquet needs pyarrow (pip install 'pyarrow>=14')."
        ) from None
    return pq


ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The end-of-stream marker an Arrow IPC stream ends with (``datasets`` writes it on close)."""


def split_files(path: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder's split, as its ``state.json`` lists them
    (without it, the folder's ``*.arrow`` may hold ``cache-*`` files and other splits)."""
    state = path / "state.json"
    if not state.is_file():
        raise UserError(
            f"{path}: a `save_to_disk` folder without state.json, which lists the split's "
            "Arrow files (its other *.arrow files may be caches or other splits); save it "
            "again with `save_to_disk`, or pass a split's folder."
        )
    try:
        listed = json.loads(state.read_text(encoding="utf-8"))["_data_files"]
        files = [path / f["filename"] for f in listed]
    except (ValueError, KeyError, TypeError, OSError, RecursionError) as exc:
        raise UserError(f"{state}: not a `save_to_disk` state ({exc}).") from None
    for f in files:
        if f.parent != path or not f.is_file():
            raise UserError(f"{state}: lists {f.name}, which is not a file of {path}.")
    return files


def _hf_folder(path: Path, key: str) -> Iterator[tuple[Text, int]]:
    _pyarrow_parquet(path)
    import pyarrow as pa

    for f in split_files(path):
        try:
            source = pa.memory_map(str(f), "r")
            reader = pa.ipc.open_stream(source)
        except Exception as exc:
            raise UserError(f"{f}: not an Arrow stream ({exc}).") from None
        yield from _arrow_rows(f, iter(reader), key)
        size = f.stat().st_size
        with open(f, "rb") as fh:
            fh.seek(max(size - len(ARROW_EOS), 0))
            tail = fh.read()
        if tail != ARROW_EOS or source.tell() != size:
            raise UserError(
                f"{f}: cut short (the Arrow stream has no end marker; its rows so far were "
                "read, the rest is missing)."
            )


def documents(path: Path, key: str) -> Iterator[tuple[Text, int]]:
    """Each document's text and its size in input bytes, in file order."""
    kind = kind_of(path)
    if kind == "jsonl":
        yield from _jsonl(path, key)
    elif kind == "parquet":
        yield from _parquet(path, key)
    else:
        yield from _hf_folder(path, key)
