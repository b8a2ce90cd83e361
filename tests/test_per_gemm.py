"""A value per linear GEMM: ``set --fprop X --dgrad Y --wgrad Z`` writes the three
product sites of the linear autograd function, ``check`` reads them back (``--expect
fprop=...``), the branch and the commit name them, schemes carry them into scripts; on the real
linear autograd function each product's operands are quantized exactly as the ops say, and on
the fork-shaped clone the fork's own three sites take them."""

from __future__ import annotations

import json

import git
import pytest

from quantpatch.base.config import per_gemm
from quantpatch.sites.discovery import discover_sites

from .conftest import LINEAR, snapshot

PER_GEMM = ("--fprop", "nvfp4", "--dgrad", "bf16", "--wgrad", "mxfp8")


def _roles(run, root):
    res = run("check", "--repo", root, "--json")
    assert res.code == 0, res
    return json.loads(res.out)


def test_discovery_tells_the_three_gemms_of_the_linear_function(make_checkout):
    root = make_checkout("0.13.1")
    sites = discover_sites((root / LINEAR).read_text(), LINEAR, "linear")
    by_gemm = {s.gemm: s for s in sites if s.gemm}
    assert set(by_gemm) == {"fprop", "dgrad", "wgrad"}
    assert by_gemm["fprop"].function.endswith(
        "LinearWithGradAccumulationAndAsyncCommunication.forward"
    )
    assert by_gemm["dgrad"].function.endswith(".backward") and by_gemm["wgrad"].line > (
        by_gemm["dgrad"].line
    )


def test_set_per_gemm_writes_each_site_and_check_reads_them(run, make_checkout):
    root = make_checkout("0.13.1")
    res = run("set", "--repo", root, *PER_GEMM)
    assert res.code == 0, res
    report = _roles(run, root)
    assert report["gemms"]["fprop"] == "nvfp4"
    assert report["gemms"]["dgrad"] == "bf16"
    assert report["gemms"]["wgrad"] == "mxfp8"
    assert report["roles"]["linear"] is None and report["mismatched"] == []
    values = {s["gemm"]: s["value"] for s in report["sites"] if s["gemm"]}
    assert values == {"fprop": "nvfp4", "dgrad": "bf16", "wgrad": "mxfp8"}
    repo = git.Repo(root)
    branch = repo.active_branch.name
    assert branch == "quantpatch/linear-fprop.nvfp4+dgrad.bf16+wgrad.mxfp8_qk-bf16_pv-bf16"
    assert repo.head.commit.message.startswith(
        "quantpatch: linear=fprop:nvfp4,dgrad:bf16,wgrad:mxfp8 qk=bf16 pv=bf16"
    )
    ok = run("check", "--repo", root, "--expect", "fprop=nvfp4,dgrad=bf16,wgrad=mxfp8,qk=bf16")
    assert ok.code == 0, ok
    bad = run("check", "--repo", root, "--expect", "wgrad=nvfp4")
    assert bad.code == 1 and "wgrad is mxfp8, expected nvfp4" in bad.out + bad.err
    assert run("check", "--repo", root, "--expect", "linear=nvfp4").code == 1
    # one GEMM more: the others keep their values; --linear sets all three again
    assert run("set", "--repo", root, "--dgrad", "mxfp4").code == 0
    assert _roles(run, root)["gemms"]["fprop"] == "nvfp4"
    assert _roles(run, root)["gemms"]["dgrad"] == "mxfp4"
    assert run("set", "--repo", root, "--linear", "hifp8").code == 0
    report = _roles(run, root)
    assert report["roles"]["linear"] == report["gemms"]["fprop"] == "hifp8"
    assert report["gemms"]["wgrad"] == "hifp8"
    assert git.Repo(root).active_branch.name == "quantpatch/linear-hifp8_qk-bf16_pv-bf16"
    assert run("restore", "--repo", root).code == 0


def test_per_gemm_refusals_change_nothing(run, make_checkout):
    root = make_checkout("0.13.1")
    before = snapshot(root)
    res = run("set", "--repo", root, "--fprop", "w2", "--dgrad", "bf16")
    assert res.code == 2 and "ParetoQ" in res.err and "--linear" in res.err
    res = run("set", "--repo", root, "--wgrad", "nvfp4-rht", "--qk", "nvfp4-rht")
    assert res.code == 2 and "--qk" in res.err
    assert snapshot(root) == before


def test_per_gemm_values_normalise():
    assert per_gemm({"linear": "nvfp4", "wgrad": "nvfp4"}) == {"linear": "nvfp4"}
    assert per_gemm({"linear": "nvfp4-2d", "wgrad": "nvfp4-rht", "qk": "bf16"}) == {
        "fprop": "nvfp4-2d",
        "dgrad": "nvfp4-2d",
        "wgrad": "nvfp4-rht",
        "qk": "bf16",
    }


def test_a_per_gemm_scheme_reaches_the_scripts(run, tmp_path):
    config = tmp_path / "extra.toml"
    config.write_text(
        '[schemes.mixed]\nlinear = "nvfp4"\ndgrad = "bf16"\nwgrad = "mxfp8"\n'
        'qk = "bf16"\npv = "bf16"\ndefault = false\n'
    )
    out = tmp_path / "scripts"
    res = run(
        "gen-scripts", "--out", out, "--config", config, "--schemes", "mixed",
        "--models", "llama32-1b", "--datasets", "wikipedia",
    )  # fmt: skip
    assert res.code == 0, res
    (script,) = out.rglob("pretrain_*_mixed.sh")
    text = script.read_text()
    assert "readonly QUANT_SET=(--fprop nvfp4 --dgrad bf16 --wgrad mxfp8 --qk bf16 --pv bf16)" in (
        text
    )
    assert "readonly QUANT_EXPECT='fprop=nvfp4,dgrad=bf16,wgrad=mxfp8,qk=bf16,pv=bf16'" in text
    assert "readonly QUANT_LINEAR='fprop:nvfp4,dgrad:bf16,wgrad:mxfp8'" in text
    assert 'worktree \\\n    "${QUANT_SET[@]}" --path-only' in text


