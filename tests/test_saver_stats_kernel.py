"""The saver's one-pass statistics kernel: compiled on first use, cached, checked, and handed
over to torch's operators wherever it cannot give the float64 answer rounded to float32."""

from __future__ import annotations

import math
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

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
    tensor_saver.configure()
    tensor_saver._stats_kernel.cache_clear()
    yield tensor_saver
    monkeypatch.undo()
    tensor_saver.configure()
    tensor_saver._stats_kernel.cache_clear()


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
    got = ts._fused_stats(t)
    assert got is not None
    _one_ulp(got, _truth(t))
    assert ts._host_stats(t) == got
    assert ts.stats_kernel_status().startswith("kernel (compiled: ")


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
    for t in cases:
        got = ts._fused_stats(t)
        assert got is not None, t
        _one_ulp(got, _truth(t))


@needs_cc
@x86
def test_kernel_hands_over_what_it_cannot_do_exactly(ts):
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
    for t in cases:
        assert ts._fused_stats(t) is None
    kernel = [ts._host_stats(t) for t in cases]
    os.environ["TENSOR_SAVE_STATS_KERNEL"] = "false"
    ts.configure()
    eager = [ts._host_stats(t) for t in cases]
    for k, e in zip(kernel, eager, strict=True):
        assert k == pytest.approx(e, nan_ok=True)
    assert ts.stats_kernel_status() == "torch operators (TENSOR_SAVE_STATS_KERNEL is false)"


@needs_cc
@x86
def test_kernel_reads_only_plain_host_memory(ts):
    """A subclass that wraps two tensors (its own pointer is null), a lazily negated view,
    a sparse or meta tensor: never handed to the kernel, which reads raw memory. A
    parameter is plain memory."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = torch.randn(64)
    assert ts._fused_stats(torch.nn.Parameter(x.clone())) is not None
    for t in [
        TwoTensor(torch.randn(96, 128), torch.randn(96, 128)),
        torch._neg_view(x),
        x.to_sparse(),
        torch.empty(64, device="meta"),
    ]:
        assert ts._fused_stats(t) is None, type(t)
    neg = torch._neg_view(x)
    assert ts._host_stats(neg) == pytest.approx(_truth(-x), rel=1e-6)


@needs_cc
@x86
def test_mean_large_next_to_the_spread_is_left_to_two_passes(ts):
    """On 2**20 values a mean up to about 16 spreads stays with the kernel (n var at least
    n * 2**-28 = 2**-8 of the sum of squares); past it the two-pass path gives the spread.
    Both within 1e-6 of float64's."""
    gen = torch.Generator().manual_seed(9)
    for shift, kernel in [(0.0, True), (10.0, True), (30.0, False), (1e5, False)]:
        t = torch.randn(1 << 20, generator=gen) + shift
        assert (ts._fused_stats(t) is not None) is kernel, shift
        got = ts._host_stats(t)
        want = _truth(t)
        assert got[2:] == pytest.approx(want[2:], rel=1e-6)


@needs_cc
@x86
def test_compiled_once_then_loaded_from_the_cache(ts, tmp_path):
    where = tmp_path / "kernels"
    assert ts.stats_kernel_status().startswith(f"kernel (compiled: {where}")
    files = list(where.iterdir())
    assert len(files) == 1 and files[0].name.startswith("tensor_stats_")  # no leftovers
    assert stat.S_IMODE(where.stat().st_mode) == 0o700
    ts._stats_kernel.cache_clear()
    assert ts.stats_kernel_status() == f"kernel (cached: {files[0]})"


@needs_cc
@x86
@pytest.mark.parametrize("bad", ["garbage", "wrong_answers", "no_symbol"])
def test_a_cached_kernel_that_fails_is_compiled_again(ts, tmp_path, bad):
    """A cached file that does not load, lacks the function or answers wrong is replaced by
    a fresh compile (under a new inode: the bad one may already be mapped)."""
    where = tmp_path / "kernels"
    assert ts.stats_kernel_status().startswith("kernel (compiled: ")
    (target,) = where.iterdir()
    fake = tmp_path / "fake"
    if bad == "garbage":
        fake.write_bytes(b"not a library")
    else:
        body = {
            "wrong_answers": "int qp_tensor_stats(const void *p, long n, int k, double *o)"
            " { o[0] = o[1] = o[2] = o[3] = 0.0; return 0; }",
            "no_symbol": "int something_else(void) { return 0; }",
        }[bad]
        src = tmp_path / "fake.c"
        src.write_text(body + "\n")
        cc = next(found for name in ("cc", "gcc", "clang") if (found := shutil.which(name)))
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(fake), str(src)], check=True)
    os.replace(fake, target)
    ts._stats_kernel.cache_clear()
    assert ts.stats_kernel_status() == f"kernel (compiled: {target})"
    assert [p.name for p in where.iterdir()] == [target.name]
    # the next process loads the new file (this one keeps the bad library mapped under
    # that name, and dlopen answers a name it has loaded with what it loaded)
    assert _status_in_a_new_process(where) == f"kernel (cached: {target})"


