"""Site discovery: find every ``custom_quant_type`` assignment with libcst and classify it.

A *site* is an assignment to ``custom_quant_type``. Its role comes from structure only:

1. Inside each function, every ``if`` whose test reads ``custom_quant_type`` is a *dispatch*
   (an ``elif`` chain counts once). The calls inside a dispatch are its *products*: in the
   attention file a call whose arguments name a query and a key is Q.K^T (``qk``), one that names
   attention probabilities and a value is P.V (``pv``); in the linear file every dispatch is a
   ``linear`` product.
2. A site *governs* a dispatch when it comes before it, can reach it (it is not in the other
   branch of an ``if`` that holds the dispatch) and is not overwritten on the way: no later
   site whose block encloses the dispatch lies between them. This is a small reaching-definition
   analysis over the syntax tree; no line numbers are involved.
3. A site's role follows from the products of the dispatches it governs: ``qk``, ``pv``,
   ``qk+pv`` (one assignment for both attention products) or ``linear``. A site that governs no
   dispatch (it only labels tensors handed to a saver, say) has form ``label`` and takes the
   role of the next governed site in the same function. ``# quantpatch: role=X`` overrides.
"""

from __future__ import annotations

import ast
import io
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from quantpatch.base.config import SITE_NAME, Targets
from quantpatch.base.errors import UserError
from quantpatch.sites.model import (
    NO_OPS,
    OPS_VALUES,
    SITE_ROLES,
    OpsValues,
    Site,
    read_target,
    role_values,
)

__all__ = ["FileSites", "Site", "discover", "discover_sites", "discover_source", "role_values"]

_N = TypeVar("_N", bound=cst.CSTNode)

_ENV_FUNCS = ("os.environ.get", "environ.get", "os.getenv", "getenv")
_OVERRIDE_PREFIX = "quantpatch:"


@dataclass
class _RawSite:
    stmt: cst.CSTNode  # the Assign / AnnAssign
    literal: cst.SimpleString | None  # the string node that holds the value (None if dynamic)
    value: str | None
    kind: str
    source: str
    pos: int  # the order the visitor met it: source order
    chunk: int  # which of the visited statements holds it
    ancestors: tuple[cst.CSTNode, ...]
    override: str | None
    function: str
    line: int = 0  # in the file, set once every site is known


@dataclass
class _Dispatch:
    node: cst.If
    pos: int
    ancestors: tuple[cst.CSTNode, ...]
    products: frozenset[str]
    knows: tuple[str, ...] | None
    """The values the chain's branches are written for (``chain_knows``)."""
    gemm: str
    """In the linear file: ``fprop``, ``dgrad`` or ``wgrad`` (``linear_gemm``), else empty."""
    kills: tuple[int, ...]
    """Positions (visit order) of the statements before the dispatch, in its enclosing blocks, that
    definitely assign the variable (a site line, or an ``if`` whose every branch assigns)."""


@dataclass
class FileSites:
    """Discovery result for one file: the parsed module and its sites with their nodes."""

    rel: str
    text: str
    module: cst.Module
    sites: list[Site]
    literals: list[cst.SimpleString | None]
    """The literal node of each site (same order as ``sites``)."""
    pv_dispatches: list[list[cst.If]]
    """For each site, the P.V dispatches it governs (the split point of a qk+pv site)."""
    chunks: frozenset[int] = frozenset()
    """``id`` of each top-level statement that mentions the site name (where every site and
    dispatch lives): a rewrite needs to walk only these."""


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return ""


class _Find(cst.CSTVisitor):
    def __init__(self, kind: type[cst.CSTNode]) -> None:
        super().__init__()
        self.kind = kind
        self.found: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, self.kind):
            self.found.append(node)
        return True


def find_all(node: cst.CSTNode, kind: type[_N]) -> list[_N]:
    """Every node of type ``kind`` in ``node``'s subtree, in source order (a lighter stand-in
    for ``libcst.matchers.findall``, whose import alone costs a quarter second)."""
    finder = _Find(kind)
    node.visit(finder)
    return [n for n in finder.found if isinstance(n, kind)]


def _names_in(node: cst.CSTNode) -> set[str]:
    return {n.value for n in find_all(node, cst.Name)}


def reads_site(node: cst.CSTNode) -> bool:
    return SITE_NAME in _names_in(node)


def _is_site_name(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Name) and node.value == SITE_NAME


