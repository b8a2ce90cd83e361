"""The tensor saver: the install codemod, and the runtime inside a real (CPU) Megatron run."""

from __future__ import annotations

import collections
import errno
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import git
import pytest

from quantpatch.checkout.parts import SAVER_IMPL, SAVER_MODULES, runtime_source
from quantpatch.checkout.saver import SAVER_MODULE, saver_source

from .conftest import ATTENTION, LINEAR, VERSIONS, run_probe, snapshot


class _SaverParts:
    """The saver's parts (``quantpatch/runtime/quantpatch_saver/``), each imported (with
    torch) on first use."""

    def __getattr__(self, name: str):
        import importlib

        return importlib.import_module(f"quantpatch.runtime.quantpatch_saver.{name}")


sp = _SaverParts()

LAYER_FILE = "megatron/core/transformer/transformer_layer.py"
PROBE = Path(__file__).with_name("saver_probe.py")
NAME = re.compile(
    r"^\d{8}_\d{6}_(\d{4})_(linear|attention)_L(\d+|None)_(forward|backward)_"
    r"(bf16|mxfp8|mxfp4|hifp8)_(input|weight|grad_output|query|key|value|"
    r"attention_probs)\.pt$"
)


def _tree_checkout(make_checkout, version="0.13.1", **kw):
    return make_checkout(version, full=True, **kw)


@pytest.mark.parametrize("version", VERSIONS)
def test_install_remove_idempotent_and_byte_identical(run, make_checkout, version):
    root = _tree_checkout(make_checkout, version)  # fork layout (sites injected)
    before = snapshot(root)
    res = run("saver", "install", "--repo", root)
    assert res.code == 0, res
    for rel in (LINEAR, ATTENTION, LAYER_FILE):
        text = (root / rel).read_text()
        assert "# quantpatch: saver" in text
        assert "from megatron.core.quantpatch import tensor_saver as _qp_saver" in text
    assert (root / SAVER_MODULE).read_text() == runtime_source(SAVER_MODULE)  # the same module
    assert (root / SAVER_IMPL).read_text() == saver_source()
    for rel in SAVER_MODULES:  # the API and its parts, recorded
        assert (root / rel).read_text() == runtime_source(rel), rel
    assert (
        "_qp_saver.save_linear_tensors(total_input, weight, custom_quant_type, 'forward'"
        in (root / LINEAR).read_text()
    )
    repo = git.Repo(root)
    assert repo.head.commit.message.startswith("quantpatch saver install") and not repo.is_dirty()
    installed = snapshot(root)
    assert run("saver", "install", "--repo", root).out.startswith("the tensor saver is already")
    assert snapshot(root) == installed
    data = json.loads(run("check", "--json", "--repo", root).out)
    assert data["saver"]["installed"] is True and LAYER_FILE in data["saver"]["files"]
    assert [s["role"] for s in data["sites"]] == ["linear"] * 3 + ["qk", "pv"]
    st = json.loads(run("saver", "status", "--json", "--repo", root).out)
    assert st["installed"] and st["module_matches"]
    # while a set is active the saver refuses; after restore it goes
    assert run("set", "--repo", root, "--qk", "mxfp4").code == 0
    res = run("saver", "remove", "--repo", root)
    assert res.code == 2 and "restore" in res.err
    assert run("restore", "--repo", root).code == 0
    assert run("saver", "remove", "--repo", root).code == 0
    assert snapshot(root)["files"] == before["files"]
    res = run("saver", "remove", "--repo", root)
    assert res.code == 0 and "not installed" in res.out
    assert "not installed" in run("saver", "status", "--repo", root).out


def test_install_refuses_a_different_saver_unless_forced(run, make_checkout):
    root = _tree_checkout(make_checkout)
    repo = git.Repo(root)
    # a file of the saver's parts that is there already: refused by name, nothing written
    part = root / SAVER_MODULES[-1]
    part.parent.mkdir(parents=True)
    part.write_text("# someone's own\n")
    repo.git.add("-A")
    repo.git.commit("-qm", "a part of its own")
    before = snapshot(root)
    res = run("saver", "install", "--repo", root)
    assert res.code == 2 and f"{SAVER_MODULES[-1]}: a different file is already there" in res.err
    assert snapshot(root) == before
    (root / SAVER_MODULE).write_text("# the fork's own saver\n")
    repo.git.add("-A")
    repo.git.commit("-qm", "fork saver")
    before = snapshot(root)
    res = run("saver", "install", "--repo", root)
    assert res.code == 2 and "a different tensor saver is already there" in res.err
    assert snapshot(root) == before
    assert run("saver", "install", "--repo", root, "--force").code == 0
    assert (root / SAVER_MODULE).read_text() == runtime_source(SAVER_MODULE)
    assert part.read_text() == runtime_source(SAVER_MODULES[-1])
    assert run("saver", "remove", "--repo", root).code == 0
    assert snapshot(root)["files"] == before["files"]


def _probe(root: Path, out: Path, steps: int, **env_extra: str) -> tuple[dict, str]:
    return run_probe(PROBE, root, out, str(steps), **env_extra)


@pytest.fixture
def saver_checkout(run, make_checkout):
    """A full megatron-core 0.13.1 tree, initialised (sites + ops) with the saver installed."""
    root = _tree_checkout(make_checkout, inject=False)
    assert run("init", "--repo", root).code == 0
    assert run("saver", "install", "--repo", root).code == 0
    return root


def _files(d: Path) -> list[tuple[str, dict]]:
    torch = pytest.importorskip("torch")
    return [(p.name, torch.load(p)) for p in sorted(d.glob("*.pt"))]


