"""``runs`` on every way Megatron core_v0.13.1 reports a bad loss.

The logs are made by ``_training_log``, which keeps core_v0.13.1's ``training_log``
(megatron/training/training.py) bookkeeping and prints with its own format strings: per
logging interval it adds up the loss of the advanced iterations, counts the skipped ones and,
among those, the ones whose loss was NaN or Inf; it prints ``lm loss`` only where the average
over the advanced iterations is above 0 (``if avg > 0.0``), and ``grad norm`` only where the
printing iteration's optimizer step returned one (a skipped step returns None)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from quantpatch.analysis import training_logs


@dataclass
class Step:
    """One training iteration as ``train_step`` hands it to ``training_log``."""

    loss: float
    skipped: bool = False  # the loss scaler found Inf/NaN gradients: no update
    grad_norm: float | None = 1.5  # None on a skipped step (the optimizer returns None)


def _training_log(steps: list[Step], log_interval: int, loss_scale: float = 1.0) -> list[str]:
    """The iteration lines core_v0.13.1 prints for ``steps`` (iteration 1 first)."""
    total: dict[str, float] = {}
    lines = []
    for iteration, st in enumerate(steps, 1):
        # "Advanced, skipped, and Nan iterations."
        if not st.skipped:
            total["advanced iterations"] = total.get("advanced iterations", 0) + 1
        else:
            total.setdefault("advanced iterations", 0)
        total["skipped iterations"] = total.get("skipped iterations", 0) + int(st.skipped)
        got_nan = False
        if not st.skipped:
            total["lm loss"] = total.get("lm loss", 0.0) + st.loss
        else:
            got_nan = st.loss in (math.inf, -math.inf) or st.loss != st.loss
        total["nan iterations"] = total.get("nan iterations", 0) + int(got_nan)
        if iteration % log_interval:
            continue
        # training_log's format strings, verbatim (``.format`` where it has it)
        s = " [2026-11-22 11:25:39]"
        s += " iteration {:8d}/{:8d} |".format(iteration, len(steps))  # noqa: UP032
        s += " consumed samples: {:12d} |".format(8 * iteration)  # noqa: UP032
        s += " elapsed time per iteration (ms): {:.1f} |".format(96.9)  # noqa: UP032
        s += f" learning rate: {6.666667e-05:.6E} |"
        s += f" global batch size: {8:5d} |"
        avg = total["lm loss"] / float(max(1, total["advanced iterations"]))
        if avg > 0.0:
            s += " {}: {:.6E} |".format("lm loss", avg)
        total["lm loss"] = 0.0
        s += f" loss scale: {loss_scale:.1f} |"
        if st.grad_norm is not None:
            s += f" grad norm: {st.grad_norm:.3f} |"
        s += " number of skipped iterations: {:3d} |".format(total["skipped iterations"])
        s += " number of nan iterations: {:3d} |".format(total["nan iterations"])
        total["advanced iterations"] = total["skipped iterations"] = 0
        total["nan iterations"] = 0
        lines.append(s)
    return lines


def _falling(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [(2 + 8 * math.exp(-4 * i / n)) * (1 + rng.uniform(-0.01, 0.01)) for i in range(n)]


def _write(path: Path, scheme: str, lines: list[str], exit_status: int | None = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    head = f"[quantpatch] llama32-1b / wikipedia / {scheme} (smoke): linear=x qk=x pv=x"
    tail = (
        [] if exit_status is None else [f"[quantpatch] training exited with status {exit_status}"]
    )
    path.write_text("\n".join([head, *lines, *tail]) + "\n")
    return path


def bf16_nan_from(n: int, first_nan: int, seed: int = 1) -> list[Step]:
    """bf16 (no loss scaler) run with ``--no-check-for-nan-in-loss-and-grad``: from
    ``first_nan`` on the loss is NaN, the gradient too, and the update is made anyway."""
    return [
        Step(v) if i < first_nan else Step(math.nan, grad_norm=math.nan)
        for i, v in enumerate(_falling(n, seed), 1)
    ]


def fp16_recovered(n: int, skips: dict[int, float], seed: int = 2) -> list[Step]:
    """fp16: the loss scaler skips the iterations of ``skips`` (iteration -> its loss, NaN
    or finite with overflowing gradients); the others train normally."""
    return [
        Step(skips[i], skipped=True, grad_norm=None) if i in skips else Step(v)
        for i, v in enumerate(_falling(n, seed), 1)
    ]


def _rows(run, root: Path) -> dict[str, dict[str, object]]:
    res = run("runs", root, "--json")
    assert res.code == 0, res
    return {r["scheme"]: r for r in json.loads(res.out)["runs"]}


def test_the_simulator_prints_what_core_v0_13_1_printed():
    """The real 3-line log of a core_v0.13.1 run (tests don't read ../shared: its first
    line copied here) has the simulator's shape, field for field."""
    real = (
        " [2026-11-22 11:25:39] iteration       10/      30 | consumed samples:           80 |"
        " elapsed time per iteration (ms): 96.9 | learning rate: 6.666667E-05 | global batch"
        " size:     8 | lm loss: 9.889642E+00 | loss scale: 1.0 | grad norm: 2.105 | number of"
        " skipped iterations:   0 | number of nan iterations:   0 |"
    )
    steps = [Step(9.889642, grad_norm=2.105)] * 10 + [Step(9.0)] * 20
    ours = _training_log(steps, 10)[0]
    assert ours == real