# -- the real linear autograd function -------------------------------------------------------

PROBE = """
import inspect, sys, torch
from megatron.core.quantpatch import quantpatch_ops as ops
from megatron.core.tensor_parallel.layers import (
    LinearWithGradAccumulationAndAsyncCommunication as Linear,
)

calls = []
real = ops.quant_matmul

def spy(a, b, fmt, **kw):
    out = real(a, b, fmt, **kw)
    backward = "grad_output" in (kw.get("roles") or ()) or kw.get("backward", False)
    calls.append({"fmt": fmt, "backward": backward, "a": a.detach().clone(),
                  "b": b.detach().clone(), "out": out.detach().clone()})
    return out

ops.quant_matmul = spy
values = {
    "bias": None, "gradient_accumulation_fusion": False, "allreduce_dgrad": False,
    "async_grad_allreduce": False, "sequence_parallel": False, "grad_output_buffer": None,
    "wgrad_deferral_limit": 0, "tp_group": None,
}
names = list(inspect.signature(Linear.forward).parameters)[3:]
gen = torch.Generator().manual_seed(0)
w = torch.nn.Parameter((torch.randn(48, 64, generator=gen) * 0.125).to(torch.bfloat16))
x = torch.randn(8, 2, 64, generator=gen).to(torch.bfloat16).requires_grad_()
y = Linear.apply(x, w, *(values[n] for n in names))
gy = torch.randn(y.shape, generator=gen).to(torch.bfloat16)
y.backward(gy)
torch.save({"calls": calls, "x": x.detach(), "w": w.detach(), "y": y.detach(), "gy": gy,
            "dx": x.grad, "dw": w.grad}, sys.argv[1])
"""


@pytest.mark.slow
def test_each_gemm_of_the_real_linear_function_quantizes_as_the_ops_say(
    run, make_checkout, tmp_path
):
    torch = pytest.importorskip("torch")
    from quantpatch.runtime import quantpatch_ops as ops

    from .conftest import run_probe
    from .test_nvfp4 import assert_bits

    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, *PER_GEMM, "--no-branch").code == 0
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    got = run_probe(probe, root, tmp_path / "out.pt")[0]
    calls = got["calls"]
    # dgrad is bf16: its dispatch runs the stock product, quantpatch_ops is not called
    assert [(c["fmt"], c["backward"]) for c in calls] == [("nvfp4", False), ("mxfp8", True)]
    x, w, gy = got["x"], got["w"], got["gy"]
    fprop, wgrad = calls
    assert_bits(fprop["a"], x)  # the operands as the layer holds them
    assert_bits(fprop["b"], w.t())
    # a bf16 product of NVFP4 operands: code x block scale, the tensor scales on its float32
    # result (each factored operand times its scale is fake_quant's, before rounding)
    from quantpatch.runtime import quantpatch_quantize as qz

    (tx, fx), (tw, fw) = qz.quantize_factored(x, "nvfp4"), qz.quantize_factored(w.t(), "nvfp4", -2)
    assert_bits(qz.dequantized(tx, fx), ops.fake_quant(x, "nvfp4"))
    want_y = qz.scaled_matmul(tx, fx, tw, fw)
    assert_bits(got["y"], want_y)
    assert_bits(got["dx"], gy.matmul(w))  # the stock input gradient
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    assert_bits(wgrad["a"], g2.t())
    assert_bits(wgrad["b"], x2)
    want_dw = torch.matmul(
        ops.fake_quant(g2.t(), "mxfp8", backward=True),
        ops.fake_quant(x2, "mxfp8", dim=-2, backward=True),
    )
    assert_bits(got["dw"], want_dw)
    assert not torch.equal(got["dw"], g2.t().matmul(x2))  # the quantization did something


# -- the fork-shaped clone --------------------------------------------------------------------


def test_the_forks_own_three_sites_take_a_value_each(run, trees, tmp_path):
    from .forklike import build_fork, clone_quant

    fork = build_fork(tmp_path / "origin", trees["0.13.1"], full=False)
    root = clone_quant(fork, tmp_path / "Megatron-LM")
    res = run("set", "--repo", root, "--fprop", "mxfp8", "--dgrad", "bf16", "--wgrad", "hifp8")
    assert res.code == 0, res
    report = _roles(run, root)
    linear = [s for s in report["sites"] if s["role"] == "linear"]
    assert {s["gemm"] for s in linear} >= {"fprop", "dgrad", "wgrad"}
    for site in linear:
        want = {"fprop": "mxfp8", "dgrad": "bf16", "wgrad": "hifp8"}[site["gemm"] or "fprop"]
        assert site["value"] == want, site
        text = (root / site["file"]).read_text().splitlines()[site["line"] - 1]
        assert f"'{want}'" in text or f'"{want}"' in text
    assert run("check", "--repo", root, "--expect", "fprop=mxfp8,dgrad=bf16,wgrad=hifp8").code == 0
    # a value the fork's own chain does not know is refused before init, naming the GEMM
    before = snapshot(root)
    res = run("set", "--repo", root, "--wgrad", "nvfp4-rht")
    assert res.code == 2 and "not 'nvfp4-rht'" in res.err and "--wgrad" in res.err
    assert snapshot(root) == before
