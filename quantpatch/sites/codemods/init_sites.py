"""Insert fork-layout sites into stock Megatron core sources.

Each quantizable product becomes::

    custom_quant_type = 'bf16'
    if custom_quant_type == 'bf16':
        <the original statement, unchanged>
    else:
        from megatron.core.quantpatch import quantpatch_ops
        <target> = quantpatch_ops.quant_<op>(<operands>, fmt=custom_quant_type, ...)

so the ``bf16`` path runs the original PyTorch call and imports nothing new. The products are
found by structure: in the linear autograd function, the forward ``torch.matmul``, the input
gradient ``grad_output.matmul(weight)`` and the weight gradient ``grad_output.t().matmul(...)``;
in ``DotProductAttention.forward``, ``torch.baddbmm`` (Q.K^T) and ``torch.bmm`` (P.V).

``Layout`` varies how the sites are written (quotes, annotation, environment default, comments,
a nested ``else:`` branch, one shared attention site, a label site) so that tests can cover
every form real forks use, on real Megatron files.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from quantpatch.base.config import SITE_NAME
from quantpatch.base.errors import UserError
from quantpatch.sites.codemods.set_value import keep_bom
from quantpatch.sites.discovery import calls_quantpatch_ops, chain_knows, parse_source
from quantpatch.sites.model import OPS_VALUES, RUNTIME_PACKAGE

LINEAR_CLASS_SUFFIX = "LinearWithGradAccumulationAndAsyncCommunication"
ATTENTION_CLASS = "DotProductAttention"


@dataclass(frozen=True)
class Layout:
    value: str = "bf16"
    quote: str = "'"
    annotated: bool = False
    env: bool = False
    comments: bool = False
    nested: bool = False
    shared_attention: bool = False
    label: bool = False


@dataclass(frozen=True)
class _Product:
    name: str  # forward / dgrad / wgrad / qk / pv
    target: str  # the assigned name
    op: str  # matmul / baddbmm / bmm
    call: cst.Call  # the quantized call that replaces the product in the else branch


def _site_lines(layout: Layout, indent_comment: bool) -> list[str]:
    q = layout.quote
    literal = f"{q}{layout.value}{q}"
    rhs = f"os.environ.get({q}CUSTOM_QUANT_TYPE{q}, {literal})" if layout.env else literal
    ann = ": str" if layout.annotated else ""
    trailer = "  # which format this GEMM uses" if layout.comments else ""
    line = f"{SITE_NAME}{ann} = {rhs}{trailer}"
    if layout.nested:
        lines = [
            "if torch.is_grad_enabled():",
            f"    {line}",
            "else:",
            f"    {line}",
        ]
    else:
        lines = [line]
    if layout.comments and indent_comment:
        lines = ["# quantization format of the next product", *lines, ""]
    return lines


def _dispatch(stmt: cst.SimpleStatementLine, product: _Product, layout: Layout) -> cst.If:
    """``if custom_quant_type == 'bf16': <stmt> else: <quantized call>`` built from nodes, so
    the original statement (comments and continuation lines included) is kept verbatim."""
    q = layout.quote
    template = cst.parse_statement(
        f"if {SITE_NAME} == {q}bf16{q}:\n"
        "    pass\n"
        "else:\n"
        f"    from {RUNTIME_PACKAGE} import quantpatch_ops\n"
        f"    {product.target} = None\n"
    )
    assert isinstance(template, cst.If) and isinstance(template.orelse, cst.Else)
    else_body = template.orelse.body
    assert isinstance(else_body, cst.IndentedBlock)
    assign_line = else_body.body[1]
    assert isinstance(assign_line, cst.SimpleStatementLine)
    assign = assign_line.body[0]
    assert isinstance(assign, cst.Assign)
    new_assign = assign_line.with_changes(body=[assign.with_changes(value=product.call)])
    return template.with_changes(
        body=template.body.with_changes(body=[stmt.with_changes(leading_lines=())]),
        orelse=template.orelse.with_changes(
            body=else_body.with_changes(body=[else_body.body[0], new_assign])
        ),
    )


def _kwarg(name: str, value: cst.BaseExpression) -> cst.Arg:
    nospace = cst.SimpleWhitespace("")
    return cst.Arg(
        keyword=cst.Name(name),
        value=value,
        equal=cst.AssignEqual(whitespace_before=nospace, whitespace_after=nospace),
    )


WEIGHT_NAME = "weight"
"""The linear autograd function's weight: the operand ``nvfp4-2d`` tiles."""


