"""ParetoQ's extremely low-bit weights: the quantizers bit-exact against an oracle
written here from the ParetoQ paper's formulas (numpy float32, sums with math.fsum), the layer
plumbing (steps as parameters, first-forward initialisation, checkpoints), tensor
parallelism on CPU, and training a megatron-core GPT under ``set --linear w1.58``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from quantpatch.base.config import is_paretoq, validate_value  # noqa: E402
from quantpatch.base.errors import UserError  # noqa: E402
from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402

from .conftest import tiny_gpt  # noqa: E402

F32 = np.float32
TP_WORKER = Path(__file__).with_name("paretoq_tp_worker.py")

# -- the oracle: ParetoQ's formulas, in numpy float32 -----------------------------------------


def _parse(fmt: str) -> tuple[str, int | None]:
    base, _, group = fmt.partition("g")
    return base, int(group) if group else None


def _params(base: str) -> dict:
    if base == "w1":
        return {"kind": "binary", "qn": F32(-1), "qp": F32(1), "P": 1}
    if base in ("w1.58", "w2"):
        n, s = (F32(1.5), F32(0)) if base == "w1.58" else (F32(2), F32(0.5))
        return {"kind": "seq", "n": n, "s": s, "qn": -(n - s) / n, "qp": (n - s) / n, "P": 1}
    b = int(base[1:])
    return {
        "kind": "lsq",
        "qn": F32(-(2 ** (b - 1))),
        "qp": F32(2 ** (b - 1) - 1),
        "P": 2 ** (b - 1) - 1,
    }


def _per_element(a: np.ndarray, cols: int, group: int | None) -> np.ndarray:
    if group is None:
        return np.repeat(a, cols, axis=1)
    return a[:, np.arange(cols) // group]


def _seq_r(q: np.ndarray, p: dict) -> np.ndarray:
    return np.rint(np.clip(q, F32(-0.99), F32(0.99)) * p["n"] - p["s"]).astype(F32)


def oracle_forward(w: np.ndarray, alpha: np.ndarray, fmt: str) -> np.ndarray:
    base, group = _parse(fmt)
    p = _params(base)
    a = np.where(alpha > F32(1e-5), alpha, F32(1e-5)).astype(F32)
    a = _per_element(a, w.shape[1], group)
    if p["kind"] == "binary":
        return np.sign(w) * a
    q = (w / a).astype(F32)
    if p["kind"] == "seq":
        return ((_seq_r(q, p) + p["s"]) / p["n"]) * a
    return np.clip(np.rint(q), p["qn"], p["qp"]) * a


def oracle_backward(
    w: np.ndarray, alpha: np.ndarray, g: np.ndarray, fmt: str, numel: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    base, group = _parse(fmt)
    p = _params(base)
    a = _per_element(np.where(alpha > F32(1e-5), alpha, F32(1e-5)).astype(F32), w.shape[1], group)
    q = (w / a).astype(F32)
    lo, hi = (F32(-0.99), F32(0.99)) if p["kind"] == "seq" else (p["qn"], p["qp"])
    inside = (q >= lo) & (q <= hi)
    dw = np.where(inside, g, F32(0))
    if p["kind"] == "binary":
        c = np.sign(w)
    else:
        mid = ((_seq_r(q, p) + p["s"]) / p["n"]) - q if p["kind"] == "seq" else np.rint(q) - q
        c = np.where(q < lo, p["qn"], np.where(q > hi, p["qp"], mid)).astype(F32)
    k = F32(1.0 / math.sqrt((numel or w.size) * p["P"]))
    terms = (c * g) * k
    cols = w.shape[1]
    edges = (
        [(0, cols)] if group is None else [(j, min(j + group, cols)) for j in range(0, cols, group)]
    )
    da = np.array(
        [[math.fsum(terms[r, lo_:hi_].tolist()) for lo_, hi_ in edges] for r in range(w.shape[0])],
        dtype=np.float64,
    ).astype(F32)
    return dw, da


def oracle_init(w: np.ndarray, fmt: str) -> np.ndarray:
    base, group = _parse(fmt)
    p = _params(base)
    cols = w.shape[1]
    edges = (
        [(0, cols)] if group is None else [(j, min(j + group, cols)) for j in range(0, cols, group)]
    )
    mags = np.abs(w.astype(F32))
    out = []
    for row in mags:
        vals = []
        for lo_, hi_ in edges:
            part = row[lo_:hi_]
            if p["kind"] == "binary":
                vals.append(F32(math.fsum(part.tolist()) / (hi_ - lo_)))
            elif p["kind"] == "seq":
                vals.append(part.max())
            else:
                vals.append(F32(part.max()) / p["qp"])
        out.append(vals)
    return np.array(out, dtype=F32)


# -- the quantizers, bit for bit -----------------------------------------------------------------

FORMATS = ["w1", "w1.58", "w2", "w3", "w4", "w1g3", "w1.58g7", "w2g5", "w3g4", "w4g6"]


def _case(fmt: str, dtype: torch.dtype, seed: int = 0):
    """A weight [7, 13] (13: no group size here divides it) whose last rows sit at and around
    the clip boundary, steps at, below and around the 1e-5 clamp, and a gradient."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(7, 13, generator=gen) * 0.3
    p = _params(_parse(fmt)[0])
    hi = float(F32(0.99)) if p["kind"] == "seq" else float(p["qp"])
    at = torch.tensor(hi, dtype=torch.float32).to(dtype)  # the dtype's value at or below hi
    if at.float() > hi:
        at = torch.nextafter(at, torch.zeros_like(at))
    above = torch.nextafter(at, torch.full_like(at, 9.0))
    edge = torch.stack([at, -at, above, -above])
    w = w.to(dtype)
    w[5, :4] = edge * 0.5  # step 0.5 (a power of two: W / alpha is exact)
    w[6, :4] = edge * 2.0  # step 2
    w[5, 4:8] = torch.tensor([0.25, -0.75, 1.25, 0.0])  # ties of round-half-even at step 0.5
    cols = ops.alpha_columns(fmt, 13)
    alpha = (torch.rand(7, cols, generator=gen) * 0.4 + 0.05).to(dtype)
    alpha[5] = 0.5
    alpha[6] = 2.0
    alpha[4, 0] = 1e-6  # clamped to 1e-5
    alpha[3, 0] = 0.0
    alpha[2, 0] = -0.3
    g = torch.randn(7, 13, generator=gen).to(dtype)
    return w, alpha, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_forward_and_backward_bit_exact(fmt, dtype):
    """bf16 weights (and steps) are upcast to float32, computed there, and the quantized
    weight is rounded once to bf16: the oracle computes in float32 and rounds its result."""
    w, alpha, g = _case(fmt, dtype)
    wl = w.clone().requires_grad_()
    al = alpha.clone().requires_grad_()
    out = ops.paretoq_weight(wl, al, fmt)
    out.backward(g)
    w32, a32, g32 = (t.float().numpy() for t in (w, alpha, g))
    want = torch.from_numpy(oracle_forward(w32, a32, fmt)).to(dtype)
    assert out.dtype == dtype and torch.equal(out, want)
    dw, da = oracle_backward(w32, a32, g32, fmt)
    assert wl.grad is not None and al.grad is not None
    assert wl.grad.dtype == dtype and torch.equal(wl.grad, torch.from_numpy(dw).to(dtype))
    assert al.grad.dtype == dtype and torch.equal(al.grad, torch.from_numpy(da).to(dtype))
    # the boundary rows do hit both sides of the clip range
    assert (wl.grad[5:, :4] == 0).any() and (wl.grad[5:, :4] != 0).any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_initial_step_and_fake_quant(fmt):
    w, _, _ = _case(fmt, torch.float32, seed=1)
    init = ops.paretoq_init_alpha(w, fmt)
    assert init.dtype == torch.float32
    assert torch.equal(init, torch.from_numpy(oracle_init(w.numpy(), fmt)))
    assert torch.equal(ops.fake_quant(w, fmt), ops.paretoq_quantize(w, init, fmt))
    assert torch.equal(
        ops.fake_quant(w, fmt), torch.from_numpy(oracle_forward(w.numpy(), init.numpy(), fmt))
    )


