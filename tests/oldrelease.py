"""Checkouts as earlier releases left them after ``init`` and ``saver install``, built from
this version's installs by putting back what those releases wrote:

* the flat layout (``make_flat_release``: the last release before the runtime's package):
  every runtime module a file of its own in ``megatron/core/`` beside Megatron's, the saver's
  parts in ``megatron/core/quantpatch_saver/``, the site code importing
  ``megatron.core.quantpatch_ops`` and naming a product's operands with ``backward=`` /
  ``weight=``;
* release 0.1.0 (``make_old_release``: before versioned installs and the split runtime): the
  flat layout with its monolithic ``quantpatch_ops.py`` and its single-file
  ``tensor_saver.py`` (kept in ``tests/data/release_0_1_0/``), no parts modules, and install
  records without a version or codemod forms."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from quantpatch.checkout.parts import (
    OPS_MODULE,
    OPS_MODULES,
    PACKAGE,
    PACKAGE_INIT,
    SAVER_IMPL,
    SAVER_MODULE,
    SAVER_MODULES,
    flat,
    is_runtime,
    runtime_source,
)

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
    previous release left, committed on the current branch: the flat layout
    (``make_flat_release``) with its monolithic ops module and single-file saver."""
    make_flat_release(root, commit=False)
    state = root / ".git/quantpatch"
    init = json.loads((state / "init/record.json").read_text())
    for rel in map(flat, OPS_MODULES[2:]):  # the parts: the ops module held them all
        (root / rel).unlink()
        del init["files"][rel]
    (root / flat(OPS_MODULE)).write_text(OLD_OPS, encoding="utf-8")
    init["files"][flat(OPS_MODULE)]["written"] = _sha(OLD_OPS)
    for name in ("init", "saver"):
        path = state / name / "record.json"
        if not path.is_file():
            continue
        record = init if name == "init" else json.loads(path.read_text())
        if name == "saver":
            for rel in map(flat, SAVER_MODULES[2:]):
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


# -- the flat layout: the runtime's files beside Megatron's in megatron/core/ ----------------

FLAT_FORMS = {"sites": 2, "mla-params": 1, "paretoq-steps": 1, "saver-calls": 1}
"""The codemods' forms of the last release with the flat layout."""


class _FlatSites(cst.CSTTransformer):
    """The site code as the releases with the flat layout wrote it: the runtime imported from
    ``megatron.core`` itself, and a linear product's operands said by ``backward=True`` and
    ``weight="a"|"b"`` (where this version writes ``roles=(...)``)."""

    def leave_ImportFrom(
        self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom
    ) -> cst.ImportFrom:
        if m.matches(
            updated_node.module,
            m.Attribute(m.Attribute(m.Name("megatron"), m.Name("core")), m.Name("quantpatch")),
        ):
            return updated_node.with_changes(module=cst.parse_expression("megatron.core"))
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        args = list(updated_node.args)
        at = next((i for i, a in enumerate(args) if a.keyword and a.keyword.value == "roles"), None)
        if at is None:
            return updated_node
        roles = cst.ensure_type(args[at].value, cst.Tuple)
        first, second = (
            cst.ensure_type(e.value, cst.SimpleString).evaluated_value for e in roles.elements
        )
        old: list[tuple[str, cst.BaseExpression]] = []
        if first == "grad_output":
            old.append(("backward", cst.Name("True")))
        if "weight" in (first, second):
            old.append(("weight", cst.SimpleString('"a"' if first == "weight" else '"b"')))
        between = args[at - 1].comma
        new = [args[at].with_changes(keyword=cst.Name(k), value=v, comma=between) for k, v in old]
        if new:
            new[-1] = new[-1].with_changes(comma=args[at].comma)
        else:
            args[at - 1] = args[at - 1].with_changes(comma=args[at].comma)
        return updated_node.with_changes(args=[*args[:at], *new, *args[at + 1 :]])


def flat_text(text: str) -> str:
    """A target file's text as the releases with the flat layout wrote it."""
    return cst.parse_module(text).visit(_FlatSites()).code


def make_flat_release(root: Path, *, commit: bool = True) -> None:
    """``root`` init'ed (and maybe saver-installed) by this version, turned into what the
    last release with the flat layout left: every runtime file in ``megatron/core/`` itself
    (the saver's API at ``megatron/core/tensor_saver.py``, its parts in
    ``megatron/core/quantpatch_saver/``), no package ``__init__``, the site code importing
    ``megatron.core.quantpatch_ops`` and calling with ``backward=`` / ``weight=``, the records
    and the kept originals saying so; committed on the current branch."""
    state = root / ".git/quantpatch"
    records = {
        name: json.loads((state / name / "record.json").read_text())
        for name in ("init", "saver")
        if (state / name / "record.json").is_file()
    }
    for record in records.values():
        files: dict[str, dict] = {}
        for rel, info in record["files"].items():
            if rel in (PACKAGE_INIT, SAVER_IMPL):
                (root / rel).unlink()
            elif rel == SAVER_MODULE:  # the saver's API itself was there
                text = runtime_source(SAVER_IMPL)
                (root / rel).write_text(text, encoding="utf-8")
                files[rel] = {**info, "written": _sha(text)}
            elif rel.startswith(PACKAGE + "/"):
                (root / flat(rel)).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).rename(root / flat(rel))
                files[flat(rel)] = info
            else:
                files[rel] = info  # a file a codemod rewrote: below
        record["files"] = files
        record["forms"] = {k: v for k, v in FLAT_FORMS.items() if k in record.get("forms", {})}
    init, saver = records.get("init"), records.get("saver")
    for rel in {r for rec in records.values() for r in rec["files"] if not is_runtime(r)}:
        if (
            init is not None
            and saver is not None
            and rel in init["files"]
            and rel in saver["files"]
        ):
            kept = state / "saver/originals" / rel  # init's output, which the saver rewrote
            between = flat_text(kept.read_text(encoding="utf-8"))
            kept.write_text(between, encoding="utf-8")
            init["files"][rel]["written"] = saver["files"][rel]["original_sha"] = _sha(between)
        text = flat_text((root / rel).read_text(encoding="utf-8"))
        (root / rel).write_text(text, encoding="utf-8")
        (saver if saver is not None and rel in saver["files"] else init)["files"][rel][
            "written"
        ] = _sha(text)
    for name, record in records.items():
        (state / name / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    for folder in (root / PACKAGE / "quantpatch_saver", root / PACKAGE):
        if folder.is_dir():
            folder.rmdir()  # the package was never there
    if commit:
        subprocess.run(["git", "add", "-A", "megatron"], cwd=root, check=True)
        subprocess.run(
            ["git", "commit", "-qm", "quantpatch init: (the flat layout)"], cwd=root, check=True
        )
