"""Run a fork checkout's own tensor-saver call sites against the module installed there
(subprocess helper for the tests): ``train_step_hook`` of its ``megatron/training/training.py``,
and calls in the fork's API (keywords ``phase``/``component``/``rank``/``attention_weights``,
its positional order, ``get_tensor_saver().save_tensor``).

Usage: PYTHONPATH=<checkout> python saver_fork_probe.py OUT.pt

Saves what each call returned and the tensors handed over, to compare with the files.
"""

from __future__ import annotations

import sys

import torch


def main(out_path: str) -> None:
    from megatron.core import tensor_saver
    from megatron.core.tensor_saver import (
        get_tensor_saver,
        save_attention_tensors,
        save_linear_tensors,
        save_tensor,
    )
    from megatron.training.training import train_step_hook

    enabled = train_step_hook(7)
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 2, 8) for _ in range(3))
    probs = torch.rand(4, 4, 4)
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    returned = {
        "attention": save_attention_tensors(
            query=q,
            key=k,
            value=v,
            quant_type="hifp8",
            operation="forward",
            layer_idx=3,
            phase="pre",
            component="FA",
            attention_weights=probs,
        ),
        "linear": save_linear_tensors(
            input_tensor=x,
            weight=w,
            quant_type="mxfp8",
            operation="forward",
            layer_idx=None,
            phase="pre",
            component="linear",
        ),
        # the same tensors again, as an inserted call hands them over: saved once
        "again": save_linear_tensors(x, w, "mxfp8", "forward"),
        # the fork's positional order: ..., layer_idx, phase, component, rank, metadata
        "positional": save_tensor(
            x, "linear", "backward", "mxfp4", "grad_output", 2, "post", "linear", 0, {"n": 1}
        ),
        "method": get_tensor_saver().save_tensor(w, "linear", "forward", "bf16", "weight", 4),
    }
    torch.save(
        {
            "enabled": enabled,
            "iteration": get_tensor_saver().iteration,
            "returned": returned,
            "tensors": {"query": q, "key": k, "value": v, "probs": probs, "x": x, "w": w},
            "report": tensor_saver.flush(),
        },
        out_path,
    )


if __name__ == "__main__":
    main(sys.argv[1])
