"""``quantpatch runs``: Megatron training logs read by field name, compared with bf16.

Megatron's ``training_log`` prints one line per logging interval::

    [2026-11-22 11:25:39] iteration       10/      30 | consumed samples: 80 | elapsed time per
    iteration (ms): 96.9 | ... | lm loss: 9.889642E+00 | loss scale: 1.0 | grad norm: 2.105 |
    number of skipped iterations:   0 | number of nan iterations:   0 |

Releases add or drop fields (``--log-throughput`` adds ``throughput per GPU (TFLOP/s/GPU)``),
so fields are found by name, never by position. For speed (a sweep's logs hold millions of
lines), the usual log, whose iteration lines all carry the first one's fields, is read by the
``|`` bars of each line, found in one pass, with every line's field names checked at their
bars and only the values the comparison needs converted (the others on first use). Any other
log goes the general way: numpy locates every ``| <name>:`` and every ``] iteration`` at once and
assigns each value to the iteration on its line; a line missing a field gets NaN for it, a
line cut short (still being written, or two ranks interleaved) is counted and ignored. Without
numpy, or for logs whose iteration lines carry no timestamp, the field names of the first
iteration line become one pattern matched over the file in C, and lines with another set of
fields are parsed one by one. The launch scripts'
header (``[quantpatch] model / dataset / scheme (profile): linear=... qk=... pv=...``) and
closing line (``training exited with status N``) give the run's identity and status; a log
without them is keyed from its path where the run folder's name allows.
"""

from __future__ import annotations

import math
import os
import re
import statistics
from array import array
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpatch.errors import UserError

_ITERATION = re.compile(rb"iteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_HEADER = re.compile(
    rb"\[quantpatch\] (?P<model>\S+) / (?P<dataset>\S+) / (?P<scheme>\S+) \((?P<profile>\S+)\):"
    rb" linear=(?P<linear>\S+) qk=(?P<qk>\S+) pv=(?P<pv>\S+)"
)
_EXIT = re.compile(rb"\[quantpatch\] training exited with status (\d+)")
_CRASH = re.compile(rb"Traceback \(most recent call last\)|\b\w*Error: |Segmentation fault|Killed")
FIELDS = {  # Megatron's field name -> ours
    "lm loss": "loss",
    "elapsed time per iteration (ms)": "step_ms",
    "grad norm": "grad_norm",
    "loss scale": "loss_scale",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan",
    "throughput per GPU (TFLOP/s/GPU)": "tflops",
}
PROFILES = ("full", "fast", "smoke")


@dataclass
class Run:
    path: str
    model: str | None = None
    dataset: str | None = None
    scheme: str | None = None
    profile: str | None = None
    values: dict[str, str] = field(default_factory=dict)  # linear / qk / pv from the header
    # compact arrays: a run crosses a process boundary (--jobs) as bytes, not as objects
    iterations: Sequence[int] = field(default_factory=lambda: array("q"))
    series: dict[str, Sequence[float]] = field(default_factory=dict)  # ours -> one per line
    total_iterations: int | None = None
    exit_status: int | None = None
    crashed: bool = False
    garbage: int = 0  # iteration-like lines that could not be read (cut, interleaved)
    nonfinite_loss: int = 0  # intervals whose loss was printed as nan or inf
    duplicates: int = 0  # the same iteration printed again (several ranks)
    # columns nothing in the comparison reads (grad norm, loss scale, throughput), kept as
    # their fixed-width text (width, bytes) and converted on first use: converting a number
    # costs about 200 ns, a third of a log's parse
    lazy: dict[str, tuple[int, bytes]] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.exit_status == 0:
            return "finished"
        if self.exit_status is not None:
            return f"failed (exit {self.exit_status})"
        if self.crashed:
            return "crashed"
        return "no exit line (running, or killed)"

    def column(self, name: str) -> Sequence[float]:
        if name in self.lazy:
            import numpy as np

            width, text = self.lazy.pop(name)
            values = _to_float(np.frombuffer(text, f"S{width}"))
            self.series[name] = array("d", values.astype(np.float64).tobytes())
        return self.series.get(name, array("d", [math.nan]) * len(self.iterations))


