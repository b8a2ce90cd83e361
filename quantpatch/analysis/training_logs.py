"""``quantpatch runs``: Megatron training logs read by field name, compared with bf16.

Megatron's ``training_log`` prints one line per logging interval::

    [2026-11-22 11:25:39] iteration       10/      30 | consumed samples: 80 | elapsed time per
    iteration (ms): 96.9 | ... | lm loss: 9.889642E+00 | loss scale: 1.0 | grad norm: 2.105 |
    number of skipped iterations:   0 | number of nan iterations:   0 |

Releases add or drop fields (``--log-throughput`` adds ``throughput per GPU (TFLOP/s/GPU)``),
so fields are found by name, never by position. An iteration line is one with
``iteration N/ M |``; the lines between them (checkpoints saved, validation, warnings) are
passed over. For speed (a sweep's logs hold millions of lines), a usual log, whose iteration
lines all carry the first one's fields, is read in blocks of whole lines by the ``|`` bars of
each line, with every line's field names checked at their bars and each value converted a
column at a time (``log_columns``). Any other log goes the general way: numpy locates every
``| <name>:`` at once and assigns each value to the iteration on its line; a line missing a
field gets NaN for it, a line cut short (still being written, or two ranks interleaved) is
counted and ignored. Without numpy, the field names of the first iteration line become one
pattern matched over the file in C, and lines with another set of fields are parsed one by
one. The launch scripts'
header (``[quantpatch] model / dataset / scheme (profile): linear=... qk=... pv=...``) and
closing line (``training exited with status N``) give the run's identity and status; a log
without them is keyed from its path where the run folder's name allows. The attention path a run
took is the runtime's ``[quantpatch] attention path: flash|stock`` lines (``quantpatch_ops``,
printed once per path), else what its script asked for (the header's ``[quantpatch] attention:
QUANTPATCH_FLASH=... QUANTPATCH_FLASH_BF16=...``), marked ``(asked)``.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import stat
import statistics
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from quantpatch.analysis.log_lines import ITERATION, number
from quantpatch.base.errors import UserError

_HEADER = re.compile(
    rb"\[quantpatch\] (?P<model>\S+) / (?P<dataset>\S+) / (?P<scheme>\S+) \((?P<profile>\S+)\):"
    rb" linear=(?P<linear>\S+) qk=(?P<qk>\S+) pv=(?P<pv>\S+)"
)
_EXIT = re.compile(rb"\[quantpatch\] training exited with status (\d+)")
_ASKED = re.compile(
    rb"\[quantpatch\] attention: QUANTPATCH_FLASH=(\S*) QUANTPATCH_FLASH_BF16=(\S*)"
)
_SEED = re.compile(rb"\[quantpatch\] extra arguments:[^\n]*? --seed[ =]([0-9]{1,18})\b")
"""A run's ``--seed`` (``sweep run --seeds``), from the script's line of extra arguments."""
_PATH_LINE = b"[quantpatch] attention path: "  # quantpatch_ops.ATTENTION_PATH_LINE
_VALIDATION = re.compile(
    rb" validation loss at iteration (\d{1,18})( on [a-z]+ set)? \|(?P<rest>[^\n]*)"
)
"""Megatron's ``evaluate_and_print_results``: `` validation loss at iteration N | lm loss
value: X | lm loss PPL: Y |`` (at the end of training ``... on validation set`` and ``on test
set``; the test set's is not validation and is passed over)."""
ATTENTION_PATHS = ("flash", "stock")
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
    # columns that print one value throughout (loss scale, skip and NaN counts, usually):
    # one number crosses the process boundary (--jobs), not a quarter of a million
    constant: dict[str, float] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)  # the attention paths the runtime said
    asked: tuple[str, str] | None = None  # the script's QUANTPATCH_FLASH, QUANTPATCH_FLASH_BF16
    seed: int | None = None  # the --seed its script was given, where it was
    # (iteration, lm loss, perplexity) of each validation Megatron printed, in log order
    validation: list[tuple[int, float, float]] = field(default_factory=list)

    @property
    def attention(self) -> str | None:
        """The attention path the run took (``flash``, ``stock``, ``flash+stock``), else the
        one its script asked for, marked ``(asked)``; None where the log says neither."""
        if self.paths:
            return "+".join(self.paths)
        if self.asked is None:
            return None
        flash, bf16 = self.asked
        takes = flash != "0" and (bf16 == "1" or self.values.get("qk", "bf16") != "bf16")
        return f"{'flash' if takes else 'stock'} (asked)"

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
        if name in self.constant:
            return array("d", [self.constant[name]]) * len(self.iterations)
        if name not in self.series:  # not printed by this release: NaN throughout
            return array("d", [math.nan]) * len(self.iterations)
        return self.series[name]


def _compact(values: Any, code: str) -> array[Any]:
    """A numpy vector as an ``array`` of ``code`` ('d', 'q'), copied once."""
    import numpy as np

    out = array(code)
    out.frombytes(np.ascontiguousarray(values, out.typecode).data.cast("B"))
    return out


def _doubles(values: Any) -> array[float]:
    return _compact(values, "d")


def _integers(values: Any) -> array[int]:
    return _compact(values, "q")


