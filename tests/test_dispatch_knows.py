"""What a site's dispatch knows, and the refusal of a value it does not: a fork's explicit
``if custom_quant_type == 'mxfp8': ... else: <stock>`` chain runs its stock bf16 product for
any other value, so ``set`` (and ``worktree``, and ``check --expect``) say so before anything
changes. Small hand-written checkouts: the real fork-shaped ones are in test_init.py."""

from __future__ import annotations

import ast

import git
import pytest

from quantpatch.checkout.init import OPS_MODULE, ops_source
from quantpatch.sites.codemods.init_sites import teach_dispatches
from quantpatch.sites.discovery import discover_source, read_ops_values
from quantpatch.sites.model import OPS_VALUES, OpsValues, dispatch_knows
from quantpatch.sites.policy import POLICY_BLOCK

from .conftest import ATTENTION, LINEAR, snapshot

FORK_LINEAR = """\
import torch


class CustomLinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    @staticmethod
    def forward(ctx, total_input, weight):
        custom_quant_type = 'hifp8'
        save(total_input, quant_type=custom_quant_type)
        custom_quant_type = 'hifp8'
        if custom_quant_type == 'mxfp8':
            output = fork_quant.matmul(total_input, weight.t(), fmt='mxfp8')
        elif custom_quant_type in ('mxfp4', 'hifp8'):
            output = fork_quant.matmul(total_input, weight.t(), fmt=custom_quant_type)
        else:
            output = torch.matmul(total_input, weight.t())
        return output
"""

FORK_ATTENTION = """\
import torch


class DotProductAttention:
    def forward(self, query, key, attention_probs, value):
        custom_quant_type = "hifp8"
        if "mxfp8" == custom_quant_type:
            scores = fork_quant.bmm(query, key, fmt="mxfp8")
        else:
            scores = torch.bmm(query, key)
        {pv}
        return scores, context
"""

GENERIC = """\
import torch


class DotProductAttention:
    def forward(self, a, b):
        custom_quant_type = 'bf16'
        if custom_quant_type == 'bf16':
            y = {product}
        else:
            from megatron.core.quantpatch import quantpatch_ops
            y = quantpatch_ops.quant_{op}, fmt=custom_quant_type)
        return y
"""
"""quantpatch's own dispatch, as init writes it."""

PV_STOCK = """if custom_quant_type.startswith("mx"):  # not a plain comparison: unreadable
            context = fork_quant.bmm(attention_probs, value, fmt=custom_quant_type)
        else:
            context = torch.bmm(attention_probs, value)"""


def _knows(text: str, rel: str, kind: str) -> list[tuple[str, str, object]]:
    return [(s.form, s.role, s.knows) for s in discover_source(text, rel, kind).sites]


def test_each_site_knows_its_chains_values():
    assert _knows(FORK_LINEAR, LINEAR, "linear") == [
        ("label", "linear", None),  # governs nothing: never refused
        ("literal", "linear", (("bf16", "hifp8", "mxfp4", "mxfp8"),)),
    ]
    attention = FORK_ATTENTION.format(pv=PV_STOCK)
    # one site reaches both products; the P.V dispatch cannot be read, so neither can it
    assert _knows(attention, ATTENTION, "attention") == [("literal", "qk+pv", None)]


@pytest.mark.parametrize(
    ("branches", "knows"),
    [
        (
            "if custom_quant_type == 'bf16':\n    y = a\nelse:\n    y = quantpatch_ops.quant_matmul"
            "(a, b, fmt=custom_quant_type)\n",
            ("bf16", OPS_VALUES),
        ),
        (
            "if custom_quant_type == 'x':\n    y = a\nelif custom_quant_type != 'bf16':\n"
            "    y = quantpatch_ops.quant_bmm(a, b, fmt=custom_quant_type)\nelse:\n    y = b\n",
            ("bf16", OPS_VALUES, "x"),
        ),
        ("if custom_quant_type == 'x':\n    y = a\nelse:\n    raise ValueError(y)\n", ("x",)),
        ("if custom_quant_type not in ['x', 'y']:\n    y = a\n", None),  # catch-all, fork op
        ("if custom_quant_type == X:\n    y = a\n", None),
        ("if custom_quant_type in 'xy':\n    y = a\n", None),  # a substring test
        ("if custom_quant_type in 'x' 'y':\n    y = a\n", None),
        ("if custom_quant_type == 'x' or flag:\n    y = a\n", None),
        ("if custom_quant_type in ('x', ('y',)):\n    y = a\n", None),
        ("if custom_quant_type is None:\n    y = a\n", None),
        ("if custom_quant_type in {'x', 'y'}:\n    y = a\n", ("bf16", "x", "y")),
    ],
)
def test_chain_forms(branches, knows):
    body = "".join(f"    {line}\n" for line in branches.splitlines())
    text = f"def forward(a, b):\n    custom_quant_type = 'x'\n{body}    return y\n"
    (site,) = discover_source(text, LINEAR, "linear").sites
    assert site.knows == (None if knows is None else (tuple(sorted(knows)),))


