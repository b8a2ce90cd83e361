"""The saver's one-pass statistics kernel: compiled on first use, cached, checked, and handed
over to torch's operators wherever it cannot give the float64 answer rounded to float32."""

from __future__ import annotations

import math
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import readable

torch = pytest.importorskip("torch")


class _SaverParts:
    """The saver's parts (``quantpatch/runtime/quantpatch_saver/``), each imported (with
    torch) on first use."""

    def __getattr__(self, name: str):
        import importlib

        return importlib.import_module(f"quantpatch.runtime.quantpatch_saver.{name}")


sp = _SaverParts()

_SAVER_ENV_AT_IMPORT = {k: v for k, v in os.environ.items() if k.startswith("TENSOR_SAVE")}


def _cc() -> str:
    """The first C compiler on PATH, as the saver looks for one without ``$CC``."""
    return next(found for name in ("cc", "gcc", "clang") if (found := shutil.which(name)))


needs_cc = pytest.mark.skipif(
    not any(shutil.which(name) for name in ("cc", "gcc", "clang")),
    reason="no C compiler on PATH: the kernel cannot be built here",
)
x86 = pytest.mark.skipif(
    os.uname().machine not in ("x86_64", "amd64"), reason="the kernel is x86-64 only"
)


@pytest.fixture
def ts(monkeypatch, tmp_path):
    from quantpatch.runtime import tensor_saver

    for k in list(os.environ):
        if k.startswith("TENSOR_SAVE"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("TENSOR_SAVE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("TENSOR_SAVE_ACCELERATORS", "stats-kernel")
    tensor_saver.configure()
    sp.stats_kernel.forget()
    yield tensor_saver
    sp.stats_kernel.forget()
    monkeypatch.undo()
    tensor_saver.configure()


def _ready(ts) -> str:
    """The kernel's status once any compile under way has ended."""
    return ts.stats_kernel_status()


def _exited(pid: int, why: str) -> None:
    """Wait on a pidfd (no polling) until ``pid`` has exited (a zombie counts: it runs no
    more); 60 s only for one that never does."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone and reaped
    try:
        assert readable(fd, 60), why
    finally:
        os.close(fd)


def _truth(t: torch.Tensor) -> list[float]:
    """float64's min, max, mean and sample std, each rounded once to float32."""
    d = t.double()
    std = d.std().item() if t.numel() > 1 else 0.0
    values = [d.min().item(), d.max().item(), d.mean().item(), std]
    return torch.tensor(values, dtype=torch.float32).tolist()


def _one_ulp(got: list[float], want: list[float]) -> None:
    assert got[:2] == want[:2]  # min and max are values of the tensor
    for g, w in zip(got[2:], want[2:], strict=True):
        assert g == pytest.approx(w, rel=2.0**-23, abs=1e-45)


@needs_cc
@x86
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 1000, (1 << 20) + 5])
def test_kernel_gives_float64s_answer_rounded_for_every_length(ts, dtype, n):
    """16 values at a time and the rest one by one, from a storage offset (a view into a
    larger tensor): within one float32 rounding of float64's (min and max exactly)."""
    gen = torch.Generator().manual_seed(n)
    base = (torch.randn(n + 3, generator=gen) * 2.5 - 0.75).to(getattr(torch, dtype))
    t = base[3:]
    assert _ready(ts).startswith("kernel (compiled: ")
    got = sp.stats_kernel.fused_stats(t)
    assert got is not None
    _one_ulp(got, _truth(t))
    assert sp.stats.host_stats(t) == got


@needs_cc
@x86
def test_kernel_extremes_of_each_type(ts):
    """The largest and smallest (subnormal) magnitudes of each type: squares that would
    overflow or vanish in float32 stay exact in float64."""
    cases = [
        torch.tensor([3.0e38, -3.3e38, 1.0e38] * 11, dtype=torch.bfloat16),
        torch.tensor([1e-40, -2e-40, 9e-41] * 11, dtype=torch.bfloat16),
        torch.tensor([65504.0, -60000.0, 1.0] * 11, dtype=torch.float16),
        torch.tensor([6e-8, -1.2e-7, 0.0] * 11, dtype=torch.float16),
        torch.tensor([3.4e38, -3.0e38, 1.0] * 11),
        torch.tensor([1e-45, -3e-45, 7e-45] * 11),
        torch.zeros(40, dtype=torch.bfloat16),
    ]
    assert _ready(ts).startswith("kernel (")
    for t in cases:
        got = sp.stats_kernel.fused_stats(t)
        assert got is not None, t
        _one_ulp(got, _truth(t))


