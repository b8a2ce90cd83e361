"""Rewrite site values (and split a shared qk+pv site) without touching any other byte.

The transformer swaps only the characters between the quotes of the chosen string literals
(prefix and quote style kept) and, for a split, inserts one assignment line right before each
P.V dispatch of the shared site. Nodes are matched by identity with the tree that discovery
walked, so the plan and the discovery can never disagree about which literal is meant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import libcst as cst

from quantpatch.base.config import GEMMS, SITE_NAME
from quantpatch.base.errors import UserError
from quantpatch.sites.discovery import FileSites, discover_source, role_values


def requote(literal: str, value: str) -> str:
    """``literal`` (a Python string literal as written) with its content replaced by ``value``.

    >>> requote("r'''hifp8'''", "mxfp4")
    "r'''mxfp4'''"
    """
    prefix_len = len(literal) - len(literal.lstrip("rRbBuUfF"))
    prefix, body = literal[:prefix_len], literal[prefix_len:]
    quote = body[:3] if body[:3] in ("'''", '"""') else body[:1]
    return f"{prefix}{quote}{value}{quote}"


class _Rewrite(cst.CSTTransformer):
    def __init__(
        self,
        values: Mapping[int, str],
        inserts: Mapping[int, Sequence[cst.BaseStatement]],
    ) -> None:
        super().__init__()
        self.values = values
        self.inserts = inserts

    def leave_SimpleString(
        self, original_node: cst.SimpleString, updated_node: cst.SimpleString
    ) -> cst.SimpleString:
        value = self.values.get(id(original_node))
        if value is None:
            return updated_node
        return updated_node.with_changes(value=requote(original_node.value, value))

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        if not any(id(child) in self.inserts for child in original_node.body):
            return updated_node
        body: list[cst.BaseStatement] = []
        for orig, upd in zip(original_node.body, updated_node.body, strict=False):
            new = list(self.inserts.get(id(orig), ()))
            if new and isinstance(upd, (cst.If, cst.SimpleStatementLine)) and upd.leading_lines:
                # the blank lines and comments in front of the statement stay in front of
                # the inserted line, which sits right before the statement itself
                new[0] = new[0].with_changes(leading_lines=upd.leading_lines)
                upd = upd.with_changes(leading_lines=())
            body.extend(new)
            body.append(upd)
        return updated_node.with_changes(body=body)


def insert_before(module: cst.Module, inserts: Mapping[int, Sequence[cst.BaseStatement]]) -> str:
    """The code of ``module`` with statements inserted before the statements whose ``id`` is
    a key of ``inserts`` (in any indented block); nothing else changes."""
    return module.visit(_Rewrite({}, inserts)).code


def _site_statement(source: str, literal: str, value: str, role: str) -> cst.BaseStatement:
    """A site of the same form as the one it splits from (``source`` is that site's value
    expression, ``literal`` the string in it that holds the value)."""
    expr = cst.parse_expression(source)
    strings = [n for n in _strings(expr) if n.value == literal]

    class _Swap(cst.CSTTransformer):
        def leave_SimpleString(
            self, original_node: cst.SimpleString, updated_node: cst.SimpleString
        ) -> cst.SimpleString:
            if strings and original_node is strings[-1]:
                return updated_node.with_changes(value=requote(literal, value))
            return updated_node

    swapped = expr.visit(_Swap())
    assert isinstance(swapped, cst.BaseExpression)
    code = cst.Module([]).code_for_node(swapped)
    return cst.parse_statement(f"{SITE_NAME} = {code}  # quantpatch: role={role}\n")


def _strings(node: cst.CSTNode) -> list[cst.SimpleString]:
    found: list[cst.SimpleString] = []

    class _Find(cst.CSTVisitor):
        def visit_SimpleString(self, n: cst.SimpleString) -> None:
            found.append(n)

    node.visit(_Find())
    return found


def plan_values(fs: FileSites, values: Mapping[str, str], *, split: bool = True) -> str:
    """The source of ``fs`` with every site of the roles in ``values`` set to its value (see
    :func:`plan_module`)."""
    module = plan_module(fs, values, split=split)
    return fs.text if module is None else keep_bom(fs.text, module.code)