def _spec_source() -> str:
    from quantpatch.checkout.parts import FORMATS_MODULE, runtime_source

    return runtime_source(FORMATS_MODULE)


def test_the_ops_module_is_read_never_imported():
    from quantpatch.base.config import QUANT_TYPES
    from quantpatch.runtime.quantpatch_formats import GROUPED

    shipped = read_ops_values(ops_source(), _spec_source())  # its values are the spec's
    assert shipped == OpsValues(frozenset(QUANT_TYPES), frozenset(GROUPED))
    assert read_ops_values(ops_source()).readable is False  # the spec missing: nothing refused
    assert read_ops_values(ops_source(), "Format(name)\n").readable is False
    half = 'Format("x", "mx")\nFormat("fp8-block-2d", "fp8-block", roles=())\n'
    assert read_ops_values(ops_source(), half) == OpsValues(frozenset({"x"}))
    ops = read_ops_values(
        "import torch\nBASE = ('bf16', 'mxfp8')\nW: tuple = ('w1', 'w2')\n"
        "FORMATS = (*BASE, 'nvfp4') + W\nGROUPED_FORMATS = W\nraise SystemExit\n"
    )
    assert ops == OpsValues(
        frozenset({"bf16", "mxfp8", "nvfp4", "w1", "w2"}), frozenset({"w1", "w2"})
    )
    assert ops.declares("w2g128") and not ops.declares("w2g") and not ops.declares("w3g64")
    assert not ops.declares("mxfp8g32") and not ops.declares("w2g0")
    assert read_ops_values(None) == OpsValues()  # no module: nothing
    for unreadable in ("FORMATS = tuple(x)\n", "OTHER = ()\n", "FORMATS = (\n", "FORMATS = A\n"):
        assert read_ops_values(unreadable).readable is False, unreadable
    (site,) = [s for s in discover_source(FORK_LINEAR, LINEAR, "linear").sites if s.knows]
    generic = discover_source(
        GENERIC.format(product="torch.matmul(a, b)", op="matmul(a, b"), LINEAR, "linear"
    ).sites[0]
    assert dispatch_knows(site, "nvfp4", OpsValues(readable=False)) is False  # no ops branch
    assert dispatch_knows(generic, "nvfp4", OpsValues(readable=False)) is None
    assert dispatch_knows(generic, "w2g128", ops) is True


def _fork(tmp_path, pv: str = PV_STOCK, ops: bool = False, generic: bool = False):
    root = tmp_path / "fork"
    texts = [(LINEAR, FORK_LINEAR), (ATTENTION, FORK_ATTENTION.format(pv=pv))]
    if generic:
        texts = [
            (LINEAR, GENERIC.format(product="torch.matmul(a, b)", op="matmul(a, b")),
            (ATTENTION, GENERIC.format(product="torch.bmm(query, key)", op="bmm(query, key")),
        ]
    for rel, text in texts:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    if ops:
        from quantpatch.checkout.parts import FORMATS_MODULE

        (root / OPS_MODULE).parent.mkdir(parents=True, exist_ok=True)
        (root / OPS_MODULE).write_text(ops_source())
        (root / FORMATS_MODULE).write_text(_spec_source())
    repo = git.Repo.init(root, initial_branch="quant")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "Test")
        cw.set_value("user", "email", "test@example.com")
    repo.git.add("-A")
    repo.git.commit("-qm", "fork")
    return root


def test_set_refuses_a_value_the_dispatch_does_not_know(run, tmp_path):
    root = _fork(tmp_path)
    before = snapshot(root)
    for extra in ((), ("--no-branch",), ("--dry-run",)):
        res = run("set", "--repo", root, "--linear", "nvfp4", *extra)
        assert res.code == 2, res
        assert f"{LINEAR}:9 (CustomLinear" in res.err and "'nvfp4'" in res.err, res.err
        assert "knows bf16, hifp8, mxfp4, mxfp8" in res.err and "--allow-unknown" in res.err
        assert snapshot(root) == before
    res = run("worktree", "--repo", root, "--linear", "nvfp4", "--qk", "bf16", "--pv", "bf16")
    assert res.code == 2 and "'nvfp4'" in res.err
    assert snapshot(root) == before
    # what the chain knows is written; what cannot be read (qk+pv here) is never refused
    assert run("set", "--repo", root, "--linear", "mxfp4", "--qk", "nvfp4").code == 0
    assert run("restore", "--repo", root).code == 0
    # --allow-unknown writes it anyway, and check --expect then says it does not hold
    res = run("set", "--repo", root, "--linear", "nvfp4", "--allow-unknown", "--no-branch")
    assert res.code == 0, res
    res = run("check", "--repo", root, "--expect", "linear=nvfp4")
    assert res.code == 1 and "--expect linear" in res.out + res.err
    assert f"{LINEAR}:9" in res.out + res.err
    assert run("check", "--repo", root, "--expect", "qk=hifp8").code == 0
    assert run("restore", "--repo", root).code == 0


