"""Discovery results cached by file content, so that ``check`` on unchanged files never loads
libcst (whose import alone costs ~170 ms) nor parses anything.

The key is the SHA-256 of (cache format, quantpatch version, path, file kind, file text): any
change to the file, its role family or the tool gives a new key, so an entry can never be
stale. Entries are small JSON files under ``<state dir>/cache``; the newest 64 are kept.
A file that does not mention ``custom_quant_type`` has no sites and is never parsed.

An entry holds a linear file's BF16 layer policy beside its sites (``Found``): ``check``
reports the policy too, and reading it from the file would import libcst on every check.

A cold cache is filled ahead (``discover_ahead``): a forked child imports libcst and parses
while the command goes on, and ``read_sites`` then finds the entries it stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from quantpatch import __version__
from quantpatch.base import faults
from quantpatch.base.config import SITE_NAME, Targets
from quantpatch.base.errors import UserError
from quantpatch.sites.model import POLICY_NAME, Policy, Site, read_target

CACHE_FORMAT = 7  # 7: the entry holds the linear file's BF16 layer policy
KEEP = 64


def cache_key(rel: str, kind: str, text: str) -> str:
    head = f"{CACHE_FORMAT}\0{__version__}\0{rel}\0{kind}\0".encode()
    return hashlib.sha256(head + text.encode("utf-8")).hexdigest()


def _entry(cache_dir: Path, rel: str, kind: str, text: str) -> Path:
    return cache_dir / f"sites-{cache_key(rel, kind, text)[:40]}.json"


class Found(NamedTuple):
    """What discovery finds in one file: its sites, and (a linear file) its BF16 layer
    policy, None where it has none."""

    sites: list[Site]
    policy: Policy | None = None


def discover(text: str, rel: str, kind: str) -> Found:
    """Parse ``text`` (imports libcst): its sites, and a linear file's policy."""
    from quantpatch.sites.discovery import discover_sites
    from quantpatch.sites.policy import find_policy

    policy = find_policy(text, rel) if kind == "linear" else None
    return Found(discover_sites(text, rel, kind), policy)


def _needs_parse(text: str, kind: str) -> bool:
    """Whether ``text`` can hold anything discovery finds (else: ``Found([])``, unparsed)."""
    return SITE_NAME in text or (kind == "linear" and POLICY_NAME in text)


def load(cache_dir: Path | None, rel: str, kind: str, text: str) -> Found | None:
    """The cached sites and policy of ``text``, or ``None`` on a miss or on any doubt: an
    entry is trusted only when it names this very text (its full key) and every site it
    lists stands in the text as recorded (the line holds the site name and the value as
    written, and the value is the one in that expression), its policy likewise. ``check
    --expect``, which every launch script relies on, must never report a value the file
    does not hold."""
    if cache_dir is None:
        return None
    try:
        data = json.loads(_entry(cache_dir, rel, kind, text).read_text(encoding="utf-8"))
        key = cache_key(rel, kind, text)
        raw_policy = data["policy"]
        if data.get("key") != key or data.get("digest") != _digest(key, data["sites"], raw_policy):
            return None  # not this text, or an entry changed since quantpatch wrote it
        sites = [Site.from_dict(d) for d in data["sites"]]
        policy = None if raw_policy is None else Policy(**raw_policy)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    lines = text.splitlines()
    if policy is not None and not _policy_stands(policy, rel, lines):
        return None
    for site in sites:
        if not _well_formed(site) or not 0 < site.line <= len(lines) or site.file != rel:
            return None
        line = lines[site.line - 1]
        first = site.source.splitlines()[0] if site.source else ""
        if SITE_NAME not in line or first not in line:
            return None
        if site.value is not None and site.value not in site.source:
            return None
    return Found(sites, policy)


def _policy_stands(policy: Policy, rel: str, lines: list[str]) -> bool:
    """The policy as recorded stands in the text: its line names the policy and holds the
    value as written (a value written otherwise, escaped or on a later line, is a miss)."""
    line = policy.line
    if not isinstance(line, int) or isinstance(line, bool) or not 0 < line <= len(lines):
        return False
    if policy.file != rel or POLICY_NAME not in lines[line - 1]:
        return False
    return policy.value is None or (
        isinstance(policy.value, str) and policy.value in lines[line - 1]
    )


def _digest(key: str, sites: object, policy: object = None) -> str:
    """A checksum over an entry's content, so a corrupted or hand-edited entry is a miss."""
    content = sites if policy is None else [sites, policy]
    body = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{key}\0{body}".encode()).hexdigest()


