"""``quantpatch data prepare`` and ``data status`` as plain functions.

Each distinct tokenizer tokenizes the inputs once: documents are read in order, encoded in
batches by the tokenizer's Rust core on ``workers`` threads (``encode_batch``, the same
backend and settings that ``transformers``' fast tokenizer, and so Megatron's
``HuggingFaceTokenizer.tokenize``, calls for one text), and written as Megatron's
``tools/preprocess_data.py --json-keys text --tokenizer-type HuggingFaceTokenizer
--append-eod`` writes them (``indexed``). Each prefix is written under a temporary name in its
own folder and renamed into place, the old ``.idx`` removed first and the new one last, so a
kill never leaves a dataset under the final name that is not whole; the next run removes what
a killed one left."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpatch import __version__
from quantpatch.base import faults
from quantpatch.base.errors import UserError
from quantpatch.data_prep.indexed import Writer, optimal_dtype
from quantpatch.data_prep.inputs import (
    Text,
    absolute,
    check_readable,
    content_hash,
    documents,
)
from quantpatch.data_prep.layout import (
    FINGERPRINT,
    HUB_NAME,
    count,
    files_hash,
    files_problem,
    is_local,
    local_path,
    manifest_path,
    read_manifest,
    sample_hash,
    well_formed,
)

FORMAT = "megatron-indexed-dataset/1"
BATCH_DOCS = 2048
Progress = Callable[[int, int, int], None]
"""Called with documents, tokens and input bytes done so far."""


@dataclass(frozen=True)
class Target:
    """One model's dataset: where it goes and the tokenizer it is made with."""

    model: str
    prefix: Path
    tokenizer: str


@dataclass
class Outcome:
    model: str
    prefix: Path
    state: str  # "written" or "up to date"
    documents: int
    tokens: int
    seconds: float = 0.0
    shared_with: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "prefix": str(self.prefix),
            "state": self.state,
            "documents": self.documents,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokenized_with": self.shared_with,
        }


@dataclass
class Tokenizer:
    name: str
    """As recorded: a folder's absolute path, else the hub name."""
    backend: Any  # tokenizers.Tokenizer, as transformers configured it
    vocab_size: int
    eod: int
    hash: str
    local: bool = False


def load_tokenizer(name: str, workers: int) -> Tokenizer:
    """The tokenizer Megatron's ``HuggingFaceTokenizer`` loads
    (``AutoTokenizer.from_pretrained``), its vocabulary size (``len``) and EOD (EOS) id."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(workers))  # before tokenizers' first batch
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    # transformers' advice at import ("PyTorch was not found. Models won't be available"):
    # data prepare needs its tokenizers only, so the line would only alarm
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers
    except ImportError:
        raise UserError(
            "data prepare needs transformers and tokenizers (pip install 'transformers>=4.40' "
            "'tokenizers>=0.15', or the data extra: pip install -e '.[data]' in quantpatch's "
            "repository folder)."
        ) from None
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    if not is_local(name) and (name.startswith((".", "/", "~")) or not HUB_NAME.match(name)):
        raise UserError(f"the tokenizer {name} cannot be loaded: there is no such folder.")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"the tokenizer {name} cannot be loaded ({first}).") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise UserError(
            f"the tokenizer {name} has no fast (Rust) tokenizer: data prepare needs its "
            "tokenizer.json."
        )
    if tok.eos_token_id is None:
        raise UserError(
            f"the tokenizer {name} has no EOS token: Megatron's --append-eod ends every "
            "document with it."
        )
    backend.no_truncation()  # as transformers encodes one text without truncation or padding
    backend.no_padding()
    folder = local_path(name)
    if folder is not None:
        return Tokenizer(
            folder, backend, len(tok), int(tok.eos_token_id), files_hash(Path(folder)), True
        )
    digest = "sha256:" + hashlib.sha256(backend.to_str().encode()).hexdigest()
    return Tokenizer(name, backend, len(tok), int(tok.eos_token_id), digest)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _partials(prefix: Path) -> list[Path]:
    return sorted(prefix.parent.glob(f".{prefix.name}.partial-*"))


def remove_leftovers(prefix: Path) -> None:
    """What a killed run left beside ``prefix`` (its process gone)."""
    for path in _partials(prefix):
        pid = path.name.rsplit("-", 1)[-1].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _temp(prefix: Path) -> Path:
    return prefix.with_name(f".{prefix.name}.partial-{os.getpid()}")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def capped_workers(workers: int) -> tuple[int, str | None]:
    """``workers`` capped at the usable cores (the tokenizer starts one thread each: ten
    thousand of them take minutes to start and gain nothing), and the warning to print."""
    cores = usable_cores()
    if workers <= cores:
        return workers, None
    return cores, f"--workers {workers} is more than the {cores} usable cores: using {cores}."


def _lock_path(prefix: Path) -> Path:
    return prefix.with_name(f".{prefix.name}.lock")


@contextlib.contextmanager
def prefix_locks(prefixes: Sequence[Path]) -> Iterator[None]:
    """An exclusive ``flock`` on each prefix's ``.NAME.lock`` (beside it) for the duration,
    as the checkout lock does: the kernel releases it however its holder dies; a prefix that
    another run holds is refused (exit 2) before anything is written. The lock files stay
    (removing one would let a second run lock a new file while a third holds the old), and
    are never written to, so a run that finds its dataset up to date changes nothing."""
    import fcntl

    fds: list[int] = []
    try:
        for prefix in sorted(set(prefixes)):
            lock = _lock_path(prefix)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as exc:
                raise UserError(f"{lock}: cannot create the lock file ({exc.strerror}).") from None
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(
                    f"{prefix}: another data prepare is writing this dataset; wait for it to "
                    "finish and run again."
                ) from None
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _check_places(targets: Sequence[Target]) -> None:
    """Refused before any work: two models writing one prefix (a ``--config`` prefix without
    ``{model}``), or a folder (or anything not a file) where a dataset's file goes."""
    seen: dict[Path, str] = {}
    for target in targets:
        if target.prefix in seen:
            raise UserError(
                f"{seen[target.prefix]} and {target.model} would both write {target.prefix}: "
                "the dataset's prefix needs {model} in it to keep the models apart."
            )
        seen[target.prefix] = target.model
        for path in (Path(f"{target.prefix}.bin"), Path(f"{target.prefix}.idx"),
                     manifest_path(target.prefix)):  # fmt: skip
            if path.is_symlink() or (path.exists() and not path.is_file()):
                raise UserError(f"{path}: not a regular file where the dataset's file goes.")


