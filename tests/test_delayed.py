"""FP8 delayed scaling (``fp8-delayed``, ``fp8-delayed-e4m3``): the runtime's update and
quantized operands against TransformerEngine's delayed-scaling update, step by step.

Two references: TE's fused kernel ``fused_amax_and_scale_update_after_reduction``
(``transformer_engine/common/recipe/delayed_scaling.cu``: what TE runs on a GPU, so the one the
runtime follows), transcribed below as a scalar float32 loop; and TE 2.20.2's unfused Python
update ``_amax_and_scale_update`` run as TE ships it (``tests/te_reference.py``), which differs
from the kernel in exactly two points the tests pin down: it rolls the history at amax 0, and
computes ``reciprocal(amax) * fp8_max`` instead of one division.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from quantpatch.analysis import tensors
from quantpatch.runtime import quantpatch_delayed as qd
from tests.te_reference import te_delayed_update

FP8_DTYPE = {448.0: torch.float8_e4m3fn, 57344.0: torch.float8_e5m2}


def kernel_update(
    history: list[float], scale: float, amax: float, algo: str, fp8_max: float, margin: int
) -> tuple[list[float], float]:
    """TE's ``kernel_bulk`` for one scale, transcribed as scalar float32 code."""
    f32 = np.float32
    scaled_max = f32(fp8_max) * f32(np.power(f32(2.0), f32(-margin)))
    last = f32(amax)
    n = len(history)
    running = f32(0.0)
    new = [f32(h) for h in history]
    if last != 0:
        for i in range(n):
            a = f32(history[i + 1]) if i < n - 1 else last
            running = np.fmax(running, a)
            new[i] = a if i > 0 else f32(0.0)
    chosen = last if algo == "most_recent" else running
    if np.isfinite(chosen) and chosen > 0:
        with np.errstate(over="ignore", divide="ignore"):
            s = f32(scaled_max / chosen)
    else:
        s = f32(scale)
    if np.isinf(s):
        s = f32(np.finfo(np.float32).max)
    return [float(x) for x in new], float(s)


