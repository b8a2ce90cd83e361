"""A repository shaped like the quantization fork this tool is made for, built at run time.

Real forks are clones with years of history, a branch literally named ``quant``, the linear
dispatches in a renamed ``CustomLinear...`` copy of the autograd function, a label site that
only names the tensors handed to the fork's own tensor saver before a shared Q.K^T/P.V site,
callers of that saver in ``megatron/training/``, an ``arguments.py`` and a Megatron version
newer than the wheels. ``build_fork`` writes such an *origin* from the real megatron-core
files (nothing of the fork is copied: every fork-specific line below is written from the shape
described in the project's issues), and ``clone_quant`` makes the user's ``git clone -b quant``.

Usable from tests and from ``benchmarks/cli_timing.py`` (no pytest import).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from quantpatch.base.config import DEFAULT_ATTENTION_FILE, DEFAULT_LINEAR_FILE
from quantpatch.sites.codemods.init_sites import LINEAR_CLASS_SUFFIX, Layout, inject_sites

from .megatron_parser import write_parser

LINEAR = DEFAULT_LINEAR_FILE
ATTENTION = DEFAULT_ATTENTION_FILE
SAVER = "megatron/core/tensor_saver.py"
TRAINING = "megatron/training/training.py"
ARGUMENTS = "megatron/training/arguments.py"
PACKAGE_INFO = "megatron/core/package_info.py"
STOCK_CLASS = LINEAR_CLASS_SUFFIX
CUSTOM_CLASS = "Custom" + LINEAR_CLASS_SUFFIX
FORK_VERSION = (0, 15, 0, "rc3")

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "Fork Author",
    "GIT_AUTHOR_EMAIL": "author@fork.invalid",
    "GIT_COMMITTER_NAME": "Fork Author",
    "GIT_COMMITTER_EMAIL": "author@fork.invalid",
}


def git(cwd: Path, *args: str, input: str | None = None) -> str:
    import os

    env = {**os.environ, **_GIT_ENV}
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, input=input, capture_output=True, text=True, check=True
    ).stdout


# -- the fork's own tensor saver (its API, written from the shape the issues describe) ------

FORK_SAVER_SOURCE = '''\
"""The fork's tensor saver: saves the operands of quantized GEMMs for offline analysis."""

import os
import time

import torch


class TensorSaver:
    def __init__(self, save_dir=None, enabled=None):
        self.save_dir = save_dir or os.environ.get("TENSOR_SAVE_DIR", "./enhanced_tensor_logs")
        if enabled is None:
            enabled = os.environ.get("TENSOR_SAVE_ENABLED", "false").lower() == "true"
        self.enabled = enabled
        self.counter = 0
        self.iteration = 0

    def set_iteration(self, iteration):
        self.iteration = iteration

    def save_tensor(self, tensor, layer_type, operation, quant_type, tensor_name,
                    layer_idx=None, phase="pre", component="linear", rank=None, metadata=None):
        if not self.enabled or tensor is None:
            return None
        os.makedirs(self.save_dir, exist_ok=True)
        self.counter += 1
        stamp = time.strftime("%Y%m%d_%H%M%S")
        name = (f"{stamp}_{self.counter:04d}_{layer_type}_L{layer_idx}_{operation}_{phase}_"
                f"{component}_{quant_type}_{tensor_name}.pt")
        path = os.path.join(self.save_dir, name)
        torch.save({"tensor": tensor.detach().cpu(),
                    "metadata": {"layer_type": layer_type, "operation": operation,
                                 "quant_type": quant_type, "tensor_name": tensor_name,
                                 "layer_idx": layer_idx, "phase": phase,
                                 "component": component, "rank": rank,
                                 "iteration": self.iteration, **(metadata or {})}}, path)
        return path


_saver = None


def get_tensor_saver():
    global _saver
    if _saver is None:
        _saver = TensorSaver()
    return _saver


def save_tensor(tensor, layer_type, operation, quant_type, tensor_name, layer_idx=None,
                phase="pre", component="linear", rank=None, metadata=None):
    return get_tensor_saver().save_tensor(tensor, layer_type, operation, quant_type,
                                          tensor_name, layer_idx, phase, component, rank,
                                          metadata)


