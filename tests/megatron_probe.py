"""Run the real Megatron code of a checkout on CPU (subprocess helper for the tests).

Usage: PYTHONPATH=<checkout> python megatron_probe.py OUT.pt

Saves the linear autograd function's three GEMM results (forward, input grad, weight grad)
with their inputs, and DotProductAttention's output and input gradients (on CPU, see
quantpatch.runtime.megatron_single).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))


def main(out_path: str) -> None:
    from quantpatch.runtime.linear_probe import run as run_linear
    from quantpatch.runtime.megatron_single import init_single_process

    init_single_process("cpu")
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    results = {f"linear_{k}": v for k, v in run_linear(64, 96, 80).items()}
    gen = torch.Generator().manual_seed(1)
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=128,
        num_attention_heads=4,
        use_cpu_initialization=True,
        attention_dropout=0.0,
    )
    attn = dpa.DotProductAttention(
        cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    sq, b, heads, dim = 48, 2, 4, 32
    q, k, v = (torch.randn(sq, b, heads, dim, generator=gen).requires_grad_() for _ in range(3))
    mask = torch.triu(torch.ones(1, 1, sq, sq, dtype=torch.bool), diagonal=1)
    out = attn(q, k, v, attention_mask=mask)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    results.update(
        {
            "attn_out": out.detach(),
            "attn_dq": q.grad,
            "attn_dk": k.grad,
            "attn_dv": v.grad,
            "attn_q": q.detach(),
            "attn_k": k.detach(),
            "attn_v": v.detach(),
        }
    )
    torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