def _unwritable(folder: Path) -> str | None:
    """Why the dataset cannot be written into ``folder`` (made if missing), None where it
    can: a read-only file system or a permission."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def _describe(paths: Sequence[Path]) -> list[dict[str, Any]]:
    described = []
    for path in paths:
        size, digest = content_hash(path)
        described.append({"path": str(path), "size": size, "hash": digest})
    return described


def _up_to_date_or_refused(
    dataset: str,
    targets: Sequence[Target],
    toks: dict[str, Tokenizer],
    described: list[dict[str, Any]],
    text_key: str,
) -> list[Outcome]:
    """The targets whose folder cannot be written (a read-only file system, a permission):
    each up to date, as its outcome (nothing to write, so nothing refused), or refused in one
    sentence naming the folder, before anything is written."""
    found = []
    for target in targets:
        why = _unwritable(target.prefix.parent)
        if why is None:
            continue
        expected = _expected(dataset, target, toks[target.tokenizer], described, text_key)
        manifest = up_to_date(target.prefix, expected)
        if manifest is None:
            raise UserError(f"{target.prefix.parent} is not writable ({why}): choose --data-root.")
        documents, tokens = manifest["documents"], manifest["tokens"]
        found.append(Outcome(target.model, target.prefix, "up to date", documents, tokens))
    return found


def _batches(inputs: Sequence[Path], key: str) -> Iterator[tuple[list[Text], int]]:
    texts: list[Text] = []
    size = 0
    for path in inputs:
        found = 0
        for text, n in documents(path, key):
            found += 1
            texts.append(text)
            size += n
            if len(texts) >= BATCH_DOCS:
                yield texts, size
                texts, size = [], 0
        if not found:
            raise UserError(
                f"{path}: holds no documents; an empty input would make an empty dataset "
                "(the one there, if any, is kept)."
            )
    if texts:
        yield texts, size


def _read_ahead(batches: Iterator[tuple[list[Text], int]]) -> Iterator[tuple[list[Text], int]]:
    """The batches read and parsed on a thread of their own, a few ahead, while the tokenizer
    (which lets go of the GIL in ``encode_batch``) encodes the one before; a reading error
    is raised here, in order."""
    import queue
    import threading

    ahead: queue.Queue[tuple[list[Text], int] | BaseException | None] = queue.Queue(maxsize=4)

    def read() -> None:
        try:
            for batch in batches:
                ahead.put(batch)
            ahead.put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            ahead.put(exc)

    threading.Thread(target=read, name="quantpatch-data-reader", daemon=True).start()
    while (item := ahead.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


def tokenize(
    inputs: Sequence[Path],
    key: str,
    tok: Tokenizer,
    dest: Path,
    progress: Progress | None = None,
) -> Writer:
    """Every document of ``inputs`` into ``dest.bin`` / ``dest.idx``, as Megatron's tool
    records it: a document's sentences (one, unless the text is a list) each encoded, the
    empty ones dropped, EOD appended to the last; a document with no tokens is an empty
    document (no sequence)."""
    writer = Writer(dest, tok.vocab_size)
    encode = tok.backend.encode_batch
    eod = tok.eod
    docs = tokens = done_bytes = 0
    try:
        for texts, size in _read_ahead(_batches(inputs, key)):
            flat: list[int] = []
            lengths: list[int] = []
            ends: list[int] = []
            if all(isinstance(t, str) for t in texts):
                for enc in encode(texts, add_special_tokens=True):
                    ids = enc.ids
                    if ids:
                        flat.extend(ids)
                        flat.append(eod)
                        lengths.append(len(ids) + 1)
                    ends.append(len(lengths))
            else:
                for text in texts:
                    sentences = [text] if isinstance(text, str) else text
                    found = False
                    for enc in encode(sentences, add_special_tokens=True) if sentences else []:
                        if enc.ids:
                            flat.extend(enc.ids)
                            lengths.append(len(enc.ids))
                            found = True
                    if found:
                        flat.append(eod)
                        lengths[-1] += 1
                    ends.append(len(lengths))
            faults.step(f"write {dest}.bin", done=False)
            writer.add(flat, lengths, ends)
            faults.step(f"write {dest}.bin", done=True)
            docs += len(texts)
            tokens += len(flat)
            done_bytes += size
            if progress is not None:
                progress(docs, tokens, done_bytes)
        writer.finish()
    except BaseException:
        writer.abandon()
        raise
    return writer


def _expected(
    dataset: str, target: Target, tok: Tokenizer, inputs: list[dict[str, Any]], key: str
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "dataset": dataset,
        "model": target.model,
        "inputs": inputs,
        "text_key": key,
        "tokenizer": {
            "name": tok.name,
            "local": tok.local,
            "hash": tok.hash,
            **({"fingerprint": FINGERPRINT} if tok.local else {}),
            "vocab_size": tok.vocab_size,
            "eod": tok.eod,
        },
        "dtype": optimal_dtype(tok.vocab_size).__name__,
        "options": "--json-keys text --tokenizer-type HuggingFaceTokenizer --append-eod",
    }


SAME = ("format", "inputs", "text_key", "tokenizer", "dtype", "options")


def up_to_date(prefix: Path, expected: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest where the dataset at ``prefix`` is whole and made from the same inputs with
    the same tokenizer; None where it must be (re)made."""
    manifest = read_manifest(prefix)
    if manifest is None or not well_formed(manifest):
        return None
    if any(manifest.get(k) != expected[k] for k in SAME):
        return None
    for suffix in ("bin", "idx"):
        if not Path(f"{prefix}.{suffix}").is_file():
            return None
    if files_problem(prefix, manifest) is not None:
        return None
    return manifest


