"""NVFP4, nvfp4-2d and nvfp4-rht against TransformerEngine 2.20.2's own reference
(``NVFP4QuantizerRef``, tests/te_reference.py), bit for bit: every E2M1 code, every E4M3 block
scale and the global amax, on 2^20 values and more per case (Gaussian with a log-normal scale
per row, fixed seeds), fp32 and bf16 inputs, 1 x 16 and 16 x 16 tiles, the Hadamard transform,
lengths that are not a multiple of 16, zero blocks, ties, subnormal and flushed scales,
saturation and an all-zero tensor; the dequantized values against TE's formula
``code * (scale * (amax / 2688))``; and the Triton kernels (interpreter) against TE on smaller
shapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from quantpatch.runtime import quantpatch_nvfp4 as nv  # noqa: E402
from quantpatch.runtime import quantpatch_rht as rht  # noqa: E402

from .te_reference import te_modules, te_nvfp4, te_nvfp4_dequant  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16


def gaussian(m: int, n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Gaussian values with a log-normal scale per row (sigma 2: rows span ~2^23)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(m, 1, generator=gen) * 2.0)
    return (torch.randn(m, n, generator=gen) * scale).to(dtype)


def edges(dtype: torch.dtype) -> torch.Tensor:
    """4096 x 256 Gaussian rows with, among them: zero blocks and rows, E2M1 ties at a scale of
    exactly 1 (the tensor's amax 2688 makes g = 1), rows whose E4M3 scales are subnormal or
    flush to 0 (2^-20 .. 2^-35 of the amax), blocks saturating their elements (one large value,
    the rest just below 6 times the rounded-down scale), and -0."""
    x = gaussian(4096, 256, 5, F32)
    x = x / x.abs().max() * 2000.0
    x[0, 0] = 2688.0  # g = 1
    x[1:17, :] = 0.0  # zero rows and 16 x 16 tiles
    x[17, 32:48] = 0.0  # a zero block
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0])
    ties = torch.cat([torch.tensor([6.0]), mids, -mids[:5]])  # block max 6: scale 1
    x[32:48, :] = ties.repeat(16, 16)
    for i, e in enumerate(range(-35, -19)):
        x[48 + i] = gaussian(1, 256, 100 + i, F32)[0] * 2.0**e * 2688.0
    x[64:80, 0::16] = 100.0 * 1.0625  # block max between E4M3 values: s rounds down
    x[64:80, 1::16] = 100.0
    x[80, 5] = -0.0
    return x.to(dtype)


def ours(x: torch.Tensor, tile: tuple[int, int], use_rht: bool):
    """(codes, scales per block, amax) of quantpatch's reference, laid out as TE's."""
    t = rht.rht(x, -1) if use_rht else x
    q, s, amax = nv.nvfp4_parts(t, -1, tile == (16, 16))
    return q, s[:, ::16], amax


def mismatches(x: torch.Tensor, tile: tuple[int, int] = (1, 16), use_rht: bool = False):
    """Elements whose code differs (value or sign bit), blocks whose scale differs, and
    whether the global amax differs; TE's RHT path quantizes ``x.t()``'s columnwise operand,
    so it gets ``x.t()`` (rows of ``x`` transformed)."""
    codes, scales, amax = te_nvfp4(x.t().contiguous() if use_rht else x, tile, rht=use_rht)
    q, s, a = ours(x, tile, use_rht)
    m, nb = q.shape[0], s.shape[1]
    code_bad = (codes != q) | (torch.signbit(codes) != torch.signbit(q))
    scale_bad = scales[:m, :nb] != s
    return int(code_bad.sum()), int(scale_bad.sum()), int(a.reshape(1) != amax.reshape(1))


CASES = [
    ("gaussian", lambda d: gaussian(4096, 256, 0, d)),
    ("wide", lambda d: gaussian(1024, 1024, 1, d)),
    ("odd lengths", lambda d: gaussian(1000, 1050, 2, d)),  # 1050 % 16 = 10, 1000 % 16 = 8
    ("edges", edges),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_codes_scales_and_amax_equal_te(case, tile, dtype):
    x = dict(CASES)[case](dtype)
    assert x.numel() >= 1 << 20
    assert mismatches(x, tile) == (0, 0, 0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["gaussian", "wide", "edges"])
def test_rht_codes_scales_and_amax_equal_te(case, dtype):
    x = dict(CASES)[case](dtype)
    assert mismatches(x, use_rht=True) == (0, 0, 0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_the_transform_equals_tes_bit_for_bit(dtype):
    """TE's ``_apply_rht`` (``x @ (diag(s) H16 / 4)`` in ``x``'s dtype) against ours, also with
    block magnitudes spanning 2^20 (float32 partial sums no longer exact)."""
    ref = te_modules().reference_nvfp4
    q = ref.NVFP4QuantizerRef(
        dtype=te_modules().reference_utils.Fp4Formats.E2M1, columnwise=True, with_rht=True
    )
    assert tuple(int(v) for v in ref.get_wgrad_sign_vector()) == rht.SIGNS
    x = gaussian(4096, 256, 3, dtype)
    wide = x.clone().reshape(-1, 16)
    wide[:, 0] *= 2.0**20
    for t in (x, wide.reshape(x.shape)):
        want, got = q._apply_rht(t), rht.rht(t, -1)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16 if dtype == BF16 else torch.int32),
                           want.view(torch.int16 if dtype == BF16 else torch.int32))  # fmt: skip


def test_an_all_zero_tensor():
    z = torch.zeros(4096, 256)
    for tile in ((1, 16), (16, 16)):
        assert mismatches(z, tile) == (0, 0, 0)
    assert mismatches(z, use_rht=True) == (0, 0, 0)
    assert torch.equal(nv.nvfp4(z, -1, False), z)


def _dequant_equal(x: torch.Tensor, tile: tuple[int, int], use_rht: bool) -> None:
    codes, scales, amax = te_nvfp4(x.t().contiguous() if use_rht else x, tile, rht=use_rht)
    want = te_nvfp4_dequant(codes, scales, amax, tile).to(x.dtype)
    if use_rht:
        got = rht.reference_rht_fake_quant(x, -1, None)
    else:
        got = nv.nvfp4(x, -1, tile == (16, 16))
    it = torch.int16 if x.dtype == BF16 else torch.int32
    assert torch.equal(got.view(it), want.view(it))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_the_dequantized_values_are_tes_formula(dtype):
    """``code * (scale * (amax / 2688))``, rounded once to the input's dtype."""
    x = edges(dtype)
    _dequant_equal(x, (1, 16), False)
    _dequant_equal(x, (16, 16), False)
    _dequant_equal(x, (1, 16), True)


