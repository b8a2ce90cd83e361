"""Run Megatron's tensor-parallel linear autograd function forward and backward on CPU and
save the three GEMM results (forward output, input gradient, weight gradient).

Usage (inside a checkout, with the checkout first on PYTHONPATH):
    python linear_probe.py OUT.pt [TOKENS HIDDEN_IN HIDDEN_OUT] [--weights FMT] [--delayed FMT]

``--weights`` names a ParetoQ value (``w2``, ...): the weight is quantized first with the
checkout's ops and the step the layer's first forward takes, as Column/RowParallelLinear do
before they call the linear function (which leaves the operands as they are for that value).
``--delayed`` names a delayed-scaling value (``fp8-delayed``, ...): the weight gets a layer's
amax history and scales, one step fills them, and the second step on the same inputs (scaled
from the first one's amaxes; the weight written in place between them, as an optimizer step
would, so it is quantized anew) is the one saved.

torch and the standard library only; the inputs are seeded so that runs of different sources
(one per quantization format) see identical tensors. Used by ``quantpatch demo``.
"""

from __future__ import annotations

import inspect
import sys

import torch


def run(
    tokens: int = 256,
    hidden_in: int = 512,
    hidden_out: int = 512,
    seed: int = 0,
    *,
    weights: str | None = None,
    delayed: str | None = None,
) -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication as Linear,
    )

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 1, hidden_in, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(hidden_out, hidden_in, generator=gen) * hidden_in**-0.5
    w = w.to(torch.bfloat16).requires_grad_()
    grad_y = torch.randn(tokens, 1, hidden_out, generator=gen).to(torch.bfloat16)
    # the argument list differs between megatron-core releases: fill it by name
    values = {
        "bias": None,
        "gradient_accumulation_fusion": False,
        "allreduce_dgrad": False,
        "async_grad_allreduce": False,
        "sequence_parallel": False,
        "grad_output_buffer": None,
        "wgrad_deferral_limit": 0,
        "tp_group": None,
    }
    names = list(inspect.signature(Linear.forward).parameters)[3:]  # after ctx, input, weight
    wq = w
    if weights is not None:
        from megatron.core.quantpatch import quantpatch_ops as ops

        wq = ops.paretoq_weight(w, ops.paretoq_init_alpha(w, weights), weights)
    if delayed is not None:  # a layer's state for the weight, filled by one step
        from megatron.core.quantpatch import quantpatch_ops as ops

        layer = torch.nn.Module()
        layer.weight = w
        ops.add_delayed_state(layer, delayed)
        Linear.apply(x, wq, *(values[n] for n in names)).backward(grad_y)
        x.grad = w.grad = None
        with torch.no_grad():  # as an optimizer step would: the weight is quantized anew
            w.mul_(1)
    y = Linear.apply(x, wq, *(values[n] for n in names))
    y.backward(grad_y)
    assert x.grad is not None and w.grad is not None
    return {"forward": y.detach(), "dgrad": x.grad, "wgrad": w.grad}


if __name__ == "__main__":
    args = sys.argv[2:]
    named: dict[str, str | None] = {"--weights": None, "--delayed": None}
    for flag in named:
        if flag in args:
            i = args.index(flag)
            named[flag] = args[i + 1]
            del args[i : i + 2]
    sizes = [int(a) for a in args[:3]]
    torch.save(run(*sizes, weights=named["--weights"], delayed=named["--delayed"]), sys.argv[1])
