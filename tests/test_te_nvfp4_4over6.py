"""NVFP4's 4over6 values (``nvfp4-4over6-mae``, ``-mse``, each with the E4M3 bound 256, TE's
default under 4over6, and 448) against TransformerEngine 2.20.2's own reference
(``NVFP4QuantizerRef(nvfp4_use_4over6=True, nvfp4_4over6_err_mode=..., nvfp4_e4m3_max=...)``,
tests/te_reference.py), bit for bit: every E2M1 code, every chosen E4M3 block scale and the
global amax, on 1 x 16 blocks and 16 x 16 weight tiles, fp32 and bf16, with edge blocks
(zeros, exact ties between the two candidates, saturated map-to-4 scales, block maxima at and
one float32 ulp around the bounds, subnormal and flushed scales, -0); the dequantized values
against TE's GEMM factor ``code * (scale * (amax / (6 * bound)))``; the output gradient as
``nvfp4``'s (TE's gradient slots take no 4over6); the products' operands; the Triton kernels
(interpreter) against the reference; and the role refusal."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from quantpatch.runtime import quantpatch_formats as formats  # noqa: E402
from quantpatch.runtime import quantpatch_nvfp4 as nv  # noqa: E402
from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_quantize as qz  # noqa: E402

from .te_reference import te_nvfp4, te_nvfp4_dequant  # noqa: E402
from .test_te_nvfp4 import gaussian  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
VALUES = formats.names(family="nvfp4", four_over_six="mae") + formats.names(
    family="nvfp4", four_over_six="mse"
)
TILES = [(1, 16), (16, 16)]


def _te_args(fmt: str) -> tuple[str, int]:
    mode, bound = nv.FOUR_OVER_SIX[fmt]
    return mode.upper(), bound


def edges(dtype: torch.dtype, bound: int, rows: int = 2048) -> torch.Tensor:
    """``rows`` x 256 Gaussian rows (a log-normal scale per row) with, among them: the tensor's
    amax 6 * bound (g = 1); blocks whose two candidates are both exact (values of +-{1.5, 3, 6}
    times a power of two: equal errors, a tie that goes to 6); blocks whose maximum is the
    tensor's (with bound 448 the map-to-4 scale saturates at 448 and equals map-to-6's); block
    maxima at 2/3 of the tensor's and one float32 ulp either side (1.5 * the map-to-6 scale at
    the E4M3 maximum); zero rows and tiles; a zero block; rows whose scales are subnormal or
    flush to 0; -0."""
    assert rows >= 128
    x = gaussian(rows, 256, 7, F32)
    top = 6.0 * bound
    x = x / x.abs().max() * (top * 0.9)
    x[0, 0] = top
    x[1:17, :] = 0.0
    x[17, 32:48] = 0.0
    gen = torch.Generator().manual_seed(8)
    exact = torch.tensor([1.5, 3.0, 6.0, -1.5, -3.0, -6.0, 0.0])
    idx = torch.randint(0, 7, (16, 256), generator=gen)
    ties = exact[idx]
    ties[:, ::16] = 6.0  # every block's maximum 6 * 2^k
    ties = ties * 2.0 ** torch.randint(-6, 6, (16, 16), generator=gen).repeat_interleave(16, 1)
    x[32:48] = ties
    x[48:64, ::16] = top  # blocks at the tensor's amax
    third = torch.tensor(top * 2.0 / 3.0)
    near = torch.stack(
        [torch.nextafter(third, third * 0), third, torch.nextafter(third, third * 2)]
    )
    x[64:80, ::16] = near.repeat(16 * 16)[: 16 * 16].reshape(16, 16)
    for i, e in enumerate(range(-35, -19)):
        x[80 + i] = gaussian(1, 256, 200 + i, F32)[0] * 2.0**e * top
    x[96, 5] = -0.0
    x[97, 0::16] = 100.0 * 1.0625  # block max between E4M3 values
    return x.to(dtype)


def mismatches(x: torch.Tensor, fmt: str, tile: tuple[int, int]) -> tuple[int, int, int, int]:
    """(codes that differ (value or sign), scales that differ, whether the amax differs,
    blocks mapped to 4) of quantpatch's reference against TE's on the 2-D ``x``."""
    mode, bound = _te_args(fmt)
    codes, scales, amax = te_nvfp4(x, tile, four_over_six=mode, e4m3_max=bound)
    q, s, a = nv.nvfp4_4over6_parts(x, fmt, -1, tile == (16, 16))
    s = s[:, ::16]
    m, nb = q.shape[0], s.shape[1]
    code_bad = (codes != q) | (torch.signbit(codes) != torch.signbit(q))
    scale_bad = scales[:m, :nb] != s
    # the blocks that took the map-to-4 scale: theirs differs from map-to-6's
    g = torch.clamp(torch.tensor(6.0 * bound) / a, max=3.4028234663852886e38)
    padded = torch.nn.functional.pad(x.float().abs(), (0, nb * 16 - x.shape[1]))
    bmax = padded.reshape(m, nb, 16).amax(-1) if tile == (1, 16) else None
    to4 = 0
    if bmax is not None:
        six = nv._e4m3(torch.clamp((bmax / 6.0) * g, max=448.0))
        to4 = int((s != six).sum())
    return int(code_bad.sum()), int(scale_bad.sum()), int(a.reshape(1) != amax.reshape(1)), to4


@pytest.mark.parametrize(
    ("tile", "dtype"), [((1, 16), BF16), ((16, 16), F32)], ids=["1x16-bf16", "16x16-fp32"]
)
@pytest.mark.parametrize("fmt", VALUES)
def test_codes_scales_and_amax_equal_te(fmt, tile, dtype):
    """128 K values per case: 64 K of edge rows and 64 K Gaussian rows (the slow test below:
    3 M values per case, every tile and dtype)."""
    bound = nv.FOUR_OVER_SIX[fmt][1]
    x = torch.cat([edges(dtype, bound, 256), gaussian(256, 256, 1, dtype)])
    bad_codes, bad_scales, bad_amax, to4 = mismatches(x, fmt, tile)
    assert (bad_codes, bad_scales, bad_amax) == (0, 0, 0)
    if tile == (1, 16):  # both candidates are taken, many times
        assert 500 < to4 < x.numel() // 16 - 500, to4


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile", TILES, ids=["1x16", "16x16"])
@pytest.mark.parametrize("fmt", VALUES)
def test_one_million_values_equal_te(fmt, tile, dtype):
    """2^20 Gaussian values, 1 M values with odd lengths (padded as TE pads) and 1 M edge
    values per case."""
    bound = nv.FOUR_OVER_SIX[fmt][1]
    for x in (
        gaussian(4096, 256, 0, dtype),
        gaussian(1000, 1050, 2, dtype),
        edges(dtype, bound, 4096),
    ):
        assert x.numel() >= 1 << 20
        assert mismatches(x, fmt, tile)[:3] == (0, 0, 0)


def test_exact_ties_go_to_six_and_saturated_map4_equals_map6():
    """Blocks of +-{1.5, 3, 6} * 2^k are exact under both candidates: the tie keeps 6's scale;
    with bound 448 a block at the tensor's amax saturates map-to-4's scale at 448, so both
    candidates are the same and it keeps 6's too."""
    for fmt in VALUES:
        bound = nv.FOUR_OVER_SIX[fmt][1]
        x = edges(F32, bound, 128)
        q, s, a = nv.nvfp4_4over6_parts(x, fmt)
        assert float(a) == 6.0 * bound
        ties = x[32:48]
        bmax = ties.abs().reshape(16, 16, 16).amax(-1)
        assert torch.equal(s[32:48, ::16], bmax / 6.0)  # g = 1: map-to-6's scale, exact
        assert torch.equal(q[32:48] * s[32:48], ties)
        at_top = s[48:64, ::16].unique().tolist()
        assert at_top == ([448.0] if bound == 448 else [256.0, 384.0]), at_top


