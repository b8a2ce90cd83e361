"""What the training thread does with a tensor it hands over: which layer and linear it
belongs to, whether it is the same data as one already handed over, and its snapshot (a host
copy in a buffer used again; on CUDA a device copy, the statistics queued on the device and
the copy to pinned host memory on a side stream, so the training stream never waits)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from .dtypes import clone, raw

# -- which layer and which linear: filled by the TransformerLayer hook ------------------------

_LAYERS: dict[int, Any] = {}
_WEIGHTS: dict[int, tuple[int | None, str]] = {}


def enter_layer(layer: Any) -> None:
    """Called at the start of ``TransformerLayer.forward``: remember the layer so that the
    linear calls inside it can be named (layer number, qkv/proj/fc1/fc2/expert)."""
    _LAYERS[id(layer)] = layer


def kind_from_name(name: str) -> str:
    parts = name.split(".")
    base = next(
        (p.replace("linear_", "") for p in reversed(parts) if p.startswith("linear_")),
        parts[-2] if len(parts) > 1 else name,
    )
    if "shared_experts" in parts:
        return f"shared_expert_{base}"
    if "experts" in parts or "local_experts" in parts:
        return f"expert_{base}"
    return base


def linear_meta(weight: torch.Tensor) -> dict[str, Any]:
    """Layer number and module kind of the linear layer that owns ``weight``."""
    key = id(weight)
    if key not in _WEIGHTS:
        found: tuple[int | None, str] = (None, "output_layer")
        for layer in list(_LAYERS.values()):
            for name, param in layer.named_parameters():
                if param is weight:
                    found = (getattr(layer, "layer_number", None), kind_from_name(name))
                    break
            else:
                continue
            break
        _WEIGHTS[key] = found
    layer_idx, kind = _WEIGHTS[key]
    return {"layer_idx": layer_idx, "module_kind": kind}


def identity(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same data: storage, offset, dtype, version, and the elements
    they address in order (dimensions of size 1 dropped and mergeable ones merged, so that a
    view that only reshapes is the same tensor)."""
    try:
        ptr: Any = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        ptr = id(t)
    layout: list[tuple[int, int]] = []
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if size == 1:
            continue
        if layout and layout[-1][1] == size * stride:
            layout[-1] = (layout[-1][0] * size, stride)
        else:
            layout.append((size, stride))
    # the version counter (``Tensor._version``, torch's in-place counter): where a torch has
    # none, every call is new data (saved twice rather than an in-place change missed)
    version = getattr(t, "_version", None)
    return (
        ptr,
        t.storage_offset(),
        t.dtype,
        object() if version is None else version,
        tuple(layout),
    )


POOL_BYTES = 256 << 20
"""Host snapshot memory kept for reuse at most (CPU tensors)."""


class HostPool:
    """Host snapshot buffers used again, by dtype and shape: pageable ones for CPU tensors
    (a fresh allocation of a few MiB is handed back to the OS when freed, so without reuse
    every snapshot page-faults its memory anew, which costs 4x the copy itself: 0.45 ms
    against 0.1 ms per 2 MiB here) and pinned ones for the copies of device tensors."""

    def __init__(self, cap: int) -> None:
        self.cap, self.bytes = cap, 0
        self.free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, t: torch.Tensor) -> torch.Tensor | None:
        """A free buffer of ``t``'s dtype and shape, or None (always for a quantized tensor,
        whose scale and zero point a buffer would not have, and which copies only from
        float)."""
        if t.is_quantized:
            return None
        key = (t.dtype, tuple(t.shape))
        with self.lock:
            bucket = self.free.get(key)
            buf = bucket.pop() if bucket else None
            if buf is not None:
                self.bytes -= buf.numel() * buf.element_size()
        return buf

    def snapshot(self, t: torch.Tensor) -> torch.Tensor:
        buf = self.take(t)
        if buf is None:
            return clone(t)
        raw(buf).copy_(raw(t))
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        if buf.is_quantized:
            return
        nbytes = buf.numel() * buf.element_size()
        with self.lock:
            if self.bytes + nbytes <= self.cap:
                self.free.setdefault((buf.dtype, tuple(buf.shape)), []).append(buf)
                self.bytes += nbytes


class Item:
    __slots__ = ("cost", "device", "directory", "event", "host", "meta", "name", "stats")

    def __init__(
        self,
        name: str,
        host: torch.Tensor | None,
        stats: torch.Tensor | None,
        event: Any,
        meta: dict[str, Any],
        cost: int,
        directory: Path,
    ) -> None:
        self.name, self.host, self.stats, self.event = name, host, stats, event
        self.meta, self.cost, self.directory = meta, cost, directory
        self.device: torch.Tensor | None = None  # a device snapshot waiting for a host buffer


class Snapshots:
    """The snapshots of one saver: the host pool (CPU tensors) and, made at the first CUDA
    tensor, the device copies (``device_copy``: pinned pool, side stream, handed-over
    snapshots)."""

    def __init__(self, pool: HostPool | None = None) -> None:
        self.pool = pool or HostPool(POOL_BYTES)
        self.device: Any = None  # device_copy.DeviceCopies, made at the first CUDA tensor

    def take(
        self,
        t: torch.Tensor,
        name: str,
        meta: dict[str, Any],
        cost: int,
        directory: Path,
        stats_only: bool,
    ) -> Item:
        """On the host a snapshot from the pool (the writer thread computes the statistics
        from it); on CUDA the statistics and a copy queued on a side stream."""
        if t.device.type != "cuda":
            return Item(name, self.pool.snapshot(t), None, None, meta, cost, directory)
        if self.device is None:
            from . import device_copy  # CUDA only: never imported on the host

            self.device = device_copy.DeviceCopies(HostPool(device_copy.PINNED_POOL_BYTES))
        host, stats, event, handed_over = self.device.take(t, stats_only)
        item = Item(name, host, stats, event, meta, cost, directory)
        item.device = handed_over
        return item

    def copy_to_host(self, item: Item) -> None:
        """The pinned buffer and copy of a handed-over device snapshot (statistics thread)."""
        self.device.copy_to_host(item)

    def release(self, item: Item) -> None:
        """Give ``item``'s buffers back once it is written, failed or dropped (a dropped
        item's copy may still run: the next copy into its buffer is queued behind it)."""
        if item.event is None:  # a CPU snapshot (or none)
            if item.host is not None:
                self.pool.give_back(item.host)
            return
        self.device.release(item)

    def synchronize(self) -> None:
        """Wait for the side stream: a dropped tensor's copy may still run there, into a
        pinned buffer that the next saver takes and copies into on a stream of its own."""
        if self.device is not None:
            self.device.synchronize()
