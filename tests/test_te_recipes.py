"""Megatron's FP8 recipes as schemes that quantize what Megatron + TransformerEngine quantize
(``te_recipe``), and their native twins (``native``): the registry fields and their refusals,
and on a tiny megatron-core GPT each GEMM classified quantized or bf16 from the operands its
product received, equal GEMM for GEMM to Megatron's own ``get_fp8_context`` for the same
flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantpatch.base.config import GEMMS
from quantpatch.base.errors import UserError
from quantpatch.launch.registry import RECIPE_FLAGS, load_registry, recipe_table

from .conftest import LINEAR

TE = {  # scheme -> (value, --fp8-format, --fp8-recipe)
    "te_mxfp8_e4m3": ("mxfp8-rceil", "e4m3", "mxfp8"),
    "te_mxfp8_hybrid": ("mxfp8-rceil-hybrid", "hybrid", "mxfp8"),
    "te_tensorwise_hybrid": ("fp8-tensor", "hybrid", "tensorwise"),
    "te_tensorwise_e4m3": ("fp8-tensor-e4m3", "e4m3", "tensorwise"),
    "te_blockwise_e4m3": ("fp8-block", "e4m3", "blockwise"),
    "te_blockwise_hybrid": ("fp8-block-hybrid", "hybrid", "blockwise"),
    "te_delayed_hybrid": ("fp8-delayed", "hybrid", "delayed"),
    "te_delayed_e4m3": ("fp8-delayed-e4m3", "e4m3", "delayed"),
}
"""Every (--fp8-format, --fp8-recipe) pair core_v0.13.1 accepts (fp8_utils.get_fp8_recipe: TE's
DelayedScaling, Float8CurrentScaling, Float8BlockScaling and MXFP8BlockScaling, each in E4M3
and HYBRID), one scheme each."""


def test_every_format_and_recipe_pair_megatron_accepts_is_a_scheme():
    assert {(f, r) for _, f, r in TE.values()} == {
        (f, r) for f in ("e4m3", "hybrid") for r in ("delayed", "tensorwise", "blockwise", "mxfp8")
    }
    assert {v: RECIPE_FLAGS[v] for v, *_ in TE.values()} == RECIPE_FLAGS


def test_each_recipe_is_a_scheme_with_its_megatron_flags_and_a_native_twin():
    reg = load_registry()
    for name, (value, fmt, recipe) in TE.items():
        s = reg.schemes[name]
        assert s.values() == {"linear": value, "qk": "bf16", "pv": "bf16", "bf16_layers": "output"}
        assert s.megatron_flags() == ["--fp8-format", fmt, "--fp8-recipe", recipe]
        assert RECIPE_FLAGS[value] == (fmt, recipe) and not s.default and not s.argv()
        twin = reg.schemes[name.replace("te_", "native_")]
        assert twin.native and twin.emulates == name and not twin.default
        assert twin.values() == {"linear": "bf16", "qk": "bf16", "pv": "bf16"}
        assert twin.argv() == ["--transformer-impl", "transformer_engine", *s.megatron_flags()]
    every = reg.pick("schemes", ["all"])
    assert set(TE) <= set(every) and not any(reg.schemes[n].native for n in every)


def test_the_docs_show_every_pair_with_its_value_scheme_and_twin():
    """docs/formats.md and docs/launch.md show the table the registry generates: each of the
    eight pairs with a value, a te_recipe scheme of that value and its native twin."""
    reg = load_registry()
    table = recipe_table(reg)
    rows = [r.split(" | ") for r in table.splitlines()[2:]]
    assert len(rows) == 8 and not any("-" in (c.strip("| ") for c in r) for r in rows)
    for name, (value, fmt, recipe) in TE.items():
        twin = name.replace("te_", "native_")
        assert f"| `{fmt}` | `{recipe}` | `{value}` | `{name}` | `{twin}` |" in table
    docs = Path(__file__).parents[1] / "docs"
    for page in ("formats.md", "launch.md"):
        assert table in (docs / page).read_text(encoding="utf-8"), page


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.toml"
    path.write_text(text)
    return path


def test_first_last_layers_and_the_native_twin_of_a_config_scheme(tmp_path):
    reg = load_registry(
        _config(
            tmp_path,
            "[schemes.mine]\nlinear = 'fp8-tensor'\nqk = 'bf16'\npv = 'bf16'\n"
            "te_recipe = true\nfirst_last_layers_bf16 = true\nnum_layers_at_start_in_bf16 = 2\n"
            "[schemes.mine_native]\nnative = true\nemulates = 'mine'\n"
            "args = ['--fp8-amax-history-len', '4']\n",
        )
    )
    mine = reg.schemes["mine"]
    assert mine.values()["bf16_layers"] == "first:2,last:1,output"
    flags = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"]
    flags += ["--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "1"]
    assert mine.megatron_flags() == flags
    assert reg.schemes["mine_native"].argv() == [
        "--transformer-impl", "transformer_engine", *flags, "--fp8-amax-history-len", "4",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (  # MXFP8 is no value of a Megatron recipe: te_recipe would be refused too
            "linear = 'mxfp8'\nqk = 'bf16'\npv = 'bf16'\nfirst_last_layers_bf16 = true",
            "recipes; drop first_last_layers_bf16.",
        ),
        (
            "linear = 'fp8-tensor'\nqk = 'bf16'\npv = 'bf16'\nfirst_last_layers_bf16 = true",
            "add te_recipe = true",
        ),
        ("linear = 'mxfp8'\nqk = 'bf16'\npv = 'bf16'\nte_recipe = true", "one value of a Megatron"),
        ("linear = 'fp8-tensor'\nqk = 'fp8-tensor'\npv = 'bf16'\nte_recipe = true", "qk = pv"),
        ("native = true\nlinear = 'mxfp8'", "no site runs"),
        ("native = true\nemulates = 'nothing'", "emulates 'nothing', which is no scheme"),
        ("linear = 'bf16'\nqk = 'bf16'\npv = 'bf16'\nemulates = 'bf16'", "for native schemes"),
        ("native = true\nargs = '--fp8-format hybrid'", "x.args has the wrong type"),
        ("native = true\nargs = ['--fp8-format', 3]", "args must be a list"),
    ],
)
def test_a_scheme_megatron_cannot_run_is_refused_naming_the_field(tmp_path, text, said):
    with pytest.raises(UserError, match=said.replace("(", r"\(")):
        load_registry(_config(tmp_path, f"[schemes.x]\n{text}\n"))


def test_no_fp8_wgrad_where_megatron_honours_it(tmp_path):
    """The delayed schemes take --no-fp8-wgrad (the weight gradient in BF16: fprop and dgrad
    keep the delayed value) and refuse BF16 first and last layers, as Megatron does; their
    native twin runs the same flags."""
    head = "[schemes.x]\nlinear = 'fp8-delayed'\nqk = 'bf16'\npv = 'bf16'\nte_recipe = true\n"
    x = load_registry(_config(tmp_path, head + "fp8_wgrad = false\n")).schemes["x"]
    assert x.values() == {
        "fprop": "fp8-delayed", "dgrad": "fp8-delayed", "wgrad": "bf16",
        "qk": "bf16", "pv": "bf16", "bf16_layers": "output",
    }  # fmt: skip
    assert x.megatron_flags() == [
        "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--no-fp8-wgrad"
    ]  # fmt: skip
    assert "--wgrad bf16" in " ".join(x.set_options())
    # a shipped delayed scheme with the field, field by field, and its native twin
    reg = load_registry(_config(tmp_path, "[schemes.te_delayed_e4m3]\nfp8_wgrad = false\n"))
    assert reg.schemes["te_delayed_e4m3"].values()["wgrad"] == "bf16"
    assert reg.schemes["native_delayed_e4m3"].argv()[-1] == "--no-fp8-wgrad"
    with pytest.raises(UserError, match="with the delayed recipe, which Megatron refuses"):
        load_registry(_config(tmp_path, head + "first_last_layers_bf16 = true\n"))


@pytest.mark.parametrize("value", ["fp8-tensor", "fp8-block-hybrid", "mxfp8-rceil"])
def test_no_fp8_wgrad_elsewhere_is_refused_naming_the_schemes_that_honour_it(tmp_path, value):
    """fp8_wgrad = false on a tensorwise, blockwise or MXFP8 scheme: Megatron runs its weight
    gradient in FP8 regardless, so the scheme is refused in one sentence naming the delayed
    values and schemes; the advice (a delayed value) followed, the scheme loads."""
    recipe = RECIPE_FLAGS[value][1]
    body = "qk = 'bf16'\npv = 'bf16'\nte_recipe = true\nfp8_wgrad = false\n"
    with pytest.raises(UserError) as err:
        load_registry(_config(tmp_path, f"[schemes.x]\nlinear = '{value}'\n{body}"))
    said = str(err.value)
    assert said.count(". ") == 0 and said.endswith(".")  # one sentence
    assert f"hands --no-fp8-wgrad to its delayed recipe only and runs --fp8-recipe {recipe}" in said
    assert (
        "fp8-delayed or fp8-delayed-e4m3: the schemes te_delayed_hybrid and te_delayed_e4m3" in said
    )
    for delayed in ("fp8-delayed", "fp8-delayed-e4m3"):  # the advice
        reg = load_registry(_config(tmp_path, f"[schemes.x]\nlinear = '{delayed}'\n{body}"))
        assert reg.schemes["x"].megatron_flags()[-1] == "--no-fp8-wgrad"
    reg = load_registry(_config(tmp_path, "[schemes.te_delayed_hybrid]\nfp8_wgrad = false\n"))
    assert reg.schemes["te_delayed_hybrid"].values()["wgrad"] == "bf16"


def test_set_takes_no_fp8_wgrad_under_a_delayed_value_and_check_expects_it(run, make_checkout):
    """``set`` of a delayed value on fprop and dgrad with the weight gradient in BF16 (what a
    delayed scheme with fp8_wgrad = false sets) is accepted and checked; a delayed value beside
    any other quantized weight gradient stays refused."""
    from .conftest import snapshot

    root = make_checkout("0.13.1")
    before = snapshot(root)
    res = run("set", "--repo", root, "--fprop", "fp8-delayed", "--dgrad", "fp8-delayed",
              "--wgrad", "fp8-tensor")  # fmt: skip
    assert res.code == 2 and "--wgrad bf16 for Megatron's --no-fp8-wgrad" in res.err, res
    assert snapshot(root) == before
    res = run("set", "--repo", root, "--fprop", "fp8-delayed", "--dgrad", "fp8-delayed",
              "--wgrad", "bf16", "--no-branch")  # fmt: skip
    assert res.code == 0, res
    want = "fprop=fp8-delayed,dgrad=fp8-delayed,wgrad=bf16"
    assert run("check", "--repo", root, "--expect", want).code == 0


# -- Megatron's own policy, from its get_fp8_context -----------------------------------------


def megatron_policy(megatron: Path, flags: dict[str, object], layers: int) -> dict[str, set[str]]:
    """Per transformer layer (1-based), the GEMMs Megatron runs in FP8 under ``flags``:
    core_v0.13.1's ``get_fp8_context`` (the branch built when TransformerEngine imports) read
    with libcst from ``megatron/core/fp8_utils.py`` and run as it is, with TE's recipe classes
    and ``fp8_autocast`` stood in for by recorders: a layer whose context is ``nullcontext``
    runs bf16, else fprop and dgrad in FP8 and wgrad unless the recipe's
    ``override_linear_precision`` keeps it high."""
    import contextlib
    import importlib.util
    import textwrap
    import types

    import libcst as cst

    spec = importlib.util.spec_from_file_location("megatron_enums", megatron / "core" / "enums.py")
    assert spec is not None and spec.loader is not None
    enums = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(enums)  # the enums alone: no megatron.core import in this process
    Fp8Recipe = enums.Fp8Recipe

    source = (megatron / "core" / "fp8_utils.py").read_text()
    module = cst.parse_module(source)
    found: list[str] = []

    class Find(cst.CSTVisitor):
        def visit_If(self, node: cst.If) -> None:
            if isinstance(node.test, cst.Name) and node.test.value == "HAVE_TE":
                for stmt in node.body.body:
                    if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "get_fp8_context":
                        found.append(module.code_for_node(stmt))

    module.visit(Find())
    assert len(found) == 1

    class Recipe:
        def __init__(self, **kw: object) -> None:
            self.kw = kw

    class Delayed(Recipe):
        def __init__(self, config: object, fp8_format: object, override_linear_precision: tuple):
            super().__init__(override_linear_precision=override_linear_precision)

    recipe_mod = types.SimpleNamespace(
        Format=types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID"),
        Float8CurrentScaling=Recipe,
        Float8BlockScaling=Recipe,
        MXFP8BlockScaling=Recipe,
    )
    te = types.ModuleType("transformer_engine")
    te.common = types.SimpleNamespace(recipe=recipe_mod)  # type: ignore[attr-defined]
    te.pytorch = types.SimpleNamespace(  # type: ignore[attr-defined]
        fp8_autocast=lambda enabled, fp8_recipe, fp8_group: ("fp8", fp8_recipe)
    )
    space = {
        "nullcontext": contextlib.nullcontext,
        "TransformerConfig": object,
        "TEDelayedScaling": Delayed,
        "Fp8Recipe": Fp8Recipe,
        "is_te_min_version": lambda version: True,
        "parallel_state": types.SimpleNamespace(model_parallel_is_initialized=lambda: False),
    }
    saved = sys.modules.get("transformer_engine")
    sys.modules["transformer_engine"] = te
    try:
        exec(textwrap.dedent(found[0]), space)
        defaults = {  # TransformerConfig's defaults, as Megatron's arguments give them
            "num_layers": layers,
            "fp8_param": False,
            "tp_only_amax_red": False,
            "first_last_layers_bf16": False,
            "num_layers_at_start_in_bf16": 1,
            "num_layers_at_end_in_bf16": 1,
            "fp8_wgrad": True,
        }
        config = types.SimpleNamespace(**{**defaults, **flags})
        out: dict[str, set[str]] = {}
        for number in range(1, layers + 1):
            ctx = space["get_fp8_context"](config, number - 1)  # type: ignore[operator]
            if isinstance(ctx, contextlib.nullcontext):
                out[str(number)] = set()
                continue
            keep = ctx[1].kw.get("override_linear_precision", (False, False, False))
            out[str(number)] = {g for g, high in zip(GEMMS, keep, strict=True) if not high}
    finally:
        if saved is None:
            sys.modules.pop("transformer_engine", None)
        else:
            sys.modules["transformer_engine"] = saved
    out["output"] = set()  # gpt_model.py: a tensor_parallel.ColumnParallelLinear, no fp8 context
    return out


WORKER = r"""
import json, sys, torch
import torch.distributed as dist
from quantpatch.runtime.megatron_single import init_single_process

