"""``megatron/core/tensor_saver.py`` (``runtime/saver_path.py``): importing it gives the
package's saver module itself, so a fork's callers and the inserted calls share one saver.

The file runs only as a copy inside a checkout (the fork tests exercise it there); here its own
source runs in-process, under a package laid out as a checkout lays it out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).parents[1] / "quantpatch" / "runtime" / "saver_path.py"


def _run(package: str) -> None:
    """The file's own code, as Python runs it when ``<package>.tensor_saver`` is imported."""
    code = compile(SOURCE.read_text(encoding="utf-8"), str(SOURCE), "exec")
    exec(code, {"__name__": f"{package}.tensor_saver", "__package__": package})


def test_importing_the_old_path_gives_the_packages_saver(tmp_path: Path, monkeypatch) -> None:
    core = tmp_path / "core_like"
    (core / "quantpatch").mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "quantpatch" / "__init__.py").write_text("")
    (core / "quantpatch" / "tensor_saver.py").write_text("CONFIGURED = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("core_like")]:
        monkeypatch.delitem(sys.modules, name)
    _run("core_like")
    saver = sys.modules["core_like.quantpatch.tensor_saver"]
    assert sys.modules["core_like.tensor_saver"] is saver  # one module under both names
    import core_like.tensor_saver as old_path  # a fork's caller's import

    old_path.CONFIGURED.append(1)
    assert saver.CONFIGURED == [1]  # its state is the saver's
    for name in [m for m in sys.modules if m.startswith("core_like")]:
        monkeypatch.delitem(sys.modules, name)


def test_without_the_package_the_import_fails_plainly(tmp_path: Path, monkeypatch) -> None:
    """A checkout whose package was removed by hand: the import error names the module."""
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match=r"bare\.quantpatch"):
        _run("bare")
    for name in [m for m in sys.modules if m.startswith("bare")]:
        monkeypatch.delitem(sys.modules, name)
