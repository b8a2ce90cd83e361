"""Finding and reading saved tensors: our saver's ``.pt`` files and stats-only JSONL, and the
fork's saver output (the same dict layout, its own names, often under ``<dir>/<format>/``).

Every ``.pt`` is loaded with ``torch.load(weights_only=True, mmap=True)``: a file that needs
more than tensors and plain containers (a pickle that would run code) is refused, never
executed; a file that cannot be read is reported and skipped. Metadata comes from the file's
dict first, its name second, its folder (a format name) last.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpatch.base.config import QUANT_TYPES

# {timestamp}_{counter}_{layer_type}_L{layer}_{operation}_{quant}[_rank{r}]_{tensor}.pt, the
# name our saver and the fork's write (a file name, not Python source)
_NAME = re.compile(
    r"^(?P<stamp>\d{8}_\d{6})_(?P<counter>\d+)_(?P<layer_type>.+?)_L(?P<layer>\d+|None|[A-Za-z]\w*?)_"
    r"(?P<operation>forward|backward)_(?P<quant>[A-Za-z0-9]+)(?:_rank(?P<rank>\d+))?_"
    r"(?P<tensor>.+)$"
)
GROUPS = ("layer", "kind", "operation", "tensor", "format", "rank", "step")


@dataclass
class TensorMeta:
    """What a saved tensor is: the grouping keys of ``tensors summary``/``formats``."""

    path: str
    layer: int | str | None = None  # a number; a module outside the layers by its name
    kind: str | None = None  # module kind (qkv, proj, fc1, fc2, core_attention, ...)
    operation: str | None = None  # forward / backward
    tensor: str | None = None  # input, weight, grad_output, query, key, value, ...
    format: str | None = None  # the quant type in force when it was saved
    rank: int | None = None
    step: int | None = None  # micro-step
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self, by: tuple[str, ...]) -> tuple[Any, ...]:
        return tuple(getattr(self, g) for g in by)


@dataclass
class Skipped:
    path: str
    reason: str


def discover(root: Path) -> tuple[list[Path], list[Path]]:
    """The regular ``.pt`` files and ``.jsonl`` stats files under ``root``, sorted."""
    pts, jsonl, _ = discover_all(root)
    return pts, jsonl


def discover_all(root: Path) -> tuple[list[Path], list[Path], list[Skipped]]:
    """``.pt`` files and ``.jsonl`` stats files under ``root``, sorted, and the ones skipped:
    only regular files are read (a symbolic link to one counts); a FIFO, a device, a socket
    or a dangling link so named is skipped with what it is, never opened (symbolic links to
    directories are not followed)."""
    pts: list[Path] = []
    jsonl: list[Path] = []
    skipped: list[Skipped] = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if not name.endswith((".pt", ".jsonl")):
                continue
            path = Path(dirpath) / name
            try:
                mode = os.stat(path).st_mode
            except OSError as exc:
                skipped.append(Skipped(str(path.relative_to(root)), f"cannot be read "
                                       f"({exc.strerror or exc})"))  # fmt: skip
                continue
            if not stat.S_ISREG(mode):
                skipped.append(Skipped(str(path.relative_to(root)), f"not a regular file "
                                       f"({_kind_of(mode)})"))  # fmt: skip
            elif name.endswith(".pt"):
                pts.append(path)
            else:
                jsonl.append(path)
    skipped.sort(key=lambda s: s.path)
    return sorted(pts), sorted(jsonl), skipped


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


OUTPUT_LAYER = "output_layer"


def layer_of(raw: Any, module_kind: Any, kind: Any) -> int | str | None:
    """The layer a tensor belongs to: its number, or, for a module outside the transformer
    layers (saved as ``L None``, or with ``layer_idx`` null), the module's name: its
    ``module_kind`` where the metadata has one, ``output_layer`` for a linear (the only
    linear of Megatron's GPT model outside its layers), its layer type otherwise. ``None``
    only where nothing names it."""
    number = _int(raw)
    if number is not None:
        return number
    if isinstance(raw, str) and raw not in ("", "None"):
        return raw  # a name where the number goes (``..._Loutput_layer_forward_...``)
    if isinstance(module_kind, str) and module_kind:
        return module_kind
    if kind == "linear":
        return OUTPUT_LAYER
    return str(kind) if kind else None


def meta_of(path: Path, metadata: dict[str, Any] | None, root: Path | None = None) -> TensorMeta:
    md = metadata if isinstance(metadata, dict) else {}
    m = _NAME.match(path.stem)
    parsed = m.groupdict() if m else {}
    fmt = md.get("quant_type") or parsed.get("quant")
    if not fmt and path.parent.name in QUANT_TYPES and path.parent != root:
        fmt = path.parent.name
    layer = md.get("layer_idx", md.get("layer", parsed.get("layer")))
    kind = md.get("module_kind") or md.get("layer_type") or parsed.get("layer_type")
    return TensorMeta(
        path=str(path if root is None else path.relative_to(root)),
        layer=layer_of(layer, md.get("module_kind"), kind),
        kind=kind,
        operation=md.get("operation") or parsed.get("operation"),
        tensor=md.get("tensor_name") or parsed.get("tensor"),
        format=str(fmt) if fmt else None,
        rank=_int(md.get("rank", parsed.get("rank"))),
        step=_int(md.get("micro_step", md.get("iteration"))),
    )


_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"  # torch.save's zip archive; a legacy pickle
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_tensor(path: Path) -> tuple[Any, dict[str, Any]]:
    """The tensor of a saved file and its metadata dict. Raises ``ValueError`` with a reason
    for anything that is not a safely loadable file holding one dense tensor: no regular
    file, no zip archive or pickle, a pickle that would run code (the global it names is
    said), a sparse or quantized tensor. The file is opened without blocking and checked
    on its descriptor before torch reads it (through that descriptor, where /proc has it);
    torch's warnings about the file's pickle protocol are silenced."""
    import pickle
    import warnings

    import torch

    from quantpatch.analysis.training_logs import open_regular

    with open_regular(path) as fh:
        magic = fh.read(4)
        if not (magic.startswith(_ZIP) or magic.startswith(_PICKLE)):
            raise ValueError("not a tensor file (neither a zip archive nor a pickle)")
        fd_path = f"/proc/self/fd/{fh.fileno()}"
        source = fd_path if os.path.exists(fd_path) else str(path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Detected pickle protocol", deprecations
                try:
                    obj = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):
                        raise
                    # a legacy (non-zip) file cannot be memory-mapped: read it whole
                    obj = torch.load(source, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(_refusal(str(exc))) from None
        except Exception as exc:  # cut short, or a file of another kind
            raise ValueError(f"unreadable ({_first_line(exc)})") from None
    if isinstance(obj, dict) and isinstance(obj.get("tensor"), torch.Tensor):
        t, md = obj["tensor"], obj.get("metadata")
    elif isinstance(obj, torch.Tensor):
        t, md = obj, {}
    else:
        raise ValueError("not a saved tensor (expected a dict with a 'tensor')")
    if t.layout != torch.strided:
        raise ValueError(f"not a dense tensor ({str(t.layout).removeprefix('torch.')})")
    if t.is_quantized:
        raise ValueError(f"a quantized tensor ({str(t.dtype).removeprefix('torch.')})")
    return t, md if isinstance(md, dict) else {}


def _refusal(message: str) -> str:
    """Why torch's safe loader refused a pickle, in one line: the global it would import
    (``unsupported GLOBAL posix.system``), or the instruction it does not run."""
    found = _GLOBAL.search(message)
    if found:
        return f"refused: loading it would run code (it imports {found.group(1)})"
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    why = next((ln for ln in lines if ln.lower().startswith("unsupported")), "")
    return f"refused: torch's safe loader does not read its pickle ({why[:120] or 'no reason'})"


def _kind_of(mode: int) -> str:
    from quantpatch.analysis.training_logs import kind_of

    return kind_of(mode)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:160]


@dataclass
class StatsRecord:
    meta: TensorMeta
    info: dict[str, Any]


MAX_STATS_LINE = 1 << 20
"""A stats record is a few hundred bytes; a longer line is skipped, never held whole."""
MAX_STATS_LINES = 10_000_000
"""Lines read from one stats file at most (a file linked to an endless source ends)."""


def _bounded_lines(fh: Any) -> Iterator[bytes | None]:
    """The lines of a binary file, each at most ``MAX_STATS_LINE`` bytes; ``None`` for a
    longer one, whose rest is read past in pieces of that size."""
    while True:
        line = fh.readline(MAX_STATS_LINE + 1)
        if not line:
            return
        if len(line) > MAX_STATS_LINE and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = fh.readline(MAX_STATS_LINE)
            yield None
            continue
        yield line


def read_stats_lines(path: Path, root: Path) -> Iterator[StatsRecord | Skipped]:
    """Stats-only records (``stats_rank{r}.jsonl``): one JSON object per line; a bad line is
    skipped with its number."""
    from quantpatch.analysis.training_logs import open_regular

    rel = str(path.relative_to(root))
    try:
        fh = open_regular(path)
    except ValueError as exc:
        yield Skipped(rel, str(exc))
        return
    with fh:
        for n, raw in enumerate(_bounded_lines(fh), 1):
            if raw is None:
                yield Skipped(f"{rel}:{n}", f"a line longer than {MAX_STATS_LINE >> 20} MiB")
                continue
            if n > MAX_STATS_LINES:
                yield Skipped(rel, f"read its first {MAX_STATS_LINES} lines only")
                return
            line = raw.decode("utf-8", "replace")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                info = rec["tensor_info"]
                md = rec.get("metadata") or {}
                name = str(rec.get("name", ""))
            except (ValueError, KeyError, TypeError):
                yield Skipped(f"{rel}:{n}", "not a stats record")
                continue
            meta = meta_of(path.with_name(name + ".jsonl") if name else path, md, None)
            meta.path = f"{rel}:{n}"
            yield StatsRecord(meta, info if isinstance(info, dict) else {})