def test_an_all_zero_tensor_and_tiny_and_huge_amax():
    for fmt in VALUES:
        z = torch.zeros(64, 64)
        for tile in TILES:
            assert mismatches(z, fmt, tile)[:3] == (0, 0, 0)
        assert torch.equal(ops.fake_quant(z, fmt), z)
        x = gaussian(64, 64, 4, F32)
        for scale in (2.0**-140, 2.0**-60, 2.0**100):  # g clamps at the float32 maximum first
            y = x / x.abs().max() * scale
            for tile in TILES:
                assert mismatches(y, fmt, tile)[:3] == (0, 0, 0), (fmt, scale, tile)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = {F32: torch.int32, BF16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.view(it), b.view(it))


@pytest.mark.parametrize(
    ("dtype", "fmts"), [(F32, VALUES[:2]), (BF16, VALUES[2:])], ids=["fp32", "bf16"]
)
def test_the_values_and_weight_tiles_are_tes_dequantized_operands(dtype, fmts):
    """``fake_quant(x, value)``: TE's 1 x 16 rowwise operand; along dim 0 its columnwise one
    (the transpose, quantized row by row); the weight operand format's 16 x 16 tiles: TE's
    rowwise weight along the last dimension and its columnwise weight along the first (the
    errors run along the reduction dimension, so the two may pick differently near a tie, and
    the weight cache keeps one entry per dimension)."""
    x = edges(dtype, 256, 128)
    for fmt in fmts:
        mode, bound = _te_args(fmt)
        weight_fmt = formats.spec_of(fmt).operands[0]
        for tile, got, src in (
            ((1, 16), ops.fake_quant(x, fmt), x),
            ((1, 16), ops.fake_quant(x, fmt, dim=0).t(), x.t().contiguous()),
            ((16, 16), qz.quantize(x, weight_fmt), x),
            ((16, 16), qz.quantize(x, weight_fmt, dim=-2).t(), x.t().contiguous()),
        ):
            codes, scales, amax = te_nvfp4(src, tile, four_over_six=mode, e4m3_max=bound)
            want = te_nvfp4_dequant(codes, scales, amax, tile, bound).to(dtype)
            assert _same_bits(got.contiguous(), want), (fmt, tile)