@pytest.mark.slow
def test_saving_changes_nothing_and_saves_everything(saver_checkout, tmp_path, run):
    torch = pytest.importorskip("torch")
    root = saver_checkout
    off, _ = _probe(root, tmp_path / "off.pt", 3)
    logs = tmp_path / "logs"
    on, _ = _probe(
        root, tmp_path / "on.pt", 3, TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=str(logs)
    )
    # training is bit-identical, every micro-step ran forward and backward
    assert torch.equal(off["losses"], on["losses"]) and len(on["losses"]) == 3
    for name, grad in off["grads"].items():
        assert torch.equal(grad, on["grads"][name]), name
    files = _files(logs)
    # per micro-step: 2 layers x (4 linears x (2 forward + 2 backward) + 4 attention) + the
    # output layer's 2 + 2 = 44; flushed by the exit handler alone
    assert len(files) == 3 * 44
    counters = []
    per = collections.Counter()
    head = git.Repo(root).head.commit.hexsha
    for fname, data in files:
        m = NAME.match(fname)
        assert m, fname
        counters.append(int(m.group(1)))
        meta, info, tensor = data["metadata"], data["tensor_info"], data["tensor"]
        assert meta["layer_type"] == m.group(2) and meta["operation"] == m.group(4)
        assert meta["quant_type"] == "bf16" and meta["git_commit"] == head
        assert meta["tensor_name"] == m.group(6) and str(meta["layer_idx"]) == m.group(3)
        if meta["module_kind"] == "output_layer":
            assert meta["layer_idx"] is None
        else:
            assert meta["layer_idx"] in (1, 2)
        assert tensor.device.type == "cpu" and not tensor.requires_grad
        assert info["shape"] == list(tensor.shape) and info["dtype"] == str(tensor.dtype)
        f = tensor.float()
        assert info["min"] == float(f.min()) and info["max"] == float(f.max())
        # float32 sums in another order (strided original vs contiguous copy): scale-relative
        tol = 1e-6 * max(abs(info["min"]), abs(info["max"]), 1e-30)
        assert info["mean"] == pytest.approx(float(f.mean()), abs=tol)
        assert info["std"] == pytest.approx(float(f.std()), abs=tol)
        per[
            (
                meta["layer_idx"],
                meta["module_kind"],
                meta["operation"],
                meta["tensor_name"],
                meta["micro_step"],
            )
        ] += 1
    assert sorted(counters) == list(range(1, len(files) + 1))
    for step in range(3):
        for layer in (1, 2):
            for kind in ("qkv", "proj", "fc1", "fc2"):
                assert per[(layer, kind, "forward", "input", step)] == 1
                assert per[(layer, kind, "backward", "grad_output", step)] == 1
            for t in ("query", "key", "value", "attention_probs"):
                assert per[(layer, "core_attention", "forward", t, step)] == 1
    # bit-exact: the output layer's operands as the module hooks saw them
    out_in = [
        d["tensor"]
        for n, d in files
        if d["metadata"]["module_kind"] == "output_layer"
        and d["metadata"]["tensor_name"] == "input"
    ]
    out_g = [
        d["tensor"]
        for n, d in files
        if d["metadata"]["module_kind"] == "output_layer"
        and d["metadata"]["tensor_name"] == "grad_output"
    ]
    out_w = [
        d["tensor"]
        for n, d in files
        if d["metadata"]["module_kind"] == "output_layer"
        and d["metadata"]["tensor_name"] == "weight"
    ]
    assert all(torch.equal(a, b) for a, b in zip(out_in, on["output_input"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(out_g, on["output_grad"], strict=True))
    assert all(torch.equal(w, on["output_weight"]) for w in out_w) and len(out_w) == 6


def test_labels_are_the_values_in_force(saver_checkout, tmp_path, run):
    root = saver_checkout
    assert (
        run("set", "--repo", root, "--linear", "mxfp8", "--qk", "hifp8", "--pv", "mxfp4").code == 0
    )
    logs = tmp_path / "logs"
    _probe(
        root,
        tmp_path / "q.pt",
        1,
        TENSOR_SAVE_ENABLED="1",
        TENSOR_SAVE_DIR=str(logs),
        CUSTOM_QUANT_TYPE="nonsense",
    )
    labels = {(d["metadata"]["tensor_name"], d["metadata"]["quant_type"]) for _, d in _files(logs)}
    assert labels == {
        ("input", "mxfp8"),
        ("weight", "mxfp8"),
        ("grad_output", "mxfp8"),
        ("query", "hifp8"),
        ("key", "hifp8"),
        ("value", "mxfp4"),
        ("attention_probs", "mxfp4"),
    }
    assert run("restore", "--repo", root).code == 0


@pytest.mark.slow
def test_selection_cap_and_stats_only(saver_checkout, tmp_path):
    root = saver_checkout
    sel = tmp_path / "sel"
    _probe(
        root,
        tmp_path / "a.pt",
        3,
        TENSOR_SAVE_ENABLED="true",
        TENSOR_SAVE_DIR=str(sel),
        TENSOR_SAVE_STEPS="1-2",
        TENSOR_SAVE_LAYERS="2",
        TENSOR_SAVE_KINDS="input,query",
    )
    metas = [d["metadata"] for _, d in _files(sel)]
    assert {m["micro_step"] for m in metas} == {1, 2} and {m["layer_idx"] for m in metas} == {2}
    assert {m["tensor_name"] for m in metas} == {"input", "query"}
    assert len(metas) == 2 * (4 + 1)
    cap = tmp_path / "cap"
    _, err = _probe(
        root,
        tmp_path / "b.pt",
        2,
        TENSOR_SAVE_ENABLED="true",
        TENSOR_SAVE_DIR=str(cap),
        TENSOR_SAVE_MAX_BYTES="100000",
    )
    total = sum(d["tensor"].numel() * d["tensor"].element_size() for _, d in _files(cap))
    assert 0 < total <= 100000
    assert err.count("TENSOR_SAVE_MAX_BYTES=100000 reached") == 1
    stats = tmp_path / "stats"
    _probe(
        root,
        tmp_path / "c.pt",
        2,
        TENSOR_SAVE_ENABLED="true",
        TENSOR_SAVE_DIR=str(stats),
        TENSOR_SAVE_STATS_ONLY="true",
    )
    assert not list(stats.glob("*.pt"))
    records = [json.loads(line) for line in (stats / "stats_rank0.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 44
    assert all({"min", "max", "mean", "std", "shape"} <= set(r["tensor_info"]) for r in records)


@pytest.mark.slow
def test_stock_layout_uses_the_environment_label(run, make_checkout, tmp_path):
    root = _tree_checkout(make_checkout, inject=False)
    assert run("saver", "install", "--repo", root).code == 0
    assert (
        "_qp_saver.save_linear_tensors(total_input, weight, None, 'forward'"
        in (root / LINEAR).read_text()
    )
    logs = tmp_path / "logs"
    _probe(
        root,
        tmp_path / "s.pt",
        1,
        TENSOR_SAVE_ENABLED="true",
        TENSOR_SAVE_DIR=str(logs),
        CUSTOM_QUANT_TYPE="hifp8",
    )
    assert {d["metadata"]["quant_type"] for _, d in _files(logs)} == {"hifp8"}


# -- the runtime module in-process: flush and the drop policy ---------------------------------


@pytest.fixture
def saver_module(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    from quantpatch.runtime import tensor_saver

    def setup(**env: str):
        for k in list(os.environ):
            if k.startswith("TENSOR_SAVE"):
                monkeypatch.delenv(k)
        monkeypatch.setenv("TENSOR_SAVE_ENABLED", "true")
        monkeypatch.setenv("TENSOR_SAVE_DIR", str(tmp_path / "t"))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        tensor_saver.configure()
        return tensor_saver

    yield setup
    monkeypatch.delenv("TENSOR_SAVE_ENABLED")
    tensor_saver.configure()


def test_flush_writes_everything_bit_exact(saver_module, tmp_path):
    import torch

    ts = saver_module()
    tensors = [torch.randn(64, 32, dtype=torch.bfloat16) for _ in range(20)]
    for i, t in enumerate(tensors):
        ts.save_linear_tensors(t, None, "mxfp8", "forward", i, {"module_kind": "fc1"})
    report = ts.flush()
    assert report == {
        "files": 20,
        "bytes": 20 * 64 * 32 * 2,
        "dropped": 0,
        "failed": 0,
        "errors": [],
    }
    saved = sorted((tmp_path / "t").glob("*.pt"))
    for path, t in zip(saved, tensors, strict=True):
        assert torch.equal(torch.load(path)["tensor"], t)


def test_drops_are_counted_and_reported(saver_module, capsys):
    """With a queue of one and the saver's threads held, all but the first one or two tensors
    are dropped, counted, reported, and a dropped tensor's snapshot buffer goes back to the
    pool at once, to serve the next save (it used to be left to the allocator)."""
    import torch

    ts = saver_module(TENSOR_SAVE_QUEUE="1", TENSOR_SAVE_DROP="true")
    ts._SAVER.snapshots.pool = sp.capture.HostPool(sp.capture.POOL_BYTES)
    gate = threading.Event()
    real_write, real_measure = sp.writer.Saver._write, sp.writer._measure

    def slow_write(self, item):
        gate.wait(10)
        real_write(self, item)

    def slow_measure(item):
        gate.wait(10)
        real_measure(item)

    sp.writer.Saver._write, sp.writer._measure = slow_write, slow_measure
    try:
        for i in range(6):
            ts.save_tensor(torch.ones(8, 3, 5), "linear", "forward", "bf16", "input", i)
        gate.set()
        report = ts.flush()
    finally:
        sp.writer.Saver._write, sp.writer._measure = real_write, real_measure
    assert report["dropped"] in (4, 5) and report["files"] + report["dropped"] == 6
    assert f"dropped {report['dropped']} tensor(s)" in capsys.readouterr().err
    # the written tensors' buffers, and one more: the dropped ones' one buffer, used again
    assert len(ts._SAVER.snapshots.pool.free[(torch.float32, (8, 3, 5))]) == report["files"] + 1
    assert ts._SAVER.pending_bytes == 0


def test_disabled_saver_does_nothing(saver_module, monkeypatch, tmp_path):
    import torch

    ts = saver_module()
    monkeypatch.setenv("TENSOR_SAVE_ENABLED", "false")
    ts.configure()
    assert ts.ENABLED is False
    ts.save_tensor(torch.ones(3), "linear", "forward", None, "input", 1)
    assert ts.flush()["files"] == 0 and not (tmp_path / "t").exists()


def test_selection_parsing_and_kind_names():
    pytest.importorskip("torch")

    assert (
        sp.settings._ranges("0-1,5, 7-8") == ((0, 1), (5, 5), (7, 8))
        and sp.settings._ranges("") is None
    )
    assert [x for x in range(10) if sp.settings.in_spans(sp.settings._ranges("0-1,5, 7-8"), x)] == [
        0,
        1,
        5,
        7,
        8,
    ]
    assert sp.capture.kind_from_name("self_attention.linear_qkv.weight") == "qkv"
    assert sp.capture.kind_from_name("mlp.linear_fc2.weight") == "fc2"
    assert (
        sp.capture.kind_from_name("mlp.experts.local_experts.3.linear_fc1.weight") == "expert_fc1"
    )
    assert sp.capture.kind_from_name("mlp.shared_experts.linear_fc2.weight") == "shared_expert_fc2"


def test_linear_meta_finds_the_layer_of_a_weight():
    torch = pytest.importorskip("torch")
    from quantpatch.runtime import tensor_saver as ts

    class Layer(torch.nn.Module):
        def __init__(self, number):
            super().__init__()
            self.layer_number = number
            self.mlp = torch.nn.Module()
            self.mlp.linear_fc1 = torch.nn.Linear(2, 2)

    a, b = Layer(3), Layer(4)
    ts.enter_layer(a)
    ts.enter_layer(b)
    assert ts.linear_meta(b.mlp.linear_fc1.weight) == {"layer_idx": 4, "module_kind": "fc1"}
    stray = torch.nn.Parameter(torch.ones(2))
    assert ts.linear_meta(stray) == {"layer_idx": None, "module_kind": "output_layer"}


def test_rank_in_names_and_stats_only_in_process(saver_module, monkeypatch, tmp_path):
    import torch

    ts = saver_module(TENSOR_SAVE_STATS_ONLY="true")
    monkeypatch.setattr(sp.settings, "rank_info", lambda: (3, 8))
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ts.save_attention_tensors(t, None, t * 2, "hifp8", "forward", 5, {"module_kind": "x"})
    assert ts.flush()["files"] == 2
    lines = (tmp_path / "t" / "stats_rank3.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert [r["name"].split("_", 3)[-1] for r in recs] == [
        "attention_L5_forward_hifp8_rank3_query",
        "attention_L5_forward_hifp8_rank3_value",
    ]
    assert recs[1]["tensor_info"]["max"] == 22.0 and recs[0]["tensor_info"]["mean"] == 5.5
    assert recs[0]["metadata"]["world_size"] == 8 and recs[0]["metadata"]["layer_idx"] == 5


def test_byte_cap_and_selection_in_process(saver_module, capsys):
    import torch

    ts = saver_module(
        TENSOR_SAVE_MAX_BYTES="100", TENSOR_SAVE_KINDS="input", TENSOR_SAVE_LAYERS="1-2"
    )
    for layer in (1, 2, 3):
        ts.save_linear_tensors(torch.ones(10), torch.ones(10), None, "forward", layer)
    report = ts.flush()
    assert report["files"] == 2 and report["bytes"] == 80  # weights and layer 3 not selected
    ts.save_tensor(torch.ones(10), "linear", "forward", None, "input", 1)
    ts.save_tensor(torch.ones(10), "linear", "forward", None, "input", 2)
    assert ts.flush()["files"] == 2
    assert capsys.readouterr().err.count("TENSOR_SAVE_MAX_BYTES=100 reached") == 1


# -- the saver never stops training ------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TENSOR_SAVE_STEPS", "abc"),
        ("TENSOR_SAVE_LAYERS", "1-x"),
        ("TENSOR_SAVE_MAX_BYTES", "-5"),
        ("TENSOR_SAVE_STEPS", "5-1"),
        ("TENSOR_SAVE_KINDS", ",,"),
        ("TENSOR_SAVE_QUEUE", "many"),
        ("TENSOR_SAVE_NICE", "20"),
        ("TENSOR_SAVE_STATS_ONLY", "maybe"),
        ("TENSOR_SAVE_ENABLED", "ture"),
        ("TENSOR_SAVE_ACCELERATORS", "turbo"),
        ("TENSOR_SAVE_ACCELERATORS", "all,pickler"),
    ],
)
def test_a_bad_variable_turns_saving_off_in_one_line(saver_module, capsys, tmp_path, name, value):
    import torch

    ts = saver_module(**{name: value})  # configure() reads it: no exception
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[tensor_saver]")]
    assert len(lines) == 1, err
    assert f"{name}={value!r}" in lines[0] and "expected" in lines[0]
    assert "saving is off" in lines[0]
    assert ts.ENABLED is False and ts.get_tensor_saver().enabled is False
    ts.save_linear_tensors(torch.ones(4), torch.ones(4), None, "forward", 1)  # training goes on
    ts.save_tensor(torch.ones(4), "linear", "forward", None, "input", 1)
    assert ts.flush()["files"] == 0 and not (tmp_path / "t").exists()
    assert capsys.readouterr().err == ""  # said once, at configuration


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("none", set()),
        ("stats-kernel", {"stats-kernel"}),
        (" Pickler , stats-kernel ", {"pickler", "stats-kernel"}),
        ("all", {"pickler", "stats-kernel"}),
    ],
)
def test_accelerators_are_asked_for_by_name(saver_module, value, on):
    ts = saver_module(TENSOR_SAVE_ACCELERATORS=value)
    status = ts.accelerator_status()
    assert {name for name, said in status.items() if said != "off"} == on
    assert set(status) == {"stats-kernel", "pickler"}
    if "pickler" in on:
        assert status["pickler"] == "on: pickler"  # this torch is one it was checked on


def test_bad_variables_are_quiet_while_saving_is_off(saver_module, capsys):
    ts = saver_module(TENSOR_SAVE_ENABLED="false", TENSOR_SAVE_STEPS="abc")
    assert ts.ENABLED is False and capsys.readouterr().err == ""


def test_a_huge_step_range_stays_a_range(tmp_path):
    """``0-3000000000`` once built a set of three billion numbers; under a 1 GiB address
    space limit it must configure, select and save at once."""
    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import os, resource, sys
        import torch
        from quantpatch.runtime import tensor_saver as ts
        with open("/proc/self/status") as fh:
            vm = next(int(x.split()[1]) * 1024 for x in fh if x.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
        os.environ.update(TENSOR_SAVE_ENABLED="true", TENSOR_SAVE_DIR=sys.argv[1],
                          TENSOR_SAVE_STEPS="0-3000000000", TENSOR_SAVE_LAYERS="2-2000000000")
        ts.configure()
        ts.save_tensor(torch.ones(4), "linear", "forward", None, "input", 1)
        ts.save_tensor(torch.ones(4), "linear", "forward", None, "input", 2)
        print(ts.flush()["files"])
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSOR_SAVE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "t")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.strip() == "1", res.stderr[-2000:]


def test_an_unwritable_directory_is_reported_once_with_a_count(saver_module, tmp_path, capsys):
    import torch

    (tmp_path / "file").write_text("not a directory\n")
    target = tmp_path / "file" / "logs"
    ts = saver_module(TENSOR_SAVE_DIR=str(target))
    for layer in range(5):
        ts.save_tensor(torch.ones(4), "linear", "forward", None, "input", layer)
    report = ts.flush()
    assert report["files"] == 0 and report["failed"] == 5 and report["bytes"] == 0
    assert len(report["errors"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "5 file(s) could not be written" in err[0] and str(target) in err[0]
    assert ts.flush()["failed"] == 5 and capsys.readouterr().err == ""  # not said again


class _OsWithFullDisk:
    """``os`` whose writes put part of their bytes in the file and then find the disk full."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        os.write(fd, bytes(data[:7]))
        raise OSError(errno.ENOSPC, "No space left on device")

    @staticmethod
    def writev(fd, buffers):
        return _OsWithFullDisk.write(fd, bytes(buffers[0]))


def test_a_full_disk_leaves_no_partial_file_and_counts_no_bytes(
    saver_module, monkeypatch, tmp_path, capsys
):
    import torch

    ts = saver_module(TENSOR_SAVE_MAX_BYTES="1000")
    monkeypatch.setattr(sp.ondisk, "os", _OsWithFullDisk())
    for layer in range(3):
        ts.save_tensor(torch.ones(100), "linear", "forward", None, "input", layer)  # 400 bytes
        report = ts.flush()
    assert report["failed"] == 3 and report["files"] == 0 and report["bytes"] == 0
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == []
    assert "No space left on device" in capsys.readouterr().err
    # the failed writes did not use up the cap: once the disk has room, saving goes on
    monkeypatch.setattr(sp.ondisk, "os", os)
    for layer in range(2):
        ts.save_tensor(torch.ones(100), "linear", "forward", None, "input", layer)
    assert ts.flush()["files"] == 2 and "MAX_BYTES" not in capsys.readouterr().err


def test_a_full_disk_cuts_a_partial_stats_line(saver_module, monkeypatch, tmp_path):
    import torch

    ts = saver_module(TENSOR_SAVE_STATS_ONLY="true")
    ts.save_tensor(torch.ones(4), "linear", "forward", None, "input", 1)
    assert ts.flush()["files"] == 1
    path = tmp_path / "t" / "stats_rank0.jsonl"
    whole = path.read_bytes()

    class _Os:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            os.write(fd, data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sp.ondisk, "os", _Os())
    ts.save_tensor(torch.ones(4), "linear", "forward", None, "input", 2)
    assert ts.flush()["failed"] == 1
    assert path.read_bytes() == whole


def test_an_error_inside_the_saver_turns_saving_off(saver_module, monkeypatch, capsys):
    import torch

    ts = saver_module()

    def broken(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(sp.writer.Saver, "_capture", broken)
    for layer in range(3):
        ts.save_tensor(torch.ones(4), "linear", "forward", None, "input", layer)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "boom" in err[0] and "saving is off" in err[0]
    assert ts.ENABLED is False


def test_a_new_tensor_at_a_freed_address_is_saved(saver_module, monkeypatch):
    """The allocator reuses a freed block for the next tensor: same address, other data."""
    import gc

    import torch

    ts = saver_module()
    monkeypatch.setattr(sp.capture, "identity", lambda t: ("one address",))
    first = torch.ones(8)
    ts.save_tensor(first, "linear", "forward", None, "input", 0)
    assert ts.flush()["files"] == 1
    del first
    gc.collect()
    ts.save_tensor(torch.zeros(8), "linear", "forward", None, "input", 0)
    assert ts.flush()["files"] == 2  # saved (files are counted since configure())


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="CUDA-only: the device snapshot"
)
def test_cuda_tensor_written_after_the_call_is_saved_as_it_was(saver_module):
    """Training may write into a tensor right after handing it over (a reused all-gather
    buffer, an in-place update): the file holds the values at the call."""
    import torch

    ts = saver_module()
    t = torch.arange(1 << 22, device="cuda", dtype=torch.float32)
    want = t.cpu()
    for _ in range(4):
        ts.save_tensor(t, "linear", "forward", None, "input", 1)
        t.add_(1.0)  # queued on the training stream right behind the call
        want_now = want.clone()
        report = ts.flush()
        saved = sorted(Path(sp.settings.CFG.save_dir).glob("*_input.pt"))[-1]
        assert torch.equal(torch.load(saved)["tensor"], want_now), report
        want = want + 1.0


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="CUDA-only: pinned host buffers"
)
@pytest.mark.parametrize("handover", [0, 1 << 30])
def test_cuda_pinned_buffers_made_by_either_thread(saver_module, monkeypatch, handover):
    """With no free pinned buffer the statistics thread makes it and copies the snapshot
    (up to ``_HANDOVER_BYTES`` waiting), else the training thread does; the next tensors of
    those shapes take the buffers written ones gave back. Every file holds the values at the
    call, and no device snapshot is left counted."""
    import torch

    ts = saver_module()
    device_copy = sp.device_copy
    monkeypatch.setattr(device_copy, "HANDOVER_BYTES", handover)
    ts._SAVER.snapshots.device = copies_ = device_copy.DeviceCopies(
        sp.capture.HostPool(device_copy.PINNED_POOL_BYTES)
    )
    copies = []
    real = device_copy.DeviceCopies.copy_to_host
    monkeypatch.setattr(
        device_copy.DeviceCopies, "copy_to_host", lambda s, i: copies.append(1) or real(s, i)
    )
    gen = torch.Generator(device="cuda").manual_seed(2)
    for step in range(3):
        ts_ = [torch.randn(257, 1000, device="cuda", generator=gen) for _ in range(6)]
        want = [t.cpu() for t in ts_]
        for i, t in enumerate(ts_):
            ts.save_tensor(t, "linear", "forward", None, f"input{i}", step)
            t.zero_()  # queued right behind the call
        assert ts.flush()["failed"] == 0
        assert copies_.handed_over == 0
        # six buffers made in the first step, by the statistics thread where allowed, and
        # taken again (none made) in the next ones
        assert len(copies) == (6 if handover else 0)
        assert copies_.pinned.bytes == 6 * 257 * 1000 * 4
        for i, w in enumerate(want):
            (path,) = Path(sp.settings.CFG.save_dir).glob(f"*_L{step}_forward_*_input{i}.pt")
            assert torch.equal(torch.load(path, weights_only=True)["tensor"], w)


def test_writer_threads_pool_and_format(saver_module, tmp_path):
    """Several writer threads, snapshot buffers used again, the non-zip ``torch.save``
    format: every file loads with ``weights_only=True`` and holds exactly what was handed
    over at the time of the call, even when the caller overwrites its tensor right after."""
    import zipfile

    import torch

    ts = saver_module(TENSOR_SAVE_WRITERS="3")
    gen = torch.Generator().manual_seed(1)
    buf = torch.empty(64, 48, dtype=torch.bfloat16)
    expected = {}
    for layer in range(12):  # one buffer rewritten in place between calls
        buf.copy_(torch.randn(64, 48, generator=gen))
        expected[layer] = buf.clone()
        ts.save_tensor(buf, "linear", "forward", "mxfp8", "input", layer)
        if layer % 4 == 3:
            assert ts.flush()["failed"] == 0  # buffers go back to the pool, then are reused
    odd = torch.randn(48, 64, generator=gen).t()  # a non-contiguous view
    ts.save_tensor(odd, "linear", "forward", "mxfp8", "weight", 99)
    report = ts.flush()
    assert report["files"] == 13 and report["failed"] == 0
    assert len(ts._SAVER.threads) == 3 and ts._SAVER.snapshots.pool.bytes > 0
    for path in sorted((tmp_path / "t").glob("*.pt")):
        assert not zipfile.is_zipfile(path)
        obj = torch.load(path, weights_only=True)
        want = odd if obj["metadata"]["layer_idx"] == 99 else expected[obj["metadata"]["layer_idx"]]
        assert obj["tensor"].dtype == want.dtype and torch.equal(obj["tensor"], want)
        f = want.float()
        info = obj["tensor_info"]
        assert (info["min"], info["max"]) == (f.min().item(), f.max().item())
        assert info["std"] == pytest.approx(f.std().item(), rel=1e-5)
        assert info["mean"] == pytest.approx(f.mean().item(), rel=1e-5, abs=1e-7)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities are Linux's")
@pytest.mark.parametrize(("nice", "lower"), [(None, 10), ("3", 3), ("0", 0)])
def test_the_saver_threads_yield_to_training(saver_module, nice, lower):
    """Both stages run ``TENSOR_SAVE_NICE`` below the training thread; training's own
    priority and torch thread count stay as they were."""
    import torch

    env = {} if nice is None else {"TENSOR_SAVE_NICE": nice}
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    threads = torch.get_num_threads()
    ts = saver_module(**env)
    ts.save_tensor(torch.randn(64, 64), "linear", "forward", None, "input", 0)
    assert ts.flush()["files"] == 1
    stages = [ts._SAVER.stats_thread, *ts._SAVER.threads]
    for thread in stages:
        assert thread is not None and thread.native_id is not None
        got = os.getpriority(os.PRIO_PROCESS, thread.native_id)
        assert got == min(19, me + lower), (thread.name, got)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == me
    assert torch.get_num_threads() == threads
    # the statistics thread runs torch on one core; no other thread, even one started now
    seen: dict[str, int] = {}
    later = threading.Thread(target=lambda: seen.setdefault("n", torch.get_num_threads()))
    later.start()
    later.join()
    assert seen["n"] == threads
    if sp.writer._openmp() is not None:
        one: dict[str, int] = {}

        def probe() -> None:
            sp.writer._one_core()
            one["n"] = torch.get_num_threads()

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        assert one["n"] == 1


def test_configure_keeps_the_host_snapshot_buffers(saver_module, tmp_path):
    """A fresh configuration keeps the memory the process already has for snapshots."""
    import torch

    ts = saver_module()
    ts._SAVER.snapshots.pool = pool = sp.capture.HostPool(sp.capture.POOL_BYTES)
    ts.save_tensor(torch.ones(1000), "linear", "forward", None, "input", 1)
    assert ts.flush()["files"] == 1 and pool.bytes == 4000
    (buffer,) = pool.free[(torch.float32, (1000,))]
    ts.configure()
    assert ts._SAVER.snapshots.pool is pool
    ts.save_tensor(torch.full((1000,), 2.0), "linear", "forward", None, "input", 2)
    assert ts.flush()["files"] == 1
    assert pool.free[(torch.float32, (1000,))] == [buffer]  # used again, and back
    assert torch.equal(buffer, torch.full((1000,), 2.0))


def test_a_failure_in_the_statistics_is_counted_and_saving_goes_on(
    saver_module, monkeypatch, tmp_path, capsys
):
    import torch

    ts = saver_module()
    ts._SAVER.snapshots.pool = sp.capture.HostPool(
        sp.capture.POOL_BYTES
    )  # configure() keeps the last one's buffers
    real = sp.stats.host_stats
    monkeypatch.setattr(sp.stats, "host_stats", lambda t: 1 / 0)
    for layer in range(3):
        ts.save_tensor(torch.ones(256), "linear", "forward", None, "input", layer)
    report = ts.flush()
    assert report["failed"] == 3 and report["files"] == 0 and report["bytes"] == 0
    assert "ZeroDivisionError" in capsys.readouterr().err
    assert 256 * 4 <= ts._SAVER.snapshots.pool.bytes <= 3 * 256 * 4  # snapshots back in the pool
    monkeypatch.setattr(sp.stats, "host_stats", real)
    ts.save_tensor(torch.arange(256.0), "linear", "forward", None, "input", 7)
    assert ts.flush()["files"] == 1
    (path,) = (tmp_path / "t").glob("*.pt")
    obj = torch.load(path, weights_only=True)
    assert torch.equal(obj["tensor"], torch.arange(256.0))
    # recorded and written in one os.writev, the bytes are exactly those of torch.save's own file
    ours, theirs = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    fd = os.open(ours, os.O_WRONLY | os.O_CREAT)
    try:
        sp.ondisk.write_all(fd, sp.ondisk.torch_bytes(obj, obj["tensor"]))
    finally:
        os.close(fd)
    torch.save(obj, theirs, _use_new_zipfile_serialization=False)
    assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize(
    ("scratch_max", "kernel"), [(1 << 24, "none"), (64, "none"), (1 << 24, "stats-kernel")]
)
def test_stats_never_write_the_tensor_and_match_torch(
    saver_module, monkeypatch, scratch_max, kernel
):
    """In the float32 buffer a thread keeps (reused from tensor to tensor, larger ones
    first) or, past its size, in a copy of their own; or by the one-pass kernel, which
    hands what it cannot do exactly (not finite, offset, strided, float64) to those."""
    import torch

    saver_module(TENSOR_SAVE_ACCELERATORS=kernel)
    sp.stats_kernel.kernel(wait=True)  # compiled by now, where it can be
    monkeypatch.setattr(sp.stats, "_SCRATCH_MAX", scratch_max)
    cases = [
        torch.randn(300, 7) * 3 + 5,  # float32: the copy must be a real copy
        (torch.randn(1000) * 40).to(torch.bfloat16),
        torch.randn(40, 30).t(),
        torch.arange(10, dtype=torch.float64),
        torch.tensor([2.5]),
        torch.tensor([]),
        torch.tensor([1.0, float("nan"), 3.0]),
        torch.tensor([1.0, float("inf")]),
        torch.randn(1 << 20),  # on the host: the variance from the two sums
        torch.randn(1 << 16) * 1e-3 + 1e3,  # an offset 1e6x the spread: the two-pass formula
        torch.full((5000,), 7.25),
    ]
    for t in cases:
        before = t.clone()
        got = sp.stats.host_stats(t)
        assert torch.equal(t, before) or torch.isnan(before).any()
        f = t.float()
        if t.numel() == 0:
            assert got == [0.0, 0.0, 0.0, 0.0]
            continue
        want = [f.min().item(), f.max().item(), f.mean().item()]
        want.append(f.std().item() if t.numel() > 1 else 0.0)
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, rel=1e-5, abs=1e-6, nan_ok=True)


@pytest.mark.parametrize(
    ("shift", "two_passes"),
    [(0.0, False), (1.0, False), (3.0, True), (1e3, True), (-1e3, True)],
)
def test_host_std_in_one_pass_only_where_it_is_exact(saver_module, monkeypatch, shift, two_passes):
    """The sum of squares gives the spread in one pass while it keeps at least half of it
    (mean^2 <= var); past that the deviations are squared in a second pass. Either way the
    result is within 1e-6 of float64's on 1M bf16 values."""
    import torch

    saver_module()
    calls = []
    real = sp.stats._deviation_host
    monkeypatch.setattr(sp.stats, "_deviation_host", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(3)
    t = (torch.randn(1 << 20, generator=gen) + shift).to(torch.bfloat16)
    got = sp.stats.host_stats(t)
    exact = t.double()
    assert got[2] == pytest.approx(exact.mean().item(), rel=1e-6, abs=1e-9)
    assert got[3] == pytest.approx(exact.std().item(), rel=1e-6)
    assert bool(calls) is two_passes


@pytest.mark.parametrize("stats_only", ["false", "true"])
@pytest.mark.parametrize("behind", [0, 10**9])
def test_either_thread_writes_the_files(saver_module, monkeypatch, tmp_path, behind, stats_only):
    """The statistics thread writes the files itself when the writers are behind (0 waiting
    suffices), the writer does otherwise: the same files, counted once. Stats-only lines
    always go to the writer."""
    import threading

    import torch

    ts = saver_module(TENSOR_SAVE_STATS_ONLY=stats_only)
    monkeypatch.setattr(sp.writer, "_BEHIND", behind)
    writers: list[str] = []
    real = sp.writer.Saver._write
    monkeypatch.setattr(
        sp.writer.Saver,
        "_write",
        lambda self, item: writers.append(threading.current_thread().name) or real(self, item),
    )
    tensors = [torch.randn(300, 70).to(torch.bfloat16) * k for k in range(1, 9)]
    for layer, tensor in enumerate(tensors):
        ts.save_tensor(tensor, "linear", "forward", None, "input", layer)
    report = ts.flush()
    assert report["files"] == len(tensors)
    assert (report["failed"], report["dropped"]) == (0, 0)
    assert ts._SAVER.pending_bytes == 0
    by_stats = writers.count("tensor_saver_stats")
    assert len(writers) == len(tensors)
    if stats_only == "true":
        assert by_stats == 0
        lines = (tmp_path / "t" / "stats_rank0.jsonl").read_text().splitlines()
        got = {json.loads(x)["metadata"]["layer_idx"]: json.loads(x) for x in lines}
        for layer, tensor in enumerate(tensors):
            assert got[layer]["tensor_info"]["max"] == tensor.float().max().item()
        return
    assert by_stats == (len(tensors) if behind == 0 else 0)
    assert report["bytes"] == sum(t.numel() * 2 for t in tensors)
    paths = sorted((tmp_path / "t").glob("*.pt"))
    assert len(paths) == len(tensors)
    assert not list((tmp_path / "t").glob(".*.tmp"))
    for path in paths:
        obj = torch.load(path, weights_only=True)
        layer = obj["metadata"]["layer_idx"]
        assert torch.equal(obj["tensor"], tensors[layer])
        assert obj["tensor_info"]["std"] == pytest.approx(tensors[layer].float().std().item())


def test_a_file_the_statistics_thread_fails_to_write_is_counted_once(
    saver_module, monkeypatch, tmp_path
):
    """A write that fails in the statistics thread (writers behind) is counted and reported
    like one that fails in a writer; the others are written and training goes on."""
    import torch

    ts = saver_module()
    monkeypatch.setattr(sp.writer, "_BEHIND", 0)
    real = sp.ondisk.write_all
    calls = []

    def flaky(fd, parts):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(fd, parts)

    monkeypatch.setattr(sp.ondisk, "write_all", flaky)
    for layer in range(4):
        ts.save_tensor(torch.ones(64, 64) * layer, "linear", "forward", None, "input", layer)
    report = ts.flush()
    assert (report["files"], report["failed"]) == (3, 1)
    assert "No space left" in report["errors"][0]
    assert ts._SAVER.pending_bytes == 0
    assert len(list((tmp_path / "t").glob("*.pt"))) == 3
    assert not list((tmp_path / "t").glob(".*.tmp"))


@pytest.mark.parametrize("storages", [1, 2])
def test_only_the_one_storage_after_the_pickles_is_kept_as_a_view(saver_module, storages):
    """A pickle as large as the tensor is copied; the tensor's bytes, written after torch.save
    flushes its pickles (the storage keys last), are a view of the snapshot (no copy), and
    only when the keys name one storage."""
    import pickle

    import torch

    saver_module()
    host = torch.arange(1 << 16, dtype=torch.int16)
    nbytes = host.numel() * 2
    data = bytes(memoryview(host.numpy()).cast("B"))
    keys = pickle.dumps([str(k) for k in range(storages)], protocol=2)
    size = (1 << 16).to_bytes(8, "little")
    rec = sp.ondisk._Recorder(host)
    rec.write(b"p" * nbytes)  # a pickle of exactly the storage's size
    rec.write(keys)
    rec.flush()
    rec.write(size)
    rec.write(data)
    parts = rec.done()
    assert b"".join(bytes(p) for p in parts) == b"p" * nbytes + keys + size + data
    assert len(parts) == (2 if storages == 1 else 1)
    host[0] = 7  # a view follows the snapshot; a copy keeps the bytes written
    first = bytes(memoryview(parts[-1])[-nbytes:][:2])
    assert first == ((7).to_bytes(2, "little") if storages == 1 else b"\x00\x00")


@pytest.mark.parametrize(
    ("case", "dtype"),
    [
        ("tiny", "float32"),  # squares underflow float32 unless scaled
        ("huge", "float32"),  # the sum of squares overflows float32 unless scaled
        ("near_max", "float32"),  # 2**128, the scale, is not a float32
        ("offset", "float64"),  # a float32 copy would lose the spread
        ("plain", "bfloat16"),
    ],
)
def test_std_of_any_magnitude_on_the_host_and_on_the_device(saver_module, case, dtype):
    """Within 1e-6 of float64, on the host path and on the device path (run here on the
    CPU: the same operators, no synchronisation in it)."""
    import torch

    saver_module()
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1 << 16, generator=gen, dtype=torch.float64)
    values = {
        "tiny": base * 1e-30,
        "huge": base * 1e20,
        "near_max": torch.where(base > 0, 3e38, -3e38),
        "offset": 1e10 + base * 1e-3,
        "plain": base,
    }[case]
    t = values.to(getattr(torch, dtype))
    exact = t.double()
    mean, std = exact.mean().item(), exact.std().item()
    host = sp.stats.host_stats(t)
    _, _, dev_mean, dev_std = sp.stats.combine(sp.stats.device_moments(t).tolist(), t.numel())
    for got_mean, got_std in ((host[2], host[3]), (dev_mean, dev_std)):
        assert got_std == pytest.approx(std, rel=1e-6)
        assert got_mean == pytest.approx(mean, rel=1e-6, abs=1e-6 * std)


@pytest.mark.parametrize("chunk", [1 << 24, 1000, 7])
def test_device_moments_combine_to_the_host_statistics(saver_module, monkeypatch, chunk):
    """The device path (its operators, run here on the CPU), in one chunk or many, gives the
    host path's min, max, mean and std: within 1e-6 of float64 where they are finite, and
    the same inf / NaN where a value is not."""
    import torch

    saver_module()
    monkeypatch.setattr(sp.stats, "DEVICE_CHUNK", chunk)
    gen = torch.Generator().manual_seed(8)
    nan, inf = float("nan"), float("inf")
    cases = [
        torch.randn(5000, generator=gen) * 3 + 5,
        (torch.randn(71, 70, generator=gen) * 40).to(torch.bfloat16).t(),
        torch.randn(10_000, generator=gen).round() + 1e7,  # the spread under a large mean
        torch.full((3000,), 7.25, dtype=torch.float16),
        torch.tensor([2.5]),
        torch.tensor([]),
        torch.arange(1000, dtype=torch.int64),
        torch.arange(10) % 3 == 0,
        torch.tensor([1.0, nan, 3.0]),
        torch.tensor([1.0, inf]),
        torch.tensor([-inf, 1.0]),
        torch.tensor([-inf, inf]),
        torch.tensor([inf, 1.0, -inf]),  # with chunks of 1 or 7: in two chunks
        torch.tensor([inf, 1.0, 2.0]),
        torch.tensor([-inf]),
        torch.tensor([nan]),
    ]
    for t in cases:
        got = sp.stats.combine(sp.stats.device_moments(t).tolist(), t.numel())
        host = sp.stats.host_stats(t)
        assert got == pytest.approx(host, rel=1e-6, abs=1e-6, nan_ok=True), t
        if t.numel() and bool(t.double().isfinite().all()):
            exact = t.double()
            std = exact.std().item() if t.numel() > 1 else 0.0
            assert got[2:] == pytest.approx([exact.mean().item(), std], rel=1e-6, abs=1e-6)


def test_device_moments_queue_few_operators(saver_module):
    """Each operator the device path queues is a kernel launch in the training thread:
    on an H100 the 37 of the scaled float32 formula took 21.6 ms a step for 32 tensors.
    A tensor of one chunk now takes six (views not counted); each further chunk two."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    saver_module()

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kernels: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            if not any(v in name for v in ("view", "slice", "alias", "reshape", "detach")):
                self.kernels.append(name)
            return func(*args, **(kwargs or {}))

    t = torch.randn(64, 128).to(torch.bfloat16)
    with Count() as count:
        sp.stats.device_moments(t)
    assert len(count.kernels) <= 6, count.kernels


def _legacy_torch_save(obj) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "case",
    ["bf16", "float32", "int64", "bool", "empty", "view", "offset", "requires_grad", "values"],
)
def test_the_plain_pickler_writes_torch_saves_bytes(saver_module, case):
    """The saver's own dict (one plain host tensor, plain values) is pickled without
    torch.save, byte for byte as torch.save pickles it, whatever the dtype, shape, offset
    into its storage or values around it."""
    import torch

    saver_module()
    base = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    tensor = {
        "bf16": base.to(torch.bfloat16),
        "float32": base,
        "int64": base.to(torch.int64),
        "bool": base > 100,
        "empty": torch.empty(0, 3),
        "view": base.t(),
        "offset": base[3:, 5:],
        "requires_grad": base.clone().requires_grad_(True),
        "values": base,
    }[case]
    meta = {"layer_idx": 3, "shape": [64, 64], "name": "x", "none": None, "flag": True}
    if case == "values":
        meta.update(pair=(1, 2.5), nested={"a": [1, {"b": "c"}]}, hooks=collections.OrderedDict())
    obj = {"tensor": tensor, "tensor_info": {"min": -1.5, "max": 2.0}, "metadata": meta}
    parts = sp.pickler.plain_bytes(obj, tensor)
    assert parts is not None  # not torch.save's path
    assert b"".join(bytes(p) for p in parts) == _legacy_torch_save(obj)
    loaded = torch.load(io.BytesIO(b"".join(bytes(p) for p in parts)), weights_only=True)
    assert torch.equal(loaded["tensor"], tensor.detach()) and loaded["metadata"] == meta


@pytest.mark.parametrize("case", ["other_tensor", "same_storage", "ordered_dict", "module", "set"])
def test_what_the_plain_pickler_does_not_know_goes_to_torch_save(saver_module, case):
    """Another tensor, a second view of the same storage, a filled OrderedDict, a class or a
    set in the metadata: the plain pickler declines, and the file is torch.save's own."""
    import torch

    saver_module()
    tensor = torch.randn(256, 256)
    extra = {
        "other_tensor": torch.ones(3),
        "same_storage": tensor[1:],
        "ordered_dict": collections.OrderedDict(a=1),
        "module": torch.nn.Linear,
        "set": {1, 2},
    }[case]
    obj = {"tensor": tensor, "tensor_info": {}, "metadata": {"extra": extra}}
    assert sp.pickler.plain_bytes(obj, tensor) is None
    assert b"".join(bytes(p) for p in sp.ondisk.torch_bytes(obj, tensor)) == _legacy_torch_save(obj)


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_a_storage_alone_is_plain_only_in_the_tensors_own_dtype(saver_module, dtype):
    """The element count after the pickles is the storage's own: a typed storage of the
    host's memory in another dtype goes to torch.save (its count would be 4x off)."""
    import torch

    saver_module()
    host = torch.arange(16.0)
    storage = torch.storage.TypedStorage(
        wrap_storage=host.untyped_storage(), dtype=getattr(torch, dtype), _internal=True
    )
    obj = {"storage": storage}
    assert (sp.pickler.plain_bytes(obj, host) is None) is (dtype == "uint8")
    ours = b"".join(bytes(p) for p in sp.ondisk.torch_bytes(obj, host))
    assert ours == _legacy_torch_save(obj)
    assert torch.load(io.BytesIO(ours), weights_only=True)["storage"].nbytes() == 64


@pytest.mark.parametrize("kernel", ["stats-kernel", "none"])
@pytest.mark.parametrize(
    "case",
    ["constant", "two_close", "integers_near_1e7", "float32_subnormals", "float64_subnormal"],
)
def test_host_stats_are_float64s_rounded_where_float32_std_is_off(saver_module, case, kernel):
    """The mean's rounding is taken out of the two-pass deviations (float32 ``Tensor.std``
    gives 2.4e-7 for a constant, 2.25 for integers near 1e7 whose spread is 1.04), and
    subnormal values are scaled within the type's range (2**128 is inf in float32, 2**1063
    overflows a Python float)."""
    import torch

    saver_module(TENSOR_SAVE_ACCELERATORS=kernel)
    sp.stats_kernel.kernel(wait=True)
    gen = torch.Generator().manual_seed(11)
    t = {
        "constant": torch.full((1000,), 3.3),
        "two_close": torch.tensor([1.0, 1.0 + 2.0**-23]),
        "integers_near_1e7": torch.randn(100_000, generator=gen).round() + 1e7,
        "float32_subnormals": torch.tensor([1e-39, -2e-39, 3e-39]),
        "float64_subnormal": torch.tensor([1e-320, 0.0, 3e-321], dtype=torch.float64),
    }[case]
    exact = t.double()
    truth = [exact.min(), exact.max(), exact.mean(), exact.std()]
    want = torch.tensor([float(v) for v in truth], dtype=torch.float32).tolist()
    assert sp.stats.host_stats(t) == pytest.approx(want, rel=1e-6, abs=1e-44)
    # the device path (its operators, run here on the CPU)
    got = sp.stats.combine(sp.stats.device_moments(t).tolist(), t.numel())
    assert got == pytest.approx(want, rel=1e-6, abs=1e-44)


@pytest.mark.parametrize(("accelerators", "torch_saves"), [("none", 4), ("pickler", 0)])
def test_files_are_torch_saves_whichever_path_writes_them(
    saver_module, monkeypatch, tmp_path, accelerators, torch_saves
):
    """By default each file goes through torch.save; with the pickler accelerator torch.save
    is not called. Either way the bytes are torch.save's own (non-zip format) and load with
    ``weights_only=True``."""
    import torch

    ts = saver_module(TENSOR_SAVE_ACCELERATORS=accelerators)
    sp.pickler._legacy_header()  # taken from torch.save once per process
    assert ts.accelerator_status()["pickler"] == (
        "off" if accelerators == "none" else "on: pickler"
    )
    calls = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: calls.append(1) or real(*a, **k))
    tensors = [torch.randn(128, 64).to(torch.bfloat16) for _ in range(4)]
    for layer, tensor in enumerate(tensors):
        ts.save_tensor(tensor, "linear", "forward", None, "input", layer)
    assert ts.flush()["files"] == 4
    assert len(calls) == torch_saves
    monkeypatch.setattr(torch, "save", real)
    for path in (tmp_path / "t").glob("*.pt"):
        obj = torch.load(path, weights_only=True)
        assert torch.equal(obj["tensor"], tensors[obj["metadata"]["layer_idx"]])
        assert obj["tensor_info"]["shape"] == [128, 64] and obj["metadata"]["micro_step"] == 0


@pytest.mark.parametrize("missing", ["rebuild", "storage_type", "version"])
def test_the_pickler_falls_back_to_torch_save_without_the_private_names(
    saver_module, monkeypatch, tmp_path, missing
):
    """The pickler needs torch-private names; on a torch without one of them (or one it was
    not checked on) it declines, says why, and torch.save writes the file. The names are
    taken away while the pickler looks for them (torch.save itself needs them)."""
    import torch

    ts = saver_module(TENSOR_SAVE_ACCELERATORS="pickler")
    sp.pickler.why_not.cache_clear()
    assert sp.pickler.why_not() == ""  # the normal path on this torch
    tensor = torch.randn(64, 32)
    calls = []
    real = torch.save
    try:
        with monkeypatch.context() as m:
            if missing == "rebuild":
                m.delattr(torch._utils, "_rebuild_tensor_v2")
            elif missing == "storage_type":
                m.delattr(torch.storage.TypedStorage, "_pickle_storage_type")
            else:
                m.setattr(torch, "__version__", "9.0.0")
            sp.pickler.why_not.cache_clear()
            sp.pickler.why_not()  # looked for once per process
        why = ts.accelerator_status()["pickler"]
        want = {
            "rebuild": "this torch has no torch._utils._rebuild_tensor_v2",
            "storage_type": "this torch has no TypedStorage._pickle_storage_type",
            "version": "torch 9.0.0 is not one it was checked on (2.1 to 2.13)",
        }[missing]
        assert why == f"on: torch.save ({want})"
        assert sp.pickler.plain_bytes({"tensor": tensor}, tensor) is None
        with monkeypatch.context() as m:
            m.setattr(torch, "save", lambda *a, **k: calls.append(1) or real(*a, **k))
            ts.save_tensor(tensor, "linear", "forward", None, "input", 3)
            assert ts.flush()["files"] == 1
    finally:
        sp.pickler.why_not.cache_clear()
    assert calls == [1]
    (path,) = (tmp_path / "t").glob("*.pt")
    assert torch.equal(torch.load(path, weights_only=True)["tensor"], tensor)


def test_a_tensor_in_the_metadata_or_a_wrapper_subclass_is_written_as_torch_saves(
    saver_module, monkeypatch, tmp_path
):
    """The snapshot's view stands only for the one storage torch.save writes: a tensor of
    the same size in the metadata (two storages, written in address order) and a subclass
    wrapping two tensors (storages of its own) are copied as torch.save writes them."""
    import torch
    from torch.testing._internal.two_tensor import TwoTensor

    ts = saver_module()
    expected = {}
    recorded = sp.ondisk.torch_bytes

    def _torch_bytes(obj, host):
        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=False)
        expected[obj["metadata"]["layer_idx"]] = buffer.getvalue()
        return recorded(obj, host)

    monkeypatch.setattr(sp.ondisk, "torch_bytes", _torch_bytes)
    tensors = [torch.full((128, 128), float(i)) for i in range(8)]  # 64 KiB, as the scale
    for i, tensor in enumerate(tensors):
        scale = {"scale": torch.full((128, 128), -1.0)}
        ts.save_tensor(tensor, "linear", "forward", None, "input", i, metadata=scale)
    pair = TwoTensor(torch.randn(96, 128), torch.randn(96, 128))  # no pool buffer: a clone
    ts.save_tensor(pair, "linear", "forward", None, "weight", 8)
    assert ts.flush()["files"] == 9
    for path in (tmp_path / "t").glob("*.pt"):
        obj = torch.load(path, weights_only=False)
        layer = obj["metadata"]["layer_idx"]
        assert path.read_bytes() == expected[layer]
        if layer < 8:
            assert torch.equal(obj["tensor"], tensors[layer])
            assert torch.equal(obj["metadata"]["scale"], torch.full((128, 128), -1.0))
        else:
            assert type(obj["tensor"]) is TwoTensor and torch.equal(obj["tensor"].a, pair.a)


def test_writes_cut_short_are_finished_and_the_file_is_torch_saves(
    saver_module, monkeypatch, tmp_path
):
    """os.writev and os.write may write less than asked (a signal, a nearly full disk): the
    rest follows, and the file is byte for byte what torch.save writes."""
    import torch

    ts = saver_module()
    sizes = []

    class _Os:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            sizes.append(len(data))
            return os.write(fd, bytes(memoryview(data)[:1000]))

        @staticmethod
        def writev(fd, buffers):
            return _Os.write(fd, b"".join(bytes(b) for b in buffers))

    expected = []
    recorded = sp.ondisk.torch_bytes

    def _torch_bytes(obj, host):  # what torch.save writes for the same object
        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=False)
        expected.append(buffer.getvalue())
        return recorded(obj, host)

    monkeypatch.setattr(sp.ondisk, "torch_bytes", _torch_bytes)
    monkeypatch.setattr(sp.ondisk, "os", _Os())
    tensor = torch.arange(5000, dtype=torch.bfloat16).reshape(50, 100)
    ts.save_tensor(tensor, "linear", "forward", None, "input", 1)
    assert ts.flush()["files"] == 1
    (path,) = (tmp_path / "t").glob("*.pt")
    assert len(sizes) > 10  # cut short many times
    assert torch.equal(torch.load(path, weights_only=True)["tensor"], tensor)
    assert [path.read_bytes()] == expected