def _well_formed(site: Site) -> bool:
    return (
        isinstance(site.line, int)
        and not isinstance(site.line, bool)
        and all(isinstance(v, str) for v in (site.role, site.file, site.form, site.source))
        and isinstance(site.value, str | None)
        and (site.knows is None or all(isinstance(v, str) for chain in site.knows for v in chain))
        and all(isinstance(v, str) for v in site.knows_for)
    )


def store(
    cache_dir: Path | None,
    rel: str,
    kind: str,
    text: str,
    sites: Sequence[Site],
    policy: Policy | None = None,
) -> None:
    """Best effort: a cache that cannot be written only costs time."""
    if cache_dir is None:
        return
    with contextlib.suppress(OSError):
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = _entry(cache_dir, rel, kind, text)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        key = cache_key(rel, kind, text)
        dicts = [s.to_dict() for s in sites]
        raw_policy = None if policy is None else dataclasses.asdict(policy)
        digest = _digest(key, dicts, raw_policy)
        entry = {"key": key, "digest": digest, "sites": dicts, "policy": raw_policy}
        tmp.write_text(json.dumps(entry), encoding="utf-8")
        os.replace(tmp, path)
        entries = sorted(cache_dir.glob("sites-*.json"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-KEEP]:
            old.unlink()
        # a writer stopped mid-entry (a check interrupted) leaves its temporary file
        stale = os.stat(path).st_mtime - 60
        for left in cache_dir.glob("sites-*.tmp"):
            with contextlib.suppress(OSError):
                if left.stat().st_mtime < stale:
                    left.unlink()


class _Read(NamedTuple):
    """A target file as read once: what discovery finds in it from the cache, ``Found([])``
    where the file cannot hold anything, ``None`` where it must be parsed."""

    rel: str
    kind: str
    text: str
    found: Found | None


def _scan(root: Path, targets: Targets, cache_dir: Path | None) -> list[_Read]:
    out = []
    for rel in targets.all_files:
        text = read_target(root, rel)
        kind = targets.kind_of(rel)
        found = load(cache_dir, rel, kind, text) if _needs_parse(text, kind) else Found([])
        out.append(_Read(rel, kind, text, found))
    return out


def read_found(
    root: Path, targets: Targets, cache_dir: Path | None, ahead: Ahead | None = None
) -> list[Found]:
    """What discovery finds in every target file (in ``targets.all_files`` order), from the
    cache where possible (parsing the others); ``ahead`` holds the files as already read,
    and the child filling the cache, which is waited for first."""
    if ahead is not None:
        ahead.wait()
    files = ahead.files if ahead is not None else _scan(root, targets, cache_dir)
    out: list[Found] = []
    for rel, kind, text, found in files:
        if found is None and ahead is not None and ahead.forked:
            found = load(cache_dir, rel, kind, text)  # what the child stored
        if found is None:
            found = discover(text, rel, kind)  # imports libcst: only on a miss
            store(cache_dir, rel, kind, text, found.sites, found.policy)
        out.append(found)
    return out


def read_sites(
    root: Path, targets: Targets, cache_dir: Path | None, ahead: Ahead | None = None
) -> list[list[Site]]:
    """The sites of every target file, as ``read_found`` finds them."""
    return [found.sites for found in read_found(root, targets, cache_dir, ahead)]


def policy_of(targets: Targets, files: Sequence[Found]) -> Policy | None:
    """The BF16 layer policy of the checkout's linear files as ``read_found`` found them (the
    first linear file's that has one), or None."""
    policies = {f.policy.file: f.policy for f in files if f.policy is not None}
    return next((policies[rel] for rel in targets.linear if rel in policies), None)


# -- discovery ahead: a cold cache filled by a forked child ------------------------------------


class Ahead:
    """The target files as ``discover_ahead`` read them, and the child it started (``pid``
    0: none was needed), leader of its own process group (its helpers are in it too)."""

    def __init__(self, files: list[_Read], pid: int) -> None:
        self.files, self.pid, self.forked = files, pid, pid != 0

    def wait(self) -> None:
        """Until the child has exited (at once the second time)."""
        if self.pid:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = 0

    def stop(self) -> None:
        """End the child and its helpers at once (the command is being interrupted): none
        of them writes anything after this returns."""
        if self.pid:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, 9)  # SIGKILL, by number: no import of signal here
            self.wait()

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if kind is None:
            self.wait()
        else:
            self.stop()


def can_fork() -> bool:
    """A child can be forked safely: the platform has ``fork`` and this process runs no
    other thread (a lock another thread holds would stay held in the child forever). The
    threads are counted by the kernel where it tells (those of C extensions and ``_thread``
    included), by ``threading`` elsewhere."""
    if not hasattr(os, "fork"):
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        threading = sys.modules.get("threading")
        return threading is None or threading.active_count() == 1


