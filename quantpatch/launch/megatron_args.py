"""Reading a Megatron-LM checkout's own training argument parser: its release and its flags.

Nothing here imports or runs the checkout; every file is read with libcst.

- The release is ``MAJOR.MINOR.PATCH`` + ``PRE_RELEASE`` from the literal assignments in
  ``megatron/core/package_info.py`` (``0.15.0rc3``); ``None`` when they are not there.
- The accepted flags are every string literal starting with ``--`` among the positional
  arguments of every ``<anything>.add_argument(...)`` call in ``megatron/training/arguments.py``
  and in the checkout modules that file imports (one level, and only those whose text mentions
  ``add_argument``: ``megatron/training/argument_utils.py``, a fork's own extension module).
  Keyword arguments (``help=``, ``dest=``, ``metavar=``) never count.
- Newer releases also build flags from dataclass fields with
  ``ArgumentGroupFactory(SomeConfig, exclude=[...]).build_group(parser)``. For each such call
  the class is looked up through the scanned file's imports (re-exports in ``__init__.py``
  followed), and each of its annotated fields (base classes first) gives ``--field-name``; a
  ``bool`` field whose default is not ``False`` gives ``--no-field-name`` and
  ``--disable-field-name`` instead, a field with ``field(init=False)`` or in ``exclude`` (a
  literal list, or a name bound to one earlier in the same function) gives nothing, and
  ``metadata={"argparse_meta": {"arg_names": [...]}}`` names the flags itself. A class that
  cannot be found is listed in ``CheckoutRelease.unresolved``: its flags are unknown.

Only what is written literally is seen: a flag name built in code is missing (so a script
using it is refused), and an ``exclude`` list built in code counts as empty (so its fields'
flags count as accepted). Upstream writes both literally.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from quantpatch.base.edits import read_exact, sha256_text
from quantpatch.launch.megatron_files import ARGUMENTS, PACKAGE_INFO, CheckoutRelease
from quantpatch.sites.discovery import parse_source

__all__ = ["CheckoutRelease", "read_release"]

_FACTORY = "ArgumentGroupFactory"
_BOOL_ANNOTATIONS = {
    "bool",
    "Optional[bool]",
    "typing.Optional[bool]",
    "bool|None",
    "None|bool",
    "Union[bool,None]",
    "typing.Union[bool,None]",
}
_NOT_FIELDS = ("ClassVar", "typing.ClassVar", "InitVar", "dataclasses.InitVar", "KW_ONLY")


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr.value}" if head else ""
    return ""


def _string(node: cst.BaseExpression) -> str | None:
    """The value of a plain string literal (implicit concatenation included), else ``None``."""
    if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _strings(node: cst.BaseExpression) -> list[str] | None:
    """A list or tuple literal of strings, else ``None``."""
    if not isinstance(node, (cst.List, cst.Tuple)):
        return None
    out = []
    for element in node.elements:
        if isinstance(element, cst.StarredElement):
            return None
        value = _string(element.value)
        if value is None:
            return None
        out.append(value)
    return out


def _keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg.value
    return None


@dataclass
class _Class:
    bases: list[str]
    fields: dict[str, tuple[str, ...]]
    """field name -> the flags it gives"""


@dataclass
class _Factory:
    cls: str
    exclude: set[str]


@dataclass
class _Facts:
    """What one file says: literal flags, dataclass groups, imports and classes."""

    rel: str
    flags: set[str] = field(default_factory=set)
    factories: list[_Factory] = field(default_factory=list)
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)
    """local name -> (module, name in that module), from every ``from M import N [as L]``."""
    modules: set[str] = field(default_factory=set)
    """Every module the file imports (``import M``, ``from M import N``, and ``M.N``)."""
    classes: dict[str, _Class] = field(default_factory=dict)


def _package(rel: str) -> list[str]:
    parts = rel[: -len(".py")].split("/")
    return parts[:-1]  # a module's package; for ``__init__.py`` the package itself


class _Reader(cst.CSTVisitor):
    def __init__(self, facts: _Facts, module: cst.Module) -> None:
        super().__init__()
        self.facts = facts
        self.module = module
        self.lists: list[dict[str, list[str]]] = [{}]  # list literals bound per function scope
        self.class_depth = 0

    # -- scopes ------------------------------------------------------------------------
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.lists.append({})

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.lists.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if self.class_depth == 0 and len(self.lists) == 1:
            self.facts.classes[node.name.value] = self._class(node)
        self.class_depth += 1

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.class_depth -= 1

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            values = _strings(node.value)
            if values is not None:
                self.lists[-1][node.targets[0].target.value] = values

    # -- imports -----------------------------------------------------------------------
    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            self.facts.modules.add(_dotted(alias.name))

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        level = len(node.relative)
        module = _dotted(node.module) if node.module is not None else ""
        if level:
            package = _package(self.facts.rel)
            base = package[: len(package) - (level - 1)] if level > 1 else package
            module = ".".join([*base, module] if module else base)
        if not module:
            return
        self.facts.modules.add(module)
        if isinstance(node.names, cst.ImportStar):
            return
        for alias in node.names:
            name = _dotted(alias.name)
            local = name
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            self.facts.imported[local] = (module, name)
            self.facts.modules.add(f"{module}.{name}")

    # -- calls -------------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value == "add_argument":
            for arg in node.args:
                if arg.keyword is None and not arg.star:
                    value = _string(arg.value)
                    if value is not None and value.startswith("--"):
                        self.facts.flags.add(value)
            return
        if _dotted(func).rsplit(".", 1)[-1].endswith(_FACTORY):
            self._factory(node)

    def _factory(self, node: cst.Call) -> None:
        """``ArgumentGroupFactory(Config, exclude=[...])``: a group built from a dataclass."""
        cls = _dotted(node.args[0].value) if node.args and not node.args[0].keyword else ""
        if not cls:
            return
        exclude = _keyword(node, "exclude")
        if exclude is None and len(node.args) > 1 and node.args[1].keyword is None:
            exclude = node.args[1].value
        names: list[str] | None = None
        if isinstance(exclude, cst.Name):  # bound to a list literal earlier in the function
            scope = next((s for s in reversed(self.lists) if exclude.value in s), {})
            names = scope.get(exclude.value)
        elif exclude is not None:
            names = _strings(exclude)
        self.facts.factories.append(_Factory(cls, set(names or ())))

    # -- dataclass fields --------------------------------------------------------------
    def _class(self, node: cst.ClassDef) -> _Class:
        bases = [_dotted(b.value) for b in node.bases if b.keyword is None]
        fields: dict[str, tuple[str, ...]] = {}
        body = node.body.body if isinstance(node.body, cst.IndentedBlock) else ()
        for stmt in body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                    made = self._field(small.target.value, small)
                    if made is not None:
                        fields[small.target.value] = made
        return _Class([b for b in bases if b], fields)

    def _field(self, name: str, node: cst.AnnAssign) -> tuple[str, ...] | None:
        """The flags one dataclass field gives (``None``: it is not an ``__init__`` field)."""
        annotation = "".join(self.module.code_for_node(node.annotation.annotation).split())
        if annotation.startswith(_NOT_FIELDS):
            return None
        default: cst.BaseExpression | None = node.value
        if isinstance(node.value, cst.Call) and _dotted(node.value.func) in (
            "field",
            "dataclasses.field",
        ):
            call = node.value
            init = _keyword(call, "init")
            if isinstance(init, cst.Name) and init.value == "False":
                return None
            meta = _keyword(call, "metadata")
            names = _arg_names(meta) if meta is not None else None
            if names:
                return tuple(n for n in names if n.startswith("--"))
            default = _keyword(call, "default")
        flag = name.replace("_", "-")
        if annotation in _BOOL_ANNOTATIONS and not (
            isinstance(default, cst.Name) and default.value == "False"
        ):
            return (f"--no-{flag}", f"--disable-{flag}")
        return (f"--{flag}",)


def _arg_names(meta: cst.BaseExpression) -> list[str] | None:
    """``{"argparse_meta": {"arg_names": [...]}}`` -> the names."""
    for outer in meta.elements if isinstance(meta, cst.Dict) else ():
        if isinstance(outer, cst.DictElement) and _string(outer.key) == "argparse_meta":
            for inner in outer.value.elements if isinstance(outer.value, cst.Dict) else ():
                if isinstance(inner, cst.DictElement) and _string(inner.key) == "arg_names":
                    return _strings(inner.value)
    return None


class _Checkout:
    """The checkout's Python files, each read and parsed at most once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.texts: dict[str, str | None] = {}
        self.parsed: dict[str, _Facts] = {}
        self.class_files: list[str] = []

    def module_file(self, module: str) -> str | None:
        rel = module.replace(".", "/")
        for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
            if (self.root / candidate).is_file():
                return candidate
        return None

    def text(self, rel: str) -> str | None:
        if rel not in self.texts:
            self.texts[rel] = read_exact(self.root / rel)
        return self.texts[rel]

    def facts(self, rel: str) -> _Facts:
        if rel not in self.parsed:
            module = parse_source(self.text(rel) or "", str(self.root / rel))
            facts = _Facts(rel)
            module.visit(_Reader(facts, module))
            self.parsed[rel] = facts
        return self.parsed[rel]

    def find_class(self, name: str, rel: str, depth: int = 0) -> tuple[str, _Class] | None:
        """The class ``name`` as seen from file ``rel``: defined there or imported (through
        ``__init__.py`` re-exports, a few levels deep)."""
        if depth > 6:
            return None
        facts = self.facts(rel)
        head, _, attr = name.rpartition(".")
        if head:  # ``module.Class``: the module as the file imported it
            local_module = facts.imported.get(head)
            module = ".".join(local_module) if local_module else head
            target = self.module_file(module)
            return self.find_class(attr, target, depth + 1) if target else None
        if name in facts.classes:
            return rel, facts.classes[name]
        if name in facts.imported:
            module, original = facts.imported[name]
            target = self.module_file(module)
            if target is not None:
                return self.find_class(original, target, depth + 1)
        return None

    def dataclass_flags(self, name: str, rel: str, exclude: set[str]) -> set[str] | None:
        found = self.find_class(name, rel)
        if found is None:
            return None
        fields: dict[str, tuple[str, ...]] = {}
        for cls_rel, cls in self._lineage(found):
            fields.update(cls.fields)
            self.class_files.append(cls_rel)
        return {flag for n, flags in fields.items() if n not in exclude for flag in flags}

    def _lineage(self, found: tuple[str, _Class], depth: int = 0) -> Iterator[tuple[str, _Class]]:
        """Base classes first (as ``dataclasses.fields`` orders them), then the class."""
        rel, cls = found
        if depth < 8:
            for base in cls.bases:
                parent = self.find_class(base, rel)
                if parent is not None:
                    yield from self._lineage(parent, depth + 1)
        yield found


