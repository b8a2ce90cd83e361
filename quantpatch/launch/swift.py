"""Megatron-SWIFT (ms-swift's ``megatron pt``) as a launcher.

What ``megatron pt`` accepts is read statically (libcst; ms-swift is never imported) from an
ms-swift wheel, an unpacked wheel or an installation: the fields of its pretraining argument
dataclass, whose names are its ``--flags``. Whether it can run the code quantpatch patches is
read there too: quantpatch's sites live in Megatron's local linear layers and
``DotProductAttention``, so an ms-swift that cannot build ``transformer_impl='local'`` layers
or does not take its Megatron-LM from ``MEGATRON_LM_PATH`` (the scheme's worktree) would train
without the requested quantization; for such an ms-swift no script is generated.

Without an explicit source the installed ms-swift is read; without one, the list bundled in
``quantpatch/data/swift/`` (read from the ms-swift 3.12.6 wheel by this module).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantpatch.base.errors import UserError

if TYPE_CHECKING:
    import libcst as cst

    from quantpatch.launch.layout import Layout
    from quantpatch.launch.registry import Registry

BUNDLED = "3.12.6"
# the class `megatron pt` parses its arguments into, by ms-swift layout (3.x, then 4.x)
PRETRAIN_CLASSES = (
    ("swift.megatron.argument.train_args", "MegatronTrainArguments"),
    ("swift.megatron.arguments.pretrain_args", "MegatronPretrainArguments"),
)
ENV_MODULES = ("swift.megatron.init", "swift.megatron")
"""Where ms-swift sets up Megatron-LM (and reads ``MEGATRON_LM_PATH``)."""
# flags quantpatch's swift scripts pass themselves
OWN_FIELDS = (
    "model",
    "dataset",
    "max_length",
    "padding_free",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "sequence_parallel",
    "save",
    "tensorboard_dir",
    "megatron_extra_kwargs",
)
MOE_FIELDS = ("expert_model_parallel_size", "expert_tensor_parallel_size")
VPP_FIELD = "num_virtual_stages_per_pipeline_rank"
# registry args the swift scripts do not pass: ms-swift takes tokenizer and data from --model
# and --dataset, and the parallel sizes and outputs are the script's own
SKIPPED_ARGS = frozenset({"tokenizer-type", "tokenizer-model", "vocab-size"})


@dataclass(frozen=True)
class SwiftSource:
    version: str
    fields: frozenset[str]
    """Every ``--field`` that ``megatron pt`` accepts."""
    where: str
    """What was read: a path, or the bundled list."""
    refusal: str | None = None
    """Why this ms-swift cannot run quantpatch's sites (``None``: it can)."""

    def describe(self) -> str:
        return f"ms-swift {self.version} ({len(self.fields)} `megatron pt` arguments, {self.where})"


class _Tree:
    """Python source files of an ms-swift, in a directory or a wheel."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._zip = zipfile.ZipFile(root) if root.is_file() else None
        self._modules: dict[str, cst.Module | None] = {}

    def text(self, rel: str) -> str | None:
        try:
            if self._zip is not None:
                try:
                    return self._zip.read(rel).decode("utf-8")
                except KeyError:
                    return None
            path = self.root / rel
            return path.read_text(encoding="utf-8") if path.is_file() else None
        except (UnicodeDecodeError, OSError, zipfile.BadZipFile) as exc:
            raise UserError(f"{self.root}: {rel} cannot be read as UTF-8 text ({exc}).") from None

    def module(self, name: str) -> cst.Module | None:
        if name not in self._modules:
            import libcst as cst

            base = name.replace(".", "/")
            text = self.text(f"{base}.py")
            if text is None:
                text = self.text(f"{base}/__init__.py")
            try:
                self._modules[name] = None if text is None else cst.parse_module(text)
            except cst.ParserSyntaxError:
                raise UserError(f"{self.root}: {base}.py does not parse.") from None
        return self._modules[name]

    def is_package(self, name: str) -> bool:
        return self.text(f"{name.replace('.', '/')}/__init__.py") is not None


def _dotted(node: Any) -> str:
    import libcst as cst

    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


def _imports(tree: _Tree, module: str) -> dict[str, tuple[str, str]]:
    """``name -> (module, name)`` for every ``from X import name`` anywhere in the module
    (lazy packages import under ``if TYPE_CHECKING``)."""
    import libcst as cst

    node = tree.module(module)
    if node is None:
        return {}
    package = module if tree.is_package(module) else module.rpartition(".")[0]
    found: dict[str, tuple[str, str]] = {}

    class Visitor(cst.CSTVisitor):
        def visit_ImportFrom(self, imp: cst.ImportFrom) -> None:
            source = _dotted(imp.module) if imp.module is not None else ""
            if imp.relative:
                parts = package.split(".")
                parts = parts[: len(parts) - (len(imp.relative) - 1)]
                source = ".".join([*parts, source] if source else parts)
            if isinstance(imp.names, cst.ImportStar):
                return
            for alias in imp.names:
                name = _dotted(alias.name)
                local = alias.asname.name.value if alias.asname else name  # type: ignore[union-attr]
                found[local] = (source, name)

    node.visit(Visitor())
    return found


def _class(tree: _Tree, module: str, name: str, depth: int = 0) -> tuple[str, Any] | None:
    """The ``ClassDef`` of ``name`` as seen from ``module`` (following imports)."""
    import libcst as cst

    node = tree.module(module)
    if node is None or depth > 12:
        return None
    for stmt in node.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == name:
            return module, stmt
    target = _imports(tree, module).get(name)
    return None if target is None else _class(tree, *target, depth + 1)


def _linearize(tree: _Tree, module: str, cls: Any) -> list[tuple[str, Any]]:
    """The class and its bases in method-resolution order (C3), as far as they resolve."""
    bases = []
    for arg in cls.bases:
        found = _class(tree, module, _dotted(arg.value).rpartition(".")[2])
        if found is not None:
            bases.append(found)
    seqs = [_linearize(tree, *b) for b in bases] + [bases]
    order = [(module, cls)]
    while True:
        seqs = [s for s in seqs if s]
        if not seqs:
            return order
        for seq in seqs:
            head = seq[0]
            if not any(head[1] is other[1] for s in seqs for other in s[1:]):
                break
        else:  # inconsistent hierarchy: keep the declared order
            head = seqs[0][0]
        order.append(head)
        seqs = [s[1:] if s[0][1] is head[1] else s for s in seqs]


def _fields(order: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Dataclass fields (annotated names of each class body) over the hierarchy."""
    import libcst as cst

    out: dict[str, Any] = {}
    for _, cls in reversed(order):
        for line in cls.body.body:
            if not isinstance(line, cst.SimpleStatementLine):
                continue
            for stmt in line.body:
                if isinstance(stmt, cst.AnnAssign) and isinstance(stmt.target, cst.Name):
                    name = stmt.target.value
                    if name.startswith("_") or _dotted(stmt.annotation.annotation).endswith(
                        "ClassVar"
                    ):
                        continue
                    out[name] = stmt.annotation.annotation
    return out


