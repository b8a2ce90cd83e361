"""NVFP4's per-tensor amax under tensor parallelism, on CPU: two processes (gloo), TP = 2 with
sequence parallelism, a ColumnParallelLinear -> GELU -> RowParallelLinear of an ``init``ed
checkout whose linear sites hold ``nvfp4`` (first on PYTHONPATH):

    python nvfp4_tp_worker.py OUT.pt

TransformerEngine 2.20.2 (``module/linear.py``, ``set_quantizer_amax_reduction_group``)
reduces the amax across the tensor-parallel group for the input of a column-parallel layer
under sequence parallelism (the input is all-gathered along the sequence) and for the output
gradient of a row-parallel one (all-gathered in the backward), and for nothing else: a
row-parallel layer's input and every weight shard take their own rank's amax. Each rank runs
the forward and computes, with ``quantpatch_ops``, the outputs TE's rule gives and the ones
the other rule would give (the column input's amax per sequence shard; the row input's and the
weights' amax over the group). Rank 0 writes OUT.pt: per rank, whether the layers' outputs
equal each.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

H, S = 64, 32  # hidden size, sequence length (16 tokens a rank)


def _nv(t: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    from megatron.core.quantpatch import quantpatch_ops

    return quantpatch_ops.nvfp4(t, -1, False, None, amax)


def _amax(t: torch.Tensor, group) -> torch.Tensor:
    a = t.detach().abs().amax().reshape(1).clone()
    dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a.reshape(())


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter(t: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty(t.shape[0] // 2, *t.shape[1:], dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
    return out


def _body(rank: int, port: int, path: str) -> None:
    # Megatron's sequence-parallel buffers are allocated on torch.cuda.current_device(): on a
    # CPU-only build they go to the CPU instead (the numerics do not depend on where)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    parallel_state.initialize_model_parallel(2, 1)
    group = parallel_state.get_tensor_model_parallel_group()
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(7)
    col = ColumnParallelLinear(
        H, H, config=cfg, init_method=torch.nn.init.normal_, bias=False, gather_output=False
    )
    row = RowParallelLinear(
        H,
        H,
        config=cfg,
        init_method=torch.nn.init.normal_,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    with torch.no_grad():  # shards whose amaxes differ: the rules give other values
        col.weight.mul_(8.0 if rank else 1.0)
        row.weight.mul_(1.0 if rank else 8.0)
    gen = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(S // 2, 1, H, generator=gen) * (64.0 if rank else 1.0)  # this rank's tokens
    with torch.no_grad():
        h = torch.nn.functional.gelu(col(x)[0])  # [S, 1, H / 2]: every token, half the features
        y, _ = row(h)  # [S / 2, 1, H]: this rank's tokens
        x_all = _gather(x, group)
        wc, wr = col.weight, row.weight
        # TE's rule: the column input's amax over the group (= over the gathered tensor), the
        # row input's and every weight shard's on their own rank
        te_col = torch.matmul(_nv(x_all, _amax(x, group)), _nv(wc).t())
        te_row = _reduce_scatter(torch.matmul(_nv(h), _nv(wr).t()), group)
        # the other rule: the column input's amax per sequence shard, the others over the group
        shard = _gather(_nv(x), group)
        other_col = torch.matmul(shard, _nv(wc, _amax(wc, group)).t())
        h_other = _nv(h, _amax(h, group))
        other_row = _reduce_scatter(torch.matmul(h_other, _nv(wr, _amax(wr, group)).t()), group)
        got_col = col(x)[0]
    out = {
        "col_is_te": bool(torch.equal(got_col, te_col)),
        "row_is_te": bool(torch.equal(y, te_row)),
        "col_is_other": bool(torch.equal(got_col, other_col)),
        "row_is_other": bool(torch.equal(y, other_row)),
        "x_amax_shard_differs": bool(x.abs().amax() != x_all.abs().amax()),
    }
    outs = [None, None]
    dist.all_gather_object(outs, out, group=group)
    if rank == 0:
        torch.save(outs, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_body, args=(free, sys.argv[1]), nprocs=2)
