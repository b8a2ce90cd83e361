"""`init` / `init --remove` on stock megatron-core releases, and what the result computes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import git
import pytest

from quantpatch.checkout.init import (
    FLASH_MODULE,
    KERNELS_MODULE,
    OPS_MODULE,
    ops_source,
    runtime_source,
)

from .conftest import ATTENTION, LINEAR, VERSIONS, run_probe, snapshot, tiny_gpt

PROBE = Path(__file__).with_name("megatron_probe.py")


def _probe_inputs(torch):
    """The seeded input, weight and output gradient ``linear_probe`` feeds the layer."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 96, generator=gen).to(torch.bfloat16)
    w = (torch.randn(80, 96, generator=gen) * 96**-0.5).to(torch.bfloat16)
    gy = torch.randn(64, 1, 80, generator=gen).to(torch.bfloat16)
    return x, w, gy


@pytest.mark.parametrize("version", VERSIONS)
def test_init_and_remove_round_trip(run, make_checkout, version):
    root = make_checkout(version, inject=False)
    before = snapshot(root)
    res = run("init", "--repo", root)
    assert res.code == 0, res
    data = json.loads(run("check", "--json", "--repo", root).out)
    # the attention forward reads P.V's format (a label site), then Q.K^T's, at its top for
    # the flash route of the FA schemes; the P.V product has its own site
    assert [(s["role"], s["value"], s["form"]) for s in data["sites"]] == [
        ("linear", "bf16", "literal"),  # the linear autograd function: forward,
        ("linear", "bf16", "literal"),  # input gradient,
        ("linear", "bf16", "literal"),  # weight gradient
        ("linear", "bf16", "literal"),  # ColumnParallelLinear.__init__: ParetoQ steps
        ("linear", "bf16", "literal"),  # RowParallelLinear.__init__
        ("pv", "bf16", "label"),
        ("qk", "bf16", "literal"),
        ("pv", "bf16", "literal"),
    ]
    assert (root / OPS_MODULE).read_text() == ops_source()
    assert (root / KERNELS_MODULE).read_text() == runtime_source(KERNELS_MODULE)
    assert (root / FLASH_MODULE).read_text() == runtime_source(FLASH_MODULE)
    repo = git.Repo(root)
    assert repo.head.commit.message.startswith("quantpatch init:") and not repo.is_dirty()
    assert run("init", "--repo", root).code == 2
    # a set is active: init --remove refuses until restore
    assert run("set", "--repo", root, "--qk", "mxfp8").code == 0
    res = run("init", "--repo", root, "--remove")
    assert res.code == 2 and "restore" in res.err
    assert run("restore", "--repo", root).code == 0
    res = run("init", "--repo", root, "--remove")
    assert res.code == 0, res
    after = snapshot(root)
    assert after["files"] == before["files"]
    assert repo.head.commit.message.startswith("quantpatch init --remove")
    res = run("init", "--repo", root, "--remove")
    assert res.code == 2 and "nothing to remove" in res.err


def test_init_refusals(run, make_checkout, tmp_path, monkeypatch):
    # sites already, dispatching to quantpatch_ops, but no ParetoQ steps in the layers'
    # constructors: init adds only those (the attention file has nothing to teach)
    forked = make_checkout()
    attention = (forked / ATTENTION).read_bytes()
    assert run("set", "--repo", forked, "--linear", "w2").code == 2
    assert run("init", "--repo", forked).code == 0
    assert (forked / ATTENTION).read_bytes() == attention
    functions = {
        s["function"] for s in json.loads(run("check", "--json", "--repo", forked).out)["sites"]
    }
    assert {"ColumnParallelLinear.__init__", "RowParallelLinear.__init__"} <= functions
    before = snapshot(forked)
    res = run("init", "--repo", forked)
    assert res.code == 2 and "already initialised by quantpatch" in res.err
    assert snapshot(forked) == before
    stock = make_checkout(inject=False)
    (stock / LINEAR).write_text((stock / LINEAR).read_text() + "# edit\n")
    res = run("init", "--repo", stock)
    assert res.code == 2 and f"uncommitted changes to {LINEAR}" in res.err
    git.Repo(stock).git.checkout("--", LINEAR)
    (stock / OPS_MODULE).parent.mkdir(parents=True)
    (stock / OPS_MODULE).write_text("# someone else's module\n")
    res = run("init", "--repo", stock)
    assert res.code == 2 and "a different file is already there" in res.err
    (stock / OPS_MODULE).unlink()
    assert run("init", "--repo", stock).code == 0
    p = stock / ATTENTION
    p.write_text(p.read_text().replace("custom_quant_type = 'bf16'", "custom_quant_type = 'x'", 1))
    git.Repo(stock).git.commit("-qam", "hand edit")
    res = run("init", "--repo", stock, "--remove")
    assert res.code == 2 and "changed since 'quantpatch init'" in res.err
    # without git: still all-or-nothing and removable
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    plain = make_checkout(inject=False, use_git=False)
    plain_before = snapshot(plain)
    assert run("init", "--repo", plain).code == 0
    assert run("init", "--repo", plain, "--remove").code == 0
    assert snapshot(plain) == plain_before