def _roles(args: list[cst.Arg], backward: bool) -> tuple[str, str]:
    """The roles of the product's two operands, as TransformerEngine names them: the one
    that names the layer's weight (``weight.t()`` in the forward, ``weight`` in dgrad) is the
    ``weight``; in a gradient GEMM the first is the ``grad_output``; the rest are ``input``."""
    operands = [a for a in args if a.keyword is None and not a.star][:2]
    roles = ["input", "input"]
    for i, arg in enumerate(operands):
        if m.findall(arg.value, m.Name(WEIGHT_NAME)):
            roles[i] = "weight"
            break
    if backward:
        roles[0] = "grad_output"
    return roles[0], roles[1]


def _quant_call(
    call: cst.Call, op: str, receiver: cst.BaseExpression | None, backward: bool
) -> cst.Call:
    """``quantpatch_ops.quant_<op>(<operands>, fmt=custom_quant_type[, roles=("grad_output",
    "weight")])`` with the original argument nodes (and their comments) kept as they are;
    ``roles`` names each operand of a linear product (matmul only: the attention products'
    operands are inputs)."""
    args = list(call.args)
    if receiver is not None:
        args.insert(0, cst.Arg(receiver))
    extra = [_kwarg("fmt", cst.Name(SITE_NAME))]
    if op == "matmul":
        first, second = _roles(args, backward)
        extra.append(_kwarg("roles", cst.parse_expression(f'("{first}", "{second}")')))
    last = args[-1].comma if args else cst.MaybeSentinel.DEFAULT
    if isinstance(last, cst.Comma) and isinstance(
        last.whitespace_after, cst.ParenthesizedWhitespace
    ):
        # one argument per line, as written: the new arguments take the indentation of the
        # arguments (the comma after a middle one), the closing comma keeps the last line's
        between = next(
            (
                a.comma
                for a in args[:-1]
                if isinstance(a.comma, cst.Comma)
                and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace)
            ),
            last,
        )
        args[-1] = args[-1].with_changes(comma=between)
        extra = [a.with_changes(comma=between) for a in extra[:-1]] + [
            extra[-1].with_changes(comma=last)
        ]
    args += extra
    for i, arg in enumerate(args[:-1]):
        if arg.comma is cst.MaybeSentinel.DEFAULT:
            args[i] = arg.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    func = cst.Attribute(value=cst.Name("quantpatch_ops"), attr=cst.Name(f"quant_{op}"))
    return call.with_changes(func=func, args=args)


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def product_of(stmt: cst.SimpleStatementLine, func: str) -> _Product | None:
    """Recognise one of the five products in a statement line of ``func``."""
    if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
        return None
    assign = stmt.body[0]
    if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
        return None
    target = assign.targets[0].target.value
    call = assign.value
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
        return None
    attr = call.func.attr.value
    receiver = call.func.value
    is_torch = m.matches(receiver, m.Name("torch"))
    if func == "forward" and attr == "matmul" and is_torch:
        return _Product("forward", target, "matmul", _quant_call(call, attr, None, False))
    if func == "backward" and attr == "matmul" and not is_torch:
        if target not in ("grad_input", "grad_weight"):
            return None
        if len(call.args) != 1 or call.args[0].keyword is not None:
            return None  # Tensor.matmul takes one operand: not a fork's quant_mod.matmul(a, b)
        name = "dgrad" if target == "grad_input" else "wgrad"
        return _Product(name, target, "matmul", _quant_call(call, attr, receiver, True))
    if func == "forward" and is_torch and attr in ("baddbmm", "bmm"):
        name = "qk" if attr == "baddbmm" else "pv"
        return _Product(name, target, attr, _quant_call(call, attr, None, False))
    return None


