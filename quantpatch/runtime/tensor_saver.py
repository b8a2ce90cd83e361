"""Save the operands of the quantized GEMMs (forward and backward) with honest names.

Installed by ``quantpatch saver install`` as ``megatron/core/quantpatch/tensor_saver.py``
(``megatron.core.tensor_saver`` is this module too), with its parts in ``quantpatch_saver/``
beside it, one concern each: ``settings.py`` (the variables), ``capture.py`` (what the
training thread does), ``writer.py`` (the background threads), ``stats.py`` (the
statistics), ``ondisk.py`` (the files), ``compat.py`` (a fork's calling conventions), and the
opt-in accelerators ``stats_kernel.py`` and ``pickler.py``.
This module is the API its callers use; all of it depends on torch and the standard library
only. The calls quantpatch inserts are guarded by ``ENABLED``, a
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
``TENSOR_SAVE_WRITERS``   background writer threads (default: one per two cores, at most 2)
``TENSOR_SAVE_NICE``      how much lower the saver's threads are scheduled than training, on
                          Linux (0-19, default 10; 0: the same priority)
``TENSOR_SAVE_ACCELERATORS`` opt-in accelerators, ``stats-kernel``, ``pickler`` (commas),
                          ``all`` or ``none`` (default): the one-pass C statistics kernel
                          compiled on first use, and the plain pickler
``TENSOR_SAVE_KERNEL_DIR`` where that kernel is cached (default ``kernels`` in
                          quantpatch's cache, ``~/.cache/quantpatch``)
``QUANTPATCH_SOURCE_COMMIT`` the source commit to record (default: ``git rev-parse HEAD``)

The saver never stops training: a variable it cannot read is reported in one line (name,
value, accepted syntax) and saving stays off; files that cannot be written are counted and
reported once at ``flush()`` / exit, and leave no partial file behind.

File name: ``{timestamp}_{counter:04d}_{layer_type}_L{layer_idx}_{operation}_{quant_type}
[_rank{r}]_{tensor_name}.pt`` holding ``{"tensor", "tensor_info", "metadata"}``, byte for byte
what ``torch.save`` writes in its non-zip format (``torch.load`` reads it, ``weights_only=True``
included; it cannot be memory-mapped) because the zip format's CRC-32 and records cost 2.7x
the write. That format holds the dtypes with a legacy storage class only: a tensor of any
other (float8, uint16/32/64, complex32, bits, packed fp4) is written in the zip format,
``torch.save``'s default; one torch cannot save at all (int1-7, uint1-7) is counted as
failed with torch's reason. ``tensor_info``'s min, max, mean and std are None for a dtype
without them (complex, bits, packed fp4, quantized).

On CUDA the training stream never waits for the host: statistics are computed on the device,
the tensor is copied into pinned host memory on a side stream, and a background thread waits
for that copy and writes the file. Pinned buffers are used again; while none of the right
shape is free, the background thread makes one (pinning memory is slow) and queues the copy.
A micro-step ends when a forward tensor of the same layer, operation and name is seen again
(recomputed activations count as a new micro-step). A tensor handed over twice in one
micro-step under the same layer, operation and name (the same storage, unchanged) is saved
once.

The API of a fork's own ``tensor_saver.py`` is served too, so that a checkout's existing
callers keep working when this module replaces it: the keywords ``phase``, ``component``,
``rank`` and ``attention_weights`` (and the same order when passed positionally after
``layer_idx``), ``get_tensor_saver()`` and ``TensorSaver`` (``save_tensor``, ``set_iteration``,
``enabled``, ``save_dir``, ``counter``, ``iteration``). Their calls are saved like the inserted
ones (asynchronously, with the layer number and module kind of a linear layer's weight); the
``save_*`` functions return the path each file will have once written (``None`` when a
tensor is not saved).
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .quantpatch_saver import capture, compat, pickler, settings, stats_kernel, writer

ENABLED = settings.ENABLED_AT_IMPORT
"""The one test every inserted call makes."""

_SAVER = writer.Saver()


def configure() -> None:
    """Read the environment again (tests and long-lived processes): everything queued is
    written first, then a fresh saver starts from the new settings, with the host snapshot
    buffers of the last (host and pinned): memory the process already has, where fresh
    buffers are faulted in (or pinned) anew (see ``capture.HostPool``)."""
    global ENABLED, _SAVER
    flush()
    _SAVER.stop()
    ENABLED = settings.reload()
    _SAVER = writer.Saver(_SAVER.snapshots)


_FAILED = False


def _save(
    tensor: torch.Tensor | None,
    layer_type: str,
    operation: str,
    quant_type: str | None,
    tensor_name: str,
    layer_idx: int | None,
    metadata: Mapping[str, Any] | None,
    save_dir: Path | None = None,
) -> str | None:
    """Hand one tensor to the saver; an error inside it turns saving off, never training."""
    global ENABLED, _FAILED
    if tensor is None:
        return None
    try:
        return _SAVER.save(
            tensor, layer_type, operation, quant_type, tensor_name, layer_idx, metadata, save_dir
        )
    except Exception as exc:
        ENABLED = False
        if not _FAILED:
            _FAILED = True
            print(
                f"[tensor_saver] saving {layer_type} {operation} {tensor_name} failed "
                f"({type(exc).__name__}: {exc}); tensor saving is off for the rest of this run.",
                file=sys.stderr,
            )
        return None


# -- the public API: quantpatch's, and the one a fork's own saver has ------------------------


def enter_layer(layer: Any) -> None:
    """Called at the start of ``TransformerLayer.forward``: remember the layer so that the
    linear calls inside it can be named (layer number, qkv/proj/fc1/fc2/expert)."""
    capture.enter_layer(layer)


def linear_meta(weight: torch.Tensor) -> dict[str, Any]:
    """Layer number and module kind of the linear layer that owns ``weight``."""
    return capture.linear_meta(weight)


def save_tensor(
    tensor: torch.Tensor | None,
    layer_type: str,
    operation: str,
    quant_type: str | None,
    tensor_name: str,
    layer_idx: int | None = None,
    *args: Any,
    metadata: Mapping[str, Any] | None = None,
    phase: str | None = None,
    component: str | None = None,
    rank: int | None = None,
) -> str | None:
    """Save one tensor; the path its file will have (``None``: not saved)."""
    if not ENABLED or tensor is None:
        return None
    md = compat.save_tensor_metadata(args, metadata, phase, component, rank)
    return _save(tensor, layer_type, operation, quant_type, tensor_name, layer_idx, md)


def save_linear_tensors(
    input_tensor: torch.Tensor | None,
    weight: torch.Tensor | None,
    quant_type: str | None,
    operation: str = "forward",
    layer_idx: int | None = None,
    *args: Any,
    metadata: Mapping[str, Any] | None = None,
    phase: str | None = None,
    component: str | None = None,
    rank: int | None = None,
) -> dict[str, str | None]:
    """The operands of a linear GEMM: ``input`` and ``weight`` in the forward pass,
    ``grad_output`` and ``weight`` in the backward pass. Without a ``layer_idx`` the layer
    number and module kind are those of the layer that owns ``weight``."""
    first = "input" if operation == "forward" else "grad_output"
    if not ENABLED:
        return {first: None, "weight": None}
    md = compat.linear_metadata(args, metadata, phase, component, rank)
    if weight is not None and (layer_idx is None or "module_kind" not in md):
        found = capture.linear_meta(weight)  # a fork's call names no layer: the weight's owner
        if layer_idx is None:
            layer_idx = found["layer_idx"]
        md = {"module_kind": found["module_kind"], **md}
    return {
        first: _save(input_tensor, "linear", operation, quant_type, first, layer_idx, md),
        "weight": _save(weight, "linear", operation, quant_type, "weight", layer_idx, md),
    }


def save_attention_tensors(
    query: torch.Tensor | None,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    quant_type: str | None,
    operation: str = "forward",
    layer_idx: int | None = None,
    *args: Any,
    metadata: Mapping[str, Any] | None = None,
    phase: str | None = None,
    component: str | None = None,
    rank: int | None = None,
    attention_weights: torch.Tensor | None = None,
) -> dict[str, str | None]:
    """The operands of attention (``attention_weights``: the attention probabilities, saved
    as ``attention_probs``)."""
    names = ("query", "key", "value", "attention_weights")
    if not ENABLED:
        return dict.fromkeys(names)
    md, probs = compat.attention_metadata(args, metadata, phase, component, rank, attention_weights)
    tensors = (query, key, value, probs)
    return {
        name: _save(
            tensor,
            "attention",
            operation,
            quant_type,
            "attention_probs" if name == "attention_weights" else name,
            layer_idx,
            md,
        )
        for name, tensor in zip(names, tensors, strict=True)
    }


class TensorSaver:
    """The object API of a fork's saver over this module: ``get_tensor_saver()`` returns the
    shared one (whose ``enabled`` and ``save_dir`` are this module's settings); one made
    directly may have its own directory and switch."""

    def __init__(self, save_dir: str | os.PathLike[str] | None = None, enabled: Any = None):
        self._save_dir = Path(save_dir) if save_dir else None
        self._enabled = None if enabled is None else bool(enabled)

    @property
    def enabled(self) -> bool:
        return ENABLED if self._enabled is None else self._enabled

    @enabled.setter
    def enabled(self, value: Any) -> None:
        global ENABLED
        if self is _SHARED:
            ENABLED = bool(value)
        else:
            self._enabled = bool(value)

    @property
    def save_dir(self) -> str:
        return str(self._save_dir or settings.CFG.save_dir)

    @save_dir.setter
    def save_dir(self, value: str | os.PathLike[str]) -> None:
        if self is _SHARED:
            settings.CFG.save_dir = Path(value)
        else:
            self._save_dir = Path(value)

    @property
    def counter(self) -> int:
        return _SAVER.counter

    @property
    def iteration(self) -> int:
        return settings.iteration() or 0

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.set_iteration(value)

    def set_iteration(self, iteration: int) -> None:
        """The training iteration, recorded in the metadata of every file from now on."""
        settings.set_iteration(iteration)

    def save_tensor(
        self,
        tensor: torch.Tensor | None,
        layer_type: str,
        operation: str,
        quant_type: str | None,
        tensor_name: str,
        layer_idx: int | None = None,
        *args: Any,
        metadata: Mapping[str, Any] | None = None,
        phase: str | None = None,
        component: str | None = None,
        rank: int | None = None,
    ) -> str | None:
        if not self.enabled or tensor is None:
            return None
        md = compat.save_tensor_metadata(args, metadata, phase, component, rank)
        return _save(
            tensor, layer_type, operation, quant_type, tensor_name, layer_idx, md, self._save_dir
        )

    def flush(self) -> dict[str, Any]:
        return flush()


_SHARED = TensorSaver()


def get_tensor_saver() -> TensorSaver:
    """The shared saver object (a fork's API)."""
    return _SHARED


def flush() -> dict[str, Any]:
    """Wait until every queued tensor is on disk; report files, bytes, drops and failed
    writes (each kind of loss said once on stderr)."""
    return _SAVER.flush()


def accelerator_status() -> dict[str, str]:
    """Each opt-in accelerator (``TENSOR_SAVE_ACCELERATORS``) and what runs in its place in
    this process: ``off`` where it was not asked for, else what it answers (the statistics
    kernel waits for a compile under way)."""
    return {
        name: (("on: " + _ACCELERATORS[name]()) if settings.accelerated(name) else "off")
        for name in settings.ACCELERATORS
    }


_ACCELERATORS = {"stats-kernel": stats_kernel.status, "pickler": pickler.status}


def stats_kernel_status() -> str:
    """How host statistics are computed in this process (waiting for a compile under way):
    ``kernel (cached: PATH)``, ``kernel (compiled: PATH)``, ``kernel (compiled, not
    cached: WHY)`` or ``torch operators (WHY)``."""
    if not settings.accelerated("stats-kernel"):
        return "torch operators (stats-kernel is not in TENSOR_SAVE_ACCELERATORS)"
    return stats_kernel.status()


atexit.register(flush)
