"""The random Hadamard transform of ``nvfp4-rht`` (quantpatch_rht.py) against an oracle written
here: numpy, H16 by Sylvester's construction, the sign vector as docs/formats.md states it,
NVFP4 by the ml_dtypes oracle of test_nvfp4; the fused Triton kernel against the reference in
Triton's interpreter; the product unchanged by the transform without quantization."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
np = pytest.importorskip("numpy")

from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_rht as rht  # noqa: E402

from .test_nvfp4 import E2M1_GRID, assert_bits, nvfp4_oracle  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "formats.md"


def documented_signs() -> list[int]:
    """The sign vector as docs/formats.md writes it: ``s = (+1, -1, ...)``."""
    found = re.search(r"s = \(([-+0-9, ]+)\)", DOC.read_text(encoding="utf-8"))
    assert found, "docs/formats.md states no sign vector 's = (...)'"
    return [int(v) for v in found.group(1).split(",")]


def sylvester(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def transform_oracle(x: torch.Tensor, dim: int) -> np.ndarray:
    """Each 16-block (row vector) of ``x`` along ``dim`` times diag(s) @ H16 / 4 (TE's order:
    the signs first), in float64, rounded once to float32 (exact for ``_bf16_blocks``: the
    caller rounds to the input's dtype, as TE does)."""
    v = np.moveaxis(x.detach().double().numpy(), dim, -1)
    assert v.shape[-1] % 16 == 0
    m = np.diag(np.array(documented_signs(), dtype=np.float64)) @ sylvester(16) / 4
    blocks = v.reshape(*v.shape[:-1], -1, 16) @ m
    return np.moveaxis(blocks.reshape(v.shape).astype(np.float32), -1, dim)


def _bf16_blocks(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """bf16 values whose magnitudes lie in [2^-4, 2^4) with random signs (some blocks scaled by
    a power of two, so blocks differ): every sum of the transform is exact in float32."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(shape, generator=gen) * 8 - 4)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    scale = torch.exp2(torch.randint(-3, 4, (*shape[:-1], 1), generator=gen).float())
    return (mag * sign * scale).to(torch.bfloat16)


def test_the_documented_signs_are_the_modules():
    assert tuple(documented_signs()) == rht.SIGNS
    assert len(rht.SIGNS) == 16 and set(rht.SIGNS) == {-1, 1}


@pytest.mark.parametrize("shape,dim", [((4, 64), -1), ((48, 5), 0), ((3, 2, 48), -1)])
def test_the_transform_is_sylvesters_hadamard_with_the_documented_signs(shape, dim):
    x = _bf16_blocks(shape, sum(shape))
    got = rht.rht(x, dim)
    want = torch.from_numpy(transform_oracle(x, dim)).to(torch.bfloat16)  # TE: in x's dtype
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert_bits(got, want)


@pytest.mark.parametrize("shape,dim", [((4, 64), -1), ((48, 6), 0), ((6, 48), -1)])
def test_round_to_nearest_matches_the_oracle_bit_for_bit(shape, dim):
    x = _bf16_blocks(shape, 7 + sum(shape))
    t = torch.from_numpy(transform_oracle(x, dim)).to(torch.bfloat16)  # rounded before the cast
    want = nvfp4_oracle(t, dim=dim).to(torch.bfloat16)
    assert_bits(rht.rht_fake_quant(x, dim), want)
    assert_bits(ops.fake_quant(x, "nvfp4-rht", dim=dim), _inverse_oracle(want, dim, x))


def _inverse_oracle(q: torch.Tensor, dim: int, x: torch.Tensor) -> torch.Tensor:
    """fake_quant's view: the quantized transform taken back by the transpose, in float32 (the
    values are few binades apart, so float64 then one rounding equals the float32 butterfly)."""
    v = np.moveaxis(q.double().numpy(), dim, -1)
    m = np.diag(np.array(documented_signs(), dtype=np.float64)) @ sylvester(16) / 4
    back = (v.reshape(*v.shape[:-1], -1, 16) @ m.T).reshape(v.shape)
    return torch.from_numpy(np.moveaxis(back.astype(np.float32), -1, dim)).to(x.dtype)


def test_stochastic_rounding_matches_the_oracle_given_the_same_draws():
    x = _bf16_blocks((8, 48), 3)
    ops.reset_sr_generators()
    got = rht.rht_fake_quant(x, -1, backward=True)
    gen = torch.Generator().manual_seed(ops.sr_seed())
    draws = torch.randint(0, 256, (8, 48), generator=gen, dtype=torch.uint8)
    t = torch.from_numpy(transform_oracle(x, -1)).to(torch.bfloat16)
    assert_bits(got, nvfp4_oracle(t, rand=draws))


def test_stochastic_rounding_takes_neighbours_only_and_is_unbiased():
    x = _bf16_blocks((4, 32), 11).float()
    t = torch.from_numpy(transform_oracle(x, -1))
    rn = rht.rht_fake_quant(x, -1)
    # the grid each element is rounded on: the E2M1 values times its block's decode scale
    from quantpatch.runtime import quantpatch_nvfp4 as nvq

    amax = t.abs().amax()
    g = nvq.nv_global_scale(amax)
    bmax = t.abs().reshape(4, 2, 16).amax(-1, keepdim=True)
    s = nvq.nv_block_scale(bmax, g).expand(4, 2, 16).reshape(4, 32)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    raw = t.abs() * nvq.nv_encode_scale(s, g)
    p = raw.clamp(max=6)  # past 6 (a scale rounded down to E4M3) it saturates: biased there
    lo = grid[(grid[None, None, :] <= p[..., None]).sum(-1) - 1]
    hi = grid[torch.clamp((grid[None, None, :] < p[..., None]).sum(-1), max=7)]
    unit = s * nvq.nv_global_decode(amax)
    lo_value, hi_value = lo * unit, hi * unit  # as the quantizer scales them back
    total = torch.zeros_like(t, dtype=torch.float64)
    draws = 2000
    ops.reset_sr_generators()
    for _ in range(draws):
        q = rht.rht_fake_quant(x, -1, backward=True)
        assert bool(((q.abs() == lo_value) | (q.abs() == hi_value)).all()), "not a neighbour"
        total += q.double()
    mean = total / draws
    # unbiased to 1/256 of a spacing (8 random bits): the mean of the draws is the
    # transformed value (sigma of the mean <= unit/90) wherever it does not saturate
    inside = raw <= 6
    assert int(inside.sum()) > 100
    assert float(((mean - t.double()).abs() / unit)[inside].max()) < 0.08
    assert not torch.equal(rn, q)  # rounding to nearest is not what the draws did


def test_the_transform_leaves_the_product_unchanged_without_quantization():
    """H16 diag(s) / 4 is orthogonal: the bf16 wgrad product with the transform and no
    quantization equals the plain one within float32 rounding."""
    gen = torch.Generator().manual_seed(5)
    grad_output = torch.randn(48, 24, generator=gen).to(torch.bfloat16)  # [tokens, out]
    total_input = torch.randn(48, 32, generator=gen).to(torch.bfloat16)  # [tokens, in]
    plain = grad_output.t().float().matmul(total_input.float())
    got = rht.rht_matmul(grad_output.t().float(), total_input.float(), quantize=False)
    assert got.shape == plain.shape == (24, 32)
    torch.testing.assert_close(got, plain, rtol=2e-6, atol=2e-5)
    # and with quantization it is close to NVFP4's product, not equal to the plain one
    q = ops.quant_matmul(grad_output.t(), total_input, "nvfp4-rht", backward=True)
    assert q.dtype == torch.bfloat16 and not torch.equal(q.float(), plain)
    rel = float((q.float() - plain).norm() / plain.norm())
    assert rel < 0.25


def test_a_length_not_a_multiple_of_16_is_refused_naming_the_shape():
    """TE's reference refuses it (``Inner dimension ... must be divisible by hadamard dimension
    16``); so does the runtime, in one sentence naming the shape, before any work."""
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(6, 21, generator=gen)
    b = torch.randn(21, 5, generator=gen)
    with pytest.raises(ValueError, match=r"shape \(6, 21\) has 21 there \(dim -1\)"):
        ops.quant_matmul(a, b, "nvfp4-rht")
    with pytest.raises(ValueError, match=r"shape \(21, 5\) has 21 there \(dim 0\)"):
        rht.rht_fake_quant(b, 0)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        ops.fake_quant(a, "nvfp4-rht")
    assert rht.rht_fake_quant(torch.randn(6, 32, generator=gen), -1).shape == (6, 32)


def test_gradients_pass_straight_through():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(4, 32, generator=gen, requires_grad=True)
    b = torch.randn(32, 3, generator=gen, requires_grad=True)
    ops.quant_matmul(a, b, "nvfp4-rht").sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(4, 3) @ b.detach().t())
    torch.testing.assert_close(b.grad, a.detach().t() @ torch.ones(4, 3))


# -- the fused kernel in Triton's interpreter -------------------------------------------------


@pytest.fixture
def interpreted_kernel(monkeypatch):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    from quantpatch.runtime import quantpatch_rht_kernels

    return quantpatch_rht_kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,dim", [((20, 64), -1), ((48, 18), 0), ((2, 3, 48), -1)])
@pytest.mark.parametrize("backward", [False, True])
def test_the_fused_kernel_equals_the_reference(interpreted_kernel, dtype, shape, dim, backward):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 6, shape).float())).to(
        dtype
    )
    if dtype == torch.float32:
        x[(0,) * x.dim()] = float("inf")  # a non-finite element: its block passes through
    if dim == 0:
        x = x.t().contiguous().t() if x.dim() == 2 else x  # a strided reduction dimension
    rand = None
    if backward:
        rand = torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8)
    got = interpreted_kernel.rht_nvfp4(x, dim, rand, rht.transform_matrix(x.device))
    want = rht.reference_rht_fake_quant(x, dim, rand)
    assert_bits(got, want)


def test_rht_fake_quant_takes_the_kernel_where_chosen(interpreted_kernel):
    x = _bf16_blocks((16, 32), 1)
    t = torch.from_numpy(transform_oracle(x, -1)).to(torch.bfloat16)
    assert_bits(rht.rht_fake_quant(x, -1), nvfp4_oracle(t))


# -- `tensors formats`: the RHT candidate for the saved wgrad operands ------------------------


def test_tensors_formats_offers_rht_for_the_wgrad_operands(run, tmp_path):
    """The saver's linear ``input`` (forward) and ``grad_output`` (backward) are the operands
    of the weight-gradient GEMM: ``nvfp4-rht`` is measured on them along the tokens (against
    the tensor, after the inverse transform); the weight shows n/a."""
    gen = torch.Generator().manual_seed(4)
    d = tmp_path / "logs"
    d.mkdir()
    x = torch.randn(64, 2, 32, generator=gen)
    x[5, 0, :] *= 40.0  # one token with outliers in every feature: the rows differ
    tensors = {
        "forward_nvfp4_input": x.to(torch.bfloat16),
        "backward_nvfp4_grad_output": (torch.randn(64, 2, 32, generator=gen) * 1e-3).to(
            torch.bfloat16
        ),
        "forward_nvfp4_weight": torch.randn(32, 32, generator=gen).to(torch.bfloat16),
    }
    for i, (tail, t) in enumerate(tensors.items()):
        name = f"20260101_000000_{i:04d}_linear_L1_{tail}.pt"
        torch.save({"tensor": t, "metadata": {"module_kind": "fc1"}}, d / name)
    res = run("tensors", "formats", d, "--json", "--formats", "nvfp4,nvfp4-rht", "--by", "tensor")
    assert res.code == 0, res
    rows = {(r["tensor"], r["candidate"]): r for r in json.loads(res.out)["rows"]}
    assert rows[("weight", "nvfp4-rht")]["sqnr_db"] in (None, "n/a")
    for tensor in ("input", "grad_output"):
        got = rows[(tensor, "nvfp4-rht")]
        assert isinstance(got["sqnr_db"], float) and got["sqnr_db"] > 10
    # the same measure by hand: the inverse-transformed quantization of [tokens, features]
    x2 = tensors["forward_nvfp4_input"].reshape(-1, 32)
    q = ops.fake_quant(x2, "nvfp4-rht", dim=0).double()
    want = 10 * math.log10(float((x2.double() ** 2).sum() / ((x2.double() - q) ** 2).sum()))
    assert rows[("input", "nvfp4-rht")]["sqnr_db"] == pytest.approx(want, abs=1e-6)
    assert rows[("input", "nvfp4-rht")]["sqnr_db"] != rows[("input", "nvfp4")]["sqnr_db"]
