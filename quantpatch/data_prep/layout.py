"""Where a dataset lives and whether it is ready, resolved as the generated scripts resolve it:
``DATA_PREFIX`` first, else the registry's prefix under ``DATA_ROOT`` (default ``/data``); the
tokenizer from ``TOKENIZER_MODEL``, else the model's. Light: no tokenizer library is loaded."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_DATA_ROOT = "/data"
"""The scripts' ``DATA_ROOT`` when the environment sets none (templates/pretrain.sh.j2)."""

HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?\Z")
"""A Hugging Face hub name (``org/name`` or ``name``); the scripts use the same expression."""

TOKENIZER_FILES = (
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
"""The files of a tokenizer folder that decide its token ids (weights and configs are not)."""


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
    """The tokenizer a script passes: ``TOKENIZER_MODEL`` when set, else the model's."""
    return env.get("TOKENIZER_MODEL") or default


def is_local(tokenizer: str) -> bool:
    """Whether a tokenizer is a folder on this machine (else a hub name)."""
    return Path(tokenizer).is_dir()


def tokenizer_problem(tokenizer: str) -> str | None:
    """Why a script would refuse ``TOKENIZER_MODEL``: a path that is not a folder."""
    if is_local(tokenizer) or HUB_NAME.match(tokenizer):
        return None
    return f"the tokenizer {tokenizer} is neither a folder nor a Hugging Face model name"


def files_hash(folder: Path) -> str:
    """sha256 over the tokenizer files of a folder (name and content, in name order)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            h.update(name.encode() + b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return "sha256:" + h.hexdigest()


def manifest_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".json")


def read_manifest(prefix: Path) -> dict[str, Any] | None:
    """The manifest beside a prefix, or None where there is none (or it cannot be read)."""
    try:
        data = json.loads(manifest_path(prefix).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and _well_formed(data) else None


def _well_formed(manifest: Mapping[str, Any]) -> bool:
    """Whether a manifest's fields have the types ``data prepare`` writes (a hand-edited one
    that does not is no manifest: ``status`` says so and ``prepare`` rewrites the dataset)."""

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

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
    if is_local(tokenizer):
        return made.get("hash") == files_hash(Path(tokenizer))
    return made.get("name") == tokenizer


@dataclass(frozen=True)
class Need:
    """One dataset a run reads."""

    model: str
    dataset: str
    prefix: Path
    tokenizer: str

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
        if manifest is not None and not tokenizer_matches(manifest, self.tokenizer):
            made = manifest["tokenizer"]["name"]
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
        return (
            f"for {self.model} on {self.dataset}: export TOKENIZER_MODEL={made} (the tokenizer "
            f'it was made with), or put tokenizer_model = "{made}" in the [models.{self.model}] '
            f"table of a --config, or make it again with the scripts' tokenizer "
            f"(`{self.command()}`)"
        )

    def command(self) -> str:
        """The command that makes this dataset."""
        return f"quantpatch data prepare {self.dataset} --input CORPUS --models {self.model}"
