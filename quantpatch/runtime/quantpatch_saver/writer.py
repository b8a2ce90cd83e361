"""The saver's pipeline: what the training thread hands over (selected, named, capped, taken
by ``capture``), and the two background stages behind it: the statistics thread (``stats``)
and the writer threads (``ondisk``), each scheduled below training; the counts ``flush()``
reports."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import capture, ondisk, settings, stats
from .capture import Item, Snapshots
from .dtypes import LEGACY_DTYPES

_READY = 4
"""Tensors with their statistics waiting for a writer at most (host memory in flight)."""
_BEHIND = 2
"""Tensors waiting for a writer from which on the statistics thread writes the next file
itself (a writer takes the next one as soon as it is free, so one waiting is no backlog)."""


@functools.cache
def _openmp() -> Any:
    """torch's own OpenMP runtime, found among the libraries this process has loaded (None
    where there is none: another platform or another build). Looked up once per process: it
    took 1 ms, at the start of every statistics thread."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line and ".so" in line}
    except OSError:
        return None
    import ctypes

    for path in sorted(paths):
        if Path(path).name.split(".so")[0].split("-")[0] in ("libgomp", "libiomp5", "libomp"):
            with contextlib.suppress(OSError):
                lib = ctypes.CDLL(path)
                if hasattr(lib, "omp_set_num_threads"):
                    return lib
    return None


def _one_core() -> None:
    """torch's operators on one core in the calling thread, and in no other. OpenMP keeps
    the thread count per thread, but ``torch.set_num_threads`` also sets the count every
    thread inherits when it first runs an operator (the main thread too, before its first
    one), which cut a training process's later threads to one core; OpenMP's own call is
    made instead, after torch's set-up of this thread. Where torch's OpenMP runtime is not
    found, nothing changes."""
    torch.get_num_threads()  # torch's lazy per-thread set-up first, so it cannot undo this
    lib = _openmp()
    if lib is not None:
        lib.omp_set_num_threads(1)


def _yield_to_training() -> None:
    """Schedule the calling thread ``TENSOR_SAVE_NICE`` lower than the process (Linux sets
    priorities per thread). Where the saver and training compete for the cores, training
    goes first: on 2 cores its wait fell from 0.42x to 0.12x the fork's, and the saver
    finishes no later, since it runs whenever training waits for anything."""
    if not settings.CFG.nice or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):  # a sandbox that forbids it: the same priority
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + settings.CFG.nice
        )


def _measure(item: Item) -> None:
    """The statistics of ``item`` (of host snapshots: computed here), into its ``info``."""
    if item.stats is None:
        assert item.host is not None
        mn, mx, mean, std = stats.host_stats(item.host)
    else:
        if item.event is not None:  # the copies from the device: the statistics are read here
            item.event.synchronize()
        n = math.prod(item.meta["info"]["shape"])
        mn, mx, mean, std = stats.combine(item.stats.tolist(), n)
    item.meta["info"].update(min=mn, max=mx, mean=mean, std=std)


def _encode(item: Item) -> list[Any]:
    """The bytes of ``item``'s file (or stats-only line), made by the thread that writes it:
    some are views of the snapshot, which goes back to the pool once they are written."""
    info = item.meta.pop("info")
    if settings.CFG.stats_only:
        line = json.dumps({"name": item.name, "tensor_info": info, "metadata": item.meta})
        return [(line + "\n").encode("utf-8")]
    obj = {"tensor": item.host, "tensor_info": info, "metadata": item.meta}
    return ondisk.torch_bytes(obj, item.host)