def _install(temp: Path, prefix: Path, manifest: dict[str, Any]) -> None:
    """The temporary dataset renamed into place: the old ``.idx`` removed first (the old
    dataset is then no dataset), the ``.bin`` and the manifest, the ``.idx`` last."""
    manifest["files"] = {s: Path(f"{temp}.{s}").stat().st_size for s in ("bin", "idx")}
    # the size and the hash of head and tail are what data status and the launches compare
    # (two short reads); the full sha256 is for the record (sha256sum checks it)
    manifest["samples"] = {s: sample_hash(Path(f"{temp}.{s}")) for s in ("bin", "idx")}
    manifest["sha256"] = {s: content_hash(Path(f"{temp}.{s}"))[1] for s in ("bin", "idx")}
    try:
        Path(f"{temp}.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UserError(
            f"{prefix.parent}: cannot write the dataset ({exc.strerror or exc}); the dataset "
            "there, if any, is unchanged."
        ) from None
    Path(f"{prefix}.idx").unlink(missing_ok=True)
    for suffix in ("bin", "json", "idx"):
        faults.step(f"rename {prefix}.{suffix}", done=False)
        final = manifest_path(prefix) if suffix == "json" else Path(f"{prefix}.{suffix}")
        os.replace(f"{temp}.{suffix}", final)
        faults.step(f"rename {prefix}.{suffix}", done=True)