def test_non_finite_values_pass_through_and_leave_the_rest_as_te():
    """NaN and +-Inf come back as they were and are left out of the amax and their block's
    maximum (TE's reference does not define them: the rest equals TE on the tensor with them
    zeroed, as ``nvfp4`` does)."""
    x = gaussian(64, 64, 9, F32)
    x[0, 3], x[1, 20], x[2, 7] = float("nan"), float("inf"), -float("inf")
    zeroed = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    for fmt in VALUES:
        mode, bound = _te_args(fmt)
        got = ops.fake_quant(x, fmt)
        assert torch.isnan(got[0, 3]) and got[1, 20] == float("inf") and got[2, 7] == -float("inf")
        codes, scales, amax = te_nvfp4(zeroed, four_over_six=mode, e4m3_max=bound)
        want = te_nvfp4_dequant(codes, scales, amax, (1, 16), bound)
        finite = torch.isfinite(x)
        assert torch.equal(got[finite], want[finite])


def test_the_output_gradient_is_nvfp4s_with_the_same_random_bits():
    """TE's gradient slots take no 4over6: ``backward=True`` is ``nvfp4``'s stochastic
    rounding, drawing the same bits."""
    x = gaussian(32, 64, 10, BF16)
    for fmt in VALUES:
        ops.reset_sr_generators()
        got = ops.fake_quant(x, fmt, backward=True)
        ops.reset_sr_generators()
        assert torch.equal(got, ops.fake_quant(x, "nvfp4", backward=True))


def test_products_give_each_operand_its_format():
    """fprop ``x @ W^T``: x in 1 x 16 4over6 blocks, W in 16 x 16 tiles along its input
    dimension; dgrad ``dY @ W``: dY as ``nvfp4``'s gradient (stochastic), W's tiles along its
    output dimension; wgrad ``dY^T @ x``: dY^T stochastic, x in 4over6 blocks along the
    tokens."""
    x = gaussian(32, 64, 11, F32)
    w = torch.nn.Parameter(gaussian(48, 64, 12, F32))
    dy = gaussian(32, 48, 13, F32)
    for fmt in VALUES:
        wf = formats.spec_of(fmt).operands[0]
        with torch.no_grad():
            got = ops.quant_matmul(x, w.t(), fmt, weight="b")
            want = ops.fake_quant(x, fmt) @ qz.quantize(w.detach(), wf).t()
            assert torch.equal(got, want), fmt
            ops.reset_sr_generators()
            got = ops.quant_matmul(dy, w, fmt, backward=True, weight="b")
            ops.reset_sr_generators()
            want = ops.fake_quant(dy, "nvfp4", backward=True) @ qz.quantize(w.detach(), wf, dim=-2)
            assert torch.equal(got, want), fmt
            ops.reset_sr_generators()
            got = ops.quant_matmul(dy.t(), x, fmt, backward=True)
            ops.reset_sr_generators()
            want = ops.fake_quant(dy.t(), "nvfp4", backward=True) @ ops.fake_quant(x, fmt, dim=0)
            assert torch.equal(got, want), fmt