def test_gradient_scale_is_double_rounded_to_float32_and_takes_the_whole_numel():
    w, alpha, g = _case("w4", torch.float32)
    _, da = ops.paretoq_grads(w, alpha, g, "w4", numel=w.numel() * 2)
    want = oracle_backward(w.numpy(), alpha.numpy(), g.numpy(), "w4", numel=w.numel() * 2)[1]
    assert torch.equal(da.float(), torch.from_numpy(want))
    assert ops.grad_scale("w4", 91).item() == float(F32(1 / math.sqrt(91 * 7)))
    assert ops.grad_scale("w2", 91).item() == float(F32(1 / math.sqrt(91)))


def test_products_leave_operands_alone_and_formats_are_listed():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    assert torch.equal(ops.quant_matmul(a, b, "w2g4"), a @ b)
    assert torch.equal(ops.quant_matmul(a, b, "w1.58", backward=True), a @ b)
    assert set(ops.GROUPED_FORMATS) <= set(ops.FORMATS)
    assert [ops.paretoq_spec(f) for f in ("w2g128", "w1.58", "w2g0", "w5", "mxfp8", "w2g")] == [
        ("w2", 128),
        ("w1.58", None),
        None,
        None,
        None,
        None,
    ]
    with pytest.raises(ValueError, match="2-D weights"):
        ops.fake_quant(torch.randn(2, 3, 4), "w2")
    for bad in (ops.paretoq_quantize, ops.paretoq_fake_quant):
        with pytest.raises(ValueError, match="not a ParetoQ"):
            bad(
                torch.randn(2, 3),
                *([torch.ones(2, 1)] if bad is ops.paretoq_quantize else []),
                "mxfp8",
            )  # type: ignore[operator]
    with pytest.raises(ValueError, match="not a ParetoQ"):
        ops.alpha_columns("hifp8", 4)
    with pytest.raises(ValueError, match="not a ParetoQ"):
        ops.paretoq_grads(torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), "bf16")