def save_linear_tensors(input_tensor, weight, quant_type, operation="forward", layer_idx=None,
                        phase="pre", component="linear", rank=None, metadata=None):
    saver = get_tensor_saver()
    return {
        "input": saver.save_tensor(input_tensor, "linear", operation, quant_type, "input",
                                   layer_idx, phase, component, rank, metadata),
        "weight": saver.save_tensor(weight, "linear", operation, quant_type, "weight",
                                    layer_idx, phase, component, rank, metadata),
    }


def save_attention_tensors(query, key, value, quant_type, operation="forward", layer_idx=None,
                           phase="pre", component="FA", rank=None, metadata=None,
                           attention_weights=None):
    saver = get_tensor_saver()
    out = {}
    for name, tensor in (("query", query), ("key", key), ("value", value),
                         ("attention_weights", attention_weights)):
        out[name] = saver.save_tensor(tensor, "attention", operation, quant_type, name,
                                      layer_idx, phase, component, rank, metadata)
    return out
'''

FORK_TRAINING_SOURCE = '''\
"""The fork's training loop (only the parts that call the tensor saver)."""

from megatron.core.tensor_saver import get_tensor_saver


def train_step_hook(iteration):
    saver = get_tensor_saver()
    saver.set_iteration(iteration)
    return saver.enabled
'''

_LINEAR_SAVER_CALL = """\
from megatron.core.tensor_saver import save_linear_tensors
save_linear_tensors(input_tensor=total_input, weight=weight, quant_type={site},
                    operation="forward", layer_idx=getattr(ctx, "layer_idx", None),
                    phase="pre", component="linear")
"""

_ATTENTION_LABEL = """\
{site} = {value}
from megatron.core.tensor_saver import save_attention_tensors
save_attention_tensors(query=query, key=key, value=value, quant_type={site},
                       operation="forward", layer_idx=self.layer_number, phase="pre",
                       component="FA")
"""


# -- the fork's own quantizers and its explicit dispatch chains ------------------------------

FORK_QUANT = "megatron/core/fork_quant.py"
FORK_FORMATS = ("mxfp8", "mxfp4", "hifp8")
"""The values the fork's chains have a branch for (besides bf16, their stock ``else``)."""

FORK_QUANT_SOURCE = '''\
"""The fork's own quantizers: MXFP8, MXFP4 and HiFP8 fake quantization with a straight-through
gradient, and the products its dispatch chains call."""

import torch

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _mx(x, dim, fmt):
    x = x.float().movedim(dim, -1)
    n = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, (-n) % 32)).unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - (8 if fmt == "mxfp8" else 2))
    y = blocks / scale
    if fmt == "mxfp8":
        q = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    else:
        grid = torch.tensor(_E2M1)
        idx = torch.bucketize(y.abs().clamp(max=6.0), (grid[1:] + grid[:-1]) / 2)
        q = grid[idx] * torch.sign(y)
    return (q * scale).flatten(-2)[..., :n].movedim(-1, dim)


def _hifp8(x):
    x = x.float()
    _, e = torch.frexp(x.abs())
    e = e - 1
    bits = torch.where(e.abs() <= 3, 3, torch.where(e.abs() <= 7, 2, 1))
    step = torch.exp2((e - bits).float())
    return (torch.round(x / step) * step).clamp(-(2.0**15), 2.0**15)


def fake_quant(x, fmt, dim=-1):
    q = _hifp8(x) if fmt == "hifp8" else _mx(x, dim, fmt)
    return x + (q.to(x.dtype) - x).detach()


def matmul(a, b, fmt, backward=False):
    return torch.matmul(fake_quant(a, fmt), fake_quant(b, fmt, -2 if b.dim() > 1 else -1))


def bmm(a, b, fmt, backward=False):
    return torch.bmm(fake_quant(a, fmt), fake_quant(b, fmt, -2))


def baddbmm(input, batch1, batch2, beta=1.0, alpha=1.0, fmt="mxfp8", backward=False):
    q1, q2 = fake_quant(batch1, fmt), fake_quant(batch2, fmt, -2)
    if beta == 0:
        return torch.bmm(q1, q2) * alpha
    return torch.baddbmm(input, q1, q2, beta=beta, alpha=alpha)
