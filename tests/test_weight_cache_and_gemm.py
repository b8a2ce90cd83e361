"""On CPU: weights quantized once per optimizer step (the weight cache of
``quantpatch_ops``), the autotuned fake-quant kernels' every configuration, and the quantized
GEMM (operands quantized in its tile loop) with its per-shape dispatch.

The kernels run in Triton's interpreter (``conftest.py`` sets ``TRITON_INTERPRET=1`` without
a GPU), bit for bit against the PyTorch reference where the arithmetic is the same, and within
the float32 accumulation-order bound where only the order of the GEMM's sums differs.
"""

from __future__ import annotations

import gc
import importlib
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_quantize as qz  # noqa: E402
from quantpatch.runtime import quantpatch_weights as wc  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.delenv("QUANTPATCH_WEIGHT_CACHE", raising=False)
    monkeypatch.delenv("QUANTPATCH_WEIGHT_CACHE_MB", raising=False)
    monkeypatch.delenv("QUANTPATCH_GEMM", raising=False)
    ops.weight_cache_clear()
    ops.weight_cache_reset_stats()
    yield
    ops.weight_cache_clear()
    ops.weight_cache_reset_stats()


@pytest.fixture(scope="module")
def gemm(kernels):
    return importlib.import_module("quantpatch.runtime.quantpatch_gemm_kernels")


@pytest.fixture(scope="module")
def kernels():
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield importlib.import_module("quantpatch.runtime.quantpatch_kernels")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


# -- weights quantized once per optimizer step ---------------------------------------------------


class _MegatronLinear(torch.autograd.Function):
    """The three GEMMs of Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` as
    ``quantpatch init`` rewrites them: forward ``x @ weight.t()``, dgrad ``gy @ weight`` and
    wgrad ``gy.t() @ x`` (both with ``backward=True``), inside a custom autograd function."""

    @staticmethod
    def forward(ctx, x, weight, fmt):
        ctx.save_for_backward(x, weight)
        ctx.fmt = fmt
        return ops.quant_matmul(x, weight.t(), fmt)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        dgrad = ops.quant_matmul(gy, weight, ctx.fmt, backward=True)
        g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
        wgrad = ops.quant_matmul(g2.t(), x2, ctx.fmt, backward=True)
        return dgrad, wgrad, None


def _weights() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.nn.Parameter((torch.randn(96, 64, generator=gen) * 0.1).to(torch.bfloat16)),
        torch.nn.Parameter((torch.randn(64, 96, generator=gen) * 0.1).to(torch.bfloat16)),
    ]


def _step(weights, micro_batches, fmt, seed):
    """k micro-batches of a two-layer stack with gradient accumulation, then one SGD step;
    every output, input gradient and weight gradient returned."""
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(micro_batches):
        x = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16).requires_grad_()
        h = _MegatronLinear.apply(x, weights[0], fmt)
        y = _MegatronLinear.apply(h, weights[1], fmt)
        y.float().square().sum().backward()
        outs += [y.detach(), x.grad]
    outs += [w.grad.clone() for w in weights]
    held = ops.weight_cache_stats()["bytes"]
    torch.optim.SGD(weights, lr=0.5).step()
    for w in weights:
        w.grad = None
    return outs, held


def _count_weight_quantizations(monkeypatch, weights) -> list[tuple[int, str, bool]]:
    """Every quantization of a weight's storage, as (which weight, format, backward)."""
    seen: list[tuple[int, str, bool]] = []

    def spying(real):
        def spy(x, fmt, *, dim=-1, backward=False):
            for i, w in enumerate(weights):
                if x.data_ptr() == w.data_ptr():
                    seen.append((i, fmt, backward))
            return real(x, fmt, dim=dim, backward=backward)

        return spy

    # what the weight cache quantizes with (bf16 NVFP4 and FP8 tensor scaling: factored)
    monkeypatch.setattr(wc, "quantize", spying(wc.quantize))
    monkeypatch.setattr(wc, "quantize_factored", spying(wc.quantize_factored))
    return seen


