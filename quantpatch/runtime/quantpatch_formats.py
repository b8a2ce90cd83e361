"""Every number format quantpatch emulates, declared once: the element types and one entry per
value. The runtime's dispatch and kernels, the CLI's choices and help, ``quantpatch list``, the
values table, the analysis candidates and docs/formats.md are all derived from this module.

Installed by ``quantpatch init`` beside ``quantpatch_ops.py`` (``megatron/core/``); standard
library only, so the CLI reads it at start-up without torch. A format is one :class:`Format`
entry in :data:`SPECS`; an entry whose fields do not describe a format the runtime can compute
is refused when this module is imported, and a name without an entry is refused by every entry
point (``fake_quant``, ``quant_matmul``, ``set``, ``tensors formats``) in one sentence.

Operand roles are TransformerEngine's: ``input`` (the activation of the forward GEMM, the
saved input of the weight-gradient GEMM), ``weight`` and ``grad_output`` (the output gradient,
the first operand of Megatron's dgrad and wgrad products).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Element(NamedTuple):
    """A floating-point element type with saturation: its constants as the rounding uses them."""

    mbits: int
    """Mantissa bits."""
    emin: int
    """The exponent of the smallest normal (the subnormal spacing is 2^(emin - mbits))."""
    vmax: float
    """The largest finite value (saturation)."""
    emax: int
    """The exponent of the largest power of two it holds (OCP MX: ``emax_elem``)."""


E4M3 = Element(3, -6, 448.0, 8)
E5M2 = Element(2, -14, 57344.0, 15)
E2M1 = Element(1, 0, 6.0, 2)
E2M3 = Element(3, 0, 7.5, 2)
E3M2 = Element(2, -2, 28.0, 4)
ELEMENTS: dict[str, Element] = {
    "e4m3": E4M3,
    "e5m2": E5M2,
    "e2m1": E2M1,
    "e2m3": E2M3,
    "e3m2": E3M2,
}
"""The element types with an exponent and a mantissa of fixed widths (OCP FP8, FP6, FP4).
``hif8`` (HiFloat8's tapered precision) is an element of its own, computed by its family."""

ROLES = ("linear", "qk", "pv")
"""The GEMM families a site governs."""
OPERANDS = ("input", "weight", "grad_output")
"""The operand roles (TransformerEngine's names)."""

FAMILIES = ("none", "mx", "fp8-tensor", "fp8-delayed", "fp8-block", "hifp8", "nvfp4", "paretoq")
"""Each family is one module of arithmetic in the runtime (this order is the table's)."""
SCALES = ("e8m0-floor", "e8m0-rceil", "e4m3-fp32", "fp32", "fp32-delayed", "pow2")
"""``e8m0-floor``: OCP MX's 2^(floor(log2 amax) - emax); ``e8m0-rceil``: NVIDIA's
2^ceil(log2(amax / vmax)); ``e4m3-fp32``: E4M3 block scales under a float32 tensor scale;
``fp32``: one float32 scale (per tensor, or ParetoQ's learnable step per row);
``fp32-delayed``: one float32 scale per tensor from its linear layer's amax history of earlier
steps (TransformerEngine's delayed scaling);
``pow2``: a power-of-two float32 scale per block."""
BACKWARD = ("all", "grad_output")
"""Which operands of a backward GEMM (``backward=True``) take the gradient treatment
(``grad_output``'s element and rounding): ``all`` of them (``mxfp8``, as it always has), or
the ``grad_output`` alone, the other operand keeping its forward element (TE's HYBRID recipes,
NVFP4's stochastic rounding)."""
FOUR_OVER_SIX = ("", "mae", "mse")
"""NVFP4's 4over6 block scaling (Cook et al., arXiv 2512.02010; TE's ``nvfp4_4over6``): each
block of the input and weight operands is scaled so its amax maps to 4 or to 6, whichever
errs less by this metric (mean absolute or squared error); empty: every block maps to 6."""
WEIGHT_CACHE = ("", "elementwise", "forward", "tiles")
"""How the weight cache may share one quantized weight between W and W^T and both directions:
``elementwise`` (no block: always), ``forward`` (one tensor scale, where no gradient element
applies), ``tiles`` (2-D tiles of a matrix); empty: one entry per dimension and direction."""

_TORCHAO = "torchao 0.18 to_mx(..., ScaleCalculationMode.{mode}, block_size=32) + to_dtype"
_TE_NVFP4 = "TransformerEngine 2.20.2 NVFP4QuantizerRef"
_PARETOQ = (
    "ParetoQ's weight quantizers (Liu et al., arXiv 2502.02631), a learnable float32 step per "
    "output row (the grouped values: per row and group of N input columns); not a library's "
    "bit pattern"
)
_TE_DELAYED = (
    "TransformerEngine's delayed-scaling update as its fused kernel computes it "
    "(fused_amax_and_scale_update_after_reduction; 2.20.2's unfused Python update but for its "
    "two documented differences) and its satfinite FP8 cast, DelayedScaling, Format.{fmt}"
)
_DELAYED_ROLE = (
    "scales each operand from its linear layer's amax history, which {role} does not keep; use "
    "'fp8-tensor' (current scaling) for {role}"
)
_TE_4OVER6 = (
    _TE_NVFP4 + " with nvfp4_use_4over6, nvfp4_4over6_err_mode={mode}, nvfp4_e4m3_max={bound} "
    "(tile (1, 16); weights (16, 16)); the output gradient as `nvfp4`'s (TE's gradient slots "
    "take no 4over6)"
)
_4OVER6_ROLE = (
    "is TE's 4over6, which NVFP4BlockScaling applies to the linear layers' inputs and weights "
    "only (TE quantizes no attention GEMM in NVFP4); use 'nvfp4' for {role}"
)
_PARETOQ_ROLE = (
    "is a ParetoQ weight format, and only the linear role has weights; {role} takes the other "
    "values"
)


@dataclass(frozen=True)
class Format:
    """One value a site may hold (or, with ``roles=()``, an operand format that a value's
    products give one operand: ``fp8-block-2d``)."""

    name: str
    family: str
    input: str | None = None
    """The element of the input operand (and of every operand outside a backward GEMM)."""
    weight: str | None = None
    grad_output: str | None = None
    block: tuple[int, int] | None = None
    """The scale block along the reduction dimension, (rows, cols); None: no block scale."""
    weight_block: tuple[int, int] | None = None
    """A weight's block, where it differs from ``block``."""
    scale: str | None = None
    roles: tuple[str, ...] = ROLES
    backward: str = "all"
    stochastic: tuple[str, ...] = ()
    """The operand roles rounded stochastically (the others: to nearest, ties to even)."""
    rht: bool = False
    """A random Hadamard transform of both operands along the reduction dimension first."""
    tiled: bool = False
    """``fake_quant`` of this name quantizes 2-D tiles (its ``weight_block``) of the last two
    dimensions, not blocks along ``dim``."""
    weight_operand: str | None = None
    """The operand format the products give a weight (None: this one)."""
    other_operand: str | None = None
    """The operand format the products give every other operand (None: this one)."""
    fused_gemm: bool = False
    """Whether the GEMM that quantizes its operands in its tile loop takes it (a value with
    ``rht``: its operands transformed first, then that GEMM); the others take the separate
    path (fake-quant kernels, then the product)."""
    weight_cache: str = ""
    four_over_six: str = ""
    """4over6 on the input and weight operands, with this error metric (:data:`FOUR_OVER_SIX`;
    the output gradient under ``backward=True`` is plain ``nvfp4``'s, as TE's)."""
    e4m3_max: int = 448
    """The E4M3 bound in the per-tensor scale ``e4m3_max * 6 / amax`` (TE: 256 or 448 under
    4over6, 448 otherwise)."""
    grouped: bool = False
    """Takes a ``g<N>`` suffix (ParetoQ: one step per row and group of N input columns)."""
    w_bits: int | None = None
    """A ParetoQ value's ``w_bits`` in ParetoQ's code (0: ternary); None for every other
    family."""
    default_candidate: bool = False
    """Compared by ``tensors formats`` and ``tensors plot`` when no ``--formats`` is given."""
    linear_only: str = ""
    """Why only the linear role may hold it (``{role}``: the role refused), as the end of the
    sentence ``'<name>' ...``."""
    summary: str = ""
    """What the GEMM computes with it, one line (docs/formats.md's table of values)."""
    reference: str | None = None
    """The function it is bit-identical to, in words (None: none)."""
    megatron: str | None = None
    """The Megatron-LM flags whose quantization it emulates (None: none)."""

    def __post_init__(self) -> None:
        why = _incomplete(self)
        if why:
            raise ValueError(f"format {self.name!r} is declared incompletely: {why}")

    def element(self, operand: str) -> str | None:
        """The element of ``operand`` (one of :data:`OPERANDS`)."""
        return {"input": self.input, "weight": self.weight, "grad_output": self.grad_output}[
            operand
        ]

    def rounding(self, operand: str) -> str:
        return "stochastic" if operand in self.stochastic else "nearest"

    @property
    def operands(self) -> tuple[str, str]:
        """(a weight's operand format, every other operand's) in the products."""
        return (self.weight_operand or self.name, self.other_operand or self.name)


_ELEMENTS_OF = {
    "mx": set(ELEMENTS),
    "fp8-tensor": {"e4m3", "e5m2"},
    "fp8-delayed": {"e4m3", "e5m2"},
    "fp8-block": {"e4m3", "e5m2"},
    "hifp8": {"hif8"},
    "nvfp4": {"e2m1"},
}


def _bad_elements(f: Format) -> str:
    elements = [f.input, f.weight, f.grad_output]
    if f.family in ("none", "paretoq"):
        if any(e is not None for e in elements):
            return f"a {f.family} value quantizes no operand to an element"
    elif any(e not in _ELEMENTS_OF[f.family] for e in elements):
        return f"its elements {elements} are not all of {sorted(_ELEMENTS_OF[f.family])}"
    return ""


_RULES: tuple[tuple[Callable[[Format], bool], Callable[[Format], str]], ...] = (
    # (what makes an entry incomplete, the sentence that says so), one per field or pair of
    # fields, in the order a reader of an entry meets them
    (lambda f: f.scale is not None and f.scale not in SCALES,
     lambda f: f"scale {f.scale!r} is none of {', '.join(SCALES)}"),
    (lambda f: f.family == "mx"
     and (f.block != (1, 32) or f.scale not in ("e8m0-floor", "e8m0-rceil")),
     lambda f: "an MX value has blocks of (1, 32) and an E8M0 scale rule"),
    (lambda f: f.family == "nvfp4" and (f.block != (1, 16) or f.scale != "e4m3-fp32"),
     lambda f: "an NVFP4 value has blocks of (1, 16) and E4M3 scales under a float32 one"),
    (lambda f: f.family == "fp8-block" and f.block != (1, 128),
     lambda f: "an fp8-block value has blocks of (1, 128)"),
    (lambda f: f.backward not in BACKWARD,
     lambda f: f"backward {f.backward!r} is none of {', '.join(BACKWARD)}"),
    (lambda f: not set(f.roles) <= set(ROLES) or not set(f.stochastic) <= set(OPERANDS),
     lambda f: "its roles or stochastic operands are not of the known ones"),
    (lambda f: f.weight_cache not in WEIGHT_CACHE,
     lambda f: f"weight_cache {f.weight_cache!r} is none of {WEIGHT_CACHE}"),
    (lambda f: f.tiled and f.weight_block is None,
     lambda f: "a tiled format names its tiles (weight_block)"),
    (lambda f: bool(f.roles) and f.roles != ROLES and not f.linear_only,
     lambda f: "a value some roles may not hold says why (linear_only)"),
    (lambda f: bool(f.roles) and not f.summary,
     lambda f: "a value says in one line what the GEMM computes with it (summary)"),
    (lambda f: (f.family == "paretoq") != (f.w_bits is not None),
     lambda f: "a ParetoQ value, and only one, names its w_bits"),
    (lambda f: f.four_over_six not in FOUR_OVER_SIX,
     lambda f: f"four_over_six {f.four_over_six!r} is none of {FOUR_OVER_SIX}"),
    (lambda f: f.e4m3_max not in (256, 448) or (f.e4m3_max != 448 and not f.four_over_six),
     lambda f: "the E4M3 bound is 448, or 256 under 4over6 (TE's nvfp4_e4m3_max)"),
    (lambda f: bool(f.four_over_six)
     and (f.family != "nvfp4" or f.rht or bool(set(f.stochastic) - {"grad_output"})),
     lambda f: "4over6 is NVFP4's, without the Hadamard transform or stochastic rounding"),
    (lambda f: f.fused_gemm
     and (f.family in ("none", "paretoq", "fp8-delayed") or bool(f.four_over_six)),
     lambda f: "the fused GEMM takes no unquantized, ParetoQ, delayed-scaling or 4over6 value"),
)  # fmt: skip


def _incomplete(f: Format) -> str:
    """What keeps ``f`` from being a format the runtime computes ('' where nothing does): the
    first of its family, its elements and the rules above that it breaks."""
    if f.family not in FAMILIES:
        return f"family {f.family!r} is none of {', '.join(FAMILIES)}"
    bad = _bad_elements(f)
    if bad:
        return bad
    return next((say(f) for broken, say in _RULES if broken(f)), "")


# Every entry is a literal ``Format("name", ...)`` call, never built by a helper: the CLI reads
# the spec installed in a checkout with libcst and does not import it
# (``sites.discovery.read_ops_values``), so a name made at run time would be a value the CLI
# cannot see there.
SPECS: tuple[Format, ...] = (
    Format("bf16", "none", summary='no quantization: the original PyTorch call',
        reference="the unquantized product"),
    Format(
        "mxfp8", "mx", "e4m3", "e4m3", "e5m2", (1, 32), scale="e8m0-floor", fused_gemm=True,
        default_candidate=True,
        summary=(
            "OCP MX: blocks of 32 with an E8M0 scale (FLOOR rule); E4M3 elements forward, E5M2 "
            "for both operands of the gradient GEMMs"
        ),
        reference=_TORCHAO.format(mode="FLOOR") + " (OCP MX v1.0), except its 2^-127 block "
        "scale (docs/formats.md); both operands of a backward GEMM E5M2",
    ),
    Format(
        "mxfp4", "mx", "e2m1", "e2m1", "e2m1", (1, 32), scale="e8m0-floor", fused_gemm=True,
        default_candidate=True,
        summary='OCP MX with E2M1 elements, blocks of 32 (FLOOR rule)',
        reference=_TORCHAO.format(mode="FLOOR") + " (OCP MX v1.0), except its 2^-127 block "
        "scale (docs/formats.md)",
    ),
    Format(
        "hifp8", "hifp8", "hif8", "hif8", "hif8", fused_gemm=True, weight_cache="elementwise",
        default_candidate=True,
        summary='HiFloat8, per tensor: tapered 3/2/1 mantissa bits, no scale',
        reference="HiFloat8 (Luo et al., arXiv 2409.16626) as docs/formats.md specifies it; no "
        "library reference",
    ),
    Format(
        "nvfp4", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), scale="e4m3-fp32", fused_gemm=True,
        backward="grad_output", stochastic=("grad_output",),
        summary=(
            "NVIDIA's FP4: E2M1 in blocks of 16 with E4M3 scales under an FP32 tensor scale; the "
            "output gradient rounded stochastically"
        ),
        reference=_TE_NVFP4 + " (tile (1, 16))",
    ),
    Format(
        "nvfp4-2d", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        fused_gemm=True,
        roles=("linear",), backward="grad_output", stochastic=("grad_output",), tiled=True,
        other_operand="nvfp4", weight_cache="tiles",
        linear_only="tiles weights 16 x 16, and only the linear role has weights; use 'nvfp4' "
        "for {role}",
        summary='`nvfp4` with 16 x 16 weight tiles, so W and W^T quantize alike (linear role only)',
        reference=_TE_NVFP4 + " (tile (1, 16); weights (16, 16))",
    ),
    Format(
        "nvfp4-rht", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), scale="e4m3-fp32", fused_gemm=True,
        roles=("linear",), backward="grad_output", stochastic=("grad_output",), rht=True,
        linear_only="transforms the operands of the linear GEMMs (the weight gradient's in "
        "NVIDIA's recipe); use 'nvfp4' for {role}",
        summary=(
            "`nvfp4` after a random Hadamard transform (16 x 16, fixed signs, / 4) of both "
            "operands along the reduction dimension: NVIDIA's recipe for the weight-gradient GEMM"
            " (`--wgrad nvfp4-rht`; linear role only)"
        ),
        reference=_TE_NVFP4 + " (tile (1, 16), with_rht)",
    ),
    Format(
        "mxfp8-rceil", "mx", "e4m3", "e4m3", "e4m3", (1, 32), scale="e8m0-rceil", fused_gemm=True,
        summary=(
            "MX blocks of 32 with NVIDIA's RCEIL scale rule (2^ceil(log2(amax / 448))); E4M3 for "
            "the gradients too"
        ),
        reference=_TORCHAO.format(mode="RCEIL") + " (TransformerEngine MXFP8BlockScaling, "
        "default Format.E4M3)",
        megatron="--fp8-format e4m3 --fp8-recipe mxfp8",
    ),
    Format(
        "mxfp8-rceil-hybrid", "mx", "e4m3", "e4m3", "e5m2", (1, 32), scale="e8m0-rceil",
        fused_gemm=True,
        backward="grad_output",
        summary=(
            "`mxfp8-rceil` with E5M2 for the output gradient (TE's `Format.HYBRID`); the other "
            "operand of a gradient GEMM keeps E4M3"
        ),
        reference=_TORCHAO.format(mode="RCEIL") + " (TransformerEngine MXFP8BlockScaling, "
        "Format.HYBRID)",
        megatron="--fp8-format hybrid --fp8-recipe mxfp8",
    ),
    Format(
        "mxfp4-rceil", "mx", "e2m1", "e2m1", "e2m1", (1, 32), scale="e8m0-rceil", fused_gemm=True,
        summary='`mxfp4` with the RCEIL scale rule (2^ceil(log2(amax / 6)))',
        reference=_TORCHAO.format(mode="RCEIL"),
    ),
    Format(
        "fp8-tensor", "fp8-tensor", "e4m3", "e4m3", "e5m2", scale="fp32", backward="grad_output",
        fused_gemm=True,
        weight_cache="forward",
        summary=(
            "TE's per-tensor current scaling: one float32 scale 448 / amax per tensor, E4M3; the "
            "output gradient E5M2 (57344 / amax)"
        ),
        reference="TransformerEngine 2.20.2 CurrentScalingQuantizerRef (Float8CurrentScaling, "
        "Format.HYBRID) and its dequantize",
        megatron="--fp8-format hybrid --fp8-recipe tensorwise",
    ),
    Format(
        "fp8-tensor-e4m3", "fp8-tensor", "e4m3", "e4m3", "e4m3", scale="fp32",
        backward="grad_output", fused_gemm=True, weight_cache="forward",
        summary="`fp8-tensor` with E4M3 for the output gradient too (TE's `Format.E4M3`)",
        reference="TransformerEngine 2.20.2 CurrentScalingQuantizerRef (Float8CurrentScaling, "
        "Format.E4M3) and its dequantize",
        megatron="--fp8-format e4m3 --fp8-recipe tensorwise",
    ),
    Format(
        "fp8-delayed", "fp8-delayed", "e4m3", "e4m3", "e5m2", scale="fp32-delayed",
        roles=("linear",), backward="grad_output", linear_only=_DELAYED_ROLE,
        summary=(
            "TE's delayed scaling: one float32 scale per tensor from the linear layer's amax "
            "history of earlier steps, E4M3; the output gradient E5M2 (linear role only)"
        ),
        reference=_TE_DELAYED.format(fmt="HYBRID"),
        megatron="--fp8-format hybrid --fp8-recipe delayed",
    ),
    Format(
        "fp8-delayed-e4m3", "fp8-delayed", "e4m3", "e4m3", "e4m3", scale="fp32-delayed",
        roles=("linear",), backward="grad_output", linear_only=_DELAYED_ROLE,
        summary="`fp8-delayed` with E4M3 for the output gradient too (TE's `Format.E4M3`)",
        reference=_TE_DELAYED.format(fmt="E4M3"),
        megatron="--fp8-format e4m3 --fp8-recipe delayed",
    ),
    Format(
        "fp8-block", "fp8-block", "e4m3", "e4m3", "e4m3", (1, 128), (128, 128), "pow2",
        fused_gemm=True,
        weight_operand="fp8-block-2d",
        summary=(
            "DeepSeek-V3's blockwise FP8: E4M3 with power-of-two scales, 1 x 128 blocks along the"
            " reduction dimension, 128 x 128 tiles for a weight"
        ),
        reference="DeepSeek-V3 blockwise FP8 (TransformerEngine Float8BlockScaling defaults: "
        "pow_2_scales, eps 0): the formulas of TE's BlockwiseQuantizerReference "
        "(tests/pytorch/references), proven against quantpatch's own oracle in "
        "tests/test_reference_numerics.py",
        megatron="--fp8-format e4m3 --fp8-recipe blockwise",
    ),
    Format(
        "fp8-block-hybrid", "fp8-block", "e4m3", "e4m3", "e5m2", (1, 128), (128, 128), "pow2",
        fused_gemm=True, backward="grad_output", weight_operand="fp8-block-2d",
        summary=(
            "`fp8-block` with E5M2 for the output gradient's 1 x 128 blocks (scale "
            "2^floor(log2(57344 / amax)); TE's `Format.HYBRID`); the other operand of a gradient "
            "GEMM keeps E4M3"
        ),
        reference="the formulas of TE's BlockwiseQuantizerReference with the E5M2 dtype's "
        "largest value for the output gradient (TransformerEngine Float8BlockScaling, "
        "Format.HYBRID), proven against quantpatch's own oracle in "
        "tests/test_reference_numerics.py",
        megatron="--fp8-format hybrid --fp8-recipe blockwise",
    ),
    Format(
        "fp8-block-2d", "fp8-block", "e4m3", "e4m3", "e4m3", (1, 128), (128, 128), "pow2",
        roles=(), tiled=True, weight_cache="tiles",
        reference="fp8-block's weight tiles (an operand format, not a value)",
    ),
    Format(
        "mxfp6-e2m3", "mx", "e2m3", "e2m3", "e2m3", (1, 32), scale="e8m0-floor", fused_gemm=True,
        summary="OCP MX with FP6 E2M3 elements (largest 7.5), blocks of 32 (FLOOR rule)",
        reference=_TORCHAO.format(mode="FLOOR") + " with fp6_e2m3 (OCP MX v1.0), except its "
        "2^-127 block scale (docs/formats.md)",
    ),
    Format(
        "mxfp6-e3m2", "mx", "e3m2", "e3m2", "e3m2", (1, 32), scale="e8m0-floor", fused_gemm=True,
        summary="OCP MX with FP6 E3M2 elements (largest 28), blocks of 32 (FLOOR rule)",
        reference=_TORCHAO.format(mode="FLOOR") + " with fp6_e3m2 (OCP MX v1.0), except its "
        "2^-127 block scale (docs/formats.md)",
    ),
    Format(
        "mxfp6-e2m3-rceil", "mx", "e2m3", "e2m3", "e2m3", (1, 32), scale="e8m0-rceil",
        fused_gemm=True,
        summary="`mxfp6-e2m3` with the RCEIL scale rule (2^ceil(log2(amax / 7.5)))",
        reference=_TORCHAO.format(mode="RCEIL") + " with fp6_e2m3",
    ),
    Format(
        "mxfp6-e3m2-rceil", "mx", "e3m2", "e3m2", "e3m2", (1, 32), scale="e8m0-rceil",
        fused_gemm=True,
        summary="`mxfp6-e3m2` with the RCEIL scale rule (2^ceil(log2(amax / 28)))",
        reference=_TORCHAO.format(mode="RCEIL") + " with fp6_e3m2",
    ),
    Format(
        "nvfp4-4over6-mae", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=("linear",), backward="grad_output", stochastic=("grad_output",),
        weight_operand="nvfp4-4over6-mae-2d", four_over_six="mae", e4m3_max=256,
        linear_only=_4OVER6_ROLE,
        summary="NVFP4 with 4over6 (TE's default): each 16-block of the input and weight "
            "scaled so its amax maps to 4 or to 6, whichever gives the smaller absolute "
            "error (summed over the block, 16 x 16 tiles for a weight); tensor scale amax "
            "/ (256 * 6); the output gradient as `nvfp4` (linear role only)",
        reference=_TE_4OVER6.format(mode="MAE", bound=256),
    ),
    Format(
        "nvfp4-4over6-mae-2d", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=(), backward="grad_output", stochastic=("grad_output",), tiled=True,
        four_over_six="mae", e4m3_max=256,
        reference="nvfp4-4over6-mae's weight tiles (an operand format, not a value)",
    ),
    Format(
        "nvfp4-4over6-mae-448", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=("linear",), backward="grad_output", stochastic=("grad_output",),
        weight_operand="nvfp4-4over6-mae-448-2d", four_over_six="mae", e4m3_max=448,
        linear_only=_4OVER6_ROLE,
        summary="`nvfp4-4over6-mae` with the E4M3 bound 448 in the tensor scale (amax / (448 * 6))",
        reference=_TE_4OVER6.format(mode="MAE", bound=448),
    ),
    Format(
        "nvfp4-4over6-mae-448-2d", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=(), backward="grad_output", stochastic=("grad_output",), tiled=True,
        four_over_six="mae", e4m3_max=448,
        reference="nvfp4-4over6-mae-448's weight tiles (an operand format, not a value)",
    ),
    Format(
        "nvfp4-4over6-mse", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=("linear",), backward="grad_output", stochastic=("grad_output",),
        weight_operand="nvfp4-4over6-mse-2d", four_over_six="mse", e4m3_max=256,
        linear_only=_4OVER6_ROLE,
        summary="`nvfp4-4over6-mae` choosing 4 or 6 by the squared error",
        reference=_TE_4OVER6.format(mode="MSE", bound=256),
    ),
    Format(
        "nvfp4-4over6-mse-2d", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=(), backward="grad_output", stochastic=("grad_output",), tiled=True,
        four_over_six="mse", e4m3_max=256,
        reference="nvfp4-4over6-mse's weight tiles (an operand format, not a value)",
    ),
    Format(
        "nvfp4-4over6-mse-448", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=("linear",), backward="grad_output", stochastic=("grad_output",),
        weight_operand="nvfp4-4over6-mse-448-2d", four_over_six="mse", e4m3_max=448,
        linear_only=_4OVER6_ROLE,
        summary="`nvfp4-4over6-mse` with the E4M3 bound 448 in the tensor scale (amax / (448 * 6))",
        reference=_TE_4OVER6.format(mode="MSE", bound=448),
    ),
    Format(
        "nvfp4-4over6-mse-448-2d", "nvfp4", "e2m1", "e2m1", "e2m1", (1, 16), (16, 16), "e4m3-fp32",
        roles=(), backward="grad_output", stochastic=("grad_output",), tiled=True,
        four_over_six="mse", e4m3_max=448,
        reference="nvfp4-4over6-mse-448's weight tiles (an operand format, not a value)",
    ),
    Format("w1", "paretoq", scale="fp32", roles=("linear",), grouped=True, w_bits=1,
           linear_only=_PARETOQ_ROLE,
           summary=(
               "ParetoQ binary weights (linear role only, activations as they are): sign(W) * a, "
               "a a learnable step per output row (`w1g<N>`: per row and N input columns), "
               "initialised to mean |W| at the first forward"
           ),
        reference=_PARETOQ),
    Format("w1.58", "paretoq", scale="fp32", roles=("linear",), grouped=True, w_bits=0,
           linear_only=_PARETOQ_ROLE,
           summary=(
               "ParetoQ ternary weights: stretched elastic quant a * (round(clamp(W/a, +-0.99) * "
               "1.5) / 1.5), a from max |W| per row (or group), learnt"
           ),
        reference=_PARETOQ),
    Format("w2", "paretoq", scale="fp32", roles=("linear",), grouped=True, w_bits=2,
           linear_only=_PARETOQ_ROLE,
           summary=(
               "ParetoQ 2-bit weights: stretched elastic quant with n = 2, shift 0.5 (levels "
               "+-a/4, +-3a/4), a from max |W| per row (or group), learnt"
           ),
        reference=_PARETOQ),
    Format("w3", "paretoq", scale="fp32", roles=("linear",), grouped=True, w_bits=3,
           linear_only=_PARETOQ_ROLE,
           summary=(
               "ParetoQ 3-bit weights: LSQ a * clamp(round(W/a), -4, 3), a from max |W| / 3 per "
               "row (or group), learnt"
           ),
        reference=_PARETOQ),
    Format("w4", "paretoq", scale="fp32", roles=("linear",), grouped=True, w_bits=4,
           linear_only=_PARETOQ_ROLE,
           summary=(
               "ParetoQ 4-bit weights: LSQ a * clamp(round(W/a), -8, 7), a from max |W| / 7 per "
               "row (or group), learnt"
           ),
        reference=_PARETOQ),
)  # fmt: skip
"""Every format, one entry each (the order of ``QUANT_TYPES`` and of error messages)."""

