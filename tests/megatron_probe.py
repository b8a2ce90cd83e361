"""Run the real Megatron code of a checkout on CPU (subprocess helper for the tests).

Usage: PYTHONPATH=<checkout> python megatron_probe.py OUT.pt

Saves the linear autograd function's three GEMM results (forward, input grad, weight grad)
with their inputs, and DotProductAttention's output and input gradients. Megatron allocates
its attention buffer with torch.cuda.current_device() and forks a CUDA RNG tracker; on CPU
the buffer becomes plain uninitialised torch.empty memory (exactly what beta=0 must never
read) and the fork a no-op (dropout is 0).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))


def main(out_path: str) -> None:
    from quantpatch.runtime.linear_probe import run as run_linear

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)

    class CpuBuffer:
        def get_tensor(self, shape, dtype, name):
            return torch.full(shape, float("nan"), dtype=dtype)  # garbage, never to be read

    class NoFork:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

    parallel_state.get_global_memory_buffer = lambda: CpuBuffer()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoFork()
    dpa.tensor_parallel.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker

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