@needs_cc
@x86
def test_kernel_hands_over_what_it_cannot_do_exactly(ts, monkeypatch):
    """Not finite, a mean large next to the spread, a constant, another dtype or a strided
    layout: None, and the float32 path's answer (the same one as with the kernel off)."""
    gen = torch.Generator().manual_seed(5)
    cases = [
        torch.tensor([1.0, float("nan"), 3.0] * 9, dtype=torch.bfloat16),
        torch.tensor([1.0, float("inf"), 3.0] * 9),
        torch.tensor([-float("inf"), float("inf")] * 9, dtype=torch.float16),
        torch.randn(1 << 16, generator=gen) * 1e-3 + 1e3,
        torch.randn(100_000, generator=gen).round() + 1e7,
        torch.full((5000,), 7.25, dtype=torch.bfloat16),
        torch.randn(40, 30, generator=gen).t(),
        torch.arange(10, dtype=torch.float64),
        torch.arange(10, dtype=torch.int32),
    ]
    assert _ready(ts).startswith("kernel (")
    for t in cases:
        assert sp.stats_kernel.fused_stats(t) is None
    kernel = [sp.stats.host_stats(t) for t in cases]
    monkeypatch.setenv("TENSOR_SAVE_ACCELERATORS", "none")
    ts.configure()
    eager = [sp.stats.host_stats(t) for t in cases]
    for k, e in zip(kernel, eager, strict=True):
        assert k == pytest.approx(e, nan_ok=True)
    off = "torch operators (stats-kernel is not in TENSOR_SAVE_ACCELERATORS)"
    assert ts.stats_kernel_status() == off


@needs_cc
@x86
def test_kernel_reads_only_plain_host_memory(ts):
    """A subclass that wraps two tensors (its own pointer is null), a lazily negated view,
    a sparse or meta tensor: never handed to the kernel, which reads raw memory. A
    parameter is plain memory."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = torch.randn(64)
    assert _ready(ts).startswith("kernel (")
    assert sp.stats_kernel.fused_stats(torch.nn.Parameter(x.clone())) is not None
    for t in [
        TwoTensor(torch.randn(96, 128), torch.randn(96, 128)),
        torch._neg_view(x),
        x.to_sparse(),
        torch.empty(64, device="meta"),
    ]:
        assert sp.stats_kernel.fused_stats(t) is None, type(t)
    neg = torch._neg_view(x)
    assert sp.stats.host_stats(neg) == pytest.approx(_truth(-x), rel=1e-6)


@needs_cc
@x86
def test_mean_large_next_to_the_spread_is_left_to_two_passes(ts):
    """On 2**20 values a mean up to about 200 spreads stays with the kernel (n var at least
    3 * depth * 2**-26 of the sum of squares, depth 256 + 256 + 25); past it the two-pass
    path gives the spread. Both within 1e-6 of float64's."""
    gen = torch.Generator().manual_seed(9)
    assert _ready(ts).startswith("kernel (")
    for shift, kernel in [(0.0, True), (30.0, True), (150.0, True), (300.0, False), (1e5, False)]:
        t = torch.randn(1 << 20, generator=gen) + shift
        assert (sp.stats_kernel.fused_stats(t) is not None) is kernel, shift
        got = sp.stats.host_stats(t)
        want = _truth(t)
        assert got[2:] == pytest.approx(want[2:], rel=1e-6)


def test_the_bound_follows_the_kernels_blocks(ts):
    """``_sums_depth`` describes the C source's blocks; tensors too large for any spread to
    be kept skip the kernel's pass."""
    assert f"#define QP_BLOCK {sp.stats_kernel._STATS_BLOCK}\n" in sp.stats_kernel._STATS_C
    assert sp.stats_kernel._sums_depth(1 << 20) == 256 + 256 + 25
    assert sp.stats_kernel._exact_enough(1 << 30, 1.0, 1.0)
    assert not sp.stats_kernel._exact_enough(1 << 37, 1.0, 1.0)


@pytest.fixture
def scratch_tmp(monkeypatch, tmp_path):
    """The system's temporary directory, for this test alone (kernels built outside the
    cache go there, and must not stay)."""
    import tempfile

    where = tmp_path / "tmp"
    where.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where


@needs_cc
@x86
def test_compiled_once_then_loaded_from_the_cache(ts, tmp_path, scratch_tmp):
    where = tmp_path / "kernels"
    assert ts.stats_kernel_status().startswith(f"kernel (compiled: {where}")
    files = list(where.iterdir())
    assert len(files) == 1 and files[0].name.startswith("tensor_stats_")  # no leftovers
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    assert not list(scratch_tmp.iterdir())
    sp.stats_kernel.forget()
    assert ts.stats_kernel_status() == f"kernel (cached: {files[0]})"


