"""The BF16 layer policy: transformer layers whose linear GEMMs stay unquantized.

Installed by ``quantpatch init`` as ``megatron/core/quantpatch/quantpatch_layers.py``; torch and the
standard library only. The policy is a literal in the checkout's linear file (``init`` puts it
there; ``quantpatch set --bf16-layers`` writes it)::

    quantpatch_bf16_layers = 'first:2,last:8'
    if quantpatch_bf16_layers:
        from megatron.core.quantpatch import quantpatch_layers

        quantpatch_layers.install(quantpatch_bf16_layers)

Grammar (comma separated, any mix): ``first:N`` (layers 1..N), ``last:N`` (the last N layers
of the model), ``K`` or ``A-B`` (Megatron layer numbers, 1-based); ``recipe`` stands for NVIDIA's
proportion (arXiv 2509.25149: the first 2 and the last 8 of 62 blocks), scaled to the model:
``first:round(2 L / 62)``, ``last:round(8 L / 62)`` (at least one each); ``output`` keeps the
linear GEMMs outside every transformer layer in BF16 (the output layer: Megatron builds it as
a plain ``ColumnParallelLinear`` that TransformerEngine's recipes never quantize). The numbers are
Megatron's global ones (``TransformerLayer.layer_number``: the pipeline stage's and virtual
stage's offset included) and ``first``/``last`` are resolved against the model's layer count
(``config.num_layers``) when the first layer runs, so one policy means the same layers under
every parallel layout.

Which layer a GEMM belongs to: forward pre- and post-hooks on every module (registered once by
``install``) keep a stack of the transformer layers running, and a gradient hook on each
layer's output marks the start of that layer's backward (the engine computes a layer's output
gradient before any of its own backward GEMMs, and its input gradient after all of them). The
products of ``quantpatch_ops.quant_matmul`` (the linear role only: Q.K^T and P.V keep their
values) ask ``keeps_bf16()`` and run the plain PyTorch product in a policy layer, and outside
every transformer layer (the output layer) where the policy says ``output``. Dispatches that do not
hand the value to ``quantpatch_ops`` (a fork's own branches) cannot ask: ``quantpatch set``
refuses a policy on those.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch

_ITEM = re.compile(r"(first|last):([0-9]+)|([1-9][0-9]*)(?:-([1-9][0-9]*))?|recipe|output")
RECIPE = (2, 8, 62)
"""NVIDIA's 12 B model: the first 2 and the last 8 of its 62 blocks in BF16."""


