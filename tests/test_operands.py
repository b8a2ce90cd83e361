"""The operands a quantized product multiplies in bf16 and fp16 training: each element is its
code times its block scale, exactly, and the per-tensor float32 scales (``fp8-tensor``, the
delayed values, NVFP4's) multiply the product's float32 result once, as a tensor core applies
them; the products stay within a bf16 GEMM's accumulation bound of TransformerEngine's own
reference GEMMs (``NVFP4QuantizerRef.qgemm`` on ``high_precision_gemm_ref``,
``CurrentScalingQuantizerRef.qgemm``) fed the same codes and scales. The operands are captured
where the matrix product runs (``benchmarks/operand_exactness.py``'s ``TorchDispatchMode``), for
the three products of the linear layer and, where a value applies there, Q.K^T and P.V; the
Triton kernels and the fused GEMM produce the same operands in the interpreter."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from quantpatch.runtime import quantpatch_formats as formats
from quantpatch.runtime import quantpatch_ops as ops
from quantpatch.runtime import quantpatch_quantize as qz
from quantpatch.runtime import quantpatch_rht as rht
from quantpatch.runtime.quantpatch_fp8 import finite_amax, tensor_scales
from quantpatch.runtime.quantpatch_nvfp4 import nvfp4_4over6_parts, nvfp4_parts

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "operand_exactness.py"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@cache
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("operand_exactness", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


VALUES = [v for v in formats.VALUES if formats.spec_of(v).family not in ("none", "paretoq")]
FACTORED = [v for v in VALUES if qz.factors(v, torch.bfloat16)]


def _gemms(fmt: str, dtype: torch.dtype, tokens: int, hidden: int) -> dict[str, Any]:
    b = bench()
    gemms: dict[str, Any] = b.linear_gemms(fmt, dtype, tokens, hidden)
    if "qk" in formats.spec_of(fmt).roles:
        gemms.update(b.attention_gemms(fmt, dtype, tokens, 64))
    return gemms


def test_the_values_with_a_per_tensor_scale_are_factored() -> None:
    assert set(FACTORED) >= {
        "fp8-tensor", "fp8-delayed", "fp8-delayed-e4m3", "nvfp4", "nvfp4-2d", "nvfp4-rht"
    }  # fmt: skip
    assert not {"mxfp8", "mxfp4", "hifp8", "fp8-block", "bf16", "w2"} & set(FACTORED)
    assert not qz.factors("fp8-tensor", torch.float32)  # float32 holds code x scale already


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("fmt", VALUES)
def test_every_operand_the_product_sees_is_code_times_block_scale(fmt: str, dtype: str) -> None:
    """fprop, dgrad, wgrad (and Q.K^T, P.V): 0 elements differ from code x block scale in
    float32 (per-tensor scales factored out), and the training dtype holds every one."""
    torch_dtype = DTYPES[dtype]
    factored = qz.factors(fmt, torch_dtype)
    bad: dict[str, int] = {}
    for name, gemm in _gemms(fmt, torch_dtype, 32, 128).items():
        (seen,) = gemm["seen"]  # one matrix product ran
        for src, got, (opfmt, dim, backward, scale) in zip(
            (gemm["a"], gemm["b"]), seen, gemm["ops"], strict=True
        ):
            got = got.reshape(src.shape).to(torch.float32)
            whole, block = bench().readings(src, opfmt, dim, backward, got, scale)
            want = block if factored else whole
            bad[name] = bad.get(name, 0) + int((got != want).sum())
            assert torch.equal(got.to(torch_dtype).to(torch.float32), got), name
    assert bad == dict.fromkeys(bad, 0)


# -- the products against TransformerEngine's reference GEMMs ----------------------------------


def _nv_parts(src: torch.Tensor, got: torch.Tensor, opfmt: str, dim: int, backward: bool) -> Any:
    """An NVFP4 operand's codes (from the captured ``got``, code x block scale), its E4M3
    block scales, its tensor's amax, the reduction dimension last (TE's ``[rows, K]``), and
    the E4M3 bound of its tensor scale (a 4over6 operand's; its gradient is ``nvfp4``'s)."""
    spec = formats.spec_of(opfmt)
    v = rht.rht(src, dim) if spec.rht else src
    two_d = spec.tiled and v.dim() >= 2
    bound = spec.e4m3_max if spec.four_over_six and not backward else 448
    if spec.four_over_six and not backward:
        _, s, amax = nvfp4_4over6_parts(v.to(torch.float32), opfmt, dim, two_d)
    else:
        _, s, amax = nvfp4_parts(v.to(torch.float32), dim, two_d)
    codes = got / torch.where(s > 0, s, torch.ones_like(s))
    if dim in (-2, 0):
        codes, s = codes.t(), s.t()
    return codes.contiguous(), s[:, ::16].contiguous(), amax.reshape(1), bound


def _te_nvfp4(a_parts: Any, b_parts: Any, dtype: torch.dtype) -> torch.Tensor:
    """TE's reference GEMM of two NVFP4 operands, each with its own tensor-scale bound (TE's
    qresult ``nvfp4_e4m3_max`` under 4over6; 448 is the plain bound)."""
    from .te_reference import te_modules

    mods = te_modules()
    ref = mods.reference_nvfp4
    quantizer = ref.NVFP4QuantizerRef(
        dtype=mods.reference_utils.Fp4Formats.E2M1, rowwise=True, columnwise=False
    )
    (ca, sa, aa, ea), (cb, sb, ab, eb) = a_parts, b_parts

    def qresult(amax: torch.Tensor, bound: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            global_amax_row=amax, global_amax_col=amax, nvfp4_use_4over6=True,
            nvfp4_e4m3_max=bound,
        )  # fmt: skip

    out: torch.Tensor = quantizer.qgemm(
        ref.cast_to_fp4x2(ca), ref.cast_to_fp4x2(cb), None, dtype, sa, sb,
        qresult_x=qresult(aa, ea), qresult_w=qresult(ab, eb),
    )  # fmt: skip
    return out


def _te_fp8(
    ca: torch.Tensor, fa: torch.Tensor, cb: torch.Tensor, fb: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    from .te_reference import te_modules

    ref = te_modules().reference_current_scaling
    quantizer = ref.CurrentScalingQuantizerRef(
        dtype=torch.float8_e4m3fn, rowwise=True, columnwise=False
    )

    def fp8(c: torch.Tensor) -> torch.Tensor:
        e5m2 = bool((c.abs() > 448).any()) or not torch.equal(
            c.to(torch.float8_e4m3fn).to(torch.float32), c
        )
        return c.to(torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn)

    params = types.SimpleNamespace(use_split_accumulator=True)
    out: torch.Tensor = quantizer.qgemm(
        fp8(ca), fp8(cb), params, dtype, fa.reshape(()).float(), fb.reshape(()).float()
    )
    return out


def _factor_of(src: torch.Tensor, opfmt: str, backward: bool, scale: Any) -> torch.Tensor:
    """The per-tensor float32 factor of an FP8 operand: ``scale_inv``, TE's dequantization
    scale (current scaling from ``src``'s amax; delayed: ``1 / scale``)."""
    if scale is not None:
        return torch.reciprocal(scale.to(torch.float32))
    spec = formats.spec_of(opfmt)
    elem = formats.ELEMENTS[str(spec.grad_output if backward else spec.input)]
    return tensor_scales(finite_amax(src), elem.vmax, src.dtype)[1]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("fmt", FACTORED)
def test_products_are_te_reference_gemms_of_the_same_codes(fmt: str, dtype: str) -> None:
    """Each product of the linear layer (fprop, dgrad, wgrad) against TE's reference GEMM of
    the codes and scales it multiplied: within the accumulation bound of two float32 sums in
    different orders and one rounding of each to the training dtype."""
    torch_dtype = DTYPES[dtype]
    eps = torch.finfo(torch_dtype).eps
    for name, gemm in bench().linear_gemms(fmt, torch_dtype, 64, 128).items():
        (seen,) = gemm["seen"]
        sides = []
        for src, got, (opfmt, dim, backward, scale) in zip(
            (gemm["a"], gemm["b"]), seen, gemm["ops"], strict=True
        ):
            got = got.reshape(src.shape).to(torch.float32)
            if formats.spec_of(opfmt).family == "nvfp4":
                sides.append(_nv_parts(src, got, opfmt, dim, backward))
            else:
                codes = got.t() if dim in (-2, 0) else got
                sides.append((codes.contiguous(), _factor_of(src, opfmt, backward, scale)))
        if formats.spec_of(fmt).family == "nvfp4":
            te = _te_nvfp4(sides[0], sides[1], torch_dtype)
            a_eff = sides[0][0] * sides[0][1].repeat_interleave(16, dim=1)
            b_eff = sides[1][0] * sides[1][1].repeat_interleave(16, dim=1)
            bounds = float(sides[0][3] * sides[1][3])
            alpha = sides[0][2].double() * sides[1][2].double() / (6.0 * 6 * bounds)
        else:
            (ca, fa), (cb, fb) = sides
            te = _te_fp8(ca, fa, cb, fb, torch_dtype)
            a_eff, b_eff, alpha = ca, cb, fa.double() * fb.double()
        ours = gemm["out"].reshape(te.shape)
        k = a_eff.shape[-1]
        mag = (a_eff.double().abs() @ b_eff.double().abs().t()) * alpha
        tol = eps * te.double().abs() + 2 * (k + 4) * 2.0**-24 * mag + 1e-30
        excess = (ours.double() - te.double()).abs() - tol
        assert float(excess.max()) <= 0, (name, float(excess.max()))
        assert ours.dtype == torch_dtype


def test_gradients_stay_straight_through() -> None:
    """Under autograd the factored product's gradients are those of the product of the
    dequantized operands (code x scale in the training dtype), as before."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(2, 16, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    b = torch.randn(2, 64, 32, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(2, 16, 32, generator=gen).to(torch.bfloat16)
    for fmt in ("fp8-tensor", "nvfp4"):
        a.grad = b.grad = None
        ops.quant_bmm(a, b, fmt).backward(g)
        qa, fa = qz.quantize_factored(a.detach(), fmt, -1)
        qb, fb = qz.quantize_factored(b.detach(), fmt, -2)
        da, db = qz.dequantized(qa, fa), qz.dequantized(qb, fb)
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, torch.bmm(g, db.transpose(1, 2)))
        assert torch.equal(b.grad, torch.bmm(da.transpose(1, 2), g))
    # fp8-tensor's dequantized operand is the fake-quantized one, bit for bit
    qa, fa = qz.quantize_factored(a.detach(), "fp8-tensor", -1)
    assert torch.equal(qz.dequantized(qa, fa), ops.fake_quant(a.detach(), "fp8-tensor"))


def test_an_all_zero_operand_keeps_inf_and_nan_passing_through() -> None:
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    x[0, 0], x[1, 3] = float("inf"), float("nan")
    w = torch.ones(32, 8, dtype=torch.bfloat16)
    for fmt in ("nvfp4", "fp8-tensor"):
        old = torch.matmul(ops.fake_quant(x, fmt), ops.fake_quant(w, fmt, dim=-2))
        new = ops.quant_matmul(x, w, fmt)
        assert torch.equal(new.isnan(), old.isnan()) and torch.equal(new.isinf(), old.isinf())


# -- the Triton kernels and the fused GEMM (interpreter) -------------------------------------


@pytest.fixture()
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors in Triton's interpreter: TRITON_INTERPRET=1")
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_kernels_give_the_factored_operands_bit_for_bit(triton_kernels: None, dtype: str) -> None:
    """``quantize_factored`` through the kernels equals the reference: fp8-tensor (E4M3, E5M2),
    NVFP4 (nearest and with the same random bits), nvfp4-2d, and the Hadamard-transformed
    NVFP4; 0 differing bits."""
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(48, 96, generator=gen) * 3).to(torch_dtype)
    x[0, 5] = float("inf")
    cases: list[tuple[str, int, bool]] = [
        ("fp8-tensor", -1, False), ("fp8-tensor", -1, True), ("nvfp4", -1, False),
        ("nvfp4", 0, False), ("nvfp4", -1, True), ("nvfp4-2d", -1, False),
        ("nvfp4-4over6-mae", -1, False), ("nvfp4-4over6-mse-448", 0, False),
        ("nvfp4-4over6-mae-2d", -2, False), ("nvfp4-4over6-mse", -1, True),
    ]  # fmt: skip
    for fmt, dim, backward in cases:
        ops.reset_sr_generators()
        got, gf = qz.quantize_factored(x, fmt, dim, backward)
        ops.reset_sr_generators()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QUANTPATCH_KERNELS", "reference")
            want, wf = qz.quantize_factored(x, fmt, dim, backward)
        assert torch.equal(_bits(got), _bits(want)), (fmt, dim, backward)
        assert torch.equal(gf, wf), (fmt, dim, backward)
    y = x[:, :96].clone()
    y[0, 5] = 1.0
    ops.reset_sr_generators()
    got, gf = rht.rht_factored(y, -1, backward=True)
    ops.reset_sr_generators()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTPATCH_KERNELS", "reference")
        want, wf = rht.rht_factored(y, -1, backward=True)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(gf, wf)


@pytest.mark.parametrize("fmt", ["fp8-tensor", "nvfp4", "nvfp4-2d"])
def test_fused_gemm_factors_the_tensor_scales_out_of_its_tile_loop(
    triton_kernels: None, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The fused GEMM's operands are the factored operands (code x block scale) and its
    result is their product times the tensor scales, within the accumulation-order bound of
    the separate path's; a weight from the cache enters with its scale."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter only")
    kernels = qz.gemm_kernels()
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(32, 64, generator=gen) * 4).to(torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(48, 64, generator=gen).to(torch.bfloat16))
    ta, fa = qz.quantize_factored(a, "nvfp4" if fmt == "nvfp4-2d" else fmt, -1)
    tb, fb = qz.quantize_factored(w.detach().t(), fmt, -2)
    want = qz.scaled_matmul(ta, fa, tb, fb)
    monkeypatch.setenv("QUANTPATCH_GEMM", "fused")
    calls = []
    real = kernels.quant_gemm

    def spy(*args: Any) -> torch.Tensor:
        calls.append(args[8] if len(args) > 8 else False)
        out: torch.Tensor = real(*args)
        return out

    monkeypatch.setattr(kernels, "quant_gemm", spy)
    with torch.no_grad():
        got = ops.quant_matmul(a, w.t(), fmt, weight="b")
        monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", "0")
        uncached = ops.quant_matmul(a, w.t(), fmt, weight="b")
    assert calls == [True, True]  # the fused GEMM ran, factored
    k = ta.shape[-1]
    alpha = fa.double() * fb.double()
    mag = (ta.double().abs() @ tb.double().abs()) * alpha
    exact = (ta.double() @ tb.double()) * alpha
    tol = 2 * k * 2.0**-24 * mag + 2 * 2.0**-8 * exact.abs() + 1e-30
    for out in (got, uncached):
        assert bool(((out.double() - want.double()).abs() <= tol).all())
    old = torch.matmul(ops.fake_quant(a, fmt if fmt != "nvfp4-2d" else "nvfp4"), w.detach().t())
    assert not torch.equal(got, old)  # sanity: the product did quantize
