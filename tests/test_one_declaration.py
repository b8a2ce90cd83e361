"""A format is declared once, in the spec (``quantpatch/runtime/quantpatch_formats.py``), and
the project's text says why, not where a change was asked for.

* No string literal of the package outside the spec names a value or an operand format
  (``"mxfp8"``, ``"nvfp4-rht"``, ``"fp8-block-2d"``, ...): everything else derives its names
  from the spec (``names(...)``, the spec's fields), so adding a format never means hunting
  for hand-kept tuples. A family name compared with a spec entry's ``family`` is a family,
  not a value, and passes; the few literals left are listed below with their reasons.
* Each value is described once in README.md and docs/: the table generated from the spec
  (``summary_table``, kept equal by ``test_docs_show_the_declared_table``); no other table
  has a row per value.
* README, docs, the package, the tests and the scripts carry no tracker numbers (the word
  "issue" and a number):
  a reader has nothing to look them up in.

Read statically (``ast`` and text), nothing imported but the spec.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from quantpatch.runtime import quantpatch_formats as spec

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "quantpatch"
SPEC_FILE = PACKAGE / "runtime" / "quantpatch_formats.py"

NAMES = sorted({f.name for f in spec.SPECS} - {"bf16"}, key=len, reverse=True)
"""Every declared value and operand format but ``bf16`` (a word, and the identity)."""
NAME = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, NAMES)) + r")(?![\w.]|-[a-z0-9])")

ALLOWED: dict[tuple[str, str], str] = {
    ("quantpatch/launch/native.py", "mxfp8"): (
        "Megatron's own --fp8-recipe argument value, not a quantpatch value"
    ),
    ("quantpatch/launch/registry.py", "mxfp8"): (
        "Megatron's own --fp8-recipe choice (FP8_RECIPES), not a quantpatch value"
    ),
    # the fused GEMM's operand kinds keyed by the spec's (family, scale, tiled): family names
    # that are also values' names
    ("quantpatch/runtime/quantpatch_gemm_kernels.py", "hifp8"): "a family keying a GEMM kind",
    ("quantpatch/runtime/quantpatch_gemm_kernels.py", "fp8-tensor"): "a family keying a GEMM kind",
    ("quantpatch/runtime/quantpatch_gemm_kernels.py", "fp8-block"): "a family keying a GEMM kind",
    ("quantpatch/runtime/quantpatch_gemm_kernels.py", "nvfp4"): "a family keying a GEMM kind",
}
"""(file, literal) -> why that literal may stay."""

ALLOWED_FILES = {
    "quantpatch/data/schemes.toml": (
        "the schemes are data: each role's value, checked against the spec when the registry "
        "loads them"
    ),
}


def _is_family(node: ast.expr) -> bool:
    """``x.family``, ``_family(x)`` or a variable ``family``: an expression whose value is a
    family name."""
    if isinstance(node, ast.Name):
        return node.id.endswith("family")
    if isinstance(node, ast.Attribute):
        return node.attr == "family"
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name.endswith("family")
    return False


def _strings(node: ast.expr) -> list[ast.Constant]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def literals(source: str) -> list[tuple[int, str]]:
    """The string literals of ``source`` that name a declared value (line, literal), leaving
    out docstrings, ``__all__`` and family names used as families."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))  # docstrings, module and attribute ones alike
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            skip |= {id(n) for n in _strings(node.value)}
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_family(s) for s in sides):
                for s in sides:
                    skip |= {id(n) for n in _strings(s) if n.value in spec.FAMILIES}
        elif isinstance(node, ast.keyword) and node.arg == "family":
            skip |= {id(n) for n in _strings(node.value) if n.value in spec.FAMILIES}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += [(node.lineno, m.group(1)) for m in NAME.finditer(node.value)]
    return found


def test_the_scanner_tells_values_from_families_and_text() -> None:
    src = (
        'A = "mxfp8"\n'
        'B = ("nvfp4-2d", "w1.58")\n'
        'if spec.family == "nvfp4" or _family(f) in ("fp8-tensor", "fp8-delayed"):\n'
        '    names(family="hifp8")\n'
        'if fmt == "nvfp4":\n'
        '    raise ValueError(f"{fmt}: use fp8-tensor here")\n'
        '__all__ = ["nvfp4"]\n'
        'C = "FA_mxfp8 and linear_mxfp4 are schemes; mxfp8x is no value"\n'
    )
    assert literals(src) == [
        (1, "mxfp8"),
        (2, "nvfp4-2d"),
        (2, "w1.58"),
        (5, "nvfp4"),
        (6, "fp8-tensor"),
    ]


def test_no_value_name_literal_outside_the_spec() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == SPEC_FILE:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for line, name in literals(path.read_text(encoding="utf-8")):
            if (rel, name) not in ALLOWED:
                bad.append(f"{rel}:{line}: {name!r}")
    for path in sorted([*PACKAGE.rglob("*"), *(ROOT / "templates").rglob("*")]):
        if not path.is_file() or path.suffix in (".py", ".pyc"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED_FILES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        bad += [f"{rel}: {m.group(1)!r}" for m in NAME.finditer(text)]
    assert not bad, "value names outside the spec (derive them from it):\n" + "\n".join(bad)


def _value_rows(text: str) -> list[str]:
    """Markdown table rows whose first cell names declared values, and nothing else."""
    one = r"`(?:" + "|".join(map(re.escape, spec.VALUES)) + r")`"
    first = re.compile(r"^\|\s*" + one + r"(?:\s*,\s*" + one + r")*\s*\|")
    return [line for line in text.splitlines() if first.match(line)]


def test_each_value_is_described_once_in_the_docs() -> None:
    from quantpatch.base.values import summary_table

    generated = set(_value_rows(summary_table()))
    assert len(generated) == len(spec.VALUES), "the generated table has a row per value"
    extra = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rows = _value_rows(path.read_text(encoding="utf-8"))
        extra += [f"{path.name}: {r[:80]}" for r in rows if r not in generated]
    assert not extra, "a value described again beside the generated table:\n" + "\n".join(extra)


TRACKER = re.compile(
    r"(?i)\bissues? ?#?[0-9]+|\bissue[0-9]+|(?<![&\w])#[0-9]{2}\b"
    # a tracker's finding by its number: "Findings N and M:", a section "# -- N: ..."
    r"|\bfindings? [0-9]+[a-z]?(?: and [0-9]+[a-z]?)?:|^\s*# -- [0-9]+[a-z]?[:,]"
)


def test_no_tracker_numbers_in_the_project_text() -> None:
    assert TRACKER.search("see issue " + "41") and TRACKER.search("(#" + "56)")
    assert TRACKER.search("Findings " + "2 and 4: x") and TRACKER.search("# -- " + "1a, 1b: x")
    assert not TRACKER.search("color: #fff; 32 issues remain? no")
    places = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("docs", "quantpatch", "tests", "benchmarks", "templates", ".ci"):
        places += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file())
    bad = []
    for path in places:
        if path.suffix in (".pyc", ".png", ".gz", ".so", ".bin", ".idx"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if TRACKER.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:90]}")
    assert not bad, "say the reason, not a tracker number:\n" + "\n".join(bad)
