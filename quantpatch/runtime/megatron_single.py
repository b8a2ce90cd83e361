"""Run megatron-core in a single process, on one GPU or on the CPU.

Used by the tests' probes and the benchmarks (torch only). On CUDA it sets up Megatron's own
RNG tracker; on CPU it replaces the two CUDA-only pieces that DotProductAttention needs: the
global memory buffer (allocated on ``torch.cuda.current_device()``) becomes a CPU buffer filled
with NaN, so any read of it shows (baddbmm with beta=0 must never read it), and the CUDA RNG
tracker's ``fork()`` becomes a no-op (run with dropout 0).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


class _CpuBuffer:
    def get_tensor(self, shape: Any, dtype: torch.dtype, name: str) -> torch.Tensor:
        return torch.full(tuple(shape), float("nan"), dtype=dtype)


class _NoFork:
    def fork(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def init_single_process(
    device: str = "cpu",
    seed: int = 1234,
    *,
    rank: int = 0,
    pipeline: int = 1,
    init_method: str = "tcp://127.0.0.1:0",
) -> None:
    """One rank, tensor and pipeline parallel size 1, on ``device`` (cpu or cuda); or, with
    ``pipeline`` > 1, rank ``rank`` of that many pipeline stages (one process each, gloo on
    CPU, meeting at ``init_method``)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=pipeline,
    )
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import dot_product_attention

    parallel_state.initialize_model_parallel(1, pipeline)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    parallel_state.get_global_memory_buffer = lambda: _CpuBuffer()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoFork()
    dot_product_attention.tensor_parallel.get_cuda_rng_tracker = (
        tensor_parallel.get_cuda_rng_tracker
    )
