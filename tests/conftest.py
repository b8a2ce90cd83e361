"""Fixtures built at test time from real megatron-core wheels (no Megatron source committed)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import git
import pytest

from quantpatch import cli
from quantpatch.base.config import Targets
from quantpatch.base.megatron_source import megatron_tree
from quantpatch.checkout.init import OPS_MODULES, runtime_source
from quantpatch.sites.codemods.init_sites import Layout, inject_sites


def _interpret_triton_without_a_gpu() -> None:
    """Triton reads ``TRITON_INTERPRET`` when it is first imported (its own library functions
    are decorated then), and torch may import it early: set it before any test module loads,
    so that without a GPU the kernels run in the interpreter on CPU tensors."""
    if "TRITON_INTERPRET" in os.environ:
        return
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_a_gpu()

# -- the two suites --------------------------------------------------------------------------
# ``python -m pytest`` (the README's test command) runs the fast suite: every test but those
# marked ``slow`` (the end-to-end runs: every kill point of every command, every Megatron
# layout, the GPU kit's CPU run, the real Slurm). ``python -m pytest --full`` runs them all.
# A ``-m`` expression, when given, decides alone. Coverage is gated at FULL_GATE on the full
# suite and at FAST_GATE on the fast one (subprocesses counted in both).
FULL_GATE, FAST_GATE = 90.0, 85.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="the full suite: the tests marked slow too (the default leaves them out)",
    )
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        default=None,
        help="write each slow test's seconds (setup, call, teardown) of this run into PATH "
        "(JSON, merged with what is there): tests/durations.json orders the slow tests",
    )


def _full(config: pytest.Config) -> bool:
    return bool(config.getoption("--full") or config.getoption("markexpr"))


def pytest_configure(config: pytest.Config) -> None:
    cov = config.pluginmanager.getplugin("_cov")  # pytest-cov, when --cov is on
    options = getattr(cov, "options", None)
    # unset (coverage's own default, 0): the gate of this suite; --cov-fail-under N wins
    if options is not None and not getattr(options, "cov_fail_under", None):
        options.cov_fail_under = FULL_GATE if _full(config) else FAST_GATE


def pytest_report_header(config: pytest.Config) -> str:
    if _full(config):
        return "quantpatch: the full suite (slow tests included)"
    return "quantpatch: the fast suite; `python -m pytest --full` adds the tests marked slow"


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _full(config):
        workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
        items[:] = slow_first(items, recorded_durations(DURATIONS), workers)
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


# -- the slow tests' order -------------------------------------------------------------------
# The slow tests take from seconds to minutes each. Run in the order they are written, a
# worker may start a two-minute test when the others have nothing left, and idle meanwhile.
# So the slow tests start longest first, by the seconds each took in a recorded run
# (tests/durations.json, written by ``--record-durations tests/durations.json``; a test not
# recorded counts as its recorded parametrisations' median, else all tests'). xdist's
# worksteal scheduler hands each worker a slice of the collection in order (then moves the
# ends of the longest queues to idle workers): the tests are dealt so that each worker's
# slice starts with its own longest tests and ends with short ones. Tests that share a
# module-scoped fixture, or name one ``xdist_group`` (one real Slurm at a time on a
# machine), stay together, in their order: one worker builds the fixture once, and never
# waits on another for the shared resource.
DURATIONS = Path(__file__).with_name("durations.json")


def recorded_durations(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _unit_key(item: pytest.Item) -> str:
    """What ties ``item`` to others: a shared resource, a fixture wider than one test (not the
    session's, which every worker builds once anyway), or nothing (its own id)."""
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return f"group:{group.args[0] if group.args else group.kwargs.get('name')}"
    info = getattr(item, "_fixtureinfo", None)
    for name in sorted(info.name2fixturedefs if info is not None else ()):
        defs = info.name2fixturedefs[name]
        if defs and defs[-1].scope in ("package", "module", "class"):
            return f"fixture:{item.nodeid.split('::')[0]}:{name}"
    return item.nodeid


def _slices(n: int, workers: int) -> list[int]:
    """The sizes of the slices worksteal first hands ``workers`` idle workers of ``n`` tests."""
    sizes = []
    for i in range(workers):
        sizes.append(n // (workers - i))
        n -= sizes[-1]
    return sizes


def slow_first(
    items: list[pytest.Item], seconds: dict[str, float], workers: int
) -> list[pytest.Item]:
    """``items`` with the slow ones first, longest first, dealt to ``workers`` slices (the
    others after them, in their order)."""
    slow = [item for item in items if item.get_closest_marker("slow")]
    rest = [item for item in items if not item.get_closest_marker("slow")]
    if not slow:
        return items
    seconds = _estimated(slow, seconds)
    units: dict[str, list[pytest.Item]] = {}
    for item in slow:
        units.setdefault(_unit_key(item), []).append(item)
    ordered = sorted(
        units.values(), key=lambda unit: (-sum(seconds[i.nodeid] for i in unit), unit[0].nodeid)
    )
    if rest or workers <= 1:  # one worker, or slices of a mixed collection: longest first
        return [item for unit in ordered for item in unit] + rest
    # each unit, longest first, to the slice with the least work that has room for it (a unit
    # that fits nowhere exactly goes where most room is left)
    room = _slices(len(slow), workers)
    dealt: list[list[pytest.Item]] = [[] for _ in room]
    work = [0.0] * workers
    for unit in ordered:
        fits = [w for w in range(workers) if room[w] >= len(unit)]
        w = (
            min(fits, key=lambda w: (work[w], w))
            if fits
            else max(range(workers), key=room.__getitem__)
        )
        dealt[w] += unit
        room[w] -= len(unit)
        work[w] += sum(seconds[i.nodeid] for i in unit)
    return [item for share in dealt for item in share]


def _estimated(items: list[pytest.Item], seconds: dict[str, float]) -> dict[str, float]:
    """Each item's recorded seconds; one never recorded (new since the record): the median of
    its recorded parametrisations (a new case of a test), else the median of all."""

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    known = [seconds[i.nodeid] for i in items if i.nodeid in seconds]
    typical = median(known) if known else 10.0
    siblings: dict[str, list[float]] = {}
    for nodeid, value in seconds.items():
        siblings.setdefault(nodeid.partition("[")[0], []).append(value)
    estimated = {}
    for item in items:
        others = siblings.get(item.nodeid.partition("[")[0], [typical])
        estimated[item.nodeid] = seconds.get(item.nodeid, median(others))
    return estimated


_seen: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" in report.keywords:
        _seen[report.nodeid] = _seen.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = session.config.getoption("--record-durations")
    if not target or hasattr(session.config, "workerinput") or not _seen:
        return  # xdist's workers report to the controller, which writes the file
    path = Path(target)
    merged = {**recorded_durations(path), **{k: round(v, 1) for k, v in _seen.items()}}
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n", encoding="utf-8")


VERSIONS = ("0.11.0", "0.13.1")
LINEAR = Targets().linear[0]
ATTENTION = Targets().attention[0]


@pytest.fixture(scope="session")
def trees() -> dict[str, Path]:
    """``megatron/`` of each release, from its wheel (cached between runs)."""
    return {v: megatron_tree(v) for v in VERSIONS}


MakeCheckout = Callable[..., Path]


@pytest.fixture
def make_checkout(tmp_path: Path, trees: dict[str, Path]) -> MakeCheckout:
    """A git checkout holding the two real target files of a release with sites injected
    (and, with them, the ops module their dispatches hand values to, as init installs it)."""
    counter = iter(range(1000))

    def make(
        version: str = "0.13.1",
        layout: Layout | None = None,
        *,
        inject: bool = True,
        use_git: bool = True,
        full: bool = False,
        extra: tuple[str, ...] = (),
        ops: bool = True,
    ) -> Path:
        root = tmp_path / f"checkout{next(counter)}"
        src = trees[version]
        if full:
            shutil.copytree(src, root / "megatron")
        for rel in extra:  # more real files, as they are (e.g. transformer_layer.py)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src.parent / rel, root / rel)
        for rel in (LINEAR, ATTENTION):
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            text = (src.parent / rel).read_text(encoding="utf-8")
            kind = "linear" if rel == LINEAR else "attention"
            dest.write_text(inject_sites(text, rel, kind, layout) if inject else text)
        if inject and ops:  # as init leaves it: the module its dispatches hand values to
            for installed in OPS_MODULES:  # quantpatch_ops.py and the parts it imports
                (root / installed).parent.mkdir(parents=True, exist_ok=True)
                (root / installed).write_text(runtime_source(installed), encoding="utf-8")
        (root / "README.md").write_text("not a target\n")
        if use_git:  # closed at once: a test process makes hundreds (their descriptors)
            with git.Repo.init(root, initial_branch="main") as repo:
                with repo.config_writer() as cw:
                    cw.set_value("user", "name", "Test")
                    cw.set_value("user", "email", "test@example.com")
                repo.git.add("-A")
                repo.git.commit("-qm", "fixture")
        return root

    return make


def snapshot(root: Path) -> dict[str, object]:
    """Every work-tree file's bytes, every ref, HEAD and the quantpatch record."""
    files = {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }
    snap: dict[str, object] = {"files": files}
    if (root / ".git").exists():
        with git.Repo(root) as repo:
            snap["refs"] = repo.git.for_each_ref()
        snap["head"] = (root / ".git" / "HEAD").read_text()
        state = root / ".git" / "quantpatch" / "state.json"
        snap["state"] = state.read_text() if state.exists() else None
    return snap


class Result:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    def __repr__(self) -> str:
        return f"Result(code={self.code}, out={self.out[-400:]!r}, err={self.err[-400:]!r})"


@pytest.fixture
def run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., Result]:
    """Run the real CLI entry point in-process and return exit code, stdout and stderr."""

    def invoke(*args: str | Path) -> Result:
        monkeypatch.setattr(sys, "argv", ["quantpatch", *map(str, args)])
        cli.OPTS.repo, cli.OPTS.json, cli.OPTS.debug = None, False, False
        code = 0
        try:
            cli.main()
        except SystemExit as exc:
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return invoke


def git_out(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout


def run_probe(
    script: Path, root: Path, out: Path, *args: str, **env_extra: str
) -> tuple[dict, str]:
    """Run a probe script against the Megatron of ``root`` (first on PYTHONPATH) in a clean
    environment (no saver or quant-type variables unless given); its results and stderr."""
    torch = pytest.importorskip("torch")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TENSOR_SAVE") and k != "CUSTOM_QUANT_TYPE"
    }
    env.update(PYTHONPATH=str(root), **env_extra)
    res = subprocess.run(
        [sys.executable, str(script), str(out), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out), res.stderr


def tiny_gpt(root: Path, cfg: dict[str, object]) -> dict[str, object]:
    """benchmarks/gpu_e2e.py's worker (a megatron-core GPT, local spec, bf16, Adam) run on
    ``root``'s megatron in a clean environment (no saver or quant-type variables): the JSON
    it prints last (``losses``, and ``alpha`` under ParetoQ values)."""
    import importlib.util
    import json

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("gpu_e2e", bench / "gpu_e2e.py")
        assert spec is not None and spec.loader is not None
        e2e = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(e2e)
    finally:
        sys.path.remove(str(bench))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env.pop("CUSTOM_QUANT_TYPE", None)
    env["PYTHONPATH"] = e2e.worker_pythonpath(root)
    out = subprocess.run(
        [sys.executable, "-c", e2e.WORKER, json.dumps(cfg)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- barriers: a test waits for a moment of another process without polling -----------------


def readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` became readable (or its other end closed, or its process exited, for a
    pidfd) within ``timeout`` seconds. On ``poll``, which takes a descriptor of any number:
    ``select`` raises for one above 1,023, which a long test process may well hold."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000))))


class Pipe:
    """A named pipe that processes under test write lines into at the moments a test waits
    for (a stub's start, ``faults.pause``). Held open for reading and writing by the test, so
    a writer never blocks and no line is lost between two reads; ``line`` waits on ``select``,
    its timeout only a guard against a moment that never comes."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path, self.fd, self.buf = path, os.open(path, os.O_RDWR), b""

    def line(self, timeout: float = 120.0) -> str:
        while b"\n" not in self.buf:
            assert readable(self.fd, timeout), f"no line in {self.path}"
            self.buf += os.read(self.fd, 4096)
        first, self.buf = self.buf.split(b"\n", 1)
        return first.decode()

    def close(self) -> None:
        """Unlinked first: a writer that opens it later finds no pipe and never blocks."""
        self.path.unlink()
        os.close(self.fd)


def paused(fifo: Path, timeout: float = 120.0) -> str:
    """The line a process held at ``faults.pause`` wrote into ``fifo``: waited for on
    ``select`` (a pipe no writer has opened yet is not readable), ``timeout`` a guard only."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        data = b""
        while not data.endswith(b"\n"):
            assert readable(fd, timeout), f"nothing came through {fifo}"
            chunk = os.read(fd, 4096)
            assert chunk, f"{fifo} was closed before a whole line"
            data += chunk
        return data.decode().strip()
    finally:
        os.close(fd)


def release(fifo: Path) -> None:
    """Let a process held at ``faults.pause`` go on: the pipe opened for writing (once the
    process reads it) and closed, nothing written, so that no later read takes it."""
    with open(fifo, "w", encoding="utf-8"):
        pass


def wait_exited(pids: list[int], timeout: float = 120.0) -> None:
    """Until every process of ``pids`` has exited (a zombie counts: it runs no more), on
    pidfds: no polling; ``timeout`` a guard only."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone and reaped
        try:
            assert readable(fd, timeout), f"process {pid} still runs"
        finally:
            os.close(fd)


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` now (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found
