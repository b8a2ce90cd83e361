"""The README's main job: a demo checkout of the whole megatron-core tree, walked end to end."""

from __future__ import annotations

import git
import pytest

from quantpatch.base.config import Targets, is_paretoq
from quantpatch.base.errors import UserError
from quantpatch.checkout.demo import DEMO_FORMATS, build_checkout
from quantpatch.sites.discovery import discover

from .terminal import assert_cursor_shown, run_in_pty, screen_lines


@pytest.mark.slow  # two minutes: the fast suite keeps the demo's checkout builds below
def test_demo_at_a_terminal_walks_and_restores_byte_identical(run, tmp_path):
    """The demo as the README runs it, at a real terminal (a pty): its spinners leave the
    cursor shown, and what it printed and left behind is the walk the README describes."""
    dest = tmp_path / "demo"
    code, text = run_in_pty("demo", dest)
    assert code == 0, text[-3000:]
    assert_cursor_shown(text)  # its spinners: building, then the linear layer's errors
    lines = screen_lines(text)
    shown = "\n".join(lines)
    assert "target files byte-identical to before the first set: yes" in shown
    assert "quantpatch/linear-hifp8_qk-mxfp4_pv-mxfp8" in shown
    assert lines[-1].startswith(f"try: cd {dest}"), lines[-3:]  # what to try next
    repo = git.Repo(dest)
    assert repo.active_branch.name == "main" and not repo.is_dirty()
    walked = {
        "quantpatch/linear-mxfp8_qk-mxfp8_pv-bf16",
        "quantpatch/linear-hifp8_qk-mxfp4_pv-mxfp8",
    }
    per_format = {f"quantpatch/linear-{f}_qk-bf16_pv-bf16" for f in DEMO_FORMATS}
    assert {h.name for h in repo.heads} == {"main"} | walked | per_format
    # the whole package tree is there, not only the two target files
    assert len(list((dest / "megatron" / "core").rglob("*.py"))) > 200
    assert [c.summary for c in repo.iter_commits("main")] == [
        "quantpatch init: fork-layout custom_quant_type sites (bf16) and the runtime they "
        "call, megatron/core/quantpatch/",
        "megatron-core 0.13.1, unmodified",
    ]
    # the error table: bf16 is the reference, every quantized format differs from it
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 4 and cells[0] in DEMO_FORMATS:
            rows[cells[0]] = [float(c) for c in cells[1:]]
    assert set(rows) == set(DEMO_FORMATS), "a row per format the demo runs"
    assert rows["bf16"] == [0.0, 0.0, 0.0]
    for fmt in (f for f in DEMO_FORMATS if f != "bf16" and not is_paretoq(f)):
        assert all(0.001 < e < 0.5 for e in rows[fmt]), (fmt, rows[fmt])
    # RCEIL never saturates a block's largest element: E4M3 forward no worse than the floor
    # rule's; E4M3 gradients (mxfp8-rceil) err less than E5M2 ones (the hybrid's)
    assert rows["mxfp8-rceil"][0] == rows["mxfp8-rceil-hybrid"][0]
    assert rows["mxfp8-rceil"][1] < rows["mxfp8-rceil-hybrid"][1]
    # delayed scaling's second step on the same inputs scales by the first one's amaxes: what
    # current scaling computes; E4M3 gradients err less than E5M2 ones
    assert rows["fp8-delayed"] == rows["fp8-tensor"]
    assert rows["fp8-delayed-e4m3"][0] == rows["fp8-tensor"][0]
    assert rows["fp8-delayed-e4m3"][1] < rows["fp8-delayed"][1]
    assert rows["fp8-delayed-e4m3"] == rows["fp8-tensor-e4m3"]  # Format.E4M3's two recipes
    # Format.HYBRID's blocks: E4M3 forward as fp8-block's, E5M2 gradients err more
    assert rows["fp8-block-hybrid"][0] == rows["fp8-block"][0]
    assert rows["fp8-block-hybrid"][1] > rows["fp8-block"][1]
    assert rows["mxfp4"][0] > rows["mxfp8"][0]  # 2 mantissa bits less than E4M3
    assert rows["nvfp4"][0] < rows["mxfp4"][0]  # E4M3 scales of 16, not powers of two of 32
    # ParetoQ: the weight quantized (ternary, 2-bit) with the first forward's step, activations
    # as they are: the forward and input gradient err far more than with 4-bit blocks; the
    # weight gradient is the bf16 one but where W / alpha clips (the row maxima: a few)
    for fmt in ("w1.58", "w2"):
        fwd, dgrad, wgrad = rows[fmt]
        assert rows["mxfp4"][0] < fwd < 2 and rows["mxfp4"][1] < dgrad < 2, (fmt, rows[fmt])
        assert 0 < wgrad < 0.2, (fmt, rows[fmt])
    res = run("demo", dest)
    assert res.code == 2 and "not empty" in res.err


def test_demo_checkout_of_older_release(tmp_path):
    dest = build_checkout(tmp_path / "old", "0.11.0")
    sites = [s for f in discover(dest, Targets()) for s in f.sites]
    # the linear autograd function's three products, the ParetoQ steps of ColumnParallelLinear
    # and RowParallelLinear; P.V's format read first at the top of the attention forward (the
    # flash route)
    assert [s.role for s in sites] == [*["linear"] * 5, "pv", "qk", "pv"]


def test_unknown_release_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPATCH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"cannot fetch megatron-core 0\.0\.0"):
        build_checkout(tmp_path / "x", "0.0.0")