def test_rht_refuses_a_length_not_a_multiple_of_16_as_te_does():
    x = gaussian(8, 40, 4, BF16)
    with pytest.raises(ValueError, match=r"shape \(8, 40\) has 40"):
        rht.rht_fake_quant(x, -1)
    with pytest.raises(ValueError, match=r"shape \(40, 8\) has 40 there \(dim 0\)"):
        rht.rht_fake_quant(x.t(), 0)
    with pytest.raises(ValueError, match="divisible by hadamard dimension 16"):
        te_nvfp4(x.t().contiguous(), rht=True)


# -- the Triton kernels (interpreter) against TE, on smaller shapes ---------------------------


@pytest.fixture
def kernels(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1)")
    pytest.importorskip("triton")
    from quantpatch.runtime import quantpatch_kernels, quantpatch_rht_kernels

    return quantpatch_kernels, quantpatch_rht_kernels


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_the_kernels_equal_te(kernels, dtype):
    k, rk = kernels
    x = edges(dtype)[:128].contiguous()  # 32 K values: ties, zero and subnormal-scale blocks
    x = torch.cat([x, gaussian(128, 256, 9, dtype)])
    it = torch.int16 if dtype == BF16 else torch.int32
    for fmt, tile in (("nvfp4", (1, 16)), ("nvfp4-2d", (16, 16))):
        codes, scales, amax = te_nvfp4(x, tile)
        want = te_nvfp4_dequant(codes, scales, amax, tile).to(dtype)
        assert torch.equal(k.fake_quant(x, fmt).view(it), want.view(it)), fmt
    codes, scales, amax = te_nvfp4(x.t().contiguous(), rht=True)
    want = te_nvfp4_dequant(codes, scales, amax, (1, 16)).to(dtype)
    got = rk.rht_nvfp4(x, -1, None, rht.transform_matrix())
    assert torch.equal(got.view(it), want.view(it))


# -- tensor parallelism: the tensor each per-tensor amax is taken over ------------------------

TP_WORKER = Path(__file__).with_name("nvfp4_tp_worker.py")


@pytest.mark.slow
def test_tensor_parallel_amax_follows_tes_reduction_rule(run, make_checkout, tmp_path):
    """TP = 2 with sequence parallelism (two processes, gloo, CPU), ``--linear nvfp4``: the
    column-parallel layer's input is quantized with the amax of the whole all-gathered input
    (TE reduces that amax over the group), the row-parallel layer's input and each weight shard
    with their own rank's (TE reduces neither); the other rule gives other outputs."""
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, "--linear", "nvfp4").code == 0
    out = tmp_path / "tp.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env.pop("CUSTOM_QUANT_TYPE", None)
    env["PYTHONPATH"] = str(root)
    res = subprocess.run(
        [sys.executable, str(TP_WORKER), str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for rank, got in enumerate(torch.load(out)):
        assert got["x_amax_shard_differs"] or rank == 1, got  # rank 0's shard is the small one
        assert got["col_is_te"] and got["row_is_te"], (rank, got)
        assert not got["col_is_other"] and not got["row_is_other"], (rank, got)
