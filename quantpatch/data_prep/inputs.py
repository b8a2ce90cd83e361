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


def check_readable(path: Path) -> None:
    if not path.exists():
        raise UserError(f"{path}: no such input.")
    if path.is_dir():
        kind_of(path)
        return
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror}).") from None
    kind_of(path)


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
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _text_of(record: Any, key: str, where: str) -> Text:
    if not isinstance(record, dict):
        raise UserError(f"{where}: the record is a {type(record).__name__}, not a JSON object.")
    if key not in record:
        raise UserError(f"{where}: the record has no '{key}' field (--text-key).")
    text = record[key]
    if isinstance(text, str):
        return text
    if isinstance(text, list) and all(isinstance(t, str) for t in text):
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
                raise UserError(f"{path}:{number + 1}: not UTF-8 ({exc.reason}).") from None
            except (OSError, EOFError, ValueError) as exc:
                raise UserError(f"{path}: cannot be decompressed ({exc}).") from None
            if not line:
                return
            number += 1
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise UserError(f"{path}:{number}: not a JSON line ({exc}).") from None
            yield _text_of(record, key, f"{path}:{number}"), len(line)


def _arrow_rows(path: Path, batches: Iterator[Any], key: str) -> Iterator[tuple[Text, int]]:
    row = 0
    for batch in batches:
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
    yield from _arrow_rows(path, reader.iter_batches(batch_size=4096, columns=None), key)


def _pyarrow_parquet(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"{path}: reading Parquet needs pyarrow (pip install 'pyarrow>=14')."
        ) from None
    return pq


def _hf_folder(path: Path, key: str) -> Iterator[tuple[Text, int]]:
    _pyarrow_parquet(path)
    import pyarrow as pa

    state = path / "state.json"
    files: list[Path]
    if state.is_file():
        try:
            listed = json.loads(state.read_text(encoding="utf-8"))["_data_files"]
            files = [path / f["filename"] for f in listed]
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{state}: not a `save_to_disk` state ({exc}).") from None
    else:
        files = sorted(path.glob("*.arrow"))
    for f in files:
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(f), "r"))
        except Exception as exc:
            raise UserError(f"{f}: not an Arrow stream ({exc}).") from None
        yield from _arrow_rows(f, iter(reader), key)


def documents(path: Path, key: str) -> Iterator[tuple[Text, int]]:
    """Each document's text and its size in input bytes, in file order."""
    kind = kind_of(path)
    if kind == "jsonl":
        yield from _jsonl(path, key)
    elif kind == "parquet":
        yield from _parquet(path, key)
    else:
        yield from _hf_folder(path, key)
