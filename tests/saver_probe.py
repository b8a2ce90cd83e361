"""Train a tiny GPTModel (megatron-core local spec) of a checkout on CPU for a few
micro-steps (subprocess helper for the tests).

Usage: PYTHONPATH=<checkout> python saver_probe.py OUT.pt MICRO_STEPS

Saves the losses, every parameter gradient and, captured by module hooks, the output layer's
input, weight and output gradient (to compare with what the tensor saver wrote). It never calls
the saver's flush(): files must be complete through its exit handler alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(out_path: str, micro_steps: int) -> None:
    from quantpatch.runtime.megatron_single import init_single_process

    init_single_process("cpu")
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32)
    captured: dict[str, list[torch.Tensor]] = {"input": [], "grad_output": []}
    model.output_layer.register_forward_pre_hook(
        lambda m, args: captured["input"].append(args[0].detach().clone())
    )

    def grad_of_output(module, args, out) -> None:  # the gradient arriving at the output
        out[0].register_hook(lambda g: captured["grad_output"].append(g.detach().clone()))

    model.output_layer.register_forward_hook(grad_of_output)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(micro_steps):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        pos = torch.arange(16).expand(2, 16)
        mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), 1)
        loss = model(ids, pos, mask, labels=ids).float().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.save(
        {
            "losses": torch.stack(losses),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "output_input": captured["input"],
            "output_grad": captured["grad_output"],
            "output_weight": (  # its own weight, or the embedding's when tied
                model.output_layer.weight
                if model.output_layer.weight is not None
                else model.shared_embedding_or_output_weight()
            )
            .detach()
            .clone(),
        },
        out_path,
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