@needs_cc
@x86
def test_a_compile_never_holds_up_the_saver(ts, monkeypatch, tmp_path):
    """While the kernel is compiled (here by a compiler held at a barrier until the test lets
    it go) torch's operators compute the statistics: nothing waits for it, and it is used
    once it is there."""
    import threading

    cc = _cc()
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    held = tmp_path / "held-cc"  # `--version` at once; the compile only once released
    held.write_text(
        f'#!/bin/sh\ncase "$*" in *--version*) exec {cc} "$@";; esac\n'
        f'read go < {gate}\nexec {cc} "$@"\n'
    )
    held.chmod(0o755)
    monkeypatch.setenv("CC", str(held))
    t = (torch.randn(4096, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16)
    seen: dict[str, object] = {}

    def meanwhile() -> None:
        seen["fused"] = sp.stats_kernel.fused_stats(t)
        seen["kernel"] = sp.stats_kernel.kernel()
        seen["eager"] = sp.stats.host_stats(t)

    release = os.open(gate, os.O_RDWR)  # never blocks; the line waits here until read
    try:
        worker = threading.Thread(target=meanwhile, daemon=True)
        worker.start()
        worker.join(120)  # finishes at once unless it waits for the held compiler
        assert not worker.is_alive(), "the saver waited for the compiler"
        assert seen["fused"] is None
        assert seen["kernel"] == (None, "being loaded or compiled")
        os.write(release, b"go\n")  # now the compiler may run
        assert _ready(ts).startswith("kernel (compiled: ")
    finally:
        os.close(release)
    eager = seen["eager"]
    got = sp.stats_kernel.fused_stats(t)
    assert got is not None
    _one_ulp(got, _truth(t))
    # torch's operators sum in another order than the kernel: the mean (near 0) differs by a
    # few float32 roundings of the sum, an absolute error, not a relative one
    assert eager == pytest.approx(got, rel=1e-6, abs=1e-6)


@needs_cc
@x86
def test_a_hung_compiler_is_stopped_with_its_children(ts, monkeypatch, tmp_path):
    """Past ``_COMPILE_TIMEOUT`` the compiler's whole session is killed (cc1, as and ld
    would be its children), its build directory removed, and the operators stay."""
    pidfile = tmp_path / "child.pid"
    hung = tmp_path / "hung-cc"
    hung.write_text(f"#!/bin/sh\nsleep 1000 &\necho $! > {pidfile}\nwait\n")
    hung.chmod(0o755)
    monkeypatch.setenv("CC", str(hung))
    monkeypatch.setattr(sp.stats_kernel, "_COMPILE_TIMEOUT", 1.0)
    assert _ready(ts) == f"torch operators ({hung} took over 1 s and was stopped)"
    child = int(pidfile.read_text())
    _exited(child, "the compiler's child still runs")
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == []


@needs_cc
@x86
@pytest.mark.parametrize("bad", ["garbage", "wrong_answers", "no_symbol"])
def test_a_cached_kernel_that_fails_is_compiled_again(ts, tmp_path, bad):
    """A cached file that does not load, lacks the functions or answers wrong is replaced
    by a fresh compile (under a new inode: the bad one may already be mapped)."""
    where = tmp_path / "kernels"
    assert _ready(ts).startswith("kernel (compiled: ")
    (target,) = where.iterdir()
    fake = tmp_path / "fake"
    if bad == "garbage":
        fake.write_bytes(b"not a library")
    else:
        body = {
            "wrong_answers": "int qp_supported(void) { return 1; }\n"
            "int qp_tensor_stats(const void *p, long n, int k, double *o)"
            " { o[0] = o[1] = o[2] = o[3] = 0.0; return 0; }",
            "no_symbol": "int something_else(void) { return 0; }",
        }[bad]
        src = tmp_path / "fake.c"
        src.write_text(body + "\n")
        cc = _cc()
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(fake), str(src)], check=True)
    os.replace(fake, target)
    sp.stats_kernel.forget()
    assert _ready(ts) == f"kernel (compiled: {target})"
    assert [p.name for p in where.iterdir()] == [target.name]
    # the next process loads the new file (this one keeps the bad library mapped under
    # that name, and dlopen answers a name it has loaded with what it loaded)
    assert _status_in_a_new_process(where) == f"kernel (cached: {target})"


def _status_in_a_new_process(where: Path, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    full["TENSOR_SAVE_KERNEL_DIR"] = str(where)
    full["TENSOR_SAVE_ACCELERATORS"] = "stats-kernel"
    full.update(env)
    code = "from quantpatch.runtime import tensor_saver as ts; print(ts.stats_kernel_status())"
    run = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True
    )
    return run.stdout.strip()