def _probe(root: Path, out: Path) -> dict:
    return run_probe(PROBE, root, out)[0]


@pytest.mark.parametrize(
    "version",  # the older release only in the full suite (22 s each)
    [pytest.param(v, marks=pytest.mark.slow) if v != VERSIONS[-1] else v for v in VERSIONS],
)
def test_initialised_checkout_computes_bit_identically_then_quantizes(
    run, make_checkout, tmp_path, version
):
    torch = pytest.importorskip("torch")
    from quantpatch.runtime.quantpatch_ops import quant_matmul

    stock = make_checkout(version, inject=False, full=True)
    ref = _probe(stock, tmp_path / "stock.pt")
    assert run("init", "--repo", stock).code == 0
    same = _probe(stock, tmp_path / "init.pt")
    for key, value in ref.items():
        assert torch.equal(value, same[key]), key
    assert torch.isfinite(ref["attn_out"]).all()

    assert (
        run("set", "--repo", stock, "--linear", "mxfp8", "--qk", "hifp8", "--pv", "mxfp4").code == 0
    )
    quant = _probe(stock, tmp_path / "quant.pt")
    for key in ("linear_forward", "linear_dgrad", "linear_wgrad", "attn_out", "attn_dq"):
        assert torch.isfinite(quant[key]).all() and not torch.equal(quant[key], ref[key]), key
    # the linear GEMMs went through the ops with the right operands and element types
    from quantpatch.runtime import linear_probe  # same seeded inputs as the probe

    x, w, gy = _probe_inputs(torch)
    assert linear_probe.run.__defaults__ == (256, 512, 512, 0)
    assert torch.equal(quant["linear_forward"], quant_matmul(x, w.t(), "mxfp8"))
    assert torch.equal(quant["linear_dgrad"], quant_matmul(gy, w, "mxfp8", backward=True))
    assert torch.equal(
        quant["linear_wgrad"],
        quant_matmul(gy.reshape(64, 80).t(), x.reshape(64, 96), "mxfp8", backward=True),
    )
    assert run("restore", "--repo", stock).code == 0


@pytest.mark.parametrize("version", ["0.11.0", "0.13.1"])
def test_init_teaches_the_local_attention_mla_head_dims(trees, version):
    """MLA builds its core attention with k_channels / v_channels; init adds exactly those two
    keyword parameters and the head dims they set (nothing else in __init__), and leaves a
    DotProductAttention that already takes them as it is."""
    import difflib

    from quantpatch.sites.codemods.init_sites import inject_sites

    rel = ATTENTION
    stock = (trees[version].parent / rel).read_text()
    new = inject_sites(stock, rel, "attention")
    init_part = new[: new.index("    def forward(")]
    added = [
        line[1:]
        for line in difflib.unified_diff(
            stock[: stock.index("    def forward(")].splitlines(), init_part.splitlines(), n=0
        )
        if line.startswith("+") and not line.startswith("+++")
    ]
    assert [a.strip() for a in added if not a.strip().startswith("#")] == [
        "k_channels: int = None,",
        "v_channels: int = None,",
        "if k_channels is not None:",
        "self.hidden_size_per_attention_head = k_channels",
        "if v_channels is not None:",
        "self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition",
    ]
    taught = stock.replace(
        "softmax_scale: float = None,",
        "softmax_scale: float = None,\n        k_channels: int = None,",
    )
    assert "k_channels: int = None" in taught
    again = inject_sites(taught, rel, "attention")
    assert again.count("k_channels") == taught.count("k_channels")


