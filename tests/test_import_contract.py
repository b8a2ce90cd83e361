"""The package's import contract: no module imports another that (directly or not) imports it
back, and no module takes another module's private names.

Read statically (``ast``, nothing imported), so a lazy import inside a function counts like a
top-level one: a cycle that only closes at run time is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "quantpatch"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> tuple[set[str], list[str]]:
    """The quantpatch modules ``name`` imports, and every private name it takes from one."""
    found: set[str] = set()
    private: list[str] = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bound: dict[str, str] = {}  # a local name -> the quantpatch module it is bound to
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
            bound |= {a.asname: a.name for a in node.names if a.name in known and a.asname}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.add(sub)  # `from quantpatch import repo`
                    bound[alias.asname or alias.name] = sub
                elif base in known:
                    found.add(base)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{name}: from {base} import {alias.name}")
    for node in ast.walk(tree):  # `ops._round_element`: a private name through the module
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            private.append(f"{name}: {bound[node.value.id]}.{node.attr}")
    found.discard(name)
    return {m for m in found if m.startswith("quantpatch")}, private


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    graph, private = {}, []
    for name, path in mods.items():
        graph[name], taken = _imports(name, path, set(mods))
        private += taken
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    graph, _ = _graph()
    assert len(graph) > 40  # the walk saw the package
    assert cycles(graph) == []


def test_the_runtime_copied_into_checkouts_imports_nothing_of_quantpatch():
    graph, _ = _graph()
    runtime = {m: deps for m, deps in graph.items() if m.startswith("quantpatch.runtime")}
    outside = {m: d for m, deps in runtime.items() if (d := deps - set(runtime))}
    assert len(runtime) > 3 and outside == {}


def test_no_module_takes_another_modules_private_names():
    _, private = _graph()
    assert private == []


LAYERS = {
    "quantpatch.runtime": set(),
    "quantpatch.base": set(),
    "quantpatch.sites": {"quantpatch.base"},
    "quantpatch.git": {"quantpatch.base", "quantpatch.sites"},
    "quantpatch.checkout": {"quantpatch.base", "quantpatch.sites", "quantpatch.git"},
    "quantpatch.data_prep": {"quantpatch.base"},
    "quantpatch.launch": {
        "quantpatch.base",
        "quantpatch.sites",
        "quantpatch.git",
        "quantpatch.checkout",
        "quantpatch.data_prep",
    },
    "quantpatch.analysis": {"quantpatch.base", "quantpatch.runtime"},
}
"""What each package may import besides itself (and ``quantpatch.__version__``); ``cli`` may
import everything, and nothing may import ``cli``."""


SPEC_MODULE = "quantpatch.runtime.quantpatch_formats"
"""The one runtime module every package may import: the format spec, standard library only
(installed into checkouts with the runtime, read by the CLI without torch)."""

TOP = ("quantpatch", "quantpatch.__main__", "quantpatch.cli")
"""The package's own module (``__version__``), ``python -m quantpatch`` and the CLI."""


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def upward(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        here = _package(mod)
        for dep in sorted(deps):
            there = _package(dep)
            if there in (here, "quantpatch") or here in TOP or dep == SPEC_MODULE:
                continue
            if here not in LAYERS or there not in LAYERS[here]:
                out.append(f"{mod} -> {dep}")
    return out


def test_every_module_lives_in_a_package_of_the_contract():
    graph, _ = _graph()
    loose = [m for m in graph if _package(m) not in {*LAYERS, *TOP}]
    assert loose == []


def test_the_upward_finder_finds_an_upward_import():
    assert upward(
        {"quantpatch.sites.discovery.x": {"quantpatch.git.repo", "quantpatch.base.errors"}}
    ) == ["quantpatch.sites.discovery.x -> quantpatch.git.repo"]


def test_no_package_imports_one_above_it():
    graph, _ = _graph()
    assert upward(graph) == []


def test_the_format_spec_imports_the_standard_library_only():
    """Every package may import the spec (``SPEC_MODULE``) because it imports nothing but the
    standard library: read statically, every top-level name it imports is a stdlib module."""
    import sys

    path = PACKAGE / "runtime" / "quantpatch_formats.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {
        (n.module or "").split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.level == 0
    }
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert imported and relative == []
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


