"""``quantpatch init``: make a stock Megatron checkout a quantization test bed, and undo it.

``init`` inserts fork-layout sites (value ``bf16``, so the checkout computes exactly as before)
into the two target files, with the flash-attention route of the FA schemes at the top of
``DotProductAttention.forward``, and installs ``megatron/core/quantpatch_ops.py``,
``megatron/core/quantpatch_kernels.py``, ``megatron/core/quantpatch_flash.py``,
``megatron/core/quantpatch_rht.py``, ``megatron/core/quantpatch_rht_kernels.py`` and
``megatron/core/quantpatch_layers.py`` (verbatim
copies of ``quantpatch/runtime/``: the ops, their fused Triton kernels for CUDA tensors, the
flash-attention kernels, the Hadamard transform of ``nvfp4-rht`` with its kernel, and the
BF16 layer policy's hooks, whose policy literal ``init`` puts in the linear file): a
recorded install, so ``init --remove`` restores the original bytes exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path

from quantpatch.base.config import load_targets
from quantpatch.base.edits import Edit, read_exact
from quantpatch.base.errors import UserError
from quantpatch.git import repo as gitrepo
from quantpatch.git.installs import InstallResult, record_of, run_install, run_remove
from quantpatch.sites.codemods.init_sites import inject_sites, inject_weight_steps, teach_dispatches
from quantpatch.sites.model import read_target
from quantpatch.sites.policy import insert_policy

OPS_MODULE = "megatron/core/quantpatch_ops.py"
KERNELS_MODULE = "megatron/core/quantpatch_kernels.py"
FLASH_MODULE = "megatron/core/quantpatch_flash.py"
RHT_MODULE = "megatron/core/quantpatch_rht.py"
RHT_KERNELS_MODULE = "megatron/core/quantpatch_rht_kernels.py"
LAYERS_MODULE = "megatron/core/quantpatch_layers.py"
# installed path -> the runtime module it copies
RUNTIME_MODULES = {
    OPS_MODULE: "runtime/quantpatch_ops.py",
    KERNELS_MODULE: "runtime/quantpatch_kernels.py",
    FLASH_MODULE: "runtime/quantpatch_flash.py",
    RHT_MODULE: "runtime/quantpatch_rht.py",
    RHT_KERNELS_MODULE: "runtime/quantpatch_rht_kernels.py",
    LAYERS_MODULE: "runtime/quantpatch_layers.py",
}
RECORD = "init"


def runtime_source(installed: str) -> str:
    return resources.files("quantpatch").joinpath(RUNTIME_MODULES[installed]).read_text("utf-8")


def ops_source() -> str:
    return runtime_source(OPS_MODULE)


def _files(checkout: gitrepo.Checkout) -> list[str]:
    return [*load_targets(checkout.root).all_files, *RUNTIME_MODULES]


def _plan(checkout: gitrepo.Checkout) -> list[Edit]:
    root = checkout.root
    if record_of(checkout, RECORD) is not None:
        raise UserError(f"{root}: already initialised by quantpatch ('init --remove' undoes it).")
    targets = load_targets(root)
    edits = _site_edits(root, targets.all_files, targets.kind_of)
    for installed in RUNTIME_MODULES:
        current, source = read_exact(root / installed), runtime_source(installed)
        if current is not None and current != source:
            raise UserError(f"{installed}: a different file is already there; move it away first.")
        edits.append(Edit(installed, current, source))
    return edits


def _site_edits(root: Path, rels: tuple[str, ...], kind_of: Callable[[str], str]) -> list[Edit]:
    """A stock file gets sites and quantpatch's dispatches; a file that has sites already
    (a fork's) gets its explicit dispatch chains taught the quantpatch values they lack,
    its own branches untouched. Nothing to do anywhere is refused."""
    from quantpatch.sites.discovery import discover_sites

    edits, forked = [], []
    for rel in rels:
        text = read_target(root, rel)
        if not discover_sites(text, rel, kind_of(rel)):
            new = inject_sites(text, rel, kind_of(rel), flash=True)
            if kind_of(rel) == "linear":
                new = inject_weight_steps(new, rel)  # ParetoQ steps: parameters of the layers
                new = insert_policy(new, rel)  # the BF16 layer policy (set --bf16-layers)
            edits.append(Edit(rel, text, new))
            continue
        forked.append(rel)
        taught = teach_dispatches(text, rel)
        if kind_of(rel) == "linear":
            taught = _with_weight_steps(taught or text, rel) or taught
            if taught is not None:  # the policy goes where the dispatches learn quantpatch_ops
                taught = insert_policy(taught, rel)
        if taught is not None:
            edits.append(Edit(rel, text, taught))
    if forked and len(edits) == 0:
        raise UserError(
            f"{forked[0]}: the file already has custom_quant_type sites whose dispatches "
            "quantpatch cannot teach more values; nothing to initialise."
        )
    return edits


def _with_weight_steps(text: str, rel: str) -> str | None:
    """A fork's linear file with the ParetoQ steps in its parallel linear layers (as on a
    stock checkout), or None where the fork has them already or changed those layers beyond
    recognition (then ``set`` refuses the ParetoQ values there, naming the constructors)."""
    from quantpatch.sites.codemods.init_sites import STEP_CONSTRUCTORS
    from quantpatch.sites.discovery import discover_sites

    if {s.function for s in discover_sites(text, rel, "linear")} >= set(STEP_CONSTRUCTORS):
        return None
    try:
        return inject_weight_steps(text, rel)
    except UserError:
        return None


def init(path: Path | None, *, remove: bool = False) -> InstallResult:
    if remove:
        return run_remove(path, RECORD, "quantpatch init --remove: restore the stock sources")
    return run_install(
        path,
        RECORD,
        _plan,
        _files,
        "quantpatch init: fork-layout custom_quant_type sites (bf16), "
        "megatron/core/quantpatch_ops.py and its Triton kernels",
    )
