"""Megatron iteration lines read a column at a time with numpy (the fast paths of ``runs``).

A sweep's logs hold millions of lines, so nothing here loops over lines in Python. A log is
one ``uint8`` array; every ``/``, ``|`` and newline in it is found with one pass; an
iteration line (``iteration N/ M |``, Megatron's ``' iteration {:8d}/{:8d} |'``) is
recognised at its ``/``; and a field's values are cut out of every line at once, as
fixed-width windows of bytes, right-aligned on the `` |`` that closes them. A window is held
column-major (one row per byte position, one column per line), so that every check and every
sum runs along contiguous memory: numpy's reductions across a short inner axis cost ten times
more.

Numbers are converted exactly as ``float()`` converts them. When every row is laid out like
the first (Megatron's ``{:.6E}``, ``{:.1f}`` and ``{:3d}``: the same digits after the point,
the same exponent width), the digits are summed column-wise into one integer, exact below
2**53, and scaled once by an exact power of ten: a single correctly rounded operation on
exact operands, which is Clinger's fast path, the one ``strtod`` itself takes. The rows
that are not (``nan``, ``inf``, more than 15 digits, garbage) go through numpy's own
conversion, one by one where even that refuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from quantpatch.analysis.log_lines import ITERATION, number

_POW10 = 10.0 ** np.arange(23)  # every one an exact double
_EXACT_DIGITS = 15  # a decimal integer of this many digits is an exact double (< 2**53)
_NUMBER = re.compile(rb"(-?)(\d+)(\.\d+)?(?:([eE])([+-]?)(\d+))?")
_SPACE, _PLUS, _MINUS, _BAR, _SLASH = 32, 43, 45, 124, 47

_SCRATCH: dict[int, Any] = {}


def _scratch(n: int, which: int = 0) -> Any:
    """A boolean buffer of ``n`` elements, reused from log to log: a fresh 80 MB array per
    log costs its page faults again (a third of the time with two processes)."""
    buf = _SCRATCH.get(which)
    if buf is None or len(buf) < n:
        buf = _SCRATCH[which] = np.empty(max(n, 1 << 20), np.bool_)
    return buf[:n]


class LogBytes:
    """A log's bytes as an array, with fixed-width windows at any positions."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.arr = np.frombuffer(data, np.uint8)
        self._views: dict[int, Any] = {}
        self._found: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.arr)

    def positions(self, byte: int) -> Any:
        """Every position of ``byte``, in order."""
        if byte in self._found:
            return self._found[byte]
        return np.flatnonzero(np.equal(self.arr, byte, out=_scratch(len(self.arr))))

    def scan(self, *wanted: int) -> None:
        """Find every position of each of ``wanted`` bytes with one pass over the file for
        all of them (``positions`` then answers from it)."""
        hits = np.equal(self.arr, wanted[0], out=_scratch(len(self.arr)))
        other = _scratch(len(self.arr), 1)
        for byte in wanted[1:]:
            hits |= np.equal(self.arr, byte, out=other)
        found = np.flatnonzero(hits)
        which = self.arr[found]
        self._found = {byte: found[which == byte] for byte in wanted}

    def at(self, pos: Any) -> Any:
        """The byte at each position (NUL outside the file)."""
        if not len(self.arr):
            return np.zeros(np.shape(pos), np.uint8)
        if not len(pos) or (pos.min() >= 0 and pos.max() < len(self.arr)):
            return self.arr[pos]
        inside = (pos >= 0) & (pos < len(self.arr))
        return np.where(inside, self.arr[np.clip(pos, 0, max(len(self.arr) - 1, 0))], 0)

    def items(self, start: Any, width: int) -> Any:
        """``width`` bytes from each position, as one item each (numpy ``V<width>``: a
        line's bytes are copied together, which is what a gather costs); bytes outside the
        file are NUL."""
        n = len(self.arr)
        start = np.asarray(start, np.int64)
        kind = np.dtype((np.void, width))
        if n < width:
            out = np.zeros(len(start), kind)
            edge = np.arange(len(start))
        else:
            if width not in self._views:  # every position's next ``width`` bytes, no copy
                self._views[width] = np.ndarray(
                    buffer=self.arr, dtype=kind, shape=(n - width + 1,), strides=(1,)
                )
            if not len(start) or (start.min() >= 0 and start.max() <= n - width):
                return self._views[width][start]  # the usual: all inside the file
            out = self._views[width][np.clip(start, 0, n - width)]
            edge = np.flatnonzero((start < 0) | (start > n - width))
        if len(edge):  # the few lines at the file's ends: byte by byte
            rows = self.at(start[edge][:, None] + np.arange(width)).astype(np.uint8)
            out[edge] = np.ascontiguousarray(rows).view(kind).ravel()
        return out

    def matches(self, start: Any, const: bytes) -> Any:
        """Whether the bytes at each position are ``const``: one gather of the bytes (in whole
        8-byte words, the last masked to what ``const`` has), then a comparison per word as
        64-bit integers, a column at a time. For a name of 30 bytes, 11 ns a line against 28
        for four 8-byte gathers; numpy's comparison of whole items is slower still, even for
        two bytes."""
        words = -(-len(const) // 8)
        tail = len(const) - (words - 1) * 8  # the bytes of const in the last word
        want = np.frombuffer(const.ljust(words * 8, b"\0"), np.uint64)
        mask = np.frombuffer(b"\xff" * tail + b"\0" * (8 - tail), np.uint64)[0]
        got = self.items(start, words * 8).view(np.uint64).reshape(-1, words)
        ok = (got[:, -1] & mask) == want[-1]
        for k in range(words - 1):
            ok &= got[:, k] == want[k]
        return ok

    def windows(self, start: Any, width: int) -> Any:
        """``width`` bytes from each position, column-major: ``out[c, i]`` is the byte at
        ``start[i] + c`` (NUL outside the file)."""
        rows = self.items(start, width).view(np.uint8).reshape(-1, width)
        return np.ascontiguousarray(rows.T)

    def right_aligned(self, start: Any, end: Any) -> Any:
        """The bytes ``[start, end)`` of each line, right-aligned in windows as wide as the
        widest (at most 64), spaces on the left; a line whose bytes are wider is all spaces
        (not a number)."""
        length = end - start
        width = int(min(max(int(length.max(initial=1)), 1), 64))
        win = self.windows(end - width, width)
        if (length != width).any():  # not a fixed-width field: blank what is not its own
            blank = np.arange(width)[:, None] < (width - length)[None, :]
            blank |= length[None, :] > width
            win = np.where(blank, np.uint8(_SPACE), win)
        return win


@dataclass
class IterationLines:
    """The iteration lines of a log, in file order."""

    first_bar: Any  # each line's first '|' (the one after "iteration N/ M")
    iteration: Any  # int64
    total: Any  # int64


def _weights(width: int) -> Any:
    """The place values of ``width`` digit columns, left to right (those past 10**22, where no
    row that is read this way has a digit, are capped)."""
    return _POW10[np.minimum(np.arange(width), 22)][::-1]


def _is_digit(win: Any) -> Any:
    return (win >= 48) & (win <= 57)


def _digits(win: Any) -> tuple[Any, Any]:
    """Columns of ``' '* [0-9]+`` (right-aligned integers of at most 15 digits): (values,
    which columns are). ``_fast`` with an empty layout reads the same, but its sign and
    suffix checks cost 15 ms a log here, on two windows of every iteration line."""
    digit = _is_digit(win)
    ok = digit[-1] & (digit | (win == _SPACE)).all(axis=0)
    if len(win) > 1:
        ok &= (digit[1:] >= digit[:-1]).all(axis=0)  # no space between digits
    if len(win) > _EXACT_DIGITS:
        ok &= digit.sum(axis=0) <= _EXACT_DIGITS
    values = _weights(len(win)) @ np.where(digit, win - 48, 0)
    return values.astype(np.int64), ok


def iteration_lines(text: LogBytes) -> IterationLines:
    """Every ``iteration N/ M |`` in the log, found at its ``/``. The lines laid out like the
    first one (Megatron's fixed widths) are checked and read with one window each; any other
    ``/`` that could still start one (a digit or a space on both sides) is matched with the
    pattern, one by one (a few in a usual log: paths)."""
    data = text.data
    empty = np.zeros(0, np.int64)
    first = ITERATION.search(data)
    if first is None:
        return IterationLines(empty, empty, empty)
    slashes = text.positions(_SLASH)
    # the first line's layout: "iteration", a space, N in [s - before, s), M, " |" at s + after
    s0 = data.index(b"/", first.end(1))
    before, after = s0 - first.start(), first.end() - 1 - s0
    win = text.windows(slashes - before, before + after + 1)
    ok = (win[:9] == np.frombuffer(b"iteration", np.uint8)[:, None]).all(axis=0)
    ok &= (win[9] == _SPACE) & (win[-1] == _BAR) & (win[-2] == _SPACE)
    n_it, ok_it = _digits(win[9:before])
    n_total, ok_total = _digits(win[before + 1 : -2])
    fixed = np.flatnonzero(ok & ok_it & ok_total)
    first_bar, iteration, total = slashes[fixed] + after, n_it[fixed], n_total[fixed]
    maybe = np.ones(len(slashes), np.bool_)
    maybe[fixed] = False
    s = slashes[maybe]
    near = text.windows(s - 1, 3)
    s = s[(_is_digit(near[0]) | (near[0] == _SPACE)) & (_is_digit(near[2]) | (near[2] == _SPACE))]
    extra: list[tuple[int, int, int]] = []
    for pos in s.tolist():
        eol = data.find(b"\n", pos)
        m = ITERATION.search(data, data.rfind(b"\n", 0, pos) + 1, len(data) if eol < 0 else eol)
        while m is not None and m.start(2) < pos:  # an earlier one on the same line
            m = ITERATION.search(data, m.start() + 1, m.endpos)
        if m is not None and data.index(b"/", m.end(1)) == pos:
            extra.append((m.end() - 1, int(m.group(1)), int(m.group(2))))
    if extra:
        more = np.array(extra, np.int64)
        order = np.argsort(np.concatenate([first_bar, more[:, 0]]), kind="stable")
        first_bar = np.concatenate([first_bar, more[:, 0]])[order]
        iteration = np.concatenate([iteration, more[:, 1]])[order]
        total = np.concatenate([total, more[:, 2]])[order]
    return IterationLines(first_bar, iteration, total)


@dataclass(frozen=True)
class _Layout:
    """How a plain decimal is written after its integer digits: ``.ddddddE+dd`` is
    ``suffix``, 6 ``frac`` digits, 2 ``exp`` digits and an exponent sign."""

    suffix: bytes
    frac: int
    exp: int
    exp_sign: bool


def _layout(sample: bytes) -> _Layout | None:
    m = _NUMBER.fullmatch(sample)
    if m is None:
        return None
    frac = len(m.group(3) or b".") - 1
    return _Layout(sample[m.end(2) :], frac, len(m.group(6) or b""), bool(m.group(5)))


def parse_numbers(win: Any) -> Any:
    """The numbers right-aligned in the columns of ``win`` (w x n bytes, spaces above) as
    float64, bit for bit what ``float()`` gives; NaN where a column is not a number."""
    w, n = win.shape
    out = np.full(n, np.nan)
    if n == 0:
        return out
    layout = _layout(bytes(win[:, 0]).strip()) or _layout(bytes(win[:, -1]).strip())
    good = np.zeros(n, np.bool_)
    # more digits after the point than an exact integer holds never take the fast path (and
    # its table of powers of ten stops at 10**22)
    if layout is not None and w > len(layout.suffix) and layout.frac <= _EXACT_DIGITS:
        good, values = _fast(win, layout)
        out[good] = values[good]
    bad = np.flatnonzero(~good)
    if len(bad):
        rows = win[:, bad]
        out[bad] = to_float(np.ascontiguousarray(rows.T).view(f"S{w}").ravel())
        out[bad[(rows == 0).any(axis=0)]] = np.nan  # numpy's text drops a NUL; float() not
    return out


def _fast(win: Any, layout: _Layout) -> tuple[Any, Any]:
    """Clinger's fast path: (the columns laid out as ``layout`` says, their values)."""
    n = win.shape[1]
    width = len(win) - len(layout.suffix)  # the sign and the integer digits
    head, tail = win[:width], win[width:]
    # the suffix: its literal bytes ('.', 'E', the exponent's sign) in place, digits elsewhere
    want = np.frombuffer(layout.suffix, np.uint8)
    literal = ~_is_digit(want)
    sign_row = len(want) - layout.exp - 1 if layout.exp_sign else -1
    good = _is_digit(tail[~literal]).all(axis=0)
    for row in np.flatnonzero(literal):
        if row == sign_row:
            good &= (tail[row] == _PLUS) | (tail[row] == _MINUS)
        else:
            good &= tail[row] == want[row]
    # the integer digits against the suffix, spaces before them and perhaps a minus sign
    digit = _is_digit(head)
    n_int = digit.sum(axis=0)
    minus = head == _MINUS
    negative = minus.any(axis=0)
    good &= digit[-1] & (n_int + layout.frac <= _EXACT_DIGITS)
    if width > 1:
        good &= (digit[1:] >= digit[:-1]).all(axis=0)  # no gap between digits
    good &= (digit | minus | (head == _SPACE)).all(axis=0) & (minus.sum(axis=0) <= 1)
    if negative.any():  # the sign right before the digits
        good &= ~negative | minus[np.clip(width - n_int - 1, 0, width - 1), np.arange(n)]
    # one integer of all the digits (exact: at most 15), then one exact power of ten
    mantissa = _weights(width) @ np.where(digit, head - 48, 0)
    if layout.frac:
        frac_rows = np.flatnonzero(~literal)[: layout.frac]
        fraction = _weights(layout.frac) @ (tail[frac_rows] - 48)
        mantissa = mantissa * _POW10[layout.frac] + fraction
    exponent = np.full(n, -layout.frac, np.int64)
    if layout.exp:
        e = _weights(layout.exp) @ (tail[len(want) - layout.exp :] - 48)
        e = np.minimum(e, 999).astype(np.int64)  # past 22 it is not read this way anyway
        exponent += np.where(tail[sign_row] == _MINUS, -e, e) if sign_row >= 0 else e
    good &= np.abs(exponent) <= 22
    scale = _POW10[np.minimum(np.abs(exponent), 22)]
    values = np.where(exponent >= 0, mantissa * scale, mantissa / scale)
    return good, np.where(negative, -values, values)


def to_float(text: Any) -> Any:
    """Fixed-width number texts (an ``S`` array) as floats; one by one where numpy refuses."""
    try:
        return text.astype(np.float64)
    except ValueError:  # garbage inside a field
        return np.array([number(t) for t in text.tolist()], dtype=np.float64)