def _strings(node: Any) -> set[str]:
    import libcst as cst

    found: set[str] = set()

    class Visitor(cst.CSTVisitor):
        def visit_SimpleString(self, s: cst.SimpleString) -> None:
            value = s.evaluated_value
            if isinstance(value, str):
                found.add(value)

    node.visit(Visitor())
    return found


def read_swift(root: Path) -> SwiftSource:
    """Read an ms-swift (wheel, unpacked wheel or site-packages) without importing it."""
    if not root.exists():
        raise UserError(f"{root}: no such ms-swift wheel or directory.")
    try:
        tree = _Tree(root)
    except zipfile.BadZipFile:
        raise UserError(f"{root}: not a wheel (zip) or a directory holding swift/.") from None
    version_module = tree.module("swift.version")
    if version_module is None:
        raise UserError(f"{root}: holds no ms-swift (no swift/version.py).")
    version = next(
        (
            s
            for s in sorted(_strings(version_module))
            if s[:1].isdigit() and s.replace(".", "").replace("rc", "").isalnum()
        ),
        "unknown",
    )
    for module, name in PRETRAIN_CLASSES:
        found = _class(tree, module, name)
        if found is not None:
            break
    else:
        raise UserError(
            f"ms-swift {version} in {root}: found none of "
            f"{', '.join(f'{m}.{c}' for m, c in PRETRAIN_CLASSES)}, the arguments of "
            "`megatron pt` that quantpatch knows."
        )
    fields = _fields(_linearize(tree, *found))
    where = f"{found[0].replace('.', '/')}.py"
    refusal = None
    impl = fields.get("transformer_impl")
    if impl is None or "local" not in _strings(impl):
        refusal = (
            f"ms-swift {version} has no transformer_impl='local' (its `megatron pt` arguments "
            f"in {where} build Transformer Engine layers only), so quantpatch's sites in the "
            "local linear layers and DotProductAttention would never run; use an ms-swift that "
            "takes --transformer_impl local and MEGATRON_LM_PATH (the 3.x line, e.g. 3.12.6)"
        )
    elif not any(
        "MEGATRON_LM_PATH" in _strings(m)
        for m in (tree.module(name) for name in ENV_MODULES)
        if m is not None
    ):
        refusal = (
            f"ms-swift {version} does not read MEGATRON_LM_PATH (in "
            f"{' or '.join(ENV_MODULES)}), so it would not train the scheme's worktree"
        )
    return SwiftSource(version, frozenset(fields), str(root), refusal)


def _installed() -> Path | None:
    try:
        dist = metadata.distribution("ms-swift")
    except metadata.PackageNotFoundError:
        return None
    root = Path(str(dist.locate_file("")))
    return root if (root / "swift" / "version.py").is_file() else None