def plan_module(
    fs: FileSites, values: Mapping[str, str], *, split: bool = True
) -> cst.Module | None:
    """The module of ``fs`` with every site of the roles in ``values`` set to its value, or
    ``None`` when nothing changes.

    A ``qk+pv`` site given different qk and pv values is split (an assignment for P.V is
    inserted right before its P.V dispatch) or, with ``split=False``, refused. A label site
    in front of it is never split: it takes the value of the product it labels once the split
    is made, Q.K^T's (the first of its roles). Dynamic sites are refused when their role is
    written: quantpatch never guesses at an expression.
    """
    by_node: dict[int, str] = {}
    inserts: dict[int, list[cst.BaseStatement]] = {}
    for site, literal, pv_nodes in zip(fs.sites, fs.literals, fs.pv_dispatches, strict=False):
        wanted = site.wanted(values)
        if wanted is None:
            continue
        if literal is None:
            raise UserError(
                f"{fs.rel}:{site.line}: the {site.role} site is dynamic ({site.source}); "
                "quantpatch only rewrites string literals and environment defaults."
            )
        if (
            site.role == "qk+pv"
            and site.form != "label"
            and "qk" in values
            and "pv" in values
            and values["qk"] != values["pv"]
        ):
            if not split:
                raise UserError(
                    f"{fs.rel}:{site.line}: one assignment governs both Q.K^T and P.V, so qk="
                    f"{values['qk']} and pv={values['pv']} cannot differ with --no-split."
                )
            if not pv_nodes:
                raise UserError(
                    f"{fs.rel}:{site.line}: the shared qk+pv site has no separate P.V dispatch "
                    "to split at; add '# quantpatch: role=...' comments or edit it by hand."
                )
            by_node[id(literal)] = values["qk"]
            for node in pv_nodes:
                inserts.setdefault(id(node), []).append(
                    _site_statement(site.source, literal.value, values["pv"], "pv")
                )
            continue
        by_node[id(literal)] = wanted
    if not by_node and not inserts:
        return None
    # transform only the top-level statements that mention the site name (where every site
    # and dispatch lives); the rest of the module is kept as the very same nodes
    rewrite = _Rewrite(by_node, inserts)
    body = [stmt.visit(rewrite) if id(stmt) in fs.chunks else stmt for stmt in fs.module.body]
    return fs.module.with_changes(body=body)


def keep_bom(original: str, code: str) -> str:
    """libcst drops a leading UTF-8 byte-order mark; every byte outside the literal stays."""
    if original.startswith("\ufeff") and not code.startswith("\ufeff"):
        return "\ufeff" + code
    return code


def verify_rewrite(
    old: FileSites,
    new_text: str,
    values: Mapping[str, str],
    file_kind: str,
    module: cst.Module | None = None,
) -> FileSites:
    """Re-read a planned source and prove it is what was asked: it parses and compiles, the
    roles hold the requested values, and no site appeared or vanished except split ones.
    ``module`` is the tree ``new_text`` was generated from (libcst's code generation is the
    exact inverse of its parser): discovery then runs on it instead of parsing the text
    again, while CPython's compiler still proves the text parses."""
    try:
        compile(new_text.removeprefix("\ufeff"), old.rel, "exec", dont_inherit=True)
    except SyntaxError as exc:  # pragma: no cover - libcst and CPython agree on our output
        raise UserError(f"{old.rel}:{exc.lineno}: the rewrite would not compile.") from None
    new = discover_source(new_text, old.rel, file_kind, module=module)
    got, _ = role_values(new.sites)
    for role, value in values.items():
        present = any(role in s.roles for s in new.sites) or (
            role in GEMMS and any(s.gemm == role for s in new.sites)
        )
        if present and got.get(role) != value:
            raise RuntimeError(
                f"{old.rel}: after rewriting, role {role} reads {got.get(role)!r}, not {value!r}"
            )
    if len(new.sites) < len(old.sites):
        raise RuntimeError(f"{old.rel}: the rewrite lost a site")
    return new
