"""NVFP4 against an oracle written here from the format's definition, block by block in numpy
float32 with ml_dtypes casts (E4M3 scales, E2M1 elements): forward round-to-nearest-even,
backward stochastic rounding given the same random bits, 2-D weight tiles, and the products."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
np = pytest.importorskip("numpy")

from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_quantize as qz  # noqa: E402

F32 = np.float32
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def _block_oracle(
    block: np.ndarray,
    g: np.float32,
    dec: np.float32,
    bits: np.ndarray | None,
    factored: bool = False,
) -> tuple[np.ndarray, np.float32]:
    """One block (float32, any shape) quantized and dequantized, and its E4M3 scale, in
    TransformerEngine 2.20.2's order of float32 operations (``NVFP4QuantizerRef``);
    ``factored``: code x block scale, without the tensor scale ``dec``."""
    finite = np.isfinite(block)
    mags = np.where(finite, np.abs(block), F32(0)).astype(F32)
    bmax = F32(mags.max())
    m = F32(g * F32(F32(1) / F32(6)))
    s = F32(np.minimum(F32(bmax * m), F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32))
    with np.errstate(divide="ignore", over="ignore"):
        enc = F32(min(F32(F32(1) / F32(s * F32(F32(1) / g))), np.finfo(F32).max))
    out = np.empty_like(block)
    for i in np.ndindex(*block.shape):
        x = block[i]
        if not np.isfinite(x):
            out[i] = x
            continue
        with np.errstate(over="ignore"):
            scaled = F32(x * enc)
        p = min(abs(float(scaled)), 6.0)
        if bits is None:
            q = float(F32(p).astype(ml_dtypes.float4_e2m1fn).astype(F32))
        else:
            lo = max(v for v in E2M1_GRID if v <= p)
            hi = min(v for v in E2M1_GRID if v >= p)
            frac = 0.0 if hi == lo else (p - lo) / (hi - lo)
            q = hi if int(bits[i]) < int(np.floor(256 * frac)) else lo
        q = F32(-q if scaled < 0 else q)
        out[i] = F32(q * s) if factored else F32(q * F32(s * dec))
    return out, s


def _oracle(
    x: torch.Tensor, dim: int, two_d: bool, rand: torch.Tensor | None, factored: bool
) -> tuple[np.ndarray, np.float32]:
    v = x.detach().float().cpu().numpy().astype(F32)
    r = None if rand is None else rand.cpu().numpy()
    finite = np.isfinite(v)
    amax = F32(np.where(finite, np.abs(v), F32(0)).max()) if v.size else F32(0)
    with np.errstate(divide="ignore", over="ignore"):
        g = F32(min(F32(F32(2688) / amax), np.finfo(F32).max))
    dec = F32(amax / F32(2688))
    out = np.empty_like(v)
    if two_d and v.ndim >= 2:
        rows, cols = v.shape[-2:]
        for lead in np.ndindex(*v.shape[:-2]):
            for r0 in range(0, rows, 16):
                for c0 in range(0, cols, 16):
                    idx = (*lead, slice(r0, r0 + 16), slice(c0, c0 + 16))
                    blk = _block_oracle(v[idx], g, dec, None if r is None else r[idx], factored)
                    out[idx] = blk[0]
    else:
        vm, om = np.moveaxis(v, dim, -1), np.moveaxis(out, dim, -1)
        rm = None if r is None else np.moveaxis(r, dim, -1)
        for lead in np.ndindex(*vm.shape[:-1]):
            for c0 in range(0, vm.shape[-1], 16):
                idx = (*lead, slice(c0, c0 + 16))
                blk = _block_oracle(vm[idx], g, dec, None if rm is None else rm[idx], factored)
                om[idx] = blk[0]
    return out, dec


def nvfp4_oracle(
    x: torch.Tensor, dim: int = -1, two_d: bool = False, rand: torch.Tensor | None = None
) -> torch.Tensor:
    """NVFP4 as TE 2.20.2 computes it, in float32: g = min(2688 / amax, FLT_MAX), per block
    s = E4M3(amax_b * (g * (1/6))), q = E2M1(x * (1 / (s * (1/g)))) (negative iff x times that
    is), x^ = q * (s * (amax / 2688)); blocks of 16 along ``dim`` or 16 x 16 tiles of the last
    two dimensions; ``rand``: 8 random bits per element (uint8), up iff r < floor(256 f)."""
    out, _dec = _oracle(x, dim, two_d, rand, factored=False)
    result = torch.from_numpy(out)
    if x.dtype == torch.bfloat16:  # the float32 result rounded to bf16 by ml_dtypes
        return torch.from_numpy(out.astype(ml_dtypes.bfloat16).view(np.int16)).view(x.dtype)
    return result.to(x.dtype)


def nvfp4_factored_oracle(
    x: torch.Tensor, dim: int = -1, two_d: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_oracle``'s operand as a bf16/fp16 product takes it: code x block scale q * s
    (exact in ``x``'s dtype) and the per-tensor decode scale amax / 2688 (float32, 0-d)."""
    out, dec = _oracle(x, dim, two_d, None, factored=True)
    t = torch.from_numpy(out)
    assert torch.equal(t.to(x.dtype).float(), t)  # exact in the training dtype
    return t.to(x.dtype), torch.tensor(dec, dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), "NaN in different places"
    bad = (_bits(got) != _bits(want)) & ~nan_g
    if bool(bad.any()):
        where = bad.nonzero()[:5].tolist()
        pairs = [(got[tuple(i)].item(), want[tuple(i)].item()) for i in where]
        raise AssertionError(f"{int(bad.sum())} lanes differ, e.g. (got, oracle) {pairs}")