def test_every_runtime_module_stays_under_1200_lines_and_the_savers_under_800():
    sizes = {
        str(p.relative_to(PACKAGE / "runtime")): len(p.read_text(encoding="utf-8").splitlines())
        for p in (PACKAGE / "runtime").rglob("*.py")
    }
    saver = {n: s for n, s in sizes.items() if n.startswith("quantpatch_saver/")}
    assert len(saver) == 11 and "tensor_saver.py" in sizes
    saver["tensor_saver.py"] = sizes["tensor_saver.py"]
    assert {n: s for n, s in saver.items() if s > 800} == {}
    assert {n: s for n, s in sizes.items() if s >= 1200} == {}


def _installed_modules(sources: dict[str, str]) -> set[str]:
    """The ``quantpatch.runtime`` modules that an install's files copy (installed path ->
    runtime file), a package's ``__init__`` by the package's name."""
    return {
        "quantpatch." + src.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for src in sources.values()
    }


def test_saver_install_copies_every_part_the_saver_imports():
    """A checkout imports ``megatron.core.quantpatch.tensor_saver`` (and, a fork's callers,
    ``megatron.core.tensor_saver``, which is that module); every runtime module it reaches
    by its relative imports must be among the files ``saver install`` copies into the
    runtime's package."""
    from quantpatch.checkout.parts import PACKAGE, SAVER_IMPL, SAVER_MODULE, SAVER_SOURCES

    assert SAVER_SOURCES[SAVER_IMPL] == "runtime/tensor_saver.py"
    assert all(rel.startswith(PACKAGE + "/") for rel in SAVER_SOURCES if rel != SAVER_MODULE)
    graph, _ = _graph()
    installed = _installed_modules(SAVER_SOURCES)
    reached, todo = set(), ["quantpatch.runtime.tensor_saver"]
    while todo:
        mod = todo.pop()
        if mod not in reached:
            reached.add(mod)
            todo += graph[mod]
    # the package's ``__init__`` is imported with its modules (it imports nothing itself), and
    # saver_path.py (megatron.core.tensor_saver) imports the saver by name at run time
    assert reached | {"quantpatch.runtime.quantpatch_saver", "quantpatch.runtime.saver_path"} == (
        installed
    )


def test_init_installs_every_runtime_module_the_installed_ones_import():
    """A checkout imports ``megatron.core.quantpatch.quantpatch_ops``; every runtime module it
    reaches by its relative imports must be among the files ``init`` installs beside it, in
    the package, and the package's ``__init__.py`` names every one of them."""
    from quantpatch.checkout.parts import PACKAGE, RUNTIME_MODULES, SAVER_SOURCES

    graph, _ = _graph()
    installed = _installed_modules(RUNTIME_MODULES)
    assert all(rel.startswith(PACKAGE + "/") for rel in RUNTIME_MODULES)
    reached, todo = set(), ["quantpatch.runtime.quantpatch_ops"]
    while todo:
        mod = todo.pop()
        if mod not in reached:
            reached.add(mod)
            todo += graph[mod]
    assert len(reached) > 5 and reached <= installed
    doc = (PACKAGE_DIR := Path(__file__).parent.parent / "quantpatch/runtime/package_init.py")
    text = ast.get_docstring(ast.parse(doc.read_text(encoding="utf-8"))) or ""
    for rel in (*RUNTIME_MODULES, *SAVER_SOURCES):
        name = rel.removeprefix(PACKAGE + "/")
        if rel.startswith(PACKAGE + "/") and name != "__init__.py":
            shown = name.split("/")[0] + "/" if "/" in name else name
            assert f"``{shown}``" in text, f"{PACKAGE_DIR.name} does not describe {name}"


def test_only_the_env_module_reads_the_environment():
    """The runtime reads its environment variables in ``quantpatch_env.py`` alone (the tensor
    saver, copied into checkouts on its own, keeps its ``TENSOR_SAVE_*`` settings): read
    statically, no other runtime module touches ``os.environ`` or ``os.getenv``."""
    readers = []
    for path in sorted((PACKAGE / "runtime").glob("*.py")):
        if path.name in ("quantpatch_env.py", "tensor_saver.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "getenv")
            ):
                readers.append(f"{path.name}:{node.lineno}")
    assert readers == []
