"""The real ``megatron/`` package tree of a ``megatron-core`` release, without importing it.

Taken from the installed distribution when its version matches, else from the release's wheel
(fetched once with ``pip download --no-deps`` into the cache and unpacked there). Nothing of
Megatron is ever imported or committed to this project.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from quantpatch.base.errors import UserError

DEFAULT_VERSION = "0.13.1"


def cache_dir() -> Path:
    base = os.environ.get("QUANTPATCH_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(base) / "quantpatch" if base else Path.home() / ".cache" / "quantpatch"


def make_private_dirs(path: Path) -> None:
    """``path`` and every missing directory above it made 0700, whatever the umask: the
    installed saver loads a compiled kernel from ``kernels/`` of this cache only while no other
    user can rename a directory above it, so the cache directories quantpatch makes (and
    ``~/.cache`` where it makes that too) must not be group-writable under umask 002."""
    missing: list[Path] = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue
        os.chmod(d, 0o700)


def _installed(version: str) -> Path | None:
    try:
        dist = metadata.distribution("megatron-core")
    except metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    tree = Path(str(dist.locate_file("megatron")))
    return tree if (tree / "core").is_dir() else None


def fetch_wheel(version: str, dest: Path, package: str = "megatron-core") -> Path:
    """``package``'s wheel at ``version`` in ``dest``: the one already there, else fetched with
    ``pip download --no-deps`` (the tests fetch TransformerEngine's pure-Python wheel so too)."""
    make_private_dirs(dest)
    stem = package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if found:
        return found[0]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        f"{package}=={version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(dest.glob(f"{stem}-{version}-*.whl"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no wheel found"])[-1]
        raise UserError(f"cannot fetch {package} {version} from the package index ({last}).")
    return found[0]


def megatron_tree(version: str = DEFAULT_VERSION) -> Path:
    """A directory holding ``megatron/`` of the given megatron-core release."""
    installed = _installed(version)
    if installed is not None:
        return installed
    root = cache_dir() / f"megatron-core-{version}"
    tree = root / "megatron"
    if (tree / "core").is_dir():
        return tree
    make_private_dirs(cache_dir())
    # one process fetches and unpacks at a time (two `demo` runs, or test workers, would
    # otherwise download into the same file and remove each other's half-unpacked tree)
    with open(cache_dir() / f".megatron-core-{version}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (tree / "core").is_dir():  # another process made it while this one waited
            return tree
        wheel = fetch_wheel(version, cache_dir() / "wheels")
        tmp = root.with_name(root.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith("megatron/")]
            zf.extractall(tmp, members)
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    return tree