class _Inject(cst.CSTTransformer):
    def __init__(self, kind: str, layout: Layout, flash: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.layout = layout
        self.flash = flash and kind == "attention"
        self.flash_done = False
        self.cls: list[str] = []
        self.func: list[str] = []
        self.found: list[str] = []
        self.label_done = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.cls.append(node.name.value)

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        self.cls.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.func.append(node.name.value)

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        if self.flash and self._in_target():
            updated_node = _with_flash_route(updated_node, self.layout)
            self.flash_done = True
        self.func.pop()
        return updated_node

    def _in_target(self) -> bool:
        if not self.cls or not self.func:
            return False
        if self.kind == "linear":
            return self.cls[-1].endswith(LINEAR_CLASS_SUFFIX) and self.func[-1] in (
                "forward",
                "backward",
            )
        return self.cls[-1] == ATTENTION_CLASS and self.func[-1] == "forward"

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if not self._in_target():
            return updated_node
        product = product_of(original_node, self.func[-1])
        if product is None or (self.kind == "linear") != (product.name not in ("qk", "pv")):
            return updated_node
        self.found.append(product.name)
        lines: list[str] = []
        if product.name == "pv" and self.layout.shared_attention:
            pass  # P.V reuses the value assigned before Q.K^T
        elif product.name == "qk" and self.flash:
            pass  # the Q.K^T site heads the forward, before the flash route (_with_flash_route)
        else:
            if self.layout.label and not self.label_done and product.name == "forward":
                # a fork's label site: names the saved tensors, overwritten before the GEMM
                q = self.layout.quote
                lines += [
                    f"{SITE_NAME} = {q}{self.layout.value}{q}",
                    f"quantpatch_label = {SITE_NAME}",
                ]
                self.label_done = True
            lines += _site_lines(self.layout, indent_comment=True)
        new = [cst.parse_statement(code + "\n") for code in _group(lines)]
        new.append(_dispatch(updated_node, product, self.layout))
        new[0] = new[0].with_changes(
            leading_lines=(*updated_node.leading_lines, *new[0].leading_lines)
        )
        return cst.FlattenSentinel(new)


def _group(lines: list[str]) -> list[str]:
    """Split generated lines into top-level statements (a line that is not indented starts one;
    blank lines become part of the following statement's leading lines)."""
    out: list[str] = []
    pending: list[str] = []
    for line in lines:
        if line == "" or line.startswith("#"):
            pending.append(line)
            continue
        if line.startswith((" ", "else:")) and out:
            out[-1] += "\n" + line
            continue
        out.append("\n".join([*pending, line]))
        pending = []
    return out


_EXPECTED = {"linear": ["forward", "dgrad", "wgrad"], "attention": ["qk", "pv"]}


# -- the flash-attention route of the FA schemes ---------------------------------------------
#
# With ``flash=True`` (``quantpatch init``) DotProductAttention.forward starts, after its
# docstring and assertions, with the formats of both attention products and a guarded early
# return to the flash-attention kernel (quantpatch_ops.flash_dot_product_attention), taken when
# Q.K^T is quantized, P.V is bf16 and the inputs allow it (CUDA tensors, the causal mask or
# none, no dropout, ...). Both formats must be known there, before the key/value heads are
# repeated and the [b * np, sq, sk] score buffer is taken, so the Q.K^T site moves up from its
# product (it still governs the Q.K^T dispatch: nothing assigns the variable in between) and
# P.V's format is read first by a second P.V site (``# quantpatch: role=pv``: ``set`` writes it
# with the one at the P.V product, ``check`` flags them if they ever differ). With Q.K^T in
# bf16 the guard is one string comparison and one environment lookup, and the stock
# computation runs, bit for bit, importing nothing of quantpatch's, unless
# ``QUANTPATCH_FLASH_BF16=1`` asks for the flash kernel there too (a bf16 baseline on the
# attention path of the FA schemes it is compared with: ``sweep run --attention``). That branch
# names ``'bf16'``, never the site, so the dispatch still reads as written for the ops' values
# and bf16 (``discovery.chain_knows``), and ``import os`` is added to the file where it lacks it.

FLASH_PV = "quantpatch_pv"
FLASH_BF16 = "QUANTPATCH_FLASH_BF16"  # =1: a bf16 Q.K^T takes the flash kernel too
FLASH_ARGS = ("query", "key", "value", "attention_mask")  # the forward's first parameters
_FLASH_COMMENT = (
    "# quantpatch: the formats of P.V, then of Q.K^T; a quantized Q.K^T with a bf16 P.V runs",
    "# on the flash-attention kernel when the inputs allow it, before any score is materialised",
    "# (a bf16 Q.K^T too where QUANTPATCH_FLASH_BF16=1: a baseline on the FA schemes' kernel)",
)


def _flash_lines(layout: Layout) -> str:
    q = layout.quote
    literal = f"{q}{layout.value}{q}"
    args = ", ".join(("self", *FLASH_ARGS))
    return (
        f"{SITE_NAME} = {literal}  # quantpatch: role=pv\n"
        f"{FLASH_PV} = {SITE_NAME}\n"
        f"{SITE_NAME} = {literal}\n"
        f"if {SITE_NAME} != {q}bf16{q}:\n"
        f"    from {RUNTIME_PACKAGE} import quantpatch_ops\n"
        "\n"
        "    if quantpatch_ops.flash_eligible(\n"
        f"        {args}, qk={SITE_NAME}, pv={FLASH_PV}\n"
        "    ):\n"
        "        return quantpatch_ops.flash_dot_product_attention(\n"
        f"            {args}, fmt={SITE_NAME}\n"
        "        )\n"
        "else:\n"
        f"    if os.environ.get({q}{FLASH_BF16}{q}) == {q}1{q}:\n"
        f"        from {RUNTIME_PACKAGE} import quantpatch_ops\n"
        "\n"
        "        if quantpatch_ops.flash_eligible(\n"
        f"            {args}, qk={q}bf16{q}, pv={FLASH_PV}\n"
        "        ):\n"
        "            return quantpatch_ops.flash_dot_product_attention(\n"
        f"                {args}, fmt={q}bf16{q}\n"
        "            )\n"
    )


def _is_preamble(stmt: cst.BaseStatement) -> bool:
    """A docstring or an assertion: the flash route comes after them."""
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Assert) or m.matches(s, m.Expr(value=m.SimpleString())) for s in stmt.body
    )