def test_values_are_linear_only():
    for value in ("w1", "w1.58", "w2", "w3", "w4", "w2g128", "w1.58g64", "w4g1"):
        assert validate_value(value, allow_unknown=False, role="linear") == value
        assert is_paretoq(value)
        with pytest.raises(UserError, match="only the linear role has weights") as exc:
            validate_value(value, allow_unknown=False, role="qk", where="--qk")
        assert str(exc.value).count(". ") == 0  # one sentence
    for bad in ("w2g0", "w5", "w2g", "w1.5", "w2g-1"):
        with pytest.raises(UserError):
            validate_value(bad, allow_unknown=False, role="linear")


# -- the layer plumbing, in process (a layer with the attributes Megatron's layers have) -----


class _Layer(torch.nn.Module):
    """The attributes ``add_weight_scales`` reads from Column/RowParallelLinear."""

    def __init__(self, out: int, inp: int, dim: int, tp: int = 1, tp_group=None) -> None:
        super().__init__()
        self.output_size, self.input_size = out, inp
        self.output_size_per_partition = out // tp if dim == 0 else out
        self.input_size_per_partition = inp // tp if dim == 1 else inp
        shape = (self.output_size_per_partition, self.input_size_per_partition)
        self.weight = torch.nn.Parameter(torch.randn(*shape) * 0.2)
        self.tp_group = tp_group


def _linear(input, weight, bias, gradient_accumulation_fusion):
    assert gradient_accumulation_fusion is False
    return input @ weight.t()


def test_layer_steps_initialise_once_train_and_survive_a_checkpoint():
    torch.manual_seed(0)
    layer = _Layer(6, 10, 0)
    ops.add_weight_scales(layer, "w2g4", partition_dim=0)
    assert layer.weight_alpha.shape == (6, 3) and layer.weight_alpha_tp_axis == 0
    assert int(layer.weight_alpha_initialized) == 0
    assert "weight_alpha" in dict(layer.named_parameters())
    x = torch.randn(5, 10)
    y = ops.paretoq_linear(
        layer, _linear, input=x, weight=layer.weight, bias=None, gradient_accumulation_fusion=True
    )
    init = ops.paretoq_init_alpha(layer.weight, "w2g4")
    assert torch.equal(layer.weight_alpha.detach(), init)
    assert torch.equal(y, x @ ops.paretoq_quantize(layer.weight, init, "w2g4").t())
    y.sum().backward()
    assert layer.weight_alpha.grad is not None and layer.weight.grad is not None
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt.step()
    trained = layer.weight_alpha.detach().clone()
    assert not torch.equal(trained, init)
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_alpha", "weight_alpha_initialized"}
    fresh = _Layer(6, 10, 0)
    ops.add_weight_scales(fresh, "w2g4", partition_dim=0)
    fresh.load_state_dict(state)
    ops.paretoq_linear(
        fresh, _linear, input=x, weight=fresh.weight, bias=None, gradient_accumulation_fusion=True
    )
    assert torch.equal(fresh.weight_alpha.detach(), trained)  # loaded, not re-initialised
    # a weight handed to the forward (a shared embedding) is not quantized
    other = torch.randn(6, 10)
    out = ops.paretoq_linear(
        fresh, _linear, input=x, weight=other, bias=None, gradient_accumulation_fusion=False
    )
    assert torch.equal(out, x @ other.t())
    # sharded_state_dict: the split step takes the weight's axis, positional or by keyword
    seen = []
    ops.paretoq_sharded_state_dict(
        fresh, lambda *a, **k: seen.append((a, k)), {}, "p.", {"weight": 0}, ()
    )
    ops.paretoq_sharded_state_dict(
        fresh, lambda *a, **k: seen.append((a, k)), {}, "p.", tensor_parallel_layers_axis_map=None
    )
    assert seen[0][0][2] == {"weight": 0, "weight_alpha": 0}
    assert seen[1][1]["tensor_parallel_layers_axis_map"] == {"weight_alpha": 0}


