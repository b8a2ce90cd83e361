"""Where a dataset lives and whether it is ready, resolved as the generated scripts resolve it:
``DATA_PREFIX`` first, else the registry's prefix under ``DATA_ROOT`` (default ``/data``); the
tokenizer from ``TOKENIZER_MODEL``, else the model's. Light: no tokenizer library is loaded."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DATA_ROOT = "/data"
"""The scripts' ``DATA_ROOT`` when the environment sets none (templates/pretrain.sh.j2)."""

HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?\Z")
"""A Hugging Face hub name (``org/name`` or ``name``); the scripts use the same expression."""

LEGACY_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)
"""The files the fingerprint of manifests made before ``FINGERPRINT`` covered."""
FINGERPRINT = "every-file/1"
"""How a manifest's tokenizer hash was made: every regular file of the folder."""
SAMPLE_BYTES = 1 << 20
"""How much of a dataset file's head and of its tail the check of ``data status`` and of the
launches hashes (with its size)."""


def data_prefix(
    template: str, model: str, env: Mapping[str, str], data_root: str | None = None
) -> Path:
    """A model's prefix for a dataset (``{data_root}`` / ``{model}`` filled in): ``data_root``
    when given, else ``DATA_PREFIX``, else the template under ``DATA_ROOT`` or the default."""
    if data_root is None and env.get("DATA_PREFIX"):
        return Path(env["DATA_PREFIX"])
    root = data_root or env.get("DATA_ROOT") or DEFAULT_DATA_ROOT
    return Path(template.replace("{model}", model).replace("{data_root}", root))


def tokenizer_for(default: str, env: Mapping[str, str]) -> str:
    """The tokenizer a script passes: ``TOKENIZER_MODEL`` when set (a folder made absolute:
    the scripts start in the checkout, not here), else the model's."""
    given = env.get("TOKENIZER_MODEL")
    if given:
        return local_path(given) or given
    return default


def local_path(tokenizer: str) -> str | None:
    """A tokenizer that is a folder here, as an absolute path; None for anything else."""
    path = Path(tokenizer).expanduser()
    return str(path.resolve()) if path.is_dir() else None


def is_local(tokenizer: str) -> bool:
    """Whether a tokenizer is a folder on this machine (else a hub name)."""
    return Path(tokenizer).is_dir()


def tokenizer_problem(tokenizer: str) -> str | None:
    """Why a script would refuse ``TOKENIZER_MODEL``: a path that is not a folder."""
    if is_local(tokenizer) or HUB_NAME.match(tokenizer):
        return None
    return f"the tokenizer {tokenizer} is neither a folder nor a Hugging Face model name"