def _with_flash_route(forward: cst.FunctionDef, layout: Layout) -> cst.FunctionDef:
    """``DotProductAttention.forward`` with the two formats and the flash route at its top."""
    names = [p.name.value for p in forward.params.params]
    if names[1:5] != list(FLASH_ARGS) or not isinstance(forward.body, cst.IndentedBlock):
        raise UserError(
            "DotProductAttention.forward does not take (self, query, key, value, "
            "attention_mask, ...); the file is not a supported megatron-core release."
        )
    body = list(forward.body.body)
    at = 0
    while at < len(body) and _is_preamble(body[at]):
        at += 1
    route = list(cst.parse_module(_flash_lines(layout)).body)
    comments = [cst.EmptyLine(indent=True, comment=cst.Comment(c)) for c in _FLASH_COMMENT]
    route[0] = route[0].with_changes(leading_lines=[cst.EmptyLine(indent=False), *comments])
    body[at:at] = route
    return forward.with_changes(body=forward.body.with_changes(body=body))


def _ensure_import_os(module: cst.Module) -> cst.Module:
    has_os = any(
        m.matches(s, m.SimpleStatementLine(body=[m.Import(names=[m.ImportAlias(m.Name("os"))])]))
        for s in module.body
    )
    if has_os:
        return module
    body = list(module.body)
    first_import = next(
        (
            i
            for i, s in enumerate(body)
            if m.matches(s, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()]))
        ),
        0,
    )
    body.insert(first_import, cst.parse_statement("import os\n"))
    return module.with_changes(body=body)


MLA_HEAD_DIMS = ("k_channels", "v_channels")
_MLA_COMMENT = (
    "# quantpatch: Multi-Latent Attention hands its own Q/K and V head dims (as it does to",
    "# TEDotProductAttention); without them the local attention cannot be built for MLA",
)
_MLA_LINES = """\
if k_channels is not None:
    self.hidden_size_per_attention_head = k_channels
if v_channels is not None:
    self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
"""