def _classify_value(value: cst.BaseExpression) -> tuple[str, cst.SimpleString | None, str | None]:
    """(kind, literal node, value) of an assignment's right-hand side."""
    if isinstance(value, cst.SimpleString):
        evaluated = value.evaluated_value
        if isinstance(evaluated, str):
            return "literal", value, evaluated
        return "dynamic", None, None
    if isinstance(value, cst.Call) and _dotted(value.func) in _ENV_FUNCS:
        default: cst.BaseExpression | None = None
        positional = [a for a in value.args if a.keyword is None and not a.star]
        if len(positional) >= 2:
            default = positional[1].value
        for arg in value.args:
            if arg.keyword is not None and arg.keyword.value == "default":
                default = arg.value
        if isinstance(default, cst.SimpleString) and isinstance(default.evaluated_value, str):
            return "env", default, default.evaluated_value
    return "dynamic", None, None


def _is_query(name: str) -> bool:
    return name in ("q", "query") or name.startswith(("query", "q_"))


def _is_key(name: str) -> bool:
    return name in ("k", "key") or name.startswith(("key", "k_"))


def _is_probs(name: str) -> bool:
    return "prob" in name or name in ("p", "attn", "attn_weights", "attention_weights")


def _is_value(name: str) -> bool:
    return name in ("v", "value") or name.startswith(("value", "v_"))


def classify_product(call: cst.Call) -> str | None:
    """``qk`` or ``pv`` for an attention product call, from the names in its arguments."""
    names: set[str] = set()
    for arg in call.args:
        names |= _names_in(arg.value)
    if any(_is_query(n) for n in names) and any(_is_key(n) for n in names):
        return "qk"
    if any(_is_probs(n) for n in names) and any(_is_value(n) for n in names):
        return "pv"
    return None


def linear_gemm(dispatch: cst.If, function: str) -> str:
    """Which GEMM of the linear autograd function a dispatch computes: ``fprop`` in a
    ``forward``; in a ``backward``, ``dgrad`` where its branches assign ``grad_input`` and
    ``wgrad`` where they assign ``grad_weight`` (Megatron's names for the two products); empty
    where neither or both (a constructor's ParetoQ steps, say)."""
    if function == "forward":
        return "fprop"
    if function != "backward":
        return ""
    names = {
        t.target.value
        for a in find_all(dispatch, cst.Assign)
        for t in a.targets
        if isinstance(t.target, cst.Name)
    }
    found = [g for g, n in (("dgrad", "grad_input"), ("wgrad", "grad_weight")) if n in names]
    return found[0] if len(found) == 1 else ""


def _override(line: cst.CSTNode | None) -> str | None:
    """The role named by a trailing ``# quantpatch: role=X`` comment, if any."""
    if not isinstance(line, cst.SimpleStatementLine):
        return None
    comment = line.trailing_whitespace.comment
    if comment is None:
        return None
    text = comment.value.lstrip("#").strip()
    if not text.startswith(_OVERRIDE_PREFIX):
        return None
    for part in text[len(_OVERRIDE_PREFIX) :].split():
        if part.startswith("role="):
            role = part[len("role=") :]
            if role not in SITE_ROLES or role == "unknown":
                raise UserError(f"unknown role '{role}' in a '# quantpatch:' comment.")
            return role
    return None