def _status_in_a_new_process(where: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env["TENSOR_SAVE_KERNEL_DIR"] = str(where)
    code = "from quantpatch.runtime import tensor_saver as ts; print(ts.stats_kernel_status())"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return run.stdout.strip()


@needs_cc
@x86
@pytest.mark.parametrize("what", ["directory", "file"])
def test_a_cache_others_can_write_is_not_used(ts, tmp_path, what):
    """Code is loaded from the cache: a directory or file that others can write is skipped,
    and the kernel is compiled into a private temporary directory instead."""
    where = tmp_path / "kernels"
    if what == "directory":
        where.mkdir()
        where.chmod(0o777)
    else:
        assert ts.stats_kernel_status().startswith("kernel (compiled: ")
        (target,) = where.iterdir()
        target.chmod(0o666)
        ts._stats_kernel.cache_clear()
    status = ts.stats_kernel_status()
    assert status.startswith("kernel (compiled: ") and str(where) not in status
    used = Path(status.removeprefix("kernel (compiled: ").removesuffix(")"))
    assert stat.S_IMODE(used.parent.stat().st_mode) == 0o700
    assert len(list(where.iterdir())) == (0 if what == "directory" else 1)
    shutil.rmtree(used.parent)


def test_without_a_compiler_the_operators_compute_the_stats(ts, monkeypatch, tmp_path):
    t = (torch.randn(1000) * 3).to(torch.bfloat16)
    monkeypatch.setenv("TENSOR_SAVE_STATS_KERNEL", "false")
    ts.configure()
    eager = ts._host_stats(t)
    monkeypatch.setenv("TENSOR_SAVE_STATS_KERNEL", "true")
    ts.configure()
    for cc, why in [
        (str(tmp_path / "no-such-cc"), "could not run (FileNotFoundError"),
        ("false", "failed (no output)"),
    ]:
        monkeypatch.setenv("CC", cc)
        ts._stats_kernel.cache_clear()
        assert ts._host_stats(t) == eager
        assert ts.stats_kernel_status().startswith(f"torch operators ({cc} {why}"), cc
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    ts._stats_kernel.cache_clear()
    assert ts._host_stats(t) == eager
    assert ts.stats_kernel_status() == (
        "torch operators (no C compiler (cc, gcc or clang) on PATH)"
    )
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_other_machines_use_the_operators(ts, monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    t = torch.randn(100).to(torch.bfloat16)
    assert ts._fused_stats(t) is None
    assert ts.stats_kernel_status() == "torch operators (not an x86-64 host (aarch64))"


@needs_cc
@x86
def test_ranks_that_start_together_share_one_cached_kernel(tmp_path):
    """Eight processes compile at once into one empty cache: each gets a working kernel,
    and one file is left."""
    code = textwrap.dedent(
        """
        import torch
        from quantpatch.runtime import tensor_saver as ts
        t = torch.arange(100, dtype=torch.bfloat16)
        assert ts._fused_stats(t) is not None
        print(ts.stats_kernel_status())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env["TENSOR_SAVE_KERNEL_DIR"] = str(tmp_path / "kernels")
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(o.startswith("kernel (") for o in outs)
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [
        next((tmp_path / "kernels").iterdir()).name
    ]


@needs_cc
@x86
def test_saved_files_hold_the_kernels_statistics(ts, tmp_path):
    """End to end through the statistics thread: every file's tensor_info is float64's
    answer rounded to float32."""
    os.environ.update({"TENSOR_SAVE_ENABLED": "true", "TENSOR_SAVE_DIR": str(tmp_path / "t")})
    ts.configure()
    gen = torch.Generator().manual_seed(2)
    tensors = [
        (torch.randn(256, 129, generator=gen) * s + s / 3).to(torch.bfloat16)
        for s in (0.01, 1.0, 40.0)
    ]
    for i, t in enumerate(tensors):
        ts.save_tensor(t, "linear", "forward", "bf16", f"t{i}", 1)
    assert ts.flush()["files"] == 3
    assert ts.stats_kernel_status().startswith("kernel (")
    for path in sorted((tmp_path / "t").rglob("*.pt")):
        obj = torch.load(path, weights_only=True)
        info = obj["tensor_info"]
        got = [info["min"], info["max"], info["mean"], info["std"]]
        _one_ulp(got, _truth(obj["tensor"]))
        assert math.isfinite(info["std"])


def test_the_installed_module_imports_torch_and_the_standard_library_only():
    """The contract of ``megatron/core/tensor_saver.py``: the kernel is C source inside it,
    compiled by the system's compiler, loaded with ctypes; no other package."""
    import ast

    from quantpatch.runtime import tensor_saver

    tree = ast.parse(Path(tensor_saver.__file__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module is not None
            imported.add(node.module.partition(".")[0])
    assert "ctypes" in imported
    assert imported - set(sys.stdlib_module_names) == {"torch"}
