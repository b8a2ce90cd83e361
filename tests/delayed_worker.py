"""Delayed scaling across processes, on CPU, against an ``init``ed checkout whose linear sites
hold ``fp8-delayed`` (first on PYTHONPATH): a ColumnParallelLinear -> GELU ->
RowParallelLinear pair trained with Adam.

    python delayed_worker.py OUT.pt dist         # two ranks over gloo: DP 2, TP 2, DP 2 with
                                                 # tp_only_amax_red; per layer and step each
                                                 # rank's own amaxes and the history's
    python delayed_worker.py OUT.pt run 6        # one process, 6 steps, uninterrupted
    python delayed_worker.py OUT.pt save 3 CKPT  # 3 steps, then the layers' and Adam's state
    python delayed_worker.py OUT.pt resume 6 CKPT  # a fresh process: load, steps 4..6

Every mode writes, per step, the loss, the output and each layer's scales and history.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _layers(tp_only: bool = False, tp_group: Any = None) -> tuple[Any, Any]:
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    size = 1 if tp_group is None else dist.get_world_size(tp_group)
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=size, use_cpu_initialization=True, params_dtype=torch.float32
    )
    cfg.tp_only_amax_red = tp_only  # type: ignore[attr-defined]  # TransformerConfig's flag
    cfg.fp8_amax_history_len = 4  # type: ignore[attr-defined]
    cfg.fp8_amax_compute_algo = "max"  # type: ignore[attr-defined]

    def init(w: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(w, std=0.2)

    torch.manual_seed(7)
    extra = {} if tp_group is None else {"tp_group": tp_group}
    col = ColumnParallelLinear(
        16, 24, config=cfg, init_method=init, bias=False, gather_output=False, **extra
    )
    row = RowParallelLinear(
        24, 16, config=cfg, init_method=init, bias=False, input_is_parallel=True,
        skip_bias_add=True, **extra,
    )  # fmt: skip
    return col, row


def _step(col: Any, row: Any, opt: Any, step: int, rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 2, 16, generator=gen) * (1.0 + step + 3 * rank)
    target = torch.randn(4, 2, 16, generator=gen)
    opt.zero_grad()
    y, _ = row(torch.nn.functional.gelu(col(x)[0]))
    loss = ((y - target) ** 2).mean()
    loss.backward()
    opt.step()
    return {
        "loss": float(loss),
        "out": y.detach().clone(),
        "scales": [m.fp8_delayed.scale.clone() for m in (col, row)],
        "history": [m.fp8_delayed.amax_history.clone() for m in (col, row)],
    }


def _single(mode: str, steps: int, ckpt: str | None) -> list[dict[str, Any]]:
    from quantpatch.runtime.megatron_single import init_single_process

    init_single_process("cpu")
    col, row = _layers()
    opt = torch.optim.Adam([*col.parameters(), *row.parameters()], lr=1e-2)
    first = 0
    if mode == "resume":
        assert ckpt is not None
        state = torch.load(ckpt)
        col.load_state_dict(state["col"])
        row.load_state_dict(state["row"])
        opt.load_state_dict(state["opt"])
        first = state["steps"]
    out = [_step(col, row, opt, s, 0) for s in range(first, steps)]
    if mode == "save":
        assert ckpt is not None
        state = {"col": col.state_dict(), "row": row.state_dict(), "opt": opt.state_dict()}
        torch.save({**state, "steps": steps}, ckpt)
    sharded = {
        key: (type(sh).__name__, tuple(sh.global_shape), sh.replica_id)
        for key, sh in col.sharded_state_dict(prefix="col.").items()
        if "fp8_delayed" in key
    }
    return [*out, {"sharded": sharded}]


def _distributed(rank: int, port: int, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.quantpatch import quantpatch_delayed as qd

    log: list[tuple[int, dict[int, float]]] = []
    record = qd.DelayedState._record

    def spy(self: Any, amaxes: dict[int, torch.Tensor]) -> None:
        log.append((id(self), {c: float(a) for c, a in amaxes.items()}))
        record(self, amaxes)

    qd.DelayedState._record = spy  # type: ignore[method-assign]
    results = {}
    for label, tp, tp_only in (("dp2", 1, False), ("tp2", 2, False), ("dp2_tp_only", 1, True)):
        parallel_state.initialize_model_parallel(tp, 1)
        group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        col, row = _layers(tp_only, group)
        names = {id(col.fp8_delayed): "col", id(row.fp8_delayed): "row"}
        opt = torch.optim.Adam([*col.parameters(), *row.parameters()], lr=1e-2)
        log.clear()
        steps = []
        for s in range(3):
            before = len(log)
            step = _step(col, row, opt, s, rank)
            step["local"] = [(names[i], a) for i, a in log[before:]]
            steps.append(step)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, steps)
        results[label] = gathered
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(results, path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    out_path, mode = sys.argv[1], sys.argv[2]
    if mode == "dist":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(_distributed, args=(free_port, out_path), nprocs=2, join=True)
    else:
        n = int(sys.argv[3])
        torch.save(_single(mode, n, sys.argv[4] if len(sys.argv) > 4 else None), out_path)
