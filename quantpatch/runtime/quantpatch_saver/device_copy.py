"""The snapshot of a CUDA tensor: its statistics queued on the device and its copy to pinned
host memory on a side stream, so the training stream never waits. Imported at the first CUDA
tensor a saver takes (never on a host-only run)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from .dtypes import clone, raw
from .stats import device_moments

PINNED_POOL_BYTES = 4 << 30
"""Pinned host memory kept for the copies of device tensors at most (torch's own cache keeps
what is given back beyond it)."""
HANDOVER_BYTES = 1 << 30
"""Device snapshots waiting for the statistics thread to give them a pinned host buffer at
most (device memory); beyond it the training thread makes the buffer itself."""


class Pool(Protocol):
    """A pool of host buffers by dtype and shape (``capture.HostPool``)."""

    def take(self, t: torch.Tensor) -> torch.Tensor | None: ...

    def give_back(self, buf: torch.Tensor) -> None: ...


class Snapshot(Protocol):
    """What a device copy fills in of a saver's item (``capture.Item``)."""

    host: torch.Tensor | None
    event: Any
    device: torch.Tensor | None


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer of ``t``'s shape and dtype (slow when torch has none cached)."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class DeviceCopies:
    """The pinned pool, the side stream and the device snapshots handed over to the
    statistics thread of one saver."""

    def __init__(self, pinned: Pool) -> None:
        self.pinned = pinned  # capture's pool, made with PINNED_POOL_BYTES
        self.stream: Any = None
        self.lock = threading.Lock()
        self.handed_over = 0  # bytes of device snapshots waiting for a pinned buffer

    def take(
        self, t: torch.Tensor, stats_only: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor, Any, torch.Tensor | None]:
        """Statistics on the tensor's device, and (unless ``stats_only``) a host copy; both
        leave on a side stream so the training stream does not wait. Returns the host copy
        (None while handed over or statistics only), the host statistics, the event that
        marks both done and the device snapshot handed over to the statistics thread."""
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
        return host, host_stats, event, handed_over

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

    def copy_to_host(self, item: Snapshot) -> None:
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

    def drop_device(self, item: Snapshot) -> None:
        snap, item.device = item.device, None
        if snap is not None:
            with self.lock:
                self.handed_over -= snap.numel() * snap.element_size()

    def release(self, item: Snapshot) -> None:
        """Give a written, failed or dropped item's buffers back."""
        self.drop_device(item)
        if item.host is not None:
            self.pinned.give_back(item.host)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
