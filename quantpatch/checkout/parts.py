"""The parts quantpatch installs into a checkout, and whether each is this version's.

``init`` and ``saver install`` record, besides each file's original and written hashes, the
quantpatch version and the *form* of every part they installed. A part is a runtime module
copied verbatim (its content hash says whether it is this version's) or a codemod (its form,
an integer bumped whenever the codemod's output changes, says so). ``check`` reports each part
as ``current``, ``older`` (installed by an earlier quantpatch: ``quantpatch upgrade`` brings
it up to date) or ``edited`` (a file of it changed by hand since it was installed).

Light on purpose: ``check`` reads it, so it imports neither libcst nor the codemods.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from quantpatch import __version__
from quantpatch.base.config import Targets
from quantpatch.base.edits import read_exact, sha256_text
from quantpatch.git import repo as gitrepo
from quantpatch.git.installs import record_of

INIT = "init"
SAVER = "saver"

PACKAGE = "megatron/core/quantpatch"
"""The runtime's package in the checkout (``megatron.core.quantpatch``): the modules of
``quantpatch/runtime/`` under their own names, so that their relative imports hold."""
PACKAGE_INIT = f"{PACKAGE}/__init__.py"
"""Its ``__init__.py``: what each module is and which entry points the site code calls."""
OPS_MODULE = f"{PACKAGE}/quantpatch_ops.py"
KERNELS_MODULE = f"{PACKAGE}/quantpatch_kernels.py"
FLASH_MODULE = f"{PACKAGE}/quantpatch_flash.py"
RHT_KERNELS_MODULE = f"{PACKAGE}/quantpatch_rht_kernels.py"
FP8_KERNELS_MODULE = f"{PACKAGE}/quantpatch_fp8_kernels.py"
GEMM_KERNELS_MODULE = f"{PACKAGE}/quantpatch_gemm_kernels.py"
FORMATS_MODULE = f"{PACKAGE}/quantpatch_formats.py"
LAYERS_MODULE = f"{PACKAGE}/quantpatch_layers.py"
SAVER_MODULE = "megatron/core/tensor_saver.py"
"""The import path of a checkout's own saver callers (a fork's): the same module object as
``SAVER_IMPL`` (``runtime/saver_path.py``), so they keep working where it replaced theirs."""
SAVER_IMPL = f"{PACKAGE}/tensor_saver.py"
"""The tensor saver's API, which the inserted calls import."""
SAVER_PARTS = (
    "__init__",
    "settings",
    "dtypes",
    "capture",
    "device_copy",
    "stats",
    "stats_kernel",
    "ondisk",
    "pickler",
    "writer",
    "compat",
)
"""The saver's parts, one concern each (``runtime/quantpatch_saver/__init__.py``)."""
SAVER_MODULES = (
    SAVER_MODULE,
    SAVER_IMPL,
    *(f"{PACKAGE}/quantpatch_saver/{part}.py" for part in SAVER_PARTS),
)
"""Every file ``saver install`` copies: the import path its callers use, the API, its parts."""
# the parts quantpatch_ops.py imports, one concern each (see its docstring)
OPS_PARTS = (
    "quantpatch_formats",  # the format spec every other part derives its tables from
    "quantpatch_env",  # every environment variable the runtime reads
    "quantpatch_mx",
    "quantpatch_fp8",  # fp8-tensor and fp8-block (TE's FP8 recipes)
    "quantpatch_delayed",  # fp8-delayed: TE's delayed scaling, its per-layer state
    "quantpatch_nvfp4",
    "quantpatch_paretoq",
    "quantpatch_quantize",
    "quantpatch_weights",
    "quantpatch_rht",  # nvfp4-rht's Hadamard transform (imported when the value is used)
    "quantpatch_layers",  # the BF16 layer policy's hooks (imported by the linear file)
)
OPS_MODULES = (OPS_MODULE, PACKAGE_INIT, *(f"{PACKAGE}/{part}.py" for part in OPS_PARTS))
"""Every installed file ``from megatron.core.quantpatch import quantpatch_ops`` imports (the
package's ``__init__.py`` included; not the kernels)."""
# installed path -> the runtime module it copies
RUNTIME_MODULES = {
    **{
        installed: f"runtime/{Path(installed).name}"
        for installed in OPS_MODULES
        if installed != PACKAGE_INIT
    },
    PACKAGE_INIT: "runtime/package_init.py",
    KERNELS_MODULE: "runtime/quantpatch_kernels.py",
    RHT_KERNELS_MODULE: "runtime/quantpatch_rht_kernels.py",
    FP8_KERNELS_MODULE: "runtime/quantpatch_fp8_kernels.py",
    GEMM_KERNELS_MODULE: "runtime/quantpatch_gemm_kernels.py",
    FLASH_MODULE: "runtime/quantpatch_flash.py",
}
SAVER_SOURCES = {
    SAVER_MODULE: "runtime/saver_path.py",
    **{rel: "runtime/" + rel.removeprefix(f"{PACKAGE}/") for rel in SAVER_MODULES[1:]},
}
"""``saver install``'s files: installed path -> the runtime module it copies."""

