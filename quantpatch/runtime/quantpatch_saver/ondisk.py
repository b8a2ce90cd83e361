"""The files on disk: the bytes of a saver file (what ``torch.save`` writes) and how they are
written (one ``os.writev``, through a temporary name, whole or not at all).

A file is what ``torch.save(obj, f, _use_new_zipfile_serialization=False)`` writes, its
non-zip format: ``torch.load`` (``weights_only=True`` too) reads it at 0.7 ms per 2 MiB
against 1.9 ms for the zip format, whose CRC-32 and record layout cost more than the write
itself. A tensor of a dtype that format cannot hold (``LEGACY_DTYPES``) is written in the zip
format, ``torch.save``'s default, as is every file on a torch whose ``torch.save`` has no
such keyword. With ``pickler`` in ``TENSOR_SAVE_ACCELERATORS`` the saver's usual dict is
pickled by ``pickler.py`` instead (the same bytes, 64 against 190 us a file)."""

from __future__ import annotations

import inspect
import io
import os
import pickle
from pathlib import Path
from typing import IO, Any, cast

import torch

from . import pickler, settings
from .dtypes import LEGACY_DTYPES, memory_of, plain_host

_LEGACY_KEYWORD = "_use_new_zipfile_serialization"
LEGACY_FORMAT = _LEGACY_KEYWORD in inspect.signature(torch.save).parameters
"""Whether this torch's ``torch.save`` takes the keyword of its non-zip format (every torch
from 1.6 on does; where one does not, files are in the zip format)."""


class _Recorder:
    """The bytes of ``torch.save(obj)`` in its non-zip format, recorded instead of written (the
    default path, and what the pickler accelerator declines): the pickles are copied, and
    the host tensor's own bytes, which the format writes whole after them, are kept as a
    view of its memory (alive until the file is written). The file then goes out in one
    ``os.writev`` where torch.save made seven writes.

    The view is taken only where it is certainly the same bytes: ``host`` is a plain tensor
    in host memory, and the list of storage keys torch pickles last (before it flushes)
    holds one key, so the only storage written is ``host``'s own. A tensor in the metadata,
    a tensor subclass that wraps others, or a tensor on another device is copied as
    torch.save writes it."""

    def __init__(self, host: torch.Tensor | None) -> None:
        self.parts: list[Any] = []
        self.small = bytearray()
        self.host = host
        plain = plain_host(host)
        self.nbytes = host.untyped_storage().nbytes() if plain and host is not None else -1
        self.last = 0  # where the last write before the flush begins in ``small``
        self.pickled = False  # torch.save flushes once its pickles are written
        self.single = False  # one storage to write: ``host``'s

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if self.single and size == self.nbytes >= _VIEW_MIN:
            assert self.host is not None
            if self.small:
                self.parts.append(self.small)
                self.small = bytearray()
            self.parts.append(memory_of(self.host))
            self.single = False  # once
        else:
            if not self.pickled:
                self.last = len(self.small)
            self.small += view
        return size

    def flush(self) -> None:
        if not self.pickled and self.nbytes >= _VIEW_MIN:
            try:  # torch's own pickle of a list of strings, made a moment ago
                keys = pickle.loads(self.small[self.last :])
            except Exception:
                keys = None
            self.single = isinstance(keys, list) and len(keys) == 1
        self.pickled = True

    def done(self) -> list[Any]:
        if self.small:
            self.parts.append(self.small)
            self.small = bytearray()
        return self.parts


_VIEW_MIN = 1 << 16
"""The smallest storage kept as a view of the tensor's memory rather than copied (bytes)."""


def torch_bytes(obj: Any, host: torch.Tensor | None) -> list[Any]:
    """What ``torch.save`` writes for ``obj`` (its non-zip format where it holds ``host``'s
    dtype, else its zip format), in pieces; ``host`` is the tensor in ``obj``. A tensor torch
    cannot save at all (sub-byte integers) raises, and is counted as failed with torch's
    reason."""
    if host is not None and (host.dtype not in LEGACY_DTYPES or not LEGACY_FORMAT):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return [buffer.getbuffer()]
    if settings.accelerated("pickler") and plain_host(host):
        assert host is not None
        parts = pickler.plain_bytes(obj, host)
        if parts is not None:
            return parts
    recorder = _Recorder(host)
    torch.save(obj, cast(IO[bytes], recorder), **{_LEGACY_KEYWORD: False})
    return recorder.done()


def write_all(fd: int, parts: list[Any]) -> None:
    """Write ``parts`` in order, in one ``os.writev`` unless it is cut short (a signal, a full
    disk), which releases the GIL while the bytes are copied."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        done = os.writev(fd, views) if len(views) > 1 else os.write(fd, views[0])
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][done:]


def create(path: Path, mode: int) -> int:
    """``path`` opened for writing (``mode``: ``os.O_TRUNC`` or ``os.O_APPEND``), created if
    need be, with its directory: made on the first file there (or after it was removed), not
    looked up for every file."""
    flags = os.O_WRONLY | os.O_CREAT | mode
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, 0o644)


def append(path: Path, parts: list[Any]) -> None:
    """Append ``parts`` whole or not at all (a failed write is cut off again)."""
    fd = create(path, os.O_APPEND)
    try:
        start = os.fstat(fd).st_size
        try:
            write_all(fd, parts)
        except BaseException:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
