"""The environment a sweep hands its launch scripts: what the sweep planned and recorded, never
what the submitting shell happens to export.

A generated script reads two kinds of variables (docs/launch.md, "Environment"):

* **owned**: the allocation, the layout, the model's data flags, the output folders, the
  attention path and the script's own switches. Run by hand, a script takes most of them from
  the environment (that is how one script serves several layouts); in a sweep they are the
  sweep's: it removes them from the environment it passes on and sets the ones it decided
  (``OWNED``). A Slurm script takes its allocation (GPUs per node, nodes, rendezvous host,
  port and id) from Slurm and its own plan, from any shell (``templates/pretrain.sh.j2``).
* **passed through**: what a user legitimately chooses per machine and what only tunes
  (``PASSED``, ``PASSED_PREFIXES``); a sweep passes them on and records their values in
  ``sweep.json`` (each run's ``env``), so the record says what ran.

Everything else (``PATH``, a module system's variables, a virtual environment) reaches the
runs untouched: it is how the runs find the training Python, not what they train.
"""

from __future__ import annotations

from collections.abc import Mapping

OWNED = (
    # the allocation and the rendezvous
    "GPUS_PER_NODE",
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RDZV_ID",
    "CUDA_VISIBLE_DEVICES",
    # the parallel layout and the batch
    "TP",
    "PP",
    "CP",
    "EP",
    "ETP",
    "VPP",
    "SEQUENCE_PARALLEL",
    "MICRO_BATCH_SIZE",
    "GLOBAL_BATCH_SIZE",
    # the model's tokenizer flags (the tokenizer's own files are passed through)
    "TOKENIZER_TYPE",
    "VOCAB_SIZE",
    # where the runs write and what they run
    "OUTPUT_ROOT",
    "CHECKPOINT_DIR",
    "TENSORBOARD_DIR",
    "LOG_DIR",
    "TENSOR_SAVE_DIR",
    "MEGATRON_ROOT",
    "QUANTPATCH",
    "QUANTPATCH_FLASH",
    "QUANTPATCH_FLASH_BF16",
    "CUSTOM_QUANT_TYPE",
    "EXTRA_ARGS",
    "QUANTPATCH_DRY_RUN",
    "SWEEP_DIR",
)
"""Variables the scripts read that a sweep decides: removed from what it passes on (the
sweep sets its own values of some: ``OUTPUT_ROOT``, ``MEGATRON_ROOT``, ``QUANTPATCH``, and for
a local sweep ``GPUS_PER_NODE``, ``NNODES``, ``CUDA_VISIBLE_DEVICES``)."""

OWNED_PREFIXES = ("PET_",)
"""torchrun reads ``PET_<OPTION>`` for each option not given (``PET_NODE_RANK``,
``PET_MAX_RESTARTS``): the scripts give torchrun its options themselves."""

PASSED = (
    "DATA_ROOT",
    "DATA_PREFIX",
    "TOKENIZER_MODEL",
    "MOCK_DATA",
    "TENSOR_SAVE_ENABLED",
    "MASKED_SOFTMAX_FUSION",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "TORCHRUN",
    "PYTHON",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
)
"""Variables a user may set for a sweep's runs (passed on, and recorded)."""

PASSED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "NVTE_", "SBATCH_")
"""Families passed on and recorded: NCCL's and TransformerEngine's tuning, Slurm's sbatch
defaults (partition, account, ...; the scripts check that the allocation is the planned one)."""


def owned(name: str) -> bool:
    return name in OWNED or name.startswith(OWNED_PREFIXES)


def passed(name: str) -> bool:
    return name in PASSED or name.startswith(PASSED_PREFIXES)


def for_runs(
    environ: Mapping[str, str], sweep: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """The environment a sweep's scripts get: ``environ`` without the owned variables, with
    ``sweep`` (the values the sweep decided) over it; and the passed-through variables of it,
    to record."""
    env = {k: v for k, v in environ.items() if not owned(k)}
    env.update(sweep)
    return env, {k: v for k, v in sorted(env.items()) if passed(k)}
