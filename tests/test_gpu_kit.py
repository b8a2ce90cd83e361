"""The GPU kit (benchmarks/gpu_kit.py, gpu_run.sh) end to end on CPU: prepared here as for the
device machine (but for this interpreter's Python), then run with a stub ``torchrun`` and the
kernels in Triton's interpreter, so that on a lent GPU nothing but the GPU differs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _kit() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_kit", BENCH / "gpu_kit.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# core_v0.13.1's training_log line and report_memory line (megatron/training/training.py and
# utils.py), as a real run on an H200 printed them
LOG = """\
 [2026-11-27 12:21:40] iteration        1/       6 | consumed samples:            8 | \
elapsed time per iteration (ms): 9120.5 | learning rate: 3.000000E-04 | global batch size: \
    8 | lm loss: 1.217632E+01 | loss scale: 1.0 | grad norm: 14.305 | number of skipped \
iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 21000.5 | max allocated: 37781.2 | \
reserved: 39000.0 | max reserved: 39000.0
 [2026-11-27 12:21:42] iteration        2/       6 | consumed samples:           16 | \
elapsed time per iteration (ms): 2031.0 | learning rate: 3.000000E-04 | global batch size: \
    8 | lm loss: 5.895626E+00 | loss scale: 1.0 | grad norm: 9.1 | number of skipped \
iterations:   0 | number of nan iterations:   0 |
 [2026-11-27 12:21:44] iteration        3/       6 | consumed samples:           24 | \
elapsed time per iteration (ms): 2027.4 | learning rate: 3.000000E-04 | global batch size: \
    8 | lm loss: 5.685305E+00 | loss scale: 1.0 | grad norm: 7.2 | number of skipped \
iterations:   0 | number of nan iterations:   0 |
 [2026-11-27 12:21:46] iteration        4/       6 | consumed samples:           32 | \
elapsed time per iteration (ms): 2020.0 | learning rate: 3.000000E-04 | global batch size: \
    8 | lm loss: 3.471259E+00 | loss scale: 1.0 | grad norm: 5.0 | number of skipped \