class ScopedVisitor(cst.CSTVisitor):
    """A visitor that keeps the ancestor stack (``stack[-1]`` is the node being visited) and
    the enclosing classes and functions. Subclasses that define ``visit_ClassDef`` /
    ``visit_FunctionDef`` (or the ``leave_`` forms) call ``super()``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[cst.CSTNode] = []
        self.scope: list[str] = []
        self.classes: list[str] = []
        self.functions: list[cst.FunctionDef] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.stack.append(node)
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        super().on_leave(original_node)
        self.stack.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.scope.append(node.name.value)
        self.classes.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.scope.pop()
        self.classes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scope.append(node.name.value)
        self.functions.append(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scope.pop()
        self.functions.pop()


class _Collector(ScopedVisitor):
    """One pass over the statements that mention the site name, collecting per function its
    sites and dispatches. Ancestors come from the visitor's own stack, and a node's position
    is the order the visitor met it in (source order: all the analysis compares); a site's
    line is set afterwards by ``_discover``, so no code is generated for positions."""

    def __init__(self, file_kind: str) -> None:
        super().__init__()
        self.file_kind = file_kind
        # one frame per function (plus the module): its sites and dispatches
        self.module_frame: tuple[list[_RawSite], list[_Dispatch]] = ([], [])
        self.frames: list[tuple[list[_RawSite], list[_Dispatch]]] = [self.module_frame]
        self.done: list[tuple[list[_RawSite], list[_Dispatch]]] = []
        self.elif_nodes: set[int] = set()
        self.order: dict[int, int] = {}
        self.chunk = 0

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.order[id(node)] = len(self.order)
        descend = super().on_visit(node)
        # an expression or a parameter list holds no statement: nothing below it is a site
        # or a dispatch (a dispatch's calls are found from its ``if``), so the visit stops
        return descend and not isinstance(node, cst.BaseExpression | cst.Parameters)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        self.frames.append(([], []))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        super().leave_FunctionDef(original_node)
        self.done.append(self.frames.pop())

    # -- helpers ------------------------------------------------------------------------
    def _ancestors(self) -> tuple[cst.CSTNode, ...]:
        """The enclosing nodes of the node being visited, from its function (or module) on."""
        for i in range(len(self.stack) - 2, -1, -1):
            if isinstance(self.stack[i], (cst.FunctionDef, cst.Module)):
                return tuple(self.stack[i:-1])
        return tuple(self.stack[:-1])

    def _pos(self, node: cst.CSTNode) -> int:
        return self.order[id(node)]

    # -- sites --------------------------------------------------------------------------
    def _add_site(self, stmt: cst.CSTNode, value: cst.BaseExpression) -> None:
        kind, literal, evaluated = _classify_value(value)
        ancestors = self._ancestors()
        parent = ancestors[-1] if ancestors else None
        self.frames[-1][0].append(
            _RawSite(
                stmt=stmt,
                literal=literal,
                value=evaluated,
                kind=kind,
                source=cst.Module([]).code_for_node(value),
                pos=self._pos(stmt),
                chunk=self.chunk,
                ancestors=ancestors,
                override=_override(parent),
                function=".".join(self.scope) or "<module>",
            )
        )

    def visit_Assign(self, node: cst.Assign) -> None:
        if any(_is_site_name(t.target) for t in node.targets):
            self._add_site(node, node.value)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None and _is_site_name(node.target):
            self._add_site(node, node.value)

    # -- dispatches ---------------------------------------------------------------------
    def visit_If(self, node: cst.If) -> None:
        if id(node) in self.elif_nodes or not reads_site(node.test):
            return
        # an elif chain is one dispatch: its branches are products of the same decision
        cur: cst.If | cst.Else | None = node.orelse
        while isinstance(cur, cst.If):
            self.elif_nodes.add(id(cur))
            cur = cur.orelse
        products: set[str] = set()
        if self.file_kind == "linear":
            products.add("linear")
        else:
            for call in find_all(node, cst.Call):
                product = classify_product(call)
                if product:
                    products.add(product)
        if not products:
            products.add("unknown")
        ancestors = self._ancestors()
        self.frames[-1][1].append(
            _Dispatch(
                node=node,
                pos=self._pos(node),
                ancestors=ancestors,
                products=frozenset(products),
                knows=chain_knows(node),
                gemm=linear_gemm(node, self.scope[-1] if self.scope else "")
                if self.file_kind == "linear"
                else "",
                kills=self._kills(node, ancestors),
            )
        )

    def _kills(self, node: cst.CSTNode, ancestors: tuple[cst.CSTNode, ...]) -> tuple[int, ...]:
        site_lines = {id(s.ancestors[-1]) for s in self.frames[-1][0] if s.ancestors}
        path = (*ancestors, node)
        out = []
        for block, child in itertools.pairwise(path):
            if not isinstance(block, (cst.IndentedBlock, cst.Module)):
                continue
            for stmt in block.body:
                if stmt is child:
                    break
                if _definitely_assigns(stmt, site_lines):
                    out.append(self._pos(stmt))
        return tuple(out)


def _exclusive(a: Sequence[cst.CSTNode], b: Sequence[cst.CSTNode]) -> bool:
    """True when two nodes lie in different branches of one ``if`` (never both run)."""
    common = 0
    while common < min(len(a), len(b)) and a[common] is b[common]:
        common += 1
    if common == 0 or common >= min(len(a), len(b)):
        return False
    # the deepest common ancestor is an ``if``: one node is in its body, the other in orelse
    return isinstance(a[common - 1], cst.If)


def _definitely_assigns(stmt: cst.CSTNode, site_lines: set[int]) -> bool:
    """True when running ``stmt`` always assigns a site (a site line, or an ``if`` whose
    every branch, ``else`` included, does)."""
    if id(stmt) in site_lines:
        return True
    if isinstance(stmt, cst.If):
        if not _block_assigns(stmt.body, site_lines) or stmt.orelse is None:
            return False
        if isinstance(stmt.orelse, cst.If):
            return _definitely_assigns(stmt.orelse, site_lines)
        return _block_assigns(stmt.orelse.body, site_lines)
    return False


def _block_assigns(block: cst.BaseSuite, site_lines: set[int]) -> bool:
    if isinstance(block, cst.IndentedBlock):
        return any(_definitely_assigns(s, site_lines) for s in block.body)
    return id(block) in site_lines


def _governs(sites: list[_RawSite], dispatch: _Dispatch) -> list[int]:
    """Indexes of the sites whose value reaches ``dispatch``: earlier, not in the other
    branch of an ``if``, and not definitely overwritten between the two."""
    return [
        i
        for i, s in enumerate(sites)
        if s.pos < dispatch.pos
        and not _exclusive(s.ancestors, dispatch.ancestors)
        and not any(k > s.pos for k in dispatch.kills)
    ]


# -- what a dispatch knows ---------------------------------------------------------------------


def _literal_strings(node: cst.BaseExpression) -> list[str] | None:
    """The strings of a literal, or of a tuple, list or set of literals; None otherwise."""
    if isinstance(node, cst.SimpleString | cst.ConcatenatedString):
        value = node.evaluated_value
        return [value] if isinstance(value, str) else None
    if isinstance(node, cst.Tuple | cst.List | cst.Set):
        out: list[str] = []
        for element in node.elements:
            if not isinstance(element, cst.Element):
                return None
            strings = _literal_strings(element.value)
            if strings is None or isinstance(element.value, cst.Tuple | cst.List | cst.Set):
                return None
            out += strings
        return out
    return None


def branch_test(test: cst.BaseExpression) -> tuple[bool, list[str]] | None:
    """``(True, values)`` for a test that holds for exactly those values of the site
    (``== 'x'``, ``in ('x', 'y')``), ``(False, values)`` for one that holds for every other
    value (``!=``, ``not in``); None for any other test."""
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return None
    target = test.comparisons[0]
    left, right, op = test.left, target.comparator, target.operator
    if _is_site_name(right) and isinstance(op, cst.Equal | cst.NotEqual):
        left, right = right, left  # 'x' == custom_quant_type
    if not _is_site_name(left):
        return None
    strings = _literal_strings(right)
    if strings is None:
        return None
    if isinstance(op, cst.Equal) and len(strings) == 1 and not isinstance(right, cst.Tuple):
        return True, strings
    if isinstance(op, cst.NotEqual) and len(strings) == 1 and not isinstance(right, cst.Tuple):
        return False, strings
    collection = isinstance(right, cst.Tuple | cst.List | cst.Set)  # not a substring test
    if isinstance(op, cst.In) and collection:
        return True, strings
    if isinstance(op, cst.NotIn) and collection:
        return False, strings
    return None


def calls_quantpatch_ops(body: cst.CSTNode) -> bool:
    """The block hands the site's value to a ``quantpatch_ops`` function: a product
    (``quant_*(..., fmt=<site>)``) or any other call with the site among its arguments (the
    ParetoQ steps ``init`` adds to the layers' constructors: ``add_weight_scales(self,
    <site>, ...)``)."""
    for call in find_all(body, cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and _dotted(func.value).endswith("quantpatch_ops")):
            continue
        if any(_is_site_name(arg.value) for arg in call.args):
            return True
    return False


def _raises(body: cst.BaseSuite) -> bool:
    return bool(find_all(body, cst.Raise))


def chain_knows(node: cst.If) -> tuple[str, ...] | None:
    """The values an ``if``/``elif`` dispatch chain on the site is written for: the literals
    its tests compare the site with; ``OPS_VALUES`` where a branch hands the value on to
    ``quantpatch_ops`` (quantpatch's own dispatch: ``else`` or a ``!= 'bf16'`` branch); and
    ``bf16`` where the values no test names fall through to code that is not a raise (the
    stock product). None when a test is not such a comparison, or a catch-all branch
    (``!=``, ``not in``) runs code other than ``quantpatch_ops``: the values it accepts
    cannot be read from the source."""
    values: set[str] = set()
    cur: cst.If | cst.Else | None = node
    while isinstance(cur, cst.If):
        test = branch_test(cur.test)
        if test is None:
            return None
        only, strings = test
        if only:
            values |= set(strings)
        elif calls_quantpatch_ops(cur.body):
            values.add(OPS_VALUES)
        else:
            return None
        cur = cur.orelse
    if cur is None or (not calls_quantpatch_ops(cur.body) and not _raises(cur.body)):
        values.add("bf16")
    elif calls_quantpatch_ops(cur.body):
        values.add(OPS_VALUES)
    return tuple(sorted(values))


def _site_knows(chains: Sequence[tuple[str, ...] | None]) -> tuple[tuple[str, ...], ...] | None:
    """A site's knowledge: one entry per governed dispatch; None where it governs none or
    one of them cannot be read."""
    if not chains or any(c is None for c in chains):
        return None
    return tuple(c for c in chains if c is not None)


def _tuple_strings(
    node: cst.BaseExpression, names: dict[str, cst.BaseExpression], depth: int = 0
) -> list[str] | None:
    """The strings of a module-level tuple expression: literals, other such tuples by name,
    ``*NAME`` inside a tuple, and ``A + B``."""
    if depth > 8:
        return None
    if isinstance(node, cst.Name):
        return _tuple_strings(names[node.value], names, depth + 1) if node.value in names else None
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add):
        a = _tuple_strings(node.left, names, depth + 1)
        b = _tuple_strings(node.right, names, depth + 1)
        return None if a is None or b is None else a + b
    if isinstance(node, cst.Tuple | cst.List):
        out: list[str] = []
        for element in node.elements:
            part = (
                _tuple_strings(element.value, names, depth + 1)
                if isinstance(element, cst.StarredElement)
                else _literal_strings(element.value)
                if not isinstance(element.value, cst.Tuple | cst.List | cst.Set)
                else None
            )
            if part is None:
                return None
            out += part
        return out
    return None


def _spec_values(text: str | None) -> OpsValues:
    """The values an installed format spec (``quantpatch_formats.py``) declares: the name (first
    argument, a string literal) of every ``Format(...)`` entry that some role may hold, and of
    those with ``grouped=True``, read with libcst, never imported."""
    if text is None:
        return OpsValues(readable=False)
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return OpsValues(readable=False)
    names: set[str] = set()
    grouped: set[str] = set()
    for call in _calls_named(module, "Format"):
        if not call.args or call.args[0].keyword is not None:
            return OpsValues(readable=False)
        name = _literal_strings(call.args[0].value)
        if name is None:
            return OpsValues(readable=False)
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        roles = keywords.get("roles")
        if isinstance(roles, cst.Tuple) and not roles.elements:
            continue  # an operand format, not a value
        names.update(name)
        flag = keywords.get("grouped")
        if isinstance(flag, cst.Name) and flag.value == "True":
            grouped.update(name)
    if not names:
        return OpsValues(readable=False)
    return OpsValues(frozenset(names), frozenset(grouped))


def _calls_named(module: cst.Module, name: str) -> list[cst.Call]:
    found: list[cst.Call] = []

    class _Finder(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if isinstance(node.func, cst.Name) and node.func.value == name:
                found.append(node)

    module.visit(_Finder())
    return found


def read_ops_values(text: str | None, formats_text: str | None = None) -> OpsValues:
    """What an installed ``quantpatch_ops.py`` declares (``FORMATS``, ``GROUPED_FORMATS``),
    read with libcst, never imported; where those are taken from the format spec installed
    beside it (``formats_text``: ``quantpatch_formats.py``), the spec's entries. ``None`` (no
    module): nothing."""
    if text is None:
        return NO_OPS
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return OpsValues(readable=False)
    names: dict[str, cst.BaseExpression] = {}
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign) and len(small.targets) == 1:
                    target = small.targets[0].target
                    if isinstance(target, cst.Name):
                        names[target.value] = small.value
                elif (
                    isinstance(small, cst.AnnAssign)
                    and small.value is not None
                    and isinstance(small.target, cst.Name)
                ):
                    names[small.target.value] = small.value
    if "FORMATS" not in names:
        return OpsValues(readable=False)
    formats = _tuple_strings(names["FORMATS"], names)
    grouped = _tuple_strings(names["GROUPED_FORMATS"], names) if "GROUPED_FORMATS" in names else []
    if formats is None and formats_text is not None:
        return _spec_values(formats_text)
    if formats is None or grouped is None:
        return OpsValues(readable=False)
    return OpsValues(frozenset(formats), frozenset(grouped))


def _role_from_products(products: set[str], file_kind: str) -> str:
    if file_kind == "linear":
        return "linear"
    attention = products & {"qk", "pv"}
    if attention == {"qk", "pv"}:
        return "qk+pv"
    if attention:
        return next(iter(attention))
    return "unknown"


def parse_source(text: str, rel: str) -> cst.Module:
    """Parse with libcst; a syntax error becomes a one-sentence ``UserError``.

    libcst's error position can be a line late (inside an indented block it points past the
    statement), so the line and reason come from CPython's own parser (to an AST only: nothing
    is compiled to code or run); libcst's are kept for the rare source only CPython accepts.
    """
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        line, reason = exc.raw_line, exc.message
        try:
            source = text.removeprefix("\ufeff")  # a BOM is fine in a file, not in a str
            compile(source, rel, "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError as py_exc:
            line, reason = py_exc.lineno or line, py_exc.msg
        except ValueError:  # NUL bytes: libcst's reason stands
            pass
        raise UserError(f"{rel}:{line}: the file does not parse as Python ({reason}).") from None


def _site_chunks(
    module: cst.Module, text: str, tree: ast.Module | None
) -> Sequence[tuple[cst.BaseStatement, int | None]]:
    """The top-level statements that mention the site name, each with the number of lines
    before it. Where a statement starts comes from CPython's own parser (an AST only, in C:
    no code generation of the whole module); any disagreement with libcst's tree falls back
    to generating each statement's code."""
    starts = _chunk_starts(module, text, tree)
    if starts is None:
        out: list[tuple[cst.BaseStatement, int | None]] = []
        offset = len(module.header)
        for stmt in module.body:
            code = module.code_for_node(stmt)
            if SITE_NAME in code:
                out.append((stmt, offset))
            offset += code.count("\n")
        return out
    lines = io.StringIO(text, newline="").readlines()  # \n, \r\n and \r, as Python splits
    bounds = [*starts, len(lines)]
    return [
        (stmt, bounds[i])
        for i, stmt in enumerate(module.body)
        if SITE_NAME in "".join(lines[bounds[i] : bounds[i + 1]])
    ]


