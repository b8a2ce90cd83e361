"""Every value a site may hold, as plain data: what it quantizes with and which library function
it is bit-identical to (``quantpatch list`` renders it; docs/formats.md shows the same table;
tests/test_reference_numerics.py drives ``fake_quant`` from these fields against each
reference). Standard library only: the CLI reads it at start-up without torch.

Fields of each entry:

* ``name``; ``roles``: the roles (linear, qk, pv) that may hold it;
* ``family``: ``none``, ``mx``, ``nvfp4``, ``fp8-tensor``, ``fp8-delayed``, ``fp8-block``,
  ``hifp8``, ``paretoq``;
* ``element_forward`` / ``element_gradient``: ``e4m3``, ``e5m2``, ``e2m1``, ``hif8`` or None
  (the element of the forward operands, and of the gradient operand under ``backward=True``);
* ``block``: the scale block along the reduction dimension, ``[rows, cols]`` (None: no block
  scale); ``weight_block``: a weight's, where it differs (else None);
* ``scale``: ``e8m0-floor``, ``e8m0-rceil``, ``e4m3-fp32`` (E4M3 block scales under a float32
  tensor scale), ``fp32``, ``fp32-delayed`` (a float32 tensor scale from the layer's amax
  history of earlier steps), ``pow2`` or None;
* ``rht``: a random Hadamard transform first; ``gradient_rounding``: ``nearest`` or
  ``stochastic`` (the gradient operand's);
* ``reference``: the library function the value is bit-identical to, in words (None: none).
"""

from __future__ import annotations

from typing import Any

_TORCHAO = "torchao 0.18 to_mx(..., ScaleCalculationMode.{mode}, block_size=32) + to_dtype"
_TE_NVFP4 = "TransformerEngine 2.20.2 NVFP4QuantizerRef"
_TE_DELAYED = (
    "TransformerEngine's delayed-scaling update as its fused kernel computes it "
    "(fused_amax_and_scale_update_after_reduction; 2.20.2's unfused Python update but for its "
    "two documented differences) and its satfinite FP8 cast"
)


def _value(
    name: str,
    family: str,
    forward: str | None,
    gradient: str | None,
    block: list[int] | None,
    scale: str | None,
    reference: str | None,
    *,
    roles: tuple[str, ...] = ("linear", "qk", "pv"),
    weight_block: list[int] | None = None,
    rht: bool = False,
    gradient_rounding: str = "nearest",
) -> dict[str, Any]:
    return {
        "name": name,
        "roles": list(roles),
        "family": family,
        "element_forward": forward,
        "element_gradient": gradient,
        "block": block,
        "weight_block": weight_block,
        "scale": scale,
        "rht": rht,
        "gradient_rounding": gradient_rounding,
        "reference": reference,
    }


_PARETOQ = (
    "ParetoQ's weight quantizers (Liu et al., arXiv 2502.02631), a learnable float32 step per "
    "output row (the grouped values: per row and group of N input columns); not a library's "
    "bit pattern"
)