iterations:   0 | number of nan iterations:   0 |
"""


def test_megatron_log_gives_step_time_losses_and_peak_memory():
    got = _kit().parse_megatron_log(LOG)
    assert got["iterations"] == 4
    assert got["step_ms"] == pytest.approx((2027.4 + 2020.0) / 2)  # iterations after the 2nd
    assert got["losses"] == [12.17632, 5.895626, 5.685305, 3.471259]
    assert got["losses_finite"] is True
    assert got["peak_mb"] == pytest.approx(37781.2)
    assert got["attention"] is None  # a stock bf16 run: the runtime is never asked
    said = "[quantpatch] attention path: flash (Q.K^T bf16, P.V bf16)\n"
    assert _kit().parse_megatron_log(said + LOG + said)["attention"] == "flash"
    nan = _kit().parse_megatron_log(LOG.replace("3.471259E+00", "nan"))
    assert nan["losses_finite"] is False


def test_a_failed_run_reports_its_traceback_not_torchruns_epilogue():
    kit = _kit()
    text = (
        "building model\n[rank0]: Traceback (most recent call last):\n"
        "[rank0]:   File 'optimizer_param_scheduler.py', line 74\n[rank0]: AssertionError\n"
        + "torchrun noise\n"
        * 400
    )
    assert "AssertionError" in kit.failure(text)
    assert kit.failure("no traceback\n" * 10).endswith("no traceback\n")


def test_each_step_gets_its_cap_or_what_the_later_steps_leave():
    kit = _kit()
    run = kit.Run(Path("kit"), Path("/nonexistent-out-unused"), Path("w"), False, 1.0)
    assert run.budget("setup") == kit.BUDGETS["setup"]
    run.deadline = time.monotonic() + 200  # 200 s left: the suite's floors are kept back
    later = sum(kit.FLOORS[n] for n in kit.SUITE_PARTS)
    assert run.budget("fast") == pytest.approx(200 - later, abs=1)
    assert run.budget("gemm") == pytest.approx(kit.BUDGETS["gemm"], abs=1)
    run.deadline = time.monotonic()  # nothing left: 10 s, never less
    assert run.budget("smoke") == 10.0


def test_bars_are_judged_on_a_gpu_only():
    kit = _kit()
    rows = [
        {"scheme": "bf16", "step_ms": 2027.4, "peak_mb": 37781.0},
        {"scheme": "FA_mxfp8", "step_ms": 984.0, "peak_mb": 26002.0},
        {"scheme": "FA_linear_mxfp8", "step_ms": 2400.0, "peak_mb": 26002.0},
    ]
    kit._ratios(rows)
    bars = kit.fast_bars(rows)
    assert bars[0].startswith("- MISSED: FA_linear_mxfp8") and "(1.18)" in bars[0]
    assert bars[1].startswith("- met: FA_mxfp8 <= 1.05x") and bars[2].startswith("- met:")
    assert all("not judged (stub)" in b for b in kit.fast_bars(rows, judged=False))
    assert kit.fast_bars(rows[:1])[0].startswith("- unmeasured:")


@pytest.mark.slow
def test_kit_prepared_and_run_end_to_end_on_cpu(tmp_path, trees):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    # Megatron-LM as a tree: the megatron-core 0.13.1 wheel's megatron/ and a pretrain_gpt.py
    # (the stub torchrun checks it is named, and never runs it)
    tree = tmp_path / "Megatron-LM"
    shutil.copytree(trees["0.13.1"], tree / "megatron")
    (tree / "pretrain_gpt.py").write_text("raise SystemExit('the stub torchrun stands in')\n")
    (tree / ".gitignore").write_text("__pycache__\n*.so\n")
    kit = tmp_path / "kit"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    prep = subprocess.run(
        [sys.executable, str(BENCH / "gpu_kit.py"), "prepare", "--kit", str(kit),
         "--megatron-lm", str(tree), "--python-version", version],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stdout[-3000:] + prep.stderr[-3000:]
    assert "of the device tool's 64 MiB" in prep.stdout
    assert '"command": "bash benchmarks/gpu_run.sh"' in prep.stdout
    manifest = json.loads((kit / "kit.json").read_text())
    names = {w.split("-")[0].lower().replace("_", "-") for w in manifest["wheels"]}
    assert names == {n.lower() for n in _kit().CARRIED}
    with zipfile.ZipFile(kit / "wheels" / manifest["quantpatch_wheel"]) as whl:
        assert any(n.startswith("quantpatch/templates/") for n in whl.namelist())
    out = tmp_path / "out"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("QUANTPATCH", "PYTHONPATH")},
        "KIT": str(kit),
        "PYTHON": sys.executable,
        "SITE": str(tmp_path / "site"),
        "OUT": str(out),
        "TRITON_INTERPRET": "1",
    }
    res = subprocess.run(
        ["bash", str(BENCH / "gpu_run.sh"), "--stub", "--budget-scale", "8",
         "--work", str(tmp_path / "work")],
        capture_output=True, text=True, env=env, timeout=3000,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    steps = results["steps"]
    assert list(steps) == ["setup", "smoke", "fast", "shapes", "cache", "flash", "gemm"]
    assert all(e["state"] == "ok" for e in steps.values()), steps
    # the wheels ran, not this checkout's sources
    assert steps["setup"]["environment"]["quantpatch_from"].startswith(str(tmp_path / "site"))
    smoke = {(d["model"], d["scheme"]): d for d in steps["smoke"]["runs"]}
    assert set(smoke) == {
        (m, s)
        for m in ("llama32-1b", "deepseek2_lite")
        for s in ("bf16", "FA_linear_mxfp8", "FA_linear_nvfp4", "nvfp4_recipe")
    }
    # each run's step time against its own model's bf16 run, across the separate sweeps
    assert smoke["deepseek2_lite", "FA_linear_mxfp8"]["step_vs_bf16"] == pytest.approx(1.2)
    for d in smoke.values():
        assert d["exit"] == 0 and d["losses"] == 10 and d["losses_finite"] and d["loss_falls"]
        assert d["commit_is_worktree_head"], d
    fast = {r["scheme"]: r for r in steps["fast"]["runs"]}
    assert list(fast) == ["bf16", "FA_mxfp8", "FA_linear_mxfp8"]
    assert all(r["exit"] == 0 and r["iterations"] == 6 for r in fast.values())
    # the stub's step time and report_memory scale with the scheme (1.0, 1.1, 1.2)
    assert fast["FA_linear_mxfp8"]["step_vs_bf16"] == pytest.approx(1.2)
    assert fast["FA_mxfp8"]["peak_vs_bf16"] == pytest.approx(1.1)
    for part in ("shapes", "cache", "flash", "gemm"):
        assert "quantpatch GPU suite" in steps[part]["markdown"]
    summary = (out / "summary.md").read_text()
    assert "not judged (stub)" in summary and "| deepseek2_lite | FA_linear_nvfp4 | 0 |" in summary
    # what the device tool brings back: at most 8 files
    back = {p.name for p in out.iterdir()}
    assert back == {"results.json", "summary.md", "run.log", "report.html"}
