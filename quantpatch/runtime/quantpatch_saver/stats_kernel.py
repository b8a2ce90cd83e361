"""The statistics accelerator: one pass of a small C kernel over a plain bfloat16, float16
or float32 host tensor (the float32 minimum and maximum, the float64 sum and sum of
squares), compiled with the system's C compiler on first use, in a thread of its own, and
cached per user in a directory no other user can change. Opt-in: ``stats-kernel`` in
``TENSOR_SAVE_ACCELERATORS``; torch's operators (``stats.py``) are the default and answer
wherever this declines (``fused_stats`` returns None).

Code from the cache runs inside training, so the cache is opened one directory at a time from
``/``, following no link, every check made on the open descriptor, and the library loaded
through ``/proc/self/fd/N`` of the descriptor checked (``_open_cache_dir``)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .dtypes import float32s

_STATS_C = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

/* kind: 0 bfloat16, 1 float16, 2 float32; each value is exact as a float and as a double */
#define QP_TARGET __attribute__((target("avx2,fma,f16c")))
#define QP_BLOCK 4096

int qp_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c");
}

QP_TARGET static inline __m256 qp_load8(const void *p, int64_t i, int kind) {
    if (kind == 2) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (kind == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

QP_TARGET static inline float qp_load1(const void *p, int64_t i, int kind) {
    if (kind == 2) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (kind == 1) return _cvtsh_ss(h);
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* out: min, max (float), sum and sum of squares (double: 16 accumulators per block of
   QP_BLOCK values, whose sums go into 4 running totals) */
QP_TARGET static void qp_stats_avx2(const void *p, int64_t n, int kind, double *out) {
    __m256 mn0 = _mm256_set1_ps(__builtin_inff()), mn1 = mn0;
    __m256 mx0 = _mm256_set1_ps(-__builtin_inff()), mx1 = mx0;
    __m256d ts = _mm256_setzero_pd(), tq = ts;
    int64_t i = 0;
    while (i + 16 <= n) {
        int64_t end = n - i > QP_BLOCK ? i + QP_BLOCK : n;
        __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
        __m256d q0 = s0, q1 = s0, q2 = s0, q3 = s0;
        for (; i + 16 <= end; i += 16) {
            __m256 a = qp_load8(p, i, kind), b = qp_load8(p, i + 8, kind);
            mn0 = _mm256_min_ps(mn0, a);
            mx0 = _mm256_max_ps(mx0, a);
            mn1 = _mm256_min_ps(mn1, b);
            mx1 = _mm256_max_ps(mx1, b);
            __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
            __m256d a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
            __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
            __m256d b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
            s0 = _mm256_add_pd(s0, a0);
            q0 = _mm256_fmadd_pd(a0, a0, q0);
            s1 = _mm256_add_pd(s1, a1);
            q1 = _mm256_fmadd_pd(a1, a1, q1);
            s2 = _mm256_add_pd(s2, b0);
            q2 = _mm256_fmadd_pd(b0, b0, q2);
            s3 = _mm256_add_pd(s3, b1);
            q3 = _mm256_fmadd_pd(b1, b1, q3);
        }
        ts = _mm256_add_pd(ts, _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
        tq = _mm256_add_pd(tq, _mm256_add_pd(_mm256_add_pd(q0, q1), _mm256_add_pd(q2, q3)));
    }
    float lo[8], hi[8];
    double s[4], q[4];
    _mm256_storeu_ps(lo, _mm256_min_ps(mn0, mn1));
    _mm256_storeu_ps(hi, _mm256_max_ps(mx0, mx1));
    _mm256_storeu_pd(s, ts);
    _mm256_storeu_pd(q, tq);
    float mn = lo[0], mx = hi[0];
    double sum = 0.0, squares = 0.0;
    for (int j = 0; j < 8; j++) {
        mn = lo[j] < mn ? lo[j] : mn;
        mx = hi[j] > mx ? hi[j] : mx;
    }
    for (int j = 0; j < 4; j++) {
        sum += s[j];
        squares += q[j];
    }
    for (; i < n; i++) {
        float x = qp_load1(p, i, kind);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
        sum += x;
        squares += (double)x * x;
    }
    out[0] = mn;
    out[1] = mx;
    out[2] = sum;
    out[3] = squares;
}

int qp_tensor_stats(const void *p, int64_t n, int kind, double *out) {
    if (!qp_supported() || kind < 0 || kind > 2 || n < 1) return 1;
    qp_stats_avx2(p, n, kind, out);
    return 0;
}
"""
"""The one-pass statistics of a host tensor (C, GCC/Clang with x86 intrinsics): the float32
minimum and maximum and the float64 sum and sum of squares of its bfloat16, float16 or
float32 values. torch's operators need five passes (a float32 copy, ``aminmax``, a sum, the
squares, their sum: 44-49 ms for 80 tensors of 1024x1024 bf16 on one core here); this needs
one over the 2-byte values (21-31 ms), which left the writer's other core to the files.
Compiled for AVX2/FMA/F16C by function attributes (not ``-march``), so one cached library
serves every x86-64 machine of a shared home; it asks the CPU before it runs."""
_STATS_CFLAGS = ("-O2", "-shared", "-fPIC")
_STATS_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_STATS_BLOCK = 4096
"""``QP_BLOCK`` in ``_STATS_C``."""
_COMPILE_TIMEOUT = 120.0
"""Seconds the compiler may take (in its own thread, never training's) before it and its
children are killed and torch's operators stay in use."""


