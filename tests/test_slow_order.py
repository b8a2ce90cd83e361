"""The order the slow tests start in (tests/conftest.py): longest first, dealt so that each of
xdist's workers gets as much work as the others, the tests tied together kept together."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .conftest import DURATIONS, _slices, recorded_durations, slow_first

SLOW = pytest.mark.slow.mark
SLURM = pytest.mark.xdist_group("slurm").mark


@dataclass
class Item:
    """What the ordering reads of a collected test: its id and its markers."""

    nodeid: str
    marks: list[Any] = field(default_factory=lambda: [SLOW])

    def get_closest_marker(self, name: str) -> Any:
        return next((m for m in self.marks if m.name == name), None)


def _worksteal(order: list[Item], seconds: dict[str, float], workers: int) -> float:
    """When the last of ``workers`` finishes ``order`` under xdist's worksteal scheduler: each
    worker first gets its slice of the order; a worker with fewer than two tests pending (its
    running one counted) takes the later half of the longest queue, but for the two at its
    head (xdist.scheduler.worksteal)."""
    pending: list[list[float]] = []
    start = 0
    for size in _slices(len(order), workers):
        pending.append([seconds[i.nodeid] for i in order[start : start + size]])
        start += size
    clock, ends = 0.0, [pending[w][0] if pending[w] else 0.0 for w in range(workers)]
    while any(pending):
        for w in range(workers):
            if len(pending[w]) < 2:
                donor = max(range(workers), key=lambda d: len(pending[d]))
                steal = min(len(pending[donor]) // 2, max(0, len(pending[donor]) - 2))
                if steal and donor != w:
                    pending[w] += pending[donor][-steal:]
                    del pending[donor][-steal:]
                    if len(pending[w]) == steal:  # it was idle: it starts at once
                        ends[w] = clock + pending[w][0]
        clock = min(ends[w] for w in range(workers) if pending[w])
        for w in range(workers):
            if pending[w] and ends[w] == clock:
                pending[w].pop(0)
                if pending[w]:
                    ends[w] = clock + pending[w][0]
    return clock


def test_one_worker_runs_the_longest_first_and_the_fast_tests_after():
    items = [Item("a", []), Item("s1"), Item("s2"), Item("b", []), Item("s3")]
    order = slow_first(items, {"s1": 5.0, "s2": 50.0, "s3": 20.0}, 1)
    assert [i.nodeid for i in order] == ["s2", "s3", "s1", "a", "b"]


def test_a_test_never_recorded_counts_as_the_median_one():
    items = [Item(n) for n in ("new", "s1", "s2", "s3")]
    order = slow_first(items, {"s1": 1.0, "s2": 30.0, "s3": 100.0}, 1)
    assert [i.nodeid for i in order] == ["s3", "new", "s2", "s1"]


def test_a_new_case_of_a_recorded_test_counts_as_its_recorded_cases():
    recorded = {"t::kill[set]": 20.0, "t::kill[upgrade]": 100.0, "t::kill[init]": 90.0}
    recorded |= {f"u::s{i}": 5.0 for i in range(5)}
    items = [Item(n) for n in (*recorded, "t::kill[upgrade-flat]", "u::new")]
    order = [i.nodeid for i in slow_first(items, recorded, 1)]
    # the new kill case counts as 90 s (its cases' median), the new test as 5 s (all tests')
    assert order[:4] == [
        "t::kill[upgrade]",
        "t::kill[init]",
        "t::kill[upgrade-flat]",
        "t::kill[set]",
    ]
    assert order.index("u::new") > order.index("t::kill[set]")


def test_two_workers_each_start_with_long_tests_and_finish_together():
    # as collected: the long tests bunched together, one behind the other in the first slice
    seconds = {f"long{i}": 100.0 - 10 * i for i in range(4)}
    seconds |= {f"short{i}": 2.0 for i in range(20)}
    items = [Item(n) for n in seconds]
    order = slow_first(items, seconds, 2)
    assert sorted(i.nodeid for i in order) == sorted(seconds)
    half = _slices(len(order), 2)[0]
    first, second = order[:half], order[half:]
    assert {first[0].nodeid, second[0].nodeid} == {"long0", "long1"}
    for share in (first, second):
        assert [seconds[i.nodeid] for i in share] == sorted(
            (seconds[i.nodeid] for i in share), reverse=True
        )
    total = sum(seconds.values())
    assert _worksteal(items, seconds, 2) == 270.0  # as collected: the long ones on one worker
    assert _worksteal(order, seconds, 2) == total / 2


def test_tests_tied_together_stay_together_on_one_worker():
    # the real-Slurm tests share one cluster at a time: never on two workers at once
    seconds = {"slurm1": 90.0, "slurm2": 40.0, "slurm3": 60.0, "big": 150.0}
    seconds |= {f"s{i}": 5.0 for i in range(10)}
    items = [Item(n, [SLOW, SLURM]) if n.startswith("slurm") else Item(n) for n in seconds]
    order = [i.nodeid for i in slow_first(items, seconds, 2)]
    at = order.index("slurm1")
    assert order[at : at + 3] == ["slurm1", "slurm2", "slurm3"]  # as written, one unit
    half = _slices(len(order), 2)[0]
    assert (at < half) == (at + 2 < half)
    assert order[0] == "slurm1" or order[half] == "slurm1"  # 190 s: the longest unit


def test_recorded_durations_read_back_and_unreadable_ones_ignored(tmp_path: Path):
    assert recorded_durations(tmp_path / "none.json") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert recorded_durations(tmp_path / "bad.json") == {}
    (tmp_path / "list.json").write_text("[1, 2]")
    assert recorded_durations(tmp_path / "list.json") == {}
    (tmp_path / "ok.json").write_text(json.dumps({"t::a": 3}))
    assert recorded_durations(tmp_path / "ok.json") == {"t::a": 3.0}
    # the file the suite orders by: every entry a slow test's id and its seconds
    recorded = recorded_durations(DURATIONS)
    assert recorded and all("::" in k and v >= 0 for k, v in recorded.items())