@needs_cc
@x86
def test_a_cpu_without_avx2_is_told_once(ts, tmp_path):
    """A cached kernel on a CPU that lacks the instructions: the operators, without a
    compile on every start."""
    where = tmp_path / "kernels"
    assert _ready(ts).startswith("kernel (compiled: ")
    (target,) = where.iterdir()
    src = tmp_path / "old-cpu.c"
    src.write_text(
        "int qp_supported(void) { return 0; }\n"
        "int qp_tensor_stats(const void *p, long n, int k, double *o) { return 1; }\n"
    )
    cc = _cc()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "old.so"), str(src)], check=True)
    os.replace(tmp_path / "old.so", target)
    (tmp_path / "no-cc").mkdir()  # no compiler: any cached library of this source is used
    status = _status_in_a_new_process(where, PATH=str(tmp_path / "no-cc"))
    assert status == "torch operators (the CPU lacks AVX2, FMA or F16C)"


@needs_cc
@x86
@pytest.mark.parametrize("what", ["directory", "file", "not_a_directory", "no_home"])
def test_a_cache_that_cannot_be_used_leaves_nothing_behind(
    ts, monkeypatch, tmp_path, scratch_tmp, what
):
    """Code is loaded from the cache: a directory or file that others can write is not
    used, nor a path that is no directory, nor a home that cannot be found; the kernel is
    then compiled for this process alone, in a temporary directory removed once it is
    loaded."""
    where = tmp_path / "kernels"
    if what == "directory":
        where.mkdir()
        where.chmod(0o777)
        why = f"{where} is not a directory of this user's alone"
    elif what == "file":
        assert _ready(ts).startswith("kernel (compiled: ")
        (target,) = where.iterdir()
        target.chmod(0o666)
        sp.stats_kernel.forget()
        why = f"{target} is not this user's alone"
    elif what == "not_a_directory":
        where.write_text("a file")
        why = f"no cache directory: {where} is not a directory"
    else:
        for name in ("TENSOR_SAVE_KERNEL_DIR", "QUANTPATCH_CACHE", "XDG_CACHE_HOME"):
            monkeypatch.delenv(name, raising=False)

        def no_home() -> Path:
            raise RuntimeError("Could not determine home directory.")

        monkeypatch.setattr(Path, "home", staticmethod(no_home))
        why = "no cache directory: Could not determine home directory."
    status = _ready(ts)
    assert status.startswith(f"kernel (compiled, not cached: {why}"), status
    assert not list(scratch_tmp.iterdir())
    t = torch.randn(100).to(torch.bfloat16)
    assert sp.stats_kernel.fused_stats(t) is not None
    if what in ("directory", "file"):
        assert len(list(where.iterdir())) == (0 if what == "directory" else 1)


def test_a_failure_looking_for_the_kernel_never_fails_a_save(ts, monkeypatch, tmp_path):
    """Whatever goes wrong while the kernel is looked for, the operators compute the
    statistics and the file is written."""

    def broken(cc: object) -> tuple[object, str]:
        raise OSError("something unforeseen")

    monkeypatch.setattr(sp.stats_kernel, "_cache_target", broken)
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "true")
    monkeypatch.setenv("TENSOR_SAVE_DIR", str(tmp_path / "t"))
    ts.configure()
    ts.save_tensor(torch.randn(64, 64).to(torch.bfloat16), "linear", "forward", "bf16", "x", 1)
    report = ts.flush()
    assert (report["files"], report["failed"]) == (1, 0)
    assert ts.stats_kernel_status() == (
        "torch operators (the kernel could not be looked for (OSError: something unforeseen))"
    )


def test_without_a_compiler_the_operators_compute_the_stats(ts, monkeypatch, tmp_path):
    t = (torch.randn(1000) * 3).to(torch.bfloat16)
    monkeypatch.setenv("TENSOR_SAVE_ACCELERATORS", "none")
    ts.configure()
    eager = sp.stats.host_stats(t)
    monkeypatch.setenv("TENSOR_SAVE_ACCELERATORS", "stats-kernel")
    ts.configure()
    for cc, why in [
        (str(tmp_path / "no-such-cc"), "could not run (FileNotFoundError"),
        ("false", "failed (no output)"),
    ]:
        monkeypatch.setenv("CC", cc)
        sp.stats_kernel.forget()
        assert sp.stats.host_stats(t) == eager
        assert _ready(ts).startswith(f"torch operators ({cc} {why}"), cc
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    sp.stats_kernel.forget()
    assert sp.stats.host_stats(t) == eager
    assert _ready(ts) == "torch operators (no C compiler (cc, gcc or clang) on PATH)"
    assert not list((tmp_path / "kernels").glob("*.so"))


@needs_cc
@x86
def test_cc_may_hold_a_command_with_arguments(ts, monkeypatch):
    """``CC="ccache gcc"`` or ``CC="gcc -O1"``: split as a shell would."""
    cc = _cc()
    monkeypatch.setenv("CC", f"{cc} -Wall")
    assert _ready(ts).startswith("kernel (compiled: ")