def run_job(root, FMT):
    # this scheme's checkout, imported afresh: torch and megatron's dependencies stay loaded
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    sys.path[:] = [root] + [p for p in sys.path if p not in ROOTS]
    if dist.is_initialized():
        dist.destroy_process_group()
    init_single_process("cpu")
    from megatron.core import tensor_parallel
    from megatron.core.quantpatch import quantpatch_ops as ops
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    assert ops.__file__.startswith(root), (ops.__file__, root)
    torch.manual_seed(0)
    tc = TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=4,
                           use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                           bias_dropout_fusion=False, apply_rope_fusion=False,
                           masked_softmax_fusion=False, bf16=True, params_dtype=torch.bfloat16,
                           pipeline_dtype=torch.bfloat16)
    gpt = GPTModel(tc, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32,
                   share_embeddings_and_output_weights=False)
    assert type(gpt.output_layer) is tensor_parallel.ColumnParallelLinear  # as Megatron builds it
    model = Float16Module(tc, gpt)
    # each weight's GEMM module, from the parameter names (independent of quantpatch's hooks)
    weights = {}
    for name, p in gpt.named_parameters():
        if name.endswith(".weight") and p.dim() == 2 and "embedding" not in name:
            parts = name.split(".")
            if parts[0] == "output_layer":
                weights[p.data_ptr()] = "output/output_layer"
            else:
                layer = gpt.decoder.layers[int(parts[2])].layer_number
                weights[p.data_ptr()] = f"{layer}/{'.'.join(parts[3:-1])}"
    inputs = {}
    products = []
    real_matmul, real_qm = torch.matmul, ops.quant_matmul
    # one float32 scale per tensor, amax / 448 (current scaling): divided out below; delayed
    # scaling's first step quantizes with scale 1 (no history yet), as TE's does: the codes
    per_tensor = FMT.startswith("fp8-tensor")

    def on_grid(t):
        # every value a code of E4M3 / E5M2 times one scale per block: at most 4 significant bits
        # after dividing by the block's power of two (exact in bf16), or by one float32 scale
        # per tensor (amax / 448; bf16's rounding of code x scale within 1/16)
        v = t.detach().double().flatten()
        v = v[v != 0]
        if v.numel() == 0:  # every value flushed to zero (E5M2 gradients under scale 1)
            return True
        if per_tensor:
            v = v / (v.abs().max() / 448)
        m, _ = torch.frexp(v)
        off = (m.abs() * 16 - (m.abs() * 16).round()).abs()
        return bool(off.max() <= (0.125 if per_tensor else 0.0))

    def classify(raw, seen):
        if all(r is s or torch.equal(r, s) for r, s in zip(raw, seen)):
            return "bf16"
        if all(not torch.equal(r, s) and on_grid(s) for r, s in zip(raw, seen)):
            return "quantized"
        return "mixed"

    inside = []  # the operands of the product running inside quant_matmul

    def spy(a, b, fmt, *, roles=None, backward=False, weight=None):
        seen = []
        inside.append(seen)
        try:
            out = real_qm(a, b, fmt, roles=roles, backward=backward, weight=weight)
        finally:
            inside.pop()
        backward, weight = ops._operand_roles(roles, backward, weight)
        assert len(seen) == 2, "the product was not a torch.matmul"
        gemm = ("dgrad" if weight is not None else "wgrad") if backward else "fprop"
        if gemm == "wgrad":
            where = inputs.pop(b.data_ptr())  # grad_output^T . total_input: the saved input
        else:
            w, x = (a, b) if weight == "a" else (b, a)
            where = weights[w.data_ptr()]
            if gemm == "fprop":
                inputs[x.data_ptr()] = where
        products.append((where, gemm, classify([a, b], seen)))
        return out

    def plain(x, y, gemm):
        # a product outside quant_matmul: a site whose value is bf16 runs Megatron's own line
        # (torch.matmul(total_input, weight.t()) for fprop, grad_output.matmul(weight) for
        # dgrad, grad_output.t().matmul(total_input) for wgrad); its GEMM, classified from its
        # operands
        if y.data_ptr() in weights and gemm in ("fprop", "dgrad"):
            where = weights[y.data_ptr()]
        elif y.data_ptr() in inputs and gemm == "dgrad":
            gemm, where = "wgrad", inputs.pop(y.data_ptr())
        else:
            return
        if gemm == "fprop":
            inputs[x.data_ptr()] = where
        grid = on_grid(x) and on_grid(y)
        products.append((where, gemm, "quantized" if grid else "bf16"))

    def torch_matmul(x, y, *rest, **kw):
        if inside:
            inside[-1][:] = [x, y]
        elif x.dim() >= 2 and y.dim() == 2:
            plain(x, y, "fprop")
        return real_matmul(x, y, *rest, **kw)

    real_tensor_matmul = torch.Tensor.matmul
    def tensor_matmul(x, y):
        if not inside and x.dim() >= 2 and y.dim() == 2:
            plain(x, y, "dgrad")  # or wgrad, where y is a layer's saved input
        return real_tensor_matmul(x, y)

    attention = []
    real_baddbmm, real_bmm = torch.baddbmm, torch.bmm
    def core(real, name):
        def product(*args, **kw):
            operands = [t for t in args if isinstance(t, torch.Tensor) and t.dim() == 3][-2:]
            attention.append((name, [on_grid(t) for t in operands]))
            return real(*args, **kw)
        return product
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 33), generator=gen)
    pos = torch.arange(32).expand(2, 32)
    mask = torch.triu(torch.ones(1, 1, 32, 32, dtype=torch.bool), 1)
    torch.matmul, torch.Tensor.matmul = torch_matmul, tensor_matmul
    ops.quant_matmul = spy
    torch.baddbmm, torch.bmm = core(real_baddbmm, "qk"), core(real_bmm, "pv")
    try:
        out = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:])
        torch.baddbmm, torch.bmm = real_baddbmm, real_bmm
        out.float().mean().backward()
    finally:
        torch.matmul, torch.Tensor.matmul = real_matmul, real_tensor_matmul
        torch.baddbmm, torch.bmm = real_baddbmm, real_bmm
        ops.quant_matmul = real_qm
    return {"products": products, "attention": attention}

