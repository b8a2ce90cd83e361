"""The pickler accelerator: ``torch.save``'s legacy pickles, byte for byte, for the saver's
usual object (a dict of plain values and one plain host tensor), written without torch's
per-object Python callbacks. Opt-in: ``pickler`` in ``TENSOR_SAVE_ACCELERATORS``; the
default is ``torch.save`` itself (``ondisk.torch_bytes``), which also takes whatever this
pickler declines (``plain_bytes`` returns None).

It reproduces torch's legacy format from torch-private names (``torch._utils.
_rebuild_tensor_v2``, ``TypedStorage._untyped_storage``, ``_pickle_storage_type``, ``_size``,
``UntypedStorage._cdata``), so it runs only on a torch whose version it was checked on
(``CHECKED``) and where those names are there (``why_not``); on any other torch it declines
every object and ``torch.save`` writes the files."""

from __future__ import annotations

import functools
import io
import pickle
import re
from collections import OrderedDict
from typing import IO, Any

import torch

from .dtypes import memory_of

CHECKED = ((2, 1), (2, 13))
"""The oldest and newest torch (major, minor) whose ``torch.save`` bytes this pickler was
compared with; the tests compare them on every run."""


@functools.cache
def why_not() -> str:
    """ "" where this pickler may run on this torch, else why not (cached: call
    ``why_not.cache_clear()`` after changing torch's names, as the tests do)."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    version = (int(found[1]), int(found[2])) if found else None
    if version is None or not CHECKED[0] <= version <= CHECKED[1]:
        low, high = (".".join(map(str, v)) for v in CHECKED)
        return f"torch {torch.__version__} is not one it was checked on ({low} to {high})"
    storage = torch.empty(1).untyped_storage()
    try:
        typed = torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=storage, dtype=torch.float32, _internal=True
        )
    except (AttributeError, TypeError):
        return "this torch has no TypedStorage to pickle"
    needs = {
        "torch._utils._rebuild_tensor_v2": getattr(torch._utils, "_rebuild_tensor_v2", None),
        "TypedStorage._untyped_storage": getattr(typed, "_untyped_storage", None),
        "TypedStorage._pickle_storage_type": getattr(typed, "_pickle_storage_type", None),
        "TypedStorage._size": getattr(typed, "_size", None),
        "UntypedStorage._cdata": getattr(storage, "_cdata", None),
        "torch.serialization.location_tag": getattr(torch.serialization, "location_tag", None),
        "torch.serialization.DEFAULT_PROTOCOL": getattr(
            torch.serialization, "DEFAULT_PROTOCOL", None
        ),
    }
    missing = [name for name, value in needs.items() if value is None]
    return f"this torch has no {', '.join(missing)}" if missing else ""


def status() -> str:
    why = why_not()
    return "pickler" if not why else f"torch.save ({why})"


class _NotPlain(Exception):
    """An object the plain pickler leaves to torch.save."""


_ATOMS = frozenset({dict, list, tuple, str, int, float, bool, type(None)})


class _PlainPickler(pickle.Pickler):
    """torch.save's legacy pickler for a dict of plain values and one plain host tensor.

    torch's own ``persistent_id`` (a Python closure, called for every object pickled: 61
    times for one saver file) and its per-call class and header set-up took 150 of the 190
    us a file cost; this one answers the same for the objects it knows and raises
    ``_NotPlain`` for any other (another tensor or storage, a module class, a subclass),
    which sends the whole object to torch.save. The persistent id is the tuple torch's
    legacy format writes for a typed storage: ``("storage", type, key, location, numel,
    None)``."""

    def __init__(self, file: IO[bytes], host: torch.Tensor) -> None:
        super().__init__(file, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.host = host
        self.storage = host.untyped_storage()
        self.known: tuple[Any, ...] = (host, torch._utils._rebuild_tensor_v2, OrderedDict)
        self.key: str | None = None

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMS:
            return None
        if kind is torch.storage.TypedStorage:
            storage = obj._untyped_storage
            if (
                self.key is not None
                or storage._cdata != self.storage._cdata
                or obj.dtype != self.host.dtype  # the element count is written in host's
            ):
                raise _NotPlain
            self.key = str(storage._cdata)
            storage_type = getattr(torch, obj._pickle_storage_type())
            self.known += (storage_type,)
            location = torch.serialization.location_tag(storage)
            return ("storage", storage_type, self.key, location, obj._size(), None)
        if (kind is OrderedDict and not obj) or any(obj is k for k in self.known):
            return None  # the tensor's own reduction: its rebuild function and empty hooks
        raise _NotPlain


@functools.cache
def _legacy_header() -> bytes:
    """The three pickles torch.save's legacy format starts with (magic number, protocol
    version, system information), taken from torch.save itself."""
    buffer = io.BytesIO()
    torch.save(None, buffer, _use_new_zipfile_serialization=False)
    buffer.seek(0)
    unpickler = pickle.Unpickler(buffer)
    for _ in range(3):
        unpickler.load()
    return buffer.getvalue()[: buffer.tell()]


def plain_bytes(obj: Any, host: torch.Tensor) -> list[Any] | None:
    """What torch.save writes for ``obj`` (legacy format) when the plain pickler knows all of
    it, else None: the pickles, the keys of the one storage, its element count, and a view
    of its bytes. None on a torch it was not checked on (``why_not``)."""
    if why_not():
        return None
    buffer = io.BytesIO()
    buffer.write(_legacy_header())
    pickler = _PlainPickler(buffer, host)
    try:
        pickler.dump(obj)
    except _NotPlain:
        return None
    if pickler.key is None:
        return None
    pickle.dump([pickler.key], buffer, protocol=torch.serialization.DEFAULT_PROTOCOL)
    storage = pickler.storage
    buffer.write((storage.nbytes() // host.element_size()).to_bytes(8, "little"))
    return [buffer.getvalue(), memory_of(host)]
