"""The fused quantized GEMM for every value whose spec entry says ``fused_gemm``, on CPU in
Triton's interpreter: ``quant_matmul`` with ``QUANTPATCH_GEMM=fused`` really runs
``quant_gemm`` for each such value (with the operand formats the separate path gives them),
and the product is within the float32 accumulation-order bound of the separate path's
quantized operands; a value without ``fused_gemm`` takes the separate path, explicitly; the
kind of each operand is derived from the spec. ``nvfp4-rht``: both operands transformed
first, then the NVFP4 GEMM, its operands bit for bit the separate path's."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from quantpatch.runtime import quantpatch_formats as formats  # noqa: E402
from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_quantize as qz  # noqa: E402
from quantpatch.runtime import quantpatch_rht as rht  # noqa: E402
from quantpatch.runtime import quantpatch_weights as wc  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
FUSED = formats.names(fused_gemm=True)


@pytest.fixture(scope="module")
def gemm(kernels):
    return importlib.import_module("quantpatch.runtime.quantpatch_gemm_kernels")


@pytest.fixture(scope="module")
def kernels():
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield importlib.import_module("quantpatch.runtime.quantpatch_kernels")


@pytest.fixture
def spied(kernels, gemm, monkeypatch):
    """quant_gemm's calls, (a's format, b's format), with the kernels routed as on CUDA."""
    monkeypatch.setattr(qz, "_kernels_module", kernels)
    monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", "0")
    monkeypatch.delenv("QUANTPATCH_GEMM", raising=False)
    calls: list[tuple[str, str]] = []
    real = gemm.quant_gemm
    monkeypatch.setattr(gemm, "quant_gemm", lambda *a: calls.append(a[2:4]) or real(*a))
    return calls


def _bits(t):
    t = t.detach().contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _within_bound(got, qa, qb):
    """|got - qa @ qb| within K float32 roundings of the products' magnitudes (two orders of
    summation) plus one rounding of the bf16 output."""
    k = qa.shape[-1]
    mag = torch.matmul(qa.double().abs(), qb.double().abs())
    ref = torch.matmul(qa.double(), qb.double())
    tol = 2 * k * 2.0**-24 * mag + 2 * 2.0**-8 * ref.abs() + 1e-30
    return bool(((got.double() - ref).abs() <= tol).all())


def _separate_operands(x, wt, fmt):
    """The forward product's operands as the separate path quantizes them (the reference):
    in bf16 and fp16 a value with a per-tensor scale as code x block scale times that scale,
    exact in float64 (what the product multiplies, the scale applied to its result)."""
    spec = formats.spec_of(fmt)
    factored = qz.factors(fmt, x.dtype)
    if spec.rht:
        if factored:
            (ta, fa), (tb, fb) = rht.rht_factored(x, -1), rht.rht_factored(wt, -2)
            return ta.double() * fa.double(), tb.double() * fb.double()
        return rht.rht_fake_quant(x, -1), rht.rht_fake_quant(wt, -2)
    weight_fmt, other_fmt = spec.operands
    if factored:
        ta, fa = qz.quantize_factored(x, other_fmt, -1, False)
        tb, fb = qz.quantize_factored(wt, weight_fmt, -2, False)
        return ta.double() * fa.double(), tb.double() * fb.double()
    return qz.quantize(x, other_fmt, -1, False), qz.quantize(wt, weight_fmt, -2, False)


def test_the_fused_values_are_the_spec_s_and_cover_every_computable_value():
    """Every value the products quantize but delayed scaling (its history is per layer),
    ParetoQ (weights with a learnt step) and 4over6 (each block's scale chosen from two
    candidates' errors summed in the block's order: its own kernel) has ``fused_gemm``: MX
    and its RCEIL and FP6 elements, HiF8, the FP8 values, NVFP4 and its tiles and Hadamard
    transform."""
    assert set(FUSED) == {
        f.name for f in formats.SPECS
        if f.roles and f.family not in ("none", "fp8-delayed", "paretoq") and not f.four_over_six
    }  # fmt: skip
    assert {"mxfp6-e2m3", "mxfp6-e3m2-rceil", "nvfp4-rht"} <= set(FUSED)
    assert wc._GEMM_FORMATS == FUSED


@pytest.mark.slow  # 17 values through the interpreted GEMM: about 25 s on 2 cores
@pytest.mark.parametrize("fmt", FUSED)
def test_every_fused_value_takes_the_fused_gemm(spied, monkeypatch, fmt):
    """The linear layer's forward product of each ``fused_gemm`` value: ``quant_gemm`` ran
    with the operands' formats (a weight's tiles where the value has them), and the product
    is the separate path's quantized operands' within the accumulation bound."""
    gen = torch.Generator().manual_seed(len(fmt))
    x = torch.randn(16, 128, generator=gen).to(torch.bfloat16)
    w = torch.randn(128, 128, generator=gen).to(torch.bfloat16)
    monkeypatch.setenv("QUANTPATCH_GEMM", "fused")
    with torch.no_grad():
        got = ops.quant_matmul(x, w.t(), fmt, weight="b")
    spec = formats.spec_of(fmt)
    weight_fmt, other_fmt = spec.operands
    want = ("nvfp4", "nvfp4") if spec.rht else (other_fmt, weight_fmt)
    assert spied == [want]
    qa, qb = _separate_operands(x, w.t(), fmt)
    assert _within_bound(got, qa, qb)