def test_layer_step_shapes_and_refusals():
    row = _Layer(4, 12, 1, tp=2, tp_group=object())
    ops.add_weight_scales(row, "w3", partition_dim=1)
    assert row.weight_alpha.shape == (4, 1) and row.weight_alpha_tp_axis is None
    assert row.weight_alpha_reduce_group is row.tp_group and row.weight_alpha_numel == 48
    assert row.weight_alpha.tensor_model_parallel is False
    grouped = _Layer(4, 12, 1, tp=2)
    ops.add_weight_scales(grouped, "w3g3", partition_dim=1)
    assert grouped.weight_alpha.shape == (4, 2) and grouped.weight_alpha_tp_axis == 1
    assert grouped.weight_alpha.tensor_model_parallel is True
    with pytest.raises(ValueError, match="does not divide the 6 input columns"):
        ops.add_weight_scales(_Layer(4, 12, 1, tp=2), "w3g4", partition_dim=1)
    with pytest.raises(ValueError, match="keeps no tensor-parallel group"):
        ops.add_weight_scales(_Layer(4, 12, 1, tp=2), "w3", partition_dim=1)
    for fmt in ("bf16", "mxfp8"):
        plain = _Layer(4, 12, 0)
        ops.add_weight_scales(plain, fmt, partition_dim=0)
        assert plain.weight_alpha is None
    shared = _Layer(4, 12, 0)
    shared.weight = None
    ops.add_weight_scales(shared, "w2", partition_dim=0)
    assert shared.weight_alpha is None


# -- init, set and check on a stock checkout, and a tiny GPT trained under w1.58 ------------------


def _clean_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env.pop("CUSTOM_QUANT_TYPE", None)
    env["PYTHONPATH"] = str(root)
    return env