def files_hash(folder: Path) -> str:
    """sha256 over every regular file of a tokenizer folder, its subfolders' too (symlinks
    followed, as the tokenizer loads them): relative name and content, in name order. Any file
    may decide the token ids (a ``*.tiktoken`` vocabulary, custom tokenizer code)."""
    h = hashlib.sha256()
    files = sorted((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*") if p.is_file())
    for name, path in files:
        h.update(name.encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def legacy_files_hash(folder: Path) -> str:
    """The fingerprint manifests made before ``FINGERPRINT`` recorded (a fixed list of files)."""
    h = hashlib.sha256()
    for name in LEGACY_TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            h.update(name.encode() + b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return "sha256:" + h.hexdigest()


def sample_hash(path: Path) -> str:
    """sha256 of a file's size, its first and its last ``SAMPLE_BYTES`` (all of a small one):
    a truncated file, or another dataset's, differs, at the cost of two short reads."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        h.update(str(size).encode() + b"\0")
        h.update(fh.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            fh.seek(max(SAMPLE_BYTES, size - SAMPLE_BYTES))
            h.update(fh.read(SAMPLE_BYTES))
    return "sha256:" + h.hexdigest()


def files_problem(prefix: Path, manifest: Mapping[str, Any]) -> str | None:
    """How the dataset's ``.bin`` and ``.idx`` differ from what its manifest recorded (size,
    then the hash of head and tail where recorded), in words; None where they agree."""
    sizes = manifest.get("files")
    samples = manifest.get("samples")
    if not isinstance(sizes, dict):
        return None
    out = []
    for suffix in ("bin", "idx"):
        path = Path(f"{prefix}.{suffix}")
        try:
            size = path.stat().st_size
        except OSError:
            continue  # missing: said as such
        want = sizes.get(suffix)
        if count(want) and size != want:
            out.append(f"{path.name} is {size:,} bytes, its manifest says {want:,}")
            continue
        sample = samples.get(suffix) if isinstance(samples, dict) else None
        if isinstance(sample, str):
            try:
                same = sample_hash(path) == sample
            except OSError:
                continue
            if not same:
                out.append(f"{path.name}'s content is not what its manifest recorded")
    if not out:
        return None
    return (
        f"{prefix} does not match its manifest ({'; '.join(out)}): replaced or cut short since "
        "data prepare made it"
    )


def manifest_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".json")


def read_manifest(prefix: Path) -> dict[str, Any] | None:
    """The manifest beside a prefix, or None where there is none (or it cannot be read)."""
    try:
        data = json.loads(manifest_path(prefix).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def count(v: Any) -> bool:
    """A manifest's count: a non-negative integer (JSON's true is no count)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def well_formed(manifest: Mapping[str, Any]) -> bool:
    """Whether a manifest's fields have the types ``data prepare`` writes: one edited by hand
    that does not is never taken as up to date (``prepare`` rewrites it) and ``status`` says
    it is malformed; its tokenizer's name is still compared where it is one."""

    tok = manifest.get("tokenizer")
    files = manifest.get("files")
    return (
        count(manifest.get("documents"))
        and count(manifest.get("tokens"))
        and isinstance(tok, dict)
        and isinstance(tok.get("name"), str)
        and isinstance(tok.get("hash"), str)
        and isinstance(files, dict)
        and all(count(files.get(s)) for s in ("bin", "idx"))
    )


def tokenizer_matches(manifest: Mapping[str, Any], tokenizer: str) -> bool:
    """Whether a manifest's dataset was made with ``tokenizer``: for a folder, the same
    tokenizer files (the fingerprint ``data prepare`` records: a tokenizer retrained into the
    same folder does not match); for a hub name, the same name."""
    made = manifest.get("tokenizer") or {}
    if not isinstance(made, dict):
        return False
    name = made.get("name")
    # a folder is known by its files, never by a name that may also be a hub id
    recorded_local = made.get("local") is True or (
        isinstance(name, str) and Path(name).is_absolute()
    )
    here = local_path(tokenizer)
    if here is not None:
        if made.get("fingerprint") == FINGERPRINT:
            return made.get("hash") == files_hash(Path(here))
        return made.get("hash") == legacy_files_hash(Path(here))
    if recorded_local:
        return False
    return name == tokenizer


@dataclass(frozen=True)
class Need:
    """One dataset a run reads."""

    model: str
    dataset: str
    prefix: Path
    tokenizer: str
    data_root: str | None = None
    """The data root the prefix was resolved under, where the environment chose it (the
    command that makes the dataset names it, since the shell running it may not)."""
    config: str | None = None
    """The --config file that declares the model or dataset (the command names it too)."""
    tokenizer_given: bool = False
    """Whether ``TOKENIZER_MODEL`` chose the tokenizer rather than the model's entry."""

    def missing(self) -> list[str]:
        """The files of the prefix that are absent or unreadable."""
        out = []
        for suffix in (".bin", ".idx"):
            path = Path(f"{self.prefix}{suffix}")
            try:
                with open(path, "rb"):
                    pass
            except OSError:
                out.append(str(path))
        return out

    def problem(self) -> str | None:
        """Why a run on this dataset would fail, in words, or None."""
        missing = self.missing()
        if missing:
            return f"{' and '.join(missing)} missing ({self.model} on {self.dataset})"
        bad = tokenizer_problem(self.tokenizer)
        if bad is not None:
            return f"{bad} ({self.model} on {self.dataset})"
        manifest = read_manifest(self.prefix)
        changed = None if manifest is None else files_problem(self.prefix, manifest)
        if changed is not None:
            return f"{changed} ({self.model} on {self.dataset})"
        if manifest is not None and not tokenizer_matches(manifest, self.tokenizer):
            tok = manifest.get("tokenizer")
            made = tok.get("name", "?") if isinstance(tok, dict) else "?"
            other = " (its files since changed)" if made == self.tokenizer else ""
            return (
                f"{self.prefix} was tokenized with {made}{other}, not with {self.tokenizer} "
                f"({self.model} on {self.dataset})"
            )
        return None

    def made_with(self) -> str | None:
        """The tokenizer the manifest says the dataset was made with, where it is not the one
        the scripts pass (a folder as an absolute path: the runs start in the checkout)."""
        manifest = read_manifest(self.prefix)
        if manifest is None or self.missing() or tokenizer_matches(manifest, self.tokenizer):
            return None
        made = (manifest.get("tokenizer") or {}).get("name")
        if not isinstance(made, str) or not made:
            return None
        return str(Path(made).resolve()) if is_local(made) else made

    def fixes(self) -> str | None:
        """Every way to make the scripts read this dataset with the tokenizer it was made
        with, where that is what is wrong (None otherwise)."""
        made = self.made_with()
        if made is None:
            return None
        # the variable wins over a --config entry: the entry helps only once it is unset
        unset = "unset TOKENIZER_MODEL and " if self.tokenizer_given else ""
        return (
            f"for {self.model} on {self.dataset}: export TOKENIZER_MODEL={made} (the tokenizer "
            f'it was made with), or {unset}put tokenizer_model = "{made}" in the '
            f"[models.{self.model}] table of a --config, or make it again with the scripts' "
            f"tokenizer (`{self.command()}`)"
        )

    def command(self) -> str:
        """The command that makes this dataset, where the scripts read it (only the corpus,
        ``CORPUS``, is the user's to fill in)."""
        words = [f"quantpatch data prepare {self.dataset} --input CORPUS --models {self.model}"]
        if self.tokenizer_given:
            words.append(f"--tokenizer {shlex.quote(f'{self.model}={self.tokenizer}')}")
        if self.data_root:
            words.append(f"--data-root {shlex.quote(self.data_root)}")
        if self.config:
            words.append(f"--config {shlex.quote(self.config)}")
        return " ".join(words)