class _TeachHeadDims(cst.CSTTransformer):
    """``DotProductAttention.__init__`` takes MLA's ``k_channels`` / ``v_channels`` (the
    keywords ``MLASelfAttention`` passes to its core attention): two keyword parameters and,
    before the softmax scale is derived, the head dims they set. Nothing else changes, so the
    layer computes as before for every other attention; ``init --remove`` restores the bytes."""

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        if updated_node.name.value != ATTENTION_CLASS:
            return updated_node
        body = [
            _teach(stmt)
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__"
            else stmt
            for stmt in updated_node.body.body
        ]
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


def _teach(init: cst.FunctionDef) -> cst.FunctionDef:
    """The stock ``__init__`` with the two parameters and the head dims they set (as it is
    when it already takes them or has another shape)."""
    params = init.params
    names = {p.name.value for p in (*params.params, *params.kwonly_params)}
    if names & set(MLA_HEAD_DIMS) or not isinstance(init.body, cst.IndentedBlock):
        return init
    body = list(init.body.body)
    anchor = next(
        (
            i
            for i, stmt in enumerate(body)
            if m.matches(
                stmt,
                m.If(test=m.Comparison(left=m.Name("softmax_scale"))),
            )
        ),
        None,
    )
    if anchor is None:
        return init
    # a parameter line's own comma (its newline and indent) for every parameter but the
    # last, which keeps the comma before the closing parenthesis
    last = params.params[-1]
    inner = params.params[-2].comma if len(params.params) > 1 else last.comma
    if not isinstance(inner, cst.Comma) or not isinstance(last.comma, cst.Comma):
        return init
    new_params = [
        cst.Param(
            cst.Name(name),
            annotation=cst.Annotation(cst.Name("int")),
            default=cst.Name("None"),
            comma=inner if name != MLA_HEAD_DIMS[-1] else last.comma,
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(" "),
                whitespace_after=cst.SimpleWhitespace(" "),
            ),
        )
        for name in MLA_HEAD_DIMS
    ]
    params = params.with_changes(
        params=[*params.params[:-1], last.with_changes(comma=inner), *new_params]
    )
    lines = list(cst.parse_module(_MLA_LINES).body)
    comments = [cst.EmptyLine(indent=True, comment=cst.Comment(c)) for c in _MLA_COMMENT]
    anchor_if = cst.ensure_type(body[anchor], cst.If)
    lines[0] = lines[0].with_changes(leading_lines=[*anchor_if.leading_lines, *comments])
    body[anchor] = anchor_if.with_changes(leading_lines=())
    body[anchor:anchor] = lines
    return init.with_changes(params=params, body=init.body.with_changes(body=body))


def takes_mla_head_dims(text: str, rel: str) -> bool | None:
    """Whether the file's ``DotProductAttention.__init__`` takes MLA's ``k_channels`` and
    ``v_channels`` (or ``**kwargs``); None when the file has no such class."""
    module = parse_source(text, rel)
    for cls in m.findall(module, m.ClassDef(name=m.Name(ATTENTION_CLASS))):
        for fn in m.findall(cls, m.FunctionDef(name=m.Name("__init__"))):
            params = cst.ensure_type(fn, cst.FunctionDef).params
            if isinstance(params.star_kwarg, cst.Param):
                return True
            names = {p.name.value for p in (*params.params, *params.kwonly_params)}
            return set(MLA_HEAD_DIMS) <= names
    return None


def teach_mla_head_dims(module: cst.Module) -> cst.Module:
    """``module`` with the local ``DotProductAttention`` taking MLA's head dims, where its
    ``__init__`` has the stock shape (unchanged otherwise, and when it already takes them)."""
    return module.visit(_TeachHeadDims())


