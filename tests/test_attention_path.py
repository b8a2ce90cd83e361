"""Which attention path each run took, read from its log (the runtime's
``[quantpatch] attention path:`` lines, else the script's ``[quantpatch] attention:`` header
line), shown per run by ``quantpatch runs`` and in the report's runs table; and the sweep's
choice resolved over its schemes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantpatch.analysis import training_logs
from quantpatch.analysis.report import RUN_COLUMNS
from quantpatch.base.errors import UserError
from quantpatch.launch.attention import attention_for
from quantpatch.launch.registry import load_registry
from quantpatch.runtime.quantpatch_ops import ATTENTION_PATH_LINE

from .test_analysis import LINE

HEADER = "[quantpatch] llama32-1b / wikipedia / {scheme} (smoke): linear=bf16 qk={qk} pv=bf16"


def _log(path: Path, scheme: str, qk: str, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    out = [HEADER.format(scheme=scheme, qk=qk), *lines[:1], "building the model ..."]
    out += lines[1:]
    for it in (10, 20, 30):
        out.append(LINE.format(it=it, total=30, cs=it * 8, ms=100.0, loss="2.5E+00", sk=0, nan=0))
    out.append("[quantpatch] training exited with status 0")
    path.write_text("\n".join(out) + "\n")


ASKED_FLASH = "[quantpatch] attention: QUANTPATCH_FLASH=auto QUANTPATCH_FLASH_BF16=1 (auto: x)"
ASKED_STOCK = (
    "[quantpatch] attention: QUANTPATCH_FLASH=0 QUANTPATCH_FLASH_BF16=0 (--attention stock)"
)
ASKED_AUTO_FA = "[quantpatch] attention: QUANTPATCH_FLASH=auto QUANTPATCH_FLASH_BF16=0 (auto: y)"
TOOK_FLASH = f"{ATTENTION_PATH_LINE}flash (Q.K^T bf16, P.V bf16)"
TOOK_STOCK = f"{ATTENTION_PATH_LINE}stock (attention dropout 0.1 (the kernel has none))"


@pytest.mark.parametrize(
    ("qk", "lines", "want"),
    [
        ("bf16", [ASKED_FLASH, TOOK_FLASH], "flash"),  # the baseline on the flash kernel
        ("mxfp8", [ASKED_FLASH, TOOK_STOCK], "stock"),  # asked, refused: the log says so
        ("mxfp8", [ASKED_FLASH, TOOK_FLASH, TOOK_STOCK, TOOK_FLASH], "flash+stock"),
        ("bf16", [ASKED_STOCK], "stock (asked)"),  # stock bf16 never calls the runtime
        ("mxfp8", [ASKED_AUTO_FA], "flash (asked)"),  # an older checkout says nothing
        ("bf16", [ASKED_AUTO_FA], "stock (asked)"),
        ("mxfp8", [ASKED_STOCK], "stock (asked)"),
        ("mxfp8", [], None),  # a script from before the attention path was logged
    ],
)
def test_a_runs_attention_path_comes_from_its_log(tmp_path, qk, lines, want):
    path = tmp_path / "r" / "logs" / "a.log"
    _log(path, "FA_mxfp8" if qk != "bf16" else "bf16", qk, lines)
    assert training_logs.parse_log(path).attention == want
    assert training_logs.parse_log(path, chunk=200).attention == want  # lines in many pieces


def test_runs_and_the_report_show_the_path_per_run(run, tmp_path):
    root = tmp_path / "runs"
    _log(root / "llama32-1b_wikipedia_bf16_smoke/logs/a.log", "bf16", "bf16", [ASKED_STOCK])
    _log(
        root / "llama32-1b_wikipedia_FA_mxfp8_smoke/logs/a.log",
        "FA_mxfp8",
        "mxfp8",
        [ASKED_FLASH, TOOK_FLASH],
    )
    res = run("runs", root, "--json")
    assert res.code == 0, res
    rows = {r["scheme"]: r["attention"] for r in json.loads(res.out)["runs"]}
    assert rows == {"bf16": "stock (asked)", "FA_mxfp8": "flash"}
    assert "attention" in RUN_COLUMNS
    out = tmp_path / "report.html"
    res = run("report", "--runs", root, "--out", out)
    assert res.code == 0, res
    html = out.read_text()
    assert '<td class="t">stock (asked)</td>' in html and '<td class="t">flash</td>' in html


def test_auto_takes_the_path_of_the_fa_schemes():
    schemes = load_registry().schemes
    both = [schemes["bf16"], schemes["FA_mxfp8"], schemes["linear_mxfp4"]]
    auto = attention_for("auto", both)
    assert (auto.path, auto.flash, auto.flash_bf16) == ("flash", "auto", "1")
    assert auto.why == "auto: Q.K^T quantized by FA_mxfp8"
    plain = attention_for("auto", [schemes["bf16"], schemes["linear_mxfp4"]])
    assert (plain.path, plain.flash, plain.flash_bf16) == ("stock", "0", "0")
    assert attention_for("stock", both).as_dict() == {
        "choice": "stock",
        "path": "stock",
        "why": "--attention stock",
    }
    assert attention_for("flash", [schemes["bf16"]]).flash_bf16 == "1"
    with pytest.raises(UserError, match="--attention: unknown choice 'fast'"):
        attention_for("fast", both)
