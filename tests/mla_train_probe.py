"""Train a tiny model of DeepSeek-V2-Lite's structure a few steps on CPU with the checkout's own
megatron-core (first on PYTHONPATH) and the local layers, counting the quant ops' products.

The structure: Multi-Latent Attention with a low-rank KV projection (``kv_lora_rank``), Q
projected at full rank (``q_lora_rank`` None, as in V2-Lite) or low-rank, separate YaRN rope
head dims (``qk_pos_emb_head_dim``), so that the Q/K head dim differs from the V head dim; MoE
layers (softmax top-k) with a shared expert; the first layer dense
(``moe_layer_freq``). Every call of ``quantpatch_ops.quant_matmul`` /
``quant_baddbmm`` / ``quant_bmm`` (what a site hands a product to when its value is not
bf16) and of a fork's own ``fork_quant.matmul`` / ``baddbmm`` / ``bmm`` (what its own
dispatch chains call for the values they know) is counted with the format it was given and
its direction, so the test sees which sites were taken.

Usage: ``python mla_train_probe.py '<json cfg>'``; prints one JSON line: ``losses``,
``calls`` (``"<module>.<product> <forward|backward> <fmt>"`` -> count), ``core_attention``
(the head dims the local ``DotProductAttention`` was built with) and ``layers`` (each layer's
MLP class, ``+ shared`` with a shared expert).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

import torch


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from quantpatch.runtime.megatron_single import init_single_process

    init_single_process("cpu")
    # MLA's rotary embeddings put their frequencies on torch.cuda.current_device() (they take
    # no use_cpu_initialization): on this CPU run, that device is the CPU
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    from megatron.core.transformer.moe import moe_utils

    # without Transformer Engine, megatron-core 0.13.1's router GEMM tests a name it never
    # defined (te_general_gemm is imported only with TE): None selects its own torch.mm path
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.quantpatch import quantpatch_ops
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    calls: Counter[str] = Counter()

    def counted(module: Any, name: str) -> None:
        real = getattr(module, name)
        label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            gradient = "grad_output" in (kwargs.get("roles") or ()) or kwargs.get("backward")
            way = "backward" if gradient else "forward"
            calls[f"{label} {way} {kwargs.get('fmt')}"] += 1
            return real(*args, **kwargs)

        setattr(module, name, wrapper)

    for name in ("quant_matmul", "quant_baddbmm", "quant_bmm"):
        counted(quantpatch_ops, name)
    try:  # a fork's own quantizers, which its dispatch chains call for the values they know
        from megatron.core import fork_quant  # type: ignore[attr-defined]
    except ImportError:
        pass
    else:
        for name in ("matmul", "baddbmm", "bmm"):
            counted(fork_quant, name)

    torch.manual_seed(0)
    tc = MLATransformerConfig(
        num_layers=cfg["layers"],
        hidden_size=cfg["hidden"],
        ffn_hidden_size=cfg["ffn"],
        num_attention_heads=cfg["heads"],
        q_lora_rank=cfg["q_lora_rank"],
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_head_dim=cfg["qk_head_dim"],
        qk_pos_emb_head_dim=cfg["qk_pos_emb_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_type="yarn",
        rotary_scaling_factor=40.0,
        mscale=0.707,
        mscale_all_dim=0.707,
        max_position_embeddings=cfg["seq"] * 4,
        normalization="RMSNorm",
        num_moe_experts=cfg["experts"],
        moe_router_topk=cfg["topk"],
        moe_ffn_hidden_size=cfg["moe_ffn"],
        moe_shared_expert_intermediate_size=cfg["moe_ffn"],
        moe_layer_freq=[0] + [1] * (cfg["layers"] - 1),  # the first layer dense
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_token_dispatcher_type="allgather",  # the all-to-all one takes a CUDA stream
        moe_router_score_function="softmax",
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gated_linear_unit=True,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    gpt = GPTModel(
        tc,
        spec,
        vocab_size=cfg["vocab"],
        max_sequence_length=cfg["seq"],
        position_embedding_type="rope",
    )
    model = Float16Module(tc, gpt)
    attention = gpt.decoder.layers[0].self_attention.core_attention
    built = {
        "core_attention": [
            type(attention).__module__ + "." + type(attention).__name__,
            attention.hidden_size_per_attention_head,
            attention.hidden_size_per_partition,
        ],
        "layers": [
            type(layer.mlp).__name__
            + (" + shared" if getattr(layer.mlp, "shared_experts", None) is not None else "")
            for layer in gpt.decoder.layers
        ],
        "attention": type(gpt.decoder.layers[0].self_attention).__name__,
    }
    opt = torch.optim.Adam(model.parameters(), lr=cfg.get("lr", 3e-3))
    gen = torch.Generator().manual_seed(1)
    # a learnable stream: a short pattern repeated, so the loss falls within a few steps
    pattern = torch.randint(0, cfg["vocab"], (cfg["seq"] // 4,), generator=gen)
    data = pattern.repeat(cfg["batch"], 5)[:, : cfg["seq"] + 1]
    pos = torch.arange(cfg["seq"]).expand(cfg["batch"], cfg["seq"])
    mask = torch.triu(torch.ones(1, 1, cfg["seq"], cfg["seq"], dtype=torch.bool), 1)
    losses = []
    for _ in range(cfg["steps"]):
        opt.zero_grad()
        loss = model(data[:, :-1], pos, mask, labels=data[:, 1:]).float().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    print(json.dumps({"losses": losses, "calls": dict(calls), **built}))


if __name__ == "__main__":
    main()