@pytest.mark.parametrize("fmt", ["mxfp8", "hifp8", "nvfp4-2d"])
def test_gradient_accumulation_quantizes_each_weight_once_per_step(monkeypatch, fmt):
    """4 micro-batches, 2 steps: each weight is quantized once per step for the forward and
    once for dgrad (8 quantizations per step without the cache), with bit-identical outputs,
    input gradients and weight gradients, the optimizer step invalidating the cache."""
    k = 4
    results = {}
    for cache in ("1", "0"):
        monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", cache)
        ops.reset_sr_generators()
        weights = _weights()
        per_step, held = [], []
        out = []
        with monkeypatch.context() as m:
            seen = _count_weight_quantizations(m, weights)
            for step in range(2):
                before = len(seen)
                outs, nbytes = _step(weights, k, fmt, seed=step)
                out += outs
                held.append(nbytes)
                per_step.append(sorted(seen[before:]))
        results[cache] = out
        dgrad_bw = fmt not in ops.NVFP4_FORMATS  # NVFP4 rounds the weight to nearest even
        both = sorted((i, fmt, bw) for i in (0, 1) for bw in (False, dgrad_bw))
        if cache == "1":
            # MX: one quantization for the forward, one for dgrad; HiF8 and nvfp4-2d quantize
            # a weight alike for both: once
            once = both if fmt == "mxfp8" else [(0, fmt, False), (1, fmt, False)]
            assert per_step == [once, once]
            stats = ops.weight_cache_stats()
            lookups = 2 * 2 * 2 * k  # steps x weights x (forward, dgrad) x micro-batches
            assert stats["misses"] == 2 * len(once) and stats["hits"] == lookups - 2 * len(once)
            # the bytes held before each optimizer step: one weight's bytes per quantization
            assert held == [sum(w.numel() * 2 for w in weights) * len(once) // 2] * 2
            assert stats["bytes"] == 0  # the last step emptied the cache
        else:
            assert per_step == [sorted(both * k)] * 2
    assert len(results["1"]) == len(results["0"])
    for got, want in zip(results["1"], results["0"], strict=True):
        assert same_bits(got, want)


MEGATRON_PROBE = """
import inspect, os, sys, torch
from megatron.core.quantpatch import quantpatch_ops as ops
from megatron.core.quantpatch import quantpatch_weights as wc
from megatron.core.tensor_parallel.layers import (
    LinearWithGradAccumulationAndAsyncCommunication as Linear,
)

out, k = sys.argv[1], int(sys.argv[2])
gen = torch.Generator().manual_seed(0)
w = torch.nn.Parameter((torch.randn(80, 96, generator=gen) * 96**-0.5).to(torch.bfloat16))
values = {
    "bias": None, "gradient_accumulation_fusion": False, "allreduce_dgrad": False,
    "async_grad_allreduce": False, "sequence_parallel": False, "grad_output_buffer": None,
    "wgrad_deferral_limit": 0, "tp_group": None,
}
names = list(inspect.signature(Linear.forward).parameters)[3:]
seen = []
real = wc.quantize  # what the weight cache quantizes with

def spy(x, fmt, *, dim=-1, backward=False):
    if x.data_ptr() == w.data_ptr():
        seen.append(backward)
    return real(x, fmt, dim=dim, backward=backward)

wc.quantize = spy
saved = {}
w0 = w.detach().clone()
for cache in ("1", "0"):
    os.environ["QUANTPATCH_WEIGHT_CACHE"] = cache
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w.copy_(w0)
    results, per_step = [], []
    for step in range(2):
        for _ in range(k):
            x = torch.randn(16, 2, 96, generator=gen).to(torch.bfloat16).requires_grad_()
            y = Linear.apply(x, w, *(values[n] for n in names))
            y.float().square().sum().backward()
            results += [y.detach(), x.grad]
        results.append(w.grad.clone())
        per_step.append(sorted(seen))
        seen.clear()
        torch.optim.SGD([w], lr=0.1).step()
        w.grad = None
    saved[cache] = {"results": results, "per_step": per_step, "stats": ops.weight_cache_stats()}
torch.save(saved, out)
"""


@pytest.mark.slow
def test_megatron_linear_layer_quantizes_its_weight_once_per_step(run, make_checkout, tmp_path):
    """The real linear autograd function of an initialised megatron-core 0.13.1 checkout under
    ``set --linear mxfp8``: 3 micro-batches of gradient accumulation, 2 SGD steps; with the
    cache the weight is quantized once per step for the forward (E4M3) and once for dgrad
    (E5M2), without it 3 times each; outputs and gradients bit-identical."""
    from .conftest import run_probe

    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, "--linear", "mxfp8", "--no-branch").code == 0
    probe = tmp_path / "probe.py"
    probe.write_text(MEGATRON_PROBE)
    saved = run_probe(probe, root, tmp_path / "out.pt", "3")[0]
    on, off = saved["1"], saved["0"]
    assert on["per_step"] == [[False, True]] * 2
    assert off["per_step"] == [[False] * 3 + [True] * 3] * 2
    assert on["stats"]["hits"] == 2 * 2 * 2 and on["stats"]["hit_ratio"] == pytest.approx(2 / 3)
    assert len(on["results"]) == len(off["results"]) == 2 * (2 * 3 + 1)
    for got, want in zip(on["results"], off["results"], strict=True):
        assert same_bits(got, want)


@pytest.mark.parametrize("fmt", ["mxfp8", "hifp8"])  # per view, and one entry for both views
def test_cache_is_never_stale(monkeypatch, fmt):
    """Every way a weight changes makes the next lookup miss and quantize the new values."""
    w = torch.nn.Parameter(torch.randn(64, 96, dtype=torch.bfloat16))
    x = torch.randn(8, 96, dtype=torch.bfloat16)

    def product():
        with torch.no_grad():
            return ops.quant_matmul(x, w.t(), fmt)

    def fresh():
        monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", "0")
        try:
            return product()
        finally:
            monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", "1")

    first = product()
    assert same_bits(product(), first) and ops.weight_cache_stats()["hits"] == 1

    def changed(mutate, counter="stale"):
        before = ops.weight_cache_stats()[counter]
        mutate()
        got = product()
        assert ops.weight_cache_stats()[counter] == before + 1, counter
        assert same_bits(got, fresh())
        hits = ops.weight_cache_stats()["hits"]
        assert same_bits(product(), got) and ops.weight_cache_stats()["hits"] == hits + 1

    with torch.no_grad():
        changed(lambda: w.add_(0.25))  # in place: the version counter
        changed(lambda: w.copy_(torch.randn(64, 96)))
        changed(lambda: w.t().mul_(2.0))  # through a view: the counter is shared
    changed(lambda: setattr(w, "data", torch.randn(64, 96, dtype=torch.bfloat16)))  # storage

    def optimizer_step():
        w.grad = torch.ones_like(w)
        torch.optim.Adam([w], lr=0.1).step()

    changed(optimizer_step, "misses")  # the step hook emptied the cache
    assert ops.weight_cache_stats()["generation"] >= 2

    # a write that bypasses the version counter (Megatron copies main params through .data):
    # the optimizer's hook catches it at a step; outside one, weight_cache_clear()
    def raw_write():
        w.data.copy_(torch.randn(64, 96))
        ops.weight_cache_clear()

    changed(raw_write, "misses")

    # a write into what the cache handed out is seen too
    with torch.no_grad():
        alias = ops._cached_q(w.t(), fmt, -2, False)
        alias.zero_()
    assert same_bits(product(), fresh())


