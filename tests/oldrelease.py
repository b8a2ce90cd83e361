"""A checkout as the previous release (0.1.0, before versioned installs and the split runtime)
leaves it after ``init`` and ``saver install``: its monolithic ``quantpatch_ops.py`` and its
single-file ``tensor_saver.py`` (kept in ``tests/data/release_0_1_0/``), no parts modules,
and install records without a version or codemod forms. Built from this version's installs
by putting back what that release wrote."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from quantpatch.checkout.parts import OPS_MODULE, OPS_MODULES, SAVER_MODULE, SAVER_MODULES

OLD_OPS = (Path(__file__).parent / "data/release_0_1_0/quantpatch_ops.py").read_text(
    encoding="utf-8"
)
OLD_SAVER = (Path(__file__).parent / "data/release_0_1_0/tensor_saver.py").read_text(
    encoding="utf-8"
)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def make_old_release(root: Path) -> None:
    """``root`` init'ed (and maybe saver-installed) by this version, turned into what the
    previous release left, committed on the current branch."""
    state = root / ".git/quantpatch"
    init = json.loads((state / "init/record.json").read_text())
    for rel in OPS_MODULES[1:]:
        (root / rel).unlink()
        del init["files"][rel]
    (root / OPS_MODULE).write_text(OLD_OPS, encoding="utf-8")
    init["files"][OPS_MODULE]["written"] = _sha(OLD_OPS)
    for name in ("init", "saver"):
        path = state / name / "record.json"
        if not path.is_file():
            continue
        record = init if name == "init" else json.loads(path.read_text())
        if name == "saver":
            for rel in SAVER_MODULES[1:]:
                (root / rel).unlink()
                del record["files"][rel]
            (root / SAVER_MODULE).write_text(OLD_SAVER, encoding="utf-8")
            record["files"][SAVER_MODULE]["written"] = _sha(OLD_SAVER)
        record.pop("version", None)
        record.pop("forms", None)
        path.write_text(json.dumps(record, indent=2) + "\n")
    subprocess.run(["git", "add", "-A", "megatron"], cwd=root, check=True)
    subprocess.run(
        ["git", "commit", "-qm", "quantpatch init: (release 0.1.0)"], cwd=root, check=True
    )
