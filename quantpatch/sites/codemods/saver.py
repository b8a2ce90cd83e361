"""Insert (marked) tensor-saver calls into Megatron sources.

* every linear autograd function that holds a ``custom_quant_type`` dispatch (a fork's renamed
  ``CustomLinear...`` copy is the one that runs; the stock class only where no class holds a
  dispatch): before its forward GEMM (the gathered input and the weight;
  the layer number and module kind are stashed on ``ctx`` for the backward pass) and before its
  input-gradient GEMM (the output gradient and the weight);
* ``DotProductAttention.forward``: before Q.K^T (query, key) and before P.V (value and the
  attention probabilities), with ``self.layer_number``;
* ``TransformerLayer.forward``: one call at the top that tells the saver which layer runs, so
  the linear calls can name their layer and kind (qkv / proj / fc1 / fc2 / expert / output).

Where a product sits in a ``custom_quant_type`` dispatch, the call goes right before the
dispatch and passes the variable, so saved tensors carry the format actually in force; in a
stock layout it passes ``None`` (the saver then uses ``CUSTOM_QUANT_TYPE`` or ``bf16``). Every
inserted statement carries the marker ``# quantpatch: saver``.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from quantpatch.base.config import SITE_NAME
from quantpatch.base.errors import UserError
from quantpatch.sites.codemods.init_sites import ATTENTION_CLASS, LINEAR_CLASS_SUFFIX, product_of
from quantpatch.sites.codemods.set_value import insert_before, keep_bom
from quantpatch.sites.discovery import ScopedVisitor, find_all, parse_source
from quantpatch.sites.model import RUNTIME_PACKAGE

MARK = "# quantpatch: saver"
IMPORT = f"from {RUNTIME_PACKAGE} import tensor_saver as _qp_saver  {MARK}\n"
LAYER_CLASS = "TransformerLayer"


@dataclass
class _Target:
    node: cst.CSTNode
    governed: bool
    call: cst.Call


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def _root_name(expr: cst.BaseExpression) -> str:
    names = find_all(expr, cst.Name)
    if not names:
        raise UserError(f"cannot name the operand '{_code(expr)}'.")
    return names[0].value


class _FindTargets(ScopedVisitor):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.found: dict[str, dict[str, _Target]] = {}  # class -> product -> target
        self.layer_forward: cst.FunctionDef | None = None

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        if (
            self.kind == "layer"
            and self.classes
            and self.classes[-1] == LAYER_CLASS
            and node.name.value == "forward"
            and len(self.functions) == 1
        ):
            self.layer_forward = node

    def _in_scope(self) -> bool:
        if not self.classes or not self.functions:
            return False
        cls, func = self.classes[-1], self.functions[-1].name.value
        if self.kind == "linear":
            return cls.endswith(LINEAR_CLASS_SUFFIX) and func in ("forward", "backward")
        return self.kind == "attention" and cls == ATTENTION_CLASS and func == "forward"

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        if not self._in_scope():
            return
        product = product_of(node, self.functions[-1].name.value)
        found = self.found.setdefault(self.classes[-1], {})
        if product is None or product.name in found or product.name == "wgrad":
            return
        if (self.kind == "linear") == (product.name in ("qk", "pv")):
            return
        target: cst.CSTNode = node
        governed = False
        for ancestor in self.stack[:-1]:  # the outermost dispatch that holds the product
            if isinstance(ancestor, cst.If) and any(
                n.value == SITE_NAME for n in find_all(ancestor.test, cst.Name)
            ):
                target, governed = ancestor, True
                break
        assert isinstance(node.body[0], cst.Assign) and isinstance(node.body[0].value, cst.Call)
        found[product.name] = _Target(target, governed, node.body[0].value)

    def chosen(self) -> dict[str, dict[str, _Target]]:
        """The classes to instrument: every one that holds a dispatch (a fork's renamed copy
        of the linear autograd function is the one that runs), else the stock one."""
        with_products = {c: t for c, t in self.found.items() if t}
        governed = {c: t for c, t in with_products.items() if any(x.governed for x in t.values())}
        if governed:
            return governed
        return dict(list(with_products.items())[:1])


def _block(lines: list[str]) -> cst.BaseStatement:
    head, *body = lines
    return cst.parse_statement(f"{head}  {MARK}\n" + "".join(f"    {b}\n" for b in body))


def _linear_calls(t: _Target, direction: str) -> cst.BaseStatement:
    qt = SITE_NAME if t.governed else "None"
    func = t.call.func
    assert isinstance(func, cst.Attribute)
    if direction == "forward":  # torch.matmul(total_input, weight.t())
        first = _code(t.call.args[0].value)
        return _block(
            [
                "if _qp_saver.ENABLED:",
                "ctx.qp_saver_meta = _qp_saver.linear_meta(weight)",
                f"_qp_saver.save_linear_tensors({first}, weight, {qt}, 'forward', "
                "ctx.qp_saver_meta['layer_idx'], ctx.qp_saver_meta)",
            ]
        )
    first = _code(func.value)  # grad_output.matmul(weight)
    return _block(
        [
            "if _qp_saver.ENABLED:",
            "_qp_meta = getattr(ctx, 'qp_saver_meta', None) or _qp_saver.linear_meta(weight)",
            f"_qp_saver.save_linear_tensors({first}, weight, {qt}, 'backward', "
            "_qp_meta['layer_idx'], _qp_meta)",
        ]
    )


def _attention_calls(t: _Target, product: str) -> cst.BaseStatement:
    qt = SITE_NAME if t.governed else "None"
    args = [a.value for a in t.call.args]
    meta = "{'module_kind': 'core_attention'}"
    if product == "qk":  # torch.baddbmm(buffer, query..., key..., ...)
        q, k = _root_name(args[1]), _root_name(args[2])
        return _block(
            [
                "if _qp_saver.ENABLED:",
                f"_qp_saver.save_attention_tensors({q}, {k}, None, {qt}, 'forward', "
                f"self.layer_number, {meta})",
            ]
        )
    probs, v = _root_name(args[0]), _root_name(args[1])
    return _block(
        [
            "if _qp_saver.ENABLED:",
            f"_qp_saver.save_attention_tensors(None, None, {v}, {qt}, 'forward', "
            f"self.layer_number, {meta})",
            f"_qp_saver.save_tensor({probs}, 'attention', 'forward', {qt}, 'attention_probs', "
            f"self.layer_number, {meta})",
        ]
    )


def _with_import(module: cst.Module) -> cst.Module:
    """The saver import right after the last top-level import before the first definition."""
    body = list(module.body)
    last = -1
    for i, stmt in enumerate(body):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(
            stmt.body[0], (cst.Import, cst.ImportFrom)
        ):
            last = i
    body.insert(last + 1, cst.parse_statement(IMPORT))
    return module.with_changes(body=body)


_EXPECTED = {"linear": ("forward", "dgrad"), "attention": ("qk", "pv")}


def instrument(text: str, rel: str, kind: str) -> str:
    """``text`` with saver calls inserted; ``kind`` is linear, attention or layer."""
    module = parse_source(text, rel)
    if MARK in text:
        raise UserError(f"{rel}: already instrumented ('{MARK}' found).")
    finder = _FindTargets(kind)
    module.visit(finder)
    inserts: dict[int, list[cst.BaseStatement]] = {}
    if kind == "layer":
        fn = finder.layer_forward
        if fn is None or not isinstance(fn.body, cst.IndentedBlock):
            raise UserError(f"{rel}: cannot find {LAYER_CLASS}.forward.")
        stmts = fn.body.body
        doc = (
            stmts
            and isinstance(stmts[0], cst.SimpleStatementLine)
            and isinstance(stmts[0].body[0], cst.Expr)
            and isinstance(stmts[0].body[0].value, cst.SimpleString)
        )
        anchor = stmts[1] if doc and len(stmts) > 1 else stmts[0]
        inserts[id(anchor)] = [_block(["if _qp_saver.ENABLED:", "_qp_saver.enter_layer(self)"])]
    else:
        chosen = finder.chosen() or {"": {}}
        for cls, found in chosen.items():
            missing = [p for p in _EXPECTED[kind] if p not in found]
            if missing:
                where = f"{cls}: " if len(chosen) > 1 else ""
                raise UserError(
                    f"{rel}: {where}cannot find the {', '.join(missing)} product(s) to "
                    "instrument; the file is not a supported Megatron layout."
                )
            for name in _EXPECTED[kind]:
                t = found[name]
                stmt = (
                    _linear_calls(t, "forward" if name == "forward" else "backward")
                    if kind == "linear"
                    else _attention_calls(t, name)
                )
                inserts.setdefault(id(t.node), []).append(stmt)
    return keep_bom(text, insert_before(_with_import(module), inserts))