def test_straight_through_gradient_reaches_the_weight(monkeypatch):
    grads = {}
    for cache in ("1", "0"):
        monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", cache)
        gen = torch.Generator().manual_seed(4)
        w = torch.nn.Parameter(torch.randn(40, 64, generator=torch.Generator().manual_seed(2)))
        x = torch.randn(3, 16, 64, generator=gen)
        for _ in range(3):
            ops.quant_matmul(x, w.t(), "mxfp4").sum().backward()
        grads[cache] = w.grad
    assert grads["1"].abs().sum() > 0 and same_bits(grads["1"], grads["0"])
    assert ops.weight_cache_stats()["hits"] == 2


def test_nvfp4_stochastic_rounding_draws_the_same_bits_with_the_cache(monkeypatch):
    """A weight rounded stochastically (the first operand under ``backward``) is never cached
    (a hit would skip the generator's draws); as the second operand it keeps nearest even and
    is cached, and the other operand's draws are the same with or without the cache."""
    w = torch.nn.Parameter(torch.randn(32, 48))
    g = torch.randn(32, 24)
    out = {}
    for cache in ("1", "0"):
        monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", cache)
        ops.reset_sr_generators()
        ops.weight_cache_reset_stats()
        with torch.no_grad():
            out[cache] = [
                ops.quant_matmul(w, w.t(), "nvfp4", backward=True),
                ops.quant_matmul(g.t(), w, "nvfp4", backward=True),
                ops.quant_matmul(w, w.t(), "nvfp4", backward=True),
                ops.quant_matmul(g.t(), w, "nvfp4", backward=True),
            ]
        if cache == "1":
            stats = ops.weight_cache_stats()
            assert stats["bypassed"] == 2 and stats["misses"] == 2 and stats["hits"] == 2
    for a, b in zip(out["1"], out["0"], strict=True):
        assert same_bits(a, b)
    assert not same_bits(out["1"][0], out["1"][2])  # fresh draws each time


def test_memory_is_bounded_reported_and_freed_with_the_weight(monkeypatch):
    w1 = torch.nn.Parameter(torch.randn(64, 64))
    w2 = torch.nn.Parameter(torch.randn(64, 64))
    one = 64 * 64 * 4
    monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE_MB", str(1.5 * one / 2**20))
    with torch.no_grad():
        ops._cached_q(w1, "mxfp8", 0, False)
        ops._cached_q(w2, "mxfp8", 0, False)  # over the cap: quantized, not kept
        again = ops._cached_q(w2, "mxfp8", 0, False)
    stats = ops.weight_cache_stats()
    assert stats["bytes"] == one and stats["weights"] == 1 and stats["entries"] == 1
    assert stats["over_cap"] == 2 and stats["cap_bytes"] == int(1.5 * one)
    assert same_bits(again, ops.fake_quant(w2.detach(), "mxfp8", dim=0))
    del w1
    gc.collect()
    assert ops.weight_cache_stats()["bytes"] == 0 and ops.weight_cache_stats()["weights"] == 0
    with torch.inference_mode():
        ops._cached_q(w2, "mxfp8", 0, False)
    assert ops.weight_cache_stats()["bypassed"] == 1
    assert ops._cached_q(w2, "bf16", 0, False) is w2
    monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", "yes")
    with pytest.raises(ValueError, match="QUANTPATCH_WEIGHT_CACHE='yes'"):
        ops._cached_q(w2, "mxfp8", 0, False)


def test_a_reused_id_of_a_collected_weight_is_not_served(monkeypatch):
    w = torch.nn.Parameter(torch.randn(32, 32))
    with torch.no_grad():
        ops._cached_q(w, "hifp8", -1, False)
    wid = id(w)
    entry = wc._WEIGHT_CACHE.entries[wid]
    other = torch.nn.Parameter(torch.randn(32, 32))
    # pretend ``other`` was allocated at the collected weight's address
    wc._WEIGHT_CACHE.entries[id(other)] = entry
    with torch.no_grad():
        got = ops._cached_q(other, "hifp8", -1, False)
    assert same_bits(got, ops.fake_quant(other.detach(), "hifp8"))
    assert wc._WEIGHT_CACHE.entries[id(other)][0]() is other


# -- the autotuned fake-quant kernels: every configuration bit for bit ---------------------------


