"""The BF16 layer policy's runtime (``quantpatch_layers``), driven in-process on a stand-in of
Megatron's ``TransformerLayer``: which layer a forward and a backward GEMM belong to, and which
of them the policy keeps in BF16. (The installed copy runs inside Megatron in other tests'
subprocesses, which coverage of ``quantpatch/runtime`` does not see.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from quantpatch.runtime import quantpatch_layers as layers  # noqa: E402


class _Gemm(torch.autograd.Function):
    """A product that asks the policy in its forward (fprop) and its backward (dgrad)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        layers.keeps_bf16("fprop")
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        layers.keeps_bf16("dgrad")
        return grad * 2.0


class TransformerLayer(torch.nn.Module):
    """Megatron's class name, its global ``layer_number`` and ``config.num_layers``."""

    def __init__(self, number: int, total: int) -> None:
        super().__init__()
        self.layer_number = number
        self.config = SimpleNamespace(num_layers=total)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Gemm.apply(x), None


@pytest.fixture
def policy():
    layers.uninstall()
    yield layers
    layers.uninstall()


def test_each_gemm_is_counted_in_its_layer_and_the_policy_keeps_its_layers(policy):
    model = [TransformerLayer(n, 4) for n in (1, 2, 3, 4)]
    policy.install("first:1,last:1")
    assert policy.bf16_layers() is None  # resolved when the first layer runs
    x = torch.ones(3, requires_grad=True)
    h = x
    for layer in model:
        h = layer(h)[0]
    assert policy.bf16_layers() == frozenset({1, 4})
    assert policy.current_layer() is None
    out = _Gemm.apply(h)  # the output layer: outside every transformer layer, never kept
    out.sum().backward()
    counts = policy.product_counts()
    assert counts == {
        "None/dgrad:quantized": 1,
        "None/fprop:quantized": 1,
        "1/dgrad:bf16": 1,
        "1/fprop:bf16": 1,
        "2/dgrad:quantized": 1,
        "2/fprop:quantized": 1,
        "3/dgrad:quantized": 1,
        "3/fprop:quantized": 1,
        "4/dgrad:bf16": 1,
        "4/fprop:bf16": 1,
    }
    policy.reset_counts()
    assert policy.product_counts() == {}


def test_a_new_policy_replaces_the_old_and_uninstall_forgets_it(policy):
    policy.install("recipe")
    model = [TransformerLayer(n, 62) for n in range(1, 63)]
    h = torch.ones(1, requires_grad=True)
    for layer in model:
        h = layer(h)[0]
    assert policy.bf16_layers() == frozenset({1, 2, *range(55, 63)})
    policy.install("2-3")
    for layer in model[:3]:
        layer(torch.ones(1))
    assert policy.bf16_layers() == frozenset({2, 3})
    policy.uninstall()
    assert policy.bf16_layers() is None and not policy.keeps_bf16("wgrad")


def test_the_grammar():
    assert layers.parse("first:2, last:8,5,7-9,recipe") == [
        ("first", 2, 0), ("last", 8, 0), ("range", 5, 5), ("range", 7, 9), ("recipe", 0, 0),
    ]  # fmt: skip
    assert layers.resolve("first:2,last:1,10-40", 12) == frozenset({1, 2, 10, 11, 12})
    assert layers.recipe_counts(16) == (1, 2) and layers.recipe_counts(2) == (1, 1)
    for bad, said in (("middle:3", "'middle:3' is not first:N"), ("9-3", "runs backwards")):
        with pytest.raises(ValueError, match=said):
            layers.parse(bad)