def _chunk_starts(module: cst.Module, text: str, tree: ast.Module | None) -> list[int] | None:
    """For each top-level statement of ``module``, the lines before its code (its leading
    comments and blank lines included), or ``None`` when CPython's AST and libcst's tree do
    not line up one to one."""
    if tree is None:
        return None
    nodes = tree.body
    starts: list[int] = []
    i = 0
    for stmt in module.body:
        k = len(stmt.body) if isinstance(stmt, cst.SimpleStatementLine) else 1
        if i + k > len(nodes):
            return None
        starts.append(_first_line(nodes[i]) - 1 - len(stmt.leading_lines))
        i += k
    if i != len(nodes) or (starts and starts[0] != len(module.header)):
        return None
    if any(b <= a for a, b in itertools.pairwise(starts)):
        return None
    return starts


def _first_line(node: ast.stmt) -> int:
    """Where a statement starts in the file: its first decorator, if it has one."""
    decorators: list[ast.expr] = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def _excerpt(text: str) -> tuple[str, ast.Module] | None:
    """The part of ``text`` that can hold sites, as one source: every top-level statement
    that mentions the site name, a class reduced to its header and the members that do
    (recursively). Each line is kept as in the file, so columns, and the nesting libcst
    sees, are the file's. Lines are found by CPython's parser (an AST only, in C), whose
    tree of the whole file comes with the excerpt (it gives each site's line). None where
    that parser refuses the file or a class's first member shares its header's line."""
    tree = _ast_of(text)
    if tree is None:
        return None
    lines = io.StringIO(text, newline="").readlines()
    keep: set[int] = set()  # 0-based

    def take(body: list[ast.stmt]) -> bool:
        kept = False
        for node in body:
            first, last = _first_line(node), node.end_lineno or node.lineno
            if SITE_NAME not in "".join(lines[first - 1 : last]):
                continue
            if isinstance(node, ast.ClassDef):  # its header, and the members that mention it
                header = _first_line(node.body[0]) - 1  # the header's last line
                if header < first:
                    raise _NoExcerpt
                if take(node.body):
                    keep.update(range(first - 1, header))
                    kept = True
                continue
            keep.update(range(first - 1, last))
            kept = True
        return kept

    try:
        take(tree.body)
    except _NoExcerpt:
        return None
    return "".join(lines[i] for i in sorted(keep)), tree


