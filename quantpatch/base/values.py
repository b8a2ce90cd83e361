"""Every value a site may hold, as plain data: what it quantizes with and which library function
it is bit-identical to (``quantpatch list`` renders it; docs/formats.md shows the same table;
tests/test_reference_numerics.py drives ``fake_quant`` from these fields against each
reference). Derived from the one format spec, ``quantpatch.runtime.quantpatch_formats``
(standard library only: the CLI reads it at start-up without torch).

Fields of each entry:

* ``name``; ``roles``: the roles (linear, qk, pv) that may hold it;
* ``family``: ``none``, ``mx``, ``nvfp4``, ``fp8-tensor``, ``fp8-delayed``, ``fp8-block``,
  ``hifp8``, ``paretoq``;
* ``element_forward`` / ``element_gradient``: ``e4m3``, ``e5m2``, ``e3m2``, ``e2m3``,
  ``e2m1``, ``hif8`` or None (the element of the forward operands, and of the gradient
  operand under ``backward=True``);
* ``block``: the scale block along the reduction dimension, ``[rows, cols]`` (None: no block
  scale); ``weight_block``: a weight's, where it differs (else None);
* ``scale``: ``e8m0-floor``, ``e8m0-rceil``, ``e4m3-fp32`` (E4M3 block scales under a float32
  tensor scale), ``fp32``, ``fp32-delayed`` (a float32 tensor scale from the layer's amax
  history of earlier steps), ``pow2`` or None;
* ``rht``: a random Hadamard transform first; ``gradient_rounding``: ``nearest`` or
  ``stochastic`` (the gradient operand's);
* ``four_over_six``: NVFP4's 4over6 block scaling of the input and weight operands, ``mae``
  or ``mse`` (the error that picks map-to-4 or map-to-6 per block), else None;
  ``e4m3_max``: the E4M3 bound in an NVFP4 value's tensor scale (448, or 256 under 4over6;
  None outside NVFP4);
* ``fused_gemm``: whether the GEMM that quantizes its operands in its tile loop takes it;
* ``reference``: the library function the value is bit-identical to, in words (None: none);
* ``megatron``: the Megatron-LM flags whose quantization it emulates (None: none).
"""

from __future__ import annotations

from typing import Any

from quantpatch.runtime.quantpatch_formats import FAMILIES, SPECS, Format


def _value(f: Format) -> dict[str, Any]:
    return {
        "name": f.name,
        "roles": list(f.roles),
        "family": f.family,
        "element_forward": f.input,
        "element_gradient": f.grad_output,
        "block": list(f.block) if f.block else None,
        "weight_block": list(f.weight_block) if f.weight_block else None,
        "scale": f.scale,
        "rht": f.rht,
        "gradient_rounding": f.rounding("grad_output"),
        "four_over_six": f.four_over_six or None,
        "e4m3_max": f.e4m3_max if f.family == "nvfp4" else None,
        "fused_gemm": f.fused_gemm,
        "reference": f.reference,
        "megatron": f.megatron,
    }


VALUES: tuple[dict[str, Any], ...] = tuple(
    _value(f) for f in sorted((f for f in SPECS if f.roles), key=lambda f: FAMILIES.index(f.family))
)
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
    head = (*TEXT_COLUMNS, "fused_gemm", "megatron", "reference")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, row in zip(VALUES, text_rows(), strict=True):
        megatron = f"`{v['megatron']}`" if v["megatron"] else "-"
        cells = (*row, _cell(v["fused_gemm"]), megatron, _cell(v["reference"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def value_list(role: str | None = None, *, with_bf16: bool = True) -> str:
    """The values ``role`` may hold (None: every value), comma-separated, for help texts; the
    grouped ParetoQ values as ``w<b>g<N>``."""
    names = [
        f.name
        for f in SPECS
        if f.roles and (role is None or role in f.roles) and (with_bf16 or f.name != "bf16")
    ]
    if any(f.grouped for f in SPECS if f.name in names):
        names.append("w<b>g<N>")
    return ", ".join(names)


def summary_table() -> str:
    """The values one line each, with the Megatron flags each emulates, as docs/formats.md
    shows them (a test keeps the two equal): from the spec's ``summary`` and ``megatron``."""
    lines = [
        "| value | what the GEMM computes (both operands fake-quantized along the reduction "
        "dimension) | Megatron flags it emulates |",
        "| --- | --- | --- |",
    ]
    for f in SPECS:
        if f.roles:
            flags = f"`{f.megatron}`" if f.megatron else "-"
            lines.append(f"| `{f.name}` | {f.summary.replace('|', chr(92) + '|')} | {flags} |")
    return "\n".join(lines) + "\n"