def _mixed(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Blocks of 16 with magnitudes spread over many binades."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    mags = torch.exp2(torch.randint(-20, 20, (*shape[:-1], (shape[-1] + 15) // 16), generator=gen))
    return x * mags.float().repeat_interleave(16, dim=-1)[..., : shape[-1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 48), (5, 40), (3, 2, 17)])
def test_forward_matches_the_oracle(dtype, shape):
    x = _mixed(shape, sum(shape)).to(dtype)
    assert_bits(ops.fake_quant(x, "nvfp4"), nvfp4_oracle(x))
    assert_bits(ops.fake_quant(x, "nvfp4", dim=0), nvfp4_oracle(x, dim=0))


def test_ties_and_scale_edges():
    """g = 1 (amax 2688); a block of every E2M1 value, midpoint (ties to even) and neighbour at
    scale 1; blocks whose scale is an E4M3 tie, subnormal, flushed to 0 (2^-11, and the tie
    2^-10 to even 0), and 448."""
    mids = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
    vals = np.concatenate([E2M1_GRID, mids, mids * (1 + 2**-8), mids * (1 - 2**-8)])
    vals = np.concatenate([vals, -vals])
    pad = (-len(vals)) % 15
    body = np.concatenate([vals, np.zeros(pad)]).reshape(-1, 15)
    blocks = [np.full((1, 16), 2688.0)]
    for bmax in (6.0, 6.375, 6 * 1.1875, 6 * 2.0**-9, 6 * 3 * 2.0**-9, 6 * 1.5 * 2.0**-10):
        blocks.append(np.concatenate([np.full((len(body), 1), bmax), body * bmax / 6], axis=1))
    for bmax in (6 * 2.0**-11, 6 * 2.0**-10, 2688.0 * (1 - 2**-12)):
        blocks.append(np.concatenate([np.full((len(body), 1), bmax), body * bmax / 6], axis=1))
    x = torch.tensor(np.concatenate(blocks), dtype=torch.float32)
    got = ops.fake_quant(x, "nvfp4")
    assert_bits(got, nvfp4_oracle(x))
    assert_bits(ops.fake_quant(x.t().contiguous(), "nvfp4", dim=0), nvfp4_oracle(x).t())
    # at scale 1 the ties went to even, and the 2^-11 and 2^-10 blocks flushed to (signed) 0
    at_one = got[1 : 1 + len(body), 1:].flatten()[: len(vals)]
    assert float(at_one[len(E2M1_GRID)]) == 0.0  # 0.25 -> 0
    assert float(at_one[len(E2M1_GRID) + 1]) == 1.0  # 0.75 -> 1
    assert float(at_one[len(E2M1_GRID) + 4]) == 2.0  # 2.5 -> 2
    assert float(at_one[len(E2M1_GRID) + 6]) == 4.0  # 5 -> 4
    flushed = got[1 + 6 * len(body) : 1 + 8 * len(body)]
    assert bool((flushed == 0).all())