class _NoExcerpt(Exception):
    pass


def discover_sites(text: str, rel: str, file_kind: str) -> list[Site]:
    """The sites of one file, as ``discover_source`` finds them, parsing with libcst only the
    excerpt that can hold them (a tenth of the linear file: the rest of it costs a cold
    ``check`` most of its time). The whole file is parsed where CPython's parser or libcst
    refuses the excerpt, so a file that does not parse is refused with its line as before."""
    if SITE_NAME not in text:
        return []
    excerpt = _excerpt(text)
    if excerpt is not None:
        source, tree = excerpt
        try:
            module = cst.parse_module(source)
        except cst.ParserSyntaxError:
            pass
        else:
            statements = [(stmt, None) for stmt in module.body]
            found = _discover(module, source, rel, file_kind, statements, tree)
            if found is not None:
                return found.sites
    return discover_source(text, rel, file_kind).sites


def discover_source(
    text: str, rel: str, file_kind: str, *, module: cst.Module | None = None
) -> FileSites:
    """All sites of one file's source text; ``file_kind`` is ``linear`` or ``attention``.
    ``module`` is ``text`` already parsed (or the tree ``text`` was generated from)."""
    if module is None:
        module = parse_source(text, rel)
    if SITE_NAME not in text:
        return FileSites(rel, text, module, [], [], [], frozenset())
    tree = _ast_of(text)
    found = _discover(module, text, rel, file_kind, _site_chunks(module, text, tree), tree)
    assert found is not None  # every statement's offset is known
    return found