def inject_sites(
    text: str,
    rel: str,
    kind: str,
    layout: Layout | None = None,
    *,
    teach_mla: bool = True,
    flash: bool = False,
) -> str:
    """``text`` with fork-layout sites and dispatches around every product of ``kind`` (and,
    in the attention file, the MLA head dims of ``teach_mla_head_dims`` unless told not to:
    real forks do not have them). ``flash``: the attention forward also gets the
    flash-attention route of the FA schemes (see ``_with_flash_route``; ``quantpatch init``)."""
    layout = layout or Layout()
    module = parse_source(text, rel)
    if SITE_NAME in text and m.findall(module, m.Name(SITE_NAME)):
        raise UserError(f"{rel}: the file already has {SITE_NAME} sites; nothing to initialise.")
    if flash and (layout.shared_attention or layout.env or layout.nested):
        raise ValueError("the flash route is written with one plain literal site per product")
    inject = _Inject(kind, layout, flash)
    new = module.visit(inject)
    missing = [p for p in _EXPECTED[kind] if p not in inject.found]
    if inject.flash and not inject.flash_done:
        missing.append("DotProductAttention.forward")
    if missing:
        raise UserError(
            f"{rel}: cannot find the {', '.join(missing)} product(s) this Megatron layout "
            "should have; the file is not a supported megatron-core release."
        )
    if layout.env or inject.flash:
        new = _ensure_import_os(new)
    if kind == "attention" and teach_mla:
        new = teach_mla_head_dims(new)
    return keep_bom(text, new.code)


# -- ParetoQ weight steps: a linear-role site in the tensor-parallel layers' constructors ----

PARALLEL_LINEAR_CLASSES = {"ColumnParallelLinear": 0, "RowParallelLinear": 1}
"""The layers whose constructors get a linear-role site, with the weight's TP split dim."""
STEP_CONSTRUCTORS = tuple(f"{cls}.__init__" for cls in PARALLEL_LINEAR_CLASSES)
"""Where those sites are (the function names discovery gives them)."""
_STEP_COMMENT = (
    "# the linear role's learnable weight steps (ParetoQ values), parameters from here on"
)
_HAS_STEP = (
    "if self.weight_alpha is None:\n"
    "    pass\n"
    "else:\n"
    f"    from {RUNTIME_PACKAGE} import quantpatch_ops\n"
    "    pass\n"
)


def _constructor_site(partition_dim: int, value: str = "bf16") -> list[cst.BaseStatement]:
    """``custom_quant_type = '<value>'`` and its dispatch: ``bf16`` registers no step (as a
    layer without bias registers ``bias = None``); another value asks the ops for one (and
    they register none for a value that is not ParetoQ's)."""
    code = (
        f"{_STEP_COMMENT}\n"
        f"{SITE_NAME} = {value!r}\n"
        f"if {SITE_NAME} == 'bf16':\n"
        "    self.register_parameter('weight_alpha', None)\n"
        "else:\n"
        f"    from {RUNTIME_PACKAGE} import quantpatch_ops\n"
        f"    quantpatch_ops.add_weight_scales(self, {SITE_NAME}, "
        f"partition_dim={partition_dim})\n"
    )
    module = cst.parse_module(code)
    body: list[cst.BaseStatement] = list(
        module.body
    )  # the comment is the module's header: it leads the site's line
    body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine(indent=False), *module.header])
    return body


def _wrapped(stmt: cst.SimpleStatementLine, helper: str) -> cst.If:
    """``if self.weight_alpha is None: <stmt> else: <stmt calling quantpatch_ops.<helper>(
    self, <the original callee>, <its arguments>)>``: the original statement kept verbatim."""
    small = stmt.body[0]
    assert isinstance(small, (cst.Assign, cst.Return)) and isinstance(small.value, cst.Call)
    call = small.value
    first = call.args[0].comma if call.args else cst.MaybeSentinel.DEFAULT
    comma = (  # one argument a line where the call is written so
        first
        if isinstance(first, cst.Comma)
        and isinstance(first.whitespace_after, cst.ParenthesizedWhitespace)
        else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    )
    helper_call = call.with_changes(
        func=cst.Attribute(value=cst.Name("quantpatch_ops"), attr=cst.Name(helper)),
        args=[cst.Arg(cst.Name("self"), comma=comma), cst.Arg(call.func, comma=comma), *call.args],
    )
    quantized = stmt.with_changes(body=[small.with_changes(value=helper_call)], leading_lines=())
    template = cst.ensure_type(cst.parse_statement(_HAS_STEP), cst.If)
    orelse = cst.ensure_type(template.orelse, cst.Else)
    else_body = cst.ensure_type(orelse.body, cst.IndentedBlock)
    return template.with_changes(
        body=template.body.with_changes(body=[stmt.with_changes(leading_lines=())]),
        orelse=orelse.with_changes(
            body=else_body.with_changes(body=[else_body.body[0], quantized])
        ),
        leading_lines=stmt.leading_lines,
    )


