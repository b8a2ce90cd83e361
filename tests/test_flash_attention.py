"""The FA schemes' flash attention (quantpatch_flash.py, quantpatch_ops.quant_flash_attention)
against the unfused path that Megatron's patched DotProductAttention runs otherwise.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py) on CPU tensors. The unfused path is written out here exactly as the initialised
``DotProductAttention.forward`` computes it: ``repeat_interleave`` of the key/value heads,
``quant_baddbmm`` (``torch.baddbmm`` in bf16) into bf16 scores, the softmax in float32 after
the layer-scaling coefficient and the causal mask's -10000, bf16 probabilities, ``torch.bmm``
with the values.

Tolerance: a flash kernel does not round the scores and the normalisation where the unfused
path does, so the two differ in the last bits even in bf16. On the same inputs each test
measures that difference for bf16: the relative error ||flash - unfused|| / ||unfused||
(Frobenius) of ``quant_flash_attention(fmt='bf16')`` against the unfused bf16 path, for the
output and each gradient (0.5-0.9 % here: a few bf16 roundings, 2^-8 each), and requires the
quantized flash result to lie within 2x that of the quantized unfused result (measured: at
most 1.3x) and at least 3x closer to it than the quantization moves the result (3-14 %).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402

from .conftest import ATTENTION, run_probe  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in masked lanes
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
PROBE = Path(__file__).with_name("flash_probe.py")


@pytest.fixture(scope="module")
def flash():
    """The flash kernels: compiled on a GPU, else run by Triton's interpreter."""
    assert CUDA or os.environ.get("TRITON_INTERPRET") == "1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        from quantpatch.runtime import quantpatch_flash

        yield quantpatch_flash


def unfused(q, k, v, fmt, *, causal, scale, coeff=None):
    """The initialised DotProductAttention.forward's unfused path, ``[sq, b, h, dv]``."""
    sq, b, h, _ = q.shape
    rep = h // k.shape[2]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    sk = k.shape[0]
    query = q.reshape(sq, b * h, -1).transpose(0, 1)
    key = k.reshape(sk, b * h, -1).transpose(0, 1).transpose(1, 2)
    buf = torch.full((b * h, sq, sk), float("nan"), dtype=q.dtype, device=q.device)
    if fmt == "bf16":
        scores = torch.baddbmm(buf, query, key, beta=0.0, alpha=scale)
    else:
        scores = ops.quant_baddbmm(buf, query, key, beta=0.0, alpha=scale, fmt=fmt)
    x = scores.view(b, h, sq, sk).float()
    if coeff is not None:
        x = x * coeff
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        x = x.masked_fill(mask, -10000.0)
    probs = torch.softmax(x, dim=-1).to(q.dtype).view(b * h, sq, sk)
    ctx = torch.bmm(probs, v.reshape(sk, b * h, -1).transpose(0, 1))
    return ctx.view(b, h, sq, -1).permute(2, 0, 1, 3)


