"""The fused Triton kernels against the PyTorch reference, bit for bit.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before the
kernels module is imported) on CPU tensors; with one, on CUDA tensors. The reference is itself
checked against ml_dtypes and the HiF8 table in ``test_quant_ops.py``, so equality here is
equality with the oracles. NaN lanes are compared as NaN (the kernels keep the input's NaN
payload; the reference's dtype round trip may canonicalise it); every other lane by its bits.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
np = pytest.importorskip("numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")

from quantpatch.runtime import quantpatch_formats as formats  # noqa: E402
from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_quantize as qz  # noqa: E402

# numpy (the interpreter) warns of overflow in lanes the kernels compute and then discard
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
MX = [  # every OCP (FLOOR rule) MX value of the spec, in both directions
    (f.name, backward)
    for f in formats.SPECS
    if f.family == "mx" and f.scale == "e8m0-floor"
    for backward in (False, True)
]
ML_DTYPES = {  # the spec's element types as ml_dtypes names them (the oracle's own tables)
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def kernels():
    """The kernels module: on a GPU, compiled; without one, run by Triton's interpreter
    (``conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports triton)."""
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy overflow in discarded lanes
        yield importlib.import_module("quantpatch.runtime.quantpatch_kernels")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype
    g, r = got.detach().cpu(), ref.detach().cpu()
    nan_g, nan_r = torch.isnan(g), torch.isnan(r)
    assert torch.equal(nan_g, nan_r), "NaN in different places"
    same = _bits(g) == _bits(r)
    bad = ~(same | nan_g)
    if bool(bad.any()):
        where = bad.nonzero()[:5].tolist()
        pairs = [(g[tuple(i)].item(), r[tuple(i)].item()) for i in where]
        raise AssertionError(f"{int(bad.sum())} lanes differ, e.g. (kernel, reference) {pairs}")


def check(kernels, x: torch.Tensor, fmt: str, dim: int = -1, backward: bool = False) -> None:
    x = x.to(DEVICE)
    got = kernels.fake_quant(x, fmt, dim, backward)
    ref = qz._fake_quant(x, fmt, dim, backward)
    assert_same(got, ref)


# -- the oracle set -----------------------------------------------------------------------------


def _element(fmt: str, backward: bool) -> str:
    spec = formats.SPEC[fmt]
    return str(spec.grad_output if backward else spec.input)


def _element_grid(fmt: str, backward: bool) -> np.ndarray:
    """Every finite value of the element type, every midpoint, and a neighbour either side."""
    dtype = ML_DTYPES[_element(fmt, backward)]
    vals = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)  # bits beyond: ignored
    vals = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    mids = (vals[1:] + vals[:-1]) / 2
    vals = np.concatenate([vals, mids, mids * (1 + 2**-12), mids * (1 - 2**-12), [vals[-1] * 1.2]])
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize(("fmt", "backward"), MX)
def test_mx_every_code_midpoint_and_tie_at_every_kind_of_scale(kernels, fmt, backward):
    emax = formats.ELEMENTS[_element(fmt, backward)].emax
    grid = _element_grid(fmt, backward)
    pad = (-len(grid)) % 31
    rows = np.concatenate([grid, np.zeros(pad)]).reshape(-1, 31)
    blocks = []
    # the scale pinned by an anchor in the top binade: 1, tiny (E8M0 floor, subnormal fp32),
    # huge (near the float32 maximum)
    for shared in (0, -127, -120, 100, 127 - emax - 1):
        anchor = np.full((rows.shape[0], 1), 2.0 ** (shared + emax))
        blocks.append(np.concatenate([rows * 2.0**shared, anchor], axis=1))
    x = torch.tensor(np.concatenate(blocks), dtype=torch.float32)
    check(kernels, x, fmt, backward=backward)
    check(kernels, x.t().contiguous(), fmt, dim=0, backward=backward)


@pytest.mark.parametrize(("fmt", "backward"), MX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mx_random_magnitudes_specials_and_zero_blocks(kernels, fmt, backward, dtype):
    gen = torch.Generator().manual_seed(7)
    mags = torch.exp2(torch.randint(-60, 60, (24, 4, 1), generator=gen).float())
    x = (torch.randn(24, 4, 32, generator=gen) * mags).reshape(24, 128)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 3], x[2, 40], x[3, 70] = float("nan"), float("inf"), -float("inf")
    x[4, :32] = float("nan")  # a block of NaN only
    x[5, 9] = -0.0
    x = x.to(dtype)
    check(kernels, x, fmt, backward=backward)
    check(kernels, x, fmt, dim=0, backward=backward)


@pytest.mark.parametrize("n", [1, 31, 33, 45, 100])
def test_mx_reduction_lengths_not_a_multiple_of_32(kernels, n):
    x = torch.randn(6, n, generator=torch.Generator().manual_seed(n)) * 5
    for fmt, backward in MX[:3]:
        check(kernels, x, fmt, backward=backward)
        check(kernels, x, fmt, dim=0, backward=backward)


def test_mx_batches_and_strided_inputs(kernels):
    gen = torch.Generator().manual_seed(3)
    x3 = torch.randn(3, 40, 50, generator=gen).to(torch.bfloat16)
    for dim in (0, 1, 2, -1):
        check(kernels, x3, "mxfp8", dim=dim)
    # Megatron's key operand: [sk, b*np, hn] -> transpose(0, 1).transpose(1, 2), reduced along hn
    key = torch.randn(24, 6, 64, generator=gen).to(torch.bfloat16)
    check(kernels, key.transpose(0, 1).transpose(1, 2), "mxfp8", dim=-2)
    check(kernels, torch.randn(2, 3, 4, 33, generator=gen), "mxfp4", dim=2)
    check(kernels, torch.randn(2, 3, 8, 70, generator=gen)[:, :, ::2], "mxfp8")  # not dense
    check(kernels, torch.randn(70, generator=gen).expand(3, 70), "mxfp8")  # overlapping
    check(kernels, torch.tensor(3.3), "mxfp8")  # 0-d


def test_mx_output_keeps_the_input_layout_and_dtype(kernels):
    x = torch.randn(64, 96, dtype=torch.bfloat16).to(DEVICE).t()
    y = kernels.fake_quant(x, "mxfp8", 0, False)
    assert y.dtype == x.dtype and y.stride() == x.stride()


# -- HiF8 -------------------------------------------------------------------------------------


def _hif8_values() -> np.ndarray:
    """Every finite HiF8 magnitude from the definition, midpoints, neighbours, and the edges."""
    vals = [0.0]
    for e in range(-15, 16):
        m = 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1
        vals += [2.0**e * (1 + k / 2**m) for k in range(2**m)]
    vals += [2.0**e for e in range(-22, -15)]
    v = np.unique(np.array(vals))
    v = v[v <= 2.0**15]
    mids = (v[1:] + v[:-1]) / 2
    edges = [2.0**-23, 2.0**-23 * (1 - 2**-20), 2.0**-24, 2.0**15 * 1.5, 2.0**16, 3e38, 1e-40]
    out = np.concatenate([v, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), edges])
    return np.concatenate([out, -out])


@pytest.mark.parametrize("dtype", DTYPES)
def test_hifp8_every_code_midpoint_and_edge(kernels, dtype):
    x = torch.tensor(_hif8_values(), dtype=torch.float32)
    x = torch.cat([x, torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])])
    check(kernels, x.to(dtype), "hifp8")


def test_hifp8_log_uniform_and_layouts(kernels):
    gen = torch.Generator().manual_seed(11)
    x = torch.exp2(torch.rand(20_000, generator=gen) * 80 - 50)
    x = x * torch.where(torch.rand(20_000, generator=gen) < 0.5, -1.0, 1.0)
    check(kernels, x, "hifp8")
    m = x[: 100 * 150].reshape(100, 150)
    check(kernels, m.t(), "hifp8")  # transposed: walked in storage order
    check(kernels, m[:, ::3], "hifp8")  # not dense


# -- the dispatch in quantpatch_ops -------------------------------------------------------------


def test_quant_products_through_the_kernels(kernels, monkeypatch):
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    monkeypatch.setattr(qz, "_kernels_module", kernels)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(4, 16, 64, generator=gen).to(DEVICE)
    b = torch.randn(4, 64, 24, generator=gen).to(DEVICE)
    buffer = torch.full((4, 16, 24), float("nan"), device=DEVICE)  # never read with beta=0
    for fmt in ("mxfp8", "mxfp4", "hifp8"):
        got = ops.quant_baddbmm(buffer, a, b, beta=0.0, alpha=0.5, fmt=fmt)
        assert torch.isfinite(got).all()
        monkeypatch.setenv("QUANTPATCH_KERNELS", "reference")
        ref = ops.quant_baddbmm(buffer, a, b, beta=0.0, alpha=0.5, fmt=fmt)
        monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
        assert_same(got, ref)
        w = torch.randn(64, 40, generator=gen).to(DEVICE)
        assert_same(ops.quant_matmul(a[0], w, fmt), _reference(ops.quant_matmul, a[0], w, fmt))
        assert_same(ops.quant_bmm(a, b, fmt), _reference(ops.quant_bmm, a, b, fmt))


def _reference(op, *args):
    saved = os.environ.get("QUANTPATCH_KERNELS")
    os.environ["QUANTPATCH_KERNELS"] = "reference"
    try:
        return op(*args)
    finally:
        os.environ["QUANTPATCH_KERNELS"] = saved or "auto"


def test_straight_through_gradient_through_the_kernels(kernels, monkeypatch):
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    monkeypatch.setattr(qz, "_kernels_module", kernels)
    a = torch.randn(8, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(64, 8, device=DEVICE, requires_grad=True)
    ops.quant_matmul(a, w, "mxfp8").sum().backward()
    assert a.grad is not None and torch.isfinite(a.grad).all()


def test_forced_kernels_refuse_cpu_tensors_they_cannot_read(monkeypatch):
    """Compiled (not interpreted) Triton reads GPU memory only: a CPU tensor forced onto the
    kernels is refused in one sentence, not handed to the launcher (which failed on an H100
    with "Pointer argument (at 0) cannot be accessed from Triton")."""
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="compiled Triton kernels run on CUDA tensors only"):
        ops.fake_quant(torch.randn(4, 64), "mxfp8")
    assert ops.kernels_in_use("cpu").startswith("none (QUANTPATCH_KERNELS=triton refuses")
    monkeypatch.setenv("QUANTPATCH_KERNELS", "auto")  # auto: CPU tensors take the reference
    x = torch.randn(4, 64)
    assert torch.equal(ops.fake_quant(x, "mxfp8"), qz._fake_quant(x, "mxfp8", -1, False))


def test_the_kernel_path_is_announced_once_with_why(monkeypatch, capsys):
    """Which code quantizes CUDA tensors is printed once per process on rank 0, as the
    attention path is: a Triton import that failed says its error instead of falling back to
    the reference in silence."""
    monkeypatch.setenv("QUANTPATCH_KERNELS", "auto")
    monkeypatch.setattr(qz, "_kernels_said", [])
    monkeypatch.setattr(qz, "_kernels_module", None)
    monkeypatch.setattr(qz, "_kernels_error", "ImportError: No module named 'triton'")
    qz.say_kernels("cuda")
    qz.say_kernels("cuda")
    line = qz.KERNELS_PATH_LINE + "reference (no Triton kernels: ImportError: No module named "
    assert capsys.readouterr().err == line + "'triton')\n"
    monkeypatch.setattr(qz, "_kernels_said", [])
    monkeypatch.setenv("RANK", "1")  # other ranks say nothing
    qz.say_kernels("cuda")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(qz, "_kernels_module", object())
    qz.say_kernels("cuda")
    assert capsys.readouterr().err == qz.KERNELS_PATH_LINE + "triton\n"


def test_kernel_mode_switch_and_fallback(monkeypatch):
    x = torch.randn(4, 64)
    monkeypatch.setenv("QUANTPATCH_KERNELS", "reference")
    assert ops.kernels_in_use() == "reference (QUANTPATCH_KERNELS=reference)"
    assert torch.equal(ops.fake_quant(x, "mxfp8"), qz._fake_quant(x, "mxfp8", -1, False))
    monkeypatch.setenv("QUANTPATCH_KERNELS", "fast")
    with pytest.raises(ValueError, match="QUANTPATCH_KERNELS='fast'"):
        ops.fake_quant(x, "mxfp8")
    # auto on a CPU tensor: the reference, whatever the kernels' state
    monkeypatch.setenv("QUANTPATCH_KERNELS", "auto")
    assert torch.equal(ops.fake_quant(x, "hifp8"), qz._fake_quant(x, "hifp8", -1, False))
    # no importable kernels: auto falls back and says why; triton refuses
    monkeypatch.setattr(qz, "_kernels_module", None)
    monkeypatch.setattr(qz, "_kernels_error", "ModuleNotFoundError: No module named 'triton'")
    assert ops.kernels_in_use() == "reference (no Triton kernels: " + qz._kernels_error + ")"
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="No module named 'triton'"):
        ops.fake_quant(x, "mxfp8")


def test_empty_tensors(kernels):
    for shape in ((0, 32), (0,), (4, 0)):
        x = torch.empty(shape)
        for fmt in ("mxfp8", "mxfp4", "hifp8"):
            assert kernels.fake_quant(x.to(DEVICE), fmt).shape == x.shape
            assert ops.fake_quant(x, fmt).shape == x.shape


def test_one_launch_and_no_copy_per_call(kernels, monkeypatch):
    """One kernel per call and no hidden copy of the input, for the layouts Megatron passes
    (rows, a weight reduced along its first dimension, the transposed key): the output is the
    only allocation, with the input's strides."""
    launches = []
    for name in ("_mx_kernel", "_hifp8_kernel"):
        real = getattr(kernels, name)

        class Counting:
            def __init__(self, real=real, name=name):
                self.real, self.name = real, name

            def __getitem__(self, grid):
                launches.append(self.name)
                return self.real[grid]

        monkeypatch.setattr(kernels, name, Counting())
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(24, 6, 64, generator=gen).to(torch.bfloat16)
    cases = [
        (torch.randn(16, 96, generator=gen), -1),
        (torch.randn(96, 16, generator=gen), 0),
        (key.transpose(0, 1).transpose(1, 2), -2),
    ]
    for x, dim in cases:
        x = x.to(DEVICE)
        for fmt in ("mxfp8", "mxfp4", "hifp8"):
            launches.clear()
            same, _, _ = kernels._as_3d(x, dim % x.dim())
            assert same is x  # read in place
            y = kernels.fake_quant(x, fmt, dim, False)
            assert launches == ["_hifp8_kernel" if fmt == "hifp8" else "_mx_kernel"]
            assert y.stride() == x.stride()


