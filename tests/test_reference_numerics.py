"""The MX and FP8 values bit for bit against the vendors' own references.

* ``mxfp8`` / ``mxfp4`` against torchao 0.18's ``to_mx`` + ``to_dtype`` in
  ``ScaleCalculationMode.FLOOR``; ``mxfp8-rceil`` / ``mxfp8-rceil-hybrid`` / ``mxfp4-rceil``
  against its ``RCEIL`` mode (TransformerEngine's and the hardware's rule);
* ``fp8-tensor`` against TransformerEngine 2.20.2's ``CurrentScalingQuantizerRef`` (E4M3
  forward, E5M2 gradients);
* ``fp8-block`` against the independent oracle below (numpy scales, torch's float8 cast);
* the Triton kernels (interpreter, smaller tensors) against the PyTorch reference.

Inputs like a model's tensors: rows of Gaussians with a log-normal scale per row (seed
fixed), bf16 and fp32, along the last dimension and the first, an odd length (padding), and
rows built for the edges: zero blocks, ties, saturation, subnormal scales. Where a reference is
itself defective (torchao's FLOOR at the 2^-127 scale; NaN/Inf) the documented behaviour of
docs/formats.md is tested instead.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

from quantpatch.runtime import quantpatch_formats as formats
from quantpatch.runtime import quantpatch_fp8 as qf
from quantpatch.runtime import quantpatch_mx as qm
from quantpatch.runtime import quantpatch_ops as ops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats import kernels as torchao_kernels
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

_TORCHAO_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e2m1": torch.float4_e2m1fn_x2,
    "e2m3": DTYPE_FP6_E2M3,
    "e3m2": DTYPE_FP6_E3M2,
}
_MODES = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
_MX = [f for f in formats.SPECS if f.family == "mx"]
# (value, backward) -> (element, rule): what each MX value of the spec quantizes with
_MX_VALUES = {
    (f.name, backward): (str(f.grad_output if backward else f.input), str(f.scale)[5:])
    for f in _MX
    for backward in (False, True)
}
_MX_ELEMENTS = sorted({elem for elem, _ in _MX_VALUES.values()})
"""Every element type an MX value of the spec uses."""
_ELEMS = {e: formats.ELEMENTS[e] for e in _MX_ELEMENTS}


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return t.view(ints[t.dtype])


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype
    return int((_bits(a) != _bits(b)).sum())


def _rows(n_rows: int, n: int, seed: int = 0) -> torch.Tensor:
    """Model-like inputs: Gaussian rows, each with a log-normal scale, as bf16."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(n_rows, 1, generator=g) * 2.0)
    return (torch.randn(n_rows, n, generator=g) * scale).to(torch.bfloat16)


