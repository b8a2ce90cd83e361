"""``runs``, ``tensors`` and ``report`` on odd inputs: noisy and NaN training logs as
Megatron core_v0.13.1 prints them, logs and files that are not what their names say, hostile
names, metrics at the edges of the float range, and ``--out`` / ``--jobs`` refusals."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import warnings
from pathlib import Path

import pytest

from quantpatch.analysis import training_logs

# Megatron core_v0.13.1 ``training_log``: one iteration line (as printed with
# ``--log-throughput``); a NaN interval of a bf16 run prints no ``lm loss`` (its average is
# not above 0) but ``grad norm: nan``, and nothing skipped: ``number of nan iterations``
# counts skipped iterations only, so it stays 0 (tests/test_analysis_nan.py: every shape)
MEGATRON = (
    " [2025-06-03 10:12:45] iteration {it:8d}/{total:8d} | consumed samples: {cs:12d} | "
    "elapsed time per iteration (ms): 512.3 | throughput per GPU (TFLOP/s/GPU): 101.2 | "
    "learning rate: 3.000000E-04 | global batch size:    32 | {loss}loss scale: 1.0 | "
    "grad norm: {grad} | number of skipped iterations: {sk:3d} | "
    "number of nan iterations: {nan:3d} |"
)


def _megatron_log(
    path: Path, losses: list[float], *, scheme: str = "bf16", exit_status: int | None = 0
) -> Path:
    """A log of one iteration line per loss (NaN: the line Megatron prints for a NaN
    interval), with the launch scripts' header and exit line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"[quantpatch] llama32-1b / wikipedia / {scheme} (smoke): linear=bf16 qk=bf16 pv=bf16"]
    n = len(losses)
    for i, loss in enumerate(losses, 1):
        bad = not math.isfinite(loss)
        printed = "" if bad else f"lm loss: {loss:.6E} | "
        grad = "nan" if bad else "2.345"
        line = MEGATRON.format(it=i, total=n, cs=32 * i, loss=printed, grad=grad, sk=0, nan=0)
        lines.append(line)
    if exit_status is not None:
        lines.append(f"[quantpatch] training exited with status {exit_status}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _falling(n: int, seed: int, noise: float = 0.3) -> list[float]:
    """A falling loss with multiplicative noise of +-``noise`` on every iteration."""
    rng = random.Random(seed)
    return [(2 + 8 * math.exp(-4 * i / n)) * (1 + rng.uniform(-noise, noise)) for i in range(n)]


# -- diverged: judged against the run's own noise, and against bf16 ---------------------------


@pytest.mark.parametrize("n", [20, 2000])
def test_a_noisy_falling_loss_has_not_diverged(tmp_path, n):
    """20 noisy losses once marked every run diverged, the bf16 reference included (the
    last of 10 windows of 2 was 5 % above the best): the level is now judged against the
    run's own iteration-to-iteration noise."""
    for seed in range(5):
        root = tmp_path / str(seed)
        _megatron_log(root / "ref" / "x.log", _falling(n, seed))
        _megatron_log(root / "q" / "x.log", _falling(n, seed + 100), scheme="FA_mxfp8")
        rows = {r["scheme"]: r for r in training_logs.runs([root]).rows}
        assert rows["bf16"]["diverged"] is False, (seed, rows["bf16"])
        assert rows["FA_mxfp8"]["diverged"] is False, (seed, rows["FA_mxfp8"])
        assert rows["bf16"]["status"] == "finished"


@pytest.mark.parametrize("n", [20, 2000])
def test_a_loss_rising_over_its_last_third_has_diverged(tmp_path, n):
    losses = _falling(n, 1, noise=0.05)
    third = n - n // 3
    losses[third:] = [v * (1 + 2 * (i + 1) / (n // 3)) for i, v in enumerate(losses[third:])]
    _megatron_log(tmp_path / "ref" / "x.log", _falling(n, 2, noise=0.05))
    _megatron_log(tmp_path / "q" / "x.log", losses, scheme="FA_hifp8")
    rows = {r["scheme"]: r for r in training_logs.runs([tmp_path]).rows}
    assert rows["FA_hifp8"]["diverged"] is True and rows["bf16"]["diverged"] is False


def test_the_gap_to_bf16_that_grows_is_divergence(tmp_path):
    """A run whose loss still falls, but ever more slowly than bf16's beside it, is
    judged against bf16: its gap to bf16 rises over the last third."""
    n = 300
    ref = _falling(n, 3, noise=0.01)
    run = [v + (3.0 * max(0, i - 2 * n // 3) / (n // 3)) for i, v in enumerate(ref)]
    run = [v * 0.999 for v in run]
    _megatron_log(tmp_path / "ref" / "x.log", ref)
    _megatron_log(tmp_path / "q" / "x.log", run, scheme="linear_mxfp4")
    q = training_logs.parse_log(tmp_path / "q" / "x.log")
    b = training_logs.parse_log(tmp_path / "ref" / "x.log")
    assert training_logs.diverged(b) is False and training_logs.diverged(b, b) is False
    assert training_logs.diverged(q, b) is True


def test_too_short_to_judge_and_nan_whatever_the_length(tmp_path):
    short = _megatron_log(tmp_path / "a" / "x.log", [3.0, 2.9, 2.8])
    assert training_logs.diverged(training_logs.parse_log(short)) is None
    nan = _megatron_log(tmp_path / "b" / "x.log", [3.0, math.nan, 2.8], scheme="x")
    assert training_logs.diverged(training_logs.parse_log(nan)) is True
    res = training_logs.runs([tmp_path / "a"])
    assert res.rows[0]["diverged"] is None


def test_nan_as_megatron_prints_it(tmp_path):
    """core_v0.13.1 prints no ``lm loss`` on a bf16 NaN interval, only ``grad norm: nan``
    (``number of nan iterations`` stays 0: nothing was skipped): the run is diverged with
    status ``nan``, and the loss reported (from before the NaNs) says which iteration it is
    from."""
    losses = _falling(40, 4, noise=0.01)[:30] + [math.nan] * 10
    _megatron_log(tmp_path / "q" / "x.log", losses, scheme="FA_hifp8")
    _megatron_log(tmp_path / "ref" / "x.log", _falling(40, 5, noise=0.01))
    rows = {r["scheme"]: r for r in training_logs.runs([tmp_path]).rows}
    q = rows["FA_hifp8"]
    assert q["diverged"] is True and q["status"] == "nan" and q["nan_iterations"] == 0
    assert q["iterations"] == 40 and q["last_finite_iteration"] == 30
    assert math.isfinite(q["loss"])
    assert rows["bf16"]["last_finite_iteration"] == 40 and rows["bf16"]["status"] == "finished"
    # a NaN run too short to judge otherwise is still diverged
    _megatron_log(tmp_path / "s" / "x.log", [3.0, math.nan], scheme="FA_mxfp4")
    rows = {r["scheme"]: r for r in training_logs.runs([tmp_path / "s"]).rows}
    assert rows["FA_mxfp4"]["diverged"] is True and rows["FA_mxfp4"]["status"] == "nan"


# -- one odd log never stops the others ---------------------------------------------------------


def test_odd_logs_are_read_and_never_stop_the_others(tmp_path, monkeypatch):
    good = _megatron_log(tmp_path / "good" / "x.log", _falling(30, 6))
    digits = tmp_path / "digits" / "x.log"  # an exit status of 5000 digits
    _megatron_log(digits, _falling(30, 6), exit_status=None)
    digits.write_text(digits.read_text() + "[quantpatch] training exited with status "
                      + "9" * 5000 + "\n")  # fmt: skip
    _megatron_log(tmp_path / "huge" / "x.log", [1e308] * 30, scheme="h")  # sum overflows
    wide = _megatron_log(tmp_path / "wide" / "x.log", _falling(30, 6), scheme="w")
    text = wide.read_text().splitlines()
    text[1] = re.sub(r"lm loss: \S+", "lm loss: 1.12345678901234567890123456", text[1])
    wide.write_text("\n".join(text) + "\n")  # 26 decimals on the first iteration line
    res = training_logs.runs([tmp_path])
    assert res.logs == 4 and not res.skipped
    paths = {Path(r["path"]).parent.name: r for r in res.rows}
    assert paths["digits"]["status"].startswith("no exit line")
    assert paths["huge"]["loss"] == 1e308 and paths["huge"]["diverged"] is False
    assert paths["wide"]["iterations"] == 30
    # an internal error in one log's parse: that log is reported, the others are read
    real = training_logs.parse_log

    def boom(path: Path, chunk: int = 0) -> training_logs.Run:
        if path == good:
            raise IndexError("planted")
        return real(path, chunk)

    monkeypatch.setattr(training_logs, "parse_log", boom)
    res = training_logs.runs([tmp_path])
    assert len(res.rows) == 3 and res.skipped == [
        (str(good), "could not be parsed (IndexError: planted)")
    ]


# -- special files, long lines, memory ----------------------------------------------------------


@pytest.fixture
def alarm():
    """Fail (instead of hanging the suite) when a test blocks for 20 seconds."""

    def hang(*_: object) -> None:
        raise TimeoutError("blocked")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_special_files_are_skipped_not_read(tmp_path, alarm, run):
    _megatron_log(tmp_path / "good" / "x.log", _falling(30, 6))
    os.mkfifo(tmp_path / "fifo.log")
    (tmp_path / "zero.log").symlink_to("/dev/zero")
    res = training_logs.runs([tmp_path])
    assert len(res.rows) == 1
    assert dict(res.skipped) == {
        str(tmp_path / "fifo.log"): "not a regular file (a FIFO)",
        str(tmp_path / "zero.log"): "not a regular file (a character device)",
    }
    out = run("runs", tmp_path, "--json")
    assert out.code == 0 and len(json.loads(out.out)["skipped"]) == 2
    out = run("runs", tmp_path)
    assert out.code == 0 and "skipped" in out.err and "a FIFO" in out.err


def test_a_log_read_in_pieces_is_the_log_read_whole(tmp_path):
    """Pieces of whole lines, a line longer than a piece skipped and counted, an iteration
    printed again in a later piece, a crash at the end: the same run as read in one
    piece, with memory bounded by the piece."""
    losses = _falling(400, 8, noise=0.1)
    losses[100] = math.nan
    p = _megatron_log(tmp_path / "x.log", losses, exit_status=None)
    lines = p.read_text().splitlines()
    lines.insert(300, lines[120])  # iteration 120 again, far from its first print
    lines.insert(200, "x" * 50_000)  # one very long line (no newline for 50 kB)
    lines.append("Traceback (most recent call last):")
    p.write_text("\n".join(lines) + "\n" + "RuntimeError: CUDA err")  # still being written
    whole = training_logs.parse_log(p)
    for chunk in (4096, 20_000, 333_333):
        piece = training_logs.parse_log(p, chunk)
        assert list(piece.iterations) == list(whole.iterations) == list(range(1, 401))
        assert (piece.garbage, piece.duplicates, piece.crashed, piece.model) == (
            whole.garbage + (chunk < 50_000), whole.duplicates, whole.crashed, "llama32-1b",
        )  # fmt: skip
        for name in ("loss", "nan", "skipped", "grad_norm", "step_ms", "loss_scale", "tflops"):
            a, b = list(piece.column(name)), list(whole.column(name))
            assert [x if x == x else None for x in a] == [x if x == x else None for x in b], name
    assert whole.garbage == 0 and whole.duplicates == 1 and whole.crashed


def test_memory_is_bounded_by_the_piece(tmp_path):
    """A log is never held whole: what a parse allocates at its peak is a few times a
    piece (the piece, its positions and windows), a small part of a 20 MB log."""
    import tracemalloc

    p = _megatron_log(tmp_path / "x.log", _falling(60_000, 9))
    size = p.stat().st_size
    assert size > 18 << 20
    training_logs.parse_log(p, 1 << 18)  # the reused scratch buffers, allocated once
    tracemalloc.start()
    run = training_logs.parse_log(p, 1 << 18)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(run.iterations) == 60_000
    assert peak < size / 3, (peak, size)  # the columns read (60k x 8 doubles) included


# -- format metrics in float64 ------------------------------------------------------------------


def _float64_metrics(t, fmt: str) -> tuple[float, float, float]:
    """SQNR, relative error and cosine computed directly in float64 from the quant op."""
    from quantpatch.runtime import quantpatch_ops as ops

    x = t.double()
    q = ops.fake_quant(t, fmt, dim=-1, backward=False).double()
    signal, noise = float((x * x).sum()), float(((x - q) ** 2).sum())
    cos = float((x * q).sum()) / math.sqrt(signal * float((q * q).sum()) or math.inf)
    return 10 * math.log10(signal / noise), math.sqrt(noise / signal), cos


def test_metrics_are_finite_and_right_at_the_float_range_edges():
    """A tensor HiF8 flushes entirely (|x| ~ 2^-83: its squares are 0 in float32) was reported
    SQNR inf, relative error 0, cosine 1; values of 1e30 (squares inf in float32) gave NaN."""
    torch = pytest.importorskip("torch")
    from quantpatch.analysis.tensor_metrics import format_sums

    gen = torch.Generator().manual_seed(11)
    tiny = (torch.randn(64, 64, generator=gen) * 2**-83).to(torch.bfloat16)
    s = format_sums(tiny, "hifp8").summary()
    assert s["underflows %"] == 100.0
    assert (s["sqnr_db"], s["rel_error"], s["cosine"]) == (0.0, 1.0, 0.0)
    for fmt in ("mxfp8", "mxfp4"):  # MX scales the block: nothing flushes, finite and right
        s = format_sums(tiny, fmt).summary()
        want = _float64_metrics(tiny, fmt)
        assert (s["sqnr_db"], s["rel_error"], s["cosine"]) == pytest.approx(want, rel=1e-9)
    huge = torch.randn(64, 64, generator=gen) * 1e30
    for fmt in ("mxfp8", "mxfp4", "hifp8"):
        s = format_sums(huge, fmt).summary()
        got = (s["sqnr_db"], s["rel_error"], s["cosine"])
        assert all(math.isfinite(v) for v in got), (fmt, s)
        assert got == pytest.approx(_float64_metrics(huge, fmt), rel=1e-9, abs=1e-12)
    assert format_sums(huge, "hifp8").summary()["overflows %"] == 100.0


# -- a module outside the layers is named, never None ------------------------------------------


def _layered_dir(root: Path) -> Path:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(12)
    root.mkdir(parents=True, exist_ok=True)
    for i, layer in enumerate(("0", "1", "None")):
        t = torch.randn(8, 64, generator=gen)
        name = f"20250908_091143_{i:04d}_linear_L{layer}_forward_mxfp8_input.pt"
        torch.save({"tensor": t, "metadata": {}}, root / name)  # the fork: the name only
    md = {"layer_idx": None, "module_kind": "output_layer", "tensor_name": "weight"}
    torch.save({"tensor": torch.randn(8, 64, generator=gen), "metadata": md}, root / "w.pt")
    return root


def test_the_output_layer_is_named_by_its_module(tmp_path, run):
    """The saver writes the output layer as ``..._linear_LNone_...`` (``layer_idx`` null):
    it is ``output_layer`` in the tables and the JSON, never ``None`` or ``-``."""
    d = _layered_dir(tmp_path / "t")
    res = run("tensors", "summary", d, "--by", "layer,tensor", "--json")
    assert res.code == 0, res
    data = json.loads(res.out)
    assert data["inventory"]["layers"] == [0, 1, "output_layer"]
    assert {(g["layer"], g["tensor"]) for g in data["groups"]} == {
        (0, "input"), (1, "input"), ("output_layer", "input"), ("output_layer", "weight"),
    }  # fmt: skip
    res = run("tensors", "formats", d, "--by", "layer", "--formats", "mxfp8")
    assert res.code == 0 and "output_layer" in res.out and "None" not in res.out
    res = run("tensors", "summary", d, "--by", "layer")
    assert "layers [0, 1, 'output_layer']" in res.out and "None" not in res.out
    if _has_matplotlib():
        res = run("tensors", "plot", d, "--out", tmp_path / "figs", "--formats", "mxfp8")
        assert res.code == 0 and (tmp_path / "figs" / "sqnr_heatmap.png").is_file(), res
    # a saver that writes the module's name where the number goes is read the same
    from quantpatch.analysis.tensor_files import meta_of

    named = Path("20250908_091143_0007_linear_Loutput_layer_forward_mxfp8_input.pt")
    meta = meta_of(named, {})
    assert (meta.layer, meta.kind, meta.operation, meta.tensor) == (
        "output_layer", "linear", "forward", "input",
    )  # fmt: skip


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# -- the report: escaped, written atomically, its destination checked first -------------------

HOSTILE = "<script>alert(1)</script>"


def _hostile_inputs(tmp_path: Path) -> tuple[Path, Path]:
    torch = pytest.importorskip("torch")
    tensors_dir = tmp_path / "tensors-<script>alert(1)<" / "script>"  # '/' ends a name
    tensors_dir.mkdir(parents=True)
    md = {"quant_type": "<img src=x onerror=alert(1)>", "tensor_name": "<b>t</b>"}
    t = torch.randn(8, 64, generator=torch.Generator().manual_seed(13))
    torch.save({"tensor": t, "metadata": md}, tensors_dir / "a.pt")
    (tensors_dir / "b.pt").write_bytes(b"<i>not a tensor</i>")
    log = _megatron_log(tmp_path / "runs" / "x.log", _falling(30, 14))
    text = log.read_text().replace("llama32-1b", HOSTILE, 1).replace("wikipedia", "<u>d</u>", 1)
    log.write_text(text)
    (tmp_path / "runs" / "<s>.log").symlink_to("/dev/null")
    return tensors_dir, tmp_path / "runs"


def test_the_report_escapes_every_input(tmp_path, run):
    pytest.importorskip("matplotlib")
    tensors_dir, runs_dir = _hostile_inputs(tmp_path)
    out = tmp_path / "r.html"
    res = run("report", "--tensors", tensors_dir, "--runs", runs_dir, "--out", out)
    assert res.code == 0, res
    html = out.read_text()
    for raw in (HOSTILE, "<script", "<img src=x", "<b>t", "<u>d", "<i>not", "<s>"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the log header's model
    assert "tensors-&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the directory
    assert "&lt;img src=x onerror=alert(1)&gt;" in html  # the metadata's quant_type
    assert "&lt;s&gt;.log: not a regular file" in html  # a log skipped, its name escaped


def test_the_report_is_written_atomically_and_never_over_its_inputs(tmp_path, run):
    pytest.importorskip("matplotlib")
    log = _megatron_log(tmp_path / "runs" / "x.log", _falling(30, 15))
    before = log.read_bytes()
    # a link planted at the predictable temp name: never followed
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "r.html"
    (tmp_path / "r.html.tmp").symlink_to(victim)
    res = run("report", "--runs", log, "--out", out)
    assert res.code == 0, res
    assert victim.read_text() == "keep" and not out.is_symlink()
    assert out.read_text().startswith("<!doctype html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.html.tmp", "runs", "victim"]
    # one of its own inputs, named directly, through a link, or found under a directory
    (tmp_path / "link.log").symlink_to(log)
    for dest, runs_arg in ((log, log), (tmp_path / "link.log", log), (log, tmp_path / "runs")):
        res = run("report", "--runs", runs_arg, "--out", dest)
        assert res.code == 2 and "--out" in res.err, res
        assert log.read_bytes() == before
    # a symbolic link as --out
    res = run("report", "--runs", log, "--out", tmp_path / "r.html.tmp")
    assert res.code == 2 and "symbolic link" in res.err and victim.read_text() == "keep"


def test_destinations_are_checked_before_any_work(tmp_path, run, monkeypatch):
    pytest.importorskip("matplotlib")
    from quantpatch.analysis import tensors

    log = _megatron_log(tmp_path / "runs" / "x.log", _falling(30, 16))
    d = _layered_dir(tmp_path / "t")
    existing = tmp_path / "file.png"
    existing.write_text("x")

    def never(*_: object, **__: object) -> None:
        raise AssertionError("the work started")

    monkeypatch.setattr(tensors, "formats", never)
    monkeypatch.setattr(training_logs, "runs", never)
    for args in (
        ("tensors", "plot", d, "--out", existing),
        ("tensors", "plot", d, "--out", existing / "sub"),
        ("runs", log, "--plot", existing),
        ("report", "--runs", log, "--out", "/proc/r.html"),
        ("report", "--runs", log, "--out", existing / "r.html"),
    ):
        res = run(*args)
        assert res.code == 2, (args, res)
        assert len(res.err.strip().splitlines()) == 1 and "internal error" not in res.err, res
    assert existing.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.png", "runs", "t"]


# -- tensor files that are not what their names say ---------------------------------------------


def _odd_tensor_dir(root: Path) -> Path:
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(17)
    root.mkdir(parents=True)
    md = {"tensor_name": '=HYPERLINK("http://x")', "layer_idx": 0}
    torch.save({"tensor": torch.randn(8, 64, generator=gen), "metadata": md}, root / "good.pt")
    torch.save({"tensor": torch.randn(8, 64, generator=gen).to_sparse()}, root / "sparse.pt")
    with warnings.catch_warnings():  # torch's deprecation of quantized tensors, which it
        warnings.simplefilter("ignore")  # gives once a process: whether it comes is not ours
        q = torch.quantize_per_tensor(torch.randn(8, 64, generator=gen), 0.1, 0, torch.qint8)
    torch.save({"tensor": q}, root / "quantized.pt")
    legacy = {"tensor": torch.randn(8, 64, generator=gen), "metadata": {"tensor_name": "old"}}
    for protocol in (3, 4):  # torch warns of both; its safe loader reads 3, not 4 (FRAME)
        torch.save(legacy, root / f"legacy{protocol}.pt", _use_new_zipfile_serialization=False,
                   pickle_protocol=protocol)  # fmt: skip
    os.mkfifo(root / "fifo.pt")
    os.mkfifo(root / "fifo.jsonl")
    (root / "zero.pt").symlink_to("/dev/zero")
    (root / "zeros.pt").write_bytes(bytes(1 << 16))  # /dev/zero's bytes, saved as a file

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, ("true",))

    torch.save({"tensor": Evil()}, root / "evil.pt")
    record = {"name": "x", "tensor_info": {"min": -1, "max": 1, "mean": 0, "std": 1,
                                           "shape": [4]}, "metadata": {}}  # fmt: skip
    (root / "stats_rank0.jsonl").write_text("x" * (2 << 20) + "\n" + json.dumps(record) + "\n")
    return root


def test_odd_tensor_files_are_skipped_with_one_line_each(tmp_path, run, alarm):
    import warnings

    d = _odd_tensor_dir(tmp_path / "t")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = run("tensors", "summary", d, "--json")
    assert res.code == 0, res
    assert not [w for w in seen if "pickle protocol" in str(w.message)]
    inv = json.loads(res.out)["inventory"]
    reasons = {s["path"]: s["reason"] for s in inv["skipped"]}
    assert reasons == {
        "evil.pt": "refused: loading it would run code (it imports posix.system)",
        "fifo.jsonl": "not a regular file (a FIFO)",
        "fifo.pt": "not a regular file (a FIFO)",
        "legacy4.pt": "refused: torch's safe loader does not read its pickle "
        "(Unsupported operand 149)",
        "quantized.pt": "a quantized tensor (qint8)",
        "sparse.pt": "not a dense tensor (sparse_coo)",
        "stats_rank0.jsonl:1": "a line longer than 1 MiB",
        "zero.pt": "not a regular file (a character device)",
        "zeros.pt": "not a tensor file (neither a zip archive nor a pickle)",
    }
    assert inv["files"] == 2 and inv["stats_records"] == 1  # good.pt, legacy3.pt
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = run("tensors", "formats", d)
    assert res.code == 0 and "skipped 10" in res.err, res  # and the stats-only record
    assert "a quantized tensor (qint8)" in res.err and "Traceback" not in res.err
    assert not [w for w in seen if "pickle protocol" in str(w.message)]


def test_csv_cells_are_never_formulas(tmp_path, run):
    d = _layered_dir(tmp_path / "t")
    import torch

    md = {"tensor_name": '=HYPERLINK("http://x","y")', "module_kind": "@k"}
    torch.save({"tensor": torch.randn(8, 64), "metadata": md}, d / "f.pt")
    res = run("tensors", "formats", d, "--csv", "--by", "kind,tensor", "--formats", "hifp8")
    assert res.code == 0, res
    lines = res.out.splitlines()
    row = next(ln for ln in lines if "HYPERLINK" in ln)
    assert row.startswith("'@k,\"'=HYPERLINK(") and ",hifp8," in row
    for ln in lines[1:]:  # numbers stay numbers
        float(ln.rsplit(",", 1)[1])


# -- --jobs, rich markup, mathtext -------------------------------------------------------------


def test_jobs_are_bounded(tmp_path, run):
    """--jobs 10000 forked until the process limit, exited 3 and left workers running."""
    from quantpatch.analysis import tensors
    from quantpatch.base.errors import UserError

    d = _layered_dir(tmp_path / "t")
    log = _megatron_log(tmp_path / "runs" / "x.log", _falling(30, 18))
    top = min(64, 4 * (os.cpu_count() or 1))
    for args in (  # the first just past the bound: one that fails without it forks little
        ("tensors", "plot", d, "--out", tmp_path / "figs", "--jobs", str(top + 1)),
        ("tensors", "summary", d, "--jobs", "10000"),
        ("tensors", "formats", d, "-j", "0"),
        ("runs", log, "--jobs", "10000"),
        ("report", "--runs", log, "--out", tmp_path / "r.html", "--jobs", "-3"),
    ):
        res = run(*args)
        assert res.code == 2, (args, res)
        assert res.err.strip().splitlines() == [
            f"error: --jobs {args[-1]}: give 1 to {top} worker processes "
            "(at most 4 per CPU and 64 in all)."
        ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "t"]  # nothing written
    with pytest.raises(UserError):
        tensors.summary(d, jobs=10000)
    assert run("tensors", "summary", d, "--jobs", str(min(top, 2))).code == 0


def _marked_up(tmp_path: Path) -> tuple[Path, Path]:
    torch = pytest.importorskip("torch")
    d = tmp_path / "t"
    d.mkdir()
    gen = torch.Generator().manual_seed(19)
    for i, (kind, name) in enumerate((("[/k]", "[/x]"), ("k", "[bold]y"), (":smile:", r"$\x$"))):
        md = {"module_kind": kind, "tensor_name": name, "layer_idx": i}
        torch.save({"tensor": torch.randn(8, 64, generator=gen), "metadata": md}, d / f"{i}.pt")
    log = _megatron_log(tmp_path / "runs" / "x.log", _falling(30, 20))
    log.write_text(log.read_text().replace("llama32-1b", r"[/m]$\frac{$", 1))
    bf = _megatron_log(tmp_path / "runs" / "y.log", _falling(30, 21), scheme="FA_mxfp8")
    bf.write_text(bf.read_text().replace("llama32-1b", r"[/m]$\frac{$", 1))
    return d, tmp_path / "runs"


def test_names_holding_rich_markup_are_printed_as_they_are(tmp_path, run, monkeypatch):
    d, runs_dir = _marked_up(tmp_path)
    res = run("tensors", "summary", d, "--by", "kind,tensor")
    assert res.code == 0, res
    for name in ("[/k]", "[/x]", "[bold]y", ":smile:", r"$\x$"):
        assert name in res.out, name
    res = run("tensors", "formats", d, "--by", "kind,tensor", "--formats", "mxfp8")
    assert res.code == 0 and "[/x]" in res.out and "[bold]y" in res.out, res
    res = run("runs", runs_dir)
    assert res.code == 0 and r"[/m]$\frac{$" in res.out, res
    # the internal-error handler prints the message as it is too
    from quantpatch.analysis import tensors

    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("[/x] [bold]y :smile:")

    monkeypatch.setattr(tensors, "summary", boom)
    res = run("tensors", "summary", d)
    assert res.code == 3 and "RuntimeError: [/x] [bold]y :smile:" in res.err, res


def test_dollars_in_names_never_stop_a_plot(tmp_path, run):
    pytest.importorskip("matplotlib")
    d, runs_dir = _marked_up(tmp_path)
    res = run("tensors", "plot", d, "--out", tmp_path / "figs", "--formats", "mxfp8")
    assert res.code == 0, res
    res = run("runs", runs_dir, "--plot", tmp_path / "p")
    assert res.code == 0 and any((tmp_path / "p").glob("loss_*.png")), res
    res = run("report", "--tensors", d, "--runs", runs_dir, "--out", tmp_path / "r.html")
    assert res.code == 0 and r"$\frac{$" in (tmp_path / "r.html").read_text(), res
