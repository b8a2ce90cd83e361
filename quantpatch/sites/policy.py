"""The BF16 layer policy in a checkout's linear file: find it, write it, insert it, and tell
whether the linear dispatches can honour it.

The policy is one module-level assignment that ``init`` inserts after the imports::

    quantpatch_bf16_layers = ''
    if quantpatch_bf16_layers:
        from megatron.core.quantpatch import quantpatch_layers

        quantpatch_layers.install(quantpatch_bf16_layers)

``set --bf16-layers first:2,last:8`` rewrites the literal (every other byte kept), so the scheme
branch's source says which layers ran in BF16. At run time ``quantpatch_layers`` resolves the
policy against the model and ``quantpatch_ops.quant_matmul`` consults it: a dispatch branch
that does not hand the value to ``quantpatch_ops`` (a fork's own op) cannot honour it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import libcst as cst

from quantpatch.base.config import SITE_NAME, validate_bf16_layers
from quantpatch.base.errors import UserError
from quantpatch.sites.codemods.set_value import keep_bom, requote
from quantpatch.sites.discovery import (
    ScopedVisitor,
    branch_test,
    calls_quantpatch_ops,
    linear_gemm,
    parse_source,
    reads_site,
)
from quantpatch.sites.model import POLICY_NAME, RUNTIME_PACKAGE, Policy

POLICY_BLOCK = f"""\
{POLICY_NAME} = ''  # linear layers kept in BF16 (quantpatch set --bf16-layers)
if {POLICY_NAME}:
    from {RUNTIME_PACKAGE} import quantpatch_layers

    quantpatch_layers.install({POLICY_NAME})