def test_stats_only_lines_stay_whole_with_several_writers(saver_module, tmp_path):
    import torch

    ts = saver_module(TENSOR_SAVE_STATS_ONLY="true", TENSOR_SAVE_WRITERS="4")
    for layer in range(40):
        ts.save_tensor(torch.full((50,), float(layer)), "linear", "forward", None, "x", layer)
    assert ts.flush()["files"] == 40
    lines = (tmp_path / "t" / "stats_rank0.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert sorted(r["tensor_info"]["max"] for r in recs) == [float(i) for i in range(40)]


_QUANTIZED = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")


def _every_dtype() -> list:
    import torch

    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def _sample(dtype, seed: int):
    """A tensor of ``dtype`` with varied bytes: random bytes (0 and 1 for bool), or
    quantized from random floats."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if str(dtype).removeprefix("torch.") in _QUANTIZED:
        return torch.quantize_per_tensor(torch.rand(8, 8, generator=gen), 0.05, 2, dtype)
    raw = torch.randint(0, 256, (8, 8 * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return (raw % 2 if dtype == torch.bool else raw).view(dtype)


def _bytes(t) -> bytes:
    """The bytes of ``t``'s elements (a quantized tensor's integers, scale and zero point)."""
    import torch

    if t.is_quantized:
        params = repr((t.q_scale(), t.q_zero_point())).encode()
        return bytes(t.int_repr().reshape(-1).view(torch.uint8).tolist()) + params
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", [str(d).removeprefix("torch.") for d in _every_dtype()])
def test_every_dtype_is_saved_so_that_torch_load_reads_it_bit_for_bit(
    saver_module, tmp_path, dtype
):
    """Every dtype torch has: what torch can save is written (the non-zip format where it
    holds the dtype, else the zip format: float8, uint16/32/64, complex32, bits and packed
    fp4 were written in a format torch.load cannot read), read back by
    ``torch.load(weights_only=True)`` with the same bytes, twice (the second through a
    pooled snapshot buffer); what torch cannot save at all is counted as failed, with
    torch's reason. Statistics are None where the dtype has none (complex, bits, packed
    fp4, quantized), float64's where its values are numbers."""
    import math

    import torch

    ts = saver_module()
    dt = getattr(torch, dtype)
    try:
        torch.save(_sample(dt, 0), io.BytesIO())
        savable = True
    except Exception:
        savable = False
    for seed in (1, 2):
        t = _sample(dt, seed)
        ts.save_tensor(t, "linear", "forward", "bf16", f"x{seed}", 1)
        report = ts.flush()
        if not savable:
            assert (report["files"], report["failed"]) == (0, seed), report
            assert dtype in report["errors"][0], report
            continue
        assert (report["files"], report["failed"]) == (seed, 0), report
        (path,) = (tmp_path / "t").glob(f"*_x{seed}.pt")
        obj = torch.load(path, weights_only=True)
        got = obj["tensor"]
        assert got.dtype == dt and got.shape == t.shape
        assert _bytes(got) == _bytes(t)
        info = obj["tensor_info"]
        assert info["dtype"] == str(dt)
        stats = [info[k] for k in ("min", "max", "mean", "std")]
        reducible = not (
            dt.is_complex or t.is_quantized or dtype.startswith("bits") or "float4" in dtype
        )
        if reducible:
            d = t.to(torch.float64)
            want = torch.tensor([d.min(), d.max()], dtype=torch.float32).tolist()
            assert [math.isnan(v) for v in stats[:2]] == [math.isnan(v) for v in want]
            assert [v for v in stats[:2] if v == v] == [v for v in want if v == v]
        else:
            assert stats == [None] * 4
    if savable:  # the statistics a device tensor's would get, on the host here
        t = _sample(dt, 3)
        assert len(sp.stats.combine(sp.stats.device_moments(t).tolist(), t.numel())) == 4
