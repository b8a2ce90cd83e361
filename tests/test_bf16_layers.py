"""The BF16 layer policy: ``set --bf16-layers`` writes the policy literal of the
linear file, ``check`` shows and asserts it, the branch names it; on a tiny megatron-core GPT the
layers it names run their linear GEMMs unquantized, the same layers with two pipeline stages
(gloo, CPU) as with one; a fork's clone is refused before ``init`` and accepted after."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import git
import pytest

from quantpatch.base.config import recipe_layers
from quantpatch.runtime import quantpatch_layers as layers

from .conftest import LINEAR, snapshot


def test_the_grammar_resolves_against_the_model():
    assert layers.resolve("first:1,last:2", 6) == {1, 5, 6}
    assert layers.resolve("1,2,25-32", 32) == {1, 2, *range(25, 33)}
    assert layers.resolve("last:8", 4) == {1, 2, 3, 4}
    assert layers.resolve("", 6) == frozenset()
    assert layers.resolve("recipe", 62) == {1, 2, *range(55, 63)}
    with pytest.raises(ValueError, match="'lst:2'"):
        layers.parse("lst:2")
    for total in (2, 4, 6, 16, 27, 32, 62, 80):  # `list` and the runtime agree
        assert layers.recipe_counts(total) == recipe_layers(total)
    assert recipe_layers(62) == (2, 8) and recipe_layers(32) == (1, 4)


def _check(run, root):
    res = run("check", "--repo", root, "--json")
    assert res.code == 0, res
    return json.loads(res.out)


def test_set_writes_the_policy_and_check_asserts_it(run, make_checkout):
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    assert _check(run, root)["bf16_layers"] == "none"
    res = run("set", "--repo", root, "--linear", "nvfp4", "--bf16-layers", "first:1,last:2")
    assert res.code == 0, res
    repo = git.Repo(root)
    assert repo.active_branch.name == "quantpatch/linear-nvfp4_qk-bf16_pv-bf16_bf16-first1.last2"
    assert "bf16_layers=first:1,last:2" in repo.head.commit.message
    assert "quantpatch_bf16_layers = 'first:1,last:2'" in (root / LINEAR).read_text()
    assert _check(run, root)["bf16_layers"] == "first:1,last:2"
    ok = run("check", "--repo", root, "--expect", "linear=nvfp4,bf16_layers=first:1,last:2")
    assert ok.code == 0, ok
    bad = run("check", "--repo", root, "--expect", "bf16_layers=none")
    assert bad.code == 1 and "bf16_layers is first:1,last:2, expected none" in bad.out + bad.err
    # a later set keeps the policy unless told; none removes it
    assert run("set", "--repo", root, "--qk", "mxfp8").code == 0
    assert _check(run, root)["bf16_layers"] == "first:1,last:2"
    assert run("set", "--repo", root, "--bf16-layers", "none").code == 0
    assert _check(run, root)["bf16_layers"] == "none"
    before = snapshot(root)
    res = run("set", "--repo", root, "--bf16-layers", "first:2,lst:8")
    assert res.code == 2 and "'lst:8'" in res.err
    assert snapshot(root) == before


def test_refused_on_the_fork_before_init_and_accepted_after(run, trees, tmp_path):
    from .forklike import build_fork, clone_quant

    fork = build_fork(tmp_path / "origin", trees["0.13.1"], full=False)
    root = clone_quant(fork, tmp_path / "Megatron-LM")
    before = snapshot(root)
    res = run("set", "--repo", root, "--linear", "mxfp8", "--bf16-layers", "first:1,last:2")
    assert res.code == 2 and "no quantpatch_bf16_layers policy" in res.err and "init" in res.err
    assert snapshot(root) == before
    assert run("init", "--repo", root).code == 0
    # the fork's own mxfp8 op does not ask the policy: still refused, naming the dispatch
    before = snapshot(root)
    res = run("set", "--repo", root, "--linear", "mxfp8", "--bf16-layers", "first:1,last:2")
    assert res.code == 2 and "does not hand it to quantpatch_ops" in res.err, res.err
    assert snapshot(root) == before
    # quantpatch's values go through quantpatch_ops after init: accepted
    res = run("set", "--repo", root, "--linear", "nvfp4", "--bf16-layers", "first:1,last:2")
    assert res.code == 0, res
    assert _check(run, root)["bf16_layers"] == "first:1,last:2"


# -- the tiny GPT: which layers quantize ------------------------------------------------------

WORKER = r"""
import json, sys, torch
rank, pipeline, method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
from quantpatch.runtime.megatron_single import init_single_process
init_single_process("cpu", rank=rank, pipeline=pipeline, init_method=method)
from megatron.core import parallel_state
from megatron.core.quantpatch import quantpatch_layers, quantpatch_ops as ops
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
torch.manual_seed(0)
tc = TransformerConfig(num_layers=6, hidden_size=64, num_attention_heads=4,
                       use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                       bias_dropout_fusion=False, apply_rope_fusion=False,
                       masked_softmax_fusion=False, bf16=True, params_dtype=torch.bfloat16,
                       pipeline_dtype=torch.bfloat16, pipeline_model_parallel_size=pipeline)