def parse(spec: str) -> list[tuple[str, int, int]]:
    """The items of ``spec``: ``("first", n, 0)``, ``("last", n, 0)``, ``("range", a, b)``,
    ``("recipe", 0, 0)``, ``("output", 0, 0)``; ValueError naming a bad item."""
    items: list[tuple[str, int, int]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _ITEM.fullmatch(part)
        if m is None:
            raise ValueError(
                f"bf16 layers: {part!r} is not first:N, last:N, a layer number K, a range A-B, "
                "recipe or output"
            )
        if m.group(1):
            items.append((m.group(1), int(m.group(2)), 0))
        elif m.group(3):
            a = int(m.group(3))
            b = int(m.group(4) or a)
            if b < a:
                raise ValueError(f"bf16 layers: the range {part!r} runs backwards")
            items.append(("range", a, b))
        else:
            items.append((part, 0, 0))
    return items


def recipe_counts(num_layers: int) -> tuple[int, int]:
    """The recipe's (first, last) for a model of ``num_layers``: the paper's 2 and 8 of 62
    scaled and rounded (half up), at least one each, never the whole model (as
    ``quantpatch.base.config.recipe_layers``, which ``quantpatch list`` shows)."""
    first_n, last_n, of = RECIPE
    first = max(1, int(first_n * num_layers / of + 0.5))
    last = max(1, int(last_n * num_layers / of + 0.5))
    while first + last >= num_layers and last > 1:
        last -= 1
    return first, last


def resolve(spec: str, num_layers: int) -> frozenset[int]:
    """The layer numbers (1-based, global) ``spec`` keeps in BF16 in a model of
    ``num_layers`` layers (numbers beyond the model are dropped)."""
    out: set[int] = set()
    for kind, a, b in parse(spec):
        if kind == "output":
            continue  # not a transformer layer: keeps_output()
        if kind == "recipe":
            first, last = recipe_counts(num_layers)
            out |= set(range(1, first + 1)) | set(range(num_layers - last + 1, num_layers + 1))
        elif kind == "first":
            out |= set(range(1, a + 1))
        elif kind == "last":
            out |= set(range(max(1, num_layers - a + 1), num_layers + 1))
        else:
            out |= set(range(a, b + 1))
    return frozenset(n for n in out if 1 <= n <= num_layers)


class _State:
    def __init__(self) -> None:
        self.spec = ""
        self.layers: frozenset[int] | None = None  # resolved once the layer count is known
        self.output = False  # the GEMMs outside every transformer layer too
        self.stack: list[int] = []
        self.backward_layer: int | None = None
        self.hooks: list[Any] = []
        self.counts: Counter[tuple[int | None, str]] = Counter()


_STATE = _State()


_LAYER_TYPES: dict[type, bool] = {}


def _is_transformer_layer(module: torch.nn.Module) -> bool:
    """A Megatron ``TransformerLayer`` (or a subclass) with its global layer number; the
    class test is cached per type, since the hooks see every module's every call."""
    kind = type(module)
    found = _LAYER_TYPES.get(kind)
    if found is None:
        found = _LAYER_TYPES[kind] = any(c.__name__ == "TransformerLayer" for c in kind.__mro__)
    return found and isinstance(getattr(module, "layer_number", None), int)


def _pre(module: torch.nn.Module, args: Any) -> None:
    if not _is_transformer_layer(module):
        return
    number: int = module.layer_number  # type: ignore[assignment]
    if _STATE.layers is None:
        total = getattr(getattr(module, "config", None), "num_layers", None)
        if isinstance(total, int):
            _STATE.layers = resolve(_STATE.spec, total)
    _STATE.stack.append(number)
    _STATE.backward_layer = None  # a forward between backwards: no stale layer


def _mark(number: int) -> Any:
    def hook(grad: torch.Tensor) -> None:
        _STATE.backward_layer = number

    return hook


def _post(module: torch.nn.Module, args: Any, output: Any) -> None:
    if not _is_transformer_layer(module):
        return
    if _STATE.stack:
        number = _STATE.stack.pop()
        first = output[0] if isinstance(output, tuple | list) and output else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(_mark(number))  # type: ignore[no-untyped-call]


def install(spec: str) -> None:
    """Keep the linear GEMMs of the layers ``spec`` names in BF16 (see the module docstring);
    hooks are registered once per process, a new ``spec`` replaces the old."""
    items = parse(spec)  # a bad policy fails at import of the linear file, naming the item
    _STATE.spec = spec
    _STATE.layers = None
    _STATE.output = any(kind == "output" for kind, _, _ in items)
    if not _STATE.hooks:
        from torch.nn.modules import module as nn_module

        _STATE.hooks = [
            nn_module.register_module_forward_pre_hook(_pre),
            nn_module.register_module_forward_hook(_post),
        ]


def uninstall() -> None:
    for handle in _STATE.hooks:
        handle.remove()
    _STATE.__init__()  # type: ignore[misc]


def current_layer() -> int | None:
    """The transformer layer whose GEMM runs now (its global number), or None outside any."""
    if _STATE.stack:
        return _STATE.stack[-1]
    return _STATE.backward_layer


def bf16_layers() -> frozenset[int] | None:
    """The resolved policy (None until a transformer layer has run, or with no policy)."""
    return _STATE.layers if _STATE.spec else None


def keeps_bf16(gemm: str) -> bool:
    """Whether the GEMM running now (``fprop``, ``dgrad`` or ``wgrad``) stays in BF16: in a
    policy layer, or outside every transformer layer under ``output``; each call is counted
    per layer and GEMM (``product_counts``)."""
    layer = current_layer()
    if layer is None:
        keep = _STATE.output
    else:
        keep = bool(_STATE.spec) and _STATE.layers is not None and layer in _STATE.layers
    _STATE.counts[(layer, f"{gemm}:{'bf16' if keep else 'quantized'}")] += 1
    return keep


def product_counts() -> dict[str, int]:
    """``"<layer>/<gemm>:<bf16|quantized>" -> calls`` since the last reset."""
    return {f"{layer}/{what}": n for (layer, what), n in sorted(_STATE.counts.items(), key=str)}


def reset_counts() -> None:
    _STATE.counts.clear()
