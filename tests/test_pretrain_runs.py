"""``benchmarks/gpu_suite.py``'s real-run part, off a GPU: the whole pipeline (init, saver
install, gen-scripts, the scripts through a stub ``torchrun`` that prints core_v0.13.1's log
lines, ``runs``, ``report``) so that it works the first time a GPU is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def test_gpu_suite_runs_the_generated_scripts_with_a_stub_torchrun(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_suite.py"),
            "--device",
            "cpu",
            "--skip",
            "ops,shapes,gemm,cache,flash,saver,e2e",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())["pretrain"]
    assert result["stub"] is True and result["report_bytes"] > 1000
    runs = {(d["model"], d["scheme"]): d for d in result["runs"]}
    assert set(runs) == {
        (m, s)
        for m in ("llama32-1b", "deepseek2_lite")
        for s in ("bf16", "FA_linear_mxfp8", "FA_linear_hifp8")
    }
    for d in runs.values():
        assert d["exit"] == 0 and d["losses"] == 20 and d["losses_finite"], d
        # the log names the commit the scheme's worktree holds
        assert d["commit_is_worktree_head"], d
        assert d["status"] == "finished" and d["iterations"] == 20
    # the stub's step times (50 ms x 1.2 for the MX scheme) come back through `runs`
    assert runs["llama32-1b", "bf16"]["step_vs_bf16"] == 1.0
    assert runs["llama32-1b", "FA_linear_mxfp8"]["step_vs_bf16"] == pytest.approx(1.2)
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "Generated smoke scripts through stub torchrun (no training):" in md
    assert "| deepseek2_lite | FA_linear_hifp8 | 0 |" in md


def _gpu_suite():
    import importlib.util

    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("gpu_suite", BENCH / "gpu_suite.py")
        assert spec is not None and spec.loader is not None
        suite = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite)
    finally:
        sys.path.remove(str(BENCH))
    return suite


def test_gpu_suite_reports_nvfp4_beside_mxfp4(monkeypatch):
    """The ops part on CPU at a small size (kernels in Triton's interpreter): NVFP4's rows
    (nearest, stochastic, 16 x 16 tiles) right after MXFP4's, with the same columns; on a GPU
    they are reported but judged by none of the MX bars, and FA_linear_nvfp4's step is
    reported beside FA_linear_mxfp8's."""
    monkeypatch.setenv("QUANTPATCH_KERNELS", "auto")
    suite = _gpu_suite()
    ops = suite.bench_ops("cpu", 32, 1)
    names = [e["op"] for e in ops["ops"]]
    at = names.index("mxfp4 E2M1, rows")
    assert [e["format"] for e in ops["ops"][at + 1 : at + 4]] == ["nvfp4", "nvfp4", "nvfp4-2d"]
    for e in ops["ops"]:
        assert e["triton_gbs"] > 0 and e["reference_pct_of_copy"] > 0, e
    md = suite.markdown({"device": "cpu", "device_name": "CPU", "ops": ops, "bars": []})
    assert "| nvfp4 stochastic (gradients), rows | " in md
    # a GPU's result (figures made up): the NVFP4 rows do not move the MX bars
    gpu_ops = [
        {
            "op": e["op"],
            "format": e["format"],
            "triton_pct_of_copy": 10.0 if e["format"].startswith("nv") else 60.0,
            "triton_kernels": 3 if e["format"].startswith("nv") else 2,
            "triton_extra_vs_output": 2.0 if e["format"].startswith("nv") else 1.0,
        }
        for e in ops["ops"]
    ]
    e2e = {"step_vs_bf16": {"bf16": 1.0, "FA_linear_mxfp8": 1.2, "FA_linear_nvfp4": 1.5}}
    lines = suite.bars({"device": "cuda", "ops": {"ops": gpu_ops}, "e2e": e2e})
    assert not [b for b in lines if b.startswith("MISSED")], lines
    assert (
        "reported (no bar): NVFP4 worst 10.0 % of the copy, at most 3 kernels a call, "
        "extra memory at most 2.00 outputs" in lines
    )
    assert "reported (no bar): FA_linear_nvfp4 step 1.50x bf16" in lines
