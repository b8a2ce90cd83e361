"""The checkout's own callers of ``megatron.core.tensor_saver``, checked against the API of the
module ``saver install`` puts there.

A fork may ship its own saver and call it from its training code. Before that module is
replaced, every use in the checkout is read with libcst (files that do not mention
``tensor_saver`` are not parsed): each name imported from the module (absolute or relative
imports, ``import ... as``, the dotted form), each keyword and the number of positional
arguments of each call, and each attribute of the object ``get_tensor_saver()`` (or the class)
returns, followed through plain assignments to a name. The served API is read from the source
of the module to be installed, so the two cannot drift. What is passed on through attributes,
containers or function arguments is not followed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import libcst as cst
from libcst.metadata import (
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    ScopeProvider,
)

MODULE = "megatron.core.tensor_saver"
PACKAGE, _, ATTR = MODULE.rpartition(".")


@dataclass(frozen=True)
class Signature:
    keywords: frozenset[str] | None  # None: any (``**kwargs``)
    positional: int | None  # None: any number (``*args``)

    def problem(self, call: cst.Call) -> str | None:
        """What in ``call`` this signature does not accept (``None``: nothing)."""
        if any(a.star for a in call.args):
            return None  # *xs / **kw: not checkable here
        if self.keywords is not None:
            for a in call.args:
                if a.keyword is not None and a.keyword.value not in self.keywords:
                    return f"{a.keyword.value}="
        count = sum(1 for a in call.args if a.keyword is None)
        if self.positional is not None and count > self.positional:
            return f"{count} positional arguments"
        return None


@dataclass
class ClassApi:
    init: Signature
    members: dict[str, Signature | None] = field(default_factory=dict)  # None: an attribute
    read_only: set[str] = field(default_factory=set)


@dataclass
class Api:
    names: dict[str, Signature | None] = field(default_factory=dict)  # None: not a function
    classes: dict[str, ClassApi] = field(default_factory=dict)
    returns: dict[str, str] = field(default_factory=dict)  # function -> class it returns


def _signature(params: cst.Parameters, *, bound: bool) -> Signature:
    positional = [*params.posonly_params, *params.params]
    named = list(params.params)
    if bound and positional:
        first = positional.pop(0)
        named = [p for p in named if p is not first]
    keywords = frozenset(p.name.value for p in [*named, *params.kwonly_params])
    return Signature(
        None if params.star_kwarg is not None else keywords,
        None if isinstance(params.star_arg, cst.Param) else len(positional),
    )


def _decorators(node: cst.FunctionDef) -> list[str]:
    return [cst.Module([]).code_for_node(d.decorator) for d in node.decorators]


def _class_api(node: cst.ClassDef) -> ClassApi:
    api = ClassApi(Signature(frozenset(), 0))
    setters: set[str] = set()
    properties: set[str] = set()
    for stmt in node.body.body:
        if isinstance(stmt, cst.FunctionDef):
            name, decorators = stmt.name.value, _decorators(stmt)
            if "property" in decorators:
                properties.add(name)
                api.members[name] = None
            elif any(d.endswith(".setter") for d in decorators):
                setters.add(name)
            else:
                api.members[name] = _signature(stmt.params, bound="staticmethod" not in decorators)
            if name == "__init__":
                api.init = _signature(stmt.params, bound=True)
            for target in _self_targets(stmt):
                api.members.setdefault(target, None)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for name in _assigned(stmt):
                api.members.setdefault(name, None)
    api.read_only = properties - setters
    return api


def _self_targets(func: cst.FunctionDef) -> set[str]:
    """``X`` of every ``self.X = ...`` in a method."""
    found: set[str] = set()

    class _Find(cst.CSTVisitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            t = node.target
            if (
                isinstance(t, cst.Attribute)
                and isinstance(t.value, cst.Name)
                and t.value.value == "self"
            ):
                found.add(t.attr.value)

    func.visit(_Find())
    return found


def _assigned(stmt: cst.SimpleStatementLine) -> list[str]:
    names = []
    for small in stmt.body:
        targets: list[cst.BaseExpression] = []
        if isinstance(small, cst.Assign):
            targets = [t.target for t in small.targets]
        elif isinstance(small, cst.AnnAssign):
            targets = [small.target]
        for t in targets:
            elements = (
                [e.value for e in t.elements] if isinstance(t, (cst.Tuple, cst.List)) else [t]
            )
            names += [e.value for e in elements if isinstance(e, cst.Name)]
    return names


def served_api(source: str) -> Api:
    """The names, call signatures and object members the module in ``source`` serves."""
    api = Api()
    module = cst.parse_module(source)
    returns: dict[str, str] = {}
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef):
            api.names[stmt.name.value] = _signature(stmt.params, bound=False)
            ann = stmt.returns.annotation if stmt.returns else None
            if isinstance(ann, cst.Name):
                returns[stmt.name.value] = ann.value
        elif isinstance(stmt, cst.ClassDef):
            api.classes[stmt.name.value] = _class_api(stmt)
            api.names[stmt.name.value] = api.classes[stmt.name.value].init
        elif isinstance(stmt, cst.SimpleStatementLine):
            for name in _assigned(stmt):
                api.names.setdefault(name, None)
    api.returns = {f: c for f, c in returns.items() if c in api.classes}
    for cls in api.classes:
        api.returns[cls] = cls
    return api


# -- reading the checkout -------------------------------------------------------------------


@dataclass(frozen=True)
class Use:
    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.what}"


def _python_files(root: Path) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield (Path(dirpath) / name).relative_to(root).as_posix()


def _dotted(node: cst.CSTNode | None) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


def _absolute(rel: str, node: cst.ImportFrom) -> str:
    """The module an ``ImportFrom`` in the file ``rel`` imports from."""
    base = _dotted(node.module)
    level = len(node.relative)
    if not level:
        return base
    package = list(PurePosixPath(rel).parent.parts)
    if level > 1:
        package = package[: len(package) - (level - 1)]
    return ".".join([*package, *([base] if base else [])])


Target = tuple[str, str]  # ("module" | "package" | "name" | "instance", name or class)


class _Reader:
    def __init__(self, rel: str, module: cst.Module, api: Api) -> None:
        self.rel, self.api = rel, api
        self.wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        self.scopes = self.wrapper.resolve(ScopeProvider)
        self.parents = self.wrapper.resolve(ParentNodeProvider)
        self.positions = self.wrapper.resolve(PositionProvider)
        self.uses: list[Use] = []

    def _refuse(self, node: cst.CSTNode, what: str) -> None:
        self.uses.append(Use(self.rel, self.positions[node].start.line, what))

    def read(self) -> list[Use]:
        imports: list[cst.Import | cst.ImportFrom] = []

        class _Imports(cst.CSTVisitor):
            def visit_Import(self, node: cst.Import) -> None:
                imports.append(node)

            def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
                imports.append(node)

        self.wrapper.module.visit(_Imports())
        for node in imports:
            for bound, target in self._bindings(node):
                self._follow(node, bound, target)
        return self.uses

    def _bindings(self, node: cst.Import | cst.ImportFrom) -> list[tuple[str, Target]]:
        out: list[tuple[str, Target]] = []
        if isinstance(node, cst.Import):
            for alias in node.names:
                name = _dotted(alias.name)
                bound = _dotted(alias.asname.name) if alias.asname else name
                if name == MODULE:
                    out.append((bound, ("module", MODULE)))
                elif name == PACKAGE and alias.asname:
                    out.append((bound, ("package", PACKAGE)))
            return out
        source = _absolute(self.rel, node)
        if isinstance(node.names, cst.ImportStar):
            return out
        for alias in node.names:
            name = _dotted(alias.name)
            bound = _dotted(alias.asname.name) if alias.asname else name
            if source == MODULE:
                if name not in self.api.names:
                    self._refuse(alias, name)
                else:
                    out.append((bound, ("name", name)))
            elif source == PACKAGE and name == ATTR:
                out.append((bound, ("module", MODULE)))
            elif f"{source}.{name}" == PACKAGE:
                out.append((bound, ("package", PACKAGE)))
        return out

    def _follow(self, node: cst.CSTNode, bound: str, target: Target) -> None:
        scope = self.scopes.get(node)
        if scope is None:
            return
        for assignment in scope.assignments[bound]:
            if getattr(assignment, "node", None) is node:
                for access in assignment.references:
                    self._use(access.node, target)

    def _use(self, expr: cst.CSTNode, target: Target) -> None:
        parent = self.parents.get(expr)
        kind, name = target
        if kind in ("module", "package"):
            if isinstance(parent, cst.Attribute) and parent.value is expr:
                attr = parent.attr.value
                if kind == "package":
                    if attr == ATTR:
                        self._use(parent, ("module", MODULE))
                elif self._stored(parent):
                    pass  # any module attribute can be set
                elif attr not in self.api.names:
                    self._refuse(parent, attr)
                else:
                    self._use(parent, ("name", attr))
            return
        if kind == "name":
            if isinstance(parent, cst.Call) and parent.func is expr:
                sig = self.api.names.get(name)
                problem = sig.problem(parent) if sig is not None else None
                if problem:
                    self._refuse(parent, f"{name}({problem})")
                cls = self.api.returns.get(name)
                if cls is not None:
                    self._result(parent, cls)
            return
        # an instance of class ``name``
        if isinstance(parent, cst.Attribute) and parent.value is expr:
            self._member(parent, name)

    def _stored(self, attr: cst.Attribute) -> bool:
        parent = self.parents.get(attr)
        return isinstance(parent, (cst.AssignTarget, cst.AugAssign)) and parent.target is attr

    def _member(self, attr: cst.Attribute, cls: str) -> None:
        api = self.api.classes[cls]
        member = attr.attr.value
        if self._stored(attr):
            if member in api.read_only:
                self._refuse(attr, f"{cls}.{member} (read-only)")
            return
        if member not in api.members:
            self._refuse(attr, f"{cls}.{member}")
            return
        parent = self.parents.get(attr)
        sig = api.members[member]
        if sig is not None and isinstance(parent, cst.Call) and parent.func is attr:
            problem = sig.problem(parent)
            if problem:
                self._refuse(parent, f"{cls}.{member}({problem})")

    def _result(self, call: cst.Call, cls: str) -> None:
        """The object a call returns: its attributes, directly or through a name."""
        parent = self.parents.get(call)
        if isinstance(parent, cst.Attribute) and parent.value is call:
            self._member(parent, cls)
        elif isinstance(parent, cst.Assign) and parent.value is call:
            for t in parent.targets:
                if isinstance(t.target, cst.Name):
                    self._follow(t.target, t.target.value, ("instance", cls))


def unserved_uses(root: Path, api: Api, texts: Mapping[str, str | None], skip: str) -> list[Use]:
    """Every use of ``megatron.core.tensor_saver`` in the checkout at ``root`` that ``api``
    does not serve; ``texts`` holds the contents a file will have (planned edits)."""
    uses: list[Use] = []
    rels = set(_python_files(root)) | {r for r, t in texts.items() if t is not None}
    for rel in sorted(rels):
        if rel == skip or not rel.endswith(".py"):
            continue
        text = texts.get(rel) if rel in texts else _read(root / rel)
        if not text or ATTR not in text:
            continue
        try:
            module = cst.parse_module(text)
        except cst.ParserSyntaxError:
            continue  # a file Python cannot compile imports nothing
        uses += _Reader(rel, module, api).read()
    return sorted(uses, key=lambda u: (u.file, u.line))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