def _sums_depth(n: int) -> float:
    """The most additions any value of an ``n``-element sum goes through in the kernel: the
    block's 16 accumulators (``_STATS_BLOCK``/16 each), the block totals (n/``_STATS_BLOCK``),
    and at most 25 more (combining the lanes, the last 15 values): each float64 sum is
    within depth * 2**-53 of the sum of the magnitudes."""
    return _STATS_BLOCK / 16 + n / _STATS_BLOCK + 25


def _exact_enough(n: int, squares: float, deviation: float) -> bool:
    """Whether n var = S2 - S*mean (``deviation``) from the kernel's float64 sums is within
    2**-27 of itself. Each sum is within depth * 2**-53 * S2 (``_sums_depth``; the sum of
    magnitudes times the mean is at most S2, by Cauchy-Schwarz), so the difference is within
    3 * depth * 2**-53 * S2: kept where that is at most 2**-27 of it (the std then within
    2**-28, below float32's rounding). On 2**20 values that keeps a mean up to about 200
    spreads, on 2**24 up to 70; past it the float32 path's two passes give the spread."""
    return deviation >= squares * 3 * _sums_depth(n) * 2.0**-26


def _kernel_dir() -> Path:
    """``TENSOR_SAVE_KERNEL_DIR``, else ``kernels`` in quantpatch's cache (``QUANTPATCH_CACHE``
    or ``XDG_CACHE_HOME``, then ``~/.cache``, each with ``quantpatch``: where the CLI keeps
    its own, as ``quantpatch.base.megatron_source.cache_dir`` finds it, which this installed
    module cannot import); a directory of its own, so that the CLI's (which the umask may
    leave group-writable) does not decide whether code may be loaded."""
    raw = (os.environ.get("TENSOR_SAVE_KERNEL_DIR") or "").strip()
    if raw:
        return Path(raw)
    base = (os.environ.get("QUANTPATCH_CACHE") or os.environ.get("XDG_CACHE_HOME") or "").strip()
    root = Path(base) / "quantpatch" if base else Path.home() / ".cache" / "quantpatch"
    return root / "kernels"


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_STALE_BUILD = 3600.0
"""Seconds after which a build directory in the cache is removed whoever left it (a
compile takes ``_COMPILE_TIMEOUT`` at most)."""


class _Refused(Exception):
    """The kernel cache is not used, for the reason given."""


