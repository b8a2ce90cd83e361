"""Discovery and classification on real megatron-core files with every site layout."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from quantpatch.base.errors import UserError
from quantpatch.sites import discovery as sites_module
from quantpatch.sites.codemods.init_sites import Layout, inject_sites
from quantpatch.sites.discovery import discover_sites, discover_source, role_values

from .conftest import ATTENTION, LINEAR, VERSIONS


def _src(trees: dict[str, Path], version: str, rel: str) -> str:
    return (trees[version].parent / rel).read_text(encoding="utf-8")


def _inject(trees: dict[str, Path], version: str, rel: str, layout: Layout) -> str:
    kind = "linear" if rel == LINEAR else "attention"
    return inject_sites(_src(trees, version, rel), rel, kind, layout)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("layout", "linear", "attention"),
    [
        (Layout(), ["literal"] * 3, [("qk", "literal"), ("pv", "literal")]),
        (
            Layout(quote='"', annotated=True),
            ["literal"] * 3,
            [("qk", "literal"), ("pv", "literal")],
        ),
        (Layout(env=True), ["env"] * 3, [("qk", "env"), ("pv", "env")]),
        (Layout(comments=True), ["literal"] * 3, [("qk", "literal"), ("pv", "literal")]),
        (Layout(shared_attention=True), ["literal"] * 3, [("qk+pv", "literal")]),
        (
            Layout(nested=True),
            ["literal"] * 6,
            [("qk", "literal"), ("qk", "literal"), ("pv", "literal"), ("pv", "literal")],
        ),
        (Layout(label=True), ["label"] + ["literal"] * 3, [("qk", "literal"), ("pv", "literal")]),
    ],
    ids=["plain", "double-annotated", "env", "comments", "shared", "nested-else", "label"],
)
def test_layouts_classify_by_structure(trees, version, layout, linear, attention):
    lin = discover_source(_inject(trees, version, LINEAR, layout), LINEAR, "linear")
    att = discover_source(_inject(trees, version, ATTENTION, layout), ATTENTION, "attention")
    assert [s.form for s in lin.sites] == linear
    assert {s.role for s in lin.sites} == {"linear"}
    assert all(
        s.function.startswith("LinearWithGradAccumulationAndAsyncCommunication.") for s in lin.sites
    )
    assert [(s.role, s.form) for s in att.sites] == attention
    assert {s.function for s in att.sites} == {"DotProductAttention.forward"}
    assert all(s.value == "bf16" for s in lin.sites + att.sites)
    # lines are real: the reported line holds the assignment
    text = _inject(trees, version, ATTENTION, layout).splitlines()
    for s in att.sites:
        assert "custom_quant_type" in text[s.line - 1]
    # and the excerpt read by a cold ``check`` finds exactly the same
    for rel, kind, fs in ((LINEAR, "linear", lin), (ATTENTION, "attention", att)):
        assert _dicts(discover_sites(fs.text, rel, kind)) == _dicts(fs.sites)


def _dicts(sites):
    return [s.to_dict() for s in sites]


MODULE_LEVEL = """\ufeff# -*- coding: utf-8 -*-
import torch

custom_quant_type = 'hifp8'  # a module-level default
if custom_quant_type == 'bf16':
    GEMM = torch.matmul


class Outer:
    '''custom_quant_type is read below.'''

    x = 1; y = 2

    class Inner(
        Base,
    ):
        @decorate("custom_quant_type")
        def forward(self, query, key, value, attention_probs):
            custom_quant_type = 'mxfp8'
            if custom_quant_type == 'mxfp8':
                out = torch.baddbmm(buf, query, key)
            custom_quant_type = \\
                'mxfp4'
            if custom_quant_type != 'bf16':
                out = torch.bmm(attention_probs, value)
            return out

        def other(self):
            return 1

    def label(self):
        a = custom_quant_type = 'bf16'
        save(a)