def _number(raw: bytes) -> float:
    try:
        return float(raw)
    except ValueError:
        return math.nan  # 'nan', 'inf' parse; anything else is missing


def _fields_of(rest: bytes) -> dict[str, bytes]:
    out = {}
    for part in rest.split(b"|"):
        name, sep, value = part.partition(b":")
        if sep:
            out[name.strip().decode("ascii", "replace")] = value.strip()
    return out


def _template(names: list[str]) -> re.Pattern[bytes]:
    """One pattern for iteration lines whose fields are exactly ``names`` in this order."""
    parts = [rb"iteration\s+(\d+)\s*/\s*(\d+)\s*\|"]
    for n in names:
        parts.append(rb"\s*" + re.escape(n.encode()) + rb":\s*([^|\n]*?)\s*\|")
    return re.compile(b"".join(parts) + rb"[ \t\r]*$", re.M)


def parse_log(path: Path) -> Run:
    data = path.read_bytes()
    run = Run(path=str(path))
    head = _HEADER.search(data, 0, 65536)
    if head:
        g = {k: v.decode("utf-8", "replace") for k, v in head.groupdict().items()}
        run.model, run.dataset, run.scheme, run.profile = (
            g["model"], g["dataset"], g["scheme"], g["profile"],
        )  # fmt: skip
        run.values = {r: g[r] for r in ("linear", "qk", "pv")}
    ex = _EXIT.search(data, max(0, len(data) - 65536))
    if ex:
        run.exit_status = int(ex.group(1))
    if _template_columns(data, run) or _numpy_columns(data, run):
        _finish(data, run)
        return run
    rows: dict[int, dict[str, float]] = {}
    first = _ITERATION.search(data)
    if first is not None:
        eol = data.find(b"\n", first.end())
        names = [n for n in _fields_of(data[first.end() : eol if eol >= 0 else len(data)]) if n]
        template = _template(names)
        wanted = [(i, FIELDS[n]) for i, n in enumerate(names) if n in FIELDS]
        matched = 0
        for m in template.findall(data):
            matched += 1
            it = int(m[0])
            run.total_iterations = int(m[1])
            if it in rows:
                run.duplicates += 1
                continue
            rows[it] = {ours: _number(m[2 + i]) for i, ours in wanted}
        lines = data.count(b" iteration ") - data.count(b" per iteration (")
        if matched != lines:  # other field sets, cut or garbled lines
            _slow_path(data, rows, run)
    run.iterations = array("q", sorted(rows))
    run.nonfinite_loss = sum(
        1 for r in rows.values() if "loss" in r and not math.isfinite(r["loss"])
    )
    for ours in sorted({k for r in rows.values() for k in r}):
        run.series[ours] = array("d", [rows[i].get(ours, math.nan) for i in run.iterations])
    _finish(data, run)
    return run


def _finish(data: bytes, run: Run) -> None:
    last_iteration_at = data.rfind(b" iteration ")
    run.crashed = run.exit_status is None and bool(_CRASH.search(data, max(0, last_iteration_at)))


def _to_float(text: Any) -> Any:
    """Fixed-width number texts (NUL-padded) as floats; one by one where numpy refuses."""
    import numpy as np

    try:
        return text.astype(np.float64)
    except ValueError:  # garbage inside a field
        return np.array([_number(t) for t in text.tolist()], dtype=np.float64)


_EAGER = ("loss", "step_ms", "skipped", "nan")
"""The columns the comparison reads; the others are converted on first use."""


_SCRATCH: list[Any] = []


def _scratch(n: int) -> Any:
    """A boolean buffer of ``n`` elements, reused from log to log: a fresh 80 MB array per
    log costs its page faults again (a third of the time with two processes)."""
    import numpy as np

    if not _SCRATCH or len(_SCRATCH[0]) < n:
        _SCRATCH[:] = [np.empty(max(n, 1 << 20), np.bool_)]
    return _SCRATCH[0][:n]