@pytest.mark.parametrize("log_interval", [1, 10])
def test_bf16_nan_by_omission_is_nan_and_diverged(run, tmp_path, log_interval):
    """NaN from iteration 171 of 200, no scaler, so nothing skipped and
    ``number of nan iterations`` 0 throughout; the ``lm loss`` field is left out and
    ``grad norm: nan`` printed. Once ``finished``, not diverged, its loss from 170."""
    lines = _training_log(bf16_nan_from(200, 171), log_interval)
    after = next(x for x in lines if "iteration      180/" in x)
    assert "lm loss" not in after and "grad norm: nan |" in after
    assert "number of skipped iterations:   0 | number of nan iterations:   0 |" in after
    _write(tmp_path / "q" / "x.log", "FA_mxfp4", lines)
    _write(tmp_path / "b" / "x.log", "bf16", _training_log(bf16_nan_from(200, 999), 10))
    rows = _rows(run, tmp_path)
    q = rows["FA_mxfp4"]
    assert q["status"] == "nan" and q["diverged"] is True
    assert q["iterations"] == 200 and q["last_finite_iteration"] == 170
    assert q["nan_iterations"] == 0 and q["skipped"] == 0
    losses = [float(x.split("lm loss: ")[1].split(" |")[0]) for x in lines if "lm loss" in x]
    w = max(1, min(20, math.ceil(len(losses) / 10)))
    assert q["loss"] == pytest.approx(sum(losses[-w:]) / w, rel=1e-12)
    assert rows["bf16"]["status"] == "finished" and rows["bf16"]["diverged"] is False
    table = run("runs", tmp_path)
    assert table.code == 0 and "nan" in table.out


def test_an_inf_loss_printed_then_left_out(run, tmp_path):
    """bf16: an Inf loss averages to Inf, which is above 0 and printed (``INF``, as
    ``{:.6E}`` writes it); the NaN it leads to is then left out."""
    steps = bf16_nan_from(100, 56)
    steps[54] = Step(math.inf, grad_norm=math.nan)
    lines = _training_log(steps, 5)
    assert any("lm loss: INF |" in x for x in lines)
    _write(tmp_path / "x.log", "FA_hifp8", lines)
    q = _rows(run, tmp_path)["FA_hifp8"]
    assert q["status"] == "nan" and q["diverged"] is True and q["last_finite_iteration"] == 50


def test_nan_from_the_first_line(tmp_path):
    """No line ever printed a loss: ``grad norm: nan`` alone says NaN."""
    p = _write(tmp_path / "x.log", "x", _training_log(bf16_nan_from(30, 1), 10))
    r = training_logs.parse_log(p)
    assert training_logs.nan_lines(r) == [0, 1, 2] and training_logs.nan_seen(r)
    assert training_logs.last_finite_iteration(r) is None


@pytest.mark.parametrize("log_interval", [1, 2, 10])
def test_fp16_skips_the_scaler_recovered_from_are_finished(run, tmp_path, log_interval):
    """The scaler skipped 4 iterations, 3 of them with a NaN loss, and training
    went on: ``finished``, 3 in ``nan``, 4 in ``skipped``, ``diverged`` judged on the loss
    (falling: no). With an interval of 1 or 2 whole intervals were skipped: their lines have
    no loss and no grad norm (nothing advanced; the step returned none)."""
    skips = {51: math.nan, 52: math.nan, 53: 6.1, 54: math.nan}
    lines = _training_log(fp16_recovered(200, skips), log_interval, loss_scale=32768.0)
    if log_interval <= 2:
        line = next(x for x in lines if "iteration       54/" in x)
        assert "lm loss" not in line and "grad norm" not in line
    _write(tmp_path / "x.log", "bf16_fp16", lines)
    q = _rows(run, tmp_path)["bf16_fp16"]
    assert q["status"] == "finished" and q["diverged"] is False
    assert q["nan_iterations"] == 3 and q["skipped"] == 4 and q["last_finite_iteration"] == 200