def _is_call_of(stmt: cst.BaseStatement, kind: type, func: m.BaseMatcherNode) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    return (
        isinstance(small, kind)
        and isinstance(getattr(small, "value", None), cst.Call)
        and m.matches(small.value.func, func)  # type: ignore[attr-defined]
    )


class _WeightSteps(cst.CSTTransformer):
    """In each tensor-parallel linear layer: the constructor site (last in ``__init__``), the
    forward's call of its linear function and ``sharded_state_dict``'s return wrapped in a
    test of ``self.weight_alpha`` (None under ``bf16``: the original statements run)."""

    def __init__(self, value: str = "bf16") -> None:
        super().__init__()
        self.found: dict[str, set[str]] = {}
        self.value = value

    def leave_ClassDef(
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.ClassDef:
        name = updated_node.name.value
        if name not in PARALLEL_LINEAR_CLASSES:
            return updated_node
        done = self.found.setdefault(name, set())
        body = []
        for stmt in updated_node.body.body:
            if isinstance(stmt, cst.FunctionDef) and isinstance(stmt.body, cst.IndentedBlock):
                stmt = self._method(stmt, PARALLEL_LINEAR_CLASSES[name], done)
            body.append(stmt)
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    def _method(self, fn: cst.FunctionDef, dim: int, done: set[str]) -> cst.FunctionDef:
        block = cst.ensure_type(fn.body, cst.IndentedBlock)
        stmts = list(block.body)
        method = fn.name.value
        if method == "__init__":
            stmts += _constructor_site(dim, self.value)
            done.add(method)
        elif method in ("forward", "sharded_state_dict"):
            kind, func, helper = (
                (cst.Assign, m.Attribute(m.Name("self"), m.Name("_forward_impl")), "paretoq_linear")
                if method == "forward"
                else (
                    cst.Return,
                    m.Name("make_sharded_tensors_for_checkpoint"),
                    "paretoq_sharded_state_dict",
                )
            )
            for i, stmt in enumerate(stmts):
                if _is_call_of(stmt, kind, func):
                    stmts[i] = _wrapped(cst.ensure_type(stmt, cst.SimpleStatementLine), helper)
                    done.add(method)
                    break
        return fn.with_changes(body=block.with_changes(body=stmts))


def inject_weight_steps(text: str, rel: str, value: str = "bf16") -> str:
    """``text`` (a linear file) with the ParetoQ weight steps wired into
    ``ColumnParallelLinear`` and ``RowParallelLinear``: a ``custom_quant_type`` site in each
    constructor (one more linear-role site, set with the others, holding ``value``: the
    linear role's current value on a fork, so its sites still agree), the forward passing
    the step to the ops, and ``sharded_state_dict`` sharding it like the weight."""
    module = parse_source(text, rel)
    steps = _WeightSteps(value)
    new = module.visit(steps)
    wanted = {"__init__", "forward", "sharded_state_dict"}
    missing = [
        f"{cls}.{method}"
        for cls in PARALLEL_LINEAR_CLASSES
        for method in sorted(wanted - steps.found.get(cls, set()))
    ]
    if missing:
        raise UserError(
            f"{rel}: cannot find {', '.join(missing)} in the shape this Megatron layout should "
            "have; the file is not a supported megatron-core release."
        )
    return keep_bom(text, new.code)


# -- teaching a fork's own dispatch chains the quantpatch values --------------------------------

_TEACH_TEMPLATE = """\
if x:
    pass
elif {site} != {q}bf16{q}:
    from {package} import quantpatch_ops
    {target} = None
"""


def _chain_ifs(node: cst.If) -> list[cst.If]:
    out = [node]
    while isinstance(out[-1].orelse, cst.If):
        out.append(out[-1].orelse)
    return out


def _stock_line(node: cst.If, func: str) -> tuple[cst.SimpleStatementLine, _Product] | None:
    """The chain's stock product: the one statement of its ``else`` (or of its
    ``== 'bf16'`` branch) that ``product_of`` recognises."""
    blocks: list[cst.BaseSuite] = []
    last = _chain_ifs(node)[-1]
    if isinstance(last.orelse, cst.Else):
        blocks.append(last.orelse.body)
    for branch in _chain_ifs(node):
        if m.matches(
            branch.test,
            m.Comparison(
                left=m.Name(SITE_NAME),
                comparisons=[m.ComparisonTarget(m.Equal(), comparator=m.SimpleString())],
            ),
        ):
            literal = cst.ensure_type(branch.test, cst.Comparison).comparisons[0].comparator
            if cst.ensure_type(literal, cst.SimpleString).evaluated_value == "bf16":
                blocks.append(branch.body)
    for block in blocks:
        if not isinstance(block, cst.IndentedBlock) or len(block.body) != 1:
            continue
        stmt = block.body[0]
        if isinstance(stmt, cst.SimpleStatementLine):
            product = product_of(stmt, func)
            if product is not None:
                return stmt, product
    return None


def _quote_of(node: cst.If) -> str:
    for string in find_strings(node.test):
        return string.quote[-1]
    return "'"


def find_strings(node: cst.CSTNode) -> list[cst.SimpleString]:
    return [n for n in m.findall(node, m.SimpleString()) if isinstance(n, cst.SimpleString)]


class _Teach(cst.CSTTransformer):
    """Every explicit dispatch chain (``if custom_quant_type == 'mxfp8': <fork op> elif ...
    else: <stock product>``) gains, before its ``else``, a branch for every other value
    that is not bf16, calling ``quantpatch_ops`` on the stock product's operands (the
    quantpatch values the chain lacks; the fork's own values still take its own branches,
    which stay as they are). Chains that already hand values to ``quantpatch_ops``, that
    cannot be read, or whose stock product is not recognised are left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.func: list[str] = []
        self.taught: list[str] = []
        self.elifs: set[int] = set()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.func.append(node.name.value)

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self.func.pop()
        return updated_node

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self.elifs.add(id(node.orelse))

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        if id(original_node) in self.elifs or not self.func:
            return updated_node
        if not m.findall(original_node.test, m.Name(SITE_NAME)):
            return updated_node
        knows = chain_knows(original_node)
        if knows is None or OPS_VALUES in knows:
            return updated_node
        if any(calls_quantpatch_ops(b.body) for b in _chain_ifs(original_node)):
            return updated_node
        stock = _stock_line(original_node, self.func[-1])
        if stock is None:
            return updated_node
        _, product = stock
        q = _quote_of(original_node)
        template = cst.ensure_type(
            cst.parse_statement(
                _TEACH_TEMPLATE.format(
                    site=SITE_NAME, q=q, target=product.target, package=RUNTIME_PACKAGE
                )
            ),
            cst.If,
        )
        branch = cst.ensure_type(template.orelse, cst.If)
        body = cst.ensure_type(branch.body, cst.IndentedBlock)
        line = cst.ensure_type(body.body[1], cst.SimpleStatementLine)
        assign = cst.ensure_type(line.body[0], cst.Assign)
        line = line.with_changes(body=[assign.with_changes(value=product.call)])
        branch = branch.with_changes(body=body.with_changes(body=[body.body[0], line]))
        self.taught.append(product.name)
        return _append_branch(updated_node, branch)


def _append_branch(node: cst.If, branch: cst.If) -> cst.If:
    """``node``'s chain with ``branch`` as its last ``elif`` (before the ``else``)."""
    if isinstance(node.orelse, cst.If):
        return node.with_changes(orelse=_append_branch(node.orelse, branch))
    return node.with_changes(orelse=branch.with_changes(orelse=node.orelse))


def teach_dispatches(text: str, rel: str) -> str | None:
    """``text`` with each explicit dispatch chain taught the quantpatch values it lacks
    (``_Teach``); None when no chain needs it."""
    module = parse_source(text, rel)
    teach = _Teach()
    new = module.visit(teach)
    if not teach.taught:
        return None
    return keep_bom(text, new.code)
