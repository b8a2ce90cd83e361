"""``quantpatch init``: make a stock Megatron checkout a quantization test bed, and undo it.

``init`` inserts fork-layout sites (value ``bf16``, so the checkout computes exactly as before)
into the two target files, with the flash-attention route of the FA schemes at the top of
``DotProductAttention.forward``, and installs the runtime as the package
``megatron/core/quantpatch/`` (``parts.RUNTIME_MODULES``: verbatim copies of
``quantpatch/runtime/``): ``quantpatch_ops.py``, which the sites call, the modules it imports
(one concern each), the Triton kernels for CUDA tensors, the flash-attention kernels, and an
``__init__.py`` that says what each module is. A recorded install, so ``init --remove``
restores the original bytes exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantpatch.base.config import load_targets
from quantpatch.base.edits import Edit, read_exact
from quantpatch.base.errors import UserError
from quantpatch.checkout.parts import (  # noqa: F401  (the names tests and set use)
    FLASH_MODULE,
    KERNELS_MODULE,
    OPS_MODULE,
    OPS_MODULES,
    OPS_PARTS,
    RUNTIME_MODULES,
    record_extra,
    runtime_source,
)
from quantpatch.git import repo as gitrepo
from quantpatch.git.installs import (
    InstallResult,
    record_of,
    run_amend,
    run_install,
    run_remove,
)
from quantpatch.sites.codemods.init_sites import inject_sites, inject_weight_steps, teach_dispatches
from quantpatch.sites.codemods.set_value import keep_bom
from quantpatch.sites.model import read_target
from quantpatch.sites.policy import insert_policy

RECORD = "init"


ALREADY = (
    "already initialised by quantpatch ('quantpatch upgrade' brings an earlier release's "
    "install to this version; 'init --remove' undoes it)."
)


def ops_source() -> str:
    return runtime_source(OPS_MODULE)


def _files(checkout: gitrepo.Checkout) -> list[str]:
    return [*load_targets(checkout.root).all_files, *RUNTIME_MODULES]


def _plan(checkout: gitrepo.Checkout) -> list[Edit]:
    root = checkout.root
    if record_of(checkout, RECORD) is not None:
        raise UserError(f"{root}: {ALREADY}")
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

    edits, forked = [], []
    for rel in rels:
        text = read_target(root, rel)
        new, fork = init_text(text, rel, kind_of(rel))
        if fork:
            forked.append(rel)
        if new is not None:
            edits.append(Edit(rel, text, new))
    if forked and len(edits) == 0:
        raise UserError(
            f"{forked[0]}: the file already has custom_quant_type sites whose dispatches "
            "quantpatch cannot teach more values; nothing to initialise."
        )
    return edits


def init_text(text: str, rel: str, kind: str) -> tuple[str | None, bool]:
    """What ``init`` makes of a target file's text (None: nothing to change), and whether
    the file had sites of its own (a fork's). ``upgrade`` runs it on the recorded originals."""
    from quantpatch.sites.discovery import discover_sites

    if not discover_sites(text, rel, kind):
        new = inject_sites(text, rel, kind, flash=True)
        if kind == "linear":
            new = inject_weight_steps(new, rel)  # ParetoQ steps: parameters of the layers
            new = insert_policy(new, rel)  # the BF16 layer policy (set --bf16-layers)
        return new, False
    taught = teach_dispatches(text, rel)
    if kind == "linear":
        taught = _with_weight_steps(taught or text, rel) or taught
        if taught is not None:  # the policy goes where the dispatches learn quantpatch_ops
            taught = insert_policy(taught, rel)
    else:  # a fork's local attention lacks MLA's head dims as stock Megatron does
        taught = with_mla_head_dims(taught or text, rel) or taught
    return taught, True


def _with_weight_steps(text: str, rel: str) -> str | None:
    """A fork's linear file with the ParetoQ steps in its parallel linear layers (as on a
    stock checkout), or None where the fork has them already or changed those layers beyond
    recognition (then ``set`` refuses the ParetoQ values there, naming the constructors).
    The new constructor sites hold the value the fork's linear sites hold (``hifp8`` on a
    fork that computes its linear layers in HiFP8), so ``check`` still finds them agreeing
    and every role reads as before; a value that is not ParetoQ's registers no step."""
    from quantpatch.sites.codemods.init_sites import STEP_CONSTRUCTORS
    from quantpatch.sites.discovery import discover_sites
    from quantpatch.sites.model import role_values

    sites = discover_sites(text, rel, "linear")
    if {s.function for s in sites} >= set(STEP_CONSTRUCTORS):
        return None
    values, _ = role_values(sites)
    value = values.get("linear") or values.get("fprop") or "bf16"
    try:
        return inject_weight_steps(text, rel, value)
    except UserError:
        return None


def with_mla_head_dims(text: str, rel: str) -> str | None:
    """An attention file whose ``DotProductAttention.__init__`` takes MLA's ``k_channels`` /
    ``v_channels`` (``teach_mla_head_dims``), or None where it takes them already or has no
    shape quantpatch can add them to (then ``gen-scripts`` names the file in the MLA
    models' scripts)."""
    from quantpatch.sites.codemods.init_sites import teach_mla_head_dims
    from quantpatch.sites.discovery import parse_source

    module = parse_source(text, rel)
    new = teach_mla_head_dims(module).code
    return None if new == module.code else keep_bom(text, new)


def _missing_parts(checkout: gitrepo.Checkout, record: dict[str, Any]) -> list[Edit]:
    """What an earlier quantpatch's ``init`` did not do and this one does: MLA's head dims in
    the local attention. The other parts are left as that ``init`` wrote them."""
    root = checkout.root
    targets = load_targets(root)
    edits = []
    for rel in targets.attention:
        text = read_exact(root / rel)
        if text is None:
            continue
        new = with_mla_head_dims(text, rel)
        if new is not None:
            edits.append(Edit(rel, text, new))
    return edits


def init(path: Path | None, *, remove: bool = False) -> InstallResult:
    if remove:
        return run_remove(path, RECORD, "quantpatch init --remove: restore the stock sources")
    checkout = gitrepo.find_checkout(path, need_git=False)
    if record_of(checkout, RECORD) is not None:
        return run_amend(
            path,
            RECORD,
            _missing_parts,
            "quantpatch init: the local DotProductAttention takes MLA's k_channels / "
            "v_channels (what the earlier init of this checkout did not add)",
            f"{checkout.root}: {ALREADY}",
        )
    return run_install(
        path,
        RECORD,
        _plan,
        _files,
        "quantpatch init: fork-layout custom_quant_type sites (bf16) and the runtime they "
        "call, megatron/core/quantpatch/",
        extra=record_extra(RECORD),
    )
