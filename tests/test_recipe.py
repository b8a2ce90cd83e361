"""NVIDIA's NVFP4 recipe as schemes: ``nvfp4_recipe`` trains the tiny megatron-core
GPT on CPU with finite, falling loss and computes something else than bf16, and one ``sweep``
over the recipe and its ablations (stub ``torchrun``) reports one row each."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from quantpatch.launch.registry import load_registry

from .conftest import LINEAR, git_out, tiny_gpt

RECIPE = (
    "nvfp4_recipe",
    "nvfp4_recipe_no_rht",
    "nvfp4_recipe_no_bf16_layers",
    "nvfp4_recipe_no_2d",
    "nvfp4_recipe_4over6",  # the recipe with TE's 4over6 block scaling
)


def test_the_recipe_and_its_ablations_differ_in_one_part_each():
    schemes = load_registry().schemes
    full = schemes["nvfp4_recipe"].values()
    assert full == {
        "fprop": "nvfp4-2d",
        "dgrad": "nvfp4-2d",
        "wgrad": "nvfp4-rht",
        "qk": "bf16",
        "pv": "bf16",
        "bf16_layers": "recipe,output",  # the output layer in BF16 too, as the paper keeps it
    }
    for name, part in (
        ("nvfp4_recipe_no_rht", {"wgrad": "nvfp4"}),
        ("nvfp4_recipe_no_2d", {"fprop": "nvfp4", "dgrad": "nvfp4"}),
    ):
        assert schemes[name].values() == {**full, **part}
    without = {**full, "bf16_layers": "output"}  # the transformer layers all in NVFP4
    assert schemes["nvfp4_recipe_no_bf16_layers"].values() == without
    assert not any(schemes[n].default for n in RECIPE)  # outside the default ten


def test_the_4over6_recipe_is_the_recipe_with_te_4over6_and_no_hadamard_transform():
    """TransformerEngine's NVFP4BlockScaling(nvfp4_4over6="all") with its defaults (MAE, E4M3
    bound 256) on every linear GEMM: 4over6 for the inputs and the 16 x 16 weight tiles, NVFP4's
    stochastic gradients, no Hadamard transform (TE refuses it beside 4over6), the BF16 layers
    and the output layer as nvfp4_recipe keeps them; Megatron has no flag for it."""
    scheme = load_registry().schemes["nvfp4_recipe_4over6"]
    assert scheme.values() == {
        "linear": "nvfp4-4over6-mae",
        "qk": "bf16",
        "pv": "bf16",
        "bf16_layers": "recipe,output",
    }
    assert not scheme.default and scheme.megatron_flags() == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "baseline, scheme, expect",
    [
        # the recipe quantizes layers 2-5 of 6 (1 and 6 stay bf16): not bf16's losses
        ("bf16", "nvfp4_recipe",
         "fprop=nvfp4-2d,dgrad=nvfp4-2d,wgrad=nvfp4-rht,qk=bf16,bf16_layers=recipe,output"),
        # 4over6's block scales: not nvfp4-2d's losses
        ("nvfp4_recipe", "nvfp4_recipe_4over6",
         "linear=nvfp4-4over6-mae,qk=bf16,pv=bf16,bf16_layers=recipe,output"),
    ],
)  # fmt: skip
def test_the_recipe_trains_the_tiny_gpt_on_cpu(run, make_checkout, baseline, scheme, expect):
    """The scheme trains (10 finite losses, falling) and differs from its baseline's run."""
    pytest.importorskip("torch")
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    cfg = {"device": "cpu", "steps": 10, "vocab": 256, "layers": 6, "hidden": 64, "heads": 4}
    cfg |= {"seq": 32, "batch": 2}
    res = run("set", "--repo", root, "--scheme", baseline, "--no-branch")
    assert res.code == 0, res
    before = tiny_gpt(root, cfg)["losses"]
    assert run("restore", "--repo", root).code == 0
    res = run("set", "--repo", root, "--scheme", scheme, "--no-branch")
    assert res.code == 0, res
    assert run("check", "--repo", root, "--expect", expect).code == 0
    losses = tiny_gpt(root, cfg)["losses"]
    assert isinstance(losses, list) and isinstance(before, list)
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.05, losses
    assert losses != before


