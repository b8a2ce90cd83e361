"""Discovery results cached by file content, so that ``check`` on unchanged files never loads
libcst (whose import alone costs ~170 ms) nor parses anything.

The key is the SHA-256 of (cache format, quantpatch version, path, file kind, file text): any
change to the file, its role family or the tool gives a new key, so an entry can never be
stale. Entries are small JSON files under ``<state dir>/cache``; the newest 64 are kept.
A file that does not mention ``custom_quant_type`` has no sites and is never parsed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from quantpatch import __version__
from quantpatch.config import SITE_NAME, Targets
from quantpatch.site_model import Site, read_target

CACHE_FORMAT = 3
KEEP = 64


def cache_key(rel: str, kind: str, text: str) -> str:
    head = f"{CACHE_FORMAT}\0{__version__}\0{rel}\0{kind}\0".encode()
    return hashlib.sha256(head + text.encode("utf-8")).hexdigest()


def _entry(cache_dir: Path, rel: str, kind: str, text: str) -> Path:
    return cache_dir / f"sites-{cache_key(rel, kind, text)[:40]}.json"


def load(cache_dir: Path | None, rel: str, kind: str, text: str) -> list[Site] | None:
    """The cached sites of ``text``, or ``None`` on a miss or on any doubt: an entry is
    trusted only when it names this very text (its full key) and every site it lists
    stands in the text as recorded (the line holds the site name and the value as written,
    and the value is the one in that expression). ``check --expect``, which every launch
    script relies on, must never report a value the file does not hold."""
    if cache_dir is None:
        return None
    try:
        data = json.loads(_entry(cache_dir, rel, kind, text).read_text(encoding="utf-8"))
        key = cache_key(rel, kind, text)
        if data.get("key") != key or data.get("digest") != _digest(key, data["sites"]):
            return None  # not this text, or an entry changed since quantpatch wrote it
        sites = [Site.from_dict(d) for d in data["sites"]]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    lines = text.splitlines()
    for site in sites:
        if not _well_formed(site) or not 0 < site.line <= len(lines) or site.file != rel:
            return None
        line = lines[site.line - 1]
        first = site.source.splitlines()[0] if site.source else ""
        if SITE_NAME not in line or first not in line:
            return None
        if site.value is not None and site.value not in site.source:
            return None
    return sites


def _digest(key: str, sites: object) -> str:
    """A checksum over an entry's content, so a corrupted or hand-edited entry is a miss."""
    body = json.dumps(sites, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{key}\0{body}".encode()).hexdigest()


def _well_formed(site: Site) -> bool:
    return (
        isinstance(site.line, int)
        and not isinstance(site.line, bool)
        and all(isinstance(v, str) for v in (site.role, site.file, site.form, site.source))
        and isinstance(site.value, str | None)
    )


def store(cache_dir: Path | None, rel: str, kind: str, text: str, sites: Sequence[Site]) -> None:
    """Best effort: a cache that cannot be written only costs time."""
    if cache_dir is None:
        return
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = _entry(cache_dir, rel, kind, text)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        key = cache_key(rel, kind, text)
        dicts = [s.to_dict() for s in sites]
        entry = {"key": key, "digest": _digest(key, dicts), "sites": dicts}
        tmp.write_text(json.dumps(entry), encoding="utf-8")
        os.replace(tmp, path)
        entries = sorted(cache_dir.glob("sites-*.json"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-KEEP]:
            old.unlink()


def read_sites(root: Path, targets: Targets, cache_dir: Path | None) -> list[list[Site]]:
    """The sites of every target file, from the cache where possible (parsing the others)."""
    out: list[list[Site]] = []
    for rel in targets.all_files:
        text = read_target(root, rel)
        kind = targets.kind_of(rel)
        if SITE_NAME not in text:
            out.append([])
            continue
        sites = load(cache_dir, rel, kind, text)
        if sites is None:
            from quantpatch.sites import discover_sites  # imports libcst: only on a miss

            sites = discover_sites(text, rel, kind)
            store(cache_dir, rel, kind, text, sites)
        out.append(sites)
    return out
