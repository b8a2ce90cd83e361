"""``tensors``, ``runs`` and ``report`` on real inputs: tensors our saver wrote inside a tiny
megatron-core training run, files in the fork's dict layout and naming, and training logs in
the exact format of Megatron's ``training_log``; format metrics against independent oracles."""

from __future__ import annotations

import json
import math
import os
import pickle
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("ml_dtypes")

from quantpatch.analysis import tensors, training_logs  # noqa: E402
from quantpatch.analysis.tensor_metrics import format_sums, tensor_sums  # noqa: E402
from tests.test_quant_ops import hif8_oracle, mx_oracle  # noqa: E402
from tests.test_saver import _probe, saver_checkout  # noqa: E402, F401

# -- format metrics against independent oracles -------------------------------------------------


def _oracle_metrics(x: np.ndarray, fmt: str, backward: bool) -> dict[str, float]:
    """Underflows, overflows, SQNR from ml_dtypes / the HiF8 table, rows of 32-blocks."""
    if fmt == "hifp8":
        q = hif8_oracle(x)
        over = np.abs(x) > 32768
    else:
        q = mx_oracle(x, fmt, backward)
        vmax, emax = {("mxfp8", False): (448, 8), ("mxfp8", True): (57344, 15)}.get(
            (fmt, backward), (6, 2)
        )
        blocks = x.reshape(-1, 32)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        shared = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - emax, -127)
        over = (np.abs(blocks) > vmax * 2.0 ** np.clip(shared, -127, 127)).reshape(x.shape)
    nz = x != 0
    return {
        "underflows": int((nz & (q == 0)).sum()),
        "overflows": int(over.sum()),
        "sqnr": 10 * math.log10((x**2).sum() / ((x - q) ** 2).sum()),
    }


@pytest.mark.parametrize(
    ("fmt", "backward"), [("mxfp8", False), ("mxfp8", True), ("mxfp4", False), ("hifp8", False)]
)
def test_format_metrics_match_the_oracles(fmt, backward):
    gen = np.random.default_rng(4)
    x = gen.standard_normal((16, 64)) * 2.0 ** gen.integers(-12, 12, size=(16, 1))
    x[0, :32] = 0
    x[1, 5] = 2.0**-30  # far below every MX block's reach: an underflow
    x[2, 0], x[2, 1] = 480.0, 1.0  # E4M3: scale 1, 480 > 448 is clamped
    x[3, 7] = 50000.0  # HiF8: above 2^15
    x = x.astype(np.float32).astype(np.float64)
    got = format_sums(torch.tensor(x, dtype=torch.float32), fmt, -1, backward)
    want = _oracle_metrics(x, fmt, backward)
    assert got.underflows == want["underflows"] and got.overflows == want["overflows"]
    assert got.summary()["sqnr_db"] == pytest.approx(want["sqnr"], rel=1e-6)
    assert got.underflows > 0 and got.overflows > 0
    assert got.nonzero == int((x != 0).sum()) and got.finite == x.size


def test_known_counts_on_one_block():
    x = torch.zeros(32)
    x[0], x[1], x[2] = 480.0, 2.0**-11, 1.0  # scale 2^0: 480 clamps to 448, 2^-11 flushes
    s = format_sums(x, "mxfp8").summary()
    assert s["overflows %"] == pytest.approx(100 / 32)
    assert s["underflows %"] == pytest.approx(100 / 3)
    assert s["blocks saturated %"] == 100.0 and s["blocks scale clipped %"] == 0.0
    tiny = torch.full((32,), 2.0**-140)  # amax 2^-140: the E8M0 scale clips at 2^-127
    assert format_sums(tiny, "mxfp8").summary()["blocks scale clipped %"] == 100.0
    st = tensor_sums(torch.tensor([0.0, 2.0**-4, -4.0, float("nan")])).summary()
    assert st["dynamic_range"] == 6.0 and st["absmax"] == 4.0
    assert st["zeros %"] == 25.0 and st["nan/inf %"] == 25.0


# -- tensors on what our saver wrote inside training --------------------------------------------


@pytest.fixture
def saved(saver_checkout, tmp_path, run):  # noqa: F811 - the fixture imported above
    root = saver_checkout
    assert (
        run("set", "--repo", root, "--linear", "mxfp8", "--qk", "hifp8", "--pv", "mxfp4").code == 0
    )
    logs = tmp_path / "logs"
    _probe(root, tmp_path / "q.pt", 2, TENSOR_SAVE_ENABLED="1", TENSOR_SAVE_DIR=str(logs))
    stats = tmp_path / "stats"
    _probe(
        root,
        tmp_path / "s.pt",
        1,
        TENSOR_SAVE_ENABLED="1",
        TENSOR_SAVE_DIR=str(stats),
        TENSOR_SAVE_STATS_ONLY="true",
    )
    return logs, stats