first = parallel_state.is_pipeline_first_stage()
last = parallel_state.is_pipeline_last_stage()
from megatron.core.transformer.module import Float16Module
gpt = GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32,
               pre_process=first, post_process=last)
model = Float16Module(tc, gpt)  # bf16 weights and activations, as Megatron trains
# the layer of each weight, from its parameter name and the stage's own layers (independent
# of the policy's hooks): the weights quantized in fprop and dgrad name their layers
owner = {}
for layer in gpt.decoder.layers:
    for p in layer.parameters():
        owner[p.data_ptr()] = layer.layer_number
seen = {}
def spied(real):  # _q, and _qf for a product that factors NVFP4's tensor scale out
    def spy(x, fmt, dim, backward, weight=None):
        n = owner.get(x.data_ptr())
        if n is not None and (weight or weight is None and x.dim() == 2):
            seen.setdefault(n, 0)
            seen[n] += 1
        return real(x, fmt, dim, backward, weight)
    return spy
ops._q, ops._qf = spied(ops._q), spied(ops._qf)
gen = torch.Generator().manual_seed(1)
tokens = torch.randint(0, 128, (2, 33), generator=gen)
pos = torch.arange(32).expand(2, 32)
mask = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool), 1)
if not first:
    hidden = torch.randn(32, 2, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    model.set_input_tensor(hidden)
out = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:] if last else None)
if last:
    out.float().mean().backward()
else:
    out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))
print(json.dumps({"counts": quantpatch_layers.product_counts(), "weights": seen,
                  "layers": [l.layer_number for l in gpt.decoder.layers]}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_stages(root, pipeline: int) -> list[dict]:
    import quantpatch

    method = f"tcp://127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env.pop("CUSTOM_QUANT_TYPE", None)
    here = os.path.dirname(os.path.dirname(os.path.abspath(quantpatch.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([str(root), here])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), str(pipeline), method],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(pipeline)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _by_layer(results: list[dict]) -> tuple[dict[int, dict[str, int]], dict[int, int]]:
    counts: dict[int, dict[str, int]] = {}
    weights: dict[int, int] = {}
    for res in results:
        for key, n in res["counts"].items():
            layer, _, what = key.partition("/")
            if layer != "None":
                counts.setdefault(int(layer), {})[what] = n
        for layer, n in res["weights"].items():
            weights[int(layer)] = weights.get(int(layer), 0) + n
    return counts, weights


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [1, 2])
def test_the_policy_layers_run_unquantized_on_a_tiny_gpt(run, make_checkout, pipeline):
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    res = run(
        "set", "--repo", root, "--linear", "nvfp4", "--bf16-layers", "first:1,last:2",
        "--no-branch",
    )  # fmt: skip
    assert res.code == 0, res
    results = _run_stages(root, pipeline)
    assert sorted(n for r in results for n in r["layers"]) == [1, 2, 3, 4, 5, 6]
    if pipeline == 2:  # Megatron's global numbers: the second stage holds 4-6
        assert results[1]["layers"] == [4, 5, 6]
    counts, weights = _by_layer(results)
    # each layer: 2 linear layers (QKV + proj, fc1 + fc2 = 4 GEMM modules) x fprop, dgrad, wgrad
    for layer in (2, 3, 4):
        assert counts[layer] == {"fprop:quantized": 4, "dgrad:quantized": 4, "wgrad:quantized": 4}
    for layer in (1, 5, 6):
        assert counts[layer] == {"fprop:bf16": 4, "dgrad:bf16": 4, "wgrad:bf16": 4}
    # independently of the hooks: the weights that were quantized belong to layers 2-4 only
    assert set(weights) == {2, 3, 4}
