"""The content-addressed discovery cache: hits skip libcst, any change misses, bad entries heal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quantpatch import site_cache
from quantpatch.config import Targets
from quantpatch.sites import discover_source

from .conftest import ATTENTION, LINEAR


def test_hit_equals_fresh_discovery_and_any_change_misses(make_checkout, tmp_path):
    root = make_checkout()
    cache = tmp_path / "cache"
    first = site_cache.read_sites(root, Targets(), cache)
    assert len(list(cache.glob("sites-*.json"))) == 2
    assert site_cache.read_sites(root, Targets(), cache) == first
    text = (root / ATTENTION).read_text()
    assert first[1] == discover_source(text, ATTENTION, "attention").sites
    # one changed byte: a different key, so the stale entry can never be used
    changed = text.replace("custom_quant_type = 'bf16'", "custom_quant_type = 'hifp8'", 1)
    (root / ATTENTION).write_text(changed)
    again = site_cache.read_sites(root, Targets(), cache)
    assert [s.value for s in again[1]] == ["hifp8", "bf16"]
    assert len(list(cache.glob("sites-*.json"))) == 3


def test_corrupt_entry_is_rediscovered(make_checkout, tmp_path):
    root = make_checkout()
    cache = tmp_path / "cache"
    good = site_cache.read_sites(root, Targets(), cache)
    for entry in cache.glob("sites-*.json"):
        entry.write_text("{not json")
    assert site_cache.read_sites(root, Targets(), cache) == good
    for entry in cache.glob("sites-*.json"):
        assert isinstance(json.loads(entry.read_text())["sites"], list)


def test_cache_is_pruned(tmp_path):
    for i in range(site_cache.KEEP + 5):
        site_cache.store(tmp_path, LINEAR, "linear", f"x = {i}\n", [])
    assert len(list(tmp_path.glob("sites-*.json"))) == site_cache.KEEP


@pytest.mark.parametrize("after_set", [False, True])
def test_warm_check_imports_no_parser_and_no_gitpython(run, make_checkout, after_set):
    """A warm check reads the cache and asks git directly: no libcst, no GitPython, no
    pydantic (start-up bar of issue 13), before a set and with a set's record to verify."""
    root = make_checkout()
    if after_set:
        assert run("set", "--repo", root, "--qk", "mxfp4").code == 0  # also primes the cache
    else:
        assert run("check", "--repo", root).code == 0  # primes the cache
    code = (
        "import sys\nsys.argv=['quantpatch','check','--repo',sys.argv[1]]\n"
        "from quantpatch.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('LOADED', [m for m in ('libcst','git','pydantic','torch') if m in sys.modules])\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=False
    )
    assert "LOADED []" in res.stdout, res.stdout + res.stderr
    if after_set:
        assert "_qk-mxfp4_" in res.stdout and "base (branch): main @" in res.stdout
