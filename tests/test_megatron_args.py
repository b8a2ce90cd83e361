"""Reading a checkout's own Megatron-LM argument parser: literal add_argument calls in every
shape upstream writes them, imported extension modules, dataclass-built groups (read from the
real megatron-core 0.13.1 TransformerConfig), the release, parse errors, and the cache."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from quantpatch.base.errors import UserError
from quantpatch.launch import megatron_args, megatron_release
from quantpatch.launch.megatron_args import read_release
from quantpatch.launch.megatron_files import ARGUMENTS, PACKAGE_INFO
from quantpatch.launch.megatron_release import checkout_release

from .megatron_parser import EXTENSION, bundled_flags, write_parser


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_every_literal_shape_and_nothing_else(tmp_path):
    _write(
        tmp_path,
        ARGUMENTS,
        """\
        import argparse

        def parse_args():
            parser = argparse.ArgumentParser(description='Megatron-LM Arguments')
            parser.add_argument('--direct', type=int)
            group = parser.add_argument_group(title='--not-a-flag group')
            group.add_argument("--double-quoted", action='store_true',
                               help='--help-text-is-not-a-flag')
            group.add_argument('--first', '--second-alias', dest='first')
            group.add_argument('--implicit-'
                               'concatenation', type=str)
            group.add_argument('-s', '--short-and-long', metavar='--metavar-is-not-a-flag')
            group.add_argument(*NAMES, type=int)
            group.add_argument(f'--{"formatted"}', type=int)
            group.add_argument(b'--bytes', type=int)
            group.add_argument('positional')
            add_argument('--bare-call-is-not-a-parser')
            return parser
        """,
    )
    release = read_release(tmp_path)
    assert release is not None
    assert release.flags == {
        "--direct",
        "--double-quoted",
        "--first",
        "--second-alias",
        "--implicit-concatenation",
        "--short-and-long",
    }
    assert release.version is None and release.name == "(version unknown)"
    assert release.files == (ARGUMENTS,) and release.unresolved == ()


def test_synthetic_parser_of_the_real_shape_gives_the_whole_list(tmp_path):
    moved = ["--transformer-impl", "--no-gradient-accumulation-fusion", "--num-layers"]
    path = write_parser(tmp_path, extension=moved)
    assert len(path.read_text().splitlines()) > 2500
    release = read_release(tmp_path)
    assert release is not None
    assert release.flags == set(bundled_flags())
    assert "'--num-layers'" not in (tmp_path / ARGUMENTS).read_text()
    assert release.version == "0.15.0rc3"
    assert release.files == (ARGUMENTS, EXTENSION)
    assert {rel for rel, _ in release.inputs} == {ARGUMENTS, EXTENSION, PACKAGE_INFO}


def test_imports_followed_one_level_and_only_with_add_argument(tmp_path):
    _write(
        tmp_path,
        ARGUMENTS,
        """\
        import torch
        from megatron.training import fork_args
        from .helpers import helper
        from megatron.core.absent import nothing

        def parse_args(parser):
            parser.add_argument('--own')
            return fork_args.add(parser)
        """,
    )
    _write(
        tmp_path,
        "megatron/training/fork_args.py",
        """\
        from megatron.training.deeper import more

        def add(parser):
            parser.add_argument('--from-fork')
            return more(parser)
        """,
    )
    _write(
        tmp_path,
        "megatron/training/deeper.py",
        "def more(parser):\n    parser.add_argument('--two-levels-down')\n    return parser\n",
    )
    _write(tmp_path, "megatron/training/helpers.py", "def helper():\n    return 'add_arg'\n")
    release = read_release(tmp_path)
    assert release is not None
    assert release.flags == {"--own", "--from-fork"}
    assert release.files == (ARGUMENTS, "megatron/training/fork_args.py")


def test_release_from_package_info(tmp_path, trees):
    _write(tmp_path, ARGUMENTS, "def f(p):\n    p.add_argument('--x')\n")
    real = (trees["0.13.1"] / "core" / "package_info.py").read_text()
    _write(tmp_path, PACKAGE_INFO, real)
    assert read_release(tmp_path).version == "0.13.1"  # the real megatron-core file
    _write(tmp_path, PACKAGE_INFO, "MAJOR = 0\nMINOR = 16\nPATCH = 0\nPRE_RELEASE = 'rc0'\n")
    assert read_release(tmp_path).name == "0.16.0rc0"
    _write(tmp_path, PACKAGE_INFO, "MAJOR = compute()\nMINOR = 16\nPATCH = 0\n")
    assert read_release(tmp_path).version is None
    (tmp_path / ARGUMENTS).unlink()
    assert read_release(tmp_path) is None


@pytest.mark.parametrize(
    ("rel", "where", "old", "new"),
    [
        (ARGUMENTS, "--seq-length", ".add_argument(", ".add_argument(="),
        (EXTENSION, "--num-layers", ".add_argument(", ".add_argument(="),
        (PACKAGE_INFO, "MINOR", "=", "= ="),
    ],
)
def test_a_file_that_does_not_parse_names_its_line(tmp_path, rel, where, old, new):
    """The line is the real one (libcst alone reports the next line inside a function)."""
    write_parser(tmp_path, extension=["--num-layers"])
    path = tmp_path / rel
    lines = path.read_text().splitlines(keepends=True)
    bad = next(i for i, line in enumerate(lines) if where in line)
    lines[bad] = lines[bad].replace(old, new, 1)
    path.write_text("".join(lines))
    with pytest.raises(UserError) as exc:
        read_release(tmp_path)
    assert (
        str(exc.value) == f"{path}:{bad + 1}: the file does not parse as Python (invalid syntax)."
    )


CONFIG_USE = """\
import argparse
import dataclasses