def reference_quantize(x: torch.Tensor, scale: float, fp8_max: float) -> torch.Tensor:
    """TE's delayed-scaling cast (``satfinite``) with torch's own FP8 dtypes, dequantized with
    the float32 reciprocal of the scale; non-finite elements left as they are."""
    v = x.to(torch.float32)
    s = torch.tensor(scale, dtype=torch.float32)
    finite = torch.isfinite(v)
    p = torch.clamp(torch.where(finite, v, 0.0) * s, -fp8_max, fp8_max)
    q = p.to(FP8_DTYPE[fp8_max]).to(torch.float32)
    return torch.where(finite, q * torch.reciprocal(s), v).to(x.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ in their bits (NaN payloads compared too)."""
    ia = a.to(torch.float32).view(torch.int32)
    ib = b.to(torch.float32).view(torch.int32)
    return int((ia != ib).sum())


def step_inputs(t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``t``'s input and output gradient: magnitudes changing from step to step (2^-20 to
    2^12), step 3 all zero, step 5 with an Inf (and a NaN, which TE's amax leaves out)."""
    mag = 2.0 ** [0, 3, -2, 0, 7, 1, -20, 12, -1, 4][t % 10]
    x = torch.randn(8, 64, generator=gen) * mag
    g = torch.randn(8, 32, generator=gen) * mag * 1e-3
    if t == 3:
        x.zero_()
        g.zero_()
    if t == 5:
        x[0, 0] = float("inf")
        x[1, 1] = float("nan")
        g[2, 3] = float("-inf")
    return x, g


CASES = [
    (fmt, length, algo, margin)
    for fmt in qd.DELAYED_FORMATS
    for length, algo in ((1, "most_recent"), (16, "max"))
    for margin in (0, 1)
]


@pytest.mark.parametrize(("fmt", "length", "algo", "margin"), CASES)
def test_every_step_equals_te_kernel_update_bit_for_bit(
    fmt: str, length: int, algo: str, margin: int
) -> None:
    """T = 10 steps with changing inputs, an all-zero step and an Inf step: every quantized
    operand (forward input and weight, the dgrad's output gradient and weight, the wgrad's
    output gradient and input) equals the cast under the scales TE's kernel computes from the
    same amaxes, and the state (history, scales) equals the kernel's after every step."""
    config = types.SimpleNamespace(
        fp8_amax_history_len=length, fp8_amax_compute_algo=algo, fp8_margin=margin
    )
    state = qd.DelayedState(qd.recipe_for(fmt, config))
    recipe = state.recipe
    maxes = [recipe.fp8_max(c) for c in (qd.INPUT, qd.WEIGHT, qd.GRAD)]
    gen = torch.Generator().manual_seed(52)
    w = torch.randn(32, 64, generator=gen)
    hist = [[0.0] * length for _ in range(3)]
    scales = [1.0, 1.0, 1.0]  # TE's first step
    mismatches = operands = 0
    for t in range(10):
        x, g = step_inputs(t, gen)
        if t:  # an optimizer step changed the weight
            w.mul_(1.5 if t != 6 else 2.0**-30)
        (xq, _), (wq, _) = state.forward_operands(x, w)  # float32: not factored
        (gq, _), (wq_d, _) = state.dgrad_operands(g, w)
        out = qd.delayed_matmul(g.t(), x, fmt, backward=True, weight=None)
        expect_x = reference_quantize(x, scales[0], maxes[0])
        expect_w = reference_quantize(w, scales[1], maxes[1])
        expect_g = reference_quantize(g, scales[2], maxes[2])
        for got, want in ((xq, expect_x), (wq, expect_w), (gq, expect_g), (wq_d, expect_w)):
            mismatches += same_bits(got, want)
            operands += want.numel()
        ref_out = torch.matmul(expect_g.t(), expect_x)
        mismatches += same_bits(out, ref_out)
        # the kernel's update after the step, from the same amaxes
        for c, tensor in ((0, x), (1, w), (2, g)):
            v = tensor.abs()
            amax = float(torch.where(torch.isnan(v), 0.0, v).max())
            hist[c], scales[c] = kernel_update(hist[c], scales[c], amax, algo, maxes[c], margin)
        state.flush([qd.INPUT, qd.WEIGHT, qd.GRAD])
        assert state.scale.tolist() == scales, t
        assert state.amax_history.t().tolist() == hist, t
    assert operands == 48640 and mismatches == 0


def te_python_step(
    history: torch.Tensor, scale: torch.Tensor, amax: float, fp8_max: float, algo: str, margin: int
) -> None:
    """One step of TE's unfused update as TE runs it: the reduced amax in ``history[0]``, then
    ``_amax_and_scale_update``."""
    recipe = types.SimpleNamespace(
        amax_compute_algo=algo, scaling_factor_compute_algo=None, margin=margin
    )
    history[0] = amax
    te_delayed_update()(history, scale, fp8_max, recipe)


@pytest.mark.parametrize(("length", "algo", "margin"), [(1, "most_recent", 0), (16, "max", 1)])
def test_te_python_update_differs_from_the_kernel_only_in_its_two_known_points(
    length: int, algo: str, margin: int
) -> None:
    """Over 400 steps of random amaxes (none zero), the runtime's scales equal TE's unfused
    update except where its ``reciprocal(amax) * fp8_max`` rounds differently from the
    kernel's one division; there the runtime's is the division's."""
    gen = torch.Generator().manual_seed(9)
    amaxes = (
        torch.rand(400, generator=gen) * 2.0 ** torch.randint(-30, 30, (400,), generator=gen)
    ).tolist()
    recipe = qd.DelayedRecipe(history_len=length, algo=algo, margin=margin)
    ours_h = torch.zeros(length, 1)
    ours_s = torch.ones(1)
    te_h = torch.zeros(length, 1)
    te_s = torch.ones(1)
    scaled = recipe.scaled_max(qd.INPUT)
    differ = 0
    for amax in amaxes:
        chosen = (
            torch.tensor([amax], dtype=torch.float32)
            if algo == "most_recent"
            else torch.cat([ours_h[1:, 0], torch.tensor([amax])]).amax().reshape(1)
        )
        ours_h, ours_s = qd.update(ours_h, ours_s, torch.tensor([amax]), algo, scaled)
        te_python_step(te_h, te_s, amax, 448.0, algo, margin)
        assert torch.equal(ours_h, te_h)
        if not torch.equal(ours_s, te_s):
            differ += 1
            assert ours_s.item() == torch.div(scaled, chosen).item()
            assert te_s.item() == ((torch.reciprocal(chosen) * 448.0) / 2**margin).item()
            te_s.copy_(ours_s)  # the next step starts from the same scale
    # about 28 % of amaxes round differently (10^6 uniform mantissas: 27.998 %)
    assert 400 * 0.15 < differ < 400 * 0.45


def test_a_zero_amax_step_rolls_te_python_history_but_not_the_kernels() -> None:
    """History 4 / max: after amaxes 8, 2, a step whose amax is 0 keeps the kernel's history
    and scale (the runtime's too), where TE's unfused update rolls 8 out of its window."""
    recipe = qd.DelayedRecipe(history_len=4, algo="max")
    h = torch.zeros(4, 1)
    s = torch.ones(1)
    te_h, te_s = torch.zeros(4, 1), torch.ones(1)
    for amax in (8.0, 2.0, 0.0, 0.0, 0.0):
        h, s = qd.update(h, s, torch.tensor([amax]), "max", recipe.scaled_max(qd.INPUT))
        te_python_step(te_h, te_s, amax, 448.0, "max", 0)
    assert s.item() == 448.0 / 8.0  # the window still holds 8
    assert h[:, 0].tolist() == [0.0, 0.0, 8.0, 2.0]
    assert te_h[:, 0].tolist() == [0.0, 0.0, 0.0, 0.0] and te_s.item() == 448.0 / 2.0


def test_first_step_scale_is_one_and_an_infinite_amax_keeps_the_scale() -> None:
    state = qd.DelayedState(qd.recipe_for("fp8-delayed"))
    assert state.scale.tolist() == [1.0, 1.0, 1.0]
    x = torch.full((4, 4), 1000.0)
    (xq, _), _ = state.forward_operands(x, torch.ones(2, 4))
    assert torch.all(xq == 448.0)  # scale 1: saturated
    state.forward_operands(x.new_full((4, 4), float("inf")), torch.ones(2, 4))
    expected = torch.div(torch.tensor(448.0), torch.tensor(1000.0)).item()
    assert state.scale[qd.INPUT].item() == expected  # from the finite step before
    tiny = torch.full((4, 4), 1e-45)  # 448 / 1.4e-45 overflows: float32's max
    state.forward_operands(tiny, torch.ones(2, 4))
    state.forward_operands(tiny, torch.ones(2, 4))
    assert state.scale[qd.INPUT].item() == torch.finfo(torch.float32).max


def test_the_state_stays_float32_when_megatron_casts_the_model_to_bf16() -> None:
    layer = torch.nn.Linear(4, 2)
    qd.add_delayed_state(layer, "fp8-delayed")
    layer.bfloat16()
    assert layer.fp8_delayed.scale.dtype == torch.float32
    assert set(layer.state_dict()) >= {"fp8_delayed.amax_history", "fp8_delayed.scale"}


def test_a_checkpoint_without_the_state_loads_as_a_fresh_state() -> None:
    """A layer saved under another value (no ``fp8_delayed`` keys) loads strictly."""
    plain = torch.nn.Linear(4, 2)
    layer = torch.nn.Linear(4, 2)
    qd.add_delayed_state(layer, "fp8-delayed")
    layer.fp8_delayed.scale.fill_(3.0)
    layer.load_state_dict(plain.state_dict())
    assert torch.equal(layer.weight, plain.weight)
    assert layer.fp8_delayed.scale.tolist() == [3.0, 3.0, 3.0]


def test_a_product_without_a_layer_state_is_refused_in_one_sentence() -> None:
    """No layer weight, or a weight whose layer keeps no state: one sentence, a ValueError."""
    plain = torch.ones(4, 2)
    for weight in (None, "b"):
        with pytest.raises(ValueError, match="no layer weight") as err:
            qd.delayed_matmul(torch.ones(2, 4), plain, "fp8-delayed", backward=False, weight=weight)
        assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


# -- through the checkout: set, check --expect, a tiny GPT trains -------------------------------


def test_the_delayed_values_are_linear_only_and_all_three_gemms_at_once(run, make_checkout):
    """``set --qk fp8-delayed`` and a delayed value on one GEMM of three are refused in one
    sentence, changing nothing; ``set --linear fp8-delayed`` is checked by ``check --expect``."""
    from .conftest import snapshot

    root = make_checkout("0.13.1")
    before = snapshot(root)
    res = run("set", "--repo", root, "--qk", "fp8-delayed")
    assert res.code == 2 and "amax history" in res.err and snapshot(root) == before, res
    res = run("set", "--repo", root, "--fprop", "fp8-delayed", "--dgrad", "fp8-tensor",
              "--wgrad", "fp8-tensor")  # fmt: skip
    assert res.code == 2 and "--linear fp8-delayed" in res.err and snapshot(root) == before, res
    assert run("set", "--repo", root, "--linear", "fp8-delayed-e4m3", "--no-branch").code == 0
    assert run("check", "--repo", root, "--expect", "linear=fp8-delayed-e4m3").code == 0


@pytest.mark.slow
def test_a_tiny_gpt_trains_under_linear_fp8_delayed(run, make_checkout):
    """The scheme ``linear_fp8-delayed`` on an ``init``ed megatron-core 0.13.1: every linear
    layer (qkv, proj, fc1, fc2, and the output layer) keeps its state, and the loss falls."""
    import math

    from .conftest import tiny_gpt

    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    res = run("set", "--repo", root, "--scheme", "linear_fp8-delayed", "--no-branch")
    assert res.code == 0, res
    assert run("check", "--repo", root, "--expect", "linear=fp8-delayed,qk=bf16,pv=bf16").code == 0
    cfg = {"device": "cpu", "steps": 12, "vocab": 256, "layers": 2, "hidden": 64, "heads": 4}
    cfg |= {"seq": 32, "batch": 2}
    res = tiny_gpt(root, cfg)
    losses, scales = res["losses"], res["delayed"]
    assert isinstance(losses, list) and len(losses) == 12
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses
    # 2 layers x (qkv, proj, fc1, fc2) and the output layer (its weight the embedding's)
    assert isinstance(scales, list) and len(scales) == 9, scales
    for s in scales:  # every operand's scale moved from 1.0 to fp8_max / an amax
        assert all(math.isfinite(v) and v not in (0.0, 1.0) for v in s), scales


# -- two ranks over gloo, and a checkpoint resumed in a fresh process ---------------------------

WORKER = Path(__file__).with_name("delayed_worker.py")


def _worker(root: Path, out: Path, *args: str) -> object:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env.pop("CUSTOM_QUANT_TYPE", None)
    env["PYTHONPATH"] = str(root)
    res = subprocess.run(
        [sys.executable, str(WORKER), str(out), *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture
def delayed_checkout(run, make_checkout) -> Path:  # type: ignore[no-untyped-def]
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, "--linear", "fp8-delayed", "--no-branch").code == 0
    return root  # type: ignore[no-any-return]


@pytest.mark.slow
def test_two_ranks_reduce_their_amaxes_to_the_max_over_both(delayed_checkout, tmp_path):
    """DP 2 and TP 2 (two processes, gloo; history 4, max): every amax a layer records is the
    max of the two ranks' own for that operand and step, and both ranks hold the same
    histories and scales after every step; under ``tp_only_amax_red`` with TP 1 each rank keeps
    its own (TE's TP x CP group is the rank alone)."""
    results = _worker(delayed_checkout, tmp_path / "dist.pt", "dist")
    assert isinstance(results, dict)
    for label in ("dp2", "tp2", "dp2_tp_only"):
        ranks = results[label]
        differ = 0
        for step0, step1 in zip(ranks[0], ranks[1], strict=True):
            assert len(step0["local"]) == len(step1["local"]) == 4  # col, row; fwd, bwd
            for (n0, a0), (n1, a1) in zip(step0["local"], step1["local"], strict=True):
                assert n0 == n1 and a0.keys() == a1.keys()
                differ += sum(a0[c] != a1[c] for c in a0)
            pairs = [
                *zip(step0["history"], step1["history"], strict=True),
                *zip(step0["scales"], step1["scales"], strict=True),
            ]
            same = all(torch.equal(x0, x1) for x0, x1 in pairs)
            assert same == (label != "dp2_tp_only"), label
        assert differ > 0, label  # the ranks saw different amaxes
        # after each step, history[0] holds the step's amaxes (rolled by the next flush):
        # the max over both ranks' own, or under tp_only_amax_red the rank's own
        checked = 0
        for r in (0, 1):
            for t, step in enumerate(ranks[r]):
                for layer, h in zip(("col", "row"), step["history"], strict=True):
                    mine = {c: a for n, d in step["local"] if n == layer for c, a in d.items()}
                    other = ranks[1 - r][t]["local"]
                    theirs = {c: a for n, d in other if n == layer for c, a in d.items()}
                    assert sorted(mine) == [0, 1, 2]  # input, weight, output gradient
                    for c, a in mine.items():
                        want = a if label == "dp2_tp_only" else max(a, theirs[c])
                        assert h[0, c].item() == torch.tensor(want).item(), (label, t, layer)
                        checked += 1
        assert checked == 2 * 3 * 2 * 3, label


@pytest.mark.slow
def test_a_checkpoint_at_step_3_resumes_steps_4_to_6_identically(delayed_checkout, tmp_path):
    """Six Adam steps uninterrupted, against three, the layers' state_dict (with ``fp8_delayed``
    in it) and Adam's saved, and a fresh process that loads them and runs steps 4 to 6:
    losses, outputs, histories and scales bit for bit the same. Megatron's sharded checkpoint
    carries the state as replicated tensors."""
    ckpt = tmp_path / "ckpt.pt"
    whole = _worker(delayed_checkout, tmp_path / "whole.pt", "run", "6")
    _worker(delayed_checkout, tmp_path / "first.pt", "save", "3", str(ckpt))
    resumed = _worker(delayed_checkout, tmp_path / "resumed.pt", "resume", "6", str(ckpt))
    assert isinstance(whole, list) and isinstance(resumed, list)
    *steps, meta = whole
    *later, _ = resumed
    assert len(steps) == 6 and len(later) == 3
    for a, b in zip(steps[3:], later, strict=True):
        assert a["loss"] == b["loss"] and torch.equal(a["out"], b["out"])
        for key in ("scales", "history"):
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key
    assert steps[5]["scales"][0].tolist() != [1.0, 1.0, 1.0]
    assert meta["sharded"] == {
        "col.fp8_delayed.amax_history": ("ShardedTensor", (4, 3), (0, 0, 0)),
        "col.fp8_delayed.scale": ("ShardedTensor", (3,), (0, 0, 0)),
    }


def test_tensors_formats_measures_the_scale_a_history_settles_on() -> None:
    """``tensors formats`` takes a delayed value as the scale its history settles on when it
    holds the tensor's own amax: TE's cast under the kernel's ``fp8_max / amax`` (E5M2 for
    ``fp8-delayed``'s gradient, E4M3 for ``-e4m3``'s), 1 for an all-zero tensor; the sums
    then equal fp8-tensor's where the two agree (finite tensors)."""
    from quantpatch.analysis.tensor_metrics import formats_sums

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 37.0
    amax = x.abs().max()
    for fmt, backward, fp8_max in (
        ("fp8-delayed", False, 448.0), ("fp8-delayed", True, 57344.0),
        ("fp8-delayed-e4m3", True, 448.0),
    ):  # fmt: skip
        scale = torch.div(torch.tensor(fp8_max), amax).item()
        got = qd.settled_quantize(x, fmt, backward)
        assert same_bits(got, reference_quantize(x, scale, fp8_max)) == 0, (fmt, backward)
    zeros = torch.zeros(4, 32)
    assert torch.equal(qd.settled_quantize(zeros, "fp8-delayed"), zeros)
    sums = formats_sums(x.bfloat16(), ("fp8-delayed", "fp8-tensor"), -1, True)
    assert sums["fp8-delayed"].noise == sums["fp8-tensor"].noise > 0
    assert "fp8-delayed" in tensors.FORMATS and "fp8-delayed-e4m3" in tensors.FORMATS