def test_a_value_without_fused_gemm_takes_the_separate_path(gemm, spied, monkeypatch):
    """A value whose entry does not say ``fused_gemm`` (here mxfp6-e2m3 with the flag taken
    away, as a new value arrives) is computed by the separate path, bit for bit, even with
    ``QUANTPATCH_GEMM=fused``; asking the kernel for a format its tile loop does not compute
    is refused in one sentence."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        monkeypatch.setenv("QUANTPATCH_GEMM", "separate")
        separate = ops.quant_matmul(x, w.t(), "mxfp6-e2m3", weight="b")
        monkeypatch.setattr(wc, "_GEMM_FORMATS", tuple(f for f in FUSED if f != "mxfp6-e2m3"))
        monkeypatch.setenv("QUANTPATCH_GEMM", "fused")
        fallback = ops.quant_matmul(x, w.t(), "mxfp6-e2m3", weight="b")
    assert spied == [] and torch.equal(_bits(fallback), _bits(separate))
    with pytest.raises(ValueError, match=r"not compute 'fp8-delayed' .*separate path does$"):
        gemm.gemm_operand("fp8-delayed", False)
    with pytest.raises(ValueError, match="a Hadamard transform first"):
        gemm.gemm_operand("nvfp4-rht", False)


def test_gemm_operand_derives_each_kind_and_element_from_the_spec(kernels, gemm):
    e = formats.ELEMENTS
    assert gemm.gemm_operand("bf16", True) == (gemm.GEMM_NONE, 0, 0, 0.0, 0)
    assert gemm.gemm_operand("mxfp8", True) == (gemm.GEMM_MX, *e["e5m2"])
    assert gemm.gemm_operand("mxfp8-rceil-hybrid", False) == (gemm.GEMM_MX_RCEIL, *e["e4m3"])
    assert gemm.gemm_operand("mxfp6-e3m2-rceil", True) == (gemm.GEMM_MX_RCEIL, *e["e3m2"])
    assert gemm.gemm_operand("fp8-tensor", True) == (gemm.GEMM_FP8_TENSOR, *e["e5m2"])
    assert gemm.gemm_operand("fp8-block-2d", False)[0] == gemm.GEMM_FP8_TILE
    assert gemm.gemm_operand("nvfp4-2d", True) == (gemm.GEMM_NVFP4_2D, *e["e2m1"])
    assert gemm.gemm_operand("hifp8", False) == (gemm.GEMM_HIFP8, 0, 0, 0.0, 0)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)]
)
def test_nvfp4_rht_fuses_its_transformed_operands_bit_for_bit(gemm, spied, monkeypatch, dtype):
    """The weight-gradient product of ``nvfp4-rht`` (the output gradient rounded
    stochastically): through the fused path the GEMM multiplies the transformed operands,
    each quantized bit for bit as the separate path's kernel quantizes it, with the same random
    bits (the GEMM times the identity gives each operand back exactly); the product is within
    the accumulation bound."""
    gen = torch.Generator().manual_seed(11)
    g = (torch.randn(32, 16, generator=gen) * 3).to(dtype)  # [tokens, out]: g^T @ x
    x = torch.randn(32, 32, generator=gen).to(dtype)
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    results = {}
    for mode in ("separate", "fused"):
        monkeypatch.setenv("QUANTPATCH_GEMM", mode)
        ops.reset_sr_generators()
        with torch.no_grad():
            results[mode] = ops.quant_matmul(g.t(), x, "nvfp4-rht", backward=True)
    assert spied == [("nvfp4", "nvfp4")]
    ops.reset_sr_generators()
    qa = rht.rht_fake_quant(g.t(), -1, backward=True)  # the separate path's kernel, its bits
    qb = rht.rht_fake_quant(x, -2)
    ea, eb = qa, qb  # the operands the product multiplies
    if qz.factors("nvfp4-rht", dtype):  # code x block scale, the tensor scales on the result
        ops.reset_sr_generators()
        (ta_f, fa), (tb_f, fb) = rht.rht_factored(g.t(), -1, backward=True), rht.rht_factored(x, -2)
        ea, eb = ta_f.double() * fa.double(), tb_f.double() * fb.double()
    assert _within_bound(results["fused"], ea, eb) and _within_bound(results["separate"], ea, eb)
    ops.reset_sr_generators()
    ta = rht.rht(g.t(), -1)
    bits = ops.sr_bits(ta)
    eye = torch.eye(32, dtype=dtype)
    got_a = gemm.quant_gemm(ta, eye, "nvfp4", "bf16", True, False, bits)
    assert torch.equal(_bits(got_a + 0.0), _bits(qa + 0.0))
    got_b = gemm.quant_gemm(eye, rht.rht(x, -2), "bf16", "nvfp4")
    assert torch.equal(_bits(got_b + 0.0), _bits(qb + 0.0))