SPEC: dict[str, Format] = {f.name: f for f in SPECS}
VALUES: tuple[str, ...] = tuple(f.name for f in SPECS if f.roles)
"""Every value a site may hold (the ParetoQ ones also take a ``g<N>`` suffix)."""
GROUPED: tuple[str, ...] = tuple(f.name for f in SPECS if f.grouped)
"""The values that take a ``g<N>`` group suffix."""


def names(
    *, family: str | None = None, values_only: bool = True, **fields: object
) -> tuple[str, ...]:
    """The names of the entries of ``family`` (None: any) whose ``fields`` have those values
    (``values_only``: leave out operand formats)."""
    return tuple(
        f.name
        for f in SPECS
        if (f.roles or not values_only)
        and (family is None or f.family == family)
        and all(getattr(f, k) == v for k, v in fields.items())
    )


def base_of(value: str) -> str:
    """The entry's name of ``value``: itself, or a grouped value's base (``w2g128``: ``w2``)."""
    if value in SPEC:
        return value
    base, sep, size = value.rpartition("g")
    if sep and base in GROUPED and size.isdigit() and not size.startswith("0") and len(size) <= 7:
        return base
    return value


def spec_of(fmt: str) -> Format:
    """The entry of ``fmt`` (a grouped value: its base's); an unknown name is a ``ValueError``
    in one sentence."""
    found = SPEC.get(base_of(fmt))
    if found is None:
        raise ValueError(
            f"unknown quantization format {fmt!r}; the known values are {', '.join(VALUES)} "
            "(and w<b>g<N>)"
        )
    return found
