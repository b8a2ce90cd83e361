"""TransformerEngine's own reference quantizers, imported on CPU from its pure-Python wheel.

The wheel (``pip download --no-deps transformer-engine==2.20.2``, 1.2 MB) is fetched once into
the tests' cache beside the megatron-core wheels (``quantpatch.base.megatron_source.cache_dir``)
and only ``transformer_engine/pytorch/custom_recipes/`` is unpacked from it. Nothing of TE is
installed or committed: its ``transformer_engine`` and ``transformer_engine.pytorch`` packages
are stood in for by empty namespace modules (their ``__init__`` loads the CUDA library), and
the two compiled-side modules the references import (``quantized_tensor`` for the
``Quantizer``/``QuantizedTensorStorage`` base classes, ``tensor.utils`` for ``is_custom``) by
the few lines below. The reference arithmetic itself runs as TE ships it.

Public helpers::

    te_modules() -> SimpleNamespace(reference_nvfp4, reference_current_scaling, reference_utils)
    te_nvfp4(x, tile=(1, 16), rht=False) -> (codes, scales, global_amax)   # rowwise, or the
                                                                         # columnwise RHT path
    te_nvfp4_dequant(codes, scales, global_amax, tile) -> float32 values as TE's GEMM reads them
    te_current_scaling(x, dtype) -> (q as float32, scale_inv)
    te_blockwise(x, dtype, tile) -> Float8BlockScaling's values (float32), tile (1|128, 128)
    te_delayed_update() -> TE's unfused delayed-scaling update (``_amax_and_scale_update``)

``quantization.py`` (TE's recipe state and its delayed-scaling update) imports the compiled
extension at its top, so its pure-Python update functions are taken out of it with libcst and
run as TE ships them (``@jit_fuser`` standing for TorchScript's identity on CPU).
"""

from __future__ import annotations

import fcntl
import importlib
import sys
import types
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, Union

import pytest

from quantpatch.base.megatron_source import cache_dir, fetch_wheel, make_private_dirs

TE_VERSION = "2.20.2"
_RECIPES = "transformer_engine/pytorch/custom_recipes/"
_QUANTIZATION = "transformer_engine/pytorch/quantization.py"


def te_tree() -> Path:
    """The unpacked ``custom_recipes`` folder's root (the folder holding ``transformer_engine``),
    fetched and unpacked once per machine under a lock (xdist workers share it)."""
    base = cache_dir() / "te"
    make_private_dirs(base)
    root = base / f"transformer_engine-{TE_VERSION}"
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".done").exists() or not (root / _QUANTIZATION).exists():
            wheel = fetch_wheel(TE_VERSION, base / "wheels", "transformer-engine")
            with zipfile.ZipFile(wheel) as zf:
                for name in zf.namelist():
                    if (
                        name.startswith(_RECIPES) and name.endswith(".py")
                    ) or name == _QUANTIZATION:
                        zf.extract(name, root)
            (root / ".done").write_text(TE_VERSION)
    return root


class _Quantizer:
    """Stand-in for ``transformer_engine.pytorch.quantized_tensor.Quantizer`` (its usage flags
    are all the references read of it)."""

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True) -> None:
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False


class _QuantizedTensorStorage:
    """Stand-in for ``transformer_engine.pytorch.quantized_tensor.QuantizedTensorStorage``."""


def _is_custom(x: Any) -> bool:
    return bool(getattr(x, "custom", False))


def _package(name: str, path: Path | None) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)] if path is not None else []
    return mod


@cache
def te_modules() -> types.SimpleNamespace:
    """TE's ``reference_nvfp4``, ``reference_current_scaling`` and ``reference_utils``."""
    pytest.importorskip("torch")
    root = te_tree()
    te = root / "transformer_engine"
    stand_ins = {
        "transformer_engine": _package("transformer_engine", te),
        "transformer_engine.pytorch": _package("transformer_engine.pytorch", te / "pytorch"),
        "transformer_engine.pytorch.tensor": _package("transformer_engine.pytorch.tensor", None),
    }
    qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")
    qt.Quantizer = _Quantizer  # type: ignore[attr-defined]
    qt.QuantizedTensorStorage = _QuantizedTensorStorage  # type: ignore[attr-defined]
    utils = types.ModuleType("transformer_engine.pytorch.tensor.utils")
    utils.is_custom = _is_custom  # type: ignore[attr-defined]
    stand_ins[qt.__name__] = qt
    stand_ins[utils.__name__] = utils
    for name, mod in stand_ins.items():
        sys.modules.setdefault(name, mod)
    prefix = "transformer_engine.pytorch.custom_recipes."
    return types.SimpleNamespace(
        reference_nvfp4=importlib.import_module(prefix + "reference_nvfp4"),
        reference_current_scaling=importlib.import_module(prefix + "reference_current_scaling"),
        reference_utils=importlib.import_module(prefix + "reference_utils"),
    )