def test_every_autotune_configuration_is_bit_exact(kernels):
    """The interpreter runs one configuration per layout; here each one of the fixed set runs
    (the raw kernel, given its tiles) and matches the reference."""
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(48, 96, generator=gen) * 30).to(torch.bfloat16)
    x[3, 7], x[5, 90] = float("nan"), -float("inf")
    x = x.to(DEVICE)
    mx_raw = kernels._mx_kernel.fn
    ran = 0
    for cfg in kernels._mx_kernel.configs:
        for t, dim in ((x, -1), (x, 0)):  # a contiguous and a strided reduction
            t3, (b, rows, n), (sb, sr, sn) = kernels._as_3d(t, dim % 2)
            if kernels.layout_of(cfg) != int(sn == 1):
                continue
            ran += 1
            y = torch.empty_like(t3)
            br, bn = cfg.kwargs["BLOCK_R"], cfg.kwargs["BLOCK_N"]
            grid = (-(-rows // br), -(-n // bn), b)
            mbits, emin, vmax, emax = kernels._ELEMENTS["e4m3"]
            mx_raw[grid](
                t3, y, rows, n, sb, sr, sn, 0,
                MBITS=mbits, EMIN=emin, VMAX=vmax, EMAX=emax, BLOCK_R=br, BLOCK_N=bn, BF16=True,
            )  # fmt: skip
            ref = qz._fake_quant(t, "mxfp8", dim, False)
            assert torch.equal(torch.isnan(y), torch.isnan(ref))
            assert same_bits(torch.nan_to_num(y), torch.nan_to_num(ref)), cfg
    assert ran == len(kernels._mx_kernel.configs)  # each configuration on its layout
    flat = x.reshape(-1)
    for cfg in kernels._hifp8_kernel.configs:
        y = torch.empty_like(flat)
        size = cfg.kwargs["BLOCK_SIZE"]
        kernels._hifp8_kernel.fn[(-(-flat.numel() // size),)](
            flat, y, flat.numel(), 0, BLOCK_SIZE=size, BF16=True
        )
        ref = qz._fake_quant(flat, "hifp8", -1, False)
        assert same_bits(torch.nan_to_num(y), torch.nan_to_num(ref)), cfg


def test_autotune_keys_and_pruning(kernels, gemm, monkeypatch):
    wide, tall = kernels.shape_class(8192, 4096, 1), kernels.shape_class(4096, 8192, 4096)
    assert wide != tall and kernels.shape_class(8000, 4000, 1) == wide
    assert kernels.shape_class(8193, 4096, 1) != wide
    configs = kernels._mx_kernel.configs
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled: every configuration of the layout
    contiguous = kernels._prune_by_layout(configs, {"sn": 1})
    strided = kernels._prune_by_layout(configs, {"sn": 64})
    assert len(contiguous) == 5 and len(strided) == 4
    assert {kernels.layout_of(c) for c in contiguous} == {1}
    tuned = gemm._qgemm_kernel.configs
    mx, tile = {"A_KIND": 1, "B_KIND": 1}, {"A_KIND": 5, "B_KIND": 6}
    bf16 = {"a_ptr": torch.empty(1, dtype=torch.bfloat16)}
    fp32 = {"a_ptr": torch.empty(1, dtype=torch.float32)}
    for cap, limit in (((9, 0), 232448), ((8, 6), 101376), ((12, 0), 101376)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert gemm.smem_limit() == limit  # no CUDA here: the generation's table entry
        for args, kinds in ((bf16, mx), (fp32, mx), (bf16, tile), (fp32, tile)):
            kept = gemm._prune_gemm(tuned, args, **kinds)
            size = args["a_ptr"].element_size()
            assert kept and all(gemm.gemm_smem(c, size) <= limit for c in kept)
            assert all(gemm.gemm_fits(c, kinds["A_KIND"], kinds["B_KIND"]) for c in kept)
            dropped = [c for c in tuned[1:] if c not in kept and gemm.gemm_fits(c, **_ab(kinds))]
            assert all(gemm.gemm_smem(c, size) > limit for c in dropped)
    # fp32 on an H100: every MX configuration fits (not the interpreter's, nor fp8-block's
    # 128-element K-tiles); on an RTX 4090 the 96 KiB ones do not
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert len(gemm._prune_gemm(tuned, fp32, **mx)) == len(tuned) - 2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    assert len(gemm._prune_gemm(tuned, fp32, **mx)) < len(gemm._prune_gemm(tuned, bf16, **mx))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # interpreted: the first that fits, no timing
    assert kernels._prune_by_layout(configs, {"sn": 64}) == strided[:1]
    assert gemm._prune_gemm(tuned, bf16, **mx) == [tuned[0]]
    assert [c.kwargs["BLOCK_K"] for c in gemm._prune_gemm(tuned, bf16, **tile)] == [128]


def _ab(kinds):
    return {"a_kind": kinds["A_KIND"], "b_kind": kinds["B_KIND"]}


# -- the quantized GEMM ---------------------------------------------------------------------------

GEMM_CASES = [  # (format, backward, dtype)
    ("mxfp8", False, torch.bfloat16),
    ("mxfp8", True, torch.float16),
    ("mxfp4", False, torch.float32),
    ("hifp8", False, torch.bfloat16),
]


def _operands(m, k, n, dtype, seed, transposed_b=True):
    gen = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())
    a = (torch.randn(m, k, generator=gen) * mags).to(dtype)
    b = torch.randn(n, k, generator=gen).to(dtype)  # a weight: [out, in], read as b.t()
    return a.to(DEVICE), (b.t() if transposed_b else b.t().contiguous()).to(DEVICE)


def _tolerance(qa, qb, out_dtype):
    """The float32 accumulation-order bound: each sum of K products may differ from another
    order by up to K * 2^-24 of the sum of the products' magnitudes (twice that, for two
    orders), plus one rounding to the output dtype of either result (half a unit in its last
    place, relative)."""
    k = qa.shape[-1]
    mag = torch.matmul(qa.double().abs(), qb.double().abs())
    half_ulp = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
    ref = torch.matmul(qa.double(), qb.double())
    return 2 * k * 2.0**-24 * mag + 2 * half_ulp[out_dtype] * ref.abs() + 1e-30, ref


@pytest.mark.parametrize(("fmt", "backward", "dtype"), GEMM_CASES)
def test_fused_gemm_quantizes_operands_bit_for_bit_and_multiplies_within_the_bound(
    kernels, gemm, fmt, backward, dtype
):
    """64 x 80 @ 80 x 96 (K not a multiple of 32, the weight read transposed in place): the
    GEMM times the identity gives each quantized operand exactly; the product is within the
    accumulation-order bound of torch.matmul of the reference-quantized operands."""
    a, b = _operands(64, 80, 96, dtype, seed=len(fmt) + backward)
    qa = qz._fake_quant(a, fmt, -1, backward)
    qb = qz._fake_quant(b, fmt, -2, backward)
    eye = torch.eye(80, dtype=dtype, device=DEVICE)
    # rows of A and columns of B quantize independently: one tile row / column of each (a
    # sum turns -0 into +0, so zeros are compared without their sign)
    got_a = gemm.quant_gemm(a[:32], eye, fmt, "bf16", backward)
    assert same_bits(got_a + 0.0, qa[:32] + 0.0)
    got_b = gemm.quant_gemm(eye, b[:, :32], "bf16", fmt, False, backward)
    assert same_bits(got_b + 0.0, qb[:, :32] + 0.0)
    got = gemm.quant_gemm(a, b, fmt, fmt, backward, backward)
    assert got.dtype == dtype and got.shape == (64, 96)
    tol, ref = _tolerance(qa, qb, dtype)
    err = (got.double() - ref).abs()
    assert bool((err <= tol).all()), float((err - tol).max())


def test_fused_gemm_batches_odd_shapes_and_specials(kernels, gemm):
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(2, 33, 45, generator=gen).to(DEVICE)
    b = torch.randn(2, 45, 17, generator=gen).to(DEVICE)
    a[0, 3, 5] = float("inf")
    b[1, 7, 2] = float("nan")
    got = gemm.quant_gemm(a, b, "mxfp4", "hifp8")
    qa, qb = qz._fake_quant(a, "mxfp4", -1, False), qz._fake_quant(b, "hifp8", -2, False)
    want = torch.bmm(qa, qb)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    tol, _ = _tolerance(torch.nan_to_num(qa, 0.0, 0.0, 0.0), torch.nan_to_num(qb, 0.0), a.dtype)
    assert bool(((got - want).abs()[fin] <= tol[fin]).all())
    # a 2-D operand is shared by the batches; K = 0 and empty outputs
    shared = gemm.quant_gemm(a, b[0], "mxfp8", "mxfp8")
    assert shared.shape == (2, 33, 17)
    assert torch.equal(gemm.quant_gemm(a[:, :, :0], b[:, :0], "mxfp8", "mxfp8"),
                       torch.zeros(2, 33, 17, device=DEVICE))  # fmt: skip
    assert gemm.quant_gemm(a[:, :0], b, "mxfp8", "mxfp8").shape == (2, 0, 17)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        gemm.quant_gemm(a, b.double(), "mxfp8", "mxfp8")
    with pytest.raises(ValueError, match="cannot multiply"):
        gemm.quant_gemm(a, a, "mxfp8", "mxfp8")
    with pytest.raises(ValueError, match="batch sizes"):
        gemm.quant_gemm(a, torch.cat([b, b, b]), "mxfp8", "mxfp8")
    with pytest.raises(ValueError, match="does not compute 'nvfp4-rht'"):
        gemm.quant_gemm(a, b, "nvfp4-rht", "mxfp8")


# every value the products quantize: (operand a's format, operand b's, a backward, b backward,
# dtype): as quant_matmul gives them (a weight b takes fp8-block's 128 x 128 or nvfp4-2d's
# 16 x 16 tiles; NVFP4 rounds a, the gradient, stochastically; the HYBRID values E5M2 for it)
EVERY_VALUE_CASES = [
    ("mxfp8-rceil", "mxfp8-rceil", True, True, torch.bfloat16),
    ("mxfp8-rceil-hybrid", "mxfp8-rceil-hybrid", True, False, torch.float16),
    ("mxfp4-rceil", "mxfp4-rceil", False, False, torch.float32),
    ("fp8-tensor", "fp8-tensor", False, False, torch.bfloat16),
    ("fp8-tensor", "fp8-tensor", True, False, torch.float32),
    ("fp8-block", "fp8-block-2d", False, False, torch.bfloat16),
    ("fp8-block", "fp8-block", False, False, torch.float16),
    ("fp8-tensor-e4m3", "fp8-tensor-e4m3", True, False, torch.bfloat16),
    ("fp8-block-hybrid", "fp8-block-2d", True, False, torch.bfloat16),
    ("fp8-block-hybrid", "fp8-block-hybrid", True, False, torch.float32),
    ("nvfp4", "nvfp4", False, False, torch.bfloat16),
    ("nvfp4", "nvfp4-2d", True, False, torch.bfloat16),
    ("nvfp4", "nvfp4", True, False, torch.float32),
    ("mxfp6-e2m3", "mxfp6-e2m3", False, False, torch.bfloat16),
    ("mxfp6-e3m2-rceil", "mxfp6-e3m2-rceil", True, True, torch.float32),
]


@pytest.mark.parametrize(("fa", "fb", "ba", "bb", "dtype"), EVERY_VALUE_CASES)
def test_fused_gemm_quantizes_every_value_bit_for_bit(kernels, gemm, fa, fb, ba, bb, dtype):
    """The fused GEMM for the RCEIL, FP8 and NVFP4 values: each operand (whole, since the
    per-tensor amax of fp8-tensor and NVFP4 is the whole operand's) times the identity is
    bit for bit the separate path's kernel output (stochastic rounding with the same random
    bits); the product is within the accumulation-order bound. K = 152: a tail that is not a
    multiple of 128 (fp8-block) or 16 (NVFP4)."""
    m, k, n = 32, 152, 40
    a, b = _operands(m, k, n, dtype, seed=len(fa) + 2 * ba)
    gen = torch.Generator().manual_seed(7)
    sr = ba and fa.startswith("nvfp4")
    rand = torch.randint(0, 256, a.shape, generator=gen, dtype=torch.uint8) if sr else None
    qa = qz._fake_quant(a, fa, -1, ba, rand)
    qb = qz._fake_quant(b, fb, -2, bb)
    got_a = gemm.quant_gemm(a, torch.eye(k, dtype=dtype), fa, "bf16", ba, False, rand)
    assert same_bits(got_a + 0.0, qa + 0.0)
    got_b = gemm.quant_gemm(torch.eye(k, dtype=dtype), b, "bf16", fb, False, bb)
    assert same_bits(got_b + 0.0, qb + 0.0)
    got = gemm.quant_gemm(a, b, fa, fb, ba, bb, rand)
    tol, ref = _tolerance(qa, qb, dtype)
    assert bool(((got.double() - ref).abs() <= tol).all())


@pytest.mark.parametrize(
    "fmt",  # 15-35 s each in the interpreter: the full suite's (the fast one checks the
    # fused GEMM's operands bit for bit: test_fused_gemm_quantizes_every_value_bit_for_bit)
    [
        pytest.param(f, marks=pytest.mark.slow)
        for f in ("mxfp8-rceil-hybrid", "fp8-tensor", "fp8-block", "fp8-block-hybrid", "nvfp4-2d")
    ],
)
def test_quant_matmul_fuses_every_value_like_the_separate_path(kernels, gemm, monkeypatch, fmt):
    """The linear layer's three GEMMs through ``quant_matmul`` with ``QUANTPATCH_GEMM=fused``:
    the same operands as ``separate`` (the weight's tiles, the gradient's E5M2 or stochastic
    rounding from the same draws), so the products agree within the accumulation bound, and
    the fused kernel ran for each."""
    monkeypatch.setattr(qz, "_kernels_module", kernels)
    monkeypatch.setenv("QUANTPATCH_KERNELS", "triton")
    monkeypatch.setenv("QUANTPATCH_WEIGHT_CACHE", "0")
    x, _ = _operands(40, 256, 8, torch.bfloat16, seed=9)
    w = torch.randn(128, 256).to(torch.bfloat16)
    g = torch.randn(40, 128).to(torch.bfloat16)
    calls = []
    real = gemm.quant_gemm
    monkeypatch.setattr(gemm, "quant_gemm", lambda *a: calls.append(a[2:4]) or real(*a))
    results = {}
    for mode in ("separate", "fused"):
        monkeypatch.setenv("QUANTPATCH_GEMM", mode)
        ops.reset_sr_generators()
        with torch.no_grad():
            results[mode] = (
                ops.quant_matmul(x, w.t(), fmt, roles=("input", "weight")),
                ops.quant_matmul(g, w, fmt, roles=("grad_output", "weight")),
                ops.quant_matmul(g.t(), x, fmt, backward=True),
            )
    weight_fmt = {"fp8-block": "fp8-block-2d", "fp8-block-hybrid": "fp8-block-2d"}.get(fmt, fmt)
    act_fmt = "nvfp4" if fmt == "nvfp4-2d" else fmt
    assert calls == [(act_fmt, weight_fmt), (act_fmt, weight_fmt), (act_fmt, act_fmt)]
    ops.reset_sr_generators()
    for sep, fused, (a, b, ba, bb, fa, fb) in zip(
        results["separate"], results["fused"],
        [(x, w.t(), False, False, act_fmt, weight_fmt), (g, w, True, False, act_fmt, weight_fmt),
         (g.t(), x, True, False, act_fmt, act_fmt)], strict=True,
    ):  # fmt: skip
        if qz.factors(fmt, a.dtype):  # code x block scale, the tensor scales on the result
            ta, sa = qz.quantize_factored(a, fa, -1, ba)  # the draws in the products' order
            tb, sb = qz.quantize_factored(b, fb, -2, bb)
            qa, qb = ta.double() * sa.double(), tb.double() * sb.double()
        else:
            qa = qz.quantize(a, fa, -1, ba)  # stochastic rounding: the draws in their order
            qb = qz.quantize(b, fb, -2, bb)
        tol, ref = _tolerance(qa, qb, torch.bfloat16)
        assert bool(((fused.double() - ref).abs() <= tol).all())
        assert bool(((sep.double() - ref).abs() <= tol).all())


def test_every_gemm_configuration_is_correct(kernels, gemm):
    a, b = _operands(40, 70, 36, torch.bfloat16, seed=3)
    qa, qb = qz._fake_quant(a, "mxfp8", -1, False), qz._fake_quant(b, "mxfp8", -2, False)
    tol, ref = _tolerance(qa, qb, torch.bfloat16)
    for cfg in gemm._qgemm_kernel.configs[1:]:  # the first ran in the test above
        c = torch.empty(1, 40, 36, dtype=torch.bfloat16, device=DEVICE)
        kw = cfg.kwargs
        grid = (-(-40 // kw["BLOCK_M"]) * -(-36 // kw["BLOCK_N"]), 1)
        mx = gemm.gemm_operand("mxfp8", False)
        gemm._qgemm_kernel.fn[grid](
            a, b, c, 40, 36, 70, 0, *a.stride(), 0, *b.stride(), *c.stride(), a, b, a, b, a,
            A_KIND=mx[0], A_MBITS=mx[1], A_EMIN=mx[2], A_VMAX=mx[3], A_EMAX=mx[4], A_SR=False,
            B_KIND=mx[0], B_MBITS=mx[1], B_EMIN=mx[2], B_VMAX=mx[3], B_EMAX=mx[4], B_SR=False,
            BF16=True, BIG=float(torch.finfo(torch.bfloat16).max), IEEE=False, UPCAST=not CUDA,
            FACTORED=False, **kw,
        )  # fmt: skip
        assert bool(((c[0].double() - ref).abs() <= tol).all()), cfg


def test_quant_matmul_dispatch(kernels, gemm, monkeypatch):
    """auto on CPU: the separate path, bit for bit as before; fused (interpreted) through
    quant_matmul / quant_bmm / quant_baddbmm with a cached weight entering pre-quantized;
    operands that need gradients and NVFP4 stay separate; the refusals."""
    monkeypatch.setattr(qz, "_kernels_module", kernels)
    a, _ = _operands(24, 64, 40, torch.bfloat16, seed=5)
    w = torch.nn.Parameter(torch.randn(40, 64).to(torch.bfloat16).to(DEVICE))
    if CUDA:  # auto would measure there: the first part is the separate path's
        monkeypatch.setenv("QUANTPATCH_GEMM", "separate")
    calls = []
    real = gemm.quant_gemm

    def spy(*args):
        calls.append(args[2:6])
        return real(*args)

    monkeypatch.setattr(gemm, "quant_gemm", spy)
    with torch.no_grad():
        separate = ops.quant_matmul(a, w.t(), "mxfp8")
        monkeypatch.setenv("QUANTPATCH_KERNELS", "reference")
        assert same_bits(ops.quant_matmul(a, w.t(), "mxfp8"), separate)
        assert calls == []  # auto on CPU never fuses
        monkeypatch.setenv("QUANTPATCH_GEMM", "fused")
        fused = ops.quant_matmul(a.reshape(2, 12, 64), w.t(), "mxfp8")
        assert calls == [("mxfp8", "bf16", False, False)]  # the weight came from the cache
        assert fused.shape == (2, 12, 40) and ops.weight_cache_stats()["hits"] == 2
        tol, _ = _tolerance(
            qz._fake_quant(a, "mxfp8", -1, False), qz._fake_quant(w.t(), "mxfp8", -2, False),
            torch.bfloat16,
        )  # fmt: skip
        assert bool(((fused.reshape(24, 40).double() - separate.double()).abs() <= tol).all())
        a3, b3 = a.reshape(2, 12, 64), torch.randn(2, 64, 8).to(torch.bfloat16).to(DEVICE)
        buffer = torch.full((2, 12, 8), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        bmm = ops.quant_bmm(a3, b3, "hifp8")
        scores = ops.quant_baddbmm(buffer, a3, b3, beta=0.0, alpha=0.5, fmt="hifp8")
        assert same_bits(scores, bmm * 0.5) and len(calls) == 3
        assert ops.quant_baddbmm(buffer, a3, b3, beta=0.0, fmt="hifp8").shape == (2, 12, 8)
        ops.quant_matmul(a, w.t(), "nvfp4")  # fused too: the amax taken before the launch
        assert calls[-1] == ("nvfp4", "bf16", False, False) and len(calls) == 5
        ops.quant_matmul(a, w.t(), "nvfp4-rht")  # the Hadamard transform first, then fused
        assert calls[-1] == ("nvfp4", "nvfp4", False, False) and len(calls) == 6
        assert wc._fused_product(a3, b3.float(), "mxfp8", False, False) is None  # dtypes
        assert wc._fused_product(a3, b3[:1], "mxfp8", False, False) is None  # batches
        assert wc._fused_product(a3, b3[:, :8], "mxfp8", False, False) is None  # K differs
        ops.quant_matmul(a3, b3[0], "mxfp8")  # an activation b: quantized in the loop
        assert calls[-1] == ("mxfp8", "mxfp8", False, False) and len(calls) == 7
    x = a.detach().requires_grad_()
    y = ops.quant_matmul(x, w.t(), "mxfp8")  # needs the quantized operands for backward
    assert len(calls) == 7 and y.grad_fn is not None
    monkeypatch.setenv("QUANTPATCH_GEMM", "auto")  # auto never fuses stochastic rounding
    monkeypatch.setattr(wc, "_auto_fuses", lambda t: True)
    assert wc._fused_product(a, w.detach().t(), "nvfp4", True, False) is None
    monkeypatch.setenv("QUANTPATCH_GEMM", "sometimes")
    with pytest.raises(ValueError, match="QUANTPATCH_GEMM='sometimes'"):
        ops.quant_matmul(a, w.t(), "mxfp8")
    monkeypatch.setenv("QUANTPATCH_GEMM", "fused")
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        cuda_only = "compiled Triton kernels run on CUDA tensors"
        with pytest.raises(RuntimeError, match=cuda_only), torch.no_grad():
            ops.quant_matmul(a, w.t(), "mxfp8")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(qz, "_kernels_module", None)
    monkeypatch.setattr(qz, "_kernels_error", "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(RuntimeError, match="No module named 'triton'"), torch.no_grad():
        ops.quant_matmul(a, w.t(), "mxfp8")
    monkeypatch.setenv("QUANTPATCH_GEMM", "auto")  # auto without kernels: separate, silently
    monkeypatch.setattr(wc, "_auto_fuses", lambda t: True)
    assert wc._fused_product(a, w.detach().t(), "mxfp8", False, False) is None


def test_auto_measures_each_problem_once_and_keeps_the_faster(monkeypatch):
    timed = []

    def timer(fn):
        timed.append(fn.__name__)
        return {"fused": 1.0, "separate": 2.0}[fn.__name__]

    monkeypatch.setattr(wc, "_gemm_timer", timer)
    monkeypatch.setattr(wc, "_GEMM_CHOICES", {})

    def fused():
        return torch.ones(1)

    def separate():
        return torch.zeros(1)

    assert wc._choose_gemm(("k",), fused, separate) == "fused"
    assert wc._choose_gemm(("k",), fused, separate) == "fused"
    assert timed == ["fused", "separate"]
    monkeypatch.setattr(wc, "_gemm_timer", lambda fn: {"fused": 3.0, "separate": 2.0}[fn.__name__])
    assert wc._choose_gemm(("j",), fused, separate) == "separate"
    assert ops.gemm_choices() == {"('k',)": "fused", "('j',)": "separate"}


def test_auto_through_the_products_uses_the_measured_path(kernels, monkeypatch):
    """auto where it measures (CUDA; here the interpreter stands in): the timer's verdict is
    kept per problem; separate gives the separate path's bits, fused calls the GEMM."""
    monkeypatch.setattr(qz, "_kernels_module", kernels)
    monkeypatch.setattr(wc, "_auto_fuses", lambda t: True)
    monkeypatch.setattr(wc, "_GEMM_CHOICES", {})
    verdict = {"fused": 2.0, "separate": 1.0}
    timed = []

    def timer(fn):
        timed.append(fn.__name__)
        fn()
        return verdict[fn.__name__]

    monkeypatch.setattr(wc, "_gemm_timer", timer)
    a, b = _operands(24, 64, 40, torch.float32, seed=8, transposed_b=False)
    with torch.no_grad():
        got = ops.quant_matmul(a, b, "hifp8")
        monkeypatch.setenv("QUANTPATCH_GEMM", "separate")
        assert same_bits(got, ops.quant_matmul(a, b, "hifp8"))
        monkeypatch.setenv("QUANTPATCH_GEMM", "auto")
        assert same_bits(ops.quant_matmul(a, b, "hifp8"), got) and len(timed) == 2
        verdict.update(fused=0.5)
        fused = ops.quant_matmul(a, b, "mxfp4")  # another problem: measured, fused kept
        assert len(timed) == 4 and list(ops.gemm_choices().values()) == ["separate", "fused"]
        qa, qb = qz._fake_quant(a, "mxfp4", -1, False), qz._fake_quant(b, "mxfp4", -2, False)
        tol, ref = _tolerance(qa, qb, torch.float32)
        assert bool(((fused.double() - ref).abs() <= tol).all())


def test_gpu_suite_shape_rows_run_at_tiny_sizes(monkeypatch):
    """benchmarks/gpu_suite.py's issue-30 sections end to end on CPU at tiny sizes (the
    kernels interpreted), and their table and bars, so that they run the first time a GPU
    is there."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    suite = importlib.import_module("gpu_suite")
    r = {
        "kernel_shapes": suite.bench_kernel_shapes(DEVICE, ((8, 64),), 1),
        "gemm": suite.bench_gemm(DEVICE, ((16, 32, 32),), 1, (("mxfp8", False),)),
        "weight_cache": suite.bench_weight_cache(DEVICE, 32, 64, 16, micro_batches=3, steps=2),
    }
    assert os.environ.get("QUANTPATCH_GEMM") is None and os.environ["QUANTPATCH_KERNELS"] == "auto"
    c = r["weight_cache"]
    assert c["hit_ratio"] == pytest.approx(2 / 3) and c["quantizations_per_step"] == 4
    assert c["quantizations_per_step_off"] == 12 and c["bytes_held"] == 2 * c["weight_bytes"]
    row = r["gemm"][0]["mxfp8"]
    assert row["separate_ms"] > 0 and row["fused_ms"] > 0
    md = "\n".join(suite.shapes_markdown(r))
    assert "| 8x64 |" in md and "| 16x32x32 |" in md and "hit ratio 0.667" in md
    said = []
    suite.shapes_bars(r, lambda ok, text: said.append(text))
    assert [s.split(" (")[0] for s in said] == [
        "every kernel >= 80 % of the copy",
        "quantized GEMM <= 1.08x bf16",
        "each weight quantized once per step",
    ]
    sys.modules.pop("gpu_suite", None)