def _ancestor_trusted(st: os.stat_result) -> bool:
    """Whether only root and this user can rename entries of a directory above the cache:
    it is theirs, and nobody else can write it, or it is sticky (``/tmp``), where others
    cannot rename what they do not own (the next directory down is checked for that)."""
    return st.st_uid in (0, os.geteuid()) and (
        not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX)
    )


def _open_child(parent: int, name: str, where: Path) -> int:
    """Directory ``name`` in ``parent`` opened without following a link (made, 0700 whatever
    the umask, where it is not there)."""
    try:
        return os.open(name, _DIR_OPEN, dir_fd=parent)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                raise _Refused(f"{where} is a symbolic link") from None
        raise _Refused(f"no cache directory: {where} is not a directory") from None
    with contextlib.suppress(FileExistsError):  # a rank beside this one made it first
        os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIR_OPEN, dir_fd=parent)
    if os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, 0o700)
    return fd


def _open_cache_dir(directory: Path) -> int:
    """A descriptor of the kernel cache ``directory`` (made where it is not there), or
    ``_Refused``. Opened a directory at a time from ``/``, following no link (those above it
    are resolved once, by name, first); every directory above it must pass
    ``_ancestor_trusted`` and it must be this user's, a directory, and not writable by
    group or others, each checked on its open descriptor: nothing renamed in between
    can change what is then read, written or loaded through it."""
    path = Path(os.path.abspath(directory))
    if path == path.parent:
        raise _Refused(f"{path} cannot hold the kernel cache")
    names = [*Path(os.path.realpath(path.parent)).parts[1:], path.name]
    fd = os.open("/", _DIR_OPEN)
    where = Path("/")
    try:
        for name in names:
            st = os.fstat(fd)
            if not _ancestor_trusted(st):
                raise _Refused(
                    f"{where} lets others rename what it holds (owner uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):o})"
                )
            where = where / name
            child = _open_child(fd, name, where)
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise _Refused(f"{directory} is not a directory of this user's alone")
        _proc_path(fd)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _proc_path(fd: int) -> str:
    """``/proc/self/fd/N`` for ``fd``, where that is the same file (else ``_Refused``): the
    kernel is loaded through it, never by a name that could be swapped."""
    path = f"/proc/self/fd/{fd}"
    own = os.fstat(fd)
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
        raise _Refused("no /proc/self/fd to load the kernel through a descriptor")
    return path


