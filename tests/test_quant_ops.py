"""Quant ops against independent oracles: ml_dtypes for the MX element types and E8M0 scales,
an exhaustive 256-code HiFloat8 table built from the format's definition, and properties."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
np = pytest.importorskip("numpy")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from quantpatch.runtime.quantpatch_ops import (  # noqa: E402
    fake_quant,
    quant_baddbmm,
    quant_bmm,
    quant_matmul,
)

# -- MX oracle (numpy + ml_dtypes, float64) ---------------------------------------------------

ELEMENTS = {  # fmt, backward -> (ml_dtypes type, emax_elem, largest normal)
    ("mxfp8", False): (ml_dtypes.float8_e4m3fn, 8, 448.0),
    ("mxfp8", True): (ml_dtypes.float8_e5m2, 15, 57344.0),
    ("mxfp4", False): (ml_dtypes.float4_e2m1fn, 2, 6.0),
    ("mxfp4", True): (ml_dtypes.float4_e2m1fn, 2, 6.0),
}


def mx_oracle(x: np.ndarray, fmt: str, backward: bool) -> np.ndarray:
    """Rows of ``x`` (float64) in blocks of 32 along the last axis, per OCP MX v1.0."""
    dtype, emax, vmax = ELEMENTS[(fmt, backward)]
    out = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        for start in range(0, row.shape[0], 32):
            block = row[start : start + 32]
            amax = np.max(np.abs(block))
            shared = (math.floor(math.log2(amax)) - emax) if amax > 0 else -127
            shared = max(-127, min(127, shared))
            scale = 2.0**shared
            # the scale is an E8M0 value: representable exactly
            assert float(np.float32(scale).astype(ml_dtypes.float8_e8m0fnu)) == scale
            p = np.clip(block / scale, -vmax, vmax)
            out[idx][start : start + 32] = p.astype(dtype).astype(np.float64) * scale
    return out


def _element_values(dtype) -> np.ndarray:
    """Every finite value of an ml_dtypes element type, sorted, plus every midpoint."""
    bits = np.arange(256 if np.dtype(dtype).itemsize == 1 else 16, dtype=np.uint8)
    vals = (
        bits.view(dtype)
        if np.dtype(dtype).itemsize == 1
        else np.array(
            [
                float(dtype(v))
                for v in np.frombuffer(bits.tobytes(), dtype=np.uint8).astype(np.float32)
            ]
        )
    )
    vals = np.unique(np.asarray(vals, dtype=np.float64))
    vals = vals[np.isfinite(vals)]
    mids = (vals[1:] + vals[:-1]) / 2
    return np.concatenate([vals, mids, mids * (1 + 2**-10), mids * (1 - 2**-10)])


@pytest.mark.parametrize(("fmt", "backward"), list(ELEMENTS))
def test_mx_elements_every_value_and_tie_match_ml_dtypes(fmt, backward):
    dtype, emax, vmax = ELEMENTS[(fmt, backward)]
    if dtype is ml_dtypes.float4_e2m1fn:
        grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
        grid = np.concatenate([-grid[::-1], grid])
        mids = (grid[1:] + grid[:-1]) / 2
        values = np.concatenate([grid, mids, mids * (1 + 2**-10), mids * (1 - 2**-10)])
    else:
        values = _element_values(dtype)
    values = values[np.abs(values) <= vmax]
    # blocks of 31 values plus an anchor that pins the scale to 1 (amax in the top binade)
    anchor = 2.0**emax
    pad = (-len(values)) % 31
    values = np.concatenate([values, np.zeros(pad)]).reshape(-1, 31)
    x = np.concatenate([values, np.full((values.shape[0], 1), anchor)], axis=1)
    got = fake_quant(torch.tensor(x, dtype=torch.float32), fmt, backward=backward)
    expected = mx_oracle(x, fmt, backward)
    np.testing.assert_array_equal(got.numpy().astype(np.float64), expected)


@pytest.mark.parametrize(("fmt", "backward"), list(ELEMENTS))
@pytest.mark.parametrize("seed", range(3))
def test_mx_random_blocks_and_scales_match_oracle(fmt, backward, seed):
    gen = np.random.default_rng(seed)
    # every block at its own magnitude: scales from 2^-120 to 2^120 (incl. E8M0 extremes)
    mags = 2.0 ** gen.integers(-120, 120, size=(8, 6, 1))
    x = (gen.standard_normal((8, 6, 32)) * mags).reshape(8, 192).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 32:64] *= 1e-30  # tiny
    got = fake_quant(torch.from_numpy(x), fmt, backward=backward).numpy()
    expected = mx_oracle(x.astype(np.float64), fmt, backward)
    np.testing.assert_array_equal(got.astype(np.float64), expected.astype(np.float32))


def test_mx_non_multiple_of_32_and_dim():
    x = torch.randn(3, 45) * 10
    q = fake_quant(x, "mxfp8")
    assert torch.equal(q[:, :32], fake_quant(x[:, :32], "mxfp8"))
    assert torch.equal(q[:, 32:], fake_quant(x[:, 32:], "mxfp8"))
    y = torch.randn(70, 5)
    assert torch.equal(fake_quant(y, "mxfp4", dim=0), fake_quant(y.t(), "mxfp4").t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "hifp8"])
def test_dtypes_keep_dtype_and_agree_with_float32(dtype, fmt):
    x = (torch.randn(4, 64) * 3).to(dtype)
    q = fake_quant(x, fmt)
    assert q.dtype == dtype and q.shape == x.shape
    assert torch.equal(q, fake_quant(x.float(), fmt).to(dtype))
    assert fake_quant(x, "bf16") is x


def test_nan_and_inf_propagate_without_disturbing_the_block():
    x = torch.linspace(-3, 3, 32)
    y = x.clone()
    y[5], y[9], y[20] = float("nan"), float("inf"), float("-inf")
    for fmt in ("mxfp8", "mxfp4", "hifp8"):
        q, ref = fake_quant(y, fmt), fake_quant(torch.where(torch.isfinite(y), y, 0.0), fmt)
        assert math.isnan(q[5]) and q[9] == float("inf") and q[20] == float("-inf")
        keep = torch.isfinite(y)
        assert torch.equal(q[keep], ref[keep])


# -- HiFloat8: the 256 codes from the definition -------------------------------------------------


def hif8_table() -> np.ndarray:
    """Every finite HiF8 magnitude: 3/2/1 mantissa bits for |E| <= 3/7/15 (the top code,
    1.5 * 2^15, is infinity), denormal powers of two 2^-22..2^-16, and zero."""
    mags = {0.0}
    for e in range(-15, 16):
        m = 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1
        for k in range(2**m):
            mags.add((1 + k / 2**m) * 2.0**e)
    mags.discard(1.5 * 2.0**15)  # infinity
    mags.update(2.0**e for e in range(-22, -15))
    return np.array(sorted(mags))


def test_hif8_table_has_the_documented_shape():
    table = hif8_table()
    # per sign: 120 normal codes in 31 binades (one of them, 1.5 * 2^15, is infinity) and
    # 7 denormals = 126 finite nonzero magnitudes; 2 * 126 + zero + NaN + 2 infinities = 256
    assert len(table) == 1 + 126 and table[1] == 2.0**-22 and table[-1] == 2.0**15
    binades = {math.floor(math.log2(v)) for v in table[1:]}
    assert len(binades) == 38 and min(binades) == -22 and max(binades) == 15


def hif8_oracle(x: np.ndarray) -> np.ndarray:
    table = hif8_table()
    a = np.abs(x)
    idx = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    lo, hi = table[idx - 1], table[idx]
    pick = np.where(a - lo < hi - a, lo, hi)  # ties (equal distance) go away from zero: hi
    pick = np.where(a >= table[-1], table[-1], pick)  # saturate
    return np.copysign(pick, x)


def test_hif8_every_code_midpoint_and_neighbour():
    t = hif8_table()
    mids = (t[1:] + t[:-1]) / 2
    probes = np.concatenate(
        [
            t,
            mids,
            np.nextafter(mids.astype(np.float32), 0),
            np.nextafter(mids.astype(np.float32), np.inf),
            [2.0**-23, np.nextafter(np.float32(2.0**-23), 0), 40000.0, 1e30],
        ]
    )
    probes = np.concatenate([probes, -probes]).astype(np.float32)
    got = fake_quant(torch.from_numpy(probes), "hifp8").numpy().astype(np.float64)
    np.testing.assert_array_equal(got, hif8_oracle(probes.astype(np.float64)))


def test_hif8_log_uniform_sweep():
    gen = np.random.default_rng(1)
    x = (2.0 ** gen.uniform(-26, 17, 200_000) * gen.choice([-1, 1], 200_000)).astype(np.float32)
    got = fake_quant(torch.from_numpy(x), "hifp8").numpy().astype(np.float64)
    np.testing.assert_array_equal(got, hif8_oracle(x.astype(np.float64)))


# -- properties -------------------------------------------------------------------------------

finite32 = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)
vectors = st.lists(finite32, min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(v=vectors, fmt=st.sampled_from(["mxfp8", "mxfp4", "hifp8"]), backward=st.booleans())
def test_idempotent_and_sign_symmetric(v, fmt, backward):
    x = torch.tensor(v, dtype=torch.float32)
    q = fake_quant(x, fmt, backward=backward)
    assert torch.equal(fake_quant(q, fmt, backward=backward), q)
    assert torch.equal(fake_quant(-x, fmt, backward=backward), -q)


@settings(max_examples=200, deadline=None)
@given(v=st.lists(finite32, min_size=2, max_size=32))
def test_monotone_within_a_block_and_per_tensor(v):
    x = torch.tensor(sorted(v), dtype=torch.float32)
    for fmt in ("mxfp8", "mxfp4", "hifp8"):  # one block: one scale, so order is kept
        q = fake_quant(x, fmt)
        assert bool((q[1:] >= q[:-1]).all())


@settings(max_examples=300, deadline=None)
@given(a=st.floats(min_value=2.0**-15, max_value=2.0**15, allow_nan=False, width=32))
def test_hif8_error_bound_per_binade(a):
    e = math.floor(math.log2(a))
    m = 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1
    q = float(fake_quant(torch.tensor([a]), "hifp8")[0])
    assert abs(q - a) <= 2.0 ** (e - m - 1) * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(
    v=st.lists(
        st.floats(min_value=-400, max_value=400, allow_nan=False, width=32),
        min_size=32,
        max_size=32,
    )
)
def test_mx_error_bound(v):
    x = torch.tensor(v, dtype=torch.float32)
    amax = float(x.abs().max())
    if amax == 0:
        return
    # the E8M0 scale cannot go below 2^-127 (a block of float32 denormals uses that floor)
    scale = 2.0 ** max(math.floor(math.log2(amax)) - 8, -127)
    q = fake_quant(x, "mxfp8")
    for xi, qi in zip(x.tolist(), q.tolist(), strict=True):
        p = abs(xi) / scale
        if p > 448:
            assert abs(qi) == 448 * scale
            continue
        quantum = 2.0 ** (max(math.floor(math.log2(p)), -6) - 3) if p > 0 else 2.0**-9
        assert abs(qi - xi) <= quantum / 2 * scale * (1 + 1e-9)


# -- products -------------------------------------------------------------------------------------


def test_quant_matmul_quantizes_along_the_reduction_dimension():
    a, b = torch.randn(2, 5, 64), torch.randn(64, 48)
    for fmt in ("mxfp8", "mxfp4", "hifp8"):
        want = torch.matmul(fake_quant(a, fmt, dim=-1), fake_quant(b, fmt, dim=-2))
        assert torch.equal(quant_matmul(a, b, fmt), want)
        want = torch.matmul(
            fake_quant(a, fmt, dim=-1, backward=True), fake_quant(b, fmt, dim=-2, backward=True)
        )
        assert torch.equal(quant_matmul(a, b, fmt, backward=True), want)
    assert torch.equal(quant_matmul(a, b, "bf16"), torch.matmul(a, b))


def test_baddbmm_beta_zero_never_reads_the_buffer():
    q, k = torch.randn(4, 8, 32), torch.randn(4, 32, 8)
    buf = torch.full((4, 8, 8), float("nan"))
    for fmt in ("mxfp8", "mxfp4", "hifp8"):
        out = quant_baddbmm(buf, q, k, beta=0.0, alpha=0.125, fmt=fmt)
        assert torch.isfinite(out).all()
        want = torch.bmm(fake_quant(q, fmt, dim=-1), fake_quant(k, fmt, dim=-2)) * 0.125
        assert torch.equal(out, want)
    base = torch.ones(4, 8, 8)
    out = quant_baddbmm(base, q, k, beta=1.0, alpha=1.0, fmt="mxfp8")
    assert torch.allclose(
        out, base + torch.bmm(fake_quant(q, "mxfp8", dim=-1), fake_quant(k, "mxfp8", dim=-2))
    )


def test_mxfp4_attention_uses_e2m1_for_both_operands():
    q, k = torch.randn(2, 4, 32) * 5, torch.randn(2, 32, 4) * 5
    out = quant_baddbmm(torch.empty(2, 4, 4), q, k, beta=0.0, alpha=1.0, fmt="mxfp4")
    q4 = fake_quant(q, "mxfp4", dim=-1)
    k4 = fake_quant(k, "mxfp4", dim=-2)
    assert torch.equal(out, torch.bmm(q4, k4))
    # E2M1: every element is one of 0, .5, 1, 1.5, 2, 3, 4, 6 times a power of two
    scale = 2.0 ** (torch.floor(torch.log2(q.abs().amax(-1, keepdim=True))) - 2)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert torch.isin((q4 / scale).abs(), grid).all()


def test_straight_through_gradients():
    a = torch.randn(3, 6, 32, requires_grad=True)
    b = torch.randn(3, 32, 5, requires_grad=True)
    out = quant_bmm(a, b, "hifp8")
    g = torch.randn_like(out)
    out.backward(g)
    qa, qb = fake_quant(a.detach(), "hifp8"), fake_quant(b.detach(), "hifp8")
    assert torch.equal(out.detach(), torch.bmm(qa, qb))
    assert torch.allclose(a.grad, g @ qb.transpose(1, 2))
    assert torch.allclose(b.grad, qa.transpose(1, 2) @ g)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown quantization format 'fp8'"):
        fake_quant(torch.ones(2), "fp8")


def test_an_unknown_or_half_declared_format_is_refused_at_every_entry_point(monkeypatch, run):
    """One sentence naming the value, never another format's result: ``fake_quant``, the
    products, the quantizer beneath them, ``set`` and ``tensors formats``; a name added to
    ``FORMATS`` without a spec entry (which once returned hifp8's result) and an entry whose
    fields do not make a format are refused too."""
    from quantpatch.runtime import quantpatch_formats as formats
    from quantpatch.runtime import quantpatch_ops as ops
    from quantpatch.runtime import quantpatch_quantize as qq

    x = torch.randn(4, 64)
    calls = {
        "fake_quant": lambda f: fake_quant(x, f),
        "quant_matmul": lambda f: quant_matmul(x, x.t(), f),
        "quant_bmm": lambda f: quant_bmm(x[None], x.t()[None], f),
        "quant_baddbmm": lambda f: quant_baddbmm(x[None], x[None], x.t()[None], beta=0, fmt=f),
        "quantize": lambda f: qq.quantize(x, f),
    }
    monkeypatch.setattr(ops, "FORMATS", (*ops.FORMATS, "mxfp6"))  # half declared: no entry
    for name, call in calls.items():
        for fmt in ("nope", "mxfp6"):
            with pytest.raises(ValueError, match=f"unknown quantization format '{fmt}'"):
                call(fmt)
                pytest.fail(f"{name} computed {fmt!r}")
    for entry in (
        dict(name="mxfp6", family="mx"),  # no elements, no block, no scale rule
        dict(name="mxfp6", family="mx", input="e2m3", weight="e2m3", grad_output="e2m3"),
        dict(name="fp7", family="fp7"),
        dict(name="x", family="mx", input="e2m3", weight="e2m3", grad_output="e2m3",
             block=(1, 32), scale="e8m0-floor"),  # no summary: half declared
    ):  # fmt: skip
        with pytest.raises(ValueError, match="is declared incompletely"):
            formats.Format(**entry)
    for argv in (("set", "--linear", "nope"), ("tensors", "formats", ".", "--formats", "nope")):
        res = run(*argv)
        assert res.code == 2 and "unknown" in res.err and "'nope'" in res.err, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_matches_cpu():  # pragma: no cover - runs on a GPU machine
    x = torch.randn(64, 256) * 100
    for fmt in ("mxfp8", "mxfp4", "hifp8"):
        assert torch.equal(fake_quant(x.cuda(), fmt).cpu(), fake_quant(x, fmt))


@pytest.mark.slow  # 23 s of torch.compile
def test_compiled_path_is_bit_identical(tmp_path):
    """QUANTPATCH_COMPILE=1 (torch.compile) gives exactly the eager results."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from quantpatch.runtime import quantpatch_ops as ops\n"
        "from quantpatch.runtime import quantpatch_quantize as qz\n"
        "assert qz._COMPILE\n"
        "torch.manual_seed(0)\n"
        "x = (torch.randn(64, 96) * torch.logspace(-8, 8, 96)).to(torch.bfloat16)\n"
        "x[0, 3] = float('nan')\n"
        "for fmt in ('mxfp8', 'hifp8'):\n"
        "    a = qz._fake_quant(x, fmt, -1, False)\n"
        "    b = ops.fake_quant(x, fmt)\n"
        "    assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), fmt\n"
        "print('EQUAL')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "QUANTPATCH_COMPILE": "1"},
        timeout=600,
    )
    assert "EQUAL" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize(
    ("fmt", "backward"), [("mxfp8", False), ("mxfp4", False), ("hifp8", False)]
)
def test_large_cpu_tensors_are_sliced_bit_identically(fmt, backward):
    """Above 2 x 2^18 elements the CPU path works slice by slice; it must equal the whole."""
    from quantpatch.runtime import quantpatch_quantize as qz

    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(700, 1000, generator=gen) * 4).to(torch.bfloat16)
    assert x.numel() > 2 * qz._CHUNK
    for t, dim in ((x, -1), (x, 0), (x.reshape(-1), 0), (x.t(), -1)):
        whole = qz._whole(t, fmt, dim, backward)
        assert torch.equal(
            qz._fake_quant(t, fmt, dim, backward).view(torch.int16), whole.view(torch.int16)
        )