def discover_ahead(root: Path, targets: Targets, cache_dir: Path | None) -> Ahead | None:
    """Parse, in a forked child, every target file whose sites ``cache_dir`` lacks, while
    this process goes on: the child stores what it finds in the cache and exits, and
    ``read_sites`` (handed the returned ``Ahead``) finds it there.

    A cold ``check`` spends most of its time in libcst's import (227 of 360 ms on the fork
    clone); the command's own imports (rich) and ``git status`` then run beside it on the
    other core. The child writes nothing else and leaves through ``os._exit``: none of this
    process's buffered output or exit handlers run twice. Whatever it could not parse is
    simply not in the cache, so ``read_sites`` parses it again and reports the error.
    ``None`` where no child can be forked safely; without a child where nothing is missing
    (the files as read are kept either way: ``read_sites`` reads none of them again)."""
    if cache_dir is None or not can_fork():
        return None
    try:
        files = _scan(root, targets, cache_dir)
    except UserError:  # a missing target: read_sites says so
        return None
    misses = [(f.rel, f.kind, f.text) for f in files if f.found is None]
    if not misses:
        return Ahead(files, 0)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is left to be written twice
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    pid = os.fork()
    if pid:
        with contextlib.suppress(OSError):  # its own group (set on both sides: no race)
            os.setpgid(pid, pid)
        return Ahead(files, pid)
    code = 1  # the child, from here to os._exit
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        import gc

        gc.disable()  # a process that lives a few hundred ms: libcst's import is 11 ms faster
        from quantpatch.sites import discovery, policy  # noqa: F401  (libcst, before the helpers)

        # the files are shared out between this child and its own children, the largest
        # first, one process per core: each parse runs on libcst as imported once, here
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        shares = _shares(misses, min(len(misses), cores))
        mine, helpers = shares[0], list[int]()
        for share in shares[1:]:
            helper = os.fork()
            if helper == 0:  # a helper: its share, and no one to wait for
                mine, helpers = share, []
                break
            helpers.append(helper)
        for rel, kind, text in mine:
            with contextlib.suppress(Exception):  # parsed again, and reported, by the parent
                found = discover(text, rel, kind)
                store(cache_dir, rel, kind, text, found.sites, found.policy)
        for helper in helpers:
            os.waitpid(helper, 0)
        code = 0
    finally:
        os._exit(code)


def _shares(files: list[tuple[str, str, str]], n: int) -> list[list[tuple[str, str, str]]]:
    """``files`` in ``n`` shares of about equal text, the largest file first."""
    shares: list[list[tuple[str, str, str]]] = [[] for _ in range(max(n, 1))]
    sizes = [0] * len(shares)
    for item in sorted(files, key=lambda f: -len(f[2])):
        i = sizes.index(min(sizes))
        shares[i].append(item)
        sizes[i] += len(item[2])
    return shares


@contextlib.contextmanager
def parsed_ahead(
    root: Path, targets: Targets, cache_dir: Path | None
) -> Iterator[tuple[Path | None, Ahead | None]]:
    """``discover_ahead`` for as long as this holds: the child is waited for on the way
    out, or stopped with its helpers when the command is interrupted. Yields the cache
    directory ``read_sites`` is to read, and the ``Ahead`` to hand it.

    ``cache_dir`` None (``check --expect``, which never reads the checkout's cache): the
    child fills a private directory, made here and removed on the way out, which holds
    nothing but what it parsed now; meanwhile SIGTERM ends the command through that
    clean-up, as Ctrl-C does."""
    with contextlib.ExitStack() as stack:
        held: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        if cache_dir is None and can_fork():
            import shutil
            import tempfile

            held = stack.enter_context(_terminate_cleanly())
            with held(), contextlib.suppress(OSError):  # no temporary directory: parsed here
                cache_dir = Path(tempfile.mkdtemp(prefix="quantpatch-check-"))
                stack.callback(shutil.rmtree, cache_dir, ignore_errors=True)
        with held():  # the child is forked and registered before a SIGTERM is acted on
            ahead = discover_ahead(root, targets, cache_dir)
            if ahead is not None:
                stack.enter_context(ahead)
        faults.pause("parsing ahead")  # tests stop the command here (inert otherwise)
        yield cache_dir, ahead


@contextlib.contextmanager
def _terminate_cleanly() -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
    """SIGTERM (``timeout``, a cancelled CI job) ends the command as Ctrl-C does, through
    its clean-up, for as long as this holds; only the main thread can catch signals. What
    it yields holds a SIGTERM back while a resource is made and its clean-up registered,
    so that none is made and then missed."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield contextlib.nullcontext
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            yield
        finally:  # a SIGTERM that came meanwhile is acted on here
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield held
    finally:
        signal.signal(signal.SIGTERM, before)