def test_tensors_on_the_savers_output(saved, run, tmp_path):
    logs, stats = saved
    res = run("tensors", "summary", logs, "--by", "format,tensor", "--json")
    assert res.code == 0, res
    data = json.loads(res.out)
    inv = data["inventory"]
    assert inv["files"] == 2 * 44 and inv["skipped"] == [] and inv["micro_steps"] == [0, 1]
    assert inv["formats"] == ["hifp8", "mxfp4", "mxfp8"] and 1 in inv["layers"]
    groups = {(g["format"], g["tensor"]): g for g in data["groups"]}
    assert set(groups) >= {("mxfp8", "weight"), ("hifp8", "query"), ("mxfp4", "value")}
    w = groups[("mxfp8", "weight")]
    assert w["absmax"] > 0 and w["std"] > 0 and w["nan/inf %"] == 0
    # statistics equal a direct computation over the same files
    direct = [torch.load(p)["tensor"] for p in logs.glob("*.pt")]
    direct = [t for t in direct if t is not None]
    assert sum(g["numel"] for g in data["groups"]) == sum(t.numel() for t in direct)
    # formats: every group and candidate, finite numbers, worst first
    res = run("tensors", "formats", logs, "--json", "--sample", "4096")
    assert res.code == 0, res
    rows = json.loads(res.out)["rows"]
    assert {r["candidate"] for r in rows} == {"mxfp8", "mxfp4", "hifp8"}
    sq = [r["sqnr_db"] for r in rows]
    assert sq == sorted(sq) and all(isinstance(v, float) for v in sq)
    assert all(0 <= r["cosine"] <= 1.0000001 for r in rows)
    by_fmt = {f: min(r["sqnr_db"] for r in rows if r["candidate"] == f) for f in ("mxfp8", "mxfp4")}
    assert by_fmt["mxfp4"] < by_fmt["mxfp8"]  # 4 bits lose more than 8
    # CSV and the table
    res = run("tensors", "formats", logs, "--csv", "--formats", "mxfp8", "--by", "tensor")
    assert res.code == 0 and res.out.splitlines()[0].startswith("tensor,candidate,underflows %")
    # stats-only records: summary reads them, formats says why it cannot use them
    res = run("tensors", "summary", stats, "--json")
    assert json.loads(res.out)["inventory"]["stats_records"] == 44
    res = run("tensors", "formats", stats, "--json")
    assert "44 stats-only records" in json.dumps(json.loads(res.out)["inventory"]["skipped"])