def _ast_of(text: str) -> ast.Module | None:
    try:
        return ast.parse(text.removeprefix("\ufeff"))
    except (SyntaxError, ValueError):
        return None


def _site_lines(tree: ast.Module) -> list[int]:
    """The line of every assignment to the site name, in source order, from CPython's tree
    (the statements the collector takes for sites: a plain name among the targets). Only
    statements are walked: expressions hold none."""
    out = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == SITE_NAME for t in node.targets):
                out.append((node.lineno, node.col_offset))
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            if isinstance(target, ast.Name) and target.id == SITE_NAME and node.value:
                out.append((node.lineno, node.col_offset))
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                todo += block
    return [line for line, _ in sorted(out)]


def _lines_from_positions(
    raws: Sequence[_RawSite],
    module: cst.Module,
    statements: Sequence[tuple[cst.BaseStatement, int | None]],
) -> list[int] | None:
    """Each site's line from libcst's own positions (code is generated: the fallback where
    CPython's tree is missing or disagrees); None where a statement's offset is unknown."""
    lines = []
    for raw in raws:
        stmt, offset = statements[raw.chunk]
        if offset is None:
            return None
        chunk = module.with_changes(header=(), body=(stmt,), footer=())
        positions = MetadataWrapper(chunk, unsafe_skip_copy=True).resolve(PositionProvider)
        lines.append(positions[raw.stmt].start.line + offset)
    return lines