# -- NVFP4 ------------------------------------------------------------------------------------

NV = ["nvfp4", "nvfp4-2d"]


def check_nv(
    kernels,
    x: torch.Tensor,
    fmt: str,
    dim: int = -1,
    backward: bool = False,
    rand: torch.Tensor | None = None,
) -> None:
    """The kernel against the reference, given the same random bits (8 per element) when
    rounding stochastically."""
    x = x.to(DEVICE)
    if rand is None:
        gen = torch.Generator().manual_seed(x.numel())
        rand = torch.randint(0, 256, x.shape, generator=gen, dtype=torch.uint8)
    rand = rand.to(DEVICE)
    got = kernels.fake_quant(x, fmt, dim, backward, rand)
    ref = qz._fake_quant(x, fmt, dim, backward, rand)
    assert_same(got, ref)


def _nv_blocks(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.randint(-30, 30, (*shape[:-1], 1), generator=gen).float())
    return torch.randn(*shape, generator=gen) * mags


@pytest.mark.parametrize("fmt", NV)
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_random_magnitudes_specials_and_zero_blocks(kernels, fmt, backward, dtype):
    x = _nv_blocks((40, 48), 3)
    x[0, :16] = 0.0  # an all-zero block
    x[1, 3], x[2, 40], x[3, 20] = float("nan"), float("inf"), -float("inf")
    x[20:36, 16:32] = float("nan")  # a tile of NaN only
    x[5, 9] = -0.0
    x[6, :16] *= 2.0**-40  # blocks whose E4M3 scale flushes to 0 or is subnormal
    x[7, :16] *= 2.0**-12
    x = x.to(dtype)
    check_nv(kernels, x, fmt, backward=backward)
    check_nv(kernels, x, fmt, dim=0, backward=backward)
    check_nv(kernels, x.t(), fmt, dim=0, backward=backward)  # strided: read in place