FLAT = "megatron/core"
"""Where the releases before the package installed the runtime: flat files beside
``tensor_saver.py`` (``quantpatch_ops.py``, ..., ``quantpatch_saver/``). ``upgrade`` moves a
checkout into the package; until then ``set`` reads the values of the modules it has."""


def flat(rel: str) -> str:
    """Where the releases before the package installed the runtime file ``rel``."""
    return f"{FLAT}/{rel.removeprefix(f'{PACKAGE}/')}"


def is_runtime(rel: str) -> bool:
    """Whether an install's file ``rel`` is a runtime file, this version's or one an earlier
    release installed (the flat ``megatron/core/quantpatch_*.py``, ``quantpatch_saver/``), not
    a file a codemod rewrote."""
    return rel in RUNTIME_MODULES or rel in SAVER_SOURCES or rel.startswith(f"{FLAT}/quantpatch_")


FORMS = {"sites": 3, "mla-params": 1, "paretoq-steps": 2, "saver-calls": 2}
# (sites 2: the flash route's bf16 branch, QUANTPATCH_FLASH_BF16; sites 3, paretoq-steps 2 and
# saver-calls 2: the runtime imported from its package, megatron.core.quantpatch, and the
# products' operands named by role)
"""Each codemod's form: bump it when what the codemod writes changes, so that ``check`` calls
the checkouts it rewrote older and ``upgrade`` re-applies it."""

MODULE_PARTS = {
    "ops": (INIT, OPS_MODULES),
    "kernels": (
        INIT,
        (KERNELS_MODULE, RHT_KERNELS_MODULE, FP8_KERNELS_MODULE, GEMM_KERNELS_MODULE),
    ),
    "flash": (INIT, (FLASH_MODULE,)),
    "saver": (SAVER, SAVER_MODULES),
}
"""Runtime parts: (the install that copies them, their installed files)."""
CODEMOD_PARTS = {
    "sites": (INIT, "targets"),
    "mla-params": (INIT, "attention"),
    "paretoq-steps": (INIT, "linear"),
    "saver-calls": (SAVER, "instrumented"),
}
"""Codemod parts: (the install that applies them, which of its files they rewrite)."""


@cache
def runtime_source(installed: str) -> str:
    """The text this version installs at ``installed`` (a runtime module or the saver)."""
    name = SAVER_SOURCES.get(installed) or RUNTIME_MODULES[installed]
    return resources.files("quantpatch").joinpath(name).read_text("utf-8")


def record_extra(name: str) -> dict[str, Any]:
    """What an install records about its parts: this version and each codemod's form."""
    forms = {p: FORMS[p] for p, (owner, _) in CODEMOD_PARTS.items() if owner == name}
    return {"version": __version__, "forms": forms}


@dataclass
class PartStatus:
    part: str
    install: str
    status: str
    """current, older or edited."""
    files: list[str]
    version: str | None
    """The quantpatch version that installed it (None: one before versioned installs)."""
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "install": self.install,
            "status": self.status,
            "files": self.files,
            "version": self.version,
            "detail": self.detail,
        }


def last_written(records: dict[str, dict[str, Any]], rel: str) -> str | None:
    """The hash the file must have: what the last install that wrote it wrote (``saver
    install`` instruments the files ``init`` wrote; its original is init's output)."""
    holders = [r["files"][rel] for r in records.values() if rel in r["files"]]
    inputs = {h.get("original_sha") for h in holders}
    ends = [h["written"] for h in holders if h["written"] not in inputs] or [
        h["written"] for h in holders
    ]
    return str(ends[0]) if ends else None


