"""Save the operands of the quantized GEMMs (forward and backward) with honest names.

Installed by ``quantpatch saver install`` as ``megatron/core/tensor_saver.py``; depends on torch
and the standard library only. The calls quantpatch inserts are guarded by ``ENABLED``, a
module-level boolean read once from the environment, so a disabled saver costs one attribute
test per call site.

Environment (read at import; ``configure()`` reads it again):

``TENSOR_SAVE_ENABLED``   ``true``/``1`` to save (default ``false``)
``TENSOR_SAVE_DIR``       where files go (default ``./tensor_logs``)
``CUSTOM_QUANT_TYPE``     label for call sites that have no site value (stock layouts)
``TENSOR_SAVE_STEPS``     micro-steps to save, e.g. ``0-1,100`` (default: all)
``TENSOR_SAVE_LAYERS``    layer numbers to save, e.g. ``1-2,27`` (default: all)
``TENSOR_SAVE_KINDS``     tensor names to save, e.g. ``input,grad_output`` (default: all)
``TENSOR_SAVE_MAX_BYTES`` stop saving once this many bytes were written (says so once)
``TENSOR_SAVE_STATS_ONLY`` ``true``: one JSON line per tensor in ``stats_rank{r}.jsonl``
``TENSOR_SAVE_QUEUE``     tensors waiting for the writer at most (default 64)
``TENSOR_SAVE_DROP``      ``true``: drop (and count) when the queue is full instead of waiting
``QUANTPATCH_SOURCE_COMMIT`` the source commit to record (default: ``git rev-parse HEAD``)

File name: ``{timestamp}_{counter:04d}_{layer_type}_L{layer_idx}_{operation}_{quant_type}
[_rank{r}]_{tensor_name}.pt`` holding ``{"tensor", "tensor_info", "metadata"}``.

On CUDA the training stream never waits for the host: statistics are computed on the device,
the tensor is copied into pinned host memory on a side stream, and a background thread waits
for that copy and writes the file. A micro-step ends when a forward tensor of the same layer,
operation and name is seen again (recomputed activations count as a new micro-step).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _ranges(text: str | None) -> set[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


ENABLED = _flag("TENSOR_SAVE_ENABLED")
"""The one test every inserted call makes."""


class _Config:
    def __init__(self) -> None:
        self.save_dir = Path(os.environ.get("TENSOR_SAVE_DIR", "./tensor_logs"))
        self.default_quant = os.environ.get("CUSTOM_QUANT_TYPE") or "bf16"
        self.steps = _ranges(os.environ.get("TENSOR_SAVE_STEPS"))
        self.layers = _ranges(os.environ.get("TENSOR_SAVE_LAYERS"))
        kinds = os.environ.get("TENSOR_SAVE_KINDS")
        self.kinds = {k.strip() for k in kinds.split(",") if k.strip()} if kinds else None
        cap = os.environ.get("TENSOR_SAVE_MAX_BYTES")
        self.max_bytes = int(cap) if cap else None
        self.stats_only = _flag("TENSOR_SAVE_STATS_ONLY")
        self.queue_size = int(os.environ.get("TENSOR_SAVE_QUEUE", "64"))
        self.drop = _flag("TENSOR_SAVE_DROP")


_CFG = _Config()


def _rank_info() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


_COMMIT: str | None = None


def _source_commit() -> str | None:
    global _COMMIT
    if _COMMIT is None:
        _COMMIT = os.environ.get("QUANTPATCH_SOURCE_COMMIT") or ""
        if not _COMMIT:
            try:
                _COMMIT = subprocess.run(
                    ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=False,
                ).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                _COMMIT = ""
    return _COMMIT or None


# -- which layer and which linear: filled by the TransformerLayer hook ------------------------

_LAYERS: dict[int, Any] = {}
_WEIGHTS: dict[int, tuple[int | None, str]] = {}


def enter_layer(layer: Any) -> None:
    """Called at the start of ``TransformerLayer.forward``: remember the layer so that the
    linear calls inside it can be named (layer number, qkv/proj/fc1/fc2/expert)."""
    _LAYERS[id(layer)] = layer


def _kind_from_name(name: str) -> str:
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
                    found = (getattr(layer, "layer_number", None), _kind_from_name(name))
                    break
            else:
                continue
            break
        _WEIGHTS[key] = found
    layer_idx, kind = _WEIGHTS[key]
    return {"layer_idx": layer_idx, "module_kind": kind}


# -- the writer ------------------------------------------------------------------------------


def _stats(t: torch.Tensor) -> torch.Tensor:
    """min, max, mean, std as one float32 tensor on ``t``'s device (no host synchronisation)."""
    f = t.float() if t.numel() else torch.zeros(1, device=t.device)
    std = f.std() if f.numel() > 1 else torch.zeros((), device=t.device)
    return torch.stack([f.min(), f.max(), f.mean(), std])