@dataclass
class _SiteDispatches:
    """What the dispatches one site governs say of it, gathered one dispatch at a time."""

    governs: set[str] = field(default_factory=set)
    """The products of every dispatch the site governs."""
    gemms: set[str] = field(default_factory=set)
    knows: list[tuple[str, ...] | None] = field(default_factory=list)
    """Each dispatch's values (``chain_knows``), in order."""
    knows_for: list[str] = field(default_factory=list)
    """The products each of ``knows`` is for (``qk+pv``)."""
    pv_nodes: list[cst.If] = field(default_factory=list)
    """The dispatches of P.V alone (not Q.K^T)."""

    def add(self, d: _Dispatch) -> None:
        self.governs |= d.products
        self.gemms.add(d.gemm)
        self.knows.append(d.knows)
        self.knows_for.append("+".join(sorted(d.products)))
        if "pv" in d.products and "qk" not in d.products:
            self.pv_nodes.append(d.node)

    def role(self, raw: _RawSite, file_kind: str) -> str | None:
        """The site's role: its override, else its products'; None for a label site."""
        if raw.override:
            return raw.override
        return _role_from_products(self.governs, file_kind) if self.governs else None

    def site(self, raw: _RawSite, rel: str, role: str | None, form: str, gemm: str) -> Site:
        knows = _site_knows(self.knows)
        return Site(
            role=role or "unknown",
            file=rel,
            line=raw.line,
            function=raw.function,
            value=raw.value,
            form=form,
            kind=raw.kind,
            governs=tuple(sorted(self.governs - {"unknown"})),
            source=raw.source,
            knows=knows,
            knows_for=tuple(self.knows_for) if knows is not None else (),
            gemm=gemm if (role or "") == "linear" else "",
        )


