"""A sweep's report says where its runs came from (the sweep, and
each run's scheme values, commit, data, tokenizer, GPUs, Slurm job), and is written without
figures (saying how to get them) where matplotlib is not installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest

from .test_analysis import _log

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_sweep(tmp_path: Path) -> tuple[Path, dict]:
    """A finished two-run Slurm sweep as `sweep run` records it (logs under its runs/)."""
    sweep_dir = tmp_path / "sweep"
    runs = []
    for i, scheme in enumerate(("bf16", "FA_linear_mxfp8")):
        name = f"llama32-1b_wikipedia_{scheme}_fast"
        log = sweep_dir / "runs" / name / "logs" / f"20261122-112539_job{4243 + i}.log"
        _log(log, scheme, 30)
        runs.append(
            {
                "name": name,
                "model": "llama32-1b",
                "dataset": "wikipedia",
                "scheme": scheme,
                "profile": "fast",
                "script": f"llama32-1b/{name}.sh",
                "state": "finished",
                "exit_code": 0,
                "log": str(log),
                "commit": COMMIT,
                "started": None,
                "ended": None,
                "gpus": None,
                "array_task": i,
                "pid": None,
                "slurm_job": "4242",
                "slurm_state": "COMPLETED",
            }
        )
    data = tmp_path / "data"
    record = {
        "version": 1,
        "checkout": str(tmp_path / "Megatron-LM"),
        "launcher": "slurm",
        "selection": {"profile": "fast", "launcher": "slurm", "gpus_per_node": 2},
        "slurm_job": "4242",
        "created": "2026-11-22T11:00:00+00:00",
        "layout": {"gpus_per_node": 2, "nodes": 1},
        "data": {
            "env": {"DATA_ROOT": str(data), "TOKENIZER_MODEL": str(tmp_path / "tok")},
            "checked": [
                {
                    "model": "llama32-1b",
                    "dataset": "wikipedia",
                    "prefix": str(data / "wikipedia" / "llama32-1b_text_document"),
                    "tokenizer": str(tmp_path / "tok"),
                }
            ],
        },
        "runs": runs,
    }
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep.json").write_text(json.dumps(record))
    return sweep_dir, record


def test_the_report_says_where_each_run_came_from(run, tmp_path):
    sweep_dir, record = fake_sweep(tmp_path)
    res = run("sweep", "report", sweep_dir)
    assert res.code == 0, res
    html = (sweep_dir / "report.html").read_text()
    text = html.replace("<wbr>", "")
    for fact in (
        str(sweep_dir.resolve()),
        "2026-11-22T11:00:00+00:00",
        record["checkout"],
        "slurm (job array 4242)",
        "fast, 1 node x 2 GPUs",
        record["data"]["env"]["DATA_ROOT"],
        record["data"]["env"]["TOKENIZER_MODEL"],
    ):
        assert f"<td>{fact}</td>" in text, fact
    rows = text.split("<tr")
    mx = next(r for r in rows if ">llama32-1b_wikipedia_FA_linear_mxfp8_fast<" in r)
    cells = [c.split(">", 1)[1].split("</td", 1)[0] for c in mx.split("<td")[1:]]
    # attention "-": a record from before sweeps kept the attention path; scheme args "-":
    # none (and a record from before they were recorded)
    # the data prefix and tokenizer folder shortened, their full paths on hover
    prefix, tok = (Path(record["data"]["checked"][0][k]) for k in ("prefix", "tokenizer"))
    assert cells == [
        "llama32-1b_wikipedia_FA_linear_mxfp8_fast", "finished", "FA_linear_mxfp8", "mxfp8",
        "mxfp8", "bf16", "-", "-", "-", COMMIT[:12], "…/" + "/".join(prefix.parts[-2:]),
        "…/" + "/".join(tok.parts[-2:]), "1 node x 2 GPUs", "4242_1 COMPLETED",
    ]  # fmt: skip
    assert f'title="{prefix}"' in mx and f'title="{tok}"' in mx
    # the runs table's headings are the CLI's own words, not field names
    assert "<th>Δloss</th>" in html and "loss_delta_vs_bf16" not in html


def test_the_report_without_matplotlib_has_no_figures_and_says_how(run, tmp_path, monkeypatch):
    from quantpatch.analysis import plots

    sweep_dir, _ = fake_sweep(tmp_path)
    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as an install without it
    note = "no figures: matplotlib is not installed (pip install 'matplotlib>=3.7' adds them)"
    res = run("sweep", "report", sweep_dir)
    assert res.code == 0, res
    assert note in res.out
    html = unescape((sweep_dir / "report.html").read_text())
    assert note.capitalize() + "." in html and "<img" not in html
    assert "llama32-1b_wikipedia_FA_linear_mxfp8_fast" in html.replace("<wbr>", "")
    res = run("report", "--runs", sweep_dir / "runs", "--out", tmp_path / "r.html")
    assert res.code == 0 and note in res.out, res
    res = run("runs", sweep_dir / "runs", "--plot", tmp_path / "p")
    assert res.code == 2 and "plots need matplotlib: pip install 'matplotlib>=3.7'." in res.err


@pytest.mark.parametrize("n", [3, 40])
def test_step_time_labels_are_level_and_whole(tmp_path, n):
    """The step-time bars are horizontal: each run's label reads level, none is cut."""
    pytest.importorskip("matplotlib")
    from quantpatch.analysis import training_logs
    from quantpatch.analysis.plots import plot_runs

    for i in range(n):
        scheme = "bf16" if i == 0 else f"FA_linear_mxfp8_{i}"
        _log(tmp_path / "runs" / f"r{i}" / "logs" / "a.log", scheme, 5, ms=100 + i)
    res = training_logs.runs([tmp_path / "runs"])
    captured = {}
    import matplotlib.figure

    original = matplotlib.figure.Figure.savefig

    def savefig(fig, path, *a, **kw):
        if Path(path).name == "step_time.png":
            fig.canvas.draw()
            (ax,) = fig.axes
            box = fig.bbox
            labels = ax.get_yticklabels()
            captured["rotations"] = {t.get_rotation() for t in labels}
            captured["inside"] = all(
                box.x0 <= t.get_window_extent().x0 and t.get_window_extent().y1 <= box.y1
                for t in labels
            )
            captured["texts"] = [t.get_text() for t in labels]
        return original(fig, path, *a, **kw)

    matplotlib.figure.Figure.savefig = savefig
    try:
        plot_runs(res, tmp_path)
    finally:
        matplotlib.figure.Figure.savefig = original
    assert captured["rotations"] == {0.0} and captured["inside"]
    assert len(captured["texts"]) == n - 1 or len(captured["texts"]) == n


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_PROBE = """<script>
const w = document.documentElement.clientWidth;
const cut = [...document.querySelectorAll("h1,h2,p,th,td,img")]
  .filter(e => e.getBoundingClientRect().right > w + 0.5)
  .map(e => e.tagName + ":" + e.textContent.slice(0, 40));
document.title = JSON.stringify({width: w, scroll: document.documentElement.scrollWidth, cut});
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
@pytest.mark.parametrize("width", [1000, 1280])
def test_the_report_fits_the_page_in_a_real_browser(run, tmp_path, width):
    """Headless Chromium lays the sweep's report out at 1,000 and 1,280 px
    and finds no heading, cell or figure past the page's right edge (the runs table's
    `status` and `diverged` columns were cut off); a screenshot is kept beside it."""
    sweep_dir, _ = fake_sweep(tmp_path)
    assert run("sweep", "report", sweep_dir).code == 0
    probe = tmp_path / "probe.html"
    probe.write_text((sweep_dir / "report.html").read_text() + _PROBE)
    base = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--window-size={width},900", f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run(
        [*base, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    title = unescape(dom.stdout.split("<title>", 1)[1].split("</title>", 1)[0])
    seen = json.loads(title)
    assert seen["width"] == width and seen["cut"] == [], seen
    assert seen["scroll"] <= width, seen
    shot = tmp_path / f"report-{width}.png"
    subprocess.run(
        [*base, f"--screenshot={shot}", (sweep_dir / "report.html").as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.stat().st_size > 0