class _Item:
    __slots__ = ("event", "host", "meta", "name", "nbytes", "stats")

    def __init__(
        self,
        name: str,
        host: torch.Tensor | None,
        stats: torch.Tensor | None,
        event: Any,
        meta: dict[str, Any],
        nbytes: int,
    ) -> None:
        self.name, self.host, self.stats, self.event = name, host, stats, event
        self.meta, self.nbytes = meta, nbytes


class _Saver:
    def __init__(self) -> None:
        self.counter = 0
        self.queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max(1, _CFG.queue_size))
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.written_bytes = 0
        self.files = 0
        self.dropped = 0
        self.drops_reported = 0
        self.cap_reported = False
        self.errors: list[str] = []
        self.micro_step = 0
        self.seen_forward: set[tuple[Any, ...]] = set()
        self.stream: Any = None

    # micro-steps: a forward tensor seen again starts the next one
    def _step_for(self, key: tuple[Any, ...], operation: str) -> int:
        if operation == "forward":
            if key in self.seen_forward:
                self.micro_step += 1
                self.seen_forward.clear()
            self.seen_forward.add(key)
        return self.micro_step

    def _selected(self, step: int, layer_idx: int | None, name: str) -> bool:
        if _CFG.steps is not None and step not in _CFG.steps:
            return False
        if _CFG.layers is not None and layer_idx not in _CFG.layers:
            return False
        return _CFG.kinds is None or name in _CFG.kinds

    def _capped(self, nbytes: int) -> bool:
        if _CFG.max_bytes is None or self.written_bytes + nbytes <= _CFG.max_bytes:
            return False
        if not self.cap_reported:
            self.cap_reported = True
            print(
                f"[tensor_saver] TENSOR_SAVE_MAX_BYTES={_CFG.max_bytes} reached after "
                f"{self.written_bytes} bytes; no more tensors are saved.",
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
        metadata: dict[str, Any] | None,
    ) -> None:
        quant = quant_type or _CFG.default_quant
        kind = (metadata or {}).get("module_kind")
        step = self._step_for((layer_type, layer_idx, kind, tensor_name), operation)
        if not self._selected(step, layer_idx, tensor_name):
            return
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        with self.lock:
            if self._capped(nbytes):
                return
            self.written_bytes += 0 if _CFG.stats_only else nbytes
            self.counter += 1
            counter = self.counter
        rank, world = _rank_info()
        stamp = time.strftime("%Y%m%d_%H%M%S")
        rank_part = f"_rank{rank}" if world > 1 else ""
        name = (
            f"{stamp}_{counter:04d}_{layer_type}_L{layer_idx}_{operation}_{quant}"
            f"{rank_part}_{tensor_name}"
        )
        meta: dict[str, Any] = {
            **(metadata or {}),
            "layer_type": layer_type,
            "operation": operation,
            "quant_type": quant,
            "tensor_name": tensor_name,
            "layer_idx": layer_idx,
            "save_time": time.time(),
            "micro_step": step,
            "rank": rank,
            "world_size": world,
            "git_commit": _source_commit(),
            "info": {
                "shape": list(t.shape),
                "dtype": str(t.dtype),
                "device": str(t.device),
                "requires_grad": tensor.requires_grad,
                "is_leaf": tensor.is_leaf,
            },
        }
        item = self._capture(t, name, meta, nbytes)
        self._start()
        if _CFG.drop:
            try:
                self.queue.put_nowait(item)
            except queue.Full:
                with self.lock:
                    self.dropped += 1
                    self.written_bytes -= 0 if _CFG.stats_only else nbytes
        else:
            self.queue.put(item)

    def _capture(self, t: torch.Tensor, name: str, meta: dict[str, Any], nbytes: int) -> _Item:
        """Statistics on the tensor's device, and (unless stats-only) a host copy; on CUDA
        both leave on a side stream so the training stream does not wait."""
        if t.device.type != "cuda":
            # on the host the copy is the only work done here; the writer thread computes
            # the statistics from it
            return _Item(name, t.clone(), None, None, meta, nbytes)
        stats = _stats(t)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=t.device)  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream(t.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            host_stats = torch.empty(4, dtype=torch.float32, pin_memory=True)
            host_stats.copy_(stats, non_blocking=True)
            host = None
            if not _CFG.stats_only:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        t.record_stream(self.stream)  # the caching allocator must not reuse t before the copy
        stats.record_stream(self.stream)
        return _Item(name, host, host_stats, event, meta, nbytes)

    def _start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="tensor_saver", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception as exc:  # keep training alive; report at flush
                self.errors.append(f"{item.name if item else '?'}: {exc}")
            finally:
                self.queue.task_done()

    def _write(self, item: _Item) -> None:
        if item.event is not None:
            item.event.synchronize()
        if item.stats is None:  # host tensors: statistics computed here, off the training path
            assert item.host is not None
            item.stats = _stats(item.host)
        mn, mx, mean, std = (float(v) for v in item.stats.tolist())
        info = {**item.meta.pop("info"), "min": mn, "max": mx, "mean": mean, "std": std}
        _CFG.save_dir.mkdir(parents=True, exist_ok=True)
        if _CFG.stats_only:
            line = json.dumps({"name": item.name, "tensor_info": info, "metadata": item.meta})
            path = _CFG.save_dir / f"stats_rank{item.meta['rank']}.jsonl"
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        else:
            tmp = _CFG.save_dir / f".{item.name}.pt.tmp"
            torch.save({"tensor": item.host, "tensor_info": info, "metadata": item.meta}, tmp)
            os.replace(tmp, _CFG.save_dir / f"{item.name}.pt")
        with self.lock:
            self.files += 1

    def stop(self) -> None:
        """End the writer thread (after ``flush``)."""
        if self.thread is not None and self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def flush(self) -> dict[str, Any]:
        if self.thread is not None and self.thread.is_alive():
            self.queue.join()
        report = {
            "files": self.files,
            "bytes": self.written_bytes,
            "dropped": self.dropped,
            "errors": list(self.errors),
        }
        if self.dropped != self.drops_reported:
            self.drops_reported = self.dropped
            print(
                f"[tensor_saver] dropped {self.dropped} tensor(s): the writer queue was full "
                "(TENSOR_SAVE_QUEUE / TENSOR_SAVE_DROP).",
                file=sys.stderr,
            )
        for err in self.errors:
            print(f"[tensor_saver] write failed: {err}", file=sys.stderr)
        self.errors.clear()
        return report


_SAVER = _Saver()


def configure() -> None:
    """Read the environment again (tests and long-lived processes): everything queued is
    written first, then a fresh saver starts from the new settings."""
    global ENABLED, _CFG, _SAVER
    flush()
    _SAVER.stop()
    ENABLED = _flag("TENSOR_SAVE_ENABLED")
    _CFG = _Config()
    _SAVER = _Saver()


def save_tensor(
    tensor: torch.Tensor | None,
    layer_type: str,
    operation: str,
    quant_type: str | None,
    tensor_name: str,
    layer_idx: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    if ENABLED and tensor is not None:
        _SAVER.save(tensor, layer_type, operation, quant_type, tensor_name, layer_idx, metadata)


def save_linear_tensors(
    input_tensor: torch.Tensor | None,
    weight: torch.Tensor | None,
    quant_type: str | None,
    operation: str,
    layer_idx: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    """The operands of a linear GEMM: ``input`` and ``weight`` in the forward pass,
    ``grad_output`` and ``weight`` in the backward pass."""
    first = "input" if operation == "forward" else "grad_output"
    save_tensor(input_tensor, "linear", operation, quant_type, first, layer_idx, metadata)
    save_tensor(weight, "linear", operation, quant_type, "weight", layer_idx, metadata)


def save_attention_tensors(
    query: torch.Tensor | None,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    quant_type: str | None,
    operation: str,
    layer_idx: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        save_tensor(tensor, "attention", operation, quant_type, name, layer_idx, metadata)


def flush() -> dict[str, Any]:
    """Wait until every queued tensor is on disk; report files, bytes and drops."""
    return _SAVER.flush()


atexit.register(flush)
