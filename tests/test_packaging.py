"""The wheel ships the templates and data files, and an installed copy renders from them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_templates_and_data_and_renders(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("quantpatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (
        "quantpatch/templates/pretrain.sh.j2",
        "quantpatch/templates/macros.sh.j2",
        "quantpatch/templates/index.md.j2",
        "quantpatch/data/schemes.toml",
        "quantpatch/data/models.toml",
        "quantpatch/data/datasets.toml",
        "quantpatch/data/profiles.toml",
        "quantpatch/data/megatron/pretrain-flags-core_v0.13.1.txt",
    ):
        assert name in names, name
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    code = (
        "import quantpatch.launch.scripts as s, quantpatch.launch.registry as r\n"
        "import quantpatch.launch.shell_render as sh\n"
        "print(sh.template_dir())\n"
        "reg = r.load_registry()\n"
        "print(len(s.render_all(reg, list(reg.models), list(reg.datasets), "
        "reg.pick('schemes', None), 'smoke', 'core_v0.13.1')))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    where, count = res.stdout.split()
    assert Path(where).is_relative_to(target) and count == "60"