def test_cpu_slices_equal_the_whole_tensor(monkeypatch):
    cases = [((40, 48), -1), ((40, 48), 0), ((3, 40, 33), 1), ((100,), 0)]
    for fmt in ("nvfp4-4over6-mae", "nvfp4-4over6-mse-448-2d"):
        for shape, dim in cases:
            x = gaussian(1, int(torch.tensor(shape).prod()), len(shape) + dim, F32).reshape(shape)
            x.view(-1)[5] = float("nan")
            whole = qz._fake_quant(x, fmt, dim, False)
            monkeypatch.setattr(qz, "_CHUNK", 24)
            sliced = qz._fake_quant(x, fmt, dim, False)
            monkeypatch.undo()
            assert torch.equal(torch.nan_to_num(sliced, 7.0), torch.nan_to_num(whole, 7.0))


def test_tensors_formats_measures_4over6_as_the_products_quantize():
    """``tensors formats``' candidates: an activation in 4over6's 1 x 16 blocks, a weight in its
    16 x 16 tiles, a gradient as ``nvfp4`` (what the products give each operand), each block
    counted at the scale 4over6 chose (under the value's E4M3 bound)."""
    from quantpatch.analysis.tensor_metrics import formats_sums

    x = torch.cat([edges(F32, 256, 128), gaussian(64, 256, 16, F32)])
    fmts = (*VALUES, "nvfp4")

    def noise(q: torch.Tensor) -> float:
        return float(((x.double() - q.double()) ** 2).sum())

    act = formats_sums(x, fmts, -1, False)
    weight = formats_sums(x, fmts, -1, False, tiled=True, weight=True)
    grad = formats_sums(x, fmts, -1, True)
    for fmt in VALUES:
        assert act[fmt].noise == pytest.approx(noise(ops.fake_quant(x, fmt)), rel=1e-12), fmt
        assert act[fmt].noise != act["nvfp4"].noise
        tiles = qz.quantize(x, formats.spec_of(fmt).operands[0])
        assert weight[fmt].noise == pytest.approx(noise(tiles), rel=1e-12), fmt
        assert grad[fmt].noise == grad["nvfp4"].noise
        assert act[fmt].blocks == x.numel() // 16 and weight[fmt].blocks == x.numel() // 256
        q, s, a = nv.nvfp4_4over6_parts(x, fmt)
        deq = q * (s * nv.nv_decode(a, fmt))
        # clamped: a code of 6 below |x| (beyond float32 rounding), its block's scale not flushed
        clamped = (q.abs() == 6) & (s > 0) & (x.abs() > deq.abs() * (1 + 2**-20))
        assert act[fmt].overflows == int(clamped.sum()), fmt


def test_tensors_formats_takes_the_4over6_values_as_candidates(run, tmp_path):
    """``quantpatch tensors formats --formats nvfp4-4over6-...`` on saved tensors: the
    weight's row is its 16 x 16 tiles', the input's its 1 x 16 blocks', the output
    gradient's ``nvfp4``'s."""
    import json
    import math

    d = tmp_path / "t"
    d.mkdir()
    saved = {
        "weight": gaussian(64, 48, 17, F32),
        "input": gaussian(32, 48, 18, F32),
        "grad_output": gaussian(32, 64, 19, F32),
    }
    for name, t in saved.items():
        torch.save({"tensor": t, "metadata": {"tensor_name": name}}, d / f"{name}.pt")
    fmts = ",".join((*VALUES, "nvfp4"))
    res = run("tensors", "formats", d, "--json", "--formats", fmts, "--by", "tensor")
    assert res.code == 0, res
    rows = {(r["tensor"], r["candidate"]): r for r in json.loads(res.out)["rows"]}

    def sqnr(x: torch.Tensor, q: torch.Tensor) -> float:
        err = x.double() - q.double()
        return 10 * math.log10(float((x.double() ** 2).sum() / (err**2).sum()))

    w, x = saved["weight"], saved["input"]
    for fmt in VALUES:
        tiles = qz.quantize(w, formats.spec_of(fmt).operands[0])
        assert rows[("weight", fmt)]["sqnr_db"] == pytest.approx(sqnr(w, tiles), rel=1e-12)
        blocks = ops.fake_quant(x, fmt)
        assert rows[("input", fmt)]["sqnr_db"] == pytest.approx(sqnr(x, blocks), rel=1e-12)
        assert rows[("input", fmt)]["sqnr_db"] != rows[("input", "nvfp4")]["sqnr_db"]
        same = {k: v for k, v in rows[("grad_output", "nvfp4")].items() if k != "candidate"}
        assert same == {k: v for k, v in rows[("grad_output", fmt)].items() if k != "candidate"}


