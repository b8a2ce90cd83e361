"""Every environment variable the runtime reads, in one module: its name, default, the values it
takes and the one sentence that refuses any other. The other runtime modules ask here and never
read ``os.environ`` themselves.

Each is read where it is used (a launch script, a test or a user may change it between calls),
except ``QUANTPATCH_COMPILE``, read once when ``quantpatch_quantize`` is imported.

Installed by ``quantpatch init`` beside ``quantpatch_ops.py``; standard library only.
"""

from __future__ import annotations

import os

VARIABLES = {
    "QUANTPATCH_KERNELS": "auto | reference | triton: which code quantizes (default auto)",
    "QUANTPATCH_GEMM": "auto | fused | separate: the quantized GEMM's path (default auto)",
    "QUANTPATCH_COMPILE": "1: the PyTorch reference through torch.compile (default 0)",
    "QUANTPATCH_WEIGHT_CACHE": "0 | 1: weights quantized once per optimizer step (default 1)",
    "QUANTPATCH_WEIGHT_CACHE_MB": "the weight cache's size in MiB",
    "QUANTPATCH_SR_SEED": "the stochastic rounding's seed, plus RANK (default 0)",
    "QUANTPATCH_FLASH": "auto | 0 | 1: flash attention for the FA schemes (default auto)",
    "QUANTPATCH_FLASH_BF16": "0 | 1: a bf16 Q.K^T through the flash kernel (default 0)",
    "TENSOR_SAVE_ENABLED": "1, true, yes or on: the tensor saver is on",
    "TRITON_INTERPRET": "1: Triton's interpreter runs the kernels (CPU tensors too)",
    "RANK": "the process's rank (default 0): seeds, and which process prints",
}
"""The variables, each with what it takes (``quantpatch_ops``' docstring says more)."""

_FLAG_TRUE = ("1", "true", "yes", "on")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in choices:
        expected = ", ".join(choices[:-1]) + f" or {choices[-1]}"
        raise ValueError(f"{name}={value!r}; expected {expected}")
    return value


def kernels() -> str:
    return _choice("QUANTPATCH_KERNELS", "auto", ("auto", "reference", "triton"))


def gemm() -> str:
    return _choice("QUANTPATCH_GEMM", "auto", ("auto", "fused", "separate"))


def compile_reference() -> bool:
    return os.environ.get("QUANTPATCH_COMPILE", "0") == "1"


def weight_cache() -> bool:
    return _choice("QUANTPATCH_WEIGHT_CACHE", "1", ("0", "1")) == "1"


def weight_cache_mb(default: float) -> float:
    return float(os.environ.get("QUANTPATCH_WEIGHT_CACHE_MB", default))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def first_rank() -> bool:
    """Whether this process is rank 0 (the one that prints)."""
    return os.environ.get("RANK", "0") == "0"


def sr_seed() -> int:
    return int(os.environ.get("QUANTPATCH_SR_SEED", "0")) + rank()


def flash() -> str:
    return _choice("QUANTPATCH_FLASH", "auto", ("auto", "0", "1"))


def flash_bf16() -> bool:
    value = os.environ.get("QUANTPATCH_FLASH_BF16", "0") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"QUANTPATCH_FLASH_BF16={value!r}; expected 0 or 1")
    return value == "1"


def tensor_save() -> bool:
    return os.environ.get("TENSOR_SAVE_ENABLED", "").strip().lower() in _FLAG_TRUE


def triton_interpret() -> bool:
    """Whether Triton runs its kernels in its interpreter, the only way they read CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"
