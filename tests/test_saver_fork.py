"""``saver install --force`` on a fork that ships its own tensor saver (``tests/forklike.py``):
the fork's callers keep working (and gain async saving, layer numbers and backward tensors),
the fork's ``CustomLinear...`` copy is instrumented, ``remove`` restores every byte, and a
caller the installed module would not serve is refused before anything changes."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import libcst as cst
import pytest

from quantpatch.checkout.init import OPS_MODULES
from quantpatch.checkout.saver import SAVER_MODULE

from .conftest import run_probe, snapshot
from .forklike import (
    ATTENTION,
    CUSTOM_CLASS,
    FORK_SAVER_SOURCE,
    LINEAR,
    STOCK_CLASS,
    build_fork,
    clone_quant,
    git,
)

HERE = Path(__file__).parent
CALL_PROBE = HERE / "saver_fork_probe.py"
MODEL_PROBE = HERE / "saver_probe.py"
QUIET = {"PYTHONDONTWRITEBYTECODE": "1"}  # running the checkout leaves no file behind


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory, trees: dict[str, Path]):
    return build_fork(tmp_path_factory.mktemp("fork") / "origin", trees["0.13.1"], full=True)


@pytest.fixture
def clone(origin, tmp_path: Path) -> Path:
    return clone_quant(origin, tmp_path / "Megatron-LM")


def _class_code(text: str, name: str) -> str:
    module = cst.parse_module(text)
    node = next(s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == name)
    return module.code_for_node(node)


def _function_code(class_code: str, name: str) -> str:
    cls = cst.parse_module(class_code).body[0]
    assert isinstance(cls, cst.ClassDef)
    node = next(s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name)
    return cst.Module([]).code_for_node(node)


def _saved(d: Path) -> list[tuple[str, dict]]:
    torch = pytest.importorskip("torch")
    return [(p.name, torch.load(p)) for p in sorted(d.glob("*.pt"))]


def test_check_says_a_different_saver_is_installed(run, clone):
    data = json.loads(run("check", "--json", "--repo", clone).out)
    assert data["saver"]["installed"] is False and data["saver"]["other"] is True
    text = run("check", "--repo", clone).out
    assert "tensor saver: a different tensor saver is installed" in text
    assert "a different tensor saver is installed" in run("saver", "status", "--repo", clone).out


@pytest.mark.slow  # 35 s; the fork saver's other tests stay fast
def test_force_install_serves_the_forks_callers_and_remove_restores_every_byte(
    run, clone, tmp_path
):
    torch = pytest.importorskip("torch")
    before = snapshot(clone)
    res = run("saver", "install", "--repo", clone)
    assert res.code == 2 and "a different tensor saver is already there" in res.err
    assert snapshot(clone) == before
    res = run("saver", "install", "--force", "--repo", clone)
    assert res.code == 0, res

    # read back: the fork's CustomLinear copy (the class that runs, holding the dispatches)
    # is instrumented with the site variable; the stock class is not
    linear = (clone / LINEAR).read_text()
    custom = _class_code(linear, CUSTOM_CLASS)
    assert "_qp_saver" not in _class_code(linear, STOCK_CLASS)
    forward, backward = _function_code(custom, "forward"), _function_code(custom, "backward")
    assert (
        "_qp_saver.save_linear_tensors(total_input, weight, custom_quant_type, 'forward'" in forward
    )
    assert (
        "_qp_saver.save_linear_tensors(grad_output, weight, custom_quant_type, 'backward'"
        in backward
    )
    assert "save_linear_tensors(input_tensor=total_input" in forward  # the fork's, untouched
    attention = (clone / ATTENTION).read_text()
    assert "_qp_saver.save_attention_tensors(query, key, None, custom_quant_type" in attention
    assert "save_attention_tensors(query=query, key=key, value=value" in attention

    data = json.loads(run("check", "--json", "--repo", clone).out)
    assert data["saver"]["installed"] is True and data["saver"]["replaced"] is True
    assert data["saver"]["other"] is False and data["saver"]["module_matches"] is True
    assert "tensor saver: installed (in place of the checkout's own)" in (
        run("check", "--repo", clone).out
    )

    # the fork's own call sites, imported and run with the installed module
    logs = tmp_path / "calls"
    got, err = run_probe(
        CALL_PROBE,
        clone,
        tmp_path / "calls.pt",
        TENSOR_SAVE_ENABLED="true",
        TENSOR_SAVE_DIR=str(logs),
        **QUIET,
    )
    assert got["enabled"] is True and got["iteration"] == 7
    report = got["report"]  # 4 attention + 2 linear + 1 positional + 1 method
    assert (report["files"], report["dropped"], report["failed"]) == (8, 0, 0)
    returned = got["returned"]
    assert returned["again"] == {"input": None, "weight": None}  # the same tensors: once
    paths = {
        *returned["attention"].values(),
        *returned["linear"].values(),
        returned["positional"],
        returned["method"],
    }
    files = dict(_saved(logs))
    assert {str(logs / n) for n in files} == paths
    by_name = {
        (d["metadata"]["layer_type"], d["metadata"]["tensor_name"], d["metadata"]["operation"]): d
        for d in files.values()
    }
    t = got["tensors"]
    for name, key in (("query", "query"), ("key", "key"), ("value", "value")):
        d = by_name[("attention", name, "forward")]
        assert torch.equal(d["tensor"], t[key])
        assert d["metadata"]["phase"] == "pre" and d["metadata"]["component"] == "FA"
        assert d["metadata"]["layer_idx"] == 3 and d["metadata"]["quant_type"] == "hifp8"
    assert torch.equal(by_name[("attention", "attention_probs", "forward")]["tensor"], t["probs"])
    lin = by_name[("linear", "input", "forward")]
    assert torch.equal(lin["tensor"], t["x"]) and lin["metadata"]["quant_type"] == "mxfp8"
    assert lin["metadata"]["module_kind"] == "output_layer"  # no layer owns this weight
    back = by_name[("linear", "grad_output", "backward")]["metadata"]
    assert (back["phase"], back["component"], back["rank"], back["n"]) == ("post", "linear", 0, 1)
    assert back["layer_idx"] == 2 and back["quant_type"] == "mxfp4"
    assert all(d["metadata"]["iteration"] == 7 for d in files.values())
    assert "Traceback" not in err

    # saving off: the same calls run and write nothing
    off, _ = run_probe(
        CALL_PROBE, clone, tmp_path / "off.pt", TENSOR_SAVE_DIR=str(tmp_path / "none"), **QUIET
    )
    assert off["enabled"] is False and off["report"]["files"] == 0
    assert off["returned"]["linear"] == {"input": None, "weight": None}
    assert not (tmp_path / "none").exists()

    _fork_model_saves_once_per_tensor(clone, tmp_path)

    assert run("saver", "remove", "--repo", clone).code == 0
    after = snapshot(clone)
    assert after["files"] == before["files"]  # every file, the fork's saver included
    assert (clone / SAVER_MODULE).read_text() == FORK_SAVER_SOURCE
    assert "a different tensor saver is installed" in run("check", "--repo", clone).out


def _fork_model_saves_once_per_tensor(clone: Path, tmp_path: Path) -> None:
    """The fork's GPT on CPU: training unchanged; the fork's own linear and attention calls
    and the inserted ones save each tensor once, with layer numbers, forward and backward."""
    torch = pytest.importorskip("torch")
    # the fork's dispatches call quantpatch_ops (hifp8): it and the parts it imports
    installed = [clone / rel for rel in OPS_MODULES]
    for dest in installed:
        shutil.copy(Path(__file__).parents[1] / "quantpatch/runtime" / dest.name, dest)
    try:
        off, _ = run_probe(MODEL_PROBE, clone, tmp_path / "m_off.pt", "2", **QUIET)
        logs = tmp_path / "model"
        on, _ = run_probe(
            MODEL_PROBE,
            clone,
            tmp_path / "m_on.pt",
            "2",
            TENSOR_SAVE_ENABLED="true",
            TENSOR_SAVE_DIR=str(logs),
            **QUIET,
        )
    finally:
        for dest in installed:
            dest.unlink()
    assert torch.equal(off["losses"], on["losses"])
    for name, grad in off["grads"].items():
        assert torch.equal(grad, on["grads"][name]), name
    per: collections.Counter[tuple] = collections.Counter()
    phases = set()
    for _, d in _saved(logs):
        m = d["metadata"]
        assert m["quant_type"] == "hifp8"
        key = (m["layer_idx"], m["module_kind"], m["operation"], m["tensor_name"])
        per[(*key, m["micro_step"])] += 1
        if m["layer_type"] == "linear" and m["operation"] == "forward":
            phases.add(m.get("phase"))
    assert phases == {"pre"}  # the fork's own linear call saved them, the inserted one skipped
    assert set(per.values()) == {1}
    for step in range(2):
        for layer in (1, 2):
            for kind in ("qkv", "proj", "fc1", "fc2"):
                for op, name in (("forward", "input"), ("backward", "grad_output")):
                    assert per[(layer, kind, op, name, step)] == 1
            for name in ("query", "key", "value", "attention_probs"):
                assert per[(layer, "core_attention", "forward", name, step)] == 1


def test_install_refuses_a_caller_the_saver_does_not_serve(run, clone):
    extra = clone / "megatron/training/extra_hooks.py"
    extra.write_text(
        "from megatron.core.tensor_saver import save_linear_tensors, save_everything\n"
        "from megatron.core import tensor_saver as ts\n"
        "\n"
        "\n"
        "def hook(x, w, it):\n"
        "    save_linear_tensors(x, w, 'bf16', 'forward', flush_now=True)\n"
        "    saver = ts.get_tensor_saver()\n"
        "    saver.set_iteration(it)\n"
        "    return saver.histogram(x), saver.enabled\n"
    )
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "more saver callers")
    before = snapshot(clone)
    res = run("saver", "install", "--force", "--repo", clone)
    assert res.code == 2, res
    rel = "megatron/training/extra_hooks.py"
    assert (
        f"{rel}:1 save_everything, {rel}:6 save_linear_tensors(flush_now=), "
        f"{rel}:9 TensorSaver.histogram; nothing was changed." in res.err
    )
    assert len(res.err.strip().splitlines()) == 1 and "Traceback" not in res.err
    assert snapshot(clone) == before


def test_callers_are_read_in_every_import_form(tmp_path):
    from quantpatch.checkout.saver import saver_source
    from quantpatch.checkout.saver_callers import served_api, unserved_uses

    user = tmp_path / "megatron/core/sub/user.py"
    user.parent.mkdir(parents=True)
    user.write_text(
        "from ..tensor_saver import save_tensor as st, nope\n"
        "from .. import tensor_saver\n"
        "import megatron.core.tensor_saver\n"
        "import megatron.core as mc\n"
        "from megatron.core.tensor_saver import *\n"
        "from megatron.core.tensor_saver import TensorSaver\n"
        "\n"
        "\n"
        "def f(x):\n"
        "    st(x, 'linear', 'forward', None, 'input', extra=1)\n"
        "    tensor_saver.ENABLED = True\n"
        "    tensor_saver.not_there\n"
        "    megatron.core.tensor_saver.save_linear_tensors(x, x, None, bad=2)\n"
        "    mc.tensor_saver.get_tensor_saver().counter = 3\n"
        "    s = TensorSaver(save_dir='d', colour='red')\n"
        "    s.save_tensor(x, 'a', 'b', None, 'c', *[1])\n"
        "    s.iteration = 4\n"
        "    s.set_iteration(1, 2)\n"
        "    return s.nothing, tensor_saver.flush(), st(x, 'l', 'f', None, 'i', 1, 'pre')\n"
    )
    (tmp_path / "megatron/core/broken.py").write_text("import tensor_saver (\n")
    (tmp_path / ".venv/lib").mkdir(parents=True)
    (tmp_path / ".venv/lib/other.py").write_text("from megatron.core.tensor_saver import x\n")
    planned = {"megatron/extra.py": "from megatron.core.tensor_saver import planned_name\n"}
    uses = unserved_uses(tmp_path, served_api(saver_source()), planned, skip="none")
    rel = "megatron/core/sub/user.py"
    assert [str(u) for u in uses] == [
        f"{rel}:1 nope",
        f"{rel}:10 save_tensor(extra=)",
        f"{rel}:12 not_there",
        f"{rel}:13 save_linear_tensors(bad=)",
        f"{rel}:14 TensorSaver.counter (read-only)",
        f"{rel}:15 TensorSaver(colour=)",
        f"{rel}:18 TensorSaver.set_iteration(2 positional arguments)",
        f"{rel}:19 TensorSaver.nothing",
        "megatron/extra.py:1 planned_name",
    ]
