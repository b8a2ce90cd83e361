"""``quantpatch saver install | remove | status``: the tensor saver as a recorded install.

``install`` copies ``quantpatch/runtime/tensor_saver.py`` verbatim into the runtime's package,
``megatron/core/quantpatch/tensor_saver.py``, with its parts (``runtime/quantpatch_saver/``)
in ``megatron/core/quantpatch/quantpatch_saver/``, puts at ``megatron/core/tensor_saver.py``
(where a fork's own callers import a saver) the module that is that one
(``runtime/saver_path.py``), and instruments the linear file, the attention file and
``transformer_layer.py`` beside the attention file; ``remove`` restores every byte.
Both are idempotent, refused while a ``set`` is active, and committed like ``set``.
A checkout's own saver is replaced only with ``--force``, and only when the installed module
serves every use of it in the checkout (``saver_callers``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from quantpatch.base.config import Targets, load_targets
from quantpatch.base.edits import Edit, read_exact
from quantpatch.base.errors import UserError
from quantpatch.checkout.parts import (
    SAVER_IMPL,
    SAVER_MODULE,
    SAVER_MODULES,
    record_extra,
    runtime_source,
)
from quantpatch.git import repo as gitrepo
from quantpatch.git.installs import InstallResult, record_of, run_install, run_remove
from quantpatch.sites.model import read_target

RECORD = "saver"


def saver_source() -> str:
    """The saver's API (``megatron/core/quantpatch/tensor_saver.py``), which serves the
    inserted calls and, under ``megatron.core.tensor_saver``, a checkout's own callers."""
    return runtime_source(SAVER_IMPL)


def _layer_file(targets: Targets) -> str:
    return str(PurePosixPath(targets.attention[0]).parent / "transformer_layer.py")


def instrumented_files(targets: Targets) -> dict[str, str]:
    """File -> kind (linear, attention, layer) of every file the saver instruments."""
    files = {rel: targets.kind_of(rel) for rel in targets.all_files}
    files[_layer_file(targets)] = "layer"
    return files


def install(path: Path | None, *, force: bool = False) -> InstallResult:
    def files(co: gitrepo.Checkout) -> list[str]:
        return [*instrumented_files(load_targets(co.root)), *SAVER_MODULES]

    def plan(co: gitrepo.Checkout) -> list[Edit]:
        from quantpatch.sites.codemods.saver import instrument

        edits = []
        for rel, kind in instrumented_files(load_targets(co.root)).items():
            text = read_target(co.root, rel)
            edits.append(Edit(rel, text, instrument(text, rel, kind)))
        current = read_exact(co.root / SAVER_MODULE)
        if current is not None and current != runtime_source(SAVER_MODULE) and not force:
            raise UserError(
                f"{SAVER_MODULE}: a different tensor saver is already there; "
                "--force replaces it (remove puts it back)."
            )
        edits.append(Edit(SAVER_MODULE, current, runtime_source(SAVER_MODULE)))
        for rel in SAVER_MODULES[1:]:
            part = read_exact(co.root / rel)
            if part is not None and part != runtime_source(rel) and not force:
                raise UserError(
                    f"{rel}: a different file is already there; --force replaces it (remove "
                    "puts it back)."
                )
            edits.append(Edit(rel, part, runtime_source(rel)))
        _refuse_unserved_callers(co.root, edits)
        return edits

    return run_install(
        path,
        RECORD,
        plan,
        files,
        "quantpatch saver install: tensor saver and marked calls",
        extra=record_extra(RECORD),
        idempotent=True,
    )


def _refuse_unserved_callers(root: Path, edits: list[Edit]) -> None:
    """Every import of the saver module and every call in the checkout must be served by the
    installed module; otherwise nothing is written. The files are read as they are now: the
    calls quantpatch inserts use its own module by construction, and a file that does not
    mention the saver (a stock checkout's) is then never parsed."""
    from quantpatch.checkout.saver_callers import served_api, unserved_uses

    texts = {e.rel: e.old for e in edits}
    uses = unserved_uses(root, served_api(saver_source()), texts, skip=SAVER_MODULE)
    if uses:
        raise UserError(
            f"{SAVER_MODULE}: the tensor saver quantpatch installs does not serve "
            f"{len(uses)} use(s) of the one it would replace: "
            f"{', '.join(map(str, uses))}; nothing was changed."
        )


def remove(path: Path | None) -> InstallResult:
    return run_remove(
        path, RECORD, "quantpatch saver remove: restore the uninstrumented sources", missing_ok=True
    )


@dataclass
class SaverStatus:
    installed: bool
    module: str
    module_matches: bool
    files: list[str]
    other: bool = False  # a tensor saver quantpatch did not install (the checkout's own)
    replaced: bool = False  # installed in place of such a saver (remove puts it back)

    def as_json(self) -> dict[str, Any]:
        return {
            "installed": self.installed,
            "module": self.module,
            "module_matches": self.module_matches,
            "files": self.files,
            "other": self.other,
            "replaced": self.replaced,
        }


def status(checkout: gitrepo.Checkout) -> SaverStatus:
    """Installed by quantpatch (a record exists and the module is in place), from the record
    alone: no parsing, so ``check`` stays fast. In a linked worktree (a scheme's, where
    training runs) the record is the main checkout's: the install is committed there, and
    the worktree's files come from its commits."""
    record = record_of(checkout, RECORD)
    shared = gitrepo.shared_state_dir(checkout)
    if record is None and shared != checkout.state_dir:
        record = record_of(replace(checkout, state_dir=shared), RECORD)
    current = read_exact(checkout.root / SAVER_MODULE)
    files = (record or {}).get("files", {})
    installed = record is not None and current is not None
    matches = all(read_exact(checkout.root / rel) == runtime_source(rel) for rel in SAVER_MODULES)
    return SaverStatus(
        installed,
        SAVER_MODULE,
        matches,
        sorted(files),
        other=current is not None and not installed,
        replaced=installed and bool(files.get(SAVER_MODULE, {}).get("existed")),
    )
