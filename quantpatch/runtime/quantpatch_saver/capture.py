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
from .stats import device_moments

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
PINNED_POOL_BYTES = 4 << 30
"""Pinned host memory kept for the copies of device tensors at most (torch's own cache keeps
what is given back beyond it)."""
HANDOVER_BYTES = 1 << 30
"""Device snapshots waiting for the statistics thread to give them a pinned host buffer at
most (device memory); beyond it the training thread makes the buffer itself."""


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer of ``t``'s shape and dtype (slow when torch has none cached)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


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
    """The snapshots of one saver: the host pool (CPU tensors), the pinned pool and side
    stream (CUDA tensors), and the device snapshots handed over to the statistics thread."""

    def __init__(self, pool: HostPool | None = None, pinned: HostPool | None = None) -> None:
        self.pool = pool or HostPool(POOL_BYTES)
        self.pinned = pinned or HostPool(PINNED_POOL_BYTES)
        self.stream: Any = None
        self.lock = threading.Lock()
        self.handed_over = 0  # bytes of device snapshots waiting for a pinned buffer

    def take(
        self,
        t: torch.Tensor,
        name: str,
        meta: dict[str, Any],
        cost: int,
        directory: Path,
        stats_only: bool,
    ) -> Item:
        """Statistics on the tensor's device, and (unless ``stats_only``) a host copy; on CUDA
        both leave on a side stream so the training stream does not wait."""
        if t.device.type != "cuda":
            # on the host the copy is the only work done here; the writer thread computes
            # the statistics from it
            return Item(name, self.pool.snapshot(t), None, None, meta, cost, directory)
        stats = device_moments(t)
        # a snapshot on the device, on the training stream: training may write into t right
        # after this call (a reused all-gather buffer, an in-place update), and an on-device
        # copy costs a fraction of the PCIe copy that then runs on the side stream
        snap = None if stats_only else clone(t, contiguous=False)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=t.device)  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream(t.device)
        self.stream.wait_stream(current)
        handed_over = None
        with torch.cuda.stream(self.stream):
            host_stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            host_stats.copy_(stats, non_blocking=True)
            host = None
            if snap is not None:
                host = self.pinned.take(snap)
                if host is None and self._hand_over(snap):
                    handed_over = snap
                elif host is None:  # the device holds enough snapshots already: made here
                    host = pinned_like(snap)
                if host is not None:
                    raw(host).copy_(raw(snap), non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        if snap is not None:  # the allocator must not reuse the snapshot before the copy
            snap.record_stream(self.stream)
        stats.record_stream(self.stream)
        item = Item(name, host, host_stats, event, meta, cost, directory)
        item.device = handed_over
        return item

    def _hand_over(self, snap: torch.Tensor) -> bool:
        """Whether the statistics thread makes ``snap``'s pinned host buffer and copies it.
        Pinning fresh host memory is the slow part of a copy from the device (an H100's VM:
        a step of 32 tensors, 1.6 GB, took 74-550 ms in the training thread until the
        buffers of a whole step had been made once, against 15-21 ms with them), so the
        training thread only takes free buffers, up to ``HANDOVER_BYTES`` waiting."""
        nbytes = snap.numel() * snap.element_size()
        with self.lock:
            if self.handed_over + nbytes > HANDOVER_BYTES:
                return False
            self.handed_over += nbytes
        return True

    def copy_to_host(self, item: Item) -> None:
        """The pinned buffer and the copy of a handed-over device snapshot (statistics
        thread), queued on the side stream behind what the training thread queued."""
        snap = item.device
        assert snap is not None
        # this thread's current device is 0 until set: the training process's GPU instead
        with torch.cuda.device(snap.device), torch.cuda.stream(self.stream):
            host = pinned_like(snap)
            raw(host).copy_(raw(snap), non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        event.synchronize()
        item.host, item.event = host, event
        self.drop_device(item)

    def drop_device(self, item: Item) -> None:
        snap, item.device = item.device, None
        if snap is not None:
            with self.lock:
                self.handed_over -= snap.numel() * snap.element_size()

    def release(self, item: Item) -> None:
        """Give ``item``'s buffers back once it is written, failed or dropped (a dropped
        item's copy may still run: the next copy into its buffer is queued behind it)."""
        self.drop_device(item)
        if item.host is None:
            return
        if item.event is None:  # a CPU snapshot
            self.pool.give_back(item.host)
        else:
            self.pinned.give_back(item.host)

    def synchronize(self) -> None:
        """Wait for the side stream: a dropped tensor's copy may still run there, into a
        pinned buffer that the next saver takes and copies into on a stream of its own."""
        if self.stream is not None:
            self.stream.synchronize()