JOBS = json.loads(sys.argv[1])
ROOTS = {root for root, _ in JOBS}
print(json.dumps([run_job(root, fmt) for root, fmt in JOBS]))
"""


def _gemms(jobs: list[tuple[Path, str]]) -> list[dict[str, object]]:
    """Each job's (checkout, linear value) tiny GPT, one process for all of them: each GEMM's
    module, GEMM and classification, and the attention core's operands."""
    import quantpatch

    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    for name in ("CUSTOM_QUANT_TYPE", "QUANTPATCH_FLASH", "QUANTPATCH_FLASH_BF16"):
        env.pop(name, None)
    here = Path(quantpatch.__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(here)
    done = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps([(str(r), f) for r, f in jobs])],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: list[dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


CASES = [  # (scheme or config fields, Megatron's flags)
    ("te_mxfp8_e4m3", {"fp8": "e4m3", "fp8_recipe": "mxfp8"}),
    ("te_mxfp8_hybrid", {"fp8": "hybrid", "fp8_recipe": "mxfp8"}),
    ("te_tensorwise_hybrid", {"fp8": "hybrid", "fp8_recipe": "tensorwise"}),
    ("te_blockwise_e4m3", {"fp8": "e4m3", "fp8_recipe": "blockwise"}),
    (
        "linear = 'fp8-tensor'\nte_recipe = true\nfirst_last_layers_bf16 = true",
        {"fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True},
    ),
    (
        "linear = 'mxfp8-rceil'\nte_recipe = true\nfirst_last_layers_bf16 = true\n"
        "num_layers_at_start_in_bf16 = 2",
        {
            "fp8": "e4m3",
            "fp8_recipe": "mxfp8",
            "first_last_layers_bf16": True,
            "num_layers_at_start_in_bf16": 2,
        },
    ),
    ("te_tensorwise_e4m3", {"fp8": "e4m3", "fp8_recipe": "tensorwise"}),
    ("te_blockwise_hybrid", {"fp8": "hybrid", "fp8_recipe": "blockwise"}),
    ("te_delayed_hybrid", {"fp8": "hybrid", "fp8_recipe": "delayed"}),
    ("te_delayed_e4m3", {"fp8": "e4m3", "fp8_recipe": "delayed"}),
    (  # --no-fp8-wgrad where Megatron honours it (delayed): the GEMMs it places in bf16
        "linear = 'fp8-delayed'\nte_recipe = true\nfp8_wgrad = false",
        {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_wgrad": False},
    ),
]


@pytest.mark.slow
def test_each_gemm_of_a_tiny_gpt_follows_megatrons_own_policy(run, make_checkout, trees, tmp_path):
    """Each case's values in a worktree of one checkout (``worktree --scheme``, checked by
    ``check --expect``), then one worker process trains every case's tiny GPT a step (torch
    and megatron's dependencies imported once, each checkout's megatron imported afresh)."""
    root = make_checkout("0.13.1", inject=False, full=True)
    assert run("init", "--repo", root).code == 0
    megatron = trees["0.13.1"]  # the wheel's megatron package
    jobs: list[tuple[Path, str]] = []
    for i, (scheme, _) in enumerate(CASES):
        args, config = ["--scheme", scheme], None
        if scheme not in TE:
            config = tmp_path / f"case{i}.toml"
            config.write_text(f"[schemes.case]\n{scheme}\nqk = 'bf16'\npv = 'bf16'\n")
            args = ["--scheme", "case", "--config", str(config)]
        s = load_registry(config).schemes[args[1]]
        res = run("worktree", "--repo", root, *args, "--path-only")
        assert res.code == 0, res
        wt = Path(res.out.strip())
        assert run("check", "--repo", wt, "--expect", s.expect()).code == 0
        jobs.append((wt, s.fprop or s.linear))
    figures = []
    for (scheme, flags), got in zip(CASES, _gemms(jobs), strict=True):
        want = megatron_policy(megatron, flags, 4)
        seen: dict[str, dict[str, str]] = {}
        for where, gemm, kind in got["products"]:  # type: ignore[union-attr]
            layer = where.partition("/")[0]
            expected = "quantized" if gemm in want[layer] else "bf16"
            assert kind == expected, (scheme, where, gemm, kind)
            seen.setdefault(where, {})[gemm] = kind
        # every linear GEMM of every module, the output layer's included, was seen
        modules = {"self_attention.linear_qkv", "self_attention.linear_proj"}
        modules |= {"mlp.linear_fc1", "mlp.linear_fc2"}
        expected_where = {f"{n}/{m}" for n in range(1, 5) for m in modules}
        assert set(seen) == expected_where | {"output/output_layer"}
        short = {w: sorted(g) for w, g in seen.items() if set(g) != {"fprop", "dgrad", "wgrad"}}
        assert not short, short
        # the attention core: Q.K^T and P.V of each layer on bf16 operands
        attention = got["attention"]
        assert len(attention) == 8 and not any(any(g) for _, g in attention), attention
        quantized = sum(k == "quantized" for _, _, k in got["products"])  # type: ignore[union-attr]
        figures.append((scheme.split("\n")[0], quantized, len(got["products"])))  # type: ignore[arg-type]
    print(figures)


# -- the native run beside its emulation: one sweep, the stub torchrun ----------------------

STUB_TORCHRUN = r"""#!/usr/bin/env bash
# Megatron's log lines; a TransformerEngine run (its argv says so) logs a lower loss and a
# shorter step than the emulation, so the report's pairing has figures to show
prev="" save=""
for word in "$@"; do
    [[ "$prev" == --save ]] && save="$word"
    prev="$word"
done
run="$(basename "$(dirname "$save")")"
printf '%s\n' "$@" > "$STUB_DIR/argv.$run"
step=96.9 extra=1
if [[ " $* " == *" --transformer-impl transformer_engine "* ]]; then step=50.0 extra=0; fi
for i in 1 2 3 4; do
    loss=$(awk -v i="$i" -v e="$extra" 'BEGIN { printf "%.6E", 10 - i + e * 0.01 * i }')
    printf ' [2026-11-22 11:25:3%d] iteration %9d/%8d | ' "$i" "$i" 4
    printf 'consumed samples: %12d | ' "$((2 * i))"
    printf 'elapsed time per iteration (ms): %s | learning rate: 6.666667E-05 | ' "$step"
    printf 'global batch size: %5d | lm loss: %s | loss scale: 1.0 | grad norm: 2.105 | ' 2 "$loss"
    printf 'number of skipped iterations: %3d | number of nan iterations: %3d |\n' 0 0
done
"""
NVIDIA_SMI = r"""#!/usr/bin/env bash
# GPU 0 an Ampere (8.0), GPU 1 a Hopper (9.0)
if [[ "$1" == -L ]]; then
    echo "GPU 0: NVIDIA A100 (UUID: GPU-0)"
    echo "GPU 1: NVIDIA H100 (UUID: GPU-1)"
else
    printf '8.0\n9.0\n'
fi
"""


def _stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from .test_scripts import QUANTPATCH

    bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub.mkdir()
    for name, text in (("torchrun", STUB_TORCHRUN), ("nvidia-smi", NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_DIR", str(stub))
    monkeypatch.setenv("QUANTPATCH", QUANTPATCH)
    monkeypatch.setenv("PYTHON", sys.executable)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return stub


@pytest.mark.slow
def test_the_native_twin_runs_beside_its_emulation_and_the_report_pairs_them(
    tmp_path, make_checkout, monkeypatch, run
):
    from .conftest import snapshot

    root = make_checkout(
        "0.13.1", inject=False, extra=("megatron/core/extensions/transformer_engine.py",)
    )
    assert run("init", "--repo", root).code == 0
    stub = _stubs(tmp_path, monkeypatch)
    out = tmp_path / "sweep"
    schemes = "bf16,te_tensorwise_hybrid,native_tensorwise_hybrid"
    sweep = ["sweep", "run", out, "--models", "llama32-1b", "--datasets", "wikipedia"]
    sweep += ["--profile", "smoke", "--schemes", schemes, "--repo", root]
    # no TransformerEngine in the training Python: refused before anything is written
    before = snapshot(root)
    res = run(*sweep, "--gpus", "1")
    assert res.code == 2, res
    assert "native_tensorwise_hybrid: native schemes need TransformerEngine" in res.err
    assert sys.executable in res.err and "set PYTHON to a Python that has it" in res.err
    assert not out.exists() and snapshot(root) == before
    # the advice: TransformerEngine installed where that Python finds it
    site = tmp_path / "site"
    (site / "transformer_engine").mkdir(parents=True)
    (site / "transformer_engine" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site))
    # GPU 0 (compute capability 8.0) has no FP8: refused, naming the GPU that has it
    res = run(*sweep, "--gpus", "0")
    assert res.code == 2, res
    assert "TransformerEngine runs FP8 tensorwise on compute capability 8.9 or higher" in res.err
    assert "GPU 0 of this machine is 8.0; choose GPUs 1 with --gpus" in res.err
    assert not out.exists() and snapshot(root) == before
    res = run(*sweep, "--gpus", "1")  # the advice followed
    assert res.code == 0, res
    assert "3 of 3 finished, 0 failed" in res.out
    # each run's argv carries its own scheme's arguments, after the profile's
    argv = {p.name.split(".", 1)[1]: p.read_text().split("\n") for p in stub.glob("argv.*")}
    native = argv["llama32-1b_wikipedia_native_tensorwise_hybrid_smoke"]
    emulated = argv["llama32-1b_wikipedia_te_tensorwise_hybrid_smoke"]
    tail = ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"]
    tail += ["--fp8-recipe", "tensorwise"]
    at = native.index("--transformer-impl", native.index("--transformer-impl") + 1)
    assert native[at : at + 6] == tail  # the last --transformer-impl: argparse takes it
    assert native.index("local") < at
    for other in (emulated, argv["llama32-1b_wikipedia_bf16_smoke"]):
        assert "--fp8-format" not in other and "transformer_engine" not in other
    rec = json.loads((out / "sweep.json").read_text())
    commits = {r["scheme"]: r["commit"] for r in rec["runs"]}
    assert commits["native_tensorwise_hybrid"] == commits["bf16"]  # no site runs a format
    assert commits["te_tensorwise_hybrid"] != commits["bf16"]
    recorded = {r["scheme"]: r["args"] for r in rec["runs"]}  # what runs is what it records
    assert recorded["native_tensorwise_hybrid"] == tail
    assert recorded["te_tensorwise_hybrid"] == recorded["bf16"] == []
    # the report pairs the emulation with its native twin: loss difference, step times
    html = (out / "report.html").read_text()
    assert "Emulation beside the native recipe (1 pairs)" in html
    from quantpatch.analysis.training_logs import runs, twin_rows

    rows = twin_rows(runs([out / "runs"]), [("te_tensorwise_hybrid", "native_tensorwise_hybrid")])
    assert len(rows) == 1
    row = rows[0]
    assert row["matched_iterations"] == 4
    assert row["loss_diff_mean"] == pytest.approx(0.025)  # 0.01 i over i = 1..4
    assert row["loss_diff_max_abs"] == pytest.approx(0.04)
    assert (row["step_ms_emulated"], row["step_ms_native"]) == (96.9, 50.0)
    assert " ".join(tail) in html  # the provenance table: the native run's own arguments
    for cell in ("te_tensorwise_hybrid", "native_tensorwise_hybrid", "96.9", "50"):
        assert cell in html


@pytest.mark.slow
def test_a_native_scheme_on_a_fork_without_te_layers_is_refused_until_it_has_them(
    tmp_path, trees, monkeypatch, run
):
    import shutil

    import git

    from .conftest import snapshot
    from .forklike import build_fork, clone_quant

    fork = build_fork(tmp_path / "origin", trees["0.13.1"], full=False)
    root = clone_quant(fork, tmp_path / "Megatron-LM")
    assert run("init", "--repo", root).code == 0
    # the emulation sets on the fork after init: its values through quantpatch_ops, which
    # keep the output layer in BF16
    res = run("set", "--repo", root, "--scheme", "te_blockwise_e4m3")
    assert res.code == 0, res
    assert run("check", "--repo", root, "--expect", "linear=fp8-block,bf16_layers=output").code == 0
    assert run("restore", "--repo", root).code == 0
    # the new pairs, and the delayed recipe with --no-fp8-wgrad, on the fork's own sites
    config = tmp_path / "no_wgrad.toml"
    config.write_text("[schemes.te_delayed_hybrid]\nfp8_wgrad = false\n")
    for scheme, want in (
        ("te_blockwise_hybrid", "linear=fp8-block-hybrid"),
        ("te_tensorwise_e4m3", "linear=fp8-tensor-e4m3"),
        ("te_delayed_hybrid", "fprop=fp8-delayed,dgrad=fp8-delayed,wgrad=bf16"),
    ):
        res = run("set", "--repo", root, "--scheme", scheme, "--config", config)
        assert res.code == 0, res
        expect = f"{want},qk=bf16,pv=bf16,bf16_layers=output"
        assert run("check", "--repo", root, "--expect", expect).code == 0, scheme
        assert run("restore", "--repo", root).code == 0
    _stubs(tmp_path, monkeypatch)
    site = tmp_path / "site" / "transformer_engine"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site.parent))
    gen = ["gen-scripts", "--out", tmp_path / "scripts", "--models", "llama32-1b"]
    gen += ["--datasets", "wikipedia", "--profile", "smoke", "--repo", root]
    gen += ["--schemes", "te_blockwise_e4m3,native_blockwise_e4m3"]
    before = snapshot(root)
    res = run(*gen)
    assert res.code == 2, res
    assert "megatron/core/extensions/transformer_engine.py" in res.err
    assert "run them from a Megatron-LM checkout that has it" in res.err
    assert not (tmp_path / "scripts").exists() and snapshot(root) == before
    # the advice: the checkout gets Megatron's TransformerEngine layers
    rel = "megatron/core/extensions/transformer_engine.py"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(trees["0.13.1"].parent / rel, root / rel)
    repo = git.Repo(root)
    repo.git.add(rel)
    repo.git.commit("-qm", "Megatron's TransformerEngine layers")
    res = run(*gen)
    assert res.code == 0, res
    script = next((tmp_path / "scripts").rglob("*_native_blockwise_e4m3.sh")).read_text()
    assert (
        "SCHEME_ARGS=(--transformer-impl transformer_engine --fp8-format e4m3 --fp8-recipe "
        "blockwise)" in script
    )


BEFORE_OUTPUT = Path(__file__).parent / "data/before_output_policy/quantpatch_layers.py"
"""The policy runtime as quantpatch installed it before the ``output`` item."""


@pytest.mark.slow
def test_an_output_policy_on_an_older_policy_runtime_is_refused_until_upgrade(run, make_checkout):
    import hashlib

    import git

    from .conftest import snapshot

    root = make_checkout(inject=False)
    assert run("init", "--repo", root).code == 0
    rel = "megatron/core/quantpatch/quantpatch_layers.py"
    text = BEFORE_OUTPUT.read_text(encoding="utf-8")
    (root / rel).write_text(text, encoding="utf-8")  # as an earlier init left it
    state = root / ".git/quantpatch/init/record.json"
    record = json.loads(state.read_text())
    record["files"][rel]["written"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    state.write_text(json.dumps(record, indent=2) + "\n")
    repo = git.Repo(root)
    repo.git.add("-A", "megatron")
    repo.git.commit("-qm", "quantpatch init (before the output policy)")
    before = snapshot(root)
    res = run("set", "--repo", root, "--scheme", "te_tensorwise_hybrid")
    assert res.code == 2, res
    assert "'output' needs the policy runtime of quantpatch" in res.err
    assert "run 'quantpatch upgrade'" in res.err
    assert snapshot(root) == before
    assert run("upgrade", "--repo", root).code == 0  # the advice
    res = run("set", "--repo", root, "--scheme", "te_tensorwise_hybrid")
    assert res.code == 0, res
    assert "quantpatch_bf16_layers = 'output'" in (root / LINEAR).read_text()


def test_a_native_scheme_takes_the_layout_of_transformer_engines_layers(run, tmp_path, monkeypatch):
    """CP 2 needs TransformerEngine's attention: refused for the emulation (the local
    layers), accepted for its native twin, whose script checks its layout as TE layers."""
    site = tmp_path / "site" / "transformer_engine"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site.parent))
    monkeypatch.setenv("PYTHON", sys.executable)
    gen = ["gen-scripts", "--profile", "smoke", "--models", "llama32-1b"]
    gen += ["--datasets", "wikipedia", "--cp", "2", "--gpus-per-node", "2"]
    res = run(*gen, "--out", tmp_path / "a", "--schemes", "te_tensorwise_hybrid")
    assert res.code == 2 and "CP 2 needs Transformer Engine attention" in res.err, res
    res = run(*gen, "--out", tmp_path / "b", "--schemes", "native_tensorwise_hybrid")
    assert res.code == 0, res
    script = next((tmp_path / "b").rglob("*.sh")).read_text()
    assert "--seq-length 256 --transformer-impl transformer_engine \\" in script


def test_gen_scripts_gives_each_native_twin_its_pairs_flags(run, tmp_path, monkeypatch):
    """Every native twin in one ``gen-scripts``: each script's scheme arguments are its pair's
    flags (checked against Megatron's flag list on the way), a delayed twin's with
    ``--no-fp8-wgrad`` where its emulation's config sets fp8_wgrad = false."""
    site = tmp_path / "site" / "transformer_engine"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site.parent))
    monkeypatch.setenv("PYTHON", sys.executable)
    config = _config(tmp_path, "[schemes.te_delayed_e4m3]\nfp8_wgrad = false\n")
    twins = [name.replace("te_", "native_") for name in TE]
    gen = ["gen-scripts", "--profile", "smoke", "--models", "llama32-1b", "--datasets"]
    gen += ["wikipedia", "--out", tmp_path / "out", "--schemes", ",".join(twins)]
    res = run(*gen, "--config", config)
    assert res.code == 0, res
    for name, (_, fmt, recipe) in TE.items():
        twin = name.replace("te_", "native_")
        script = next((tmp_path / "out").rglob(f"*_{twin}.sh")).read_text()
        flags = f"--fp8-format {fmt} --fp8-recipe {recipe}"
        flags += " --no-fp8-wgrad" if name == "te_delayed_e4m3" else ""
        assert f"SCHEME_ARGS=(--transformer-impl transformer_engine {flags})" in script, twin


def test_run_refuses_a_native_scheme_on_a_gpu_without_its_format(
    tmp_path, make_checkout, monkeypatch, run
):
    """``run`` trains on this machine: its visible GPUs (CUDA_VISIBLE_DEVICES) are checked,
    and the advice (the GPU that has the format) is followed."""
    root = make_checkout(inject=False, extra=("megatron/core/extensions/transformer_engine.py",))
    assert run("init", "--repo", root).code == 0
    _stubs(tmp_path, monkeypatch)
    site = tmp_path / "site" / "transformer_engine"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site.parent))
    one = ["run", "--model", "llama32-1b", "--dataset", "wikipedia", "--profile", "smoke"]
    one += ["--scheme", "native_tensorwise_hybrid", "--dry-run", "--repo", root]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    res = run(*one)
    assert res.code == 2, res
    assert "GPU 0 of this machine is 8.0; choose GPUs 1 with CUDA_VISIBLE_DEVICES" in res.err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    res = run(*one)  # its worktree verified, the command printed (by the script, on fd 1)
    assert res.code == 0, res