def test_tiny_and_huge_tensor_scales():
    """A float32-subnormal amax (g clamps at the float32 maximum) and one near its top."""
    x = _mixed((4, 32), 3)
    for scale in (2.0**-140, 2.0**-60, 2.0**100):
        y = (x / x.abs().max() * scale).float()
        assert_bits(ops.fake_quant(y, "nvfp4"), nvfp4_oracle(y))


def test_zero_tensor_nan_and_inf():
    z = torch.zeros(3, 32)
    z[1, 4] = -0.0
    # TE's code for -0 is +0 (x * enc < 0 is false): every element comes back +0
    assert_bits(ops.fake_quant(z, "nvfp4"), torch.zeros(3, 32))
    x = _mixed((4, 32), 5)
    x[0, 3], x[1, 20], x[2, 7] = float("nan"), float("inf"), -float("inf")
    x[3, :16] = float("nan")
    got = ops.fake_quant(x, "nvfp4")
    assert_bits(got, nvfp4_oracle(x))
    assert torch.isnan(got[0, 3]) and got[1, 20] == float("inf") and got[2, 7] == -float("inf")
    assert bool(torch.isfinite(got[0, torch.arange(32) != 3]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_d_tiles_match_the_oracle_and_the_transpose(dtype):
    w = _mixed((40, 48), 11).to(dtype)
    got = ops.fake_quant(w, "nvfp4-2d")
    assert_bits(got, nvfp4_oracle(w, two_d=True))
    assert_bits(ops.fake_quant(w.t(), "nvfp4-2d", dim=0).t(), got)
    assert_bits(ops.fake_quant(w.t().contiguous(), "nvfp4-2d").t(), got)
    assert not torch.equal(got, ops.fake_quant(w, "nvfp4"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4-2d"])
def test_backward_stochastic_rounding_matches_the_oracle_with_the_same_bits(
    monkeypatch, fmt, dtype
):
    monkeypatch.setenv("QUANTPATCH_SR_SEED", "17")
    monkeypatch.setenv("RANK", "3")
    ops.reset_sr_generators()
    x = _mixed((32, 48), 13).to(dtype)
    got1, got2 = ops.fake_quant(x, fmt, backward=True), ops.fake_quant(x, fmt, backward=True)
    gen = torch.Generator().manual_seed(20)  # 17 + rank 3
    u1 = torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8)
    u2 = torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8)
    two_d = fmt == "nvfp4-2d"
    assert_bits(got1, nvfp4_oracle(x, two_d=two_d, rand=u1))
    assert_bits(got2, nvfp4_oracle(x, two_d=two_d, rand=u2))
    assert not torch.equal(got1, got2)  # fresh bits per call
    assert not torch.equal(got1, ops.fake_quant(x, fmt))  # not round-to-nearest
    ops.reset_sr_generators()  # reproducible: the same seed gives the same draws
    assert_bits(ops.fake_quant(x, fmt, backward=True), got1)
    monkeypatch.setenv("RANK", "4")
    ops.reset_sr_generators()
    assert not torch.equal(ops.fake_quant(x, fmt, backward=True), got1)  # another rank's bits


def test_stochastic_rounding_at_bits_equal_to_the_threshold():
    """p = x (amax 6): a midpoint (f = 1/2, threshold floor(256 f) = 128) goes up for the bits
    0 and 127 and down for 128 and 255; f = 2^-9 (< 1/256) never goes up."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.125, 5.5, -0.75, -5.0])
    tiny = torch.tensor([1.0 + 2.0**-10, 4.0 + 2.0**-8])  # fractions 2^-9 of 0.5 and of 2
    x = torch.cat([torch.tensor([6.0]), mids, tiny, torch.zeros(2)]).expand(4, 16).contiguous()
    rand = torch.tensor([[0], [127], [128], [255]], dtype=torch.uint8).expand(4, 16).contiguous()
    got = qz._fake_quant(x, "nvfp4", -1, True, rand)
    assert_bits(got, nvfp4_oracle(x, rand=rand))
    assert (
        got[:, 2].tolist() == [1.0, 1.0, 0.5, 0.5]
        and got[:, 10].tolist() == [-1.0] * 2 + [-0.5] * 2
    )
    assert got[:, 12].tolist() == [1.0] * 4 and got[:, 13].tolist() == [4.0] * 4


def test_stochastic_rounding_goes_up_with_probability_floor_256f_over_256():
    """The hardware's granularity (8 random bits, ``cvt.rs``): P(up) = floor(256 f) / 256.
    One block [2688] makes g = 1, so the rows [6, values] have s = 1 and x * enc = x exactly.
    Fixed seed; each count within 6 binomial standard deviations of n P (about 1e-9 to fail by
    chance), a fraction below 1/256 never up, and one just below 2/256 (P = 1/256) apart from
    a uniform draw's P = f by more than 10 of them."""
    ops.reset_sr_generators()
    fracs = [2.0**-9, 2 / 256 - 2.0**-20, 0.3, 0.5, 0.75 + 2.0**-12, 255.5 / 256, 1 - 2.0**-20]
    lows = [1.0, 4.0, 0.5, 2.0, 3.0]  # spacings 0.5, 2, 0.5, 1, 1
    steps = [0.5, 2.0, 0.5, 1.0, 1.0]
    vals = [lo + st * f for lo, st in zip(lows, steps, strict=True) for f in fracs][:15]
    n = 40000
    row = torch.tensor([6.0, *vals])
    x = torch.cat([torch.tensor([[2688.0] + [0.0] * 15]), row.expand(n, 16)])
    q = ops.fake_quant(x, "nvfp4", backward=True)[1:, 1:].double()
    for j, v in enumerate(vals):
        lo, st = lows[j // len(fracs)], steps[j // len(fracs)]
        f = (float(torch.tensor(v)) - lo) / st  # the float32 value's own fraction
        p = np.floor(256 * f) / 256
        ups = int((q[:, j] > v).sum())
        assert int(((q[:, j] != lo) & (q[:, j] != lo + st)).sum()) == 0
        sd = (n * p * (1 - p)) ** 0.5
        assert abs(ups - n * p) <= 6 * sd, (v, f, ups, n * p)
        if f < 1 / 256:
            assert ups == 0
        if abs(f - (2 / 256 - 2.0**-20)) < 1e-12:
            assert abs(ups - n * f) > 10 * sd  # the uniform rule's P = f is told apart


def test_products_round_the_gradient_stochastically_and_tile_the_weight_only():
    ops.reset_sr_generators()
    a, b = _mixed((8, 32), 21), _mixed((32, 16), 22)
    want = torch.matmul(nvfp4_oracle(a), nvfp4_oracle(b, dim=0))
    assert_bits(ops.quant_matmul(a, b, "nvfp4"), want)
    assert_bits(ops.quant_matmul(a, b, "nvfp4-2d"), want)  # no Parameter: 1-D blocks
    got = ops.quant_matmul(a, b, "nvfp4", backward=True)
    gen = torch.Generator().manual_seed(ops.sr_seed())
    u = torch.randint(0, 256, a.shape, generator=gen, dtype=torch.uint8)
    assert_bits(got, torch.matmul(nvfp4_oracle(a, rand=u), nvfp4_oracle(b, dim=0)))
    weight = torch.nn.Parameter(_mixed((16, 32), 23))
    with torch.no_grad():
        got = ops.quant_matmul(a, weight.t(), "nvfp4-2d")
    assert_bits(got, torch.matmul(nvfp4_oracle(a), nvfp4_oracle(weight, two_d=True).t()))
    q1, q2 = _mixed((2, 4, 32), 24), _mixed((2, 32, 5), 25)
    want = torch.bmm(nvfp4_oracle(q1), nvfp4_oracle(q2, dim=-2))
    assert_bits(ops.quant_bmm(q1, q2, "nvfp4"), want)
    assert_bits(ops.quant_baddbmm(torch.empty(2, 4, 5), q1, q2, beta=0.0, fmt="nvfp4"), want)


def test_the_named_weight_operand_takes_the_tiles():
    """Megatron's linear autograd function hands ``weight.t()`` over as a plain tensor:
    ``roles`` names it the ``weight``, and the named operand alone takes 16 x 16 tiles;
    without roles a Parameter alone is tiled. The earlier spelling (``weight="a"|"b"``,
    ``backward=True``) computes the same, bit for bit, through the next release."""
    a, w = _mixed((8, 32), 41), _mixed((16, 32), 42)
    tiled = torch.matmul(nvfp4_oracle(a), nvfp4_oracle(w, two_d=True).t())
    assert_bits(ops.quant_matmul(a, w.t(), "nvfp4-2d", roles=("input", "weight")), tiled)
    assert_bits(ops.quant_matmul(a, w.t(), "nvfp4-2d", weight="b"), tiled)
    assert_bits(ops.quant_matmul(a, w.t(), "nvfp4-2d"), ops.quant_matmul(a, w.t(), "nvfp4"))
    assert_bits(  # both inputs: neither is tiled, though the second is a weight's view
        ops.quant_matmul(a, w.t(), "nvfp4-2d", roles=("input", "input")),
        ops.quant_matmul(a, w.t(), "nvfp4"),
    )
    assert not torch.equal(tiled, ops.quant_matmul(a, w.t(), "nvfp4"))
    g = _mixed((16, 8), 43)
    want = torch.matmul(nvfp4_oracle(w, two_d=True).t(), nvfp4_oracle(g, dim=0))
    assert_bits(ops.quant_matmul(w.t(), g, "nvfp4-2d", roles=("weight", "input")), want)
    assert_bits(ops.quant_matmul(w.t(), g, "nvfp4-2d", weight="a"), want)
    assert_bits(
        ops.quant_matmul(a, w.t(), "nvfp4", roles=("input", "weight")),
        ops.quant_matmul(a, w.t(), "nvfp4"),
    )
    gy = _mixed((8, 16), 44)  # dgrad: the output gradient (stochastic) against the weight
    for value in ("nvfp4", "nvfp4-2d"):
        ops.reset_sr_generators()
        named = ops.quant_matmul(gy, w, value, roles=("grad_output", "weight"))
        ops.reset_sr_generators()
        assert_bits(named, ops.quant_matmul(gy, w, value, backward=True, weight="b"))
    with pytest.raises(ValueError, match="weight='w'"):
        ops.quant_matmul(a, w.t(), "nvfp4-2d", weight="w")
    for roles in (("input", "grad_output"), ("weight", "weight"), ("input",), ("x", "input")):
        with pytest.raises(ValueError, match=r"roles=.*expected two of input, weight"):
            ops.quant_matmul(a, w.t(), "nvfp4", roles=roles)
    with pytest.raises(TypeError, match="roles= alone"):
        ops.quant_matmul(gy, w, "nvfp4", roles=("grad_output", "weight"), backward=True)


def test_fake_quant_of_a_named_operand():
    """``fake_quant(x, fmt, role=...)`` quantizes ``x`` as the products quantize that operand:
    a ``weight`` with the value's weight format (``nvfp4-2d``'s tiles), an ``input`` with the
    other operands' (1 x 16 blocks), a ``grad_output`` as ``backward=True`` did."""
    w = _mixed((16, 32), 45)
    assert_bits(ops.fake_quant(w, "nvfp4-2d", role="weight"), nvfp4_oracle(w, two_d=True))
    assert_bits(ops.fake_quant(w, "nvfp4-2d", role="input"), nvfp4_oracle(w))
    assert_bits(ops.fake_quant(w, "nvfp4-2d"), nvfp4_oracle(w, two_d=True))  # its own tiles
    ops.reset_sr_generators()
    named = ops.fake_quant(w, "nvfp4", role="grad_output")
    ops.reset_sr_generators()
    assert_bits(named, ops.fake_quant(w, "nvfp4", backward=True))
    with pytest.raises(ValueError, match="role='gradient'; expected one of input, weight"):
        ops.fake_quant(w, "nvfp4", role="gradient")


def test_straight_through_gradient():
    x = _mixed((4, 32), 31).requires_grad_()
    w = _mixed((32, 8), 32).requires_grad_()
    ops.quant_matmul(x, w, "nvfp4").sum().backward()
    assert x.grad is not None and w.grad is not None
    assert bool(torch.isfinite(x.grad).all()) and bool(torch.isfinite(w.grad).all())


# -- tensors formats: NVFP4 as a candidate --------------------------------------------------------


def _metrics_oracle(x: torch.Tensor, amax: float) -> dict[str, float | int]:
    """Counts and SQNR from the definition (TE's order): an element overflows where
    |x| * (1 / (s * (1/g))) > 6, a block's E4M3 scale saturated (amax_b * (g * (1/6)) past 448)
    or flushed (nonzero block, s = 0)."""
    g = F32(min(F32(F32(2688) / F32(amax)), np.finfo(F32).max))
    m = F32(g * F32(F32(1) / F32(6)))
    v = x.numpy().astype(F32)
    over = clipped = saturated = 0
    for row in v:
        for c0 in range(0, row.shape[0], 16):
            block = row[c0 : c0 + 16]
            raw = F32(np.abs(block).max() * m)
            s = F32(np.minimum(raw, F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32))
            unsaturated = raw.astype(ml_dtypes.float8_e4m3fn)  # NaN past E4M3's range
            clipped += int(bool(np.isnan(unsaturated)) or (np.abs(block).max() > 0 and s == 0))
            enc = F32(F32(1) / F32(s * F32(F32(1) / g))) if s > 0 else F32(0)
            n = int((np.abs(block) * enc > 6).sum()) if s > 0 else 0
            over, saturated = over + n, saturated + int(n > 0)
    g_x = x.double().numpy()
    q = nvfp4_oracle(x).double().numpy() if amax == float(x.abs().max()) else None
    sqnr = None if q is None else 10 * np.log10((g_x**2).sum() / ((g_x - q) ** 2).sum())
    return {"overflows": over, "clipped": clipped, "saturated": saturated, "sqnr": sqnr}


def test_formats_metrics_for_nvfp4_match_the_definition():
    from quantpatch.analysis.tensor_metrics import format_sums, formats_sums

    x = _mixed((8, 64), 41)
    x = x / x.abs().max() * 1000
    x[0, 0] = 2688.0  # g = 1
    x[1, :16] = 6 * 2.0**-11 * torch.linspace(0.5, 1, 16)  # E4M3 scale flushes to 0
    x[2, :16] = torch.tensor([6.375] + [1.0] * 15)  # s = E4M3(1.0625) = 1: 6.375 clamps to 6
    got = format_sums(x, "nvfp4")
    want = _metrics_oracle(x, 2688.0)
    assert (got.overflows, got.blocks_scale_clipped, got.blocks_saturated) == (
        want["overflows"],
        want["clipped"],
        want["saturated"],
    )
    assert got.blocks == 8 * 4 and got.overflows >= 1 and got.blocks_scale_clipped >= 1
    assert got.summary()["sqnr_db"] == pytest.approx(want["sqnr"], rel=1e-9)
    assert got.underflows == int(((x != 0) & (nvfp4_oracle(x) == 0)).sum())
    # a sample of rows is quantized with the whole tensor's scale when given its amax
    amax = torch.tensor(4000.0)
    sample = formats_sums(x, ("nvfp4",), -1, False, amax)["nvfp4"]
    assert sample.blocks_scale_clipped == _metrics_oracle(x, 4000.0)["clipped"]
    huge = formats_sums(x, ("nvfp4",), -1, False, torch.tensor(2688.0 / 1.2))["nvfp4"]
    assert huge.blocks_scale_clipped == _metrics_oracle(x, 2688.0 / 1.2)["clipped"] >= 1
    assert sample.noise != got.noise


def test_tensors_formats_takes_nvfp4_as_a_candidate(run, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    gen = torch.Generator().manual_seed(2)
    for i, name in enumerate(("input", "weight", "grad_output")):
        t = torch.randn(32, 64, generator=gen) * 10.0 ** (i - 1)
        torch.save({"tensor": t, "metadata": {"tensor_name": name, "layer_idx": 0}},
                   d / f"{i}.pt")  # fmt: skip
    res = run("tensors", "formats", d, "--json", "--formats", "mxfp4,nvfp4", "--by", "tensor")
    assert res.code == 0, res
    rows = {(r["tensor"], r["candidate"]): r for r in __import__("json").loads(res.out)["rows"]}
    assert {c for _, c in rows} == {"mxfp4", "nvfp4"}
    for name in ("input", "weight", "grad_output"):
        nv, mx = rows[(name, "nvfp4")], rows[(name, "mxfp4")]
        assert nv["blocks scale clipped %"] == 0.0 and nv["sqnr_db"] > mx["sqnr_db"]
    res = run("tensors", "formats", d, "--json")  # the default candidates are unchanged
    assert {r["candidate"] for r in __import__("json").loads(res.out)["rows"]} == {
        "mxfp8",
        "mxfp4",
        "hifp8",
    }


def test_tensors_formats_takes_nvfp4_2d_as_a_candidate(run, tmp_path):
    """nvfp4-2d tiles a linear weight 16 x 16 (its metrics are those of the oracle's tiles)
    and gives every other tensor nvfp4's 1-D blocks, as the quant op does in training."""
    import json
    import math

    from quantpatch.analysis.tensor_metrics import format_sums, sample_row_groups

    d = tmp_path / "t"
    d.mkdir()
    w, x = torch.randn(64, 48, generator=torch.Generator().manual_seed(51)), _mixed((32, 48), 52)
    w[:16, :16] = w[:16, :16] / w[:16, :16].abs().max() * 1e-6  # a tile whose E4M3 scale flushes
    for name, t in (("weight", w), ("input", x)):
        torch.save({"tensor": t, "metadata": {"tensor_name": name}}, d / f"{name}.pt")
    res = run("tensors", "formats", d, "--json", "--formats", "nvfp4,nvfp4-2d", "--by", "tensor")
    assert res.code == 0, res
    rows = {(r["tensor"], r["candidate"]): r for r in json.loads(res.out)["rows"]}
    err = w.double() - nvfp4_oracle(w, two_d=True).double()
    sqnr = 10 * math.log10(float((w.double() ** 2).sum() / (err**2).sum()))
    assert rows[("weight", "nvfp4-2d")]["sqnr_db"] == pytest.approx(sqnr, rel=1e-12)
    assert rows[("weight", "nvfp4-2d")]["sqnr_db"] != rows[("weight", "nvfp4")]["sqnr_db"]
    same = {k: v for k, v in rows[("input", "nvfp4")].items() if k != "candidate"}
    assert same == {k: v for k, v in rows[("input", "nvfp4-2d")].items() if k != "candidate"}
    tiles, blocks = format_sums(w, "nvfp4-2d", tiled=True), format_sums(w, "nvfp4-2d")
    assert (tiles.blocks, tiles.blocks_scale_clipped) == (12, 1)
    assert (blocks.blocks, blocks.blocks_scale_clipped) == (64 * 3, 16)
    # a sample keeps whole tiles: groups of 32 rows at multiples of 32, the partial one last
    t = torch.arange(100 * 16.0).reshape(100, 16)
    assert torch.equal(sample_row_groups(t, 2 * 32 * 16), torch.cat([t[:32], t[96:]]))
    assert sample_row_groups(t, None) is t
    res = run("tensors", "formats", d, "--json", "--formats", "nvfp4-2d", "--sample", "1600")
    assert res.code == 0, res


def test_the_ops_modules_import_torch_and_the_standard_library_only():
    import ast
    import sys
    from pathlib import Path

    from quantpatch.checkout.init import OPS_MODULES
    from quantpatch.checkout.parts import RUNTIME_MODULES

    package = Path(ops.__file__).parent.parent
    for installed in OPS_MODULES:  # quantpatch_ops.py, the package's __init__ and the parts
        source = package / RUNTIME_MODULES[installed]
        tree = ast.parse(source.read_text())
        names = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        names |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
        }
        # the format spec and the environment module: the standard library alone
        # (and the package's __init__, which imports nothing)
        stdlib_only = source.stem in ("quantpatch_formats", "quantpatch_env", "package_init")
        # delayed scaling asks Megatron (in whose process it runs) for the amax reduction
        # group, inside the function that reduces: never at import
        inside = {"megatron"} if source.stem == "quantpatch_delayed" else set()
        want = set() if stdlib_only else {"torch", *inside}
        assert names - set(sys.stdlib_module_names) == want


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4-2d"])
def test_cpu_slices_equal_the_whole_tensor(monkeypatch, fmt):
    """Large CPU tensors are worked slice by slice with the whole tensor's amax: the same bits
    as one pass (blocks and tiles never cut), stochastic rounding included."""
    cases = [((40, 48), -1), ((40, 48), 0), ((3, 40, 33), 1), ((100,), 0), ((2, 3, 4, 32), -1)]
    for shape, dim in cases:
        x = _mixed(shape, len(shape) * 7 + dim)
        x.view(-1)[5] = float("nan")
        rand = torch.rand(shape, generator=torch.Generator().manual_seed(1))
        whole = [qz._fake_quant(x, fmt, dim, bw, rand) for bw in (False, True)]
        monkeypatch.setattr(qz, "_CHUNK", 24)
        sliced = [qz._fake_quant(x, fmt, dim, bw, rand) for bw in (False, True)]
        monkeypatch.undo()
        for a, b in zip(sliced, whole, strict=True):
            assert_bits(a, b)
        assert_bits(whole[0], nvfp4_oracle(x, dim, fmt == "nvfp4-2d"))


def test_nvfp4_2d_is_a_linear_value_only(run, make_checkout):
    root = make_checkout()
    for args in (("--qk", "nvfp4-2d"), ("--pv", "nvfp4-2d")):
        res = run("set", "--repo", root, "--no-branch", *args)
        assert res.code == 2 and "only the linear role has weights" in res.err, res
    res = run("check", "--repo", root, "--expect", "qk=nvfp4-2d")
    assert res.code == 2 and "use 'nvfp4' for qk" in res.err, res
    res = run("set", "--repo", root, "--no-branch", "--linear", "nvfp4-2d", "--pv", "nvfp4")
    assert res.code == 0, res
    res = run("check", "--repo", root, "--expect", "linear=nvfp4-2d,pv=nvfp4")
    assert res.code == 0, res