def _own_file(fd: int, shown: Path) -> None:
    """``_Refused`` unless ``fd`` is a regular file of this user that nobody else can
    write."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise _Refused(f"{shown} is not this user's alone")


_GENERIC_ISA = ("-march=x86-64", "-mtune=generic", "-mno-avx")
"""Passed after ``$CC``'s own words: the library's code outside the AVX2 functions (which
``QP_TARGET`` enables, and which run only where the CPU has them) is plain x86-64 whatever
``-march``/``-mavx*`` the user's compiler command holds (an AVX-512 build on a shared home
would stop an AVX2 node with SIGILL)."""


def _stats_cflags() -> tuple[str, ...]:
    return (*_STATS_CFLAGS, *_GENERIC_ISA)


def _source_key() -> str:
    import hashlib

    return hashlib.sha256("\0".join((_STATS_C, *_stats_cflags())).encode()).hexdigest()[:16]


def _kernel_name(cc: list[str], version: str) -> str:
    """The cache entry for the kernel's source and flags compiled by ``cc`` (its words and
    ``version``, the first line of its ``--version``): another compiler gets another entry."""
    import hashlib

    words = hashlib.sha256("\0".join((*cc, version)).encode()).hexdigest()[:12]
    return f"tensor_stats_{_source_key()}_{words}.so"


def _compiler_version(cc: list[str]) -> str:
    """The first line ``cc --version`` prints, or "" where it prints none or fails."""
    try:
        code, output = _run([*cc, "--version"])
    except OSError:  # then it cannot compile either, and says so
        return ""
    lines = output.strip().splitlines() if code == 0 else []
    return lines[0].strip() if lines else ""


class _Cache:
    """The kernel cache, opened (``_open_cache_dir``): its directory's descriptor, the name of
    the library for this source and compiler in it (None: no compiler here, any library of
    this source), and that library's descriptor if it is there (-1: it is not)."""

    def __init__(self, fd: int, directory: Path, name: str | None) -> None:
        self.fd, self.directory, self.name, self.lib = fd, directory, name, -1

    @property
    def target(self) -> Path:
        return self.directory / (self.name or f"tensor_stats_{_source_key()}_*.so")

    def close(self) -> None:
        for fd in (self.lib, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.lib = -1


def _cache_target(cc: list[str] | None) -> tuple[_Cache | None, str]:
    """The kernel cache, opened, with the library for ``cc`` (None: no compiler, then any
    library of this source, all built with ``_GENERIC_ISA``) opened if it is there; or None
    and why it is not used (no home directory, a directory that cannot be made, a directory
    or library that others could write or swap, no ``/proc``)."""
    try:
        directory = _kernel_dir()
        fd = _open_cache_dir(directory)
    except _Refused as exc:
        return None, str(exc)
    except (OSError, RuntimeError) as exc:  # RuntimeError: Path.home() found no home
        return None, f"no cache directory: {exc}"
    cache = _Cache(fd, directory, None if cc is None else _kernel_name(cc, _compiler_version(cc)))
    name = cache.name
    if name is None:
        prefix = f"tensor_stats_{_source_key()}_"
        found = sorted(n for n in os.listdir(fd) if n.startswith(prefix) and n.endswith(".so"))
        name = found[0] if found else None
    try:
        if name is not None:
            cache.lib = os.open(name, _FILE_OPEN, dir_fd=fd)
            cache.name = name
            _own_file(cache.lib, cache.target)
    except FileNotFoundError:
        pass
    except OSError as exc:
        cache.close()
        return None, f"{directory / name} is not this user's alone ({exc})" if name else str(exc)
    except _Refused as exc:
        cache.close()
        return None, str(exc)
    return cache, ""


def _compiler() -> list[str] | None:
    """``$CC`` (split as a shell would: ``ccache gcc`` is two words), else the first of cc,
    gcc and clang on PATH."""
    import shlex
    import shutil

    raw = (os.environ.get("CC") or "").strip()
    if raw:
        with contextlib.suppress(ValueError):
            return shlex.split(raw) or None
        return [raw]
    found = next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)
    return [found] if found else None


_COMPILING: set[subprocess.Popen[str]] = set()
"""Compilers running now: killed with their children if the process exits first."""


def _kill_compilers() -> None:
    for proc in list(_COMPILING):
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, 9)


atexit.register(_kill_compilers)


def _run(command: list[str]) -> tuple[int | None, str]:
    """Run the compiler ``command`` in a session of its own (so that on a timeout its
    children, cc1, as, ld, are killed with it): its exit status (None: stopped after
    ``_COMPILE_TIMEOUT``) and output; ``OSError`` where it cannot run."""
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    _COMPILING.add(proc)
    try:
        output, _ = proc.communicate(timeout=_COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, 9)
        proc.communicate()
        return None, ""
    finally:
        _COMPILING.discard(proc)
    return proc.returncode, output


