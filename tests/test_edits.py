"""The all-or-nothing writer, with injected failures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quantpatch.base import edits as edits_mod
from quantpatch.base.edits import Edit, apply_edits, unified_diff
from quantpatch.base.errors import UserError


def _files(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.py", tmp_path / "sub" / "b.py"
    b.parent.mkdir()
    a.write_text("a = 1\n")
    b.write_text("b = 1\r\n")
    return a, b


def test_writes_all_and_keeps_mode_and_crlf(tmp_path):
    a, b = _files(tmp_path)
    os.chmod(a, 0o755)
    written = apply_edits(
        tmp_path,
        [
            Edit("a.py", "a = 1\n", "a = 2\n"),
            Edit("sub/b.py", "b = 1\r\n", "b = 2\r\n"),
            Edit("same.py", None, None),
        ],
    )
    assert written == ["a.py", "sub/b.py"]
    assert a.read_bytes() == b"a = 2\n" and b.read_bytes() == b"b = 2\r\n"
    assert a.stat().st_mode & 0o777 == 0o755
    assert not list(tmp_path.rglob("*.quantpatch-tmp"))


def test_failure_between_two_replacements_leaves_both_files(tmp_path, monkeypatch):
    a, b = _files(tmp_path)
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(edits_mod.os, "replace", flaky)
    with pytest.raises(UserError, match="every file was left as it was"):
        apply_edits(
            tmp_path,
            [Edit("a.py", "a = 1\n", "a = 2\n"), Edit("sub/b.py", "b = 1\r\n", "b = 2\r\n")],
        )
    monkeypatch.setattr(edits_mod.os, "replace", real)
    assert a.read_bytes() == b"a = 1\n" and b.read_bytes() == b"b = 1\r\n"
    assert not list(tmp_path.rglob("*.quantpatch-tmp"))


def test_failure_writing_a_temp_file_changes_nothing(tmp_path, monkeypatch):
    a, b = _files(tmp_path)
    real = edits_mod._write_temp
    seen = []

    def fail_second(target, text, mode=None):
        seen.append(target)
        if len(seen) == 2:
            raise OSError(13, "Permission denied")
        return real(target, text, mode)

    monkeypatch.setattr(edits_mod, "_write_temp", fail_second)
    with pytest.raises(UserError, match="nothing was changed"):
        apply_edits(
            tmp_path, [Edit("a.py", "a = 1\n", "x\n"), Edit("sub/b.py", "b = 1\r\n", "y\n")]
        )
    assert a.read_bytes() == b"a = 1\n" and b.read_bytes() == b"b = 1\r\n"
    assert not list(tmp_path.rglob("*.quantpatch-tmp"))


def test_create_and_delete_roll_back(tmp_path, monkeypatch):
    a, _ = _files(tmp_path)
    real = os.replace

    def fail_on_new(src, dst):
        if str(dst).endswith("new.py"):
            raise OSError(5, "I/O error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(edits_mod.os, "replace", fail_on_new)
    with pytest.raises(UserError):
        apply_edits(tmp_path, [Edit("a.py", "a = 1\n", None), Edit("new.py", None, "n\n")])
    monkeypatch.setattr(edits_mod.os, "replace", real)
    assert a.read_bytes() == b"a = 1\n"
    assert not (tmp_path / "new.py").exists()
    apply_edits(tmp_path, [Edit("a.py", "a = 1\n", None), Edit("new.py", None, "n\n")])
    assert not a.exists() and (tmp_path / "new.py").read_text() == "n\n"


def test_concurrent_change_is_refused(tmp_path):
    a, _ = _files(tmp_path)
    with pytest.raises(UserError, match="changed while quantpatch was planning"):
        apply_edits(tmp_path, [Edit("a.py", "a = 0\n", "a = 2\n")])
    assert a.read_text() == "a = 1\n"


def test_unified_diff_names_files():
    diff = unified_diff(
        [Edit("x.py", "a\n", "b\n"), Edit("y.py", "c\n", "c\n"), Edit("z.py", None, "new\n")]
    )
    assert "--- a/x.py" in diff and "+++ b/x.py" in diff and "-a\n+b\n" in diff
    assert "y.py" not in diff and "--- /dev/null" in diff