def prepare(
    dataset: str,
    inputs: Sequence[Path],
    targets: Sequence[Target],
    *,
    text_key: str = "text",
    workers: int = 1,
    progress: Callable[[str], Progress | None] | None = None,
) -> list[Outcome]:
    """Each target's dataset made (or found up to date); all inputs, folders and tokenizers
    are checked before anything is written."""
    if not inputs:
        raise UserError("data prepare needs at least one --input.")
    if workers < 1:
        raise UserError(f"--workers must be at least 1 (got {workers}).")
    workers = min(workers, usable_cores())
    _check_places(targets)
    paths = [absolute(Path(p)) for p in inputs]
    for path in paths:
        check_readable(path)
    toks: dict[str, Tokenizer] = {}
    for target in targets:
        if target.tokenizer not in toks:
            toks[target.tokenizer] = load_tokenizer(target.tokenizer, workers)
    described = _describe(paths)
    done = _up_to_date_or_refused(dataset, targets, toks, described, text_key)
    ready = {o.model for o in done}  # in folders it cannot write: no lock, nothing to do
    rest = [t for t in targets if t.model not in ready]
    with prefix_locks([t.prefix for t in rest]):
        outcomes = [*done, *_prepare(dataset, described, rest, toks, text_key, progress)]
    order = {t.model: i for i, t in enumerate(targets)}
    return sorted(outcomes, key=lambda o: order[o.model])


def _prepare(
    dataset: str,
    described: list[dict[str, Any]],
    targets: Sequence[Target],
    toks: dict[str, Tokenizer],
    text_key: str,
    progress: Callable[[str], Progress | None] | None,
) -> list[Outcome]:
    paths = [Path(d["path"]) for d in described]
    # models whose tokenizers are the same files share one tokenization
    groups: dict[str, list[Target]] = {}
    for target in targets:
        groups.setdefault(toks[target.tokenizer].hash, []).append(target)
    outcomes: list[Outcome] = []
    for group in groups.values():
        tok = toks[group[0].tokenizer]
        pending: list[tuple[Target, dict[str, Any]]] = []
        for target in group:
            remove_leftovers(target.prefix)
            expected = _expected(dataset, target, tok, described, text_key)
            found = up_to_date(target.prefix, expected)
            if found is None:
                pending.append((target, expected))
            else:
                outcomes.append(
                    Outcome(
                        target.model,
                        target.prefix,
                        "up to date",
                        found["documents"],
                        found["tokens"],
                    )
                )
        if not pending:
            continue
        start = time.monotonic()
        first = _temp(pending[0][0].prefix)
        temps = [_temp(t.prefix) for t, _ in pending]
        try:
            label = ", ".join(t.model for t, _ in pending)
            try:
                writer = tokenize(
                    paths, text_key, tok, first, progress(label) if progress is not None else None
                )
                for temp in temps[1:]:
                    for suffix in ("bin", "idx"):
                        shutil.copyfile(f"{first}.{suffix}", f"{temp}.{suffix}")
            except OSError as exc:  # a full disk, a quota: nothing is installed yet
                raise UserError(
                    f"{first.parent}: cannot write the dataset ({exc.strerror or exc}); the "
                    "dataset there, if any, is unchanged."
                ) from None
            seconds = time.monotonic() - start
            for (target, manifest), temp in zip(pending, temps, strict=True):
                manifest.update(
                    documents=writer.documents,
                    tokens=writer.tokens,
                    quantpatch=__version__,
                    seconds=round(seconds, 3),
                )
                _install(temp, target.prefix, manifest)
                outcomes.append(
                    Outcome(
                        target.model,
                        target.prefix,
                        "written",
                        writer.documents,
                        writer.tokens,
                        seconds,
                        [t.model for t, _ in pending],
                    )
                )
        finally:
            for temp in temps:
                for suffix in ("bin", "idx", "json"):
                    with contextlib.suppress(OSError):
                        Path(f"{temp}.{suffix}").unlink()
    return outcomes


def status(needs: Sequence[tuple[str, str, Path, str]]) -> list[dict[str, Any]]:
    """For each (model, dataset, prefix, tokenizer): whether the dataset is there, its
    documents and tokens (from its manifest), and whether its tokenizer is the model's."""
    from quantpatch.data_prep.layout import tokenizer_matches

    rows = []
    for model, dataset, prefix, tokenizer in needs:
        present = all(Path(f"{prefix}.{s}").is_file() for s in ("bin", "idx"))
        manifest = read_manifest(prefix)
        made = (manifest or {}).get("tokenizer") or {}
        documents, tokens = ((manifest or {}).get(k) for k in ("documents", "tokens"))
        changed = files_problem(prefix, manifest) if manifest is not None and present else None
        rows.append(
            {
                "model": model,
                "dataset": dataset,
                "prefix": str(prefix),
                "exists": present,
                "documents": documents if count(documents) else None,
                "tokens": tokens if count(tokens) else None,
                "manifest": manifest is not None,
                "manifest_well_formed": manifest is not None and well_formed(manifest),
                "tokenizer": tokenizer,
                "made_with": made.get("name") if isinstance(made, dict) else None,
                "tokenizer_matches": (
                    None if manifest is None else tokenizer_matches(manifest, tokenizer)
                ),
                # the .bin/.idx against the manifest's sizes and hashes of head and tail
                "files_match": None if manifest is None or not present else changed is None,
                "files_problem": changed,
            }
        )
    return rows