@pytest.mark.slow  # every figure drawn with matplotlib: about a minute on 2 cores
def test_plot_and_report_write_only_under_out(saved, run, tmp_path):
    pytest.importorskip("matplotlib")
    logs, _ = saved
    before = sorted(p for p in tmp_path.rglob("*"))
    res = run("tensors", "plot", logs, "--out", tmp_path / "figs", "--sample", "2048")
    assert res.code == 0, res
    pngs = sorted(p.name for p in (tmp_path / "figs").glob("*.png"))
    assert {"sqnr_heatmap.png", "underflow_overflow.png", "hist_weight.png"} <= set(pngs)
    assert all((tmp_path / "figs" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    runs_dir = tmp_path / "runs"
    _write_sweep(runs_dir)
    res = run("report", "--tensors", logs, "--runs", runs_dir, "--out", tmp_path / "r.html")
    assert res.code == 0, res
    html = (tmp_path / "r.html").read_text()
    assert "<script" not in html and "http" not in html.replace("http-equiv", "")
    assert html.count("data:image/png;base64,") >= 5 and "FA_mxfp8" in html
    after = sorted(p for p in tmp_path.rglob("*"))
    new = {p for p in after if p not in before}
    assert all(
        p.is_relative_to(tmp_path / "figs") or p.is_relative_to(runs_dir) or p.name == "r.html"
        for p in new
    )


# -- the fork's layout and bad inputs -----------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_fork_layout_and_bad_files(run, tmp_path):
    d = tmp_path / "tensor_logs"
    (d / "hifp8").mkdir(parents=True)
    (d / "mxfp8").mkdir()
    gen = torch.Generator().manual_seed(0)
    for fmt in ("hifp8", "mxfp8"):
        for i, name in enumerate(("query", "key", "value")):
            t = torch.randn(8, 2, 2, 32, generator=gen).to(torch.bfloat16)
            fname = f"20250908_091143_{i:04d}_attention_L{i % 2}_forward_{fmt}_{name}.pt"
            # the fork's dict layout, metadata without the names our saver adds
            torch.save({"tensor": t, "tensor_info": {"shape": list(t.shape)}, "metadata": {}},
                       d / fmt / fname)  # fmt: skip
    torch.save({"tensor": torch.randn(4, 32), "metadata": {}}, d / "mxfp8" / "unnamed.pt")
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(d / "evil.pt", "wb") as fh:
        pickle.dump({"tensor": Evil()}, fh)
    torch.save({"tensor": Evil()}, d / "evil_zip.pt")
    good = next((d / "hifp8").glob("*query.pt")).read_bytes()
    (d / "truncated.pt").write_bytes(good[: len(good) // 2])
    torch.save({"not": "a tensor"}, d / "dict.pt")
    torch.save([1, 2, 3], d / "list.pt")
    (d / "stats_rank0.jsonl").write_text('{"name": "x"}\nnot json\n')
    res = run("tensors", "summary", d, "--by", "layer,format,tensor", "--json")
    assert res.code == 0, res
    inv = json.loads(res.out)["inventory"]
    assert not marker.exists()
    assert inv["files"] == 7 and inv["formats"] == ["hifp8", "mxfp8"] and inv["layers"] == [0, 1]
    reasons = {s["path"]: s["reason"] for s in inv["skipped"]}
    assert reasons["evil.pt"].startswith("refused") and reasons["evil_zip.pt"].startswith("refused")
    assert "unreadable" in reasons["truncated.pt"] and "not a saved tensor" in reasons["dict.pt"]
    assert "not a saved tensor" in reasons["list.pt"]
    assert {"stats_rank0.jsonl:1", "stats_rank0.jsonl:2"} <= set(reasons)
    groups = json.loads(res.out)["groups"]
    assert {(g["layer"], g["format"], g["tensor"]) for g in groups} >= {
        (0, "hifp8", "query"),
        (1, "mxfp8", "key"),
    }
    res = run("tensors", "formats", d)
    assert res.code == 0 and "skipped 7" in res.err and "evil.pt: refused" in res.err
    assert not marker.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    res = run("tensors", "summary", empty)
    assert res.code == 0 and "read 0 tensor files" in res.err
    res = run("tensors", "summary", tmp_path / "missing")
    assert res.code == 2 and "no such directory" in res.err
    res = run("tensors", "formats", d, "--formats", "mxfp9")
    assert res.code == 2 and "unknown format mxfp9" in res.err
    res = run("tensors", "summary", d, "--by", "colour")
    assert res.code == 2 and "unknown grouping colour" in res.err


def test_jobs_give_the_same_numbers(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    gen = torch.Generator().manual_seed(1)
    for i in range(6):
        t = torch.randn(64, 96, generator=gen) * (i + 1)
        torch.save({"tensor": t, "metadata": {"tensor_name": "input", "layer_idx": i % 3}},
                   d / f"{i}.pt")  # fmt: skip
    one = tensors.formats(d, by=("layer",), jobs=1).rows
    two = tensors.formats(d, by=("layer",), jobs=2).rows
    assert one == two


# -- training logs ------------------------------------------------------------------------------

# Megatron core_v0.13.1 training_log, one line (fields by name; values filled per line)
LINE = (
    " [2026-11-22 11:25:39] iteration {it:8d}/{total:8d} | consumed samples: {cs:12d} | "
    "elapsed time per iteration (ms): {ms:.1f} | learning rate: 6.666667E-05 | "
    "global batch size:     8 | lm loss: {loss} | loss scale: 1.0 | grad norm: 2.105 | "
    "number of skipped iterations: {sk:3d} | number of nan iterations: {nan:3d} |"
)
# another release: throughput added, grad norm dropped, fields in another order
LINE_OTHER = (
    " [2026-11-22 11:25:39] iteration {it:8d}/{total:8d} | consumed samples: {cs:12d} | "
    "lm loss: {loss} | elapsed time per iteration (ms): {ms:.1f} | "
    "throughput per GPU (TFLOP/s/GPU): 123.4 | learning rate: 6.666667E-05 | "
    "global batch size:     8 | loss scale: 1.0 | "
    "number of skipped iterations: {sk:3d} | number of nan iterations: {nan:3d} |"
)


def _loss(scheme: str, it: int) -> float:
    return 10 * it**-0.25 * {"bf16": 1.0, "FA_mxfp8": 1.01, "linear_mxfp4": 1.05}.get(scheme, 1)


def _log(path: Path, scheme: str, n: int, *, line: str = LINE, end: str = "ok", ms: float = 100):
    path.parent.mkdir(parents=True, exist_ok=True)
    out = [
        "using world size: 1",
        f"[quantpatch] llama32-1b / wikipedia / {scheme} (smoke): linear=bf16 qk=bf16 pv=bf16",
        "[quantpatch] source commit abc in /w",
    ]
    for it in range(10, 10 * n + 1, 10):
        loss = f"{_loss(scheme, it):.6E}"
        if end == "nan" and it > 10 * n // 2:
            loss = "nan"
        out.append(
            line.format(
                it=it, total=10 * n, cs=it * 8, ms=ms, loss=loss, sk=0, nan=int(loss == "nan")
            )
        )
    if end == "ok":
        out.append("[quantpatch] training exited with status 0")
    elif end == "crash":
        out += ["Traceback (most recent call last):", "RuntimeError: CUDA error: out of memory"]
    elif end == "cut":
        out.append(
            line.format(it=10 * n + 10, total=10 * n, cs=0, ms=ms, loss="1.0", sk=0, nan=0)[:90]
        )
    path.write_text("\n".join(out) + ("\n" if end != "cut" else ""))


def _write_sweep(root: Path) -> None:
    base = root / "llama32-1b_wikipedia_{}_smoke" / "logs" / "20261122-112539_{}.log"
    _log(Path(str(base).format("bf16", "bf16")), "bf16", 30)
    _log(Path(str(base).format("FA_mxfp8", "FA_mxfp8")), "FA_mxfp8", 30, ms=110)
    _log(Path(str(base).format("linear_mxfp4", "x")), "linear_mxfp4", 30, line=LINE_OTHER, ms=150)
    _log(Path(str(base).format("FA_hifp8", "x")), "FA_hifp8", 30, end="nan")
    _log(Path(str(base).format("FA_linear_mxfp8", "x")), "FA_linear_mxfp8", 20, end="crash")
    _log(Path(str(base).format("FA_linear_hifp8", "x")), "FA_linear_hifp8", 25, end="cut")


def test_runs_against_bf16(run, tmp_path):
    root = tmp_path / "runs"
    _write_sweep(root)
    # two ranks printing the same lines, interleaved, and garbage in between
    inter = root / "llama32-1b_wikipedia_linear_hifp8_smoke" / "logs" / "a.log"
    _log(inter, "linear_hifp8", 10)
    lines = inter.read_text().splitlines()
    mixed = lines[:3] + [x for ln in lines[3:-1] for x in (ln, ln, "garbage | lm loss: 3")]
    inter.write_text("\n".join([*mixed, lines[-1]]) + "\n")
    res = run("runs", root, "--json")
    assert res.code == 0, res
    rows = {r["scheme"]: r for r in json.loads(res.out)["runs"]}
    assert set(rows) == {
        "bf16", "FA_mxfp8", "linear_mxfp4", "FA_hifp8", "FA_linear_mxfp8", "FA_linear_hifp8",
        "linear_hifp8",
    }  # fmt: skip
    b, fa = rows["bf16"], rows["FA_mxfp8"]
    assert b["iterations"] == 300 and b["status"] == "finished" and b["loss_delta_vs_bf16"] == 0
    # matched iterations: the last window (3 of 30 points) of both, exactly
    last = [280, 290, 300]
    want = sum(_loss("FA_mxfp8", i) for i in last) / 3 - sum(_loss("bf16", i) for i in last) / 3
    assert fa["loss_delta_vs_bf16"] == pytest.approx(want, rel=1e-5)
    assert fa["rel_delta_vs_bf16"] == pytest.approx(0.01, rel=1e-4)
    assert fa["step_vs_bf16"] == pytest.approx(1.1) and not fa["diverged"]
    other = rows["linear_mxfp4"]  # another release's fields, by name
    assert other["step_vs_bf16"] == pytest.approx(1.5)
    assert other["rel_delta_vs_bf16"] == pytest.approx(0.05, rel=1e-4)
    assert rows["FA_hifp8"]["diverged"] and rows["FA_hifp8"]["nan_iterations"] == 15
    assert rows["FA_linear_mxfp8"]["status"] == "crashed"
    cut = rows["FA_linear_hifp8"]
    assert cut["status"].startswith("no exit line") and cut["iterations"] == 250
    assert cut["unreadable_lines"] == 1
    inter_row = rows["linear_hifp8"]
    assert inter_row["iterations"] == 100 and inter_row["matched_iterations"] == 1
    # the table and the plots
    res = run("runs", root)
    assert res.code == 0 and "FA_mxfp8" in res.out and "read 7 logs" in res.err
    if _has_matplotlib():
        res = run("runs", root, "--plot", tmp_path / "p")
        assert res.code == 0, res
        assert (tmp_path / "p" / "step_time.png").is_file()
        assert (tmp_path / "p" / "loss_llama32-1b_wikipedia_smoke.png").is_file()
    assert run("runs", tmp_path / "nothing").code == 2


def test_runs_keyed_from_the_path_without_a_header(tmp_path):
    p = tmp_path / "llama32-1b_wikipedia_FA_linear_mxfp8_fast" / "logs" / "x.log"
    p.parent.mkdir(parents=True)
    p.write_text(LINE.format(it=10, total=10, cs=8, ms=1.0, loss="2.0", sk=0, nan=0) + "\n")
    res = training_logs.runs([tmp_path], names=(["llama32-1b"], ["wikipedia"]))
    (row,) = res.rows
    assert (row["model"], row["dataset"], row["scheme"], row["profile"]) == (
        "llama32-1b", "wikipedia", "FA_linear_mxfp8", "fast",
    )  # fmt: skip
    assert row["loss"] == 2.0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_logs_without_timestamps_and_with_other_field_sets(tmp_path, monkeypatch):
    """Older releases print iteration lines without the '[date]' prefix, and a resumed run
    may print another release's fields: the general numpy path reads such a log by name,
    and so does the pattern path (numpy missing): the field names of the first line become
    one pattern, other field sets are read line by line."""
    p = tmp_path / "old.log"
    lines = [
        LINE.format(it=i, total=40, cs=8 * i, ms=50.0, loss=f"{4 - i / 100:.6E}", sk=0, nan=0)
        for i in range(10, 41, 10)
    ]
    lines = [ln.replace(" [2026-11-22 11:25:39]", "") for ln in lines]
    lines.insert(2, LINE_OTHER.format(it=25, total=40, cs=0, ms=60.0, loss="nan", sk=1, nan=1))
    lines.append(lines[-1])  # printed twice
    lines.append(lines[0].replace("      10/", "      50/")[:60])  # cut short
    p.write_text("\n".join(lines) + "\n")
    for numpy_ok in (True, False):
        if not numpy_ok:
            monkeypatch.setattr(training_logs, "_numpy_columns", lambda data, run: False)
        run = training_logs.parse_log(p)
        assert list(run.iterations) == [10, 20, 25, 30, 40]
        assert run.series["loss"][0] == pytest.approx(3.9) and math.isnan(run.series["loss"][2])
        assert run.series["step_ms"][2] == 60.0 and run.nonfinite_loss == 1
        assert run.garbage == 1 and training_logs.diverged(run)


def _three_ways(path, monkeypatch):
    """The log parsed by the template path, the general numpy path and the pattern path."""
    out = {}
    with monkeypatch.context() as m:
        out["template"] = training_logs.parse_log(path)
        m.setattr(training_logs, "_template_columns", lambda data, run: False)
        out["numpy"] = training_logs.parse_log(path)
        m.setattr(training_logs, "_numpy_columns", lambda data, run: False)
        out["pattern"] = training_logs.parse_log(path)
    return out


def _same(a, b):
    assert list(a.iterations) == list(b.iterations)
    assert (a.total_iterations, a.garbage, a.duplicates, a.nonfinite_loss) == (
        b.total_iterations, b.garbage, b.duplicates, b.nonfinite_loss,
    )  # fmt: skip
    for name in ("loss", "step_ms", "skipped", "nan", "grad_norm", "loss_scale"):
        x, y = list(a.column(name)), list(b.column(name))
        assert [_bits(u) for u in x] == [_bits(v) for v in y], name


# what a real log holds between its iteration lines (core_v0.13.1's training.py and
# checkpointing.py), with '/', digits and '|' where a careless reader would take them
CHECKPOINT = (
    "saving checkpoint at iteration {it:7d} to /ckpt/run 1/2 in torch_dist format\n"
    "  successfully saved checkpoint from iteration {it:7d} to /ckpt [ t 1/1, p 1/1 ]"
)
VALIDATION = (
    "-" * 99 + "\n validation loss at iteration {it} on validation set | lm loss value: "
    "3.162278E+00 | lm loss PPL: 2.362298E+01 | \n" + "-" * 99
)


def _real_log(n: int, *, every: int = 50, grad: bool = True) -> list[str]:
    lines = ["[quantpatch] m / d / bf16 (full): linear=bf16 qk=bf16 pv=bf16"]
    for i in range(1, n + 1):
        loss = "nan" if i == 17 else f"{3 + 7 / i:.6E}"
        line = LINE.format(it=i, total=n, cs=8 * i, ms=90 + i % 13 / 10 + (i % 7) * 11.1,
                           loss=loss, sk=int(i % 50 == 0), nan=int(i == 17))  # fmt: skip
        if grad:
            line = line.replace("grad norm: 2.105", f"grad norm: {1 + 20 / i:.3f}")
        lines.append(line)
        if i % every == 0:
            lines += [CHECKPOINT.format(it=i), VALIDATION.format(it=i)]
    return lines


def test_the_template_path_equals_the_general_paths(tmp_path, monkeypatch):
    """The fast path (one field set, bars found once, values converted by column) gives
    exactly what the by-name paths give on a log shaped like a real one (checkpoint and
    validation lines in between, step times and grad norms of several widths): values,
    NaN losses, skips, duplicates, and a last line still being written; a line of another
    field set sends the file down the general path, whose result it then is."""
    lines = _real_log(300)
    lines.insert(40, lines[39])  # a line printed twice (two ranks)
    p = tmp_path / "run.log"
    cut = LINE.format(it=301, total=300, cs=0, ms=1.0, loss="1.0", sk=0, nan=0)[:70]
    p.write_text("\n".join(lines) + "\n" + cut)  # the last line is still being written
    ways = _three_ways(p, monkeypatch)
    t = ways["template"]
    assert len(t.iterations) == 300 and t.garbage == 1 and t.duplicates == 1
    assert t.nonfinite_loss == 1 and sum(t.column("skipped")) == 6 and sum(t.column("nan")) == 1
    assert t.constant == {"loss_scale": 1.0}  # one number, not 300
    assert t.column("loss_scale")[299] == 1.0 and t.column("grad_norm")[0] == 21.0
    _same(t, ways["numpy"])
    _same(t, ways["pattern"])
    with monkeypatch.context() as m:  # the template path took it, in blocks of a few lines
        m.setattr(training_logs, "_numpy_columns", _never)  # and not the general one
        m.setattr(training_logs, "_BLOCK", 1000)
        _same(training_logs.parse_log(p), t)
    # another field set in the middle: the general path decides
    other = LINE_OTHER.format(it=150, total=300, cs=0, ms=60.0, loss="1.0", sk=0, nan=0)
    at = lines.index(next(x for x in lines if "iteration      150/" in x))
    p.write_text("\n".join([*lines[:at], other, *lines[at + 1 :]]) + "\n")
    ways = _three_ways(p, monkeypatch)
    _same(ways["template"], ways["numpy"])
    _same(ways["template"], ways["pattern"])
    assert not ways["template"].constant  # it was the general path's result
    # garbage inside a value: the same
    p.write_text("\n".join(lines).replace("lm loss: 5.333333E+00", "lm loss: 5.3x3E+00") + "\n")
    ways = _three_ways(p, monkeypatch)
    _same(ways["template"], ways["numpy"])
    _same(ways["template"], ways["pattern"])


def _column_major(texts: list[bytes]) -> np.ndarray:
    """Texts right-aligned in one window, spaces on the left, one column each."""
    w = max(len(t) for t in texts)
    rows = np.frombuffer(b"".join(t.rjust(w) for t in texts), np.uint8).reshape(len(texts), w)
    return np.ascontiguousarray(rows.T)


def _bits(x: float) -> bytes:
    return b"nan" if math.isnan(x) else np.float64(x).tobytes()


_PRINTED = st.one_of(
    st.tuples(st.floats(), st.sampled_from(["%.6E", "%.1f", "%.3f", "%.17g", "%.2e", "%r"])),
    st.tuples(st.integers(-(10**18), 10**18), st.sampled_from(["%d", "%5d", "%.1f"])),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_PRINTED, min_size=1, max_size=40),
    st.lists(st.text("0123456789.eE+- nai", min_size=1, max_size=14), max_size=5),
)
def test_numbers_are_read_bit_for_bit(printed, garbage):
    """The column-wise reader gives exactly what float() gives (NaN where float() refuses),
    whatever Megatron's format, the sign, the exponent, the width; garbage among them."""
    from quantpatch.analysis.log_columns import parse_numbers

    texts = [(fmt % v).encode() for v, fmt in printed]
    texts += [g.strip().encode() or b"x" for g in garbage]
    got = parse_numbers(_column_major(texts))
    assert [_bits(x) for x in got] == [_bits(training_logs.number(t)) for t in texts]


@settings(max_examples=200, deadline=None)
@given(
    text=st.binary(min_size=0, max_size=80),
    const=st.binary(min_size=1, max_size=40),
    starts=st.lists(st.integers(-45, 125), max_size=12),
)
def test_bytes_match_at_any_position(text, const, starts):
    """``LogBytes.matches`` (whole 8-byte words, the last masked) agrees with slicing, at
    every position, the file's edges and past them included (NUL there)."""
    import numpy as np

    from quantpatch.analysis.log_columns import LogBytes

    for planted in starts[:2]:  # plant the constant so that some positions do match
        if 0 <= planted <= len(text) - len(const):
            text = text[:planted] + const + text[planted + len(const) :]
    got = LogBytes(text).matches(np.array(starts, np.int64), const)
    padded = b"\0" * 200 + text + b"\0" * 200
    want = [padded[200 + s : 200 + s + len(const)] == const for s in starts]
    assert got.tolist() == want


def test_numbers_take_the_fast_path(monkeypatch):
    """Megatron's columns are read without numpy's text conversion (the fast path)."""
    from quantpatch.analysis import log_columns

    monkeypatch.setattr(log_columns, "to_float", _never)
    for fmt, values in (("%.6E", [9.889642, -0.25, 1e-12, 3e20]), ("%.1f", [96.9, 104.3, -0.0]),
                        ("%3d", [0, 1, 250]), ("%.3f", [2.105, 11.5])):  # fmt: skip
        texts = [(fmt % v).encode() for v in values]
        got = log_columns.parse_numbers(_column_major(texts))
        assert [_bits(x) for x in got] == [_bits(float(t)) for t in texts]


def _never(*args):
    raise AssertionError("the general path was taken")


def test_iteration_lines_of_any_layout(tmp_path, monkeypatch):
    """Iteration lines are found at their '/' whatever the widths: a first line in
    Megatron's layout, then a 9-digit iteration, one without a timestamp, one with other
    spacing, and slashes that are not iteration lines at all (paths, 't 1/1')."""
    first = LINE.format(it=1, total=10**9, cs=8, ms=1.5, loss="4.000000E+00", sk=0, nan=0)
    wide = LINE.format(it=123456789, total=10**9, cs=8, ms=1.5, loss="3.000000E+00", sk=0, nan=0)
    bare = LINE.format(it=2, total=10**9, cs=8, ms=1.5, loss="3.500000E+00", sk=0, nan=0)
    bare = bare.replace(" [2026-11-22 11:25:39]", "")
    spaced = LINE.format(it=3, total=10**9, cs=8, ms=1.5, loss="3.250000E+00", sk=0, nan=0)
    spaced = spaced.replace("       3/1000000000 |", " 3 / 1000000000   |")
    p = tmp_path / "x.log"
    p.write_text("\n".join([first, CHECKPOINT.format(it=1), bare, spaced, wide]) + "\n")
    ways = _three_ways(p, monkeypatch)
    assert list(ways["template"].iterations) == [1, 2, 3, 123456789]
    assert list(ways["template"].column("loss")) == [4.0, 3.5, 3.25, 3.0]
    _same(ways["template"], ways["numpy"])
    _same(ways["template"], ways["pattern"])


# found by fuzzing the three paths against each other; a = a whole line of two fields
_A = " iteration 1/ 30 | lm loss: 1.0 | grad norm: 2.0 |\n"
_HOSTILE = {
    # a last line without its newline is still being written: counted, not read
    "no-newline": (_A + " iteration 2/ 30 | lm loss: 2.0 | grad norm: 2.0 |", [1], 1),
    "cut-at-bar": (_A + " iteration 2/ 30 | lm loss: 2.0 |", [1], 1),
    # the first copy of a repeated iteration is the one kept, whatever its fields
    "repeat": (
        _A
        + " iteration 2/ 30 | lm loss: 2.0 |\n iteration 2/ 30 | lm loss: 9.0 | grad norm: 2.0 |\n",
        [1, 2],
        0,
    ),
    "bare": (_A + " iteration 2/ 30 |\n", [1, 2], 0),
    "trailing-blanks": (
        _A + " iteration 2/ 30 | lm loss: 2.0 | grad norm: 2.0 | \t  \n",
        [1, 2],
        0,
    ),
    "other-name": (_A + " iteration 2/ 30 | lm loss: 2.0 | grad_norm: 2.0 |\n", [1, 2], 0),
    "huge-iteration": (_A + " iteration 9223372036854775808/ 30 | lm loss: 1.0 |\n", [1], 0),
    "huge-exponent": (" iteration 1/ 30 | lm loss: 1E99999999999999999999 |\n", [1], 0),
    # two ranks' lines run together: the first is cut short, the second is whole
    "run-together": (
        _A + " iteration 2/ 30 | lm loss: 2.0 | grad norm: 2.0 | iteration 3/ 30 | lm loss: 3.0 "
        "| grad norm: 2.0 |\n",
        [1, 3],
        1,
    ),
    "no-leading-space": (
        "iteration 1/ 30 | lm loss: 1.0 | grad norm: 2.0 |\nsaving checkpoint at iteration 1 to "
        "/c\niteration 2/ 30 | lm loss: 2.0 |\n",
        [1, 2],
        0,
    ),
    "split-at-bar": (_A + " iteration 2/ 30 | lm loss: 2.0 |\n grad norm: 2.0 |\n", [1, 2], 0),
    # a line cut by another process's output, its rest on the next line: cut short
    "cut-by-newline": (
        _A + " iteration 2/ 30 | lm loss: 2.0 | grad no\nrm: 2.0 |\n iteration 3/ 30 | lm loss: 3.0"
        " | grad norm: 2.0 |\n",
        [1, 3],
        1,
    ),
    # the first line's name is garbled: the next line's good one is still read by its name
    "garbled-first-name": (
        " iteration 1/ 30 | lm loss: 1.0 | grad nxrm: 2.0 |\n iteration 2/ 30 | lm loss: 2.0 "
        "| grad norm: 3.0 |\n",
        [1, 2],
        0,
    ),
    # a field after a line that another line cut belongs to neither
    "field-of-a-cut-line": (
        " iteration 50/ 99 | lm loss: 1.0 | grad norm: 2. iteration 19/ 99 | \n" + _A,
        [1, 19],
        1,
    ),
    # forms Megatron never writes: a field not written "| name: value" is not read
    "tab-after-bar": (_A + " iteration 2/ 30 |\tlm loss: 2.0 | grad norm: 2.0 |\n", [1, 2], 0),
    "no-space": (_A + " iteration 2/ 30 |lm loss: 2.0 | grad norm : 2.0 |\n", [1, 2], 0),
    "lone-cr": (_A + " iteration 2/ 30 | lm loss: 2.0 |\r grad norm: 2.0 |\n", [1, 2], 0),
    "nul": (_A + " iteration 2/ 30 | lm loss: 2.0\x00 | grad norm: 2.0 |\n", [1, 2], 0),
    "wide-value": (
        _A + " iteration 2/ 30 | lm loss: 2." + "0" * 40 + " | grad norm: 2.0 |\n",
        [1, 2],
        0,
    ),
    "restart": (
        " iteration 10/ 100 | lm loss: 1.0 |\n iteration 20/ 100 | lm loss: 1.0 |\n"
        " iteration 15/ 50 | lm loss: 1.0 |\n",
        [10, 15, 20],
        0,
    ),
}


@pytest.mark.parametrize("case", list(_HOSTILE))
def test_hostile_logs_read_the_same_three_ways(case, tmp_path, monkeypatch):
    text, iterations, garbage = _HOSTILE[case]
    p = tmp_path / "x.log"
    p.write_text(text)
    ways = _three_ways(p, monkeypatch)
    t = ways["template"]
    assert list(t.iterations) == iterations and t.garbage == garbage
    _same(t, ways["numpy"])
    _same(t, ways["pattern"])
    if case == "run-together":
        assert list(t.column("loss")) == [1.0, 3.0]
    if case == "huge-exponent":
        assert t.column("loss")[0] == math.inf
    if case in ("other-name", "no-space", "lone-cr"):
        assert math.isnan(t.column("grad_norm")[1])
    if case in ("tab-after-bar", "no-space", "nul"):
        assert math.isnan(t.column("loss")[1])
    if case == "garbled-first-name":
        assert math.isnan(t.column("grad_norm")[0]) and t.column("grad_norm")[1] == 3.0
    if case == "field-of-a-cut-line":
        assert math.isnan(t.column("loss")[1])  # iteration 19's line holds no field
    if case == "wide-value":
        assert t.column("loss")[1] == 2.0
    if case == "restart":
        assert t.total_iterations == 100  # the line of the highest iteration says


def test_the_pattern_path_does_not_backtrack(tmp_path, monkeypatch):
    """A first line with one field more than the others once made the pattern path take
    seconds a line (nested quantifiers); it is linear now."""
    first = LINE.format(it=1, total=20, cs=8, ms=1.0, loss="1.0", sk=0, nan=0) + " num zeros: 0 |"
    rest = [
        LINE.format(it=i, total=20, cs=8, ms=1.0, loss="1.0", sk=0, nan=0) for i in range(2, 21)
    ]
    p = tmp_path / "x.log"
    p.write_text("\n".join([first, *rest]) + "\n")
    monkeypatch.setattr(training_logs, "_template_columns", lambda data, run: False)
    monkeypatch.setattr(training_logs, "_numpy_columns", lambda data, run: False)
    # this process's CPU time, which other processes' load does not stretch; backtracking
    # took seconds a line (over 20 s for these 20), linear parsing takes milliseconds
    start = time.process_time()
    run = training_logs.parse_log(p)
    assert time.process_time() - start < 5.0 and len(run.iterations) == 20


def test_the_comparison_is_the_same_with_and_without_numpy(tmp_path, monkeypatch):
    for scheme, slope in (("bf16", 7.0), ("FA_mxfp8", 7.5), ("linear_mxfp4", -2.5)):
        p = tmp_path / f"llama32-1b_wikipedia_{scheme}_fast" / "logs" / "x.log"
        p.parent.mkdir(parents=True)
        step = 2 if scheme == "FA_mxfp8" else 1  # fewer iterations in common
        p.write_text(
            "\n".join(
                LINE.format(it=i, total=400, cs=8 * i, ms=50 + i % 9, loss=f"{3 + slope / i:.6E}",
                            sk=int(i % 97 == 0), nan=0)
                for i in range(1, 401, step)
            ) + "\n"
        )  # fmt: skip
    names = (["llama32-1b"], ["wikipedia"])
    fast = training_logs.runs([tmp_path], names=names).rows
    monkeypatch.setattr(training_logs, "_numpy", lambda: None)
    slow = training_logs.runs([tmp_path], names=names).rows
    assert len(fast) == 3
    for a, b in zip(fast, slow, strict=True):
        for key, value in a.items():
            if isinstance(value, float) and math.isnan(value):
                assert math.isnan(b[key]), key
            elif isinstance(value, float):
                assert value == pytest.approx(b[key], rel=1e-12, abs=1e-15), key
            else:
                assert value == b[key], key
    by = {r["scheme"]: r for r in fast}
    assert [by[s]["diverged"] for s in ("bf16", "FA_mxfp8", "linear_mxfp4")] == [
        False, False, True,
    ]  # fmt: skip
    assert by["FA_mxfp8"]["matched_iterations"] == 20 and by["FA_mxfp8"]["skipped"] == 2
    assert by["bf16"]["skipped"] == 4 and by["FA_mxfp8"]["step_vs_bf16"] == pytest.approx(1.0)


def test_sliced_metrics_equal_the_whole(monkeypatch):
    from quantpatch.analysis import tensor_metrics

    gen = torch.Generator().manual_seed(3)
    t = (torch.randn(600, 1000, generator=gen) * 3).to(torch.bfloat16)
    t[5, 7] = float("nan")
    fmts = ("mxfp8", "mxfp4", "hifp8")
    for dim in (-1, 0):
        sliced = tensor_metrics.formats_sums(t, fmts, dim)
        monkeypatch.setattr(tensor_metrics, "_SLICE", 1 << 30)
        whole = tensor_metrics.formats_sums(t, fmts, dim)
        monkeypatch.undo()
        for f in fmts:
            a, b = sliced[f], whole[f]
            assert (a.underflows, a.overflows, a.blocks, a.blocks_saturated, a.finite) == (
                b.underflows, b.overflows, b.blocks, b.blocks_saturated, b.finite,
            )  # fmt: skip
            n, other = (1000, 600) if dim == -1 else (600, 1000)
            assert a.noise == pytest.approx(b.noise, rel=1e-9)
            assert a.blocks == (math.ceil(n / 32) * other if f != "hifp8" else 0)