class Flat: custom_quant_type: str = 'bf16'
"""


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_the_excerpt_finds_what_the_whole_file_finds(newline):
    """Module-level sites, nested classes, decorators and docstrings that name the site,
    a continuation line, a BOM, CRLF, and a class whose member shares its header's line
    (the whole file is then read)."""
    text = MODULE_LEVEL.replace("\n", newline)
    whole = discover_source(text, ATTENTION, "attention").sites
    assert [(s.line, s.function, s.value) for s in whole] == [
        (4, "<module>", "hifp8"),
        (19, "Outer.Inner.forward", "mxfp8"),
        (22, "Outer.Inner.forward", "mxfp4"),
        (32, "Outer.label", "bf16"),
        (36, "Flat", "bf16"),
    ]
    assert _dicts(discover_sites(text, ATTENTION, "attention")) == _dicts(whole)
    split = text.replace("class Flat: ", "class Flat:" + newline + "    ")
    assert _dicts(discover_sites(split, ATTENTION, "attention"))[:4] == _dicts(whole)[:4]
    source, _ = sites_module._excerpt(split)
    assert "def other" not in source and "x = 1" not in source and "class Inner(" in source
    assert sites_module._excerpt(text) is None  # 'class Flat: custom_quant_type ...'


def test_lines_from_libcst_where_cpython_disagrees(trees, monkeypatch):
    """Where CPython's tree is missing or counts other sites, each site's line comes from
    libcst's positions (the whole file is then parsed): the same lines."""
    for rel, kind in ((LINEAR, "linear"), (ATTENTION, "attention")):
        text = _inject(trees, "0.13.1", rel, Layout(label=True))
        want = _dicts(discover_source(text, rel, kind).sites)
        with monkeypatch.context() as m:
            m.setattr(sites_module, "_site_lines", lambda tree: [])
            assert _dicts(discover_source(text, rel, kind).sites) == want
            assert _dicts(discover_sites(text, rel, kind)) == want
            m.setattr(sites_module, "_ast_of", lambda text: None)
            assert _dicts(discover_source(text, rel, kind).sites) == want


def test_linear_sites_cover_forward_dgrad_wgrad(trees):
    fs = discover_source(_inject(trees, "0.13.1", LINEAR, Layout()), LINEAR, "linear")
    assert [s.function.rsplit(".", 1)[1] for s in fs.sites] == ["forward", "backward", "backward"]


def test_roles_do_not_depend_on_line_numbers(trees):
    """Moving code above the sites (what broke the fork's line-number script) changes nothing
    but the lines."""
    text = _inject(trees, "0.13.1", ATTENTION, Layout())
    moved = "# a new header comment\n" * 7 + "import os\n\n\n" + text
    before = discover_source(text, ATTENTION, "attention").sites
    after = discover_source(moved, ATTENTION, "attention").sites
    assert [(s.role, s.value) for s in before] == [(s.role, s.value) for s in after]
    assert [s.line + 10 for s in before] == [s.line for s in after]


def test_swapped_order_is_still_classified_by_product():
    text = """
def forward(self, query, key, value, attention_probs, buf):
    custom_quant_type = "mxfp4"
    if custom_quant_type == "bf16":
        context = torch.bmm(attention_probs, value)
    custom_quant_type = "hifp8"
    if custom_quant_type == "bf16":
        scores = torch.baddbmm(buf, query, key.transpose(1, 2), beta=0.0)
    return scores, context
"""
    sites = discover_source(text, "a.py", "attention").sites
    assert [(s.role, s.value) for s in sites] == [("pv", "mxfp4"), ("qk", "hifp8")]


def test_override_comment_dynamic_and_unknown():
    text = """import os
def forward(query, key):
    custom_quant_type = 'mxfp8'  # quantpatch: role=pv
    if custom_quant_type == 'bf16':
        out = torch.baddbmm(buf, query, key)
    custom_quant_type = pick_format()
    if custom_quant_type == 'x':
        out = torch.bmm(attention_probs, value)
    custom_quant_type = os.getenv('CUSTOM_QUANT_TYPE', default="hifp8")
    if custom_quant_type == 'bf16':
        out = something_else(a, b)
"""
    sites = discover_source(text, "a.py", "attention").sites
    assert [(s.role, s.form, s.value) for s in sites] == [
        ("pv", "literal", "mxfp8"),
        ("pv", "dynamic", None),
        ("unknown", "env", "hifp8"),
    ]
    assert sites[1].source == "pick_format()"
    with pytest.raises(UserError, match="unknown role 'xx'"):
        discover_source(text.replace("role=pv", "role=xx"), "a.py", "attention")