def _compile_stats_kernel(build: int, cc: list[str]) -> tuple[int | None, str]:
    """``_STATS_C`` compiled by ``cc`` in the directory open as ``build`` (new, this process's
    own, 0700), named to the compiler through ``/proc/PID/fd``: a descriptor of the library
    (0700, checked to be this user's alone), or None and why not."""
    where = f"/proc/{os.getpid()}/fd/{build}"
    fd = os.open(
        "tensor_stats.c", os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_OPEN, 0o600, dir_fd=build
    )
    try:
        data = memoryview(_STATS_C.encode("utf-8"))
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
    command = [*cc, *_stats_cflags(), "-o", f"{where}/tensor_stats.so", f"{where}/tensor_stats.c"]
    try:
        code, output = _run(command)
    except OSError as exc:
        return None, f"{cc[0]} could not run ({type(exc).__name__}: {exc})"
    if code is None:
        return None, f"{cc[0]} took over {_COMPILE_TIMEOUT:g} s and was stopped"
    if code:
        lines = output.strip().splitlines() or ["no output"]
        return None, f"{cc[0]} failed ({lines[0][:200]})"
    lib = os.open("tensor_stats.so", _FILE_OPEN, dir_fd=build)
    try:
        os.fchmod(lib, 0o700)  # the compiler made it by the umask (0775 under 002)
        _own_file(lib, Path(where) / "tensor_stats.so")
    except BaseException:
        os.close(lib)
        raise
    return lib, ""


_StatsFn = Callable[[int, int, int], "tuple[float, ...] | None"]
_LOADED: list[tuple[int, ctypes.CDLL]] = []
"""Descriptors of the libraries loaded and their handles, kept open: dlopen answers a name it
has loaded (``/proc/self/fd/N``) with what it loaded, so N must never name another library
while that one is loaded (``forget`` unloads them before it lets the descriptors go)."""


def _load_stats_kernel(fd: int, shown: Path) -> tuple[_StatsFn | None, str, bool]:
    """The kernel open as ``fd`` (``shown`` in messages; the descriptor is taken over) as a
    Python function, checked on a known tensor; or None, why not, and whether compiling it
    again could help (not for a CPU without AVX2, FMA or F16C). Loaded through
    ``/proc/self/fd``: the file checked is the file loaded, whatever is renamed meanwhile.
    ctypes lets go of the GIL for the call, so the writer thread runs beside it."""
    import ctypes

    try:
        lib = ctypes.CDLL(_proc_path(fd))
    except (OSError, _Refused) as exc:
        os.close(fd)
        return None, f"{shown} does not load ({exc})", True
    _LOADED.append((fd, lib))
    try:
        supported, fn = lib.qp_supported, lib.qp_tensor_stats
    except AttributeError as exc:
        return None, f"{shown} does not load ({exc})", True
    supported.restype = ctypes.c_int
    if not supported():
        return None, "the CPU lacks AVX2, FMA or F16C", False
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    out_type = ctypes.c_double * 4

    def stats(ptr: int, n: int, kind: int) -> tuple[float, ...] | None:
        out = out_type()
        return None if fn(ptr, n, kind, out) else tuple(out)

    probe = torch.tensor([1.5, -2.25, 0.5] * 7, dtype=torch.bfloat16)  # 16 at once, 5 alone
    got = stats(probe.data_ptr(), probe.numel(), _STATS_KINDS[torch.bfloat16])
    if got != (-2.25, 1.5, -1.75, 7 * (1.5**2 + 2.25**2 + 0.5**2)):
        return None, f"{shown} gives {got} on a known tensor", True
    return stats, str(shown), True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    return True