from megatron.core.transformer import TransformerConfig
from megatron.training.argument_utils import ArgumentGroupFactory


def add_megatron_arguments(parser):
    group = parser.add_argument_group(title="core")
    group.add_argument("--seq-length", type=int, default=None)
    exclude = ["add_bias_linear", "num_moe_experts"]
    ArgumentGroupFactory(TransformerConfig, exclude=exclude).build_group(parser, "transformer")

    from megatron.training import fork_config
    from megatron.training.config import LoggerConfig

    ArgumentGroupFactory(fork_config.ForkConfig, ["skipped"]).build_group(parser, "fork")
    ArgumentGroupFactory(LoggerConfig).build_group(parser, "logging")
    return parser
"""

FORK_CONFIG = """\
from dataclasses import dataclass, field
from typing import ClassVar, Optional


@dataclass
class ForkConfig:
    quant_block: int = 32
    quant_enabled: bool = False
    quant_fused: bool = True
    quant_maybe: Optional[bool] = None
    quant_off: bool = field(default=False)
    quant_on: bool = field(default_factory=lambda: True)
    skipped: int = 1
    renamed: str = field(default="x", metadata={"argparse_meta": {"arg_names": ["--old-name"]}})
    derived: int = field(init=False, default=0)
    registry: ClassVar[dict] = {}

    def method(self) -> None:
        local: int = 3
"""


def test_dataclass_groups_from_the_real_transformer_config(tmp_path, trees):
    """Newer releases build most flags with ArgumentGroupFactory from dataclass fields."""
    shutil.copytree(trees["0.13.1"], tmp_path / "megatron")
    _write(tmp_path, ARGUMENTS, CONFIG_USE)
    _write(tmp_path, "megatron/training/fork_config.py", FORK_CONFIG)
    release = read_release(tmp_path)
    assert release is not None
    flags = release.flags
    # TransformerConfig (re-exported by megatron/core/transformer/__init__.py)
    assert {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-router-topk"} <= flags
    assert "--gated-linear-unit" in flags  # bool, default False: store_true
    assert {"--no-fp8-wgrad", "--disable-fp8-wgrad"} <= flags  # bool, default True
    assert "--fp8-wgrad" not in flags
    assert "--no-distribute-saved-activations" in flags  # Optional[bool] = None
    assert "--moe-router-padding-for-fp8" in flags  # Optional[bool] = False
    # its base class ModelParallelConfig, in another module
    assert {"--tensor-model-parallel-size", "--sequence-parallel"} <= flags
    # excluded by a list bound earlier in the function
    assert not {"--no-add-bias-linear", "--add-bias-linear", "--num-moe-experts"} & flags
    # the fork's dataclass: positional exclude, argparse_meta names, init=False, ClassVar
    assert {"--quant-block", "--quant-enabled", "--no-quant-fused", "--disable-quant-fused"} <= (
        flags
    )
    assert {"--no-quant-maybe", "--old-name", "--seq-length", "--quant-off", "--no-quant-on"} <= (
        flags
    )
    assert not {"--skipped", "--renamed", "--derived", "--registry", "--local"} & flags
    assert release.unresolved == ("LoggerConfig",)
    assert release.files == (
        ARGUMENTS,
        "megatron/core/model_parallel_config.py",
        "megatron/core/transformer/transformer_config.py",
        "megatron/training/fork_config.py",
    )
    assert release.version == "0.13.1"


def test_cache_by_content(tmp_path, monkeypatch):
    write_parser(tmp_path, extension=["--num-layers"])
    cache = tmp_path / "state" / "cache"
    first = checkout_release(tmp_path, cache)
    assert first is not None and len(list(cache.glob("flags-*.json"))) == 1

    def no_parsing(root: Path) -> None:
        raise AssertionError("parsed although nothing changed")

    monkeypatch.setattr(megatron_args, "read_release", no_parsing)
    assert checkout_release(tmp_path, cache) == first
    monkeypatch.undo()
    # any file the reading looked at changes: read again
    ext = tmp_path / EXTENSION
    ext.write_text(ext.read_text().replace(".add_argument(", ".add_argument('--layers', ", 1))
    second = checkout_release(tmp_path, cache)
    assert second is not None and second.flags == first.flags | {"--layers"}
    info = tmp_path / PACKAGE_INFO
    info.write_text(info.read_text().replace("'rc3'", "'rc4'"))
    assert checkout_release(tmp_path, cache).version == "0.15.0rc4"
    info.unlink()
    assert checkout_release(tmp_path, cache).version is None
    # a corrupt entry is ignored; an unwritable cache only costs time
    for entry in cache.glob("flags-*.json"):
        entry.write_text("{not json")
    assert checkout_release(tmp_path, cache).flags == second.flags
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    assert checkout_release(tmp_path, blocker / "cache").flags == second.flags
    (tmp_path / ARGUMENTS).unlink()
    assert checkout_release(tmp_path, cache) is None


def test_cache_keeps_the_newest_entries(tmp_path):
    cache = tmp_path / "cache"
    for i in range(megatron_release.KEEP + 3):
        _write(tmp_path, ARGUMENTS, f"def f(p):\n    p.add_argument('--flag-{i}')\n")
        assert checkout_release(tmp_path, cache).flags == {f"--flag-{i}"}
    assert len(list(cache.glob("flags-*.json"))) == megatron_release.KEEP