@pytest.mark.parametrize("fmt", NV)
def test_nvfp4_shapes_scalars_and_zero_tensors(kernels, fmt):
    for backward in (False, True):
        check_nv(kernels, _nv_blocks((2, 3, 37), 4), fmt, backward=backward)
        check_nv(kernels, _nv_blocks((3, 21, 5), 5), fmt, dim=1, backward=backward)
        check_nv(kernels, _nv_blocks((7,), 6), fmt, backward=backward)
        check_nv(kernels, torch.tensor(-3.5), fmt, backward=backward)
        check_nv(kernels, torch.zeros(4, 32), fmt, backward=backward)
        check_nv(kernels, _nv_blocks((4, 32), 7) * 2.0**-130, fmt, backward=backward)


def test_nvfp4_through_ops_draws_the_same_bits_on_either_path(kernels, monkeypatch):
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    monkeypatch.setattr(qz, "_kernels_module", kernels)
    x = _nv_blocks((16, 64), 8).to(DEVICE)
    weight = torch.nn.Parameter(_nv_blocks((24, 64), 9).to(DEVICE))
    for fmt in NV:
        ops.reset_sr_generators()
        got = ops.fake_quant(x, fmt, backward=True)
        with torch.no_grad():
            prod = ops.quant_matmul(x, weight.t(), fmt)
        ops.reset_sr_generators()
        assert_same(got, _reference(functools.partial(ops.fake_quant, backward=True), x, fmt))
        with torch.no_grad():
            assert_same(prod, _reference(ops.quant_matmul, x, weight.t(), fmt))


def test_nvfp4_stochastic_rounding_at_bits_equal_to_the_threshold(kernels):
    """Rows [6, every E2M1 midpoint, a fraction 2^-9]: p = x, the fraction 1/2 (threshold
    floor(256 / 2) = 128); bits 128 (not below it: rounded down), 0 (up) and 127 (up); the
    fraction 2^-9 < 1/256 never goes up."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.125, 5.5])
    row = torch.cat([torch.tensor([6.0]), mids, -mids[:5], torch.tensor([1.0 + 2.0**-10])])
    x = row.expand(3, 16).contiguous()
    rand = torch.tensor([[128], [0], [127]], dtype=torch.uint8).expand(3, 16)
    for fmt in NV:
        check_nv(kernels, x, fmt, backward=True, rand=rand)
        got = kernels.fake_quant(x.to(DEVICE), fmt, -1, True, rand.to(DEVICE)).cpu()
        assert got[0, 2].item() == 0.5 and got[1, 2].item() == 1.0 and got[2, 2].item() == 1.0
        assert got[:, 15].tolist() == [1.0, 1.0, 1.0]