@pytest.mark.slow
def test_tiny_gpt_trains_under_w158_on_cpu(run, make_checkout):
    """`init` adds one linear site to each tensor-parallel layer's constructor; `set --linear
    w1.58` sets all five; the megatron-core GPT of benchmarks/gpu_e2e.py trains 30 steps on
    CPU with the steps as parameters: the loss falls and the steps move."""
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    data = json.loads(run("check", "--json", "--repo", root).out)
    linear = [s for s in data["sites"] if s["role"] == "linear"]
    assert [s["function"] for s in linear][-2:] == [
        "ColumnParallelLinear.__init__",
        "RowParallelLinear.__init__",
    ]
    assert len(linear) == 5 and all(s["form"] == "literal" for s in linear)
    res = run("set", "--repo", root, "--qk", "w1.58")
    assert res.code == 2 and "only the linear role has weights" in res.err
    assert run("set", "--repo", root, "--linear", "w1.58").code == 0
    res = run("check", "--repo", root, "--expect", "linear=w1.58,qk=bf16,pv=bf16")
    assert res.code == 0, res
    cfg = {"device": "cpu", "steps": 30, "vocab": 128, "layers": 1, "hidden": 64, "heads": 4}
    cfg |= {"seq": 32, "batch": 2}
    res = tiny_gpt(root, cfg)
    losses, alphas = res["losses"], res["alpha"]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.5, losses
    # every tensor-parallel linear layer has its step (qkv, proj, fc1, fc2 and the output
    # layer, whose weight is its own here), initialised at the first forward, then trained
    assert alphas["count"] == 5, alphas
    assert alphas["first"] != alphas["last"] and all(map(math.isfinite, alphas["last"]))
    assert run("restore", "--repo", root).code == 0


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_one(run, make_checkout, tmp_path):
    """TP = 2 (two processes, gloo, CPU) against TP = 1 from the same seed, under the sites'
    value (w1.58: Column splits the per-row steps, Row keeps them whole with the initial max
    and the gradient reduced over the group) and a grouped one (w4g4: Row's steps split with
    its columns). The quantized weights and the initial steps are bitwise equal; after three
    Adam steps the steps agree to float32 rounding (Row's output is an all-reduce of partial
    products, so the loss itself differs in its last bits), and Row's whole step is bitwise
    the same on both ranks."""
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, "--linear", "w1.58").code == 0
    out = tmp_path / "tp.pt"
    res = subprocess.run(
        [sys.executable, str(TP_WORKER), str(out), "w4g4"],
        cwd=root,
        env=_clean_env(root),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = torch.load(out)
    for label in ("sites", "grouped"):
        tp2, tp1 = results[label]["tp2"], results[label]["tp1"]
        for key in ("wq_col", "wq_row", "alpha_col_init", "alpha_row_init"):
            assert torch.equal(tp2[key], tp1[key]), (label, key)
        assert abs(tp2["loss0"] - tp1["loss0"]) <= 1e-6 * abs(tp1["loss0"])
        for key in ("alpha_col", "alpha_row"):
            torch.testing.assert_close(tp2[key], tp1[key], rtol=1e-5, atol=1e-7)
            assert not torch.equal(tp2[key], tp2[f"{key}_init"]), (label, key)  # trained
        assert tp2["reloaded_equal"] and tp2["flag"] == 1 and tp1["reloaded_equal"]
    sites, grouped = results["sites"]["tp2"], results["grouped"]["tp2"]
    ranks = sites["alpha_row_ranks"]  # Row's whole step, rank 0's rows then rank 1's
    assert torch.equal(ranks[:16], ranks[16:])
    # checkpoint metadata: Column's rows and grouped Row's columns sharded, whole Row replicated
    assert sites["sharded"]["col.weight_alpha"][:2] == ((24, 1), (0, 0))
    assert sites["sharded"]["row.weight_alpha"][:2] == ((16, 1), (0, 0))
    assert grouped["sharded"]["col.weight_alpha"][:2] == ((24, 4), (0, 0))
    assert grouped["sharded"]["row.weight_alpha"][:2] == ((16, 6), (0, 0))


# -- tensors formats: ParetoQ candidates for weights only ------------------------------------------


def test_tensors_formats_takes_paretoq_candidates_for_weights_only(run, tmp_path):
    from quantpatch.analysis.tensor_metrics import NOT_APPLICABLE

    d = tmp_path / "t"
    d.mkdir()
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(12, 40, generator=gen) * 0.1).to(torch.bfloat16)
    w[0, 0] = 3.0  # an outlier: with a 1-bit mean step, its row clips
    x = torch.randn(8, 40, generator=gen)
    torch.save({"tensor": w, "metadata": {"tensor_name": "weight", "layer_idx": 1}}, d / "w.pt")
    torch.save({"tensor": x, "metadata": {"tensor_name": "input", "layer_idx": 1}}, d / "x.pt")
    res = run(
        "tensors", "formats", d, "--json", "--formats", "w1,w1.58,w4g16,mxfp4", "--by", "tensor"
    )
    assert res.code == 0, res
    rows = {(r["tensor"], r["candidate"]): r for r in json.loads(res.out)["rows"]}
    assert len(rows) == 8
    for fmt in ("w1", "w1.58", "w4g16"):
        assert all(v == NOT_APPLICABLE for k, v in rows[("input", fmt)].items() if k != "tensor"
                   and k != "candidate")  # fmt: skip
        r = rows[("weight", fmt)]
        q = ops.fake_quant(w, fmt).double()
        ref = w.double()
        want = 10 * math.log10(float((ref * ref).sum() / ((ref - q) ** 2).sum()))
        assert r["sqnr_db"] == pytest.approx(want, rel=1e-9)
        assert r["rel_error"] == pytest.approx(10 ** (-want / 20), rel=1e-9)
        clipped = ops.paretoq_clipped(w, fmt)
        assert r["overflows %"] == pytest.approx(100 * float(clipped.sum()) / w.numel())
    assert rows[("weight", "w1")]["overflows %"] > 0
    assert rows[("weight", "w4g16")]["sqnr_db"] > rows[("weight", "w1.58")]["sqnr_db"]
    assert isinstance(rows[("input", "mxfp4")]["sqnr_db"], float)
    ordered = json.loads(res.out)["rows"]
    assert [r["sqnr_db"] == NOT_APPLICABLE for r in ordered] == [False] * 5 + [True] * 3
    res = run("tensors", "formats", d, "--formats", "w1.58,mxfp8")  # the table shows n/a
    assert res.code == 0 and "n/a" in res.out
    res = run("tensors", "formats", d, "--formats", "w2g0")
    assert res.code == 2 and "unknown format w2g0" in res.err