'''


class _Chains(cst.CSTTransformer):
    """quantpatch's generic dispatch (``if custom_quant_type == 'bf16': <stock> else:
    quantpatch_ops.quant_<op>(..., fmt=custom_quant_type)``) as the fork writes its own: one
    branch per value it knows, calling its own quantizer, and the stock product in ``else``
    (where any other value silently lands)."""

    def __init__(self, quote: str) -> None:
        self.quote = quote

    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.If:
        orelse = updated_node.orelse
        if not (
            isinstance(orelse, cst.Else)
            and m.matches(
                updated_node.test,
                m.Comparison(left=m.Name("custom_quant_type"), comparisons=[m.ComparisonTarget()]),
            )
            and "quantpatch_ops" in cst.Module([]).code_for_node(orelse)
        ):
            return updated_node
        else_body = cst.ensure_type(orelse.body, cst.IndentedBlock).body
        line = cst.ensure_type(else_body[-1], cst.SimpleStatementLine)
        assign = cst.ensure_type(line.body[0], cst.Assign)
        call = cst.ensure_type(assign.value, cst.Call)
        op = cst.ensure_type(call.func, cst.Attribute).attr.value.removeprefix("quant_")
        q = self.quote
        code = "".join(
            f"{'if' if i == 0 else 'elif'} custom_quant_type == {q}{f}{q}:\n"
            "    from megatron.core import fork_quant\n"
            "    x = None\n"
            for i, f in enumerate(FORK_FORMATS)
        )
        template = cst.ensure_type(cst.parse_statement(code + "else:\n    pass\n"), cst.If)

        def fill(node: cst.If, i: int) -> cst.If:
            fmt = cst.SimpleString(f"{q}{FORK_FORMATS[i]}{q}")
            ours = ("weight", "roles")  # quantpatch's own keywords; the fork says backward=
            args = [
                a.with_changes(value=fmt)
                if a.keyword is not None and a.keyword.value == "fmt"
                else a
                for a in call.args
                if a.keyword is None or a.keyword.value not in ours
            ]
            roles = [a for a in call.args if a.keyword is not None and a.keyword.value == "roles"]
            if roles and "grad_output" in cst.Module([]).code_for_node(roles[0].value):
                args[-1] = args[-1].with_changes(
                    comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                )
                tight = cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""),
                    whitespace_after=cst.SimpleWhitespace(""),
                )
                args.append(cst.Arg(cst.Name("True"), keyword=cst.Name("backward"), equal=tight))
            if len(args) < len(call.args):
                args[-1] = args[-1].with_changes(comma=call.args[-1].comma)
            mine = call.with_changes(
                func=cst.Attribute(cst.Name("fork_quant"), cst.Name(op)), args=args
            )
            body = cst.ensure_type(node.body, cst.IndentedBlock)
            new_line = line.with_changes(body=[assign.with_changes(value=mine)])
            body = body.with_changes(body=[body.body[0], new_line])
            nxt = node.orelse
            if isinstance(nxt, cst.If):
                return node.with_changes(body=body, orelse=fill(nxt, i + 1))
            stock = cst.ensure_type(nxt, cst.Else)
            return node.with_changes(
                body=body,
                orelse=stock.with_changes(
                    body=stock.body.with_changes(body=updated_node.body.body)
                ),
            )

        return fill(template, 0).with_changes(leading_lines=updated_node.leading_lines)


def fork_chains(text: str, quote: str = "'") -> str:
    """``text`` with every generic dispatch made the fork's explicit chain."""
    return cst.parse_module(text).visit(_Chains(quote)).code


# -- building the fork's files from the real megatron-core ones -----------------------------


class _Rename(cst.CSTTransformer):
    """In ``linear_with_grad_accumulation_and_async_allreduce``: call the custom copy."""

    def __init__(self) -> None:
        self.depth = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node.name.value == "linear_with_grad_accumulation_and_async_allreduce":
            self.depth += 1

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        if original_node.name.value == "linear_with_grad_accumulation_and_async_allreduce":
            self.depth -= 1
        return updated_node

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        if self.depth and original_node.value == STOCK_CLASS:
            return updated_node.with_changes(value=CUSTOM_CLASS)
        return updated_node


def _statements(code: str) -> list[cst.BaseStatement]:
    return list(cst.parse_module(code).body)


def fork_linear(stock: str, layout: Layout) -> str:
    """The stock file plus a ``CustomLinear...`` copy that holds the sites, a label site and
    the fork's saver call; the stock class stays untouched (and unused)."""
    injected = cst.parse_module(inject_sites(stock, LINEAR, "linear", layout))
    site = "custom_quant_type"

    class _Label(cst.CSTTransformer):
        # the injected label line 'quantpatch_label = custom_quant_type' becomes the fork's
        # saver call: the label names the tensors handed to the saver
        def leave_SimpleStatementLine(
            self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
        ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
            code = cst.Module([]).code_for_node(original_node).strip()
            if code == f"quantpatch_label = {site}":
                return cst.FlattenSentinel(_statements(_LINEAR_SAVER_CALL.format(site=site)))
            return updated_node

    injected = injected.visit(_Label())
    custom = next(
        s for s in injected.body if isinstance(s, cst.ClassDef) and s.name.value == STOCK_CLASS
    )
    custom = custom.with_changes(name=cst.Name(CUSTOM_CLASS))
    module = cst.parse_module(stock)
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        body.append(stmt)
        if isinstance(stmt, cst.ClassDef) and stmt.name.value == STOCK_CLASS:
            body.append(custom)
    return module.with_changes(body=body).visit(_Rename()).code


def fork_attention(stock: str, layout: Layout) -> str:
    """Sites with one shared Q.K^T/P.V assignment, and a label site before it that names the
    tensors handed to the fork's saver at the top of ``DotProductAttention.forward``."""
    shared = Layout(**{**layout.__dict__, "shared_attention": True, "label": False})
    module = cst.parse_module(inject_sites(stock, ATTENTION, "attention", shared, teach_mla=False))
    q = layout.quote
    value = f"{q}{layout.value}{q}"
    if layout.env:
        value = f"os.environ.get({q}CUSTOM_QUANT_TYPE{q}, {value})"
    label = _statements(_ATTENTION_LABEL.format(site="custom_quant_type", value=value))

    class _Top(cst.CSTTransformer):
        def leave_FunctionDef(
            self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
        ) -> cst.FunctionDef:
            if original_node.name.value != "forward":
                return updated_node
            body = list(updated_node.body.body)
            at = 1  # after the docstring
            while at < len(body) and "assert" in cst.Module([]).code_for_node(body[at])[:20]:
                at += 1  # after the asserts the stock forward starts with
            body[at:at] = label
            return updated_node.with_changes(body=updated_node.body.with_changes(body=body))

    class _InClass(cst.CSTTransformer):
        def leave_ClassDef(
            self, original_node: cst.ClassDef, updated_node: cst.ClassDef
        ) -> cst.ClassDef:
            if original_node.name.value == "DotProductAttention":
                return updated_node.visit(_Top())  # type: ignore[return-value]
            return updated_node

    return module.visit(_InClass()).code


def package_info(stock: str, version: tuple[int, int, int, str] = FORK_VERSION) -> str:
    """The real ``package_info.py`` with the fork's (newer) version numbers."""
    major, minor, patch, pre = version
    values = {
        "MAJOR": str(major),
        "MINOR": str(minor),
        "PATCH": str(patch),
        "PRE_RELEASE": repr(pre),
    }
    lines = []
    for line in stock.splitlines(keepends=True):
        name = line.split(" = ", 1)[0]
        lines.append(f"{name} = {values[name]}\n" if name in values else line)
    return "".join(lines)


@dataclass
class Fork:
    origin: Path
    history: int


def _fast_history(repo: Path, branch: str, n: int, start: float) -> None:
    """``n`` small commits on ``branch`` through ``git fast-import`` (a few thousand take a
    second), spread over years like a real fork's log."""
    if n <= 0:
        return
    chunks = []
    tip = git(repo, "rev-parse", branch).strip()
    for i in range(n):
        when = int(start + i * 3600 * 7)
        body = f"upstream change {i}\n"
        data = f"entry {i}\n"
        chunks.append(
            f"commit refs/heads/{branch}\n"
            f"committer Upstream Dev <dev@upstream.invalid> {when} +0000\n"
            f"data {len(body)}\n{body}"
            + (f"from {tip}\n" if i == 0 else "")
            + f"M 100644 inline docs/changes/{i % 50:02d}.md\n"
            f"data {len(data)}\n{data}\n"
        )
    git(repo, "fast-import", "--quiet", input="".join(chunks))


def _commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", message)


def build_fork(
    dest: Path,
    tree: Path,
    *,
    history: int = 30,
    layout: Layout | None = None,
    full: bool = True,
    chains: bool = True,
) -> Fork:
    """The fork's origin repository at ``dest`` from a megatron-core ``tree`` (its
    ``megatron/`` directory): upstream history on ``main``, the fork's work on ``quant``
    (including the ``sed`` accident that committed a bare ``'hifp8'`` line, later fixed) and
    a ``dev`` branch. ``chains``: the dispatches are the fork's explicit chains calling its
    own quantizers (``fork_quant.py``), which know only bf16, mxfp8, mxfp4 and hifp8; else
    quantpatch's generic dispatch (values handed to a ``quantpatch_ops`` it does not ship)."""
    layout = layout or Layout(value="hifp8", label=True)
    dest.mkdir(parents=True)
    git(dest, "init", "-q", "-b", "main")
    if full:
        shutil.copytree(tree, dest / "megatron")
    else:
        for rel in (LINEAR, ATTENTION, PACKAGE_INFO):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(tree.parent / rel, dest / rel)
    (dest / "README.md").write_text("Megatron-LM (fork)\n")
    (dest / "pretrain_gpt.py").write_text("# entry point of the fork\n")
    _commit_all(dest, "upstream: megatron-core import")
    _fast_history(dest, "main", history, start=time.time() - history * 3600 * 7 - 86400)
    git(dest, "checkout", "-q", "-f", "main")

    git(dest, "checkout", "-q", "-b", "quant")
    stock_linear = (tree.parent / LINEAR).read_text(encoding="utf-8")
    stock_attention = (tree.parent / ATTENTION).read_text(encoding="utf-8")
    linear = fork_linear(stock_linear, layout)
    attention = fork_attention(stock_attention, layout)
    if chains:
        linear = fork_chains(linear, layout.quote)
        attention = fork_chains(attention, layout.quote)
        (dest / FORK_QUANT).write_text(FORK_QUANT_SOURCE, encoding="utf-8")
    # the fork's first try: sites flipped with sed, which once committed a bare 'hifp8' line
    lines = attention.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("custom_quant_type ="))
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    broken = "".join([*lines[:at], f"{indent}'hifp8'\n", *lines[at + 1 :]])
    (dest / ATTENTION).write_text(broken, encoding="utf-8")
    (dest / LINEAR).write_text(linear, encoding="utf-8")
    _commit_all(dest, "quant: switch attention to hifp8 (sed)")
    (dest / ATTENTION).write_text(attention, encoding="utf-8")
    _commit_all(dest, "quant: fix the sed edit")
    (dest / SAVER).write_text(FORK_SAVER_SOURCE, encoding="utf-8")
    (dest / TRAINING).parent.mkdir(parents=True, exist_ok=True)
    (dest / TRAINING).write_text(FORK_TRAINING_SOURCE, encoding="utf-8")
    (dest / "megatron/training/__init__.py").write_text("")
    write_parser(dest, version=None)  # megatron/training/arguments.py of the real shape
    info = (tree.parent / PACKAGE_INFO).read_text(encoding="utf-8")
    (dest / PACKAGE_INFO).write_text(package_info(info), encoding="utf-8")  # 0.15.0rc3
    _commit_all(dest, "quant: tensor saver, training hooks, megatron 0.15.0rc3")
    git(dest, "branch", "dev")
    return Fork(dest, history)


def clone_quant(fork: Fork, dest: Path) -> Path:
    """The user's checkout: ``git clone -b quant <origin>``, with a committer identity."""
    subprocess.run(
        ["git", "clone", "-q", "-b", "quant", str(fork.origin), str(dest)],
        check=True,
        capture_output=True,
    )
    git(dest, "config", "user.name", "Researcher")
    git(dest, "config", "user.email", "researcher@lab.invalid")
    return dest


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")