def test_quantpatch_dispatch_knows_what_its_ops_module_declares(run, tmp_path):
    root = _fork(tmp_path, generic=True)  # sites whose else branch imports quantpatch_ops
    before = snapshot(root)
    res = run("set", "--repo", root, "--qk", "mxfp8")
    assert res.code == 2 and "knows bf16, not 'mxfp8'" in res.err, res.err
    assert snapshot(root) == before
    # the shipped FORMATS spans several lines: replace each declaration's whole statement
    lines = ops_source().splitlines(keepends=True)
    declared = {"FORMATS": 'FORMATS = ("bf16", "mxfp8")\n', "GROUPED_FORMATS": ""}
    spans = {
        stmt.targets[0].id: (stmt.lineno - 1, stmt.end_lineno or stmt.lineno)
        for stmt in ast.parse("".join(lines)).body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
    }
    for name in sorted(declared, key=lambda n: -spans[n][0]):  # bottom up: spans stay valid
        start, end = spans[name]
        lines[start:end] = [declared[name]]
    (root / OPS_MODULE).parent.mkdir(parents=True, exist_ok=True)
    (root / OPS_MODULE).write_text("".join(lines))
    assert read_ops_values("".join(lines)) == OpsValues(frozenset({"bf16", "mxfp8"}))
    git.Repo(root).git.add("-A")
    git.Repo(root).git.commit("-qm", "an ops module without mxfp4")
    assert run("set", "--repo", root, "--qk", "mxfp8").code == 0
    assert run("check", "--repo", root, "--expect", "qk=mxfp8").code == 0
    res = run("set", "--repo", root, "--qk", "mxfp4")
    assert res.code == 2 and "knows bf16, mxfp8, not 'mxfp4'" in res.err, res.err
    assert run("set", "--repo", root, "--qk", "mxfp4", "--allow-unknown").code == 0
    res = run("check", "--repo", root, "--expect", "qk=mxfp4")
    assert res.code == 1 and "not 'mxfp4'" in res.out + res.err
    assert run("restore", "--repo", root).code == 0


def test_init_teaches_the_chains_and_remove_restores_every_byte(run, tmp_path):
    pv = (
        "if custom_quant_type == 'mxfp8':\n"
        "            context = fork_quant.bmm(attention_probs, value, fmt='mxfp8')\n"
        "        else:\n"
        "            context = torch.bmm(attention_probs, value)"
    )
    root = _fork(tmp_path, pv=pv)
    before = snapshot(root)
    assert run("set", "--repo", root, "--qk", "nvfp4", "--pv", "bf16").code == 2
    res = run("init", "--repo", root)
    assert res.code == 0, res
    text = (root / LINEAR).read_text()
    assert (
        FORK_LINEAR.replace(
            "        else:\n            output = torch.matmul",
            "        elif custom_quant_type != 'bf16':\n"
            "            from megatron.core.quantpatch import quantpatch_ops\n"
            "            output = quantpatch_ops.quant_matmul(total_input, weight.t(), "
            'fmt=custom_quant_type, roles=("input", "weight"))\n'
            "        else:\n            output = torch.matmul",
        ).replace("import torch\n", "import torch\n\n" + POLICY_BLOCK, 1)
        == text
    )  # the fork's own branches untouched; the layer policy after the imports
    attention = (root / ATTENTION).read_text()
    assert attention.count('elif custom_quant_type != "bf16":') == 1  # the chain's quotes
    assert attention.count("elif custom_quant_type != 'bf16':") == 1
    assert (root / OPS_MODULE).read_text() == ops_source()
    assert teach_dispatches(text, LINEAR) is None  # taught once
    res = run("init", "--repo", root)
    assert res.code == 2 and "already initialised" in res.err
    res = run("set", "--repo", root, "--linear", "nvfp4-2d", "--qk", "nvfp4", "--pv", "mxfp8")
    assert res.code == 0, res
    assert run("restore", "--repo", root).code == 0
    assert run("init", "--repo", root, "--remove").code == 0
    assert snapshot(root)["files"] == before["files"]