"""


def _policy_node(module: cst.Module) -> tuple[int, cst.SimpleStatementLine] | None:
    for i, stmt in enumerate(module.body):
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            continue
        node = stmt.body[0]
        if (
            isinstance(node, cst.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0].target, cst.Name)
            and node.targets[0].target.value == POLICY_NAME
        ):
            return i, stmt
    return None


def find_policy(text: str, rel: str, module: cst.Module | None = None) -> Policy | None:
    """The policy assignment of a linear file, or None (no ``init`` of this version).
    ``module``: ``text`` already parsed (parsed again unless its code is ``text``)."""
    if POLICY_NAME not in text:
        return None
    if module is None or module.code != text:
        quick = _find_quickly(text, rel)
        if quick is not False:
            return quick
        module = parse_source(text, rel)
    found = _policy_node(module)
    if found is None:
        return None
    _, stmt = found
    line = _line(module, stmt.body[0])
    assign = stmt.body[0]
    assert isinstance(assign, cst.Assign)
    value = assign.value
    literal = value.evaluated_value if isinstance(value, cst.SimpleString) else None
    return Policy(rel, line, literal if isinstance(literal, str) else None)


def _find_quickly(text: str, rel: str) -> Policy | Literal[False] | None:
    """``find_policy`` without parsing the whole file with libcst (a quarter second on a
    linear file, most of a cold ``check``): CPython's parser finds the top-level statements
    that assign the name, and libcst parses only their lines. False where that cannot
    decide (a file CPython refuses, lines that do not parse alone): the whole file then."""
    import ast

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    lines = text.splitlines(keepends=True)
    for stmt in tree.body:
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == POLICY_NAME
        ):
            continue
        first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
        try:
            module = cst.parse_module("".join(lines[first - 1 : last]))
        except cst.ParserSyntaxError:
            return False
        found = _policy_node(module)
        if found is None or found[0] != 0 or len(module.body) != 1:
            return False
        value = found[1].body[0]
        assert isinstance(value, cst.Assign)
        literal = value.value.evaluated_value if isinstance(value.value, cst.SimpleString) else None
        return Policy(rel, first, literal if isinstance(literal, str) else None)
    return None


def write_policy(text: str, rel: str, spec: str) -> str:
    """``text`` with the policy literal holding ``spec`` (nothing else changes)."""
    module = parse_source(text, rel)
    found = _policy_node(module)
    if found is None:
        raise UserError(f"{rel}: no {POLICY_NAME} assignment to write the BF16 layers into.")
    i, stmt = found
    assign = stmt.body[0]
    assert isinstance(assign, cst.Assign)
    if not isinstance(assign.value, cst.SimpleString):
        raise UserError(f"{rel}: {POLICY_NAME} is not a string literal; quantpatch never guesses.")
    new_value = assign.value.with_changes(value=requote(assign.value.value, spec))
    new_stmt = stmt.with_changes(body=[assign.with_changes(value=new_value)])
    body = [*module.body[:i], new_stmt, *module.body[i + 1 :]]
    return keep_bom(text, module.with_changes(body=body).code)


def insert_policy(text: str, rel: str) -> str:
    """``text`` with the policy block after its last top-level import before any definition
    (the file unchanged where it has one)."""
    module = parse_source(text, rel)
    if _policy_node(module) is not None:
        return text
    at = 0
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.SimpleStatementLine) and all(
            isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
        ):
            at = i + 1
        elif isinstance(stmt, cst.FunctionDef | cst.ClassDef):
            break
    block = list(cst.parse_module(POLICY_BLOCK).body)
    block[0] = block[0].with_changes(leading_lines=[cst.EmptyLine()])
    body = [*module.body[:at], *block, *module.body[at:]]
    return keep_bom(text, module.with_changes(body=body).code)


class _Chains(ScopedVisitor):
    """Every dispatch chain of the linear file with its GEMM and first line."""

    def __init__(self) -> None:
        super().__init__()
        self.chains: list[tuple[cst.If, str, str]] = []
        self.elifs: set[int] = set()

    def visit_If(self, node: cst.If) -> None:
        if id(node) in self.elifs or not reads_site(node.test):
            return
        cur: cst.If | cst.Else | None = node.orelse
        while isinstance(cur, cst.If):
            self.elifs.add(id(cur))
            cur = cur.orelse
        function = self.scope[-1] if self.scope else ""
        self.chains.append((node, linear_gemm(node, function), ".".join(self.scope)))


def _routes_to_ops(node: cst.If, value: str) -> bool | None:
    """Whether ``value`` runs a branch that hands it to ``quantpatch_ops`` (None: a test
    that cannot be read)."""
    cur: cst.If | cst.Else | None = node
    while isinstance(cur, cst.If):
        test = branch_test(cur.test)
        if test is None:
            return None
        only, strings = test
        if (value in strings) == only:
            return calls_quantpatch_ops(cur.body)
        cur = cur.orelse
    return cur is not None and calls_quantpatch_ops(cur.body)


def unhonoured(text: str, rel: str, values: Mapping[str, str]) -> str | None:
    """Why the linear dispatches of ``text`` cannot honour a BF16 layer policy under
    ``values`` (one sentence without its full stop), or None: every GEMM whose value is not
    bf16 must run a branch that hands it to ``quantpatch_ops``, the only code that asks the
    policy."""
    module = parse_source(text, rel)
    chains = _Chains()
    module.visit(chains)
    for node, gemm, where in chains.chains:
        if not gemm:
            continue  # the constructors' ParetoQ steps: no product
        value = values.get(gemm, values.get("linear"))
        if value is None or value == "bf16":
            continue
        routed = _routes_to_ops(node, value)
        if routed is not True:
            line = _line(module, node)
            how = "cannot be read" if routed is None else "does not hand it to quantpatch_ops"
            return (
                f"{rel}:{line}: the {gemm} dispatch in {where} runs '{value}' in a branch that "
                f"{how}, so it cannot keep the policy's layers in BF16; 'quantpatch init' routes "
                "the quantpatch values through quantpatch_ops (a fork's own ops stay its own)"
            )
    return None


def _line(module: cst.Module, node: cst.CSTNode) -> int:
    from libcst.metadata import MetadataWrapper, PositionProvider

    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    return int(positions[node].start.line)


def branch_tag(spec: str) -> str:
    """The policy as a branch-name part: ``first:2,last:8`` -> ``first2.last8``."""
    return validate_bf16_layers(spec).replace(":", "").replace(",", ".")


__all__ = [
    "POLICY_BLOCK",
    "POLICY_NAME",
    "SITE_NAME",
    "Policy",
    "branch_tag",
    "find_policy",
    "insert_policy",
    "unhonoured",
    "write_policy",
]