class Saver:
    """One run's saving: the tensors handed over, the threads writing them, the counts."""

    def __init__(self, snapshots: Snapshots | None = None) -> None:
        self.counter = 0
        # two stages: the statistics thread takes what training hands over, the writer
        # threads take what has its statistics; a few items wait between the two
        self.queue: queue.Queue[Item | None] = queue.Queue(maxsize=settings.CFG.queue_size)
        self.ready: queue.Queue[Item | None] = queue.Queue(maxsize=_READY)
        self.stats_thread: threading.Thread | None = None
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.append_lock = threading.Lock()  # stats-only lines: one writer at a time
        self.written_bytes = 0  # on disk
        self.pending_bytes = 0  # queued, counted against the cap until written or dropped
        self.files = 0
        self.dropped = 0
        self.drops_reported = 0
        self.failed = 0
        self.failures_reported = 0
        self.failure: tuple[Path, str] | None = None  # the first failed write since reported
        self.cap_reported = False
        self.micro_step = 0
        self.seen_forward: set[tuple[Any, ...]] = set()
        self.last_saved: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.snapshots = snapshots or Snapshots()

    # micro-steps: a forward tensor seen again starts the next one
    def _step_for(self, key: tuple[Any, ...], operation: str) -> int:
        if operation == "forward":
            if key in self.seen_forward:
                self.micro_step += 1
                self.seen_forward.clear()
            self.seen_forward.add(key)
        return self.micro_step

    def _selected(self, step: int, layer_idx: int | None, name: str) -> bool:
        if settings.CFG.steps is not None and not settings.in_spans(settings.CFG.steps, step):
            return False
        if settings.CFG.layers is not None and not settings.in_spans(
            settings.CFG.layers, layer_idx
        ):
            return False
        return settings.CFG.kinds is None or name in settings.CFG.kinds

    def _capped(self, cost: int) -> bool:
        total = self.written_bytes + self.pending_bytes
        if settings.CFG.max_bytes is None or total + cost <= settings.CFG.max_bytes:
            return False
        if not self.cap_reported:
            self.cap_reported = True
            print(
                f"[tensor_saver] TENSOR_SAVE_MAX_BYTES={settings.CFG.max_bytes} reached after "
                f"{total} bytes; no more tensors are saved.",
                file=sys.stderr,
            )
        return True

    def save(
        self,
        tensor: torch.Tensor,
        layer_type: str,
        operation: str,
        quant_type: str | None,
        tensor_name: str,
        layer_idx: int | None,
        metadata: Mapping[str, Any] | None,
        save_dir: Path | None = None,
    ) -> str | None:
        """Queue one tensor; the path its file will have, or ``None`` when not saved."""
        quant = quant_type or settings.CFG.default_quant
        md = dict(metadata or {})
        kind = md.get("module_kind")
        t = tensor.detach()
        # the same data handed over again in this micro-step with the same label (a fork's
        # own call next to an inserted one) is saved once
        same = (layer_type, layer_idx, kind, operation, tensor_name, quant)
        ident = capture.identity(t)
        before = self.last_saved.get(same)
        # an address means the same data only while the tensor seen there is alive: a freed
        # block is reused by the allocator for the next, different tensor
        if (
            before is not None
            and before[:2] == (ident, self.micro_step)
            and before[2]() is not None
        ):
            return None
        step_key = (layer_type, layer_idx, kind, tensor_name, md.get("phase"), md.get("component"))
        step = self._step_for(step_key, operation)
        self.last_saved[same] = (ident, step, weakref.ref(tensor))
        if not self._selected(step, layer_idx, tensor_name):
            return None
        nbytes = t.numel() * t.element_size()
        cost = 0 if settings.CFG.stats_only else nbytes
        with self.lock:
            if self._capped(cost):
                return None
            self.pending_bytes += cost
            self.counter += 1
            counter = self.counter
        rank, world = settings.rank_info()
        if md.get("rank") is not None:
            rank = md["rank"]
        stamp = time.strftime("%Y%m%d_%H%M%S")
        rank_part = f"_rank{rank}" if world > 1 else ""
        name = (
            f"{stamp}_{counter:04d}_{layer_type}_L{layer_idx}_{operation}_{quant}"
            f"{rank_part}_{tensor_name}"
        )
        meta: dict[str, Any] = {
            **md,
            "layer_type": layer_type,
            "operation": operation,
            "quant_type": quant,
            "tensor_name": tensor_name,
            "layer_idx": layer_idx,
            "save_time": time.time(),
            "micro_step": step,
            "rank": rank,
            "world_size": world,
            "git_commit": settings.source_commit(),
            "info": {
                "shape": list(t.shape),
                "dtype": str(t.dtype),
                "device": str(t.device),
                "requires_grad": tensor.requires_grad,
                "is_leaf": tensor.is_leaf,
            },
        }
        if settings.iteration() is not None:
            meta["iteration"] = settings.iteration()
        directory = save_dir or settings.CFG.save_dir
        try:
            item = self._capture(t, name, meta, cost, directory)
        except (RuntimeError, NotImplementedError) as exc:
            if t.dtype in LEGACY_DTYPES and not t.is_quantized:
                raise
            # a dtype torch cannot copy (here, on this device): this tensor fails, not saving
            self._count_failure(cost, directory, exc)
            return None
        self._start()
        if settings.CFG.drop:
            try:
                self.queue.put_nowait(item)
            except queue.Full:
                with self.lock:
                    self.dropped += 1
                    self.pending_bytes -= cost
                self.snapshots.release(item)  # its snapshot buffer serves the next tensor
                return None
        else:
            self.queue.put(item)
        return None if settings.CFG.stats_only else str(directory / f"{name}.pt")

    def _capture(
        self, t: torch.Tensor, name: str, meta: dict[str, Any], cost: int, directory: Path
    ) -> Item:
        return self.snapshots.take(t, name, meta, cost, directory, settings.CFG.stats_only)

    def _start(self) -> None:
        if self.stats_thread is None or not self.stats_thread.is_alive():
            self.stats_thread = threading.Thread(
                target=self._prepare_all, name="tensor_saver_stats", daemon=True
            )
            self.stats_thread.start()
        if len(self.threads) == settings.CFG.writers and all(t.is_alive() for t in self.threads):
            return
        self.threads = [t for t in self.threads if t.is_alive()]
        while len(self.threads) < settings.CFG.writers:
            thread = threading.Thread(
                target=self._write_files, name=f"tensor_saver_{len(self.threads)}", daemon=True
            )
            thread.start()
            self.threads.append(thread)

    def _failed(self, item: Item, exc: Exception) -> None:
        """Count a tensor that will not be written (training goes on; reported at flush)."""
        self._count_failure(item.cost, item.directory, exc)
        self.snapshots.release(item)

    def _count_failure(self, cost: int, directory: Path, exc: Exception) -> None:
        with self.lock:
            self.pending_bytes -= cost
            self.failed += 1
            if self.failure is None:
                self.failure = (directory, f"{type(exc).__name__}: {exc}")

    def _prepare_all(self) -> None:
        """Stage one: the statistics of host snapshots (CUDA items come with theirs); a
        writer then writes the file. When the writers are behind (``_BEHIND`` waiting), this
        thread writes the file itself instead of queueing it (stats-only lines, tiny and in
        one shared file, always go to a writer). On 2 cores, 168 MB: the statistics take 21-31
        ms of a core by the one-pass kernel (45 by torch's operators) and the files 50-80
        (the pickles 5, the rest the operating system's); one writer
        alone left this thread idle once the statistics were done, and a writer slowed down
        (a core the host gave elsewhere, a slow copy into the page cache) took the whole
        pipeline with it: 110.8 ms median over 30 interleaved repetitions, 12 over 150 ms,
        against 78.2 ms and none over 150 when this thread writes too."""
        # one core for torch's operators in this thread: the writer thread needs the other,
        # and with two the three threads took turns (111-140 ms for 168 MB against 88-92)
        _one_core()
        _yield_to_training()
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                try:
                    if item.device is not None:
                        self.snapshots.copy_to_host(item)
                    _measure(item)
                except Exception as exc:  # keep training alive; counted, reported at flush
                    self._failed(item, exc)
                    continue
                if not settings.CFG.stats_only and self.ready.qsize() >= _BEHIND:
                    self._finish(item)  # the writers are behind: written here
                else:
                    self.ready.put(item)
            finally:
                self.queue.task_done()

    def _write_files(self) -> None:
        """Stage two: the files (or stats-only lines)."""
        _yield_to_training()
        while True:
            item = self.ready.get()
            try:
                if item is None:
                    return
                self._finish(item)
            finally:
                self.ready.task_done()

    def _finish(self, item: Item) -> None:
        """Write ``item``, and count it as written or failed."""
        try:
            self._write(item)
        except Exception as exc:  # keep training alive; counted, reported at flush
            self._failed(item, exc)
        else:
            with self.lock:
                self.pending_bytes -= item.cost
                self.written_bytes += item.cost
                self.files += 1
            self.snapshots.release(item)

    def _write(self, item: Item) -> None:
        parts = _encode(item)
        if settings.CFG.stats_only:
            with self.append_lock:
                ondisk.append(item.directory / f"stats_rank{item.meta['rank']}.jsonl", parts)
            return
        tmp = item.directory / f".{item.name}.pt.tmp"
        fd = ondisk.create(tmp, os.O_TRUNC)
        try:
            try:
                ondisk.write_all(fd, parts)
            finally:
                os.close(fd)
            os.replace(tmp, item.directory / f"{item.name}.pt")
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk must not keep a partial file
                tmp.unlink()
            raise

    def stop(self) -> None:
        """End the statistics and writer threads (after ``flush``), and wait for the side
        stream: a dropped tensor's copy may still run there, into a pinned buffer that the
        next saver (``configure()``) takes and copies into on a stream of its own."""
        self.snapshots.synchronize()
        if self.stats_thread is not None and self.stats_thread.is_alive():
            self.queue.put(None)
            self.stats_thread.join()
        self.stats_thread = None
        alive = [t for t in self.threads if t.is_alive()]
        for _ in alive:
            self.ready.put(None)
        for thread in alive:
            thread.join()
        self.threads = []

    def flush(self) -> dict[str, Any]:
        if self.stats_thread is not None and self.stats_thread.is_alive():
            self.queue.join()
        if any(t.is_alive() for t in self.threads):
            self.ready.join()
        with self.lock:
            report = {
                "files": self.files,
                "bytes": self.written_bytes,
                "dropped": self.dropped,
                "failed": self.failed,
                "errors": [self.failure[1]] if self.failure else [],
            }
            failure, self.failure = self.failure, None
            new_failures = self.failed - self.failures_reported
            self.failures_reported = self.failed
            new_drops = self.dropped != self.drops_reported
            self.drops_reported = self.dropped
        if new_drops:
            print(
                f"[tensor_saver] dropped {self.dropped} tensor(s): the writer queue was full "
                "(TENSOR_SAVE_QUEUE / TENSOR_SAVE_DROP).",
                file=sys.stderr,
            )
        if new_failures and failure is not None:
            print(
                f"[tensor_saver] {new_failures} file(s) could not be written to {failure[0]} "
                f"and were dropped (first error: {failure[1]}).",
                file=sys.stderr,
            )
        return report
