"""float64 inputs and non-finite values at the edges of the formats (docs/formats.md, the
NaN/Inf paragraph): every value takes a float64 tensor and returns float64, quantized as its
float32 cast is (a finite value beyond float32's range comes back +-Inf, one below its
smallest subnormal +-0); ``nvfp4-rht`` spreads an Inf over its block of 16 as
TransformerEngine 2.20.2's reference transform does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from quantpatch.base.config import QUANT_TYPES  # noqa: E402
from quantpatch.runtime import quantpatch_nvfp4 as nv  # noqa: E402
from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_rht as rht  # noqa: E402
from quantpatch.runtime.quantpatch_ops import fake_quant, quant_matmul  # noqa: E402

F64 = torch.float64
_NAN = 7.0  # NaN compared as a value of its own


def _wide() -> torch.Tensor:
    """float64 Gaussians with, among them, finite values beyond float32's range (both signs),
    one below its smallest subnormal, NaN and +-Inf."""
    x = torch.randn(8, 64, dtype=F64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 3], x[1, 5], x[2, 7] = 1e300, -1e39, 1e-50
    x[3, 0], x[3, 9], x[4, 1] = float("nan"), float("inf"), float("-inf")
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=_NAN), torch.nan_to_num(b, nan=_NAN))


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("fmt", QUANT_TYPES)
def test_every_value_takes_float64_as_its_float32_cast(fmt: str, backward: bool) -> None:
    """``fp8-tensor`` and ``fp8-block`` raised 'value cannot be converted to type float
    without overflow' here (float64's largest value put into a float32 scale)."""
    x = _wide()
    if ops.is_delayed(fmt):  # no layer, no history: refused; its settled scale measured instead
        with pytest.raises(ValueError, match="amax history"):
            fake_quant(x, fmt, backward=backward)
        got = ops.settled_quantize(x, fmt, backward)
        assert got.dtype == F64
        assert _same(got, ops.settled_quantize(x.to(torch.float32), fmt, backward).to(F64))
        assert got[0, 3] == float("inf") and got[1, 5] == float("-inf")
        assert got[2, 7] == 0 and torch.isnan(got[3, 0]) and got[3, 9] == float("inf")
        return
    nv.reset_sr_generators()  # the same random bits for both calls (NVFP4's backward)
    got = fake_quant(x, fmt, backward=backward)
    assert got.dtype == F64 and got.shape == x.shape
    if fmt == "bf16":  # the identity
        assert got is x
        return
    nv.reset_sr_generators()
    cast = x.to(torch.float32)
    if fmt == "nvfp4-rht":  # the transform in the input's dtype first, as TE computes it
        bits = nv.sr_bits(x) if backward else None  # the draws the call above took
        want = rht.inverse_rht(nv.nvfp4(rht.rht(x, -1).to(torch.float32), -1, False, bits), -1)
    else:
        want = fake_quant(cast, fmt, backward=backward)
    assert _same(got, want.to(F64))
    if fmt != "nvfp4-rht" and not fmt.startswith("w"):  # blocks of their own: see below
        assert got[0, 3] == float("inf") and got[1, 5] == float("-inf")
        assert got[2, 7] == 0 and torch.isnan(got[3, 0]) and got[3, 9] == float("inf")


@pytest.mark.parametrize("fmt", QUANT_TYPES)
def test_every_product_takes_float64(fmt: str) -> None:
    a = torch.randn(32, 64, dtype=F64, generator=torch.Generator().manual_seed(1))
    b = torch.randn(64, 48, dtype=F64, generator=torch.Generator().manual_seed(2))
    if ops.is_delayed(fmt):  # a product without its layer keeps no history: refused
        with pytest.raises(ValueError, match="amax history"):
            quant_matmul(a, b, fmt)
        return
    for backward in (False, True):
        nv.reset_sr_generators()
        got = quant_matmul(a, b, fmt, backward=backward)
        nv.reset_sr_generators()
        want = quant_matmul(a.float(), b.float(), fmt, backward=backward)
        assert got.dtype == F64 and bool(torch.isfinite(got).all())
        # the operands quantized alike, the product accumulated in float64 rather than float32
        torch.testing.assert_close(got, want.to(F64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("inf", [float("inf"), float("-inf")], ids=["+inf", "-inf"])
def test_an_inf_in_an_rht_block_spreads_over_it_as_in_te(inf: float) -> None:
    """TE's transform (``NVFP4QuantizerRef._apply_rht``) turns one +-Inf into 16 infinities
    across its block, bit for bit as ours does; back through the inverse transform that is
    the Inf and 15 NaN. The other blocks quantize as though that block were zero (the Infs
    are left out of the tensor's amax), bit for bit as TE quantizes such a tensor."""
    from .te_reference import te_modules, te_nvfp4, te_nvfp4_dequant

    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    x[0, 0] = inf
    ref = te_modules().reference_nvfp4
    te = ref.NVFP4QuantizerRef(
        dtype=te_modules().reference_utils.Fp4Formats.E2M1, columnwise=True, with_rht=True
    )
    spread = te._apply_rht(x)
    assert bool(torch.isinf(spread[0, :16]).all()) and bool(torch.isfinite(spread[1:]).all())
    assert torch.equal(rht.rht(x, -1).view(torch.int32), spread.view(torch.int32))

    got = fake_quant(x, "nvfp4-rht")
    assert got[0, 0] == inf and bool(torch.isnan(got[0, 1:16]).all())
    zeroed = x.clone()
    zeroed[0, :16] = 0.0
    codes, scales, amax = te_nvfp4(zeroed.t().contiguous(), rht=True)
    want = rht.inverse_rht(te_nvfp4_dequant(codes, scales, amax, (1, 16)), -1)
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[0, :16] = False
    assert torch.equal(got[rest].view(torch.int32), want[rest].view(torch.int32))

    # the weight-gradient product over that block: every output of the Inf's column is NaN
    grad = torch.randn(24, 48, generator=torch.Generator().manual_seed(4))
    out = quant_matmul(grad, x[:, :32], "nvfp4-rht", backward=True)  # [out, tokens] @ [tokens, in]
    assert bool(torch.isnan(out[:, 0]).all()) and bool(torch.isfinite(out[:, 1:]).all())


@pytest.mark.parametrize("fmt", ["w1", "w1.58", "w2", "w3", "w4", "w2g16"])
def test_an_inf_weight_makes_its_paretoq_row_or_group_non_finite_only(fmt: str) -> None:
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    x[0, 3] = float("inf")
    got = fake_quant(x, fmt)
    span = 16 if fmt.endswith("g16") else 32
    assert not bool(torch.isfinite(got[0, :span]).any())
    assert bool(torch.isfinite(got[0, span:]).all())
    assert torch.equal(got[1:], fake_quant(x[1:], fmt))