@pytest.mark.slow
def test_one_sweep_reports_the_recipe_and_each_ablation(tmp_path, make_checkout, monkeypatch, run):
    from .test_scripts import QUANTPATCH
    from .test_sweep import SBATCH, SQUEUE, TORCHRUN

    root = make_checkout("0.13.1", inject=False)
    assert run("init", "--repo", root).code == 0
    bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub.mkdir()
    for name, text in (("torchrun", TORCHRUN), ("sbatch", SBATCH), ("squeue", SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_DIR", str(stub))
    monkeypatch.setenv("QUANTPATCH", QUANTPATCH)
    out = tmp_path / "sweep"
    res = run(
        "sweep", "run", out, "--models", "llama32-1b", "--datasets", "wikipedia",
        "--profile", "smoke", "--schemes", ",".join(RECIPE), "--repo", root,
    )  # fmt: skip
    assert res.code == 0, res
    assert f"{len(RECIPE)} of {len(RECIPE)} finished, 0 failed" in res.out
    rec = json.loads((out / "sweep.json").read_text())
    assert sorted(r["scheme"] for r in rec["runs"]) == sorted(RECIPE)
    parsed = json.loads(
        subprocess.run(
            [QUANTPATCH, "runs", "--json", str(out / "runs")], capture_output=True, text=True
        ).stdout
    )["runs"]
    assert sorted((r["scheme"], r["iterations"]) for r in parsed) == [
        (s, 4) for s in sorted(RECIPE)
    ]
    html = (out / "report.html").read_text()
    for name in RECIPE:
        assert html.count(name) >= 1
    # each run trained its own commit, whose sources hold the scheme's values and policy
    commits = {r["scheme"]: r["commit"] for r in rec["runs"]}
    assert len(set(commits.values())) == len(RECIPE)
    for name, commit in commits.items():
        linear = git_out(root, "show", f"{commit}:{LINEAR}")
        policy = "'output'" if name == "nvfp4_recipe_no_bf16_layers" else "'recipe,output'"
        assert f"quantpatch_bf16_layers = {policy}" in linear
        rht = name not in ("nvfp4_recipe_no_rht", "nvfp4_recipe_4over6")
        assert ("'nvfp4-rht'" in linear) == rht
        assert ("'nvfp4-4over6-mae'" in linear) == (name == "nvfp4_recipe_4over6")


TE_RECIPES = {  # NVIDIA's MXFP8 recipe and TransformerEngine's two FP8 recipes
    "mxfp8_recipe": "fprop=mxfp8-rceil,dgrad=mxfp8-rceil,wgrad=mxfp8-rceil,qk=bf16,pv=bf16",
    "linear_fp8-tensor": "linear=fp8-tensor,qk=bf16,pv=bf16",
    "linear_fp8-block": "linear=fp8-block,qk=bf16,pv=bf16",
}


def test_the_fp8_and_rceil_schemes_are_declared_outside_the_default_set():
    schemes = load_registry().schemes
    assert schemes["mxfp8_recipe"].values() == {"linear": "mxfp8-rceil", "qk": "bf16", "pv": "bf16"}
    for name, linear, qk in (
        ("linear_mxfp8-rceil", "mxfp8-rceil", "bf16"),
        ("FA_linear_mxfp8-rceil", "mxfp8-rceil", "mxfp8-rceil"),
        ("linear_mxfp4-rceil", "mxfp4-rceil", "bf16"),
        ("linear_fp8-tensor", "fp8-tensor", "bf16"),
        ("linear_fp8-block", "fp8-block", "bf16"),
    ):
        assert schemes[name].values() == {"linear": linear, "qk": qk, "pv": "bf16"}
        assert not schemes[name].default
    assert not schemes["mxfp8_recipe"].default


@pytest.mark.slow
def test_the_fp8_recipes_train_the_tiny_gpt_on_cpu(run, make_checkout):
    """mxfp8_recipe, linear_fp8-tensor and linear_fp8-block: set, checked, and the tiny GPT
    trains with finite, falling loss that differs from bf16's."""
    pytest.importorskip("torch")
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    cfg = {"device": "cpu", "steps": 8, "vocab": 256, "layers": 2, "hidden": 64, "heads": 4}
    cfg |= {"seq": 32, "batch": 2}
    assert run("set", "--repo", root, "--scheme", "bf16", "--no-branch").code == 0
    plain = tiny_gpt(root, cfg)["losses"]
    assert run("restore", "--repo", root).code == 0
    for scheme, expect in TE_RECIPES.items():
        res = run("set", "--repo", root, "--scheme", scheme, "--no-branch")
        assert res.code == 0, res
        assert run("check", "--repo", root, "--expect", expect).code == 0, scheme
        losses = tiny_gpt(root, cfg)["losses"]
        assert isinstance(losses, list) and len(losses) == 8, (scheme, losses)
        assert all(math.isfinite(v) for v in losses), (scheme, losses)
        assert losses[-1] < losses[0] - 0.05, (scheme, losses)
        assert losses != plain, scheme
        assert run("restore", "--repo", root).code == 0
