"""Every Triton launch of the runtime compiled for every supported GPU generation on this CPU
(``benchmarks/kernel_resources.py``: a stand-in for Triton's CUDA driver hands each launch to
``triton.compile`` for sm_80 ... sm_120, whose ``ptxas`` reports registers and spills), the
resources table of ``docs/performance.md`` kept equal to the script's output, and the
runtime's refusal of an older GPU before any kernel is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from quantpatch.runtime import quantpatch_ops as ops  # noqa: E402
from quantpatch.runtime import quantpatch_quantize as qz  # noqa: E402
from quantpatch.runtime import quantpatch_rht as rht  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernel_resources.py"
DOC = ROOT / "docs" / "performance.md"
GENERATIONS = [80, 86, 89, 90, 100, 120]


def _harness(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """The script in its own process: it compiles (the test process interprets)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_representative_launch_compiles_for_every_generation(tmp_path: Path):
    """``fake_quant`` of a bf16 activation in fp8-tensor, through the runtime's own dispatch:
    its launch (alignment, constexprs, warps) compiled to a cubin for each generation, with
    registers from ptxas, no spill and no shared memory beyond the generation's."""
    report, printed = _harness(tmp_path, "--fast", "--jobs", "1")
    assert report["generations"] == GENERATIONS and report["kernels"] == ["_fp8_tensor_kernel"]
    assert report["launches"] == len(GENERATIONS) == report["compiled"]
    rows = sorted(report["rows"], key=lambda r: r["cc"])
    assert [r["cc"] for r in rows] == GENERATIONS
    for r in rows:
        assert "error" not in r, r
        assert 0 < r["regs"] < 255 and r["spill_stores"] == r["spill_loads"] == 0
        assert r["cubin_bytes"] > 1000
        assert r["constants"]["(7,)"] == 2048  # BLOCK_SIZE, as the runtime launched it
    assert "PROBLEM" not in printed and "_fp8_tensor_kernel` | 120 |" in printed


def test_problems_are_a_compiler_error_a_spill_or_too_much_shared_memory():
    kr = _kr()
    ok = {"kernel": "k", "constants": {}, "options": {"num_warps": 4}, "cc": 86, "regs": 40,
          "spill_stores": 0, "spill_loads": 0, "shared": 1024}  # fmt: skip
    assert kr.problems({"rows": [ok]}) == []
    bad = [
        {**ok, "spill_stores": 8},
        {**ok, "shared": 101377},  # above sm_86's 99 KiB per block
        {"kernel": "k", "constants": {}, "options": {}, "cc": 80, "error": "PTXASError: x"},
    ]
    assert len(kr.problems({"rows": bad})) == 3
    assert kr.problems({"rows": [{**ok, "cc": 90, "shared": 101377}]}) == []
    gen = {g.cc: g for g in kr.GENERATIONS}
    assert kr.occupancy(gen[90], 40, 0, 4) == 48  # 12 blocks of 4 warps: registers decide
    assert kr.occupancy(gen[86], 255, 0, 8) == 8  # one block: 255 registers leave no room
    assert kr.occupancy(gen[90], 32, 200_000, 4) == 4  # one block: shared memory decides


def test_an_older_gpu_is_refused_in_one_sentence_before_any_kernel(monkeypatch):
    """A CUDA tensor on a GPU older than sm_80 (a V100, a T4) is refused where the runtime
    first chooses a kernel, in one sentence; following its advice (the PyTorch reference and
    the stock attention) is accepted; sm_80 and later pass."""
    cuda_tensor = types.SimpleNamespace(
        dtype=torch.bfloat16, is_cuda=True, device=torch.device("cuda", 0)
    )
    monkeypatch.setattr(qz, "_CAPABILITY_OK", set())
    monkeypatch.setenv("QUANTPATCH_KERNELS", "auto")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    sentence = r"compute capability 8\.0 \(A100\) or later, and this one \(cuda:0\) is 7\.5"
    with pytest.raises(RuntimeError, match=sentence) as refused:
        qz._use_kernels(cuda_tensor)
    message = str(refused.value)
    assert message.count(". ") == 0 and message.endswith("keep the stock attention.")
    with pytest.raises(RuntimeError, match=sentence):
        rht._use_kernels(cuda_tensor)
    with pytest.raises(RuntimeError, match=sentence):
        ops.flash_refusal(None, cuda_tensor, cuda_tensor, cuda_tensor, None, qk="mxfp8", pv="bf16")
    # the advice: QUANTPATCH_KERNELS=reference and QUANTPATCH_FLASH=0
    monkeypatch.setenv("QUANTPATCH_KERNELS", "reference")
    monkeypatch.setenv("QUANTPATCH_FLASH", "0")
    assert qz._use_kernels(cuda_tensor) is False and rht._use_kernels(cuda_tensor) is False
    refusal = ops.flash_refusal(
        None, cuda_tensor, cuda_tensor, cuda_tensor, None, qk="mxfp8", pv="bf16"
    )
    assert refusal == "QUANTPATCH_FLASH=0"
    monkeypatch.setenv("QUANTPATCH_KERNELS", "auto")
    for capability in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
        monkeypatch.setattr(qz, "_CAPABILITY_OK", set())
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        qz.require_capability(torch.device("cuda", 0))  # accepted


def _kr():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import kernel_resources as kr
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return kr


@pytest.mark.slow
def test_every_kernel_and_configuration_compiles_for_every_generation(tmp_path: Path):
    """CI's compile: the runtime driven over every value, the three dtypes and the registered
    models' widths and head dims, each generation pruning its own autotune configurations;
    every kernel's every launch configuration (tiles, warps, stages) compiled for every
    generation, one representative specialization each (the first bf16 launch), two
    generations at a time. None fails to compile, spills, or asks for more shared memory than
    its generation has, and the table in docs/performance.md is this run's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), "--jobs", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    kr = _kr()
    assert report["generations"] == GENERATIONS and len(report["kernels"]) == 14
    per_generation = {cc: sum(r["cc"] == cc for r in report["rows"]) for cc in GENERATIONS}
    assert min(per_generation.values()) >= 40, per_generation  # every configuration
    assert not any("error" in r for r in report["rows"])  # every launch compiles
    assert proc.returncode == 0 and "PROBLEM" not in proc.stdout, kr.problems(report)
    block = DOC.read_text().split(kr.BEGIN, 1)[1].split(kr.END, 1)[0]
    assert block == "\n" + kr.table(report)  # the document is this run's


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("QUANTPATCH_COMPILE_ALL") != "1",
    reason="every constexpr set of every kernel for every generation (about 3,000 "
    "compilations): QUANTPATCH_COMPILE_ALL=1 runs it on a machine with many cores",
)
def test_every_constexpr_set_compiles_for_every_generation(tmp_path: Path):
    """Each kernel, launch configuration, constexpr set (operand kinds, elements, dtypes) and
    argument types once (the most aligned), for every generation: none fails or spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), "--compile", "representatives",
         "--jobs", str(os.cpu_count() or 1)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=7200,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["generations"] == GENERATIONS and len(report["kernels"]) == 14
    assert proc.returncode == 0 and "PROBLEM" not in proc.stdout, _kr().problems(report)