def _accumulate(
    raw_sites: list[_RawSite], dispatches: Sequence[_Dispatch]
) -> list[_SiteDispatches]:
    """Each site's dispatches: every dispatch added to each site that governs it."""
    accs = [_SiteDispatches() for _ in raw_sites]
    for d in dispatches:
        for i in _governs(raw_sites, d):
            accs[i].add(d)
    return accs


def _gemms_of(accs: Sequence[_SiteDispatches]) -> list[str]:
    """Each site's GEMM: the one of every dispatch it governs; a label site takes the next
    governed site's, as it takes its role."""
    own = [next(iter(a.gemms)) if len(a.gemms) == 1 else "" for a in accs]
    return [
        own[i]
        if accs[i].governs
        else next((own[j] for j in range(i + 1, len(accs)) if accs[j].governs), "")
        for i in range(len(accs))
    ]


def _discover(
    module: cst.Module,
    text: str,
    rel: str,
    file_kind: str,
    statements: Sequence[tuple[cst.BaseStatement, int | None]],
    tree: ast.Module | None,
) -> FileSites | None:
    """The sites of ``statements`` (top-level statements of ``module`` that mention the site
    name, each with the lines before it in the file where known). Each site's line comes from
    CPython's ``tree`` of the whole file, or from libcst's positions where that tree is
    missing or holds another number of sites; None where neither can say."""
    collector = _Collector(file_kind)
    for i, (stmt, _) in enumerate(statements):
        collector.chunk = i
        module.with_changes(header=(), body=(stmt,), footer=()).visit(collector)
    collector.done.append(collector.module_frame)
    raws = sorted((r for frame, _ in collector.done for r in frame), key=lambda r: r.pos)
    lines = _site_lines(tree) if tree is not None else None
    if lines is None or len(lines) != len(raws):
        lines = _lines_from_positions(raws, module, statements)
        if lines is None:
            return None
    for raw, line in zip(raws, lines, strict=True):
        raw.line = line

    found: list[tuple[_RawSite, Site, list[cst.If]]] = []
    for raw_sites, dispatches in collector.done:
        accs = _accumulate(raw_sites, dispatches)
        roles = [acc.role(raw, file_kind) for raw, acc in zip(raw_sites, accs, strict=True)]
        gemms = _gemms_of(accs)
        for i, (raw, acc) in enumerate(zip(raw_sites, accs, strict=True)):
            role, form = roles[i], raw.kind
            if not acc.governs:
                form = "label" if raw.kind != "dynamic" else raw.kind
                if role is None:
                    later = [r for r in roles[i + 1 :] if r is not None]
                    role = later[0] if later else ("linear" if file_kind == "linear" else "unknown")
            found.append((raw, acc.site(raw, rel, role, form, gemms[i]), acc.pv_nodes))
    found.sort(key=lambda t: t[0].pos)
    return FileSites(
        rel=rel,
        text=text,
        module=module,
        sites=[s for _, s, _ in found],
        literals=[r.literal for r, _, _ in found],
        pv_dispatches=[p for _, _, p in found],
        chunks=frozenset(id(stmt) for stmt, _ in statements),
    )


def discover(root: Path, targets: Targets) -> list[FileSites]:
    """Discover the sites of every target file of a checkout (only files with the token
    are parsed)."""
    return [
        discover_source(read_target(root, rel), rel, targets.kind_of(rel))
        for rel in targets.all_files
    ]
