"""A checkout's Megatron-LM release record, cached by file content so that a warm
``gen-scripts`` never loads libcst (whose import alone costs ~0.2 s) nor parses anything.

``megatron_args.read_release`` does the reading. An entry is named by the SHA-256 of (cache
format, quantpatch version, ``megatron/training/arguments.py``'s text) and holds the hash of
every file the reading looked at (``package_info.py``, the imported modules, the dataclass
modules); it is used only when every one of them still hashes the same, so it can never be
stale. Entries are small JSON files under ``<state dir>/cache``; the newest 8 are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from quantpatch import __version__
from quantpatch.base.edits import read_exact, sha256_text
from quantpatch.launch.megatron_files import ARGUMENTS, CheckoutRelease

CACHE_FORMAT = 1
KEEP = 8


def _entry(cache_dir: Path, arguments_text: str) -> Path:
    head = f"{CACHE_FORMAT}\0{__version__}\0".encode()
    key = hashlib.sha256(head + arguments_text.encode("utf-8")).hexdigest()
    return cache_dir / f"flags-{key[:40]}.json"


def _digest(root: Path, rel: str) -> str | None:
    text = read_exact(root / rel)
    return None if text is None else sha256_text(text)


def load(root: Path, cache_dir: Path, arguments_text: str) -> CheckoutRelease | None:
    try:
        data = json.loads(_entry(cache_dir, arguments_text).read_text(encoding="utf-8"))
        inputs = tuple((str(rel), digest) for rel, digest in data["inputs"])
        if any(_digest(root, rel) != digest for rel, digest in inputs):
            return None
        return CheckoutRelease(
            root=root,
            version=data["version"],
            flags=frozenset(data["flags"]),
            files=tuple(data["files"]),
            unresolved=tuple(data["unresolved"]),
            inputs=inputs,
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None


def store(cache_dir: Path, arguments_text: str, release: CheckoutRelease) -> None:
    """Best effort: a cache that cannot be written only costs time."""
    data = asdict(release)
    data.pop("root")
    data["flags"] = sorted(release.flags)
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = _entry(cache_dir, arguments_text)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
        entries = sorted(cache_dir.glob("flags-*.json"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-KEEP]:
            old.unlink()


def checkout_release(root: Path, cache_dir: Path | None) -> CheckoutRelease | None:
    """The checkout's release, from the cache where possible; ``None`` when the checkout has
    no ``megatron/training/arguments.py``."""
    text = read_exact(root / ARGUMENTS)
    if text is None:
        return None
    if cache_dir is not None:
        cached = load(root, cache_dir, text)
        if cached is not None:
            return cached
    from quantpatch.launch.megatron_args import read_release  # imports libcst: only on a miss

    release = read_release(root)
    if release is not None and cache_dir is not None:
        store(cache_dir, text, release)
    return release