def test_paretoq_schemes_listed_chosen_and_scripted_outside_the_default_set(run, tmp_path):
    from quantpatch.launch.registry import load_registry

    reg = load_registry()
    names = ["paretoq_w1.58", "paretoq_w2", "paretoq_w4g128"]
    assert [reg.schemes[n].values() for n in names] == [
        {"linear": v, "qk": "bf16", "pv": "bf16"} for v in ("w1.58", "w2", "w4g128")
    ]
    assert not set(names) & set(reg.pick("schemes", None))
    res = run("list")
    assert res.code == 0 and all(n in res.out for n in names)
    res = run("gen-scripts", "--out", tmp_path / "default")
    assert res.code == 0 and len(list((tmp_path / "default").rglob("*.sh"))) == 60
    res = run("gen-scripts", "--out", tmp_path / "pq", "--schemes", ",".join(names))
    assert res.code == 0, res
    paths = sorted((tmp_path / "pq").rglob("*.sh"))
    assert len(paths) == 18
    dotted = [p for p in paths if p.name.endswith("_paretoq_w1.58.sh")]
    assert len(dotted) == 6 and "readonly QUANT_LINEAR=w1.58" in dotted[0].read_text()
    shellcheck = Path(sys.executable).with_name("shellcheck")
    for path in dotted[:1] + [p for p in paths if p.name.endswith("_w4g128.sh")][:1]:
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
        if shellcheck.exists():
            res = subprocess.run([str(shellcheck), str(path)], capture_output=True, text=True)
            assert res.returncode == 0, res.stdout


def test_row_step_reductions_in_process_on_a_one_rank_group():
    """The TP reductions of a whole per-row step (initial statistics, gradient) on a gloo
    group of one rank: the same numbers as without a group (the two-rank run is
    ``test_tensor_parallel_two_ranks_match_one``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        for fmt in ("w1", "w3"):
            torch.manual_seed(1)
            grouped, plain = _Layer(4, 12, 1, tp=2, tp_group=dist.group.WORLD), _Layer(4, 6, 1)
            plain.weight.data.copy_(grouped.weight.data)
            ops.add_weight_scales(grouped, fmt, partition_dim=1)
            ops.add_weight_scales(plain, fmt, partition_dim=1)
            plain.weight_alpha_numel = grouped.weight_alpha_numel  # the whole weight's k
            x = torch.randn(3, 6)
            for layer in (grouped, plain):
                y = ops.paretoq_linear(
                    layer,
                    _linear,
                    input=x,
                    weight=layer.weight,
                    bias=None,
                    gradient_accumulation_fusion=False,
                )
                y.square().sum().backward()
            assert torch.equal(grouped.weight_alpha, plain.weight_alpha)
            assert torch.equal(grouped.weight_alpha.grad, plain.weight_alpha.grad)
    finally:
        dist.destroy_process_group()


def test_weight_steps_need_the_stock_layer_shapes():
    from quantpatch.sites.codemods.init_sites import inject_weight_steps

    text = "class ColumnParallelLinear:\n    def __init__(self):\n        pass\n"
    with pytest.raises(UserError, match=r"cannot find ColumnParallelLinear\.forward"):
        inject_weight_steps(text, "layers.py")
    with pytest.raises(ValueError, match="not a ParetoQ"):
        ops.paretoq_clipped(torch.ones(2, 2), "nvfp4")
