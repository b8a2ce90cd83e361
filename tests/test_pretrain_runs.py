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
