"""ParetoQ steps under tensor parallelism, on CPU: two processes (gloo), each building a small
ColumnParallelLinear -> GELU -> RowParallelLinear twice from the same seed, once over a TP
group of both ranks (TP = 2) and once over a group of its own rank (TP = 1), then training
both a few Adam steps on the same data. Run against an ``init``ed checkout whose linear sites
hold a ParetoQ value (first on PYTHONPATH):

    python paretoq_tp_worker.py OUT.pt [GROUPED_VALUE]

``GROUPED_VALUE`` (e.g. ``w4g4``) gives the layers of a second pair of models that step
instead of the sites' value. Rank 0 writes OUT.pt: per model, the quantized weights at the
first forward and the steps after initialisation and after training, gathered across ranks,
each rank's Row step, the sharded-checkpoint metadata of the steps, and a state_dict round
trip (steps kept, not re-initialised).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3


def _models(fmt: str | None, group, rank: int, size: int):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.quantpatch import quantpatch_ops
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cfg = ModelParallelConfig(
        tensor_model_parallel_size=size, use_cpu_initialization=True, params_dtype=torch.float32
    )

    def init(w):
        return torch.nn.init.normal_(w, std=0.2)

    torch.manual_seed(7)
    col = ColumnParallelLinear(
        16, 24, config=cfg, init_method=init, bias=False, gather_output=False, tp_group=group
    )
    row = RowParallelLinear(
        24,
        16,
        config=cfg,
        init_method=init,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
        tp_group=group,
    )
    if fmt is not None:  # the same layers with another value's step
        quantpatch_ops.add_weight_scales(col, fmt, partition_dim=0)
        quantpatch_ops.add_weight_scales(row, fmt, partition_dim=1)
    return col, row


def _gather(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    if size == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _run(fmt: str | None, group, rank: int, size: int) -> dict:
    from megatron.core.quantpatch import quantpatch_ops

    col, row = _models(fmt, group, rank, size)
    opt = torch.optim.Adam([*col.parameters(), *row.parameters()], lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 16, generator=gen)
    target = torch.randn(4, 2, 16, generator=gen)
    out: dict = {}
    for step in range(STEPS):
        opt.zero_grad()
        y, _ = row(torch.nn.functional.gelu(col(x)[0]))
        loss = ((y - target) ** 2).mean()
        loss.backward()
        if step == 0:
            out["wq_col"] = _gather(
                quantpatch_ops.paretoq_quantize(
                    col.weight, col.weight_alpha, col.weight_alpha_format
                ),
                0,
                group,
                size,
            )
            row_dim = 1
            out["wq_row"] = _gather(
                quantpatch_ops.paretoq_quantize(
                    row.weight, row.weight_alpha, row.weight_alpha_format
                ),
                row_dim,
                group,
                size,
            )
            out["alpha_col_init"] = _gather(col.weight_alpha, 0, group, size)
            out["alpha_row_init"] = _row_alpha(row, group, size)
            out["loss0"] = float(loss)
        opt.step()
    out["alpha_col"] = _gather(col.weight_alpha, 0, group, size)
    out["alpha_row"] = _row_alpha(row, group, size)
    out["alpha_row_ranks"] = _gather(row.weight_alpha, 0, group, size)
    out["sharded"] = {
        name: (tuple(sh.global_shape), tuple(sh.global_offset), sh.replica_id)
        for layer, pre in ((col, "col."), (row, "row."))
        for name, sh in layer.sharded_state_dict(prefix=pre).items()
        if name.endswith("weight_alpha")
    }
    # a state_dict round trip: the trained step comes back, and is not re-initialised
    state = col.state_dict()
    fresh, _ = _models(fmt, group, rank, size)
    fresh.load_state_dict(state)
    fresh(x)
    out["reloaded_equal"] = bool(torch.equal(fresh.weight_alpha, col.weight_alpha))
    out["flag"] = int(fresh.weight_alpha_initialized)
    return out


def _row_alpha(row, group, size: int) -> torch.Tensor:
    """Row's step as TP = 1 holds it: whole per row, or its groups gathered along columns."""
    if row.weight_alpha_tp_axis is None:
        return row.weight_alpha.detach().clone()
    return _gather(row.weight_alpha, 1, group, size)


def _body(rank: int, port: int, path: str, grouped: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(2, 1)
    both = dist.new_group([0, 1])
    alone = [dist.new_group([r]) for r in (0, 1)][rank]
    results = {}
    for label, fmt in (("sites", None), ("grouped", grouped)):
        if label == "grouped" and grouped is None:
            continue
        results[label] = {"tp2": _run(fmt, both, rank, 2), "tp1": _run(fmt, alone, 0, 1)}
    if rank == 0:
        torch.save(results, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_body, args=(free, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None), nprocs=2)