def test_list_json_shows_each_value_its_metric_and_bound_and_the_scheme_no_megatron_flag(run):
    import json

    res = run("list", "--json")
    assert res.code == 0, res
    listed = json.loads(res.out)
    values = {v["name"]: v for v in listed["values"]}
    assert [n for n in values if "4over6" in n] == list(VALUES)  # the -2d operands are not values
    for fmt in VALUES:
        mode, bound = nv.FOUR_OVER_SIX[fmt]
        v = values[fmt]
        assert (v["four_over_six"], v["e4m3_max"], v["roles"]) == (mode, bound, ["linear"])
        assert (v["megatron"], v["weight_block"], v["gradient_rounding"]) == (
            None,
            [16, 16],
            "stochastic",
        )
        assert f"nvfp4_e4m3_max={bound}" in v["reference"]
    assert (values["nvfp4"]["four_over_six"], values["nvfp4"]["e4m3_max"]) == (None, 448)
    assert listed["schemes"]["nvfp4_recipe_4over6"]["linear"] == "nvfp4-4over6-mae"
    assert listed["scheme_runs"]["nvfp4_recipe_4over6"]["megatron"] is None


# -- the Triton kernels (interpreter) against the reference -----------------------------------


@pytest.fixture
def kernels(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1)")
    pytest.importorskip("triton")
    from quantpatch.runtime import quantpatch_kernels

    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    return quantpatch_kernels


def _kernel_cases(
    dtype: torch.dtype, bound: int, small: bool = False
) -> list[tuple[torch.Tensor, int, bool]]:
    x = torch.cat([edges(dtype, bound, 128), gaussian(64, 256, 14, dtype)])
    if small:  # the edge rows, half their columns
        x = x[:128, :128].contiguous()
    x[5, 7], x[6, 9] = float("nan"), -float("inf")
    odd = x[:100, :120]
    return [(x, -1, False), (x, 0, False), (x, -1, True), (x, -2, True), (odd, -1, True)]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_the_kernel_equals_the_reference(kernels):
    """``nvfp4-4over6-mae`` along the strided dimension and its weight tiles along the first
    dimension of an odd shape, bf16 with NaN and -Inf (every value, dimension and dtype
    against TE: the slow test below); ``fake_quant`` runs the kernel."""
    cases = _kernel_cases(BF16, 256, small=True)
    x = cases[0][0]
    for x, dim, two_d in (cases[1], (cases[4][0], -2, True)):
        fmt = "nvfp4-4over6-mae-2d" if two_d else "nvfp4-4over6-mae"
        got = kernels.fake_quant(x, fmt, dim)
        want = nv.nvfp4_value(x, fmt, dim, two_d)
        same = (got.view(torch.int16) == want.view(torch.int16)) | torch.isnan(want)
        assert bool(same.all()) and bool(torch.isnan(got[5, 7])), (dim, two_d)
    got = ops.fake_quant(x, "nvfp4-4over6-mae")
    assert torch.isnan(got[5, 7]) and got[6, 9] == -float("inf")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fmt", VALUES)
def test_every_kernel_value_equals_te(kernels, fmt, dtype):
    """Every 4over6 value, 1 x 16 and tiles along either dimension, against TE itself (its
    dequantized operand) on the finite inputs and against the reference with NaN/Inf."""
    mode, bound = _te_args(fmt)
    wf = formats.spec_of(fmt).operands[0]
    for x, dim, two_d in _kernel_cases(dtype, bound):
        got = kernels.fake_quant(x, wf if two_d else fmt, dim)
        want = nv.nvfp4_value(x, fmt, dim, two_d)
        assert bool(((got == want) | torch.isnan(want)).all()), (dim, two_d)
    x = torch.cat([edges(dtype, bound, 128), gaussian(64, 256, 15, dtype)])
    if dtype == torch.float16:
        x = x / 64  # inside float16's range
    for tile in TILES:
        for dim in (-1, -2):
            got = kernels.fake_quant(x, wf if tile == (16, 16) else fmt, dim)
            src = x if dim == -1 else x.t().contiguous()
            codes, scales, amax = te_nvfp4(src, tile, four_over_six=mode, e4m3_max=bound)
            want = te_nvfp4_dequant(codes, scales, amax, tile, bound).to(dtype)
            got = got if dim == -1 else got.t().contiguous()
            assert _same_bits(got, want), (tile, dim)