VALUES: tuple[dict[str, Any], ...] = (
    _value("bf16", "none", None, None, None, None, "the unquantized product"),
    _value(
        "mxfp8", "mx", "e4m3", "e5m2", [1, 32], "e8m0-floor",
        _TORCHAO.format(mode="FLOOR") + " (OCP MX v1.0), except its 2^-127 block scale "
        "(docs/formats.md); both operands of a backward GEMM E5M2",
    ),
    _value("mxfp4", "mx", "e2m1", "e2m1", [1, 32], "e8m0-floor", _TORCHAO.format(mode="FLOOR")
           + " (OCP MX v1.0), except its 2^-127 block scale (docs/formats.md)"),
    _value("mxfp8-rceil", "mx", "e4m3", "e4m3", [1, 32], "e8m0-rceil",
           _TORCHAO.format(mode="RCEIL") + " (TransformerEngine MXFP8BlockScaling, default "
           "Format.E4M3)"),
    _value("mxfp8-rceil-hybrid", "mx", "e4m3", "e5m2", [1, 32], "e8m0-rceil",
           _TORCHAO.format(mode="RCEIL") + " (TransformerEngine MXFP8BlockScaling, "
           "Format.HYBRID)"),
    _value("mxfp4-rceil", "mx", "e2m1", "e2m1", [1, 32], "e8m0-rceil",
           _TORCHAO.format(mode="RCEIL")),
    _value("fp8-tensor", "fp8-tensor", "e4m3", "e5m2", None, "fp32",
           "TransformerEngine 2.20.2 CurrentScalingQuantizerRef (Float8CurrentScaling, "
           "Format.HYBRID) and its dequantize"),
    _value("fp8-delayed", "fp8-delayed", "e4m3", "e5m2", None, "fp32-delayed",
           _TE_DELAYED + " (DelayedScaling, Format.HYBRID)", roles=("linear",)),
    _value("fp8-delayed-e4m3", "fp8-delayed", "e4m3", "e4m3", None, "fp32-delayed",
           _TE_DELAYED + " (DelayedScaling, Format.E4M3)", roles=("linear",)),
    _value("fp8-block", "fp8-block", "e4m3", "e4m3", [1, 128], "pow2",
           "DeepSeek-V3 blockwise FP8 (TransformerEngine Float8BlockScaling defaults: "
           "pow_2_scales, eps 0): the formulas of TE's BlockwiseQuantizerReference "
           "(tests/pytorch/references), proven against quantpatch's own oracle in "
           "tests/test_reference_numerics.py",
           weight_block=[128, 128]),
    _value("hifp8", "hifp8", "hif8", "hif8", None, None,
           "HiFloat8 (Luo et al., arXiv 2409.16626) as docs/formats.md specifies it; no library "
           "reference"),
    _value("nvfp4", "nvfp4", "e2m1", "e2m1", [1, 16], "e4m3-fp32",
           _TE_NVFP4 + " (tile (1, 16))", gradient_rounding="stochastic"),
    _value("nvfp4-2d", "nvfp4", "e2m1", "e2m1", [1, 16], "e4m3-fp32",
           _TE_NVFP4 + " (tile (1, 16); weights (16, 16))", roles=("linear",),
           weight_block=[16, 16], gradient_rounding="stochastic"),
    _value("nvfp4-rht", "nvfp4", "e2m1", "e2m1", [1, 16], "e4m3-fp32",
           _TE_NVFP4 + " (tile (1, 16), with_rht)", roles=("linear",), rht=True,
           gradient_rounding="stochastic"),
    *(
        _value(w, "paretoq", None, None, None, "fp32", _PARETOQ, roles=("linear",))
        for w in ("w1", "w1.58", "w2", "w3", "w4")
    ),
)  # fmt: skip
"""One entry per value of ``config.QUANT_TYPES`` (grouped by family)."""

FIELDS = tuple(VALUES[0])


def value_table() -> dict[str, dict[str, Any]]:
    """The entries by name."""
    return {v["name"]: v for v in VALUES}


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list):
        if v and all(isinstance(i, int) for i in v):
            return " x ".join(str(i) for i in v)
        return ", ".join(str(i) for i in v)
    return str(v)


TEXT_COLUMNS = (
    "name",
    "roles",
    "family",
    "element_forward",
    "element_gradient",
    "block",
    "weight_block",
    "scale",
    "rht",
    "gradient_rounding",
)
"""The columns ``list`` prints (the reference follows each table in docs/formats.md)."""


def text_rows() -> list[tuple[str, ...]]:
    """The table as text cells (``list``, docs/formats.md)."""
    return [tuple(_cell(v[c]) for c in TEXT_COLUMNS) for v in VALUES]


def markdown_table() -> str:
    """The table as docs/formats.md shows it (a test keeps the two equal)."""
    head = (*TEXT_COLUMNS, "reference")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, row in zip(VALUES, text_rows(), strict=True):
        lines.append("| " + " | ".join((*row, _cell(v["reference"]))) + " |")
    return "\n".join(lines) + "\n"