def _fields_of(rest: bytes) -> dict[str, bytes]:
    """The ``| name: value`` fields of a line, written as Megatron writes them (one space
    after the bar, the colon right after the name): what the numpy paths read too."""
    out = {}
    for part in rest.split(b"|"):
        name, sep, value = part[1:].partition(b":")
        if part[:1] == b" " and sep and name and name == name.strip():
            out[name.decode("ascii", "replace")] = value.strip()
    return out


def _template(names: list[str]) -> re.Pattern[bytes]:
    """One pattern for iteration lines whose fields are exactly ``names`` in this order."""
    parts = [ITERATION.pattern]
    for n in names:  # one way to match each field: nothing to backtrack into
        parts.append(rb" " + re.escape(n.encode()) + rb":([^|\n]*)\|")
    return re.compile(b"".join(parts) + rb"[ \t\r]*$", re.M)


_CHUNK = 64 << 20
"""A log is read this many bytes at a time, cut at its last newline (whole lines): memory
holds one chunk and the columns read so far, whatever the file's size. A line longer than a
chunk is no Megatron line: it is skipped up to its newline and counted unreadable."""
_EDGE = 65536  # the header is looked for in the first, the exit line in the last, bytes
_TAIL = 1 << 20  # what follows the last iteration line, kept to look for a crash


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (a symbolic link to one counts);
    ``ValueError`` naming what it is otherwise. Opened without blocking and checked on the
    open descriptor, so that a FIFO or a device never blocks or streams forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"cannot be opened ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"not a regular file ({kind_of(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def kind_of(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):  # fmt: skip
        if test(mode):
            return name
    return "a special file"


def _whole_lines(fh: BinaryIO, run: Run, chunk: int) -> Iterator[bytes]:
    """The file's bytes in pieces of whole lines (each ends with a newline), then what
    follows the last newline (a line still being written), which may be empty."""
    carry = b""
    skipping = False  # inside a line longer than a chunk: dropped up to its newline
    while True:
        block = fh.read(chunk)
        if not block:
            break
        if skipping:
            nl = block.find(b"\n")
            if nl < 0:
                continue
            block, skipping = block[nl + 1 :], False
        data = carry + block if carry else block
        cut = data.rfind(b"\n") + 1
        if cut:
            yield data[:cut]
        carry = data[cut:]
        if len(carry) >= chunk:
            run.garbage += 1
            carry, skipping = b"", True
    yield b"" if skipping else carry


def parse_log(path: Path, chunk: int = 0) -> Run:
    """One log, read in pieces of whole lines (``chunk`` bytes, ``_CHUNK`` by default), each
    parsed as it is read; raises ``ValueError`` when it is no regular file or cannot be read."""
    run = Run(path=str(path))
    parts: list[Run] = []
    head = last = b""  # the first bytes (the header), the last bytes (the exit line)
    since_iteration = b""  # what follows the last iteration line, where a crash shows
    try:
        with open_regular(path) as fh:
            for piece in _whole_lines(fh, run, chunk or _CHUNK):
                if piece.endswith(b"\n"):
                    part = Run(path=run.path)
                    if not (_template_columns(piece, part) or _numpy_columns(piece, part)):
                        _pattern_path(piece, part)
                    parts.append(part)
                elif ITERATION.search(piece):  # a last line still being written: not read
                    run.garbage += 1
                _said_paths(piece, run.paths)
                _validations(piece, run.validation)
                if len(head) < _EDGE:
                    head += piece[: _EDGE - len(head)]
                last = (last + piece[-_EDGE:])[-_EDGE:]
                at = piece.rfind(b" iteration ")
                tail = piece[at:] if at >= 0 else since_iteration + piece[-_TAIL:]
                since_iteration = tail[-_TAIL:]
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or exc})") from None
    found = _HEADER.search(head)
    if found:
        g = {k: v.decode("utf-8", "replace") for k, v in found.groupdict().items()}
        run.model, run.dataset, run.scheme, run.profile = (
            g["model"], g["dataset"], g["scheme"], g["profile"],
        )  # fmt: skip
        run.values = {r: g[r] for r in ("linear", "qk", "pv")}
    seed = _SEED.search(head)
    if seed:
        run.seed = int(seed.group(1))
    asked = _ASKED.search(head)
    if asked:
        run.asked = (
            asked.group(1).decode("ascii", "replace"),
            asked.group(2).decode("ascii", "replace"),
        )
    ex = _EXIT.search(last)
    if ex:  # a status of more digits than any process exits with is no exit line
        run.exit_status = int(ex.group(1)) if len(ex.group(1)) <= 9 else None
    _merge(run, parts)
    run.crashed = run.exit_status is None and bool(_CRASH.search(since_iteration))
    return run


def _validations(piece: bytes, out: list[tuple[int, float, float]]) -> None:
    """The validation losses (``lm loss value``) and perplexities (``lm loss PPL``) of the
    validation lines in ``piece``, added to ``out``; a test-set line is not validation."""
    if b"validation loss at" not in piece:
        return
    for m in _VALIDATION.finditer(piece):
        if m.group(2) is not None and m.group(2) != b" on validation set":
            continue
        fields = _fields_of(m.group("rest"))
        loss = fields.get("lm loss value")
        if loss is None:
            continue
        ppl = fields.get("lm loss PPL")
        out.append((int(m.group(1)), number(loss), number(ppl) if ppl is not None else math.nan))


def _said_paths(piece: bytes, paths: list[str]) -> None:
    """The attention paths the runtime's lines in ``piece`` name, added to ``paths`` once."""
    at = piece.find(_PATH_LINE)
    while at >= 0:
        at += len(_PATH_LINE)
        word = piece[at : at + 5].decode("ascii", "replace")
        if word in ATTENTION_PATHS and word not in paths:
            paths.append(word)
        at = piece.find(_PATH_LINE, at)


def _merge(run: Run, parts: list[Run]) -> None:
    """The parts of a log read piece by piece, as one run: the first line of an iteration
    printed in several pieces is kept (as within a piece), the counts added up. (A loss
    printed as NaN on a line dropped as a repeat from another piece is still counted.)"""
    for p in parts:
        run.garbage += p.garbage
        run.duplicates += p.duplicates
        run.nonfinite_loss += p.nonfinite_loss
    parts = [p for p in parts if len(p.iterations)]
    if len(parts) <= 1:
        if parts:
            p = parts[0]
            run.iterations, run.series, run.constant = p.iterations, p.series, p.constant
            run.total_iterations = p.total_iterations
        return
    top = max(p.iterations[-1] for p in parts)
    run.total_iterations = next(p for p in parts if p.iterations[-1] == top).total_iterations
    names = sorted({n for p in parts for n in (*p.series, *p.constant)})
    for n in names:  # one value throughout every part: one value still, never expanded
        values = {_bits(p.constant[n]) if n in p.constant else None for p in parts}
        if len(values) == 1 and None not in values:
            run.constant[n] = parts[0].constant[n]
    its = array("q")
    for p in parts:
        its.extend(p.iterations)
    columns: dict[str, array[float]] = {n: array("d") for n in names if n not in run.constant}
    for p in parts:
        for n, c in columns.items():
            c.extend(p.column(n))
    keep = _first_of_each(its)
    if keep is not None:
        run.duplicates += len(its) - len(keep)
        its = array("q", [its[i] for i in keep])
        columns = {n: array("d", [c[i] for i in keep]) for n, c in columns.items()}
    run.iterations = its
    run.series = dict(columns)


def _bits(v: float) -> bytes:
    return array("d", [v]).tobytes()


def _first_of_each(its: array[int]) -> list[int] | None:
    """The positions of each iteration's first occurrence, in iteration order; None when
    ``its`` is already strictly increasing."""
    np = _numpy()
    if np is not None:
        v = np.frombuffer(its, np.int64)
        if len(v) < 2 or bool((v[1:] > v[:-1]).all()):
            return None
        return [int(i) for i in np.unique(v, return_index=True)[1]]
    if all(b > a for a, b in itertools.pairwise(its)):
        return None
    first: dict[int, int] = {}
    for i, it in enumerate(its):
        first.setdefault(it, i)
    return [first[it] for it in sorted(first)]


def _pattern_path(data: bytes, run: Run) -> None:
    """Without numpy: the field names of the first iteration line become one pattern matched
    over the file in C; if any iteration line is not of that form, every line is read by
    name instead, in file order."""
    rows: dict[int, dict[str, float]] = {}
    totals: dict[int, int] = {}
    first = ITERATION.search(data)
    if first is not None:
        eol = data.find(b"\n", first.end())
        names = [n for n in _fields_of(data[first.end() : eol if eol >= 0 else len(data)]) if n]
        wanted = [(i, FIELDS[n]) for i, n in enumerate(names) if n in FIELDS]
        found = _template(names).findall(data)
        if len(found) == sum(1 for _ in ITERATION.finditer(data)):
            for m in found:
                it = int(m[0])
                if it in rows:
                    run.duplicates += 1
                    continue
                rows[it] = {ours: number(m[2 + i]) for i, ours in wanted}
                totals[it] = int(m[1])
        else:  # other field sets, cut or garbled lines
            _by_name(data, rows, totals, run)
    run.iterations = array("q", sorted(rows))
    if rows:
        run.total_iterations = totals[max(rows)]
    run.nonfinite_loss = sum(
        1 for r in rows.values() if "loss" in r and not math.isfinite(r["loss"])
    )
    for ours in sorted({k for r in rows.values() for k in r}):
        run.series[ours] = array("d", [rows[i].get(ours, math.nan) for i in run.iterations])


_FIELD_NAMES = [name.encode() for name in FIELDS]

_BLOCK = 8 << 20
"""The template path reads a log in blocks of this many bytes (whole lines): every check
and every value is a pass over the block's lines, and a block's lines stay in the processor's
cache from one pass to the next (a third faster than passes over the whole file)."""


@dataclass
class _Block:
    iteration: Any
    total: Any
    values: dict[str, Any]


def _template_columns(data: bytes, run: Run) -> bool:
    """The common case, fast: every iteration line has the first one's fields in its order.
    Each line's fields then sit between its own ``|`` bars, found with one pass over the
    file; every field's name is checked on every line, and each value the run keeps is
    converted column by column. Lines that are not iteration lines (checkpoints saved,
    validation, warnings) are passed over. False (the general path) on anything else.
    ``data`` ends with a newline (``parse_log`` holds back a line still being written)."""
    try:
        import numpy as np

        from quantpatch.analysis import log_columns
    except ImportError:
        return False
    first = ITERATION.search(data)
    if first is None:
        return False
    eol = data.find(b"\n", first.end())
    line = data[first.end() - 1 : eol if eol >= 0 else len(data)].rstrip(b"\r ")
    # every part between the bars a field, as Megatron writes them (what the other paths read)
    names = [name.encode() for name in _fields_of(line)]
    if eol < 0 or not line.endswith(b"|") or line.count(b"|") != len(names) + 1:
        return False
    blocks: list[_Block] = []
    start = 0
    while start < len(data):
        end = data.find(b"\n", start + _BLOCK) + 1 or len(data)
        block = _template_block(log_columns, data[start:end], names)
        if block is None:
            return False
        blocks.append(block)
        start = end
    iteration = np.concatenate([b.iteration for b in blocks])
    if not len(iteration):
        return False
    if len(iteration) < 2 or (iteration[1:] > iteration[:-1]).all():  # the usual: in order
        first_of = None
    else:  # printed twice (several ranks), or a restart: each iteration's first line
        first_of = np.unique(iteration, return_index=True)[1]
        run.duplicates = len(iteration) - len(first_of)
        iteration = iteration[first_of]
    run.iterations = _integers(iteration)
    total = np.concatenate([b.total for b in blocks])
    run.total_iterations = int(total[-1] if first_of is None else total[first_of[-1]])
    for ours in blocks[0].values:
        values = np.concatenate([b.values[ours] for b in blocks])
        if first_of is not None:
            values = values[first_of]
        if ours == "loss":
            run.nonfinite_loss = int((~np.isfinite(values)).sum())
        bits = values.view(np.int64)
        if ours not in ("loss", "step_ms") and (bits == bits[0]).all():
            run.constant[ours] = float(values[0])
        else:
            run.series[ours] = _doubles(values)
    return True


def _template_block(log_columns: Any, data: bytes, names: list[bytes]) -> _Block | None:
    """One block of whole lines through the template path; None where a line breaks it."""
    import numpy as np

    k = len(names) + 1  # bars per line, the first (after "iteration N/ M") included
    text = log_columns.LogBytes(data)
    text.scan(47, 124, 10)  # '/' (iteration lines), '|' and newlines: one pass for all
    lines = log_columns.iteration_lines(text)
    n = len(lines.first_bar)
    wanted = [(j, name, FIELDS[name.decode("ascii", "replace")]) for j, name in enumerate(names)
              if name.decode("ascii", "replace") in FIELDS]  # fmt: skip
    if not n:
        empty = np.zeros(0)
        return _Block(lines.iteration, lines.total, {o: empty for _, _, o in wanted})
    bars, newlines = text.positions(124), text.positions(10)
    if len(bars) == n * k and (bars[::k] == lines.first_bar).all():
        at = bars.reshape(n, k).T  # the usual: no other line has a bar
        ok = np.ones(n, np.bool_)
    else:  # validation lines, garbage: each line's bars from its first
        b0 = np.searchsorted(bars, lines.first_bar)
        ok = b0 + k <= len(bars)
        ok &= np.append(b0[1:] - b0[:-1] >= k, True)  # the next line starts after this one
        bars = np.append(bars, np.full(k, len(data)))  # past the end: a line cut short
        at = bars[np.arange(k)[:, None] + b0]
    # the line ends right after its last bar, and not before it (a line cut by another
    # process's output would take the next line's bars for its own)
    ends = newlines[np.minimum(np.searchsorted(newlines, lines.first_bar), len(newlines) - 1)]
    ok &= (ends == at[-1] + 1) | ((ends == at[-1] + 2) & (text.at(at[-1] + 1) == 13))
    # every field's name on every line, where the first line has it: whole for the fields
    # read, the last letter and the colon after it for the others (a line of another
    # release has other names, of other lengths)
    read = {j for j, _, _ in wanted}
    for j, name in enumerate(names):
        # whole where a field that is read could stand in its place (a name of its length)
        whole = j in read or any(len(f) == len(name) for f in _FIELD_NAMES)
        probe = b" " + name + b":" if whole else name[-1:] + b":"
        ok &= text.matches(at[j] + (len(name) + 3 - len(probe)), probe)
    if not ok.all():
        return None
    values = {}
    for j, name, ours in wanted:
        end = at[j + 1] - (text.at(at[j + 1] - 1) == 32)  # "value |"
        win = text.right_aligned(at[j] + 2 + len(name) + 1, end)
        if (win == win[:, :1]).all():  # the same text on every line: read it once
            values[ours] = np.full(win.shape[1], log_columns.parse_numbers(win[:, :1])[0])
        else:
            values[ours] = log_columns.parse_numbers(win)
    return _Block(lines.iteration, lines.total, values)


def _numpy_columns(data: bytes, run: Run) -> bool:
    """Every iteration line's fields, by name, vectorised: the general path (lines with
    other field sets, or garbled); False when numpy is missing."""
    try:
        import numpy as np

        from quantpatch.analysis import log_columns
    except ImportError:
        return False
    text = log_columns.LogBytes(data)
    arr = text.arr
    lines = log_columns.iteration_lines(text)
    if not len(lines.first_bar):
        return False
    newlines = text.positions(10)
    line_of_it = np.searchsorted(newlines, lines.first_bar)
    ends = np.append(newlines, len(arr))[line_of_it]  # each iteration line's end
    # a whole line ends with '|' (blanks may follow), and no other iteration line starts on
    # it after this one (two ranks' output run together)
    tail = text.windows(ends - 16, 16)[::-1]
    kept = (tail != 32) & (tail != 9) & (tail != 13)
    whole = tail[kept.argmax(axis=0), np.arange(tail.shape[1])] == 124
    whole &= np.append(line_of_it[1:] != line_of_it[:-1], True)
    bars = text.positions(124)
    next_bar = np.append(bars[1:], len(arr))
    starts_field = text.at(bars + 1) == 32  # "| " starts a field
    bars, next_bar = bars[starts_field], next_bar[starts_field]
    initial = text.at(bars + 2)  # the first letter of each field's name
    columns: dict[str, Any] = {}
    for name, ours in FIELDS.items():
        key = name.encode() + b":"
        pick = np.flatnonzero(initial == key[0])
        key_bytes = np.frombuffer(key, np.uint8)[:, None]
        pick = pick[(text.windows(bars[pick] + 2, len(key)) == key_bytes).all(axis=0)]
        if not len(pick):
            continue
        pos = bars[pick]
        end = next_bar[pick]
        end -= text.at(end - 1) == 32
        values = log_columns.parse_numbers(text.right_aligned(pos + 2 + len(key), end))
        # a field belongs to the iteration line before it, if that line is its line
        owner = np.searchsorted(lines.first_bar, pos, side="right") - 1
        mine = owner >= 0
        mine &= line_of_it[np.maximum(owner, 0)] == np.searchsorted(newlines, pos)
        col = np.full(len(lines.first_bar), np.nan)
        has = np.zeros(len(lines.first_bar), np.bool_)
        col[owner[mine]], has[owner[mine]] = values[mine], True
        columns[ours] = (col, has)
    ok = whole
    run.garbage += int((~ok).sum())
    kept_its = lines.iteration[ok]
    order, first = np.unique(kept_its, return_index=True)
    run.duplicates = int(ok.sum()) - len(order)
    run.iterations = _integers(order)
    if len(first):
        run.total_iterations = int(lines.total[ok][first[-1]])
    for ours, (col, has) in columns.items():
        values = col[ok][first]
        if ours == "loss":  # printed as nan/inf (a missing loss has no field on its line)
            run.nonfinite_loss = int((~np.isfinite(values) & has[ok][first]).sum())
        run.series[ours] = _doubles(values)
    return True


def _by_name(
    data: bytes, rows: dict[int, dict[str, float]], totals: dict[int, int], run: Run
) -> None:
    """Every iteration line read field by field, in file order (the first of a repeated
    iteration kept). A line is whole when it ends with a bar and no other iteration line
    starts on it after it (two ranks' output run together)."""
    for line in data.split(b"\n"):
        matches = list(ITERATION.finditer(line))
        for k, m in enumerate(matches):
            if k + 1 < len(matches) or not line.rstrip(b" \t\r").endswith(b"|"):
                run.garbage += 1  # cut short, or interleaved
                continue
            it = int(m.group(1))
            if it in rows:
                run.duplicates += 1
                continue
            raw = _fields_of(line[m.end() :])
            rows[it] = {FIELDS[n]: number(v) for n, v in raw.items() if n in FIELDS}
            totals[it] = int(m.group(2))


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
    """The logs named and the ``*.log`` under the directories named. Whatever is not a
    directory is kept: ``parse_log`` opens only regular files, and a FIFO, a device or a
    dangling link is reported as skipped, with what it is."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.log") if not q.is_dir())
        elif p.exists() or p.is_symlink():
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


def _count(values: Sequence[float]) -> int:
    """The sum of a column of counts (skipped or NaN iterations), NaN (not printed) left out;
    exact whatever was printed (a count of 1e308 is summed as an integer, never overflows)."""
    finite = _finite(values)
    np = _numpy()
    if np is not None:
        total = float(finite.sum()) if len(finite) else 0.0
        if math.isfinite(total) and abs(total) < 2**53:
            return int(total)
        finite = finite.tolist()
    return sum(int(v) for v in finite)


def _mean(values: Any) -> float:
    """The mean of finite values; inf (not ``OverflowError``) where their sum is past the
    largest double (losses printed as 1e308)."""
    try:
        return statistics.fmean(values)
    except OverflowError:
        n = len(values)
        return float(sum(v / n for v in values))


def _window(n: int) -> int:
    return max(1, min(20, math.ceil(n / 10)))


def last_window_loss(run: Run) -> float:
    losses = _finite(run.column("loss"))
    return _mean(losses[-_window(len(losses)) :]) if len(losses) else math.nan


def last_finite_iteration(run: Run) -> int | None:
    """The last iteration whose loss was printed and finite: the loss reported is from before
    it when the run went on to NaN (or stopped printing its loss)."""
    for it, v in zip(reversed(run.iterations), reversed(run.column("loss")), strict=True):
        if math.isfinite(v):
            return int(it)
    return None


def _intervals(its: Any) -> Any:
    """How many iterations each logged line covers: Megatron prints at every multiple of
    ``--log-interval`` (the smallest gap between logged iterations), averaging over the
    iterations since its last line; the first line, and one after a gap (a line lost or
    cut), cover at most one interval."""
    np = _numpy()
    if not len(its):
        return np.zeros(0, np.int64)
    gaps = np.diff(its)
    every = int(gaps.min()) if len(gaps) else int(its[0])
    return np.minimum(np.concatenate([its[:1], gaps]), every)


def nan_lines(run: Run) -> list[int]:
    """The positions (in ``run.iterations``) of the lines without a finite loss that say the
    loss went NaN, printed or not: core_v0.13.1's ``training_log`` prints ``lm loss`` only
    where its average over the interval's advanced iterations is above 0 (``if avg >
    0.0``), so a NaN (or -Inf) loss leaves the field out. Such a line is one that prints
    ``grad norm`` as NaN or Inf (an update made of a NaN gradient: with a loss scaler such
    an iteration is skipped and prints no grad norm), or one after a line that printed a
    finite loss; unless the loss scaler skipped every iteration of its interval (none
    advanced: nothing was averaged, the average is 0; the NaN ones among them are in
    ``number of nan iterations``). A loss printed NaN on a line of neither kind is in
    ``Run.nonfinite_loss``."""
    np = _numpy()
    if np is None:
        return _nan_lines_py(run, run.column("loss"))
    mask = _nan_mask(run)
    return [] if mask is None else [int(i) for i in np.flatnonzero(mask)]


def _nan_mask(run: Run) -> Any:
    """``nan_lines`` as a numpy mask over the lines; None where every loss is finite."""
    np = _numpy()
    bad = ~np.isfinite(_vector(run.column("loss")))
    if not bad.any():  # the usual: every line printed a finite loss
        return None
    its = _vector(run.iterations, "int64")
    skipped = np.nan_to_num(_vector(run.column("skipped")), nan=0.0)
    by_scaler = (skipped >= 1) & (skipped >= _intervals(its))
    earlier = np.logical_or.accumulate(~bad)  # a finite loss on this line or before it
    why = np.concatenate([[False], earlier[:-1]])
    if "grad_norm" in run.series or "grad_norm" in run.constant:  # printed by this release
        why |= ~np.isfinite(_vector(run.column("grad_norm")))
    return bad & ~by_scaler & why


def _nan_lines_py(run: Run, loss: Sequence[float]) -> list[int]:
    """``nan_lines`` without numpy."""
    if all(math.isfinite(v) for v in loss):
        return []
    its, skipped = run.iterations, run.column("skipped")
    every = min((b - a for a, b in itertools.pairwise(its)), default=its[0])
    grad = run.column("grad_norm")
    has_grad = "grad_norm" in run.series or "grad_norm" in run.constant
    out, earlier = [], False
    for i, v in enumerate(loss):
        if not math.isfinite(v):
            covers = min(its[i] - its[i - 1] if i else its[i], every)
            sk = skipped[i] if math.isfinite(skipped[i]) else 0.0
            by_scaler = sk >= 1 and sk >= covers
            if not by_scaler and (earlier or (has_grad and not math.isfinite(grad[i]))):
                out.append(i)
        earlier = earlier or math.isfinite(v)
    return out


def scaler_nan_unrecovered(run: Run) -> bool:
    """Whether the loss scaler's NaN iterations (``number of nan iterations``) went on to
    the end: no line from the last one that counts one on printed a finite loss. The ones
    it recovered from are normal fp16 training, counted in ``nan`` and nothing more."""
    if "nan" in run.constant and not run.constant["nan"] > 0:
        return False  # the usual: 0 on every line
    nan, loss = run.column("nan"), run.column("loss")
    np = _numpy()
    if np is not None:
        counted = np.flatnonzero(_vector(nan) > 0)
        return bool(len(counted)) and not np.isfinite(_vector(loss)[counted[-1] :]).any()
    last = next((i for i in range(len(nan) - 1, -1, -1) if nan[i] > 0), None)
    return last is not None and not any(math.isfinite(v) for v in loss[last:])


def nan_seen(run: Run) -> bool:
    """Whether the run's loss went NaN: a loss printed as NaN or Inf, a line that left it
    out for being NaN (``nan_lines``), or NaN iterations the loss scaler never recovered
    from (``scaler_nan_unrecovered``). Skipped NaN iterations followed by finite losses are
    not: the scaler did its job."""
    if run.nonfinite_loss or scaler_nan_unrecovered(run):
        return True
    if _numpy() is None:
        return bool(nan_lines(run))
    mask = _nan_mask(run)
    return mask is not None and bool(mask.any())


def step_time(run: Run) -> float:
    """Median step time, the first tenth of the intervals (warm-up) left out."""
    times = _finite(run.column("step_ms"))
    if not len(times):
        return math.nan
    np = _numpy()
    rest = times[len(times) // 10 :]
    return float(np.median(rest)) if np is not None else statistics.median(rest)


MIN_ITERATIONS = 10
"""Below this many logged iterations with a finite loss, ``diverged`` says ``None`` (too
short to judge), unless the run printed a NaN."""
NOISE_UNITS = 3.0
"""How far (in the run's own iteration-to-iteration noise) the last third's level must lie
above the best earlier level to count as diverged."""
LEVEL_FLOOR = 0.01
"""... and at least this fraction of that level (a noise-free series has a noise of 0)."""


def _median(v: Any) -> float:
    """The median, the two middle values halved before they are added (no overflow at
    1e308), the same with numpy or without."""
    n = len(v)
    np = _numpy()
    if np is not None:
        mid = np.partition(np.asarray(v, np.float64), [(n - 1) // 2, n // 2])
        a, b = float(mid[(n - 1) // 2]), float(mid[n // 2])
    else:
        ordered = sorted(v)
        a, b = ordered[(n - 1) // 2], ordered[n // 2]
    return a if n % 2 else a / 2 + b / 2


def _noise(v: Any) -> float:
    """The iteration-to-iteration noise of a series as a standard deviation: the median
    absolute deviation of its successive differences x 1.4826 / sqrt(2) (a difference holds
    two draws; a steady trend is its median and drops out)."""
    np = _numpy()
    if len(v) < 2:
        return 0.0
    if np is not None:
        d = np.diff(v)
        m = _median(d)
        dev: Any = np.abs(d - m)
    else:
        diffs = [b - a for a, b in itertools.pairwise(v)]
        m = _median(diffs)
        dev = [abs(x - m) for x in diffs]
    return 1.4826 * _median(dev) / math.sqrt(2)


def _rises(v: Any, scale: float) -> bool:
    """Whether the median of the last third of ``v`` lies above the lowest median of the
    earlier blocks of the same length by more than ``NOISE_UNITS`` times the series' noise
    and ``LEVEL_FLOOR`` times ``scale``."""
    n = len(v)
    k = max(n // 3, 1)
    last = _median(v[n - k :])
    best = min(_median(v[i : i + k]) for i in range(0, max(n - 2 * k, 0) + 1, k))
    if not math.isfinite(last - best):
        return True
    return last - best > max(NOISE_UNITS * _noise(v), LEVEL_FLOOR * abs(scale))


def diverged(run: Run, ref: Run | None = None) -> bool | None:
    """Whether the run diverged: NaN printed (``nan_seen``), or its loss over the last third
    of its logged iterations rose above its best earlier level, in units of its own noise
    (``_rises``), or, against ``ref`` (the bf16 run of the same model, dataset and profile),
    the gap to it at the iterations both logged rose the same way. ``None`` below
    ``MIN_ITERATIONS`` finite losses (too short to judge)."""
    if nan_seen(run):
        return True
    finite = _finite(run.column("loss"))
    if len(finite) < MIN_ITERATIONS:
        return None
    if _rises(finite, _median(finite[-max(len(finite) // 3, 1) :])):
        return True
    if ref is None or ref is run:
        return False
    va, vb = _matched(run, ref)
    if len(va) < MIN_ITERATIONS:
        return False
    np = _numpy()
    gap = va - vb if np is not None else [a - b for a, b in zip(va, vb, strict=True)]
    return _rises(gap, _median(vb[-max(len(vb) // 3, 1) :]))


def _matched(run: Run, ref: Run) -> tuple[Any, Any]:
    """The losses of both runs at the iterations both logged with a finite loss, in order."""
    np = _numpy()
    if np is not None:  # iterations are sorted and unique: look each up in the other
        la, lb = _vector(run.column("loss")), _vector(ref.column("loss"))
        ia, ib = _vector(run.iterations, "int64"), _vector(ref.iterations, "int64")
        if np.array_equal(ia, ib):  # the usual: the same logging interval
            xa = xb = np.arange(len(ia))
        else:
            at = np.minimum(np.searchsorted(ib, ia), max(len(ib) - 1, 0))
            xa = np.flatnonzero(ib[at] == ia) if len(ib) else np.zeros(0, np.int64)
            xb = at[xa]
        keep = np.isfinite(la[xa]) & np.isfinite(lb[xb])
        return la[xa[keep]], lb[xb[keep]]
    a = dict(zip(run.iterations, run.column("loss"), strict=True))
    b = dict(zip(ref.iterations, ref.column("loss"), strict=True))
    common = sorted(i for i in a.keys() & b.keys() if math.isfinite(a[i]) and math.isfinite(b[i]))
    return [a[i] for i in common], [b[i] for i in common]


def matched_delta(run: Run, ref: Run) -> tuple[float, float, int]:
    """(mean loss difference, relative difference, iterations compared) over the last window
    of the iterations both runs logged with a finite loss."""
    va, vb = _matched(run, ref)
    if not len(va):
        return math.nan, math.nan, 0
    w = _window(len(va))
    ma, mb = _mean(va[-w:]), _mean(vb[-w:])
    return ma - mb, (ma - mb) / mb if mb else math.nan, w


@dataclass
class RunsResult:
    runs: list[Run]
    rows: list[dict[str, Any]]
    logs: int
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why), not read


def keep_freed_memory() -> None:
    """Keep freed memory in the process instead of handing it back to the kernel.

    glibc returns every freed block above 128 KB (up to 32 MB) to the kernel at once, so the
    arrays of each log (its 80 MB of bytes, the positions of its bars, its windows) are
    page-faulted in afresh: 24k faults a log, a quarter of its parse on this machine. With
    both thresholds raised, they are reused from log to log; the process keeps its peak
    (a few hundred MB) until it ends. A no-op where the C library has no ``mallopt``."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD


_BIG = 256 << 20  # logs above this in total: worth keeping freed memory in this process


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def parse_or_skip(path: Path) -> Run | tuple[str, str]:
    """``parse_log``, or (path, why) for a log that cannot be read: one odd log never stops
    the others (an internal error in the parse is reported as such, with its type)."""
    try:
        return parse_log(path)
    except ValueError as exc:
        return str(path), str(exc)
    except Exception as exc:  # reported per log, never aborting the others
        return str(path), f"could not be parsed ({type(exc).__name__}: {str(exc)[:200]})"


def _parse_many(paths: list[Path], jobs: int) -> list[Run | tuple[str, str]]:
    if sum(_size(p) for p in paths) > _BIG:  # this process parses, or holds the runs
        keep_freed_memory()
    if jobs <= 1 or len(paths) < 2:
        return [parse_or_skip(p) for p in paths]
    with ProcessPoolExecutor(jobs, initializer=keep_freed_memory) as pool:
        return list(pool.map(parse_or_skip, paths, chunksize=1))


def validation_row(run: Run, ref: Run | None) -> dict[str, Any]:
    """The run's last validation (lm loss, perplexity, iteration) and its difference from the
    bf16 run's validation at the last iteration both validated (NaN where either has none)."""
    if not run.validation:
        return {"val_loss": math.nan, "val_ppl": math.nan, "val_at": None,
                "val_delta_vs_bf16": math.nan}  # fmt: skip
    at, loss, ppl = run.validation[-1]
    delta = math.nan
    if ref is not None and ref is not run and ref.validation:
        theirs = {i: v for i, v, _ in ref.validation}
        both = [(i, v) for i, v, _ in run.validation if i in theirs]
        if both:
            i, v = both[-1]
            delta = v - theirs[i]
    elif ref is run:
        delta = 0.0
    return {"val_loss": loss, "val_ppl": ppl, "val_at": at, "val_delta_vs_bf16": delta}


def runs(
    paths: list[Path] | None = None,
    jobs: int = 1,
    names: tuple[Iterable[str], Iterable[str]] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RunsResult:
    from quantpatch.analysis.limits import check_jobs

    check_jobs(jobs)
    logs = find_logs(paths or default_paths())
    results = _parse_many(logs, jobs)
    if progress:
        progress(len(logs), len(logs))
    parsed = [r for r in results if isinstance(r, Run)]
    skipped = [r for r in results if not isinstance(r, Run)]
    if names:
        for r in parsed:
            key_from_path(r, *names)
    ref: dict[tuple[Any, ...], Run] = {}
    for r in parsed:
        if r.scheme == "bf16" and r.iterations:
            k = (r.model, r.dataset, r.profile)
            if k not in ref or r.iterations[-1] > ref[k].iterations[-1]:
                ref[k] = r
    steps = {id(r): step_time(r) for r in parsed}
    rows = []
    for r in parsed:
        base = ref.get((r.model, r.dataset, r.profile))
        delta, rel, n = matched_delta(r, base) if base else (math.nan, math.nan, 0)
        st, base_st = steps[id(r)], steps[id(base)] if base else math.nan
        nan_iterations = _count(r.column("nan"))
        rows.append(
            {
                "model": r.model,
                "dataset": r.dataset,
                "scheme": r.scheme,
                "profile": r.profile,
                "attention": r.attention,
                "seed": r.seed,
                "iterations": r.iterations[-1] if r.iterations else 0,
                "of": r.total_iterations,
                "loss": last_window_loss(r),
                "last_finite_iteration": last_finite_iteration(r),
                "loss_delta_vs_bf16": delta,
                "rel_delta_vs_bf16": rel,
                "matched_iterations": n,
                "step_ms": st,
                "step_vs_bf16": st / base_st if base_st and math.isfinite(base_st) else math.nan,
                "skipped": _count(r.column("skipped")),
                "nan_iterations": nan_iterations,
                **validation_row(r, base),
                "diverged": diverged(r, base),
                "status": "nan" if nan_seen(r) else r.status,
                "unreadable_lines": r.garbage,
                "path": r.path,
            }
        )
    rows.sort(key=lambda x: tuple(str(x[k]) for k in ("model", "dataset", "profile", "scheme")))
    return RunsResult(parsed, rows, len(logs), skipped)


TWIN_COLUMNS = [
    "model", "dataset", "profile", "emulated", "native", "matched_iterations",
    "loss_diff_mean", "loss_diff_max_abs", "loss_diff_last", "step_ms_emulated",
    "step_ms_native",
]  # fmt: skip


def twin_rows(result: RunsResult, pairs: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each emulated scheme beside its native twin (``pairs``: (emulated, native) scheme
    names), per model, dataset and profile where both ran: the loss difference (emulated -
    native) at every iteration both logged with a finite loss (its mean, its largest size,
    and the last window's, as ``loss_delta_vs_bf16`` takes it), and each one's step time."""
    latest: dict[tuple[str, ...], Run] = {}
    for r in result.runs:  # a resumed run's logs: the one that got furthest
        key = (str(r.model), str(r.dataset), str(r.profile), str(r.scheme))
        if r.iterations and (key not in latest or r.iterations[-1] > latest[key].iterations[-1]):
            latest[key] = r
    rows = []
    for emulated, native in pairs:
        for (model, dataset, profile, scheme), run in sorted(latest.items()):
            twin = latest.get((model, dataset, profile, native))
            if scheme != emulated or twin is None:
                continue
            va, vb = _matched(run, twin)
            diffs = [float(a) - float(b) for a, b in zip(va, vb, strict=True)]
            rows.append(
                {
                    "model": model,
                    "dataset": dataset,
                    "profile": profile,
                    "emulated": emulated,
                    "native": native,
                    "matched_iterations": len(diffs),
                    "loss_diff_mean": sum(diffs) / len(diffs) if diffs else math.nan,
                    "loss_diff_max_abs": max(map(abs, diffs)) if diffs else math.nan,
                    "loss_diff_last": matched_delta(run, twin)[0],
                    "step_ms_emulated": step_time(run),
                    "step_ms_native": step_time(twin),
                }
            )
    return rows