def test_bare_literal_line_does_not_parse_and_names_the_line(trees):
    """The fork's sed accident: the assignment reduced to a bare 'hifp8' line that breaks the
    if/else below. Discovery refuses with the file and line."""
    text = _inject(trees, "0.13.1", ATTENTION, Layout())
    broken = text.replace("custom_quant_type = 'bf16'\n        if", "'hifp8'\n        elif", 1)
    with pytest.raises(UserError, match=r"dot_product_attention.py:\d+: the file does not parse"):
        discover_source(broken, ATTENTION, "attention")


def test_syntax_error_names_the_real_line(trees):
    """Inside an indented block libcst's own error position is a line late; the reported line
    is the one that holds the error (and each form gets CPython's reason)."""
    text = _inject(trees, "0.13.1", ATTENTION, Layout())
    lines = text.splitlines(keepends=True)
    bad = next(i for i, line in enumerate(lines) if "custom_quant_type = 'bf16'" in line)
    lines[bad] = lines[bad].replace("= 'bf16'", "= = 'bf16'")
    for discover in (discover_source, discover_sites):
        with pytest.raises(UserError) as exc:
            discover("".join(lines), ATTENTION, "attention")
        assert str(exc.value) == (
            f"{ATTENTION}:{bad + 1}: the file does not parse as Python (invalid syntax)."
        )
    lines = text.splitlines(keepends=True)
    lines[bad] = lines[bad].replace("= 'bf16'", "= ('bf16'")
    with pytest.raises(UserError, match=rf":{bad + 1}: .*\('\(' was never closed\)"):
        discover_source("".join(lines), ATTENTION, "attention")


def test_role_values_flag_disagreement(trees):
    # the forward GEMM's one site differing from the gradients' is a value per GEMM
    text = _inject(trees, "0.13.1", LINEAR, Layout())
    text = text.replace("custom_quant_type = 'bf16'", "custom_quant_type = 'mxfp8'", 1)
    values, mismatched = role_values(discover_source(text, LINEAR, "linear").sites)
    assert values["linear"] is None and mismatched == {}
    assert (values["fprop"], values["dgrad"], values["wgrad"]) == ("mxfp8", "bf16", "bf16")
    # two sites of one GEMM (one in each branch of an if) that differ disagree
    text = _inject(trees, "0.13.1", LINEAR, Layout(nested=True))
    text = text.replace("custom_quant_type = 'bf16'", "custom_quant_type = 'mxfp8'", 1)
    values, mismatched = role_values(discover_source(text, LINEAR, "linear").sites)
    assert values["linear"] is None and values["fprop"] is None
    assert [s.value for s in mismatched["linear"]] == ["mxfp8", *["bf16"] * 5]
    assert [s.value for s in mismatched["fprop"]] == ["mxfp8", "bf16"]


def test_file_without_token_is_not_classified(trees):
    fs = discover_source(_src(trees, "0.13.1", LINEAR), LINEAR, "linear")
    assert fs.sites == []


def test_injection_refuses_checkout_with_sites(trees):
    text = _inject(trees, "0.13.1", LINEAR, Layout())
    with pytest.raises(UserError, match="already has custom_quant_type sites"):
        inject_sites(text, LINEAR, "linear")


def test_injection_refuses_unknown_layout():
    with pytest.raises(UserError, match="cannot find the qk, pv product"):
        inject_sites(
            "class DotProductAttention:\n    def forward(self):\n        pass\n",
            ATTENTION,
            "attention",
        )


@pytest.mark.parametrize("version", ["0.11.0", "0.13.1"])
def test_chunk_starts_from_the_ast_match_libcst_code(trees, version):
    """Where each top-level statement starts (read from CPython's AST) is exactly where
    libcst's generated code puts it, on the real files and on the fork's layout."""
    from quantpatch.sites.discovery import _ast_of, _chunk_starts

    for rel, kind in ((LINEAR, "linear"), (ATTENTION, "attention")):
        stock = (trees[version].parent / rel).read_text()
        for text in (stock, inject_sites(stock, rel, kind, Layout(comments=True, nested=True))):
            for variant in (text, text.replace("\n", "\r\n"), "\ufeff# top\n\n" + text):
                module = cst.parse_module(variant)
                starts = _chunk_starts(module, variant, _ast_of(variant))
                assert starts is not None, (rel, version)
                offset, want = len(module.header), []
                for stmt in module.body:
                    want.append(offset)
                    offset += module.code_for_node(stmt).count("\n")
                assert starts == want, (rel, version)