def inputs(sq, sk, b, h, g, d, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(DEVICE)

    return rnd(sq, b, h, d), rnd(sk, b, g, d), rnd(sk, b, g, dv), rnd(sq, b, h, dv)


def rel(got, want):
    """||got - want|| / ||want|| (Frobenius)."""
    return ((got - want).norm() / want.norm()).item()


def run_grads(fn, q, k, v, grad):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def saved_by(fn, *args):
    """Every tensor the autograd graph of ``fn(*args)`` keeps for its backward."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


def _bits(t):
    return t.detach().cpu().contiguous().view(torch.int16)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "hifp8", "nvfp4"])
def test_qk_operands_are_the_unfused_paths_bit_for_bit(flash, fmt):
    """The Q and K the kernel multiplies (what it keeps for its backward) are, bit for bit,
    the quantized operands the unfused quant_baddbmm multiplies (and keeps), GQA included. In
    bf16 the unfused product of a value with a per-tensor scale (NVFP4) multiplies code x block
    scale and applies the tensor scales to its float32 result; the kernel keeps the
    dequantized operands, ``fake_quant``'s."""
    sq, b, h, g, d = 40, 2, 4, 2, 32
    q, k, v, _ = inputs(sq, sq, b, h, g, d, d, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kept = saved_by(
        lambda: ops.quant_flash_attention(q, k, v, fmt=fmt, causal=True, softmax_scale=0.2)
    )
    fq, fk = kept[0], kept[1]
    assert fq.shape == q.shape and fk.shape == k.shape
    ref = saved_by(lambda: unfused(q, k, v, fmt, causal=True, scale=0.2))
    uq = next(t for t in ref if t.shape == (b * h, sq, d))
    uk = next(t for t in ref if t.shape == (b * h, d, sq))
    got_q = fq.reshape(sq, b * h, d).transpose(0, 1)
    got_k = fk.repeat_interleave(h // g, dim=2).reshape(sq, b * h, d).permute(1, 2, 0)
    from quantpatch.runtime import quantpatch_quantize as qz

    if qz.factors(fmt, q.dtype):
        q_bh = q.detach().reshape(sq, b * h, d).transpose(0, 1)
        k_bh = k.detach().repeat_interleave(h // g, dim=2).reshape(sq, b * h, d).permute(1, 2, 0)
        got_q, got_k = (
            qz.quantize_factored(q_bh, fmt, -1)[0],
            qz.quantize_factored(k_bh, fmt, -2)[0],
        )
    assert torch.equal(_bits(got_q), _bits(uq)) and torch.equal(_bits(got_k), _bits(uk))
    assert not torch.equal(fq, q.detach()) and not torch.equal(fk, k.detach())
    assert torch.equal(fq, ops.fake_quant(q.detach(), fmt))


CASES = [
    # fmt, causal, (sq, sk, b, h, g, d, dv), coeff
    ("mxfp8", True, (40, 40, 1, 4, 2, 16, 16), None),  # GQA, 40 = 32 + 8: a ragged block
    ("hifp8", False, (24, 40, 2, 2, 2, 48, 32), 3.0),  # sq != sk, head dims not a power of 2
    ("nvfp4", True, (72, 72, 1, 1, 1, 32, 32), None),  # three blocks: the diagonal skip
]


@pytest.mark.parametrize(("fmt", "causal", "shape", "coeff"), CASES)
def test_outputs_and_gradients_match_the_unfused_path(flash, fmt, causal, shape, coeff):
    d = shape[5]
    q, k, v, grad = inputs(*shape, seed=2)
    scale = d**-0.5
    total = scale * (coeff or 1.0)

    def fl(fmt_):
        return lambda *t: ops.quant_flash_attention(
            *t, fmt=fmt_, causal=causal, softmax_scale=total
        )

    def un(fmt_):
        return lambda *t: unfused(*t, fmt_, causal=causal, scale=scale, coeff=coeff)

    flash_bf16 = run_grads(fl("bf16"), q, k, v, grad)
    unfused_bf16 = run_grads(un("bf16"), q, k, v, grad)
    flash_q = run_grads(fl(fmt), q, k, v, grad)
    unfused_q = run_grads(un(fmt), q, k, v, grad)
    names = ("out", "dq", "dk", "dv")
    for name, fb, ub, fq, uq in zip(
        names, flash_bf16, unfused_bf16, flash_q, unfused_q, strict=True
    ):
        tol = rel(fb, ub)
        # the bf16 flash kernel itself is right: within a few bf16 roundings of the unfused path
        assert 0 < tol <= 2**-6, (name, tol)
        err = rel(fq, uq)
        assert err <= 2 * tol, (name, err, tol)
        assert err < rel(uq, ub) / 3, (name, err, rel(uq, ub))


class _Allocations(TorchDispatchMode):
    """The number of elements of every tensor a torch operation returns."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.sizes.append(t.numel())
        return out


def test_memory_is_linear_in_the_sequence(flash):
    """Nothing the flash path allocates or keeps (forward and backward) is [b * h, sq, sk]:
    the largest tensor is an input-sized one, where the unfused path keeps the scores."""
    sq, b, h, g, d = 96, 1, 1, 1, 16
    q, k, v, grad = inputs(sq, sq, b, h, g, d, d, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = b * h * sq * sq
    io = max(t.numel() for t in (q, k, v, grad))

    def flash_path():
        out = ops.quant_flash_attention(*leaves, fmt="mxfp8", causal=True, softmax_scale=0.25)
        out.backward(grad)

    with _Allocations() as seen:
        kept = saved_by(flash_path)
    # 2 x: the CPU reference of the fake quantization pads a head dim of 16 to an MX block
    assert seen.sizes and max(seen.sizes) <= 2 * io <= scores / 3
    # q, k, v (quantized q and k), the output and the log-sum-exp of each row
    assert len(kept) == 5 and sum(t.numel() for t in kept) <= 4 * io + b * h * sq
    kept = saved_by(lambda: unfused(*leaves, "mxfp8", causal=True, scale=0.25))
    assert max(t.numel() for t in kept) >= scores


class _Layer(torch.nn.Module):
    """The attributes of Megatron's DotProductAttention that the flash route reads."""

    def __init__(self, kind="causal", dropout=0.0, coeff=None):
        super().__init__()
        self.attn_mask_type = type("AttnMaskType", (), {"name": kind})()
        self.attention_dropout = torch.nn.Dropout(dropout)
        self.softmax_scale = 0.125
        self.scale_mask_softmax = type("Softmax", (), {"scale": coeff})()


def test_the_route_refuses_what_it_cannot_compute(flash, monkeypatch):
    q, k, v, _ = inputs(8, 8, 1, 2, 1, 16, 16)
    causal = torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1)
    monkeypatch.setenv("QUANTPATCH_FLASH", "1")
    monkeypatch.delenv("TENSOR_SAVE_ENABLED", raising=False)
    layer = _Layer()

    def why(lay=layer, mask=None, qk="mxfp8", pv="bf16", tensors=(q, k, v)):
        return ops.flash_refusal(lay, *tensors, mask, qk=qk, pv=pv)

    assert why() is None and ops.flash_eligible(layer, q, k, v, causal, qk="mxfp8", pv="bf16")
    mine = causal.clone()
    assert why(mask=mine) is None and why(mask=mine) is None  # compared, then remembered
    mine[0, 0, 5, 2] = True  # changed in place: its version moves on, it is compared again
    assert "mask" in why(mask=mine)
    assert why(mask=causal.expand(3, 2, 8, 8)) is None
    other = causal.clone()
    other[0, 0, 5, 2] = True  # a document boundary: not the causal mask
    assert "mask" in why(mask=other)
    assert "mask" in why(mask=causal.to(torch.uint8))
    monkeypatch.delenv("QUANTPATCH_FLASH_BF16", raising=False)
    assert why(qk="bf16").startswith("Q.K^T is bf16")
    monkeypatch.setenv("QUANTPATCH_FLASH_BF16", "1")  # the baseline on the FA schemes' kernel
    assert why(qk="bf16") is None
    assert "P.V is quantized" in why(qk="bf16", pv="mxfp8")
    monkeypatch.setenv("QUANTPATCH_FLASH_BF16", "yes")
    with pytest.raises(ValueError, match="QUANTPATCH_FLASH_BF16"):
        why(qk="bf16")
    monkeypatch.setenv("QUANTPATCH_FLASH_BF16", "0")
    assert why(qk="bf16").startswith("Q.K^T is bf16")
    assert "P.V is quantized" in why(pv="mxfp4")
    assert "unknown format" in why(qk="fp6")
    assert "dropout" in why(_Layer(dropout=0.1))
    assert why(_Layer(dropout=0.1).eval()) is None  # dropout is off in evaluation
    assert why(_Layer("padding")) is None  # no mask: every key is visible
    assert "mask" in why(_Layer("padding"), mask=causal)
    assert "mask type arbitrary" in why(_Layer("arbitrary"))
    assert "causal attention needs sq == sk" in why(tensors=(q[:4], k, v))
    assert "dtypes" in why(tensors=(q.float(), k.float(), v.float()))
    three, two = q[:, :, :1].expand(8, 1, 3, 16), k.expand(8, 1, 2, 16)
    assert "share" in why(tensors=(three, two, v.expand(8, 1, 2, 16)))
    assert "must be [s, b, heads, head_dim]" in why(tensors=(q[0], k, v))
    assert "do not match" in why(tensors=(q, k[..., :8], v))
    big = torch.zeros(8, 1, 1, 512, dtype=torch.bfloat16, device=DEVICE)
    assert "head dims" in why(tensors=(big, big, big))
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "true")
    assert "saver" in why()
    monkeypatch.delenv("TENSOR_SAVE_ENABLED")
    monkeypatch.setenv("QUANTPATCH_FLASH", "0")
    assert why() == "QUANTPATCH_FLASH=0"
    monkeypatch.setenv("QUANTPATCH_FLASH", "yes")
    with pytest.raises(ValueError, match="QUANTPATCH_FLASH"):
        why()
    if not CUDA:
        monkeypatch.setenv("QUANTPATCH_FLASH", "auto")
        assert why() == "CPU tensors"
        monkeypatch.setenv("QUANTPATCH_FLASH", "1")
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            why()
    with pytest.raises(ValueError, match="share"):
        flash.flash_attention(three, two, v.expand(8, 1, 2, 16), causal=False, scale=1.0)
    monkeypatch.setattr(ops, "_flash_module", None)  # as where triton does not import
    monkeypatch.setattr(ops, "_flash_error", "ModuleNotFoundError: no triton")
    monkeypatch.setenv("QUANTPATCH_FLASH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert why() == "no flash-attention kernels (ModuleNotFoundError: no triton)"
    with pytest.raises(RuntimeError, match="no triton"):
        ops.quant_flash_attention(q, k, v, fmt="mxfp8", causal=True, softmax_scale=1.0)


def test_the_path_taken_is_said_once_per_kind(flash, monkeypatch, capsys):
    """flash_eligible prints the first flash and the first stock decision, once each, on rank
    0 only: the line `quantpatch runs` reads to say which attention path a run took."""
    q, k, v, _ = inputs(8, 8, 1, 2, 1, 16, 16)
    monkeypatch.setenv("QUANTPATCH_FLASH", "1")
    monkeypatch.setenv("QUANTPATCH_FLASH_BF16", "1")
    monkeypatch.delenv("TENSOR_SAVE_ENABLED", raising=False)
    monkeypatch.setattr(ops, "_paths_said", set())
    monkeypatch.setenv("RANK", "1")
    assert ops.flash_eligible(_Layer(), q, k, v, None, qk="bf16", pv="bf16")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    for _ in range(2):
        assert ops.flash_eligible(_Layer(), q, k, v, None, qk="bf16", pv="bf16")
        assert not ops.flash_eligible(_Layer(), q, k, v, None, qk="mxfp8", pv="mxfp4")
    assert ops.flash_eligible(_Layer(), q, k, v, None, qk="mxfp8", pv="bf16")
    assert capsys.readouterr().err.splitlines() == [
        "[quantpatch] attention path: flash (Q.K^T bf16, P.V bf16)",
        "[quantpatch] attention path: stock (P.V is quantized (mxfp4): the flash kernel keeps "
        "P.V in bf16)",
    ]


def test_the_layer_route_scales_like_megatron(flash, monkeypatch):
    """flash_dot_product_attention takes softmax_scale x the softmax's coefficient (layer
    scaling) and the mask type's causality, and returns Megatron's [sq, b, h * dv]."""
    monkeypatch.setenv("QUANTPATCH_FLASH", "1")
    q, k, v, _ = inputs(40, 40, 1, 2, 1, 16, 16, seed=4)
    layer = _Layer(coeff=3.0)
    got = ops.flash_dot_product_attention(layer, q, k, v, None, fmt="mxfp8")
    want = unfused(q, k, v, "mxfp8", causal=True, scale=0.125, coeff=3.0)
    assert got.shape == (40, 1, 32)
    assert rel(got.float(), want.reshape(40, 1, 32).float()) <= 2**-6
    plain = ops.flash_dot_product_attention(_Layer("no_mask"), q, k, v, None, fmt="mxfp8")
    want = unfused(q, k, v, "mxfp8", causal=False, scale=0.125)
    assert rel(plain.float(), want.reshape(40, 1, 32).float()) <= 2**-6


@pytest.mark.slow
def test_patched_dot_product_attention_takes_the_flash_route(run, make_checkout, tmp_path, flash):
    """`init`, `set --qk mxfp8`: Megatron's own DotProductAttention (GQA, causal, layer
    scaling) returns the flash route's result when QUANTPATCH_FLASH=1 lets the interpreter run
    it on CPU, never asking for its [b * np, sq, sk] buffer, and the unfused result with
    QUANTPATCH_FLASH=0; the two agree within the bf16 flash-vs-unfused tolerance measured on
    the same inputs."""
    if CUDA:
        pytest.skip("the probe runs the layer on CPU tensors in the interpreter")
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, "--qk", "mxfp8").code == 0
    text = (root / ATTENTION).read_text()
    assert "quantpatch_ops.flash_dot_product_attention(" in text
    res = json.loads(run("check", "--json", "--repo", root).out)
    assert res["roles"] == {"linear": "bf16", "qk": "mxfp8", "pv": "bf16"}
    got, _ = run_probe(PROBE, root, tmp_path / "flash.pt", TRITON_INTERPRET="1")
    q, k, v, grad = got["q"], got["k"], got["v"], got["grad"]
    scale, coeff = got["softmax_scale"], got["coeff"]
    assert coeff == 3

    def un(fmt_):
        return lambda *t: unfused(*t, fmt_, causal=True, scale=scale, coeff=coeff).reshape(
            40, 1, -1
        )

    def fl(*t):
        out = ops.quant_flash_attention(*t, fmt="bf16", causal=True, softmax_scale=scale * coeff)
        return out.reshape(40, 1, -1)

    tols = [
        rel(a, b)
        for a, b in zip(
            run_grads(fl, q, k, v, grad), run_grads(un("bf16"), q, k, v, grad), strict=True
        )
    ]
    reference = run_grads(un("mxfp8"), q, k, v, grad)
    stock = got["mask_0"]
    assert (stock["flash"], stock["buffer"]) == (0, 1)
    for mask in ("mask", "nomask"):
        routed = got[f"{mask}_1"]
        assert (routed["flash"], routed["buffer"]) == (1, 0)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            assert torch.equal(stock[name].float(), reference[i]), name  # the unfused path
            err = rel(routed[name].float(), stock[name].float())
            assert 0 < tols[i] <= 2**-6 and err <= 2 * tols[i], (mask, name, err, tols[i])


@pytest.mark.slow
def test_a_bf16_baseline_takes_the_flash_kernel_only_when_asked(
    run, make_checkout, tmp_path, flash
):
    """`init` alone (Q.K^T bf16): Megatron's DotProductAttention runs the stock path without
    calling quantpatch_ops at all unless QUANTPATCH_FLASH_BF16=1; then it returns the flash
    kernel's bf16 result (bit for bit quant_flash_attention(fmt='bf16')), within the flash
    kernel's rounding of the stock result, and says so once in its log."""
    if CUDA:
        pytest.skip("the probe runs the layer on CPU tensors in the interpreter")
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    text = (root / ATTENTION).read_text()
    assert "os.environ.get('QUANTPATCH_FLASH_BF16') == '1'" in text and "import os\n" in text
    res = json.loads(run("check", "--json", "--repo", root).out)
    assert res["roles"] == {"linear": "bf16", "qk": "bf16", "pv": "bf16"}
    got, err = run_probe(PROBE, root, tmp_path / "bf16.pt", "bf16", TRITON_INTERPRET="1")
    q, k, v, grad = got["q"], got["k"], got["v"], got["grad"]
    scale, coeff = got["softmax_scale"], got["coeff"]
    stock, routed = got["mask_stock"], got["mask_bf16"]
    assert (stock["flash"], stock["buffer"], stock["asked"]) == (0, 1, 0)
    assert (routed["flash"], routed["buffer"], routed["asked"]) == (1, 0, 1)

    def fl(*t):
        out = ops.quant_flash_attention(*t, fmt="bf16", causal=True, softmax_scale=scale * coeff)
        return out.reshape(40, 1, -1)

    def un(*t):
        return unfused(*t, "bf16", causal=True, scale=scale, coeff=coeff).reshape(40, 1, -1)

    kernel, reference = run_grads(fl, q, k, v, grad), run_grads(un, q, k, v, grad)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert torch.equal(stock[name].float(), reference[i]), name  # the stock path
        assert torch.equal(routed[name].float(), kernel[i]), name  # the flash kernel, in bf16
        err_ = rel(routed[name].float(), stock[name].float())
        assert 0 < err_ <= 2**-6, (name, err_)
    said = [line for line in err.splitlines() if line.startswith(ops.ATTENTION_PATH_LINE)]
    assert said == ["[quantpatch] attention path: flash (Q.K^T bf16, P.V bf16)"]


def test_gpu_suite_flash_rows_run_on_cpu(flash):
    """benchmarks/gpu_suite.py's flash rows (tiny sizes, interpreter): every path runs, the
    flash paths keep O(s) for the backward where the unfused ones keep the scores, and the
    table and the bars read the rows."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("gpu_suite", bench / "gpu_suite.py")
        assert spec is not None and spec.loader is not None
        suite = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite)
    finally:
        sys.path.remove(str(bench))
    seq, heads, groups, dim = 64, 2, 1, 16
    r = suite.bench_flash(DEVICE, seq, heads, groups, dim, iters=1)
    rows = {e["row"]: e for e in r["rows"]}
    assert list(rows) == [name for name, _, _ in suite.FLASH_ROWS]
    assert all(e["ms"] > 0 for e in rows.values())
    assert rows["flash bf16"]["vs_flash_bf16"] == 1.0
    scores_mib = heads * seq * seq * 2 / 2**20  # the bf16 probabilities alone
    unfused_min = min(e["saved_mib"] for n, e in rows.items() if n.startswith("unfused"))
    assert unfused_min >= scores_mib
    for name, e in rows.items():
        assert name.startswith("unfused") or e["saved_mib"] < unfused_min / 2, (name, e)
    md = suite.markdown({"device": "cpu", "device_name": "CPU", "flash": r, "bars": ["-"]})
    assert "| flash mxfp8 (FA_mxfp8) |" in md and f"sequence {seq}," in md
    for e in r["rows"]:  # as a GPU run reports them
        e["peak_mib"] = e["saved_mib"]
    judged = [b for b in suite.bars({"device": "cuda", "flash": r}) if "FA_mxfp8" in b]
    assert len(judged) == 3 and judged[2].startswith("met: FA_mxfp8 peak memory")


def test_set_writes_both_pv_sites_and_the_route_needs_a_plain_layout(run, make_checkout, trees):
    """`set --pv` writes the P.V site at the top of the forward (read by the flash route) and
    the one at the P.V product alike; init's codemod refuses layouts it cannot route."""
    from quantpatch.base.errors import UserError
    from quantpatch.sites.codemods.init_sites import Layout, inject_sites

    root = make_checkout("0.13.1", inject=False)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, "--qk", "hifp8", "--pv", "mxfp4").code == 0
    res = json.loads(run("check", "--json", "--repo", root).out)
    attention = [(s["role"], s["value"]) for s in res["sites"] if s["file"] == ATTENTION]
    assert attention == [("pv", "mxfp4"), ("qk", "hifp8"), ("pv", "mxfp4")]
    assert run("check", "--repo", root, "--expect", "qk=hifp8,pv=mxfp4").code == 0
    stock = (trees["0.13.1"].parent / ATTENTION).read_text()
    with pytest.raises(ValueError, match="plain literal"):
        inject_sites(stock, ATTENTION, "attention", Layout(env=True), flash=True)
    short = stock.replace("        attention_mask: Tensor,\n", "", 1)
    with pytest.raises(UserError, match="attention_mask"):
        inject_sites(short, ATTENTION, "attention", flash=True)