def installed_records(checkout: gitrepo.Checkout) -> dict[str, dict[str, Any]]:
    """The install records (init, saver) of the checkout; a linked worktree reads the main
    checkout's (the installs are committed there)."""
    out = {}
    shared = gitrepo.shared_state_dir(checkout)
    for name in (INIT, SAVER):
        record = record_of(checkout, name)
        if record is None and shared != checkout.state_dir:
            record = record_of(replace(checkout, state_dir=shared), name)
        if record is not None:
            out[name] = record
    return out


UPGRADING = "the interrupted 'quantpatch upgrade' was writing it; run 'quantpatch upgrade' again"


def parts_status(
    checkout: gitrepo.Checkout, targets: Targets, *, set_active: bool, upgrading: bool = False
) -> list[PartStatus]:
    """Every installed part: current, older or edited. Hashes and the records only (no
    parsing). While a ``set`` is active, and in a scheme's worktree, the target files hold
    the scheme's values, so hand edits are looked for in the runtime files alone. While an
    interrupted ``upgrade`` is unfinished (``upgrading``) its files differ from the records
    it has not rewritten yet: such a part is older, the upgrade named, not edited by hand."""
    records = installed_records(checkout)
    # a scheme's worktree holds the scheme's values in the target files: only the main
    # checkout, with no set active, holds what the installs wrote there
    main = gitrepo.shared_state_dir(checkout) == checkout.state_dir
    out: list[PartStatus] = []
    texts: dict[str, str | None] = {}

    def sha(rel: str) -> str | None:
        if rel not in texts:
            texts[rel] = read_exact(checkout.root / rel)
        text = texts[rel]
        return None if text is None else sha256_text(text)

    def edited(rels: list[str]) -> list[str]:
        return [r for r in rels if sha(r) != last_written(records, r)]

    for part, (owner, files) in MODULE_PARTS.items():
        record = records.get(owner)
        if record is None:
            continue
        rels = [r for r in files if r in record["files"]]
        # where the releases before the package installed the part (``upgrade`` moves them)
        flats = [r for r in dict.fromkeys(map(flat, files)) if r not in files]
        before = [r for r in flats if r in record["files"]]
        # a part an earlier version did not install has no files in its record: older
        version = record.get("version")
        current = (
            not before
            and len(rels) == len(files)
            and all(record["files"][r]["written"] == sha256_text(runtime_source(r)) for r in rels)
        )
        hand = edited(rels + before)
        older = "'quantpatch upgrade' installs this version's"
        status, detail = _judged(hand, upgrading, current, older)
        out.append(PartStatus(part, owner, status, list(files), version, detail))
    for part, (owner, which) in CODEMOD_PARTS.items():
        record = records.get(owner)
        if record is None:
            continue
        rels = _codemod_files(record, which, targets)
        if not rels:
            continue
        version = record.get("version")
        hand = [] if set_active or not main else edited(rels)
        form = (record.get("forms") or {}).get(part)
        status, detail = _judged(
            hand, upgrading, form == FORMS[part], "'quantpatch upgrade' re-applies it"
        )
        out.append(PartStatus(part, owner, status, rels, version, detail))
    return out


def _judged(hand: list[str], upgrading: bool, current: bool, older: str) -> tuple[str, str]:
    """A part's status and its detail: edited (``hand``: the files changed by hand), older
    (an unfinished upgrade's, or ``older``'s advice) or current."""
    if hand and upgrading:
        return "older", UPGRADING
    if hand:
        return "edited", f"{', '.join(hand)} changed by hand since it was installed"
    return ("current", "") if current else ("older", older)


def _codemod_files(record: dict[str, Any], which: str, targets: Targets) -> list[str]:
    """The recorded files a codemod part rewrites."""
    rels = [r for r in record["files"] if not is_runtime(r)]
    if which in ("linear", "attention"):
        return [r for r in rels if r in targets.all_files and targets.kind_of(r) == which]
    if which == "targets":
        return [r for r in rels if r in targets.all_files]
    return rels