def _template_columns(data: bytes, run: Run) -> bool:
    """The common case, fast: every iteration line has the first one's fields in its order.
    Each line's fields then sit between its own ``|`` bars, found with one pass over the
    file; every field's name is checked on every line, and only the values are converted.
    False (the general path) on anything else; a last line still being written is dropped
    and counted."""
    try:
        import numpy as np
        from numpy.lib.stride_tricks import sliding_window_view
    except ImportError:
        return False
    marker = b"] iteration "
    first = data.find(marker)
    eol = data.find(b"\n", first)
    if eol < 0:
        return False
    line = data[first:eol].rstrip(b"\r ")
    bars_in_line = line.count(b"|")
    names = [
        part.partition(b":")[0].strip() for part in line.split(b"|")[1:-1]
    ]  # the fields after "iteration N/ M"
    if not line.endswith(b"|") or len(names) != bars_in_line - 1 or not all(names):
        return False
    width = 24  # the widest value Megatron prints ("1.234567E+00", a step time) fits
    arr = np.frombuffer(data, np.uint8)
    if len(arr) < 2 * width:
        return False
    rows = sliding_window_view(arr, width)
    limit = len(arr) - width
    tail = np.concatenate([arr[limit:], np.zeros(2 * width, np.uint8)])

    def window(pos: Any) -> Any:
        """``width`` bytes from each position (NUL past the end of the file)."""
        out = rows[np.minimum(pos, limit)]
        late = np.flatnonzero(pos > limit)  # the last few bytes of the file: padded
        if len(late):
            out[late] = tail[(pos[late] - limit)[:, None] + np.arange(width)]
        return out

    def byte_at(pos: Any) -> Any:
        """The byte at each position (NUL past the end of the file)."""
        out = arr[np.minimum(pos, len(arr) - 1)]
        late = np.flatnonzero(pos > limit)
        if len(late):
            out[late] = tail[pos[late] - limit]
        return out

    hits = _scratch(len(arr))
    bars = np.flatnonzero(np.equal(arr, 124, out=hits))
    its = np.flatnonzero(np.equal(arr, marker[0], out=hits))
    its = its[(window(its)[:, : len(marker)] == np.frombuffer(marker, np.uint8)).all(axis=1)]
    # every iteration line carries the timestamp (" iteration " also names the step time)
    if len(its) != data.count(b" iteration ") - data.count(b" per iteration ("):
        return False
    k = len(names) + 1  # bars per line
    b0 = np.searchsorted(bars, its)
    ok = b0 + k <= len(bars)
    b0c = np.minimum(b0, len(bars) - k)
    ok &= np.append(b0[1:] - b0[:-1] >= k, True)  # the next line starts after this one
    last = bars[b0c + k - 1]
    after = window(last + 1)[:, :2]
    ok &= (after[:, 0] == 10) | ((after[:, 0] == 13) & (after[:, 1] == 10))
    for j, name in enumerate(names):  # every field's name on every line: its first and
        # middle letters where they belong and the colon right after it
        at = bars[b0c + j] + 2
        for offset, byte in ((0, name[0]), (len(name) // 2, name[len(name) // 2])):
            ok &= byte_at(at + offset) == byte
        ok &= byte_at(at + len(name)) == 58
    if not ok.all():
        if ok[:-1].all() and data.rfind(b"\n", int(its[-1])) < 0:  # a last line being written
            run.garbage = 1
        else:
            return False
    its, b0c = its[ok], b0c[ok]

    def texts(start: Any, end: Any) -> Any:
        win = window(start)
        win[np.arange(width) >= (end - start)[:, None]] = 0
        return np.ascontiguousarray(win).view(f"S{width}").ravel()

    stop = window(its + len(marker))
    slash = (stop == 47).argmax(axis=1)
    try:
        iteration = texts(its + len(marker), its + len(marker) + slash).astype(np.int64)
    except ValueError:
        return False
    order, first_of = np.unique(iteration, return_index=True)
    run.duplicates = len(iteration) - len(order)
    run.iterations = array("q", order.astype(np.int64).tobytes())
    last_line = int(its[first_of[-1]])
    m = _ITERATION.match(data, last_line + 2)
    run.total_iterations = int(m.group(2)) if m else None
    for j, name in enumerate(names):
        ours = FIELDS.get(name.decode("ascii", "replace"))
        if ours is None:
            continue
        start = bars[b0c + j] + 2 + len(name) + 1
        text = texts(start, bars[b0c + j + 1])[first_of]
        if ours in _EAGER:
            if ours in ("skipped", "nan") and (text == text[0]).all():  # the usual: all "0"
                values = np.full(len(text), _to_float(text[:1])[0])
            else:
                values = _to_float(text)
            if ours == "loss":
                run.nonfinite_loss = int((~np.isfinite(values)).sum())
            run.series[ours] = array("d", values.astype(np.float64).tobytes())
        else:
            run.lazy[ours] = (width, np.ascontiguousarray(text).tobytes())
    return True


def _numpy_columns(data: bytes, run: Run) -> bool:
    """Every iteration line's fields, vectorised; False when numpy is missing or the log's
    iteration lines are not all of the form ``] iteration N/ M |`` (then the regex path)."""
    try:
        import numpy as np
    except ImportError:
        return False
    marker = b"] iteration "
    n_lines = data.count(marker)
    # every iteration line carries the timestamp (" iteration " also names the step time)
    if n_lines == 0 or n_lines != data.count(b" iteration ") - data.count(b" per iteration ("):
        return False
    arr = np.frombuffer(data, np.uint8)
    pad = np.concatenate([arr, np.zeros(64, np.uint8)])

    def find(positions: Any, needle: bytes) -> Any:
        for j, byte in enumerate(needle):
            positions = positions[pad[positions + j] == byte]
        return positions

    def numbers(starts: Any, width: int = 24) -> Any:
        win = pad[np.minimum(starts, len(arr))[:, None] + np.arange(width)]
        stop = (win == 124) | (win == 10) | (win == 13) | (win == 47)
        stop[:, -1] = True
        win[np.arange(width) >= stop.argmax(axis=1)[:, None]] = 0
        text = np.ascontiguousarray(win).view(f"S{width}").ravel()
        try:
            return text.astype(np.float64)
        except ValueError:  # garbage inside a field: parse one by one
            return np.array([_number(t) for t in text.tolist()], dtype=np.float64)

    newlines = np.flatnonzero(arr == 10)
    its = find(np.flatnonzero(arr == marker[0]), marker)
    line_of_it = np.searchsorted(newlines, its)
    ends = np.append(newlines, len(arr))[line_of_it]  # each iteration line's end
    # a complete line ends with '|' (spaces and a carriage return may follow)
    last = np.full(len(its), 0, np.uint8)
    for back in (1, 2, 3):
        c = pad[np.maximum(ends - back, 0)]
        last = np.where((last == 0) & (c != 32) & (c != 13), c, last)
    whole = last == 124
    iteration = numbers(its + len(marker))
    slash = find(np.flatnonzero(arr == 47), b"/")
    total = numbers(slash[np.searchsorted(slash, its)] + 1) if len(slash) else iteration
    bars = np.flatnonzero(arr == 124)
    bars = bars[pad[bars + 1] == 32]  # "| " starts a field
    initial = pad[bars + 2]  # the first letter of each field's name
    columns: dict[str, Any] = {}
    for name, ours in FIELDS.items():
        key = name.encode() + b":"
        pos = bars[initial == key[0]]
        for j, byte in enumerate(key[1:], 3):
            pos = pos[pad[pos + j] == byte]
        if not len(pos):
            continue
        values = numbers(pos + len(key) + 2, 20)
        if ours == "loss":  # printed as nan/inf (a missing loss has no field on its line)
            run.nonfinite_loss = int((~np.isfinite(values)).sum())
        by_line = np.full(len(newlines) + 1, np.nan)
        by_line[np.searchsorted(newlines, pos)] = values
        columns[ours] = by_line[line_of_it]
    ok = whole & np.isfinite(iteration)
    run.garbage = int((~ok).sum())
    kept_its = iteration[ok].astype(np.int64)
    order, first = np.unique(kept_its, return_index=True)
    run.duplicates = int(ok.sum()) - len(order)
    run.iterations = array("q", order.astype(np.int64).tobytes())
    if len(first):
        run.total_iterations = int(total[ok][first[-1]])
    for ours, col in columns.items():
        run.series[ours] = array("d", col[ok][first].astype(np.float64).tobytes())
    return True


def _slow_path(data: bytes, rows: dict[int, dict[str, float]], run: Run) -> None:
    """Iteration lines the template did not take, read field by field."""
    seen = set(rows)
    for line in data.splitlines():
        m = _ITERATION.search(line)
        if m is None:
            continue
        it = int(m.group(1))
        if it in seen:
            continue
        raw = _fields_of(line[m.end() :])
        if not line.rstrip().endswith(b"|") or not raw:
            run.garbage += 1  # cut short (still being written) or interleaved
            continue
        rows[it] = {FIELDS[n]: _number(v) for n, v in raw.items() if n in FIELDS}
        run.total_iterations = int(m.group(2))
        seen.add(it)


def key_from_path(run: Run, models: Iterable[str], datasets: Iterable[str]) -> None:
    """Fill the identity of a run without a header from its folder name
    ``<model>_<dataset>_<scheme>_<profile>`` (the launch scripts' ``RUN_NAME``)."""
    if run.model:
        return
    for part in reversed(Path(run.path).parts[:-1]):
        for model in sorted(models, key=len, reverse=True):
            for dataset in datasets:
                prefix = f"{model}_{dataset}_"
                if not part.startswith(prefix):
                    continue
                rest = part[len(prefix) :]
                scheme, _, profile = rest.rpartition("_")
                if scheme and profile in PROFILES:
                    run.model, run.dataset, run.scheme, run.profile = (
                        model,
                        dataset,
                        scheme,
                        profile,
                    )
                    return


def find_logs(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.log") if q.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise UserError(f"{p}: no such file or directory.")
    return out


def default_paths() -> list[Path]:
    root = os.environ.get("OUTPUT_ROOT") or str(Path.home() / "quantpatch-runs")
    return [Path(root)]


# -- comparison ---------------------------------------------------------------------------------


def _numpy() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np


def _vector(values: Sequence[float] | Sequence[int], dtype: str = "float64") -> Any:
    np = _numpy()
    if isinstance(values, array):
        return np.frombuffer(values, dtype)
    return np.asarray(values, dtype)


def _finite(values: Sequence[float]) -> Any:
    """The finite values, in order (a numpy array when numpy is there: a run holds a
    quarter of a million of them, and a list comprehension over them costs 50 ms)."""
    np = _numpy()
    if np is None:
        return [v for v in values if math.isfinite(v)]
    vec = _vector(values)
    return vec[np.isfinite(vec)]


def _window(n: int) -> int:
    return max(1, min(20, math.ceil(n / 10)))


def last_window_loss(run: Run) -> float:
    losses = _finite(run.column("loss"))
    return statistics.fmean(losses[-_window(len(losses)) :]) if len(losses) else math.nan


def step_time(run: Run) -> float:
    """Median step time, the first tenth of the intervals (warm-up) left out."""
    times = _finite(run.column("step_ms"))
    if not len(times):
        return math.nan
    np = _numpy()
    rest = times[len(times) // 10 :]
    return float(np.median(rest)) if np is not None else statistics.median(rest)


def diverged(run: Run) -> bool:
    """A loss printed as NaN or Inf, or the last window's mean loss 5 % above the best
    window's."""
    if run.nonfinite_loss:
        return True
    finite = _finite(run.column("loss"))
    w = _window(len(finite))
    if len(finite) < 2 * w:
        return False
    np = _numpy()
    if np is not None:
        means = finite[: len(finite) // w * w].reshape(-1, w).mean(axis=1)
        return bool(means[-1] > 1.05 * means.min())
    means = [statistics.fmean(finite[i : i + w]) for i in range(0, len(finite) - w + 1, w)]
    return bool(means[-1] > 1.05 * min(means))


def matched_delta(run: Run, ref: Run) -> tuple[float, float, int]:
    """(mean loss difference, relative difference, iterations compared) over the last window
    of the iterations both runs logged with a finite loss."""
    np = _numpy()
    if np is not None:  # iterations are sorted and unique: intersect them
        la, lb = _vector(run.column("loss")), _vector(ref.column("loss"))
        _, xa, xb = np.intersect1d(
            _vector(run.iterations, "int64"),
            _vector(ref.iterations, "int64"),
            assume_unique=True,
            return_indices=True,
        )
        keep = np.isfinite(la[xa]) & np.isfinite(lb[xb])
        va, vb = la[xa[keep]], lb[xb[keep]]
    else:
        a = dict(zip(run.iterations, run.column("loss"), strict=True))
        b = dict(zip(ref.iterations, ref.column("loss"), strict=True))
        common = sorted(
            i for i in a.keys() & b.keys() if math.isfinite(a[i]) and math.isfinite(b[i])
        )
        va, vb = [a[i] for i in common], [b[i] for i in common]
    if not len(va):
        return math.nan, math.nan, 0
    w = _window(len(va))
    ma, mb = statistics.fmean(va[-w:]), statistics.fmean(vb[-w:])
    return ma - mb, (ma - mb) / mb if mb else math.nan, w


@dataclass
class RunsResult:
    runs: list[Run]
    rows: list[dict[str, Any]]
    logs: int


def _parse_many(paths: list[Path], jobs: int) -> list[Run]:
    if jobs <= 1 or len(paths) < 2:
        return [parse_log(p) for p in paths]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(parse_log, paths, chunksize=1))


def runs(
    paths: list[Path] | None = None,
    jobs: int = 1,
    names: tuple[Iterable[str], Iterable[str]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RunsResult:
    logs = find_logs(paths or default_paths())
    parsed = _parse_many(logs, jobs)
    if progress:
        progress(len(logs), len(logs))
    if names:
        for r in parsed:
            key_from_path(r, *names)
    ref: dict[tuple[Any, ...], Run] = {}
    for r in parsed:
        if r.scheme == "bf16" and r.iterations:
            k = (r.model, r.dataset, r.profile)
            if k not in ref or r.iterations[-1] > ref[k].iterations[-1]:
                ref[k] = r
    rows = []
    for r in parsed:
        base = ref.get((r.model, r.dataset, r.profile))
        delta, rel, n = matched_delta(r, base) if base else (math.nan, math.nan, 0)
        st, base_st = step_time(r), step_time(base) if base else math.nan
        rows.append(
            {
                "model": r.model,
                "dataset": r.dataset,
                "scheme": r.scheme,
                "profile": r.profile,
                "iterations": r.iterations[-1] if r.iterations else 0,
                "of": r.total_iterations,
                "loss": last_window_loss(r),
                "loss_delta_vs_bf16": delta,
                "rel_delta_vs_bf16": rel,
                "matched_iterations": n,
                "step_ms": st,
                "step_vs_bf16": st / base_st if base_st and math.isfinite(base_st) else math.nan,
                "skipped": int(math.fsum(_finite(r.column("skipped")))),
                "nan_iterations": int(math.fsum(_finite(r.column("nan")))),
                "diverged": diverged(r),
                "status": r.status,
                "unreadable_lines": r.garbage,
                "path": r.path,
            }
        )
    rows.sort(key=lambda x: tuple(str(x[k]) for k in ("model", "dataset", "profile", "scheme")))
    return RunsResult(parsed, rows, len(logs))
