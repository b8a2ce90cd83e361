"""Rewriting: only the literal changes, quote style kept, split of a shared site, inverses."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantpatch.base.config import QUANT_TYPES
from quantpatch.base.errors import UserError
from quantpatch.sites.codemods.init_sites import Layout, inject_sites
from quantpatch.sites.codemods.set_value import plan_module, plan_values, requote, verify_rewrite
from quantpatch.sites.discovery import discover_source, role_values

from .conftest import ATTENTION, LINEAR, VERSIONS


def _fs(trees: dict[str, Path], version: str, rel: str, layout: Layout):
    kind = "linear" if rel == LINEAR else "attention"
    text = inject_sites((trees[version].parent / rel).read_text(), rel, kind, layout)
    return discover_source(text, rel, kind)


def _changed_lines(a: str, b: str) -> list[tuple[str, str]]:
    la, lb = a.splitlines(True), b.splitlines(True)
    if len(la) == len(lb):
        return [(x, y) for x, y in zip(la, lb, strict=False) if x != y]
    sm = difflib.SequenceMatcher(a=la, b=lb)
    out = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "equal":
            out.append(("".join(a.splitlines(True)[i1:i2]), "".join(b.splitlines(True)[j1:j2])))
    return out


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "layout",
    [
        Layout(),
        Layout(quote='"', annotated=True, comments=True),
        Layout(env=True),
        Layout(nested=True, label=True),
    ],
    ids=["plain", "double-annotated-comments", "env", "nested-label"],
)
def test_only_the_literal_changes(trees, version, layout):
    for rel in (LINEAR, ATTENTION):
        fs = _fs(trees, version, rel, layout)
        values = {"linear": "mxfp4", "qk": "hifp8", "pv": "mxfp8"}
        new = plan_values(fs, values)
        kind = "linear" if rel == LINEAR else "attention"
        parsed = verify_rewrite(fs, new, values, kind)
        # verifying on the rewritten tree (what set does) finds exactly what a re-parse finds
        module = plan_module(fs, values)
        assert module is not None and module.code == new.removeprefix("\ufeff")
        assert verify_rewrite(fs, new, values, kind, module=module).sites == parsed.sites
        changes = _changed_lines(fs.text, new)
        assert len(changes) == len(fs.sites)
        for old, new_line in changes:
            q = layout.quote
            assert old.replace(f"{q}bf16{q}", "X", 1) in (
                new_line.replace(f"{q}{v}{q}", "X", 1) for v in ("mxfp4", "hifp8", "mxfp8")
            )
        values, _ = role_values(discover_source(new, rel, kind).sites)
        assert {k: v for k, v in values.items() if v} == (
            {"linear": "mxfp4", "fprop": "mxfp4", "dgrad": "mxfp4", "wgrad": "mxfp4"}
            if rel == LINEAR
            else {"qk": "hifp8", "pv": "mxfp8"}
        )


def test_shared_site_split_and_no_split(trees):
    fs = _fs(trees, "0.13.1", ATTENTION, Layout(shared_attention=True, quote='"'))
    same = plan_values(fs, {"qk": "mxfp8", "pv": "mxfp8"})
    assert [s.role for s in discover_source(same, ATTENTION, "attention").sites] == ["qk+pv"]
    with pytest.raises(UserError, match="cannot differ with --no-split"):
        plan_values(fs, {"qk": "mxfp8", "pv": "bf16"}, split=False)
    split = plan_values(fs, {"qk": "mxfp8", "pv": "hifp8"})
    sites = discover_source(split, ATTENTION, "attention").sites
    assert [(s.role, s.value) for s in sites] == [("qk", "mxfp8"), ("pv", "hifp8")]
    inserted = _changed_lines(fs.text, split)
    assert len(inserted) == 2
    assert inserted[1] == ("", '        custom_quant_type = "hifp8"  # quantpatch: role=pv\n')


def test_dynamic_site_is_never_rewritten():
    text = (
        "def f(a, b):\n    custom_quant_type = pick()\n    if custom_quant_type == 'x':\n"
        "        return torch.matmul(a, b)\n"
    )
    fs = discover_source(text, LINEAR, "linear")
    with pytest.raises(UserError, match="site is dynamic"):
        plan_values(fs, {"linear": "mxfp8"})


@pytest.mark.parametrize(
    ("literal", "expected"),
    [
        ("'a'", "'mxfp4'"),
        ('"a"', '"mxfp4"'),
        ("r'a'", "r'mxfp4'"),
        ('"""a"""', '"""mxfp4"""'),
        ("U'''a'''", "U'''mxfp4'''"),
    ],
)
def test_requote_keeps_prefix_and_quotes(literal, expected):
    assert requote(literal, "mxfp4") == expected


_quotes = st.sampled_from(["'", '"', "'''", '"""'])
_prefix = st.sampled_from(["", "r", "u", "R"])
_ws = st.sampled_from(["", " ", "  ", "\t"])
_comment = st.sampled_from(["", "  # note", "\t# quant type", "  #"])
_lead = st.lists(st.sampled_from(["", "    # comment", "    ", "# outdented comment"]), max_size=3)
_value = st.sampled_from(QUANT_TYPES)


@settings(max_examples=150, deadline=None)
@given(
    q=_quotes,
    prefix=_prefix,
    ws1=_ws,
    ws2=_ws,
    comment=_comment,
    lead=_lead,
    annotated=st.booleans(),
    env=st.booleans(),
    value=_value,
    new=_value,
    newline=st.sampled_from(["\n", "\r\n"]),
)
def test_rewrite_then_inverse_is_byte_identical(
    q, prefix, ws1, ws2, comment, lead, annotated, env, value, new, newline
):
    literal = f"{prefix}{q}{value}{q}"
    rhs = f"os.environ.get('CUSTOM_QUANT_TYPE',{ws2}{literal})" if env else literal
    ann = f":{ws1}str" if annotated else ""
    lines = [
        "import os",
        "",
        "def forward(total_input, weight):",
        *lead,
        f"    custom_quant_type{ann} ={ws2 or ' '}{rhs}{comment}",
        f"    if custom_quant_type == {q}bf16{q}:",
        "        return torch.matmul(total_input, weight)",
        "    return None",
        "",
    ]
    text = newline.join(lines)
    fs = discover_source(text, LINEAR, "linear")
    assert [s.value for s in fs.sites] == [value]
    once = plan_values(fs, {"linear": new})
    assert len(once) == len(text) + len(new) - len(value)
    back = plan_values(discover_source(once, LINEAR, "linear"), {"linear": value})
    assert back == text
