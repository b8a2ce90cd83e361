"""Run an initialised checkout's real DotProductAttention on CPU, through the flash route and
through the unfused path (subprocess helper for tests/test_flash_attention.py).

Usage: PYTHONPATH=<checkout> TRITON_INTERPRET=1 python flash_probe.py OUT.pt [bf16]

The layer: bf16, 2 query heads sharing 1 key/value head, causal, layer 3 with
``apply_query_key_layer_scaling`` (so the softmax scales the scores by 3 and ``softmax_scale``
is divided by 3), 40 tokens (not a multiple of the kernel's 32-token blocks). It runs once with
``QUANTPATCH_FLASH=1`` (the interpreter runs the kernels on CPU tensors) and once with
``QUANTPATCH_FLASH=0``, with the data loader's causal mask (and, flash only, with no mask:
Megatron makes its default mask on "cuda"); each time it
records the output, the input gradients, how often the flash route ran and how often the
layer asked Megatron's memory buffer for its ``[b * np, sq, sk]`` scores. With ``bf16`` (a
checkout whose Q.K^T is bf16) it runs with ``QUANTPATCH_FLASH_BF16=1`` (``mask_bf16``) and
without (``mask_stock``), also counting the calls of ``flash_eligible``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))


def main(out_path: str, mode: str = "") -> None:
    from quantpatch.runtime import megatron_single

    megatron_single.init_single_process("cpu")
    from megatron.core import parallel_state
    from megatron.core.quantpatch import quantpatch_ops
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    counts = {"flash": 0, "buffer": 0, "asked": 0}
    flash = quantpatch_ops.flash_dot_product_attention
    eligible = quantpatch_ops.flash_eligible

    def counted_eligible(*args, **kwargs):
        counts["asked"] += 1
        return eligible(*args, **kwargs)

    buffer = parallel_state.get_global_memory_buffer

    def counted_flash(*args, **kwargs):
        counts["flash"] += 1
        return flash(*args, **kwargs)

    def counted_buffer():
        counts["buffer"] += 1
        return buffer()

    quantpatch_ops.flash_dot_product_attention = counted_flash
    quantpatch_ops.flash_eligible = counted_eligible
    dpa.parallel_state.get_global_memory_buffer = counted_buffer

    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=16,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        bf16=True,
        apply_query_key_layer_scaling=True,
        masked_softmax_fusion=False,
    )
    attn = dpa.DotProductAttention(
        cfg, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )
    sq, b, heads, groups, dim = 40, 1, 2, 1, 16
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sq, b, heads, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(sq, b, groups, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(sq, b, groups, dim, generator=gen).to(torch.bfloat16)
    grad = torch.randn(sq, b, heads * dim, generator=gen).to(torch.bfloat16)
    causal_mask = torch.triu(torch.ones(b, 1, sq, sq, dtype=torch.bool), diagonal=1)
    results: dict[str, object] = {"q": q, "k": k, "v": v, "grad": grad}
    results["softmax_scale"] = attn.softmax_scale
    results["coeff"] = attn.scale_mask_softmax.scale
    # Megatron builds the default causal mask on "cuda", so the unfused path runs with the
    # data loader's mask only: on CPU, with no mask, it cannot run
    runs = (("1", "mask", causal_mask), ("1", "nomask", None), ("0", "mask", causal_mask))
    if mode == "bf16":
        runs = (("bf16", "mask", causal_mask), ("stock", "mask", causal_mask))
    for flash_mode, name, mask in runs:
        os.environ["QUANTPATCH_FLASH"] = "0" if flash_mode == "0" else "1"
        os.environ["QUANTPATCH_FLASH_BF16"] = "1" if flash_mode == "bf16" else "0"
        if True:
            counts.update(flash=0, buffer=0, asked=0)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attn(*leaves, attention_mask=mask)
            out.backward(grad)
            key = f"{name}_{flash_mode}"
            results[key] = {
                "out": out.detach(),
                "dq": leaves[0].grad,
                "dk": leaves[1].grad,
                "dv": leaves[2].grad,
                **counts,
            }
    torch.save(results, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