def test_fp16_nan_the_scaler_never_recovered_from(run, tmp_path):
    """The scaler skipping NaN iterations up to the end is a run that went NaN."""
    skips = {i: math.nan for i in range(181, 201)}
    _write(tmp_path / "x.log", "x", _training_log(fp16_recovered(200, skips), 10))
    q = _rows(run, tmp_path)["x"]
    assert q["status"] == "nan" and q["diverged"] is True
    assert q["nan_iterations"] == 20 and q["last_finite_iteration"] == 180
    # ... and overflowing gradients alone at the end (no NaN loss) are skips, not NaN
    skips = {i: 2.5 for i in range(181, 201)}
    _write(tmp_path / "x.log", "x", _training_log(fp16_recovered(200, skips), 10))
    q = _rows(run, tmp_path)["x"]
    assert q["status"] == "finished" and q["skipped"] == 20 and q["nan_iterations"] == 0


def test_a_line_lost_beside_a_skipped_interval(tmp_path):
    """A whole interval skipped is judged against the log interval (the smallest gap
    between logged iterations), so a line lost before it (cut, or garbage) does not make it
    look like an interval with advanced iterations whose loss was left out."""
    lines = _training_log(fp16_recovered(60, {i: math.nan for i in range(41, 51)}), 10)
    del lines[3]  # iteration 40's line
    p = _write(tmp_path / "x.log", "x", lines)
    r = training_logs.parse_log(p)
    assert list(r.iterations) == [10, 20, 30, 50, 60]
    assert training_logs.nan_lines(r) == [] and not training_logs.nan_seen(r)


@pytest.mark.parametrize("case", ["bf16-nan", "fp16-recovered", "fp16-unrecovered"])
def test_every_path_and_no_numpy_judge_alike(tmp_path, monkeypatch, case):
    """The template, by-name (numpy) and pattern readers, and the comparison without numpy,
    give the same NaN lines and the same row; read in small pieces too."""
    steps = {
        "bf16-nan": lambda: bf16_nan_from(300, 171),
        "fp16-recovered": lambda: fp16_recovered(300, {51: math.nan, 52: math.nan}),
        "fp16-unrecovered": lambda: fp16_recovered(300, {i: math.nan for i in range(250, 301)}),
    }[case]()
    p = _write(tmp_path / "x.log", "x", _training_log(steps, 2))
    want = training_logs.runs([tmp_path]).rows[0]
    lines = training_logs.nan_lines(training_logs.parse_log(p))
    with monkeypatch.context() as m:
        m.setattr(training_logs, "_template_columns", lambda data, run: False)
        assert training_logs.nan_lines(training_logs.parse_log(p)) == lines
        m.setattr(training_logs, "_numpy_columns", lambda data, run: False)
        assert training_logs.nan_lines(training_logs.parse_log(p)) == lines
    assert training_logs.nan_lines(training_logs.parse_log(p, 4096)) == lines
    monkeypatch.setattr(training_logs, "_numpy", lambda: None)
    assert training_logs.nan_lines(training_logs.parse_log(p)) == lines
    slow = training_logs.runs([tmp_path]).rows[0]
    for key in ("status", "diverged", "last_finite_iteration", "nan_iterations", "skipped"):
        assert slow[key] == want[key], key
    assert want["status"] == ("finished" if case == "fp16-recovered" else "nan")
    assert lines == (list(range(85, 150)) if case == "bf16-nan" else [])


def test_report_plot_and_sweep_line_say_nan_alike(run, tmp_path):
    """The consumers of the status: the HTML report marks the NaN run (diverged) and not
    the fp16 run the scaler recovered, ``report`` counts the NaN runs on the line naming
    the file (as ``sweep run`` / ``sweep report`` do), the loss plot's legend says it."""
    pytest.importorskip("matplotlib")
    from quantpatch.analysis import plots
    from quantpatch.cli.render_analysis import nan_note

    _write(tmp_path / "logs" / "a.log", "FA_mxfp4", _training_log(bf16_nan_from(60, 31), 10))
    skips = {21: math.nan, 22: math.nan}
    _write(tmp_path / "logs" / "b.log", "fp16", _training_log(fp16_recovered(60, skips), 1))
    res = run("report", "--runs", tmp_path / "logs", "--out", tmp_path / "r.html")
    assert res.code == 0, res
    assert "; 1 run went NaN (status nan in its runs table)" in res.out
    rows = (tmp_path / "r.html").read_text().split("<tr")
    bad = [r for r in rows if r.startswith(' class="bad"')]
    assert len(bad) == 1 and "FA_mxfp4" in bad[0] and ">nan<" in bad[0]
    assert any("fp16" in r and ">finished<" in r for r in rows)
    result = training_logs.runs([tmp_path / "logs"])
    status = {row["path"]: row["status"] for row in result.rows}
    labels = sorted(plots.run_label(r, status) for r in result.runs)
    assert labels == ["FA_mxfp4 (nan)", "fp16"]
    assert nan_note({"nan": 0}) == "" and nan_note({"nan": 2}).startswith("; 2 runs went NaN")