def _edges(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows for the edges (``n`` a multiple of 32): zero blocks, ties, saturation, subnormal
    scales (amax down to 2^-133), amax at and next to max_elem * 2^k."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.zeros(n)]
    base = torch.randn(n, generator=g)
    half_zero = base.clone()
    half_zero[::64] = 0
    half_zero.view(-1, 32)[::2] = 0  # every other block all zero
    rows.append(half_zero)
    # ties: multiples of 1/32 in [-8, 8] (E4M3/E5M2/E2M1 midpoints at many scales)
    rows.append(torch.randint(-256, 257, (n,), generator=g).float() / 32)
    rows.append(torch.randint(-64, 65, (n,), generator=g).float() / 8)
    # saturation: every block's amax just under the next power of two
    sat = base.clone()
    sat.view(-1, 32)[:, 0] = 1.96875 * 2.0 ** torch.arange(-20, -20 + n // 32).remainder(40)
    rows.append(sat)
    # amax exactly max_elem * 2^k, and one float32 ulp either side
    for m in sorted({e.vmax for e in _ELEMS.values()}):
        r = base.clone() / 8
        blocks = r.view(-1, 32)
        k = torch.arange(blocks.shape[0]).remainder(30) - 15
        a = m * 2.0**k
        ulp = torch.arange(blocks.shape[0]).remainder(3) - 1
        blocks[:, 5] = torch.where(ulp < 0, torch.nextafter(a, torch.zeros_like(a)), a)
        blocks[:, 5] = torch.where(ulp > 0, torch.nextafter(a, a * 2), blocks[:, 5])
        rows.append(r)
    # subnormal and tiny scales: block amax from 2^-100 down to 2^-133
    for e in (-100, -115, -119, -121, -125, -127, -129, -131, -133):
        rows.append(base * 2.0**e)
    return torch.stack(rows).to(dtype)


def _torchao_mx(x: torch.Tensor, elem: str, rule: str, dim: int) -> torch.Tensor:
    """torchao's quantize then dequantize along ``dim`` (zero-padded to whole blocks)."""
    v = x.movedim(dim, -1)
    n = v.shape[-1]
    v = torch.nn.functional.pad(v, (0, (-n) % 32)).contiguous()
    dt = _TORCHAO_DTYPES[elem]
    s, d = to_mx(v, dt, 32, _MODES[rule])
    out = to_dtype(d, s, dt, 32, x.dtype)
    return out[..., :n].movedim(-1, dim)


def _blocked(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    v = x.float().movedim(dim, -1)
    n = v.shape[-1]
    v = torch.nn.functional.pad(v, (0, (-n) % 32))
    return v.reshape(*v.shape[:-1], -1, 32), n


def _unblocked(b: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    return b.reshape(*b.shape[:-2], -1)[..., :n].movedim(-1, dim)


def _cast(p: torch.Tensor, elem: str) -> torch.Tensor:
    """float32 ``p`` through torchao's element cast (saturating; nearest even) and back."""
    p = p.clamp(-_ELEMS[elem][2], _ELEMS[elem][2])
    if elem in ("e2m1", "e2m3", "e3m2"):  # torchao's unpacked casts of its sub-byte elements
        name = {"e2m1": "f4", "e2m3": "f6_e2m3", "e3m2": "f6_e3m2"}[elem]
        unpack = getattr(torchao_kernels, f"{name}_unpacked_to_f32")
        return unpack(getattr(torchao_kernels, f"f32_to_{name}_unpacked")(p))
    return p.to(_TORCHAO_DTYPES[elem]).float()


def _scale_oracle(x: torch.Tensor, elem: str, rule: str, dim: int) -> tuple[torch.Tensor, ...]:
    """Per block, in float64 Python arithmetic: the scale exponent the rule says, the
    elements cast by torchao's element casts under it. Returns (oracle values, mask of the
    elements whose block torchao's eager path gets wrong: FLOOR's 2^-127 blocks, which it
    quantizes with 2^-126; RCEIL blocks whose float32 ``amax / max_elem`` lies just above a
    power of two, where its float32 ``log2`` rounds down to the integer before the ceiling)."""
    blocks, n = _blocked(x, dim)
    amax = blocks.abs().amax(-1)
    _, _, vmax, emax = _ELEMS[elem]
    exps = torch.empty(amax.shape, dtype=torch.int32)
    defect = torch.zeros(amax.shape, dtype=torch.bool)
    flat_a, flat_e, flat_d = amax.reshape(-1), exps.reshape(-1), defect.reshape(-1)
    for i, a in enumerate(flat_a.tolist()):
        if rule == "floor":
            e = math.frexp(a)[1] - 1 - emax if a > 0 else -127
            flat_d[i] = e <= -127
        else:
            descale = float(torch.tensor(a, dtype=torch.float32) / vmax)  # one float32 division
            e = math.ceil(math.log2(descale)) if descale > 0 else -127
            flat_d[i] = descale > 0 and float(torch.log2(torch.tensor(descale))) == e - 1
        flat_e[i] = max(-127, min(127, e))
    scale = torch.ldexp(torch.ones(()), exps.double()).float()[..., None]
    if rule == "floor":
        rcp = 1 / scale
    else:
        rcp = torch.where(exps[..., None] == -127, 1.0, 1 / scale.double()).float()
    out = _cast(blocks * rcp, elem) * scale
    mask = defect[..., None].expand_as(blocks)
    return _unblocked(out, n, dim).to(x.dtype), _unblocked(mask, n, dim)


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    return _rows(1024, 1024)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elem", _MX_ELEMENTS)
def test_mx_against_torchao_one_million_values(rows: torch.Tensor, elem: str, rule: str) -> None:
    """>= 1 M values per element type and rule, bf16 and fp32, dims -1 and 0: 0 mismatches."""
    for dtype in (torch.bfloat16, torch.float32):
        x = rows.to(dtype)
        if dtype == torch.float32:  # full float32 mantissas
            g = torch.Generator().manual_seed(2)
            x = x * (1 + torch.rand(x.shape, generator=g) / 64)
        for dim in (-1, 0):
            ours = qm.mx(x, dim, _ELEMS[elem], rule)
            ref = _torchao_mx(x, elem, rule, dim)
            assert _mismatches(ours, ref) == 0, (dtype, dim)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("elem", _MX_ELEMENTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mx_edges_against_torchao(elem: str, rule: str, dtype: torch.dtype) -> None:
    """Zero blocks, ties, saturation, subnormal scales, odd lengths: 0 mismatches with the
    plain per-block oracle everywhere, and with torchao wherever its eager path is not
    defective (docs/formats.md: FLOOR's 2^-127 blocks, RCEIL's float32 log2 just above a
    power of two; the latter only reachable from float32 inputs)."""
    x = _edges(1024, dtype)
    for t, dim in ((x, -1), (x[:, :1000], -1), (x.t().contiguous()[:999], 0)):
        ours = qm.mx(t, dim, _ELEMS[elem], rule)
        ref = _torchao_mx(t, elem, rule, dim)
        oracle, defect = _scale_oracle(t, elem, rule, dim)
        assert _mismatches(ours, oracle) == 0, dim  # everywhere, the plain oracle
        assert _mismatches(ours[~defect], ref[~defect]) == 0, dim  # torchao, bar its defects
        assert defect.any() == (rule == "floor" or dtype == torch.float32)


def test_torchao_floor_defect_is_real() -> None:
    """The case the FLOOR comparison routes around: torchao halves a block whose scale is
    2^-127 (docs/formats.md); quantpatch keeps it."""
    x = torch.full((32,), 2.0**-120)
    assert float(_torchao_mx(x, "e4m3", "floor", -1)[0]) == 2.0**-121
    assert float(qm.mx(x, -1, qm.E4M3, "floor")[0]) == 2.0**-120


def test_rceil_smallest_scale_flushes_as_the_references_do() -> None:
    """An RCEIL block with scale 2^-127 (amax <= max_elem * 2^-127): multiplied by 1, not
    2^127, so it dequantizes to +-0 (TE's exp2f_rcp, torchao)."""
    x = torch.tensor([2.0**-120, -(2.0**-122)] + [0.0] * 30)
    out = qm.mx(x, -1, qm.E4M3, "rceil")
    assert torch.equal(_bits(out), _bits(_torchao_mx(x, "e4m3", "rceil", -1)))
    assert out.abs().max() == 0 and torch.signbit(out[1])


@pytest.mark.parametrize("value", ["mxfp8", "mxfp8-rceil", "mxfp8-rceil-hybrid", "mxfp4-rceil"])
def test_non_finite_pass_through(value: str) -> None:
    """NaN and +-Inf pass through and leave their block's other elements as the block without
    them (torchao makes the whole block NaN: the documented difference)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    bad = x.clone()
    bad[0, 3], bad[1, 40], bad[2, 7] = float("nan"), float("inf"), -float("inf")
    clean = x.clone()
    clean[0, 3] = clean[1, 40] = clean[2, 7] = 0
    out, want = ops.fake_quant(bad, value), ops.fake_quant(clean, value)
    keep = torch.isfinite(bad)
    assert torch.equal(out[keep], want[keep])
    assert torch.isnan(out[0, 3]) and out[1, 40] == float("inf") and out[2, 7] == -float("inf")


@pytest.mark.parametrize(("value", "backward"), sorted(_MX_VALUES))
def test_mx_values_dispatch_their_element_and_rule(value: str, backward: bool) -> None:
    """``fake_quant`` of each MX value and direction is the declared element and rule,
    bit for bit torchao's."""
    elem, rule = _MX_VALUES[(value, backward)]
    x = _rows(64, 256, seed=4)
    got = ops.fake_quant(x, value, backward=backward)
    assert _mismatches(got, _torchao_mx(x, elem, rule, -1)) == 0


# -- fp8-tensor against TransformerEngine's CurrentScalingQuantizerRef -------------------------


def _te_dequant(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    from tests.te_reference import te_current_scaling

    q, sx = te_current_scaling(x, fp8)
    return (q.to(torch.float32) * sx).to(x.dtype)  # TE's dequantize


_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP8_VALUES = [  # (value, backward): every fp8-tensor and fp8-block value, both directions
    (f.name, backward)
    for f in formats.SPECS
    if f.roles and f.family in ("fp8-tensor", "fp8-block")
    for backward in (False, True)
]


def _fp8_dtype(value: str, backward: bool) -> torch.dtype:
    spec = formats.spec_of(value)
    return _FP8_DTYPES[str(spec.grad_output if backward else spec.input)]


@pytest.mark.parametrize(
    ("value", "backward"), [c for c in _FP8_VALUES if c[0].startswith("fp8-tensor")]
)
def test_fp8_tensor_against_transformer_engine(
    rows: torch.Tensor, value: str, backward: bool
) -> None:
    """E4M3 forward; E5M2 gradients (fp8-tensor, Format.HYBRID) or E4M3 ones (fp8-tensor-e4m3,
    Format.E4M3); bf16 and fp32, 1 M values and tiny tensors: 0 mismatches with TE 2.20.2's
    reference and its dequantize."""
    fp8 = _fp8_dtype(value, backward)
    cases = [rows, rows.float() * 1.0001, _edges(1024, torch.float32)[1:], torch.zeros(4, 32)]
    cases += [rows[:3, :33] * 2.0**-126, torch.full((2, 3), 2.0**-140)]  # 448/amax overflows
    for x in cases:
        got = ops.fake_quant(x, value, backward=backward)
        assert _mismatches(got, _te_dequant(x, fp8)) == 0, x.dtype


def test_fp8_tensor_scale_is_the_whole_tensors_when_sliced() -> None:
    """A tensor large enough to be quantized slice by slice on CPU keeps one scale."""
    x = _rows(1200, 1024, seed=5)
    x[7, 9] = 1e4
    got = ops.fake_quant(x, "fp8-tensor")
    assert _mismatches(got, _te_dequant(x, torch.float8_e4m3fn)) == 0


# -- fp8-block against an independent oracle ---------------------------------------------------


def _oracle_block(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """fp8-block on a 2-D ``x``, tiles ``tile`` (rows, cols), written plainly: numpy for the
    amax and the power-of-two scale (the float32 quotient 448 / amax, its exponent; the input
    dtype's largest value where the quotient overflows, 1 for a zero tile), torch's own
    float8_e4m3fn cast for the rounding."""
    a = x.to(torch.float32).numpy()
    out = np.empty_like(a)
    big = np.float32(torch.finfo(x.dtype).max)
    th, tw = tile
    for i in range(0, a.shape[0], th):
        for j in range(0, a.shape[1], tw):
            t = a[i : i + th, j : j + tw]
            amax = np.float32(np.abs(t).max())
            if amax == 0:
                scale = 1.0
            else:
                with np.errstate(over="ignore"):
                    quotient = np.float32(448.0) / amax
                if np.isinf(quotient):
                    quotient = big
                scale = math.ldexp(1.0, math.frexp(float(quotient))[1] - 1)
            q = torch.from_numpy(t * np.float32(scale)).to(torch.float8_e4m3fn).float().numpy()
            out[i : i + th, j : j + tw] = q * np.float32(1.0 / scale)
    return torch.from_numpy(out).to(x.dtype)


def test_fp8_block_activations_against_oracle(rows: torch.Tensor) -> None:
    """1 x 128 blocks along the reduction dimension: 1 M values, bf16 and fp32, dims -1 and
    0, an odd length, the edge rows (zero blocks, subnormal amax, 448/amax overflowing)."""
    cases = [rows, rows.float() * 1.0001, _edges(1024, torch.bfloat16), rows[:64, :1000]]
    for x in cases:
        assert _mismatches(ops.fake_quant(x, "fp8-block"), _oracle_block(x, (1, 128))) == 0
        t = x[:, :384]
        got = ops.fake_quant(t, "fp8-block", dim=0)
        assert _mismatches(got, _oracle_block(t.t(), (1, 128)).t()) == 0
    # E4M3 for gradients too
    gradient = ops.fake_quant(rows, "fp8-block", backward=True)
    assert torch.equal(gradient, ops.fake_quant(rows, "fp8-block"))


@pytest.mark.parametrize(
    ("value", "backward"), [c for c in _FP8_VALUES if c[0].startswith("fp8-block")]
)
def test_fp8_block_against_transformer_engine_blockwise(
    rows: torch.Tensor, value: str, backward: bool
) -> None:
    """fp8-block (Format.E4M3) and fp8-block-hybrid (Format.HYBRID: the output gradient's
    blocks E5M2, 2^floor(log2(57344 / amax))) against Float8BlockScaling's quantization with
    TE 2.20.2's own scale function (tests/te_reference.py ``te_blockwise``): 1 M values, bf16
    and fp32, along either dimension, odd lengths, the edge rows; a weight's 128 x 128 tiles
    E4M3 in either format."""
    from quantpatch.runtime.quantpatch_quantize import quantize
    from tests.te_reference import te_blockwise

    fp8 = _fp8_dtype(value, backward)
    cases = [rows, rows.float() * 1.0001, _edges(1024, torch.bfloat16), rows[:64, :1000]]
    for x in cases:
        got = ops.fake_quant(x, value, backward=backward)
        assert _mismatches(got, te_blockwise(x, fp8, (1, 128)).to(x.dtype)) == 0, x.dtype
        t = x[:, :384]
        got = ops.fake_quant(t, value, dim=0, backward=backward)
        want = te_blockwise(t.t().contiguous(), fp8, (1, 128)).t().to(t.dtype)
        assert _mismatches(got, want) == 0, x.dtype
    weight = formats.spec_of(value).operands[0]
    for w in (rows[:300, :200].float(), _edges(1024, torch.bfloat16)):
        want = te_blockwise(w, torch.float8_e4m3fn, (128, 128)).to(w.dtype)
        assert _mismatches(quantize(w, weight, backward=backward), want) == 0


def _te_operand(x: torch.Tensor, value: str, backward: bool, weight: bool = False) -> torch.Tensor:
    """TE 2.20.2's reference for one operand of a linear GEMM in ``value``, quantized along its
    last dimension (a 2-D weight: in 128 x 128 tiles where the value tiles weights)."""
    from tests.te_reference import te_blockwise

    spec = formats.spec_of(value)
    fp8 = _fp8_dtype(value, backward)
    if spec.family == "fp8-tensor":
        return _te_dequant(x, fp8)
    tile = (128, 128) if weight else (1, 128)
    return te_blockwise(x, fp8, tile).to(x.dtype)


@pytest.mark.parametrize("value", sorted({v for v, _ in _FP8_VALUES}))
def test_linear_layer_gemms_against_transformer_engine(value: str) -> None:
    """The three GEMMs of Megatron's linear layer as ``init`` rewrites them (fprop X . W^T,
    dgrad dY . W, wgrad dY^T . X, each operand along its own reduction dimension), in each
    tensorwise and blockwise value: every operand the product multiplies equals TE 2.20.2's
    reference quantization of it (the input and the weight E4M3; the output gradient E5M2 in
    the HYBRID values, E4M3 in the E4M3 ones), and so every product equals the product of
    TE's operands, bit for bit."""
    x = _rows(256, 384, seed=21)
    w = torch.nn.Parameter(_rows(256, 384, seed=22) * 0.05)
    gy = _rows(256, 256, seed=23)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = torch.matmul

    def spy(a: torch.Tensor, b: torch.Tensor, *rest: object, **kw: object) -> torch.Tensor:
        seen.append((a, b))
        return real(a, b, *rest, **kw)  # type: ignore[arg-type]

    ops.weight_cache_clear()
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(torch, "matmul", spy)
        mp.setenv("QUANTPATCH_GEMM", "separate")
        y = ops.quant_matmul(x, w.t(), value, weight="b")
        dx = ops.quant_matmul(gy, w, value, backward=True, weight="b")
        dw = ops.quant_matmul(gy.t(), x, value, backward=True)
    wd = w.detach()
    gt, xt, wt = gy.t().contiguous(), x.t().contiguous(), wd.t().contiguous()
    from quantpatch.runtime import quantpatch_quantize as qz

    if qz.factors(value, x.dtype):
        # a per-tensor scale: the product multiplies TE's FP8 codes (exact in float32) and
        # applies the two scales to its float32 result, as TE's GEMM takes them (alpha)
        from tests.te_reference import te_current_scaling

        def codes(t: torch.Tensor, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
            return te_current_scaling(t, _fp8_dtype(value, backward))

        pairs = [
            (codes(x, False), codes(wd, False)),
            (codes(gy, True), codes(wt, False)),
            (codes(gt, True), codes(xt, False)),
        ]
        want = [(qa, qb.t()) for (qa, _), (qb, _) in pairs]
        scales = [sa.reshape(()) * sb.reshape(()) for (_, sa), (_, sb) in pairs]
    else:
        want = [  # TE's operands, each along its reduction dimension
            (_te_operand(x, value, False), _te_operand(wd, value, False, True).t()),
            (_te_operand(gy, value, True), _te_operand(wt, value, False, True).t()),
            (_te_operand(gt, value, True), _te_operand(xt, value, False).t()),
        ]
        scales = [None, None, None]
    assert len(seen) == 3
    values = 0
    for (a, b), (ta, tb) in zip(seen, want, strict=True):
        assert _mismatches(a.contiguous(), ta.contiguous()) == 0, value
        assert _mismatches(b.contiguous(), tb.contiguous()) == 0, value
        values += a.numel() + b.numel()
    assert values == 4 * 256 * 384 + 2 * 256 * 256  # 524 288 operand values per value
    for got, (ta, tb), alpha in zip((y, dx, dw), want, scales, strict=True):
        expect = real(ta, tb) if alpha is None else (real(ta, tb) * alpha).to(got.dtype)
        assert torch.equal(got, expect), value


def test_fp8_block_weights_take_128_by_128_tiles(rows: torch.Tensor) -> None:
    """A weight operand (a 2-D Parameter, or the one ``weight=`` names) takes 128 x 128 tiles,
    the same along either dimension; odd shapes padded."""
    from quantpatch.runtime.quantpatch_quantize import quantize

    for w in (rows, rows[:300, :200].float(), _edges(1024, torch.bfloat16)):
        want = _oracle_block(w, (128, 128))
        assert _mismatches(quantize(w, "fp8-block-2d"), want) == 0
        assert _mismatches(quantize(w, "fp8-block-2d", dim=0), want) == 0
    w = torch.nn.Parameter(rows[:256, :384].float())
    a = _rows(8, 384, seed=6).float()
    got = ops.quant_matmul(a, w.t(), "fp8-block")
    want = _oracle_block(a, (1, 128)) @ _oracle_block(w.detach(), (128, 128)).t()
    assert torch.equal(got.detach(), want)


def test_fp8_non_finite_pass_through() -> None:
    x = torch.randn(4, 256)
    x[1, 5], x[2, 200] = float("nan"), float("inf")
    for value in ("fp8-tensor", "fp8-block"):
        out = ops.fake_quant(x, value)
        clean = x.clone()
        clean[1, 5] = clean[2, 200] = 0
        keep = torch.isfinite(x)
        assert torch.equal(out[keep], ops.fake_quant(clean, value)[keep])
        assert torch.isnan(out[1, 5]) and out[2, 200] == float("inf")


# -- the Triton kernels (interpreter) against the reference ------------------------------------


@pytest.fixture()
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors in Triton's interpreter: TRITON_INTERPRET=1")
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")


_KERNEL_VALUES = [  # the values tests/test_kernels.py does not drive: RCEIL MX and FP8
    (f.name, backward)
    for f in formats.SPECS
    if f.roles and (f.scale == "e8m0-rceil" or f.family in ("fp8-tensor", "fp8-block"))
    for backward in ((False, True) if f.grad_output != f.input else (False,))
]


@pytest.mark.parametrize(("value", "backward"), _KERNEL_VALUES)
def test_kernels_bit_identical_to_reference(
    triton_kernels: None, value: str, backward: bool
) -> None:
    """64 K values per case (bf16, fp16 and fp32, dims -1 and 0, an odd length) and the edge
    rows."""
    from quantpatch.runtime import quantpatch_quantize as qq

    module = qq._fp8_kernels() if value.startswith("fp8") else qq.kernels()
    launched = []
    real = module.fake_quant

    def spy(*args: object) -> torch.Tensor:
        launched.append(args[1])
        out: torch.Tensor = real(*args)
        return out

    x = _rows(64, 1024, seed=7)
    cases = [(x, -1), (x.float(), -1), (x[:, :1000], -1), (x[:, :256], 0), (x.half(), -1)]
    cases += [(_edges(256, torch.bfloat16), -1), (_edges(256, torch.float32), -1)]
    with pytest.MonkeyPatch.context() as mp, np.errstate(over="ignore"):
        mp.setattr(module, "fake_quant", spy)
        for t, dim in cases:
            got = ops.fake_quant(t, value, dim=dim, backward=backward)
            want = qq._fake_quant(t, value, dim, backward)
            assert _mismatches(got, want) == 0, (t.dtype, t.shape, dim)
    assert launched == [value] * len(cases)  # the kernels ran, not the reference


def test_fp8_block_weight_kernel(triton_kernels: None) -> None:
    from quantpatch.runtime import quantpatch_quantize as qq

    for w in (_rows(256, 384, seed=8), _rows(200, 300, seed=9).float()):
        assert _mismatches(qq.quantize(w, "fp8-block-2d"), qf.fp8_block_2d(w)) == 0


# -- the declared table (quantpatch.base.values) held against the references -------------------


def test_value_table_declares_every_value_and_its_roles() -> None:
    from quantpatch.base.config import QUANT_TYPES, validate_value
    from quantpatch.base.errors import UserError
    from quantpatch.base.values import VALUES

    assert sorted(v["name"] for v in VALUES) == sorted(QUANT_TYPES)
    assert set(QUANT_TYPES) <= set(ops.FORMATS)
    for v in VALUES:
        for role in ("linear", "qk", "pv"):
            try:
                validate_value(v["name"], allow_unknown=False, role=role)
            except UserError:
                assert role not in v["roles"], v["name"]
            else:
                assert role in v["roles"], v["name"]


def _declared(v: dict, x: torch.Tensor, backward: bool) -> torch.Tensor | None:
    """What the reference named by the row ``v`` computes for ``x`` (None: a direction the
    row's rounding makes random, checked by the caller)."""
    elem = v["element_gradient" if backward else "element_forward"]
    family = v["family"]
    if family == "none":
        assert (elem, v["block"], v["scale"]) == (None, None, None)
        return x
    if family == "mx":
        assert v["block"] == [1, 32]
        rule = {"e8m0-floor": "floor", "e8m0-rceil": "rceil"}[v["scale"]]
        return _torchao_mx(x, elem, rule, -1)
    if family == "fp8-tensor":
        assert v["scale"] == "fp32" and v["block"] is None
        return _te_dequant(x, {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[elem])
    if family == "fp8-block":
        assert v["scale"] == "pow2" and elem in ("e4m3", "e5m2")
        from quantpatch.runtime.quantpatch_quantize import quantize
        from tests.te_reference import te_blockwise

        weight = quantize(x, "fp8-block-2d", backward=backward)
        assert _mismatches(weight, _oracle_block(x, tuple(v["weight_block"]))) == 0
        if elem == "e4m3":
            return _oracle_block(x, tuple(v["block"]))
        return te_blockwise(x, _FP8_DTYPES[elem], tuple(v["block"])).to(x.dtype)
    if family == "hifp8":
        from tests.test_quant_ops import hif8_oracle

        assert (elem, v["scale"], v["block"]) == ("hif8", None, None)
        return torch.from_numpy(hif8_oracle(x.float().numpy())).to(x.dtype)
    if family == "nvfp4":
        assert (elem, v["block"], v["scale"]) == ("e2m1", [1, 16], "e4m3-fp32")
        if backward and v["gradient_rounding"] == "stochastic":
            return None
        from tests.te_reference import te_nvfp4, te_nvfp4_dequant

        if v["four_over_six"]:  # 1 x 16 blocks; the weight operand format's 16 x 16 tiles
            from quantpatch.runtime.quantpatch_quantize import quantize

            mode, bound = v["four_over_six"].upper(), v["e4m3_max"]
            codes, scales, amax = te_nvfp4(x, (16, 16), four_over_six=mode, e4m3_max=bound)
            want = te_nvfp4_dequant(codes, scales, amax, (16, 16), bound).to(x.dtype)
            weight_fmt = formats.spec_of(v["name"]).operands[0]
            assert _mismatches(quantize(x, weight_fmt), want) == 0
            codes, scales, amax = te_nvfp4(x, (1, 16), four_over_six=mode, e4m3_max=bound)
            return te_nvfp4_dequant(codes, scales, amax, (1, 16), bound).to(x.dtype)
        tile = tuple(v["weight_block"] or v["block"])
        if v["rht"]:  # the transformed operand is TE's with_rht (fake_quant transforms back)
            from quantpatch.runtime import quantpatch_rht

            codes, scales, amax = te_nvfp4(x.t().contiguous(), (1, 16), rht=True)
            got = quantpatch_rht.reference_rht_fake_quant(x, -1, None)
            want = te_nvfp4_dequant(codes, scales, amax, (1, 16)).to(x.dtype)
            assert _mismatches(got, want) == 0
            return ops.fake_quant(ops.fake_quant(x, v["name"]), v["name"])  # idempotent
        codes, scales, amax = te_nvfp4(x, tile)  # type: ignore[arg-type]
        return te_nvfp4_dequant(codes, scales, amax, tile).to(x.dtype)
    assert family == "paretoq" and v["roles"] == ["linear"], v
    from tests.test_paretoq import oracle_forward, oracle_init

    w = x.float().numpy()
    return torch.from_numpy(oracle_forward(w, oracle_init(w, v["name"]), v["name"]))


def test_every_declaration_is_its_reference() -> None:
    """``fake_quant`` driven from every row's declared fields (family, element per direction,
    block, weight block, scale rule, rounding, transform) against the reference the row names:
    torchao's to_mx for MX, TE's dtypes and reference for fp8-tensor and NVFP4, the
    independent oracles for fp8-block, HiF8 and ParetoQ, the identity for bf16; a gradient
    rounded stochastically is reproducible from the seed and not the nearest-even result."""
    from quantpatch.base.config import QUANT_TYPES
    from quantpatch.base.values import VALUES

    x = _rows(64, 256, seed=10)  # the wiring; the 1 M-value tests above prove the arithmetic
    checked = set()
    for v in VALUES:
        if v["family"] == "fp8-delayed":  # a layer's state, never one tensor: test_delayed.py
            with pytest.raises(ValueError, match="amax history"):
                ops.fake_quant(x, v["name"])
            assert v["scale"] == "fp32-delayed" and v["block"] is None
            for backward in (False, True):  # its settled scale: TE's current scaling's
                elem = v["element_gradient" if backward else "element_forward"]
                want = _te_dequant(
                    x, {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[elem]
                )
                got = ops.settled_quantize(x, v["name"], backward)
                assert _mismatches(got, want) == 0, (v["name"], backward)
            checked.add(v["name"])
            continue
        for backward in (False, True):
            xv = x.float() if v["family"] == "paretoq" else x
            want = _declared(v, xv, backward)
            if want is None:  # stochastic rounding: the same draws give the same result
                ops.reset_sr_generators()
                got = ops.fake_quant(xv, v["name"], backward=True)
                ops.reset_sr_generators()
                assert torch.equal(got, ops.fake_quant(xv, v["name"], backward=True))
                assert not torch.equal(got, ops.fake_quant(xv, v["name"]))
                continue
            got = ops.fake_quant(xv, v["name"], backward=backward)
            assert _mismatches(got, want) == 0, (v["name"], backward)
        checked.add(v["name"])
    assert checked == set(QUANT_TYPES), "every declared value is driven"


def test_docs_show_the_declared_table() -> None:
    from pathlib import Path

    from quantpatch.base.values import markdown_table, summary_table

    docs = (Path(__file__).parents[1] / "docs/formats.md").read_text(encoding="utf-8")
    assert markdown_table() in docs
    assert summary_table() in docs


def test_products_give_the_gradient_element_to_the_gradient_operand_only() -> None:
    """mxfp8-rceil-hybrid and fp8-tensor: under backward=True the first operand (the output
    gradient at Megatron's backward sites) is E5M2, the second keeps E4M3 (TE's HYBRID);
    mxfp8 keeps E5M2 for both, as it always has."""
    g = _rows(16, 256, seed=11).float()
    w = _rows(256, 64, seed=12).float()
    for value in ("mxfp8-rceil-hybrid", "fp8-tensor", "fp8-block-hybrid", "mxfp8"):
        got = ops.quant_matmul(g, w, value, backward=True)
        b_backward = value == "mxfp8"
        qa = ops.fake_quant(g, value, backward=True)
        qb = ops.fake_quant(w, value, dim=-2, backward=b_backward)
        assert torch.equal(got, qa @ qb), value


@pytest.mark.parametrize(
    ("value", "weight_fmt"), [("fp8-block", "fp8-block-2d"), ("fp8-tensor", "fp8-tensor")]
)
def test_fp8_weight_is_cached_once_for_forward_and_dgrad(
    monkeypatch: pytest.MonkeyPatch, value: str, weight_fmt: str
) -> None:
    """fp8-block's 128 x 128 weight tiles and fp8-tensor's one scale are the same for W and
    W^T and for both directions (a weight is E4M3 in the dgrad product too): the weight cache
    quantizes it once per step for the forward and the dgrad product, and the results equal
    those without the cache and the plain arithmetic."""
    from quantpatch.runtime import quantpatch_weights as wc

    w = torch.nn.Parameter(_rows(256, 384, seed=13).float())
    x = _rows(8, 384, seed=14).float()
    g = _rows(8, 256, seed=15).float()
    results = {}
    for cache in ("1", "0"):
        monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", cache)
        ops.weight_cache_clear()
        seen: list[tuple[str, bool]] = []
        real = wc.quantize

        def spy(
            t: torch.Tensor,
            fmt: str,
            *,
            dim: int = -1,
            backward: bool = False,
            seen: list[tuple[str, bool]] = seen,
            real: Callable[..., torch.Tensor] = real,
        ) -> torch.Tensor:
            if t.data_ptr() == w.data_ptr():
                seen.append((fmt, backward))
            return real(t, fmt, dim=dim, backward=backward)

        with monkeypatch.context() as m:
            m.setattr(wc, "quantize", spy)
            with torch.no_grad():
                y = ops.quant_matmul(x, w.t(), value, roles=("input", "weight"))
                dx = ops.quant_matmul(g, w, value, roles=("grad_output", "weight"))
        results[cache] = (y, dx)
        if cache == "1":
            assert seen == [(weight_fmt, False)]
        else:
            assert [f for f, _ in seen] == [weight_fmt, weight_fmt]  # E4M3 either way
    assert all(torch.equal(a, b) for a, b in zip(results["1"], results["0"], strict=True))
    if value == "fp8-block":
        qw = _oracle_block(w.detach(), (128, 128))
        qx, qg = _oracle_block(x, (1, 128)), _oracle_block(g, (1, 128))
    else:
        qw = _te_dequant(w.detach(), torch.float8_e4m3fn)
        qx, qg = _te_dequant(x, torch.float8_e4m3fn), _te_dequant(g, torch.float8_e5m2)
    assert torch.equal(results["1"][0], qx @ qw.t())
    assert torch.equal(results["1"][1], qg @ qw)


def test_tensors_formats_measures_the_new_candidates_as_fake_quant_does() -> None:
    """``tensors formats``' sums for the RCEIL and FP8 candidates are those of ``fake_quant``
    on the whole tensor (fp8-tensor: one scale from the whole tensor's amax, though the sums
    are taken slice by slice)."""
    from quantpatch.analysis.tensor_metrics import formats_sums

    x = _rows(1200, 1024, seed=16).float()
    x[1100, 3] = 3e3  # the tensor's amax, outside the first slices
    fmts = ("mxfp8-rceil", "mxfp4-rceil", "fp8-tensor", "fp8-tensor-e4m3", "fp8-block")
    fmts += ("fp8-block-hybrid",)
    for backward in (False, True):  # a gradient: E5M2 in the HYBRID values, E4M3 otherwise
        sums = formats_sums(x, fmts, -1, backward)
        for fmt in fmts:
            q = ops.fake_quant(x, fmt, backward=backward).double()
            noise = float(((x.double() - q) ** 2).sum())
            assert sums[fmt].noise == pytest.approx(noise, rel=1e-9), (fmt, backward)
    assert sums["fp8-tensor-e4m3"].noise < sums["fp8-tensor"].noise


@pytest.mark.parametrize("value", ["mxfp8-rceil", "fp8-tensor", "fp8-block"])
def test_kernels_pass_non_finite_through(triton_kernels: None, value: str) -> None:
    """NaN and +-Inf through the kernels: kept where they are, left out of the scales, every
    other element as the reference's; 0-d and empty tensors too."""
    from quantpatch.runtime import quantpatch_quantize as qq

    x = _rows(8, 256, seed=17)
    x[1, 5], x[2, 130], x[3, 0] = float("nan"), float("inf"), -float("inf")
    got, want = ops.fake_quant(x, value), qq._fake_quant(x, value, -1, False)
    keep = torch.isfinite(x)
    assert _mismatches(got[keep], want[keep]) == 0
    assert torch.isnan(got[1, 5]) and got[2, 130] == float("inf") and got[3, 0] == -float("inf")
    scalar = torch.tensor(3.3, dtype=torch.bfloat16)
    assert _mismatches(ops.fake_quant(scalar, value), qq._fake_quant(scalar, value, -1, False)) == 0
    assert ops.fake_quant(torch.empty(0, 4), value).shape == (0, 4)