def te_nvfp4(
    x: Any,
    tile: tuple[int, int] = (1, 16),
    rht: bool = False,
    four_over_six: str = "",
    e4m3_max: int = 448,
) -> tuple[Any, Any, Any]:
    """TE's ``NVFP4QuantizerRef`` on the 2-D tensor ``x``: ``(codes, scales, global_amax)``;
    ``four_over_six`` ("MAE" or "MSE"): with ``nvfp4_use_4over6`` and ``nvfp4_e4m3_max``.

    Without ``rht`` the rowwise result: ``codes`` the E2M1 values (float32, ``x``'s shape,
    signed), ``scales`` the E4M3 block scales as float32 (one per block), ``global_amax`` the
    tensor's amax. With ``rht`` TE transforms only its columnwise operand (``x.t()``, the
    weight-gradient GEMM's), so the result is that of ``x.t()`` after the transform."""
    mods = te_modules()
    ref = mods.reference_nvfp4
    q = ref.NVFP4QuantizerRef(
        dtype=mods.reference_utils.Fp4Formats.E2M1,
        rowwise=not rht,
        columnwise=rht,
        quant_tile_shape=tile,
        with_rht=rht,
        nvfp4_use_4over6=bool(four_over_six),
        nvfp4_e4m3_max=e4m3_max,
        nvfp4_4over6_err_mode=four_over_six or "MAE",
    )
    qx, sx, qx_t, sx_t, amax_row, amax_col = q._quantize(x)
    codes_packed, scales, amax = (qx_t, sx_t, amax_col) if rht else (qx, sx, amax_row)
    import torch

    codes = ref.cast_from_fp4x2(codes_packed, torch.float32)
    return codes, scales.to(torch.float32), amax


def te_nvfp4_dequant(
    codes: Any, scales: Any, global_amax: Any, tile: tuple[int, int], e4m3_max: int = 448
) -> Any:
    """The values TE's reference GEMM multiplies (``high_precision_gemm_ref``'s dequantization:
    ``code * (scale * (amax / (6 * e4m3_max)))``, its ``alpha`` split per operand; see
    reference_nvfp4.py), float32."""
    import torch

    m, n = codes.shape
    s = scales[:m, : (n + tile[1] - 1) // tile[1]]
    s = s.repeat_interleave(tile[1], dim=1)[:, :n]
    global_decode = global_amax.to(torch.float32) / torch.tensor(6.0 * e4m3_max)
    return codes * (s * global_decode)


def te_current_scaling(x: Any, dtype: Any) -> tuple[Any, Any]:
    """TE's ``CurrentScalingQuantizerRef`` (per-tensor current scaling, no pow2 scales, eps 0)
    on ``x``: the FP8 values as float32 and the dequantization scale ``scale_inv``."""
    import torch

    ref = te_modules().reference_current_scaling
    q = ref.CurrentScalingQuantizerRef(dtype=dtype, rowwise=True, columnwise=False)
    qx, sx, _, _ = q._quantize(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]))
    return qx.to(torch.float32).reshape(x.shape), sx


def te_blockwise(x: Any, dtype: Any, tile: tuple[int, int]) -> Any:
    """``Float8BlockScaling``'s quantization of the 2-D ``x`` (``tile`` (1, 128) along its rows,
    or (128, 128)), dequantized as float32: the steps of TE's ``BlockwiseQuantizerReference``
    (tests/pytorch/references; not in the wheel) with the wheel's own scale function, the
    current-scaling reference's ``_scale_from_amax_tensor`` (``pow_2_scales=True``, eps 0, the
    FP8 dtype's largest value: 448 for E4M3, 57344 for E5M2): tiles zero-padded, the float32
    amax of each, ``q = dtype(clamp(x * scale, +-max))``, the value ``q * scale_inv``."""
    import torch

    scale_from_amax = te_modules().reference_current_scaling._scale_from_amax_tensor
    rows, cols = x.shape
    th, tw = tile
    pad = (0, (-cols) % tw, 0, (-rows) % th)
    v = torch.nn.functional.pad(x, pad).contiguous()
    m, k = v.shape
    tiles = v.reshape(m // th, th, k // tw, tw)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).float()
    scale, scale_inv, _ = scale_from_amax(x.dtype, amax, dtype, eps=0.0, pow_2_scales=True)
    top = torch.finfo(dtype).max
    q = torch.clamp(tiles * scale, min=-top, max=top).to(dtype)
    out = q.to(torch.float32) * scale_inv
    return out.reshape(m, k)[:rows, :cols]


_DELAYED_FUNCTIONS = (
    "_update_amax_history",
    "_default_get_amax_and_update_history",
    "_default_sf_compute",
    "_compute_amax_and_update_history",
    "_compute_scaling_factor",
    "_amax_and_scale_update",
)


@cache
def te_delayed_update() -> Any:
    """TE's ``_amax_and_scale_update(amax_history, scale, fp8_max, recipe)`` (the update
    ``NVTE_UNFUSED_FP8_UPDATE=1`` runs; ``recipe`` needs ``amax_compute_algo``, ``margin`` and
    ``scaling_factor_compute_algo``), with the functions it calls, from TE's own source."""
    import libcst as cst
    import torch

    source = (te_tree() / _QUANTIZATION).read_text()
    module = cst.parse_module(source)
    found = {
        node.name.value: module.code_for_node(node)
        for node in module.body
        if isinstance(node, cst.FunctionDef) and node.name.value in _DELAYED_FUNCTIONS
    }
    missing = set(_DELAYED_FUNCTIONS) - set(found)
    assert not missing, f"TE {TE_VERSION}'s quantization.py lacks {sorted(missing)}"
    namespace: dict[str, Any] = {
        "torch": torch,
        "jit_fuser": lambda f: f,
        "Tuple": tuple,
        "Union": Union,
        "Callable": Callable,
        "DelayedScaling": object,
    }
    for name in _DELAYED_FUNCTIONS:
        exec(compile(found[name], f"<TE {_QUANTIZATION}:{name}>", "exec"), namespace)
    return namespace["_amax_and_scale_update"]
