"""What torch can do with each dtype, as the saver needs it: copy it, reduce it, save it in
``torch.save``'s non-zip format; and the bytes of a host tensor without a copy."""

from __future__ import annotations

import ctypes
import sys

import torch

NATIVE_STATS = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
"""Dtypes torch's reductions (``aminmax``, ``var_mean``, sums) take as they are."""

RAW_COPY = frozenset(
    getattr(torch, name)
    for name in (
        "bits8",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "float4_e2m1fn_x2",
        *(f"int{b}" for b in range(1, 8)),
        *(f"uint{b}" for b in range(1, 8)),
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
)
"""Dtypes torch has no copy for (bits, packed fp4, sub-byte integers): their snapshots are
copied as the integers of their element size, byte for byte."""

_PACKED_QUANT = frozenset({torch.quint4x2, torch.quint2x4})
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a view of its bytes as the integer type of its element size where torch
    cannot copy its dtype (``RAW_COPY``)."""
    return t.view(_SAME_SIZE[t.element_size()]) if t.dtype in RAW_COPY else t


def clone(t: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """A copy of ``t`` on its device (contiguous, or with ``t``'s strides where
    ``contiguous`` is False), whatever its dtype (a quantized tensor keeps
    its quantizer: it is never viewed as another dtype). Packed 4- and 2-bit quantized
    tensors, which torch has no copy for, are quantized again from their values, with their
    own scale and zero point: the same integers."""
    if t.is_quantized and t.dtype in _PACKED_QUANT and t.qscheme() == torch.per_tensor_affine:
        return torch.quantize_per_tensor(t.dequantize(), t.q_scale(), t.q_zero_point(), t.dtype)
    layout = torch.contiguous_format if contiguous else torch.preserve_format
    if t.dtype not in RAW_COPY:
        return t.clone(memory_format=layout)
    return raw(t).clone(memory_format=layout).view(t.dtype)


LEGACY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.qint8,
        torch.quint8,
        torch.qint32,
        torch.quint4x2,
        torch.quint2x4,
    }
)
"""Dtypes torch's non-zip format can hold (those with a legacy storage class, such as
``torch.FloatStorage``). It writes any other (float8, uint16/32/64, complex32, bits, packed
fp4) under a storage class that does not exist, and ``torch.load`` then fails."""


def float32s(*values: float) -> list[float]:
    """``values`` (Python floats) each rounded once to float32, as the files record them."""
    return torch.tensor(values, dtype=torch.float32).tolist()


def plain_host(host: torch.Tensor | None) -> bool:
    """Whether ``host`` is a plain tensor in host memory whose storage torch.save writes as
    it is in memory (little-endian)."""
    return (
        host is not None
        and type(host) is torch.Tensor
        and host.device.type == "cpu"
        and sys.byteorder == "little"
    )


def memory_of(host: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor's storage, without a copy."""

    storage = host.untyped_storage()
    memory = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    return memoryview(memory).cast("B")