@pytest.mark.slow
def test_nvfp4_through_real_megatron_layers(run, make_checkout, tmp_path, monkeypatch):
    """`set --linear nvfp4 --qk nvfp4` on an initialised checkout: finite results, the linear
    GEMMs equal to the ops (the gradients rounded stochastically from the rank's seed, dgrad
    drawing first), and `check --expect` accepting the values."""
    torch = pytest.importorskip("torch")
    from quantpatch.runtime import quantpatch_ops as ops

    stock = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", stock).code == 0
    ref = _probe(stock, tmp_path / "ref.pt")
    assert run("set", "--repo", stock, "--linear", "nvfp4", "--qk", "nvfp4").code == 0
    res = run("check", "--repo", stock, "--expect", "linear=nvfp4,qk=nvfp4,pv=bf16")
    assert res.code == 0, res
    quant = _probe(stock, tmp_path / "quant.pt")
    for key in ("linear_forward", "linear_dgrad", "linear_wgrad", "attn_out", "attn_dq"):
        assert torch.isfinite(quant[key]).all() and not torch.equal(quant[key], ref[key]), key
    x, w, gy = _probe_inputs(torch)
    monkeypatch.delenv("QUANTPATCH_SR_SEED", raising=False)
    monkeypatch.setenv("RANK", "0")
    ops.reset_sr_generators()
    assert torch.equal(quant["linear_forward"], ops.quant_matmul(x, w.t(), "nvfp4"))
    assert torch.equal(quant["linear_dgrad"], ops.quant_matmul(gy, w, "nvfp4", backward=True))
    wgrad = ops.quant_matmul(gy.reshape(64, 80).t(), x.reshape(64, 96), "nvfp4", backward=True)
    assert torch.equal(quant["linear_wgrad"], wgrad)
    assert run("set", "--repo", stock, "--linear", "nvfp4-2d").code == 0
    res = run("check", "--repo", stock, "--expect", "linear=nvfp4-2d,qk=nvfp4")
    assert res.code == 0, res
    two_d = _probe(stock, tmp_path / "2d.pt")
    assert all(torch.isfinite(v).all() for v in two_d.values())
    # Megatron's autograd function hands the weight over as a plain tensor: the sites name
    # it (roles=("input", "weight")), so its 16 x 16 tiles are taken in the forward and in dgrad
    from .test_nvfp4 import nvfp4_factored_oracle

    # a bf16 product multiplies code x block scale, the tensor scales on its float32 result
    (tx, fx), (tw, fw) = nvfp4_factored_oracle(x), nvfp4_factored_oracle(w, two_d=True)
    want = (torch.matmul(tx.float(), tw.float().t()) * (fx * fw)).to(x.dtype)
    assert torch.equal(two_d["linear_forward"], want)
    assert not torch.equal(two_d["linear_forward"], quant["linear_forward"])
    ops.reset_sr_generators()
    dgrad = ops.quant_matmul(gy, w, "nvfp4-2d", roles=("grad_output", "weight"))
    assert torch.equal(two_d["linear_dgrad"], dgrad)
    assert not torch.equal(two_d["linear_dgrad"], quant["linear_dgrad"])
    assert torch.equal(two_d["linear_wgrad"], quant["linear_wgrad"])  # no weight operand
    assert run("restore", "--repo", stock).code == 0


def _train_tiny_gpt(root: Path, **sizes: int) -> list[float]:
    """The tiny megatron-core GPT trained on CPU in ``root``: its 12 losses (``sizes``
    override the model's)."""
    cfg = {"device": "cpu", "steps": 12, "vocab": 256, "layers": 2, "hidden": 128, "heads": 4}
    cfg |= {"seq": 64, "batch": 2, **sizes}
    losses: list[float] = tiny_gpt(root, cfg)["losses"]  # type: ignore[assignment]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses), losses
    return losses


@pytest.mark.slow
def test_tiny_gpt_trains_under_nvfp4_on_cpu(run, make_checkout):
    """The tiny GPT under `set --linear nvfp4 --qk nvfp4` on an initialised core_v0.13.1
    checkout: every loss finite, and the loss falls."""
    pytest.importorskip("torch")
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert run("set", "--repo", root, "--linear", "nvfp4", "--qk", "nvfp4").code == 0
    losses = _train_tiny_gpt(root)
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_tiny_gpt_trains_under_nvfp4_on_a_fork_clone(run, trees, tmp_path):
    """On a fork-shaped clone (its own mxfp8/mxfp4/hifp8 chains): `set --linear nvfp4 --qk
    nvfp4` is refused before init, naming the value and the site, nothing changed; after
    init (which teaches the chains the quantpatch values) the tiny GPT trains under it."""
    pytest.importorskip("torch")
    from .forklike import build_fork, clone_quant

    fork = build_fork(tmp_path / "origin", trees["0.13.1"], history=2, full=True)
    root = clone_quant(fork, tmp_path / "clone")
    before = snapshot(root)
    res = run("set", "--repo", root, "--linear", "nvfp4", "--qk", "nvfp4")
    assert res.code == 2 and "'nvfp4'" in res.err and f"linear site at {LINEAR}:" in res.err
    assert snapshot(root) == before
    assert git.Repo(root).git.status("--porcelain") == ""
    res = run("set", "--repo", root, "--linear", "w1.58")  # ParetoQ: its chains know no w-value
    assert res.code == 2 and "not 'w1.58'" in res.err and f"linear site at {LINEAR}:" in res.err
    assert snapshot(root) == before
    assert run("init", "--repo", root).code == 0
    res = run("set", "--repo", root, "--linear", "nvfp4", "--qk", "nvfp4")
    assert res.code == 0, res
    losses = _train_tiny_gpt(root, layers=1, hidden=64, seq=32)
    assert losses[-1] < losses[0] - 0.5, losses
    # init gave the fork's parallel linear layers the ParetoQ steps too (its own chains know
    # no w-value; the taught branch passes the weight the layer quantized)
    functions = {
        s["function"] for s in json.loads(run("check", "--json", "--repo", root).out)["sites"]
    }
    assert {"ColumnParallelLinear.__init__", "RowParallelLinear.__init__"} <= functions
    assert run("set", "--repo", root, "--linear", "w1.58", "--qk", "bf16").code == 0
    losses = _train_tiny_gpt(root, layers=1, hidden=64, seq=32)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
