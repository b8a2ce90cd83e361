"""``benchmarks/performance.py`` rewrites exactly the generated blocks of
``docs/performance.md``, and the document has a block for every benchmark the script runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"
GPU_RESULTS = ROOT / "benchmarks" / "results" / "h100-2026-11-24"


def _performance():
    spec = importlib.util.spec_from_file_location(
        "performance", ROOT / "benchmarks" / "performance.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["performance"] = module
    spec.loader.exec_module(module)
    return module


def test_the_document_has_a_block_for_every_benchmark():
    perf = _performance()
    names = {b.name for b in perf.BENCHES} | {perf.GPU_BLOCK}
    assert set(perf.blocks(DOC.read_text())) == names


def test_saved_outputs_replace_their_blocks_and_nothing_else(tmp_path: Path):
    perf = _performance()
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "sweep.txt").write_text(
        "# a test machine, commit abc, 2026-01-01\nsweep run: 60 runs\n"
    )
    doc = tmp_path / "performance.md"
    before = DOC.read_text()
    doc.write_text(before)
    perf.main(["--from", str(saved), "--gpu-results", str(GPU_RESULTS), "--out", str(doc)])
    after = doc.read_text()
    new, old = perf.blocks(after), perf.blocks(before)
    assert new["sweep"] == (
        "`python benchmarks/sweep_overhead.py --parallel 2` on a test machine, commit abc, "
        "2026-01-01:\n\n```text\nsweep run: 60 runs\n```\n"
    )
    assert "NVIDIA H100" in new["gpu"] and "h100-2026-11-24" in new["gpu"]
    assert {k: v for k, v in new.items() if k not in ("sweep", "gpu")} == {
        k: v for k, v in old.items() if k not in ("sweep", "gpu")
    }
    outside = perf._BLOCK.sub("", after)
    assert outside == perf._BLOCK.sub("", before)


def test_a_block_the_document_lacks_is_refused(tmp_path: Path):
    perf = _performance()
    doc = tmp_path / "performance.md"
    doc.write_text("# figures\n<!-- BEGIN cli -->\nold\n<!-- END cli -->\n")
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "sweep.txt").write_text("# m\nout\n")
    with pytest.raises(SystemExit, match="no block for sweep"):
        perf.main(["--from", str(saved), "--out", str(doc)])
    assert doc.read_text() == "# figures\n<!-- BEGIN cli -->\nold\n<!-- END cli -->\n"