def _sweep_builds(cache: int) -> None:
    """Remove the build directories (``.build-HOST-PID-XXXX``) this user left in the cache
    open as ``cache``: those of a process of this host that has ended (killed while it
    compiled), and any older than ``_STALE_BUILD`` (another host's, or an older name)."""
    import shutil
    import socket

    host, now = socket.gethostname(), time.time()
    for entry in os.listdir(cache):
        if not entry.startswith(".build-"):
            continue
        try:
            st = os.stat(entry, dir_fd=cache, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        stale = now - st.st_mtime > _STALE_BUILD
        parts = entry[len(".build-") :].rsplit("-", 2)
        if not stale and len(parts) == 3 and parts[0] == host and parts[1].isdigit():
            stale = not _alive(int(parts[1]))
        if stale:
            shutil.rmtree(entry, dir_fd=cache, ignore_errors=True)


def _build_kernel(
    cache: _Cache | None, uncached: str, cc: list[str]
) -> tuple[_StatsFn | None, str]:
    """Compile (by ``cc``), load and check the kernel, then cache it (``cache`` None: not
    cached, for the reason ``uncached``). Built in a new directory of this process's own
    (``.build-HOST-PID-XXXX`` in the cache, after the ones a dead process left are swept;
    else in the system's temporary directory), reached through descriptors only and removed
    once the library is loaded: ranks that start together each build their own, and the last
    rename wins."""
    import secrets
    import shutil
    import socket
    import tempfile

    parent = -1
    if cache is not None:
        name = f".build-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            _sweep_builds(cache.fd)
            os.mkdir(name, 0o700, dir_fd=cache.fd)
            parent = os.dup(cache.fd)
        except OSError as exc:
            cache, uncached = None, f"the cache cannot be written: {exc}"
    if parent < 0:
        name = f"quantpatch-kernel-{os.getpid()}-{secrets.token_hex(4)}"
        parent = os.open(tempfile.gettempdir(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except BaseException:
            os.close(parent)
            raise
    try:
        build = os.open(name, _DIR_OPEN, dir_fd=parent)
        try:
            os.fchmod(build, 0o700)
            if os.fstat(build).st_uid != os.geteuid():
                return None, "the kernel's build directory is not this user's"
            _proc_path(build)
            lib, why = _compile_stats_kernel(build, cc)
            if lib is None:
                return None, why
            shown = cache.directory / str(cache.name) if cache else Path(name) / "tensor_stats.so"
            stats, note, _ = _load_stats_kernel(lib, shown)  # mapped: it survives its file
            if stats is None:
                return None, note
            if cache is None:
                return stats, f"compiled, not cached: {uncached}"
            try:
                os.replace(
                    "tensor_stats.so", str(cache.name), src_dir_fd=build, dst_dir_fd=cache.fd
                )
            except OSError as exc:
                return stats, f"compiled, not cached: {exc}"
            return stats, f"compiled: {shown}"
        finally:
            os.close(build)
    except _Refused as exc:
        return None, str(exc)
    finally:
        shutil.rmtree(name, dir_fd=parent, ignore_errors=True)
        os.close(parent)


def _find_kernel() -> tuple[_StatsFn | None, str]:
    """The cached kernel (this source, this compiler), else one compiled now (``_build_kernel``),
    or None and why there is none."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or sys.byteorder != "little":
        return None, f"not an x86-64 host ({platform.machine()})"
    cache = None
    try:
        cc = _compiler()
        cache, uncached = _cache_target(cc)
        if cache is not None and cache.lib >= 0:
            lib, cache.lib = cache.lib, -1
            stats, note, retry = _load_stats_kernel(lib, cache.target)
            if stats is not None or not retry:
                cache.close()  # the library's own descriptor is kept (_LOADED), not the cache's
                return stats, f"cached: {note}" if stats is not None else note
    except Exception as exc:  # never let the saver fail for its kernel
        if cache is not None:
            cache.close()
        return None, f"the kernel could not be looked for ({type(exc).__name__}: {exc})"
    try:
        if cc is None:
            return None, "no C compiler (cc, gcc or clang) on PATH"
        return _build_kernel(cache, uncached, cc)
    except Exception as exc:  # never let the saver fail for its kernel
        return None, f"the kernel could not be built ({type(exc).__name__}: {exc})"
    finally:
        if cache is not None:
            cache.close()


_KERNEL_LOCK = threading.Lock()
_kernel: tuple[_StatsFn | None, str] | None = None
"""The kernel (or None) and where it came from (or why there is none), once known."""
_kernel_build: threading.Thread | None = None


def kernel(wait: bool = False) -> tuple[_StatsFn | None, str]:
    """The one-pass kernel and where it came from, or None and why there is none (yet).
    Looked for once per process, on the first host tensor measured, in a thread of its own:
    loaded from the cache when it is there (a few ms, with the compiler's ``--version``),
    else compiled (0.5 s), while torch's operators compute the statistics, so that neither
    training nor the saver ever waits for a compiler (``wait``: this caller does). Only a
    cache that passes ``_open_cache_dir`` and a library of this user that nobody else can
    write are used; otherwise it is compiled for this process alone. A cached kernel that
    does not load or gives a wrong answer on a known tensor is compiled again (and
    replaced); any error on the way leaves torch's operators in use."""
    global _kernel_build
    with _KERNEL_LOCK:
        if _kernel is None and _kernel_build is None:
            _kernel_build = threading.Thread(
                target=_find_kernel_thread, name="tensor_saver_kernel", daemon=True
            )
            _kernel_build.start()
        build = _kernel_build
    if wait and build is not None:
        build.join()
    found = _kernel
    return found if found is not None else (None, "being loaded or compiled")


def _find_kernel_thread() -> None:
    global _kernel
    found = _find_kernel()
    with _KERNEL_LOCK:
        _kernel = found


def forget() -> None:
    """Look for the kernel again on next use (tests and benchmarks; a build under way is
    waited for first)."""
    global _kernel, _kernel_build
    build = _kernel_build
    if build is not None:
        build.join()
    with _KERNEL_LOCK:
        _kernel, _kernel_build = None, None
        loaded = _LOADED[:]
        _LOADED.clear()
    for fd, lib in loaded:  # nothing calls them now: unloaded, then their names may be reused
        _ctypes_dlclose(lib)
        os.close(fd)


def _ctypes_dlclose(lib: ctypes.CDLL) -> None:
    """Unload ``lib`` (ctypes never does): its ``/proc/self/fd/N`` name is then free."""
    import _ctypes

    with contextlib.suppress(OSError):
        _ctypes.dlclose(lib._handle)


def status() -> str:
    """How host statistics are computed when this accelerator is on (waiting for a compile
    under way): ``kernel (cached: PATH)``, ``kernel (compiled: PATH)``, ``kernel (compiled,
    not cached: WHY)`` or ``torch operators (WHY)``."""
    stats, note = kernel(wait=True)
    return f"kernel ({note})" if stats is not None else f"torch operators ({note})"


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are where ``data_ptr`` says, one after the other: a plain (or
    parameter) tensor in host memory, dense, contiguous, with no lazy negation. A subclass
    that wraps others has no memory of its own there (its pointer is null or another's)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_neg()
        and t.data_ptr() != 0
    )


def fused_stats(t: torch.Tensor) -> list[float] | None:
    """min, max, mean, std of host tensor ``t`` from one pass of the kernel, as float32 values;
    None where the kernel does not apply (another dtype, memory that is not plain and
    contiguous, no kernel yet) or where its sums are
    not exact enough for the spread (a value that is not finite, or a mean large next to
    the spread: ``_exact_enough``), which the float32 path then computes. The mean is
    within depth * 2**-53 of the values' root mean square (``_sums_depth``): within
    float32's rounding of itself unless the values nearly cancel (a mean below about 1e-7
    of that on 1M values), where it is still far closer than the float32 path's."""
    kind = _STATS_KINDS.get(t.dtype)
    if kind is None or not _plain_memory(t):
        return None
    n = t.numel()
    if n > 1 and not _exact_enough(n, 1.0, 1.0):  # no spread could be kept: not worth a pass
        return None
    stats = kernel()[0]
    if stats is None:
        return None
    got = stats(t.data_ptr(), n, kind)
    if got is None:
        return None
    mn, mx, total, squares = got
    if not (math.isfinite(total) and math.isfinite(squares)):
        return None
    mean = total / n
    if n == 1:
        return float32s(mn, mx, mean, 0.0)
    deviation = squares - total * mean
    if not _exact_enough(n, squares, deviation):
        return None
    return float32s(mn, mx, mean, math.sqrt(deviation / (n - 1)))