def test_4over6_is_a_linear_value_only(run, make_checkout):
    root = make_checkout()
    for args in (("--qk", "nvfp4-4over6-mae"), ("--pv", "nvfp4-4over6-mse-448")):
        res = run("set", "--repo", root, "--no-branch", *args)
        assert res.code == 2 and "TE quantizes no attention GEMM in NVFP4" in res.err, res
        assert res.err.strip().count("\n") == 0 or "Error" in res.err, res
    res = run("check", "--repo", root, "--expect", "qk=nvfp4-4over6-mse")
    assert res.code == 2 and "use 'nvfp4' for qk" in res.err, res
    res = run("set", "--repo", root, "--no-branch", "--linear", "nvfp4-4over6-mae", "--qk", "nvfp4")
    assert res.code == 0, res
    res = run("check", "--repo", root, "--expect", "linear=nvfp4-4over6-mae,qk=nvfp4")
    assert res.code == 0, res


@pytest.mark.slow  # about 15 s: the fork's history is built
def test_a_forks_checkout_takes_4over6_after_init(run, trees, tmp_path):
    """On a fork-shaped checkout (history, the fork's own dispatch chains, which know only its
    own values): 4over6 is refused before ``init`` naming it, at the attention roles always,
    and after ``init`` set and ``check --expect`` take it, the recipe scheme too."""
    from .forklike import build_fork, clone_quant

    fork = build_fork(tmp_path / "origin", trees["0.13.1"], full=False)
    root = clone_quant(fork, tmp_path / "Megatron-LM")
    res = run("set", "--repo", root, "--linear", "nvfp4-4over6-mse")
    assert res.code == 2 and "'quantpatch init' teaches it" in " ".join(res.err.split()), res
    assert run("init", "--repo", root).code == 0  # the advice, followed
    res = run("set", "--repo", root, "--qk", "nvfp4-4over6-mse")
    assert res.code == 2 and "use 'nvfp4' for qk" in res.err, res
    res = run("set", "--repo", root, "--linear", "nvfp4-4over6-mse", "--qk", "nvfp4")
    assert res.code == 0, res
    assert run("check", "--repo", root, "--expect", "linear=nvfp4-4over6-mse,qk=nvfp4").code == 0
    assert run("restore", "--repo", root).code == 0
    assert run("set", "--repo", root, "--scheme", "nvfp4_recipe_4over6").code == 0
    expect = "linear=nvfp4-4over6-mae,qk=bf16,pv=bf16,bf16_layers=recipe,output"
    assert run("check", "--repo", root, "--expect", expect).code == 0


@pytest.mark.slow  # about 25 s a case in the interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize(
    ("fmt", "tile", "dtype"),
    [
        ("nvfp4-4over6-mae", (1, 16), F32),
        ("nvfp4-4over6-mse", (1, 16), BF16),
        ("nvfp4-4over6-mae-448", (16, 16), BF16),
        ("nvfp4-4over6-mse-448", (16, 16), F32),
    ],
    ids=["mae-1x16-fp32", "mse-1x16-bf16", "mae-448-16x16-bf16", "mse-448-16x16-fp32"],
)
def test_the_kernel_equals_te_on_a_million_values(kernels, fmt, tile, dtype):
    """2^20 Gaussian values (a log-normal scale per row) through the kernel, each tile and
    dtype once and each value once: TE's dequantized operand, bit for bit."""
    mode, bound = _te_args(fmt)
    x = gaussian(4096, 256, 20, dtype)
    kernel_fmt = formats.spec_of(fmt).operands[0] if tile == (16, 16) else fmt
    got = kernels.fake_quant(x, kernel_fmt, -1)
    codes, scales, amax = te_nvfp4(x, tile, four_over_six=mode, e4m3_max=bound)
    want = te_nvfp4_dequant(codes, scales, amax, tile, bound).to(dtype)
    assert x.numel() == 1 << 20 and _same_bits(got, want)