def test_other_machines_use_the_operators(ts, monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    t = torch.randn(100).to(torch.bfloat16)
    assert sp.stats_kernel.fused_stats(t) is None
    assert ts.stats_kernel_status() == "torch operators (not an x86-64 host (aarch64))"


@needs_cc
@x86
def test_ranks_that_start_together_share_one_cached_kernel(tmp_path):
    """Four processes compile at once into one empty cache: each gets a working kernel,
    and one file is left."""
    code = textwrap.dedent(
        """
        import torch
        from quantpatch.runtime import tensor_saver as ts
        from quantpatch.runtime.quantpatch_saver import stats_kernel
        print(ts.stats_kernel_status())
        t = torch.arange(100, dtype=torch.bfloat16)
        assert stats_kernel.fused_stats(t) is not None
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env["TENSOR_SAVE_KERNEL_DIR"] = str(tmp_path / "kernels")
    env["TENSOR_SAVE_ACCELERATORS"] = "stats-kernel"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(o.startswith("kernel (") for o in outs)
    assert len(list((tmp_path / "kernels").iterdir())) == 1


@needs_cc
@x86
def test_threads_that_ask_together_get_one_kernel(ts, tmp_path):
    """One build per process, whichever threads ask at once."""
    import threading

    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(_ready(ts))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(got)) == 1 and got[0].startswith("kernel (compiled: ")
    assert len(list((tmp_path / "kernels").iterdir())) == 1


@needs_cc
@x86
def test_saved_files_hold_the_kernels_statistics(ts, monkeypatch, tmp_path):
    """End to end through the statistics thread: every file's tensor_info is float64's
    answer rounded to float32."""
    assert _ready(ts).startswith("kernel (")
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "true")
    monkeypatch.setenv("TENSOR_SAVE_DIR", str(tmp_path / "t"))
    ts.configure()
    gen = torch.Generator().manual_seed(2)
    tensors = [
        (torch.randn(256, 129, generator=gen) * s + s / 3).to(torch.bfloat16)
        for s in (0.01, 1.0, 40.0)
    ]
    for i, t in enumerate(tensors):
        ts.save_tensor(t, "linear", "forward", "bf16", f"t{i}", 1)
    assert ts.flush()["files"] == 3
    for path in sorted((tmp_path / "t").rglob("*.pt")):
        obj = torch.load(path, weights_only=True)
        info = obj["tensor_info"]
        got = [info["min"], info["max"], info["mean"], info["std"]]
        _one_ulp(got, _truth(obj["tensor"]))
        assert math.isfinite(info["std"])


# --- the cache's trust rule, checked on descriptors ------------------------------------------


def _refusal(ts, directory: Path) -> str:
    """Why ``_open_cache_dir`` refuses ``directory`` ("" where it opens it)."""
    try:
        fd = sp.stats_kernel._open_cache_dir(directory)
    except sp.stats_kernel._Refused as exc:
        return str(exc)
    os.close(fd)
    return ""


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to uid 65534")


def test_the_cache_directory_may_not_be_a_link(ts, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "kernels").symlink_to(real)
    assert _refusal(ts, tmp_path / "kernels") == f"{tmp_path / 'kernels'} is a symbolic link"
    assert _refusal(ts, real) == ""
    # a link above it is resolved once, by name, and what it leads to is checked instead
    (tmp_path / "up").symlink_to(tmp_path)
    assert _refusal(ts, tmp_path / "up" / "real") == ""


def test_a_directory_above_the_cache_that_others_can_write_is_refused(ts, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)  # umask 002 and a shared group: the group can rename kernels/
    assert _refusal(ts, shared / "deep" / "kernels") == (
        f"{shared} lets others rename what it holds (owner uid {os.geteuid()}, mode 775)"
    )
    assert not (shared / "deep").exists()  # refused before anything is made below it
    shared.chmod(0o1777)  # sticky (/tmp): others cannot rename what is not theirs
    assert _refusal(ts, shared / "deep" / "kernels") == ""
    for made in (shared / "deep", shared / "deep" / "kernels"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700


@needs_root
def test_a_directory_above_the_cache_of_another_user_is_refused(ts, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    assert _refusal(ts, theirs / "kernels") == (
        f"{theirs} lets others rename what it holds (owner uid 65534, mode 755)"
    )
    mine = tmp_path / "kernels"
    mine.mkdir(mode=0o700)
    os.chown(mine, 65534, 65534)
    assert _refusal(ts, mine) == f"{mine} is not a directory of this user's alone"


@needs_cc
@x86
@pytest.mark.parametrize("how", ["linked_directory", "linked_library", "shared_parent"])
def test_a_cache_that_could_be_swapped_is_not_used(ts, monkeypatch, tmp_path, scratch_tmp, how):
    """What the descriptor-based check refuses, end to end: the kernel is compiled for this
    process alone, and nothing is loaded from the cache."""
    assert _ready(ts).startswith("kernel (compiled: ")
    (genuine,) = (tmp_path / "kernels").iterdir()
    if how == "linked_directory":
        where = tmp_path / "link"
        where.symlink_to(tmp_path / "kernels")
        why = f"{where} is a symbolic link"
    elif how == "linked_library":
        where = tmp_path / "other"
        where.mkdir(mode=0o700)
        (where / genuine.name).symlink_to(genuine)
        why = f"{where / genuine.name} is not this user's alone ("
    else:
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        (shared / "kernels").mkdir(mode=0o700)
        shutil.copy2(genuine, shared / "kernels" / genuine.name)
        where = shared / "kernels"
        why = f"{shared} lets others rename what it holds"
    monkeypatch.setenv("TENSOR_SAVE_KERNEL_DIR", str(where))
    sp.stats_kernel.forget()
    status = _ready(ts)
    assert status.startswith(f"kernel (compiled, not cached: {why}"), status


@x86
def test_without_proc_nothing_is_loaded(ts, monkeypatch, scratch_tmp):
    """The kernel is loaded only through ``/proc/self/fd``: where that is missing, neither
    the cache nor a build of this process's own is used, and torch's operators stay."""

    def no_proc(fd: int) -> str:
        raise sp.stats_kernel._Refused("no /proc/self/fd to load the kernel through a descriptor")

    monkeypatch.setattr(sp.stats_kernel, "_proc_path", no_proc)
    assert (
        _ready(ts) == "torch operators (no /proc/self/fd to load the kernel through a descriptor)"
    )
    assert sp.stats_kernel.fused_stats(torch.randn(100).to(torch.bfloat16)) is None
    assert not list(scratch_tmp.iterdir())


_EVIL_C = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void evil(void) {
    int fd = open("MARKER", O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) close(fd);
}
"""

_SWAPPER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
/* argv[1]: the shared directory, argv[2]: the file naming the pair to swap, argv[3]: where
   to count the swaps. Exchanges c<i> and e<i> (atomically: c<i> is always there, the
   victim's or the swapper's), over and over, until told "stop". */
int main(int argc, char **argv) {
    char c[4096], e[4096], buf[32];
    long swaps = 0;
    if (argc != 4) return 2;
    for (;;) {
        FILE *f = fopen(argv[2], "r");
        if (!f) continue;
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        if (!strcmp(buf, "stop")) break;
        if (!n || buf[0] == '-') continue;
        snprintf(c, sizeof c, "%s/c%s", argv[1], buf);
        snprintf(e, sizeof e, "%s/e%s", argv[1], buf);
        for (int k = 0; k < 1000; k++)
            if (!renameat2(AT_FDCWD, c, AT_FDCWD, e, RENAME_EXCHANGE)) swaps++;
    }
    FILE *out = fopen(argv[3], "w");
    if (out) { fprintf(out, "%ld\n", swaps); fclose(out); }
    return 0;
}
"""


@needs_cc
@x86
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run the swapping process as a second user (uid 65534)",
)
@pytest.mark.parametrize("rule", ["as_is", "descriptors_alone"])
def test_a_directory_swapped_above_the_cache_never_gets_its_library_loaded(
    ts, monkeypatch, tmp_path, rule
):
    """A second user who can rename entries of a directory above ``kernels/`` swaps in, over
    and over, a directory holding a library of the cached name whose constructor writes a
    marker file, while this process looks for its kernel there: the marker never appears
    (the check once went by path, and the load by path again). The rule on the directories
    above refuses such a cache outright; with it switched off, the descriptors alone keep
    what was checked what is loaded."""
    import tempfile

    if rule == "descriptors_alone":
        monkeypatch.setattr(sp.stats_kernel, "_ancestor_trusted", lambda st: True)

    cc = _cc()
    # a compiler that builds the genuine library once, then fails at once: every try below
    # looks in the cache (under this compiler's entry) without a 0.5 s compile
    gate, once = tmp_path / "may-compile", tmp_path / "cc-once"
    gate.touch()
    once.write_text(
        f'#!/bin/sh\ncase "$*" in *--version*) exec {cc} "$@";; esac\n'
        f'[ -e {gate} ] && exec {cc} "$@"\nexit 1\n'
    )
    once.chmod(0o755)
    monkeypatch.setenv("CC", str(once))
    assert _ready(ts).startswith("kernel (compiled: ")
    gate.unlink()
    (genuine,) = (tmp_path / "kernels").iterdir()
    base = Path(tempfile.mkdtemp(prefix="qp-swap-"))  # tmp_path is 0700: out of uid 65534's reach
    swapper = None
    try:
        base.chmod(0o711)
        marker, current, count = base / "marker", base / "current", base / "count"
        current.write_text("-")
        current.chmod(0o644)
        shared = base / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        (tmp_path / "evil.c").write_text(_EVIL_C.replace("MARKER", str(marker)))
        (tmp_path / "swapper.c").write_text(_SWAPPER_C)
        evil, program = tmp_path / "evil.so", base / "swapper"
        subprocess.run(
            [cc, "-shared", "-fPIC", "-o", str(evil), str(tmp_path / "evil.c")], check=True
        )
        subprocess.run([cc, "-O2", "-o", str(program), str(tmp_path / "swapper.c")], check=True)
        program.chmod(0o755)
        tries = 500
        for i in range(tries):
            mine, theirs = shared / f"c{i}" / "kernels", shared / f"e{i}" / "kernels"
            mine.mkdir(parents=True, mode=0o700)
            mine.parent.chmod(0o700)
            shutil.copy2(genuine, mine / genuine.name)
            theirs.mkdir(parents=True)
            shutil.copy2(evil, theirs / genuine.name)
            for path in (theirs.parent, theirs, theirs / genuine.name):
                os.chown(path, 65534, 65534)
                path.chmod(0o755)
        count.touch()
        os.chown(count, 65534, 65534)
        swapper = subprocess.Popen(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                str(program),
                str(shared),
                str(current),
                str(count),
            ]
        )
        seen = []
        for i in range(tries):
            current.write_text(str(i))
            monkeypatch.setenv("TENSOR_SAVE_KERNEL_DIR", str(shared / f"c{i}" / "kernels"))
            sp.stats_kernel.forget()
            seen.append(ts.stats_kernel_status())
            assert not marker.exists(), f"the swapped-in library ran (try {i})"
        current.write_text("stop")
        assert swapper.wait(timeout=60) == 0
        swapper = None
        assert int(count.read_text()) > 0  # the swaps did happen
        # refused outright; with the rule off, the genuine library is loaded in some tries
        cached = sum(s.startswith("kernel (cached: ") for s in seen)
        assert (cached == 0) if rule == "as_is" else (cached > 0)
        assert not marker.exists()
    finally:
        if swapper is not None:
            current.write_text("stop")
            try:
                swapper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                swapper.kill()
                swapper.wait()
        shutil.rmtree(base, ignore_errors=True)


# --- the compiler in the cache key; a build that does not follow the user's -march -----------


def _logging_cc(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A compiler command that writes its arguments (one a line) to a log, then compiles."""
    log, script = tmp_path / f"{name}.log", tmp_path / name
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\nexec {_cc()} "$@"\n')
    script.chmod(0o755)
    return script, log


@needs_cc
@x86
def test_each_compiler_command_gets_its_own_cache_entry(ts, monkeypatch, tmp_path):
    """Two ``$CC`` commands, two entries: neither is served the other's library."""
    where = tmp_path / "kernels"
    first, _ = _logging_cc(tmp_path, "cc-one")
    monkeypatch.setenv("CC", str(first))
    assert _ready(ts).startswith("kernel (compiled: ")
    monkeypatch.setenv("CC", f"{first} -O1")
    sp.stats_kernel.forget()
    assert _ready(ts).startswith("kernel (compiled: ")
    assert len(list(where.iterdir())) == 2
    sp.stats_kernel.forget()
    assert _ready(ts).startswith("kernel (cached: ")


@needs_cc
@x86
def test_the_build_ends_with_the_generic_isa_whatever_cc_says(tmp_path):
    """``CC="cc -march=sapphirerapids -mavx512f"``: the flags the saver adds come after the
    user's, and end with plain x86-64 (the AVX2 code comes from function attributes). In a
    process of its own: on a CPU without AVX-512 the build this replaced died of SIGILL."""
    script, log = _logging_cc(tmp_path, "cc-log")
    cc = f"{script} -march=sapphirerapids -mavx512f"
    status = _status_in_a_new_process(tmp_path / "kernels", CC=cc)
    args = log.read_text().split("\n")
    assert args[:2] == ["-march=sapphirerapids", "-mavx512f"]
    out = args.index("-o")
    assert args[out - 3 : out] == ["-march=x86-64", "-mtune=generic", "-mno-avx"], args
    assert [a for a in args if a.startswith("-march=")][-1] == "-march=x86-64"
    if status.startswith("kernel (compiled: "):  # this compiler knows sapphirerapids
        objdump = shutil.which("objdump")
        if objdump is not None:
            (lib,) = (tmp_path / "kernels").iterdir()
            code = subprocess.run(
                [objdump, "-d", str(lib)], capture_output=True, text=True, check=True
            ).stdout
            # EVEX only: zmm registers, ymm/xmm 16-31, opmask registers
            assert not re.search(r"zmm|[xy]mm(1[6-9]|2\d|3[01])|\{%?k[1-7]\}", code)


# --- the cache under umask 002; build folders a killed process left ---------------------------


@needs_cc
@x86
def test_a_umask_002_run_caches_the_kernel_for_the_next(tmp_path):
    """Made 0700 (directories) and 0700 (library) whatever the umask: the second process
    loads what the first compiled (it was cached 0775, then refused as not this user's
    alone)."""
    where = tmp_path / "cache" / "quantpatch" / "kernels"
    code = "import os; os.umask(0o002)\n" + (
        "from quantpatch.runtime import tensor_saver as ts; print(ts.stats_kernel_status())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env["TENSOR_SAVE_KERNEL_DIR"] = str(where)
    env["TENSOR_SAVE_ACCELERATORS"] = "stats-kernel"
    got = [
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    (lib,) = where.iterdir()
    assert got == [f"kernel (compiled: {lib})", f"kernel (cached: {lib})"]
    for path in (where.parent.parent, where.parent, where, lib):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


@needs_cc
@x86
def test_a_build_folder_left_by_a_killed_process_is_swept(ts, tmp_path):
    """A process killed while its kernel compiles leaves its ``.build-HOST-PID-XXXX``
    folder; the next build removes it (its process is gone), and one older than an hour
    whoever made it, but not that of a process still running."""
    import signal
    import socket

    where = tmp_path / "kernels"
    pidfile, slow = tmp_path / "cc.pid", tmp_path / "slow-cc"
    os.mkfifo(pidfile)
    slow.write_text(
        f'#!/bin/sh\ncase "$*" in *--version*) exec {_cc()} "$@";; esac\n'
        f"echo $$ > {pidfile}\nexec sleep 3600\n"
    )
    slow.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env.update(
        TENSOR_SAVE_KERNEL_DIR=str(where), TENSOR_SAVE_ACCELERATORS="stats-kernel", CC=str(slow)
    )
    code = "from quantpatch.runtime import tensor_saver as ts; ts.stats_kernel_status()"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    # the compiler writes its pid into a named pipe: a barrier, read once it is there (a
    # pipe no writer opened yet is not readable; 120 s only for a compiler never started)
    reader = os.open(pidfile, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert readable(reader, 120), "the compiler never started"
        compiler = int(os.read(reader, 64))
    finally:
        os.close(reader)
        proc.kill()
        proc.wait()
    os.killpg(compiler, signal.SIGKILL)  # the compiler's session
    (left,) = where.glob(".build-*")
    old = where / ".build-a1b2c3d4"  # an older name, or another host's: by age
    old.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    running = where / f".build-{socket.gethostname()}-{os.getpid()}-0000"
    running.mkdir()
    assert _ready(ts).startswith("kernel (compiled: ")
    assert sorted(p.name for p in where.iterdir() if p.name.startswith(".")) == [running.name]
    assert len(list(where.glob("tensor_stats_*.so"))) == 1
    assert not left.exists() and not old.exists()


def test_the_installed_module_imports_torch_and_the_standard_library_only():
    """The contract of ``megatron/core/tensor_saver.py`` and its parts: the kernel is C
    source inside ``stats_kernel.py``, compiled by the system's compiler, loaded with ctypes;
    no other package, and the parts only each other (relative imports, which resolve in
    ``megatron.core`` as in ``quantpatch.runtime``)."""
    import ast

    from quantpatch.checkout.parts import SAVER_PARTS
    from quantpatch.runtime import tensor_saver

    here = Path(tensor_saver.__file__).parent
    files = [Path(tensor_saver.__file__), *sorted((here / "quantpatch_saver").glob("*.py"))]
    imported, relative = set(), set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level:
                relative.add((path.name, node.level, node.module))
            elif isinstance(node, ast.ImportFrom):
                assert node.module is not None
                imported.add(node.module.partition(".")[0])
    assert "ctypes" in imported and len(files) == 1 + len(SAVER_PARTS)  # the API and its parts
    assert imported - set(sys.stdlib_module_names) == {"torch"}
    assert {(n, m) for n, level, m in relative if level != 1} == set()
    assert ("tensor_saver.py", 1, "quantpatch_saver") in relative


def test_these_tests_leave_the_environment_as_they_found_it():
    """Run last in this file: the saver's variables are as they were when it was imported
    (one set by a test above once stayed, and turned tensor saving on in another file's
    launch-script test)."""
    now = {k: v for k, v in os.environ.items() if k.startswith("TENSOR_SAVE")}
    assert now == _SAVER_ENV_AT_IMPORT