def bundled() -> SwiftSource:
    text = resources.files("quantpatch").joinpath(f"data/swift/ms-swift-{BUNDLED}.txt")
    lines = text.read_text("utf-8").splitlines()
    fields = frozenset(line for line in lines if line and not line.startswith("#"))
    return SwiftSource(BUNDLED, fields, f"the bundled list ms-swift-{BUNDLED}.txt")


def _cache_key(root: Path) -> str:
    stat = (root / "swift" / "version.py") if root.is_dir() else root
    info = stat.stat()
    return hashlib.sha256(
        f"{root.resolve()}|{info.st_mtime_ns}|{info.st_size}".encode()
    ).hexdigest()


@cache
def swift_source(path: Path | None) -> SwiftSource:
    """The ms-swift to generate for: ``path``; else the installed one; else the bundled list.
    A read is cached on disk (keyed by path and modification time: parsing takes about half a
    second) and in the process (validation, rendering and the summary share one read)."""
    root = path if path is not None else _installed()
    if root is None:
        return bundled()
    from quantpatch.base.megatron_source import cache_dir, make_private_dirs

    if not root.exists():
        raise UserError(f"--swift: {root} does not exist.")
    if root.is_dir() and not (root / "swift" / "version.py").is_file():
        raise UserError(
            f"--swift: {root} holds no ms-swift (no swift/version.py): give a wheel, an "
            "unpacked wheel or the site-packages directory it is installed in."
        )
    cached = cache_dir() / "swift" / f"{_cache_key(root)}.json"
    try:
        data = json.loads(cached.read_text("utf-8"))
        return SwiftSource(
            data["version"], frozenset(data["fields"]), data["where"], data["refusal"]
        )
    except (OSError, ValueError, KeyError):
        pass
    source = read_swift(root)
    try:
        make_private_dirs(cached.parent)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "version": source.version,
                    "fields": sorted(source.fields),
                    "where": source.where,
                    "refusal": source.refusal,
                }
            ),
            "utf-8",
        )
        tmp.replace(cached)
    except OSError:
        pass  # a cache that cannot be written only costs the next call a parse
    return source


# -- the scripts ---------------------------------------------------------------------------


def _swift_args(
    values: Mapping[str, object], fields: frozenset[str]
) -> tuple[list[tuple[str, str | None]], dict[str, object]]:
    """Registry args (Megatron flag names) as ``megatron pt`` arguments: a flag whose
    underscore name is an ms-swift field is passed as that field; any other goes to Megatron
    through ``--megatron_extra_kwargs``."""
    from quantpatch.launch.shell_render import BATCH_VARIABLES, ShellExpr

    passed: list[tuple[str, str | None]] = []
    extra: dict[str, object] = {}
    for flag, value in values.items():
        if flag in SKIPPED_ARGS or value is False:
            continue
        field = flag.replace("-", "_")
        if field in fields:
            if flag in BATCH_VARIABLES:
                passed.append((field, ShellExpr(f'"${BATCH_VARIABLES[flag]}"')))
            elif value is True:
                passed.append((field, "true"))
            elif isinstance(value, list):
                passed.append((field, " ".join(str(v) for v in value)))
            else:
                passed.append((field, str(value)))
        else:
            extra[field] = value
    return passed, extra


def check_models(
    reg: Registry, models: Sequence[str], profile: str, path: Path | None
) -> SwiftSource:
    """Refuse when this ms-swift cannot run the local layers, or lacks a field the scripts
    pass themselves."""
    source = swift_source(path)
    if source.refusal is not None:
        raise UserError(f"{source.refusal}; read from {source.where}.")
    need = list(OWN_FIELDS)
    if any("num-experts" in reg.models[m].args for m in models):
        need += MOE_FIELDS
    missing = [f for f in need if f not in source.fields]
    if missing:
        raise UserError(
            f"ms-swift {source.version} does not accept --{', --'.join(missing)}, which the "
            f"swift scripts pass; read from {source.where}."
        )
    return source


def render_body(
    reg: Registry,
    model: str,
    dataset: str,
    scheme: str,
    profile: str,
    layout: Layout,
    run_name: str,
    path: Path | None,
    values: Mapping[str, object],
    is_moe: bool,
    blocked: Mapping[str, str] | None = None,
) -> str:
    from quantpatch.launch.shell_render import master_port, template_environment

    source = swift_source(path)
    args, extra = _swift_args(values, source.fields)
    return (
        template_environment()
        .get_template("swift.sh.j2")
        .render(
            model=reg.models[model],
            dataset=reg.datasets[dataset],
            scheme=reg.schemes[scheme],
            profile=reg.profiles[profile],
            plan=layout.plan,
            run_name=run_name,
            master_port=master_port(run_name),
            swift_args=args,
            extra_kwargs=json.dumps(extra, separators=(",", ":")) if extra else None,
            is_moe=is_moe,
            vpp_field=VPP_FIELD if VPP_FIELD in source.fields else None,
            swift_version=source.version,
            blocked=blocked,
        )
    )
