"""DeepSeek-V2-Lite's structure runs through the local layers of an ``init``ed fork-shaped
clone with the quantized sites in its path (``mla_train_probe``): Multi-Latent Attention on the
local ``DotProductAttention`` (the head dims ``init`` gave it), MoE with a shared expert after
a dense first layer, trained a few steps on CPU under three schemes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .forklike import build_fork, clone_quant

torch = pytest.importorskip("torch")

PROBE = Path(__file__).with_name("mla_train_probe.py")
STEPS = 6
LAYERS = 2
CFG = {
    "layers": LAYERS, "hidden": 64, "ffn": 128, "heads": 2,
    "q_lora_rank": None, "kv_lora_rank": 32,  # V2-Lite: full-rank Q, low-rank KV
    "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16,  # Q/K head 24, V head 16
    "experts": 4, "topk": 2, "moe_ffn": 32,
    "vocab": 128, "seq": 32, "batch": 2, "steps": STEPS,
}  # fmt: skip


@pytest.fixture(scope="module")
def fork_clone(tmp_path_factory, trees):
    tmp = tmp_path_factory.mktemp("mla")
    fork = build_fork(tmp / "origin", trees["0.13.1"], history=2, full=True)
    return clone_quant(fork, tmp / "clone")


def _train(root: Path) -> dict:
    import quantpatch

    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env.pop("CUSTOM_QUANT_TYPE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(quantpatch.__file__).parents[1])])
    res = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(CFG)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict = json.loads(res.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.slow  # 30 s of CPU training
def test_tiny_deepseek_v2_lite_trains_through_the_sites_of_an_inited_fork(run, fork_clone):
    root = fork_clone
    assert run("init", "--repo", root).code == 0
    seen = {}
    for scheme in ("FA_linear_mxfp8", "FA_linear_nvfp4", "bf16"):
        res = run("set", "--repo", root, "--scheme", scheme)
        assert res.code == 0, res
        seen[scheme] = result = _train(root)
        losses = result["losses"]
        assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), (scheme, losses)
        assert losses[-1] < losses[0] - 1.0, (scheme, losses)
        # built from the clone's own code: MLA on the local attention with the head dims init
        # gave it (Q/K 16 + 8 rope = 24 per head, V 16 x 2 heads), dense first layer, then MoE
        assert result["attention"] == "MLASelfAttention"
        assert result["core_attention"] == [
            "megatron.core.transformer.dot_product_attention.DotProductAttention",
            24,
            32,
        ]
        assert result["layers"] == ["MLP", "MoELayer + shared"]
    assert run("restore", "--repo", root).code == 0
    # the sites in force were called, with their values: every layer's Q.K^T at every step,
    # the linear products forward and backward. The fork's own chains take mxfp8; nvfp4, which
    # they lack, reaches the branch init taught them (quantpatch_ops); bf16 calls neither.
    mxfp8 = seen["FA_linear_mxfp8"]["calls"]
    assert mxfp8["fork_quant.baddbmm forward mxfp8"] == LAYERS * STEPS, mxfp8
    assert mxfp8["fork_quant.matmul forward mxfp8"] > 0, mxfp8
    assert mxfp8["fork_quant.matmul backward mxfp8"] > 0, mxfp8
    assert all(key.endswith(" mxfp8") for key in mxfp8), mxfp8
    nvfp4 = seen["FA_linear_nvfp4"]["calls"]
    assert nvfp4["quantpatch_ops.quant_baddbmm forward nvfp4"] == LAYERS * STEPS, nvfp4
    assert nvfp4["quantpatch_ops.quant_matmul forward nvfp4"] > 0, nvfp4
    assert nvfp4["quantpatch_ops.quant_matmul backward nvfp4"] > 0, nvfp4
    assert all(key.endswith(" nvfp4") for key in nvfp4), nvfp4
    assert seen["bf16"]["calls"] == {}
    # P.V stays bf16 in every scheme: no quantized bmm anywhere
    assert not any(
        "bmm forward" in k and "baddbmm" not in k for r in seen.values() for k in r["calls"]
    )