def test_a_shared_site_is_checked_per_product(run, tmp_path):
    """One assignment before Q.K^T and P.V: each value is checked against the chain of its
    own product (Q.K^T's knows mxfp8, P.V's mxfp4)."""
    pv = (
        "if custom_quant_type == 'mxfp4':\n"
        "            context = fork_quant.bmm(attention_probs, value, fmt='mxfp4')\n"
        "        else:\n"
        "            context = torch.bmm(attention_probs, value)"
    )
    root = _fork(tmp_path, pv=pv)
    (site,) = discover_source((root / ATTENTION).read_text(), ATTENTION, "attention").sites
    assert (site.role, site.knows_for) == ("qk+pv", ("qk", "pv"))
    before = snapshot(root)
    res = run("set", "--repo", root, "--qk", "mxfp4", "--pv", "mxfp4")
    assert res.code == 2 and "--qk:" in res.err and "knows bf16, mxfp8, not 'mxfp4'" in res.err
    res = run("set", "--repo", root, "--qk", "mxfp8", "--pv", "mxfp8")
    assert res.code == 2 and "--pv:" in res.err and "knows bf16, mxfp4, not 'mxfp8'" in res.err
    assert snapshot(root) == before
    assert run("set", "--repo", root, "--qk", "mxfp8", "--pv", "mxfp4").code == 0


def test_init_refuses_chains_it_cannot_teach(run, tmp_path):
    root = _fork(tmp_path, ops=False)
    assert run("init", "--repo", root).code == 0  # the linear chain and the qk chain
    assert run("init", "--repo", root, "--remove").code == 0
    unreadable = FORK_LINEAR.replace("== 'mxfp8'", "== MXFP8")
    (root / LINEAR).write_text(unreadable)
    (root / ATTENTION).write_text(
        FORK_ATTENTION.format(pv=PV_STOCK).replace('"mxfp8" == custom_quant_type', "flag")
    )
    git.Repo(root).git.commit("-qam", "unreadable chains")
    before = snapshot(root)
    res = run("init", "--repo", root)
    assert res.code == 2 and "already has custom_quant_type sites" in res.err, res.err
    assert snapshot(root) == before


def test_teaching_finds_the_stock_product_in_a_bf16_branch_and_skips_what_it_cannot_read():
    chain = (
        "class CustomLinearWithGradAccumulationAndAsyncCommunication:\n"
        "    def backward(ctx, grad_output, weight):\n"
        '        custom_quant_type = "hifp8"\n'
        '        if custom_quant_type == "hifp8":\n'
        '            grad_input = fork_quant.matmul(grad_output, weight, fmt="hifp8")\n'
        '        elif custom_quant_type == "bf16":\n'
        "            grad_input = grad_output.matmul(weight)\n"
        "        else:\n"
        '            raise ValueError("unknown format")\n'
        "{more}"
        "        return grad_input\n"
    )
    more = (
        '        if custom_quant_type == "mxfp8":\n'  # no recognisable stock product: left
        "            grad_input = grad_input * 2\n"
        "        else:\n"
        "            grad_input = grad_input + 0\n"
        "            grad_input = grad_input * 1\n"
        '        if custom_quant_type == "mxfp4":\n'  # hands on to the ops already: left
        "            grad_input = quantpatch_ops.quant_matmul(grad_output, weight, "
        "fmt=custom_quant_type)\n"
    )
    text = chain.format(more=more)
    taught = teach_dispatches(text, LINEAR)
    assert taught == text.replace(
        "        else:\n            raise",
        '        elif custom_quant_type != "bf16":\n'
        "            from megatron.core.quantpatch import quantpatch_ops\n"
        "            grad_input = quantpatch_ops.quant_matmul(grad_output, weight, "
        'fmt=custom_quant_type, roles=("grad_output", "weight"))\n'
        "        else:\n            raise",
    )
    (site,) = discover_source(taught, LINEAR, "linear").sites
    assert site.knows == (
        tuple(sorted(("bf16", "hifp8", OPS_VALUES))),
        ("bf16", "mxfp8"),
        ("bf16", "mxfp4"),
    )
    unreadable = chain.format(more=more[: more.index('        if custom_quant_type == "mxfp4"')])
    assert teach_dispatches(unreadable.replace('== "hifp8"', "== HIFP8"), LINEAR) is None


def test_a_paretoq_value_needs_the_steps_in_the_layers_constructors(run, make_checkout):
    """Sites in the linear autograd function only (a fork's, or an older init's): the products
    pass a ParetoQ weight through as its layer would have quantized it, so without the
    constructors' sites the run would train unquantized weights; set says so, nothing changed."""
    root = make_checkout("0.13.1")
    before = snapshot(root)
    res = run("set", "--repo", root, "--linear", "w2")
    assert res.code == 2, res
    assert "ColumnParallelLinear.__init__ and RowParallelLinear.__init__" in res.err
    assert f"{LINEAR} has no site" in res.err and "'quantpatch init' adds them" in res.err
    assert snapshot(root) == before
    assert run("set", "--repo", root, "--linear", "mxfp8").code == 0  # other values are fine
    assert run("set", "--repo", root, "--linear", "w2", "--allow-unknown").code == 0