def _version(module: cst.Module) -> str | None:
    values: dict[str, str] = {}
    for stmt in module.body:
        for small in stmt.body if isinstance(stmt, cst.SimpleStatementLine) else ():
            if (
                isinstance(small, cst.Assign)
                and len(small.targets) == 1
                and isinstance(small.targets[0].target, cst.Name)
            ):
                name, value = small.targets[0].target.value, small.value
                if isinstance(value, cst.Integer):
                    values[name] = str(value.evaluated_value)
                elif (literal := _string(value)) is not None:
                    values[name] = literal
    if not all(k in values for k in ("MAJOR", "MINOR", "PATCH")):
        return None
    return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE', '')}"


def read_release(root: Path) -> CheckoutRelease | None:
    """The checkout's release and accepted flags; ``None`` when it has no
    ``megatron/training/arguments.py``. A file that does not parse is a ``UserError`` naming
    the file and line."""
    checkout = _Checkout(root)
    if checkout.text(ARGUMENTS) is None:
        return None
    main = checkout.facts(ARGUMENTS)
    scanned = [main]
    for module in sorted(main.modules):
        rel = checkout.module_file(module)
        if rel is None or any(s.rel == rel for s in scanned):
            continue
        if "add_argument" in (checkout.text(rel) or ""):
            scanned.append(checkout.facts(rel))
    flags: set[str] = set()
    unresolved: list[str] = []
    for facts in scanned:
        flags |= facts.flags
        for factory in facts.factories:
            found = checkout.dataclass_flags(factory.cls, facts.rel, factory.exclude)
            if found is None:
                unresolved.append(factory.cls)
            else:
                flags |= found
    info = checkout.text(PACKAGE_INFO)
    version = None if info is None else _version(parse_source(info, str(root / PACKAGE_INFO)))
    return CheckoutRelease(
        root=root,
        version=version,
        flags=frozenset(flags),
        files=tuple(dict.fromkeys([*(s.rel for s in scanned), *checkout.class_files])),
        unresolved=tuple(dict.fromkeys(unresolved)),
        inputs=tuple(
            (rel, None if text is None else sha256_text(text))
            for rel, text in sorted(checkout.texts.items())
        ),
    )
