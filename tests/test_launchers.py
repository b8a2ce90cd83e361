"""Parallel layouts and the three launchers (torchrun, Slurm, ms-swift).

Layout rules are table-driven, each on both sides of its boundary. The launch scripts are run
end to end with stub ``sbatch``, ``srun``, ``scontrol``, ``torchrun`` and ``megatron``
executables that record their argument vectors, working directory and environment, on a git
checkout built from the real megatron-core files. ms-swift's argument names are read from the
real ms-swift wheels on PyPI (fetched at test time, never imported).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import git
import pytest

from quantpatch.base.megatron_source import cache_dir
from quantpatch.launch.layout import LayoutError, Plan, derive, plan_from_text
from quantpatch.launch.registry import load_registry, release_flags
from quantpatch.launch.scripts import render_all
from quantpatch.launch.swift import bundled, read_swift

QUANTPATCH = str(Path(sys.executable).with_name("quantpatch"))
SHELLCHECK = str(Path(sys.executable).with_name("shellcheck"))


@pytest.fixture(autouse=True)
def _outside_any_checkout(tmp_path, monkeypatch):
    """Start outside any checkout, with a state home of the test's own."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


BASE = Plan(
    gpus_per_node=8,
    nodes=2,
    layers=32,
    heads=32,
    query_groups=8,
    seq_length=4096,
    micro_batch=1,
    global_batch=256,
)

# (sizes that pass, sizes just across the boundary, the refusal)
RULES = [
    pytest.param(
        {"tp": 2},
        {"tp": 3},
        "world size 16 (2 nodes x 8 GPUs) is not divisible by TP 3 x PP 1 x CP 1 = 3; "
        "TP 2 would work.",
        id="world-divisible-by-tp-pp-cp",
    ),
    pytest.param(
        {"pp": 4},
        {"pp": 5},
        "world size 16 (2 nodes x 8 GPUs) is not divisible by TP 1 x PP 5 x CP 1 = 5; "
        "PP 4 would work.",
        id="world-divisible-by-pp",
    ),
    pytest.param(
        {"heads": 24, "query_groups": None, "tp": 8},
        {"heads": 20, "query_groups": None, "tp": 8},
        "20 attention heads are not divisible by TP 8; TP 4 would work.",
        id="heads-divisible-by-tp",
    ),
    pytest.param(
        {"query_groups": 8, "tp": 8},
        {"query_groups": 4, "tp": 8},
        "4 query groups are not divisible by TP 8; TP 4 would work.",
        id="query-groups-divisible-by-tp",
    ),
    pytest.param(
        {"sequence_parallel": "on", "tp": 2},
        {"sequence_parallel": "on", "tp": 1},
        "sequence parallel needs TP > 1 (TP is 1); TP 2 would work.",
        id="sequence-parallel-needs-tp",
    ),
    pytest.param(
        {"seq_length": 4100, "tp": 4, "sequence_parallel": "on"},
        {"seq_length": 4098, "tp": 4, "sequence_parallel": "on"},
        "sequence length 4098 / CP 1 = 4098 is not divisible by TP 4 (sequence parallel splits "
        "each CP rank's part of the sequence across TP ranks); sequence parallel off "
        "(--sequence-parallel off, SEQUENCE_PARALLEL=off) would work.",
        id="sequence-divisible-by-tp",
    ),
    pytest.param(
        {"tp": 2, "normalization": "RMSNorm"},
        {"tp": 2, "normalization": "RMSNorm", "sequence_parallel": "on"},
        "sequence parallel cannot run with the local layers: their RMSNorm is torch's norm "
        "(WrappedTorchNorm), which refuses it; sequence parallel off (--sequence-parallel off, "
        "SEQUENCE_PARALLEL=off) would work.",
        id="local-rmsnorm-refuses-sequence-parallel",
    ),
    pytest.param(
        {"tp": 2, "transformer_impl": "transformer_engine", "seq_length": 4096, "cp": 2},
        {"tp": 4, "transformer_impl": "transformer_engine", "seq_length": 4100, "cp": 2},
        "sequence length 4100 / CP 2 = 2050 is not divisible by TP 4 (sequence parallel splits "
        "each CP rank's part of the sequence across TP ranks); sequence parallel off "
        "(--sequence-parallel off, SEQUENCE_PARALLEL=off) would work.",
        id="sequence-over-cp-divisible-by-tp",
    ),
    pytest.param(
        {"cp": 1},
        {"cp": 2},
        "CP 2 needs Transformer Engine attention, but the local DotProductAttention (where the "
        "qk/pv sites live) supports only CP 1; CP 1 would work.",
        id="local-attention-no-cp",
    ),
    pytest.param(
        {"cp": 2, "transformer_impl": "transformer_engine", "seq_length": 4100},
        {"cp": 2, "transformer_impl": "transformer_engine", "seq_length": 4098},
        "sequence length 4098 is not divisible by 2 x CP = 4; CP 1 would work.",
        id="sequence-divisible-by-2cp",
    ),
    pytest.param(
        {"layers": 30, "pp": 2},
        {"layers": 30, "pp": 4},
        "30 layers are not divisible by PP 4; PP 2 would work.",
        id="layers-divisible-by-pp",
    ),
    pytest.param(
        {"vpp": 2, "pp": 2},
        {"vpp": 2, "pp": 1},
        "VPP 2 (interleaved pipeline) needs PP > 1 (PP is 1); PP 2 would work.",
        id="vpp-needs-pp",
    ),
    pytest.param(
        {"pp": 2, "vpp": 4},
        {"pp": 2, "vpp": 3},
        "32 layers are not divisible by PP 2 x VPP 3 = 6; VPP 2 would work.",
        id="layers-divisible-by-pp-vpp",
    ),
    pytest.param(
        {"ep": 1},
        {"ep": 2},
        "EP 2 needs a mixture-of-experts model (this one has no experts); EP 1 would work.",
        id="ep-needs-experts",
    ),
    pytest.param(
        {"experts": 64, "ep": 8},
        {"experts": 64, "ep": 6},
        "64 experts are not divisible by EP 6; EP 4 would work.",
        id="experts-divisible-by-ep",
    ),
    pytest.param(
        {"experts": 64, "tp": 2, "ep": 16, "etp": 1, "transformer_impl": "transformer_engine"},
        {"experts": 64, "tp": 2, "ep": 16, "transformer_impl": "transformer_engine"},
        "EP 16 x expert TP 2 = 32 does not divide DP 8 x CP 1 x TP 2 = 16; EP 8 would work.",
        id="ep-etp-divide-dp-cp-tp",
    ),
    pytest.param(
        {"experts": 64, "tp": 2, "ep": 2, "transformer_impl": "transformer_engine"},
        {
            "experts": 64,
            "tp": 2,
            "ep": 2,
            "transformer_impl": "transformer_engine",
            "sequence_parallel": "off",
        },
        "EP 2 with TP 2 needs sequence parallel (it is off); sequence parallel on "
        "(--sequence-parallel on, SEQUENCE_PARALLEL=on) would work.",
        id="ep-with-tp-needs-sequence-parallel",
    ),
    pytest.param(
        {"experts": 64, "tp": 2, "ep": 1, "normalization": "RMSNorm"},
        {"experts": 64, "tp": 2, "ep": 2, "normalization": "RMSNorm"},
        "EP 2 with TP 2 needs sequence parallel, which the local layers cannot run (their "
        "RMSNorm is torch's norm, which refuses it); TP 1 would work.",
        id="local-ep-with-tp-impossible",
    ),
    pytest.param(
        {"global_batch": 272},
        {"global_batch": 264},
        "global batch 264 is not divisible by micro batch 1 x DP 16 = 16; global batch 256 "
        "(--global-batch 256, GLOBAL_BATCH_SIZE=256) would work.",
        id="global-batch-divisible-by-micro-dp",
    ),
    pytest.param(
        {"pp": 4, "vpp": 2, "global_batch": 16},
        {"pp": 4, "vpp": 2, "global_batch": 8},
        "VPP 2 needs the micro-batches per step (8 / (micro batch 1 x DP 4) = 2) to be a "
        "multiple of PP 4, at least PP; global batch 16 (--global-batch 16, "
        "GLOBAL_BATCH_SIZE=16) would work.",
        id="vpp-micro-batches-multiple-of-pp",
    ),
]


@pytest.mark.parametrize(("good", "bad", "sentence"), RULES)
def test_every_layout_rule_on_both_sides_of_its_boundary(good, bad, sentence):
    derive(replace(BASE, **good))
    with pytest.raises(LayoutError) as exc:
        derive(replace(BASE, **bad))
    assert str(exc.value) == sentence
    # the suggested choice does work
    found = re.search(
        r"; (TP|PP|CP|EP|VPP|global batch|sequence parallel) (\w+)( \([\w-]+ \w+, \w+=\w+\))? "
        r"would work\.$",
        sentence,
    )
    assert found is not None
    field = {"global batch": "global_batch", "sequence parallel": "sequence_parallel"}.get(
        found[1], found[1].lower()
    )
    value = int(found[2]) if found[2].isdigit() else found[2]
    derive(replace(BASE, **{**bad, field: value}))


def test_derived_numbers_and_the_cross_node_warning():
    # the local layers' norms refuse sequence parallel: auto leaves it off there
    local = derive(replace(BASE, tp=2, pp=2, global_batch=64, micro_batch=2))
    assert not local.sequence_parallel and not local.warnings
    layout = derive(
        replace(
            BASE, tp=2, pp=2, global_batch=64, micro_batch=2, transformer_impl="transformer_engine"
        )
    )
    assert (layout.world, layout.dp, layout.grad_accum) == (16, 4, 8)
    assert layout.sequence_parallel and not layout.warnings
    assert layout.line() == (
        "world 16 (2 nodes x 8 GPUs) = TP 2 x PP 2 x CP 1 x DP 4; sequence parallel on; "
        "global batch 64 = micro batch 2 x DP 4 x 8 accumulation steps"
    )
    wide = derive(replace(BASE, tp=16, query_groups=16))
    assert wide.dp == 1 and wide.warnings == (
        "TP 16 is larger than the 8 GPUs of a node: tensor-parallel all-reduces will cross nodes",
    )
    moe = derive(replace(BASE, experts=64, ep=8, tp=2, transformer_impl="transformer_engine"))
    assert "EP 8 x expert TP 2 over 64 experts" in moe.line()


def test_every_suggestion_is_valid_over_a_grid():
    """Whatever is refused, a `would work` suggestion is a layout that derives."""
    checked = 0
    for tp in (1, 2, 3, 4, 8):
        for pp in (1, 2, 3, 4):
            for ep in (1, 2, 3, 8):
                for gb in (30, 32, 64):
                    plan = replace(BASE, tp=tp, pp=pp, ep=ep, global_batch=gb, experts=64)
                    try:
                        derive(plan)
                        continue
                    except LayoutError as exc:
                        found = re.search(
                            r"(TP|PP|CP|EP|VPP|global batch) (\d+) would work", str(exc)
                        )
                    if found:
                        field = {"global batch": "global_batch"}.get(found[1], found[1].lower())
                        derive(replace(plan, **{field: int(found[2])}))
                        checked += 1
    assert checked > 50


@pytest.mark.parametrize(
    ("given", "gpus", "sentence"),
    [
        ({"tp": "abc"}, None, "--tp (TP) must be an integer from 1 to 1048576, written in plain"),
        ({"tp": "0"}, None, "--tp (TP) must be an integer from 1 to 1048576"),
        # bash arithmetic reads 08 as octal and ' 2' would reach torchrun with its space
        ({"vpp": "08"}, None, "--vpp (VPP) must be an integer from 1 to 1048576"),
        ({"tp": " 2"}, None, "--tp (TP) must be an integer from 1 to 1048576"),
        ({"tp": "\u0661"}, None, "--tp (TP) must be an integer"),  # an Arabic-Indic one
        ({"nodes": "99999999"}, None, "--nodes (NNODES) must be an integer from 1 to 1048576"),
        ({"gpus_per_node": "0"}, "16", "--gpus-per-node (GPUS_PER_NODE) must be an integer from 1"),
        ({"sequence_parallel": "maybe"}, None, "SEQUENCE_PARALLEL must be auto, on or off"),
        ({"nodes": "3"}, "16", "--gpus 16 does not match 3 nodes x 8 GPUs per node = 24"),
        ({"nodes": "1"}, "16", "--gpus 16 does not match 1 node x 8 GPUs per node = 8"),
        ({}, "12", "--gpus 12 is not a whole number of 8-GPU nodes; 8 or 16 GPUs would be."),
    ],
)
def test_text_values_are_refused_with_a_sentence(given, gpus, sentence):
    with pytest.raises(LayoutError) as exc:
        derive(plan_from_text(given, BASE, gpus))
    assert str(exc.value).startswith(sentence)


def test_layout_names_flags_and_refuses_a_host_with_a_space(run):
    """Refusals name the option given (and the script's variable), and MASTER_ADDR must be
    one host: 'a b' reached torchrun's --rdzv-endpoint as two words' worth of text."""
    res = run("layout", "--model", "llama31-8b", "--nodes", "0")
    assert res.code == 2 and "--nodes (NNODES) must be an integer from 1" in res.err
    res = run("layout", "--model", "llama31-8b", "--micro-batch", "x")
    assert res.code == 2 and "--micro-batch (MICRO_BATCH_SIZE) must be an integer" in res.err
    res = run("layout", "--model", "llama31-8b", "--gpus", "16", "--master-addr", "a b")
    assert res.code == 2
    assert "MASTER_ADDR (--master-addr) must be a host name or an IP address" in res.err
    for host in ("node-0.cluster", "10.1.2.3", "[fe80::1%eth0]"):
        res = run("layout", "--model", "llama31-8b", "--gpus", "16", "--master-addr", host)
        assert res.code == 0, (host, res)


def test_layout_command(run):
    res = run("layout", "--model", "llama31-8b", "--gpus", "64", "--tp", "4", "--json")
    assert res.code == 0, res
    data = json.loads(res.out)
    assert (data["world"], data["dp"], data["grad_accum"]) == (64, 16, 16)
    assert data["plan"]["nodes"] == 8 and data["plan"]["layers"] == 32
    res = run("layout", "--model", "llama31-8b", "--gpus", "64", "--tp", "3")
    assert res.code == 2
    assert res.err.strip() == (
        "error: llama31-8b/full: world size 64 (8 nodes x 8 GPUs) is not divisible by TP 3 x "
        "PP 1 x CP 1 = 3; TP 2 would work."
    )
    res = run("layout", "--model", "deepseek2_lite", "--gpus", "16", "--ep", "8")
    assert res.code == 0 and "64 over EP 8 (8 per rank)" in res.out
    # no model: the facts themselves; a missing one is named
    res = run("layout", "--num-layers", "4", "--heads", "8", "--seq-length", "128")
    assert res.code == 2 and "a layout needs --model or --micro-batch, --global-batch" in res.err
    res = run(
        "layout", "--line", "--num-layers", "4", "--heads", "8", "--seq-length", "128",
        "--micro-batch", "1", "--global-batch", "8", "--gpus-per-node", "8", "--tp", "2",
    )  # fmt: skip
    assert res.code == 0 and res.out == (
        "world 8 (1 node x 8 GPUs) = TP 2 x PP 1 x CP 1 x DP 4; sequence parallel off; "
        "global batch 8 = micro batch 1 x DP 4 x 2 accumulation steps\n"
    )


def test_gen_scripts_refuses_a_bad_profile_layout_and_writes_nothing(run, tmp_path):
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out, "--tp", "3")
    assert res.code == 2 and not out.exists()
    assert "llama31-8b/full: world size 8 (1 node x 8 GPUs) is not divisible by TP 3" in res.err
    config = tmp_path / "cluster.toml"
    config.write_text("[profiles.full.parallel]\nnodes = 2\npp = 3\n")
    res = run("gen-scripts", "--out", out, "--config", config)
    assert res.code == 2 and not out.exists()
    assert (
        "not divisible by TP 1 x PP 3 x CP 1 = 3; PP 2 would work (pp = 2 in the "
        "[profiles.full.parallel] table of a --config)."
    ) in " ".join(res.err.split())
    config.write_text("[profiles.full.parallel]\nnodes = 2\nwarp = 3\n")
    res = run("gen-scripts", "--out", out, "--config", config)
    assert res.code == 2 and "parallel.warp is unknown" in res.err
    config.write_text('[slurm]\npartition = "gpu; rm -rf ~"\n')
    res = run("gen-scripts", "--out", out, "--config", config, "--launcher", "slurm")
    assert res.code == 2 and "slurm.partition must be one word" in res.err
    res = run("gen-scripts", "--out", out, "--launcher", "mpirun")
    assert res.code == 2 and "unknown launcher 'mpirun'" in res.err
    assert not out.exists()


# -- stub executables ---------------------------------------------------------------------

RECORD = """#!/usr/bin/env bash
# a stub: records its argument vector, working directory and environment
n="$(date +%s%N)-$$"
printf '%s\\0' "$0" "$@" > "$STUB_DIR/$n.argv"
pwd > "$STUB_DIR/$n.cwd"
env | grep -E '^(SLURM_|MEGATRON_LM_PATH|NPROC_PER_NODE|NNODES|NODE_RANK|MASTER_|TENSOR_SAVE_)' \\
    | sort > "$STUB_DIR/$n.env"
"""
STUBS = {
    "torchrun": RECORD + 'exit "${STUB_EXIT:-0}"\n',
    "megatron": RECORD + 'exit "${STUB_EXIT:-0}"\n',
    "scontrol": """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 9
printf 'gpu01\\ngpu02\\n'
""",
    # srun: one task per node, in --chdir, with the node's SLURM_NODEID
    "srun": RECORD
    + """nodes=1; dir="$PWD"
while [[ "$1" == --* ]]; do
    case "$1" in
        --nodes) nodes="$2"; shift 2 ;;
        --chdir) dir="$2"; shift 2 ;;
        --ntasks-per-node) shift 2 ;;
        *) shift ;;
    esac
done
status=0
for (( i = 0; i < nodes; i++ )); do
    (cd "$dir" && SLURM_NODEID="$i" SLURM_PROCID="$i" "$@") || status=$?
done
exit "$status"
""",
    # sbatch: records, then runs the script at once as a 2-node allocation (an array task
    # when STUB_ARRAY_TASK is set)
    "sbatch": RECORD
    + """script="${@: -1}"
export SLURM_JOB_ID=4242 SLURM_JOB_NUM_NODES=2 SLURM_JOB_NODELIST='gpu[01-02]'
export SLURM_GPUS_ON_NODE="${STUB_GPUS:-8}"
if [[ -n "${STUB_ARRAY_TASK:-}" ]]; then
    export SLURM_ARRAY_JOB_ID=4200 SLURM_ARRAY_TASK_ID="$STUB_ARRAY_TASK"
fi
bash "$script"
""",
}


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "stub"
    record.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(record),
        "QUANTPATCH": QUANTPATCH,
        "OUTPUT_ROOT": str(tmp_path / "runs"),
        # these launches are not about data: the scripts' dataset check stays quiet
        "MOCK_DATA": "1",
    }
    return env, record


def calls(record: Path, tool: str) -> list[tuple[list[str], str, dict[str, str]]]:
    """The recorded calls of one stub, in order: argv (without argv[0]), cwd, environment."""
    out = []
    for argv in sorted(record.glob("*.argv")):
        words = argv.read_text().split("\0")[:-1]
        if Path(words[0]).name != tool:
            continue
        stem = argv.with_suffix("")
        env = dict(
            line.split("=", 1)
            for line in stem.with_suffix(".env").read_text().splitlines()
            if "=" in line
        )
        out.append((words[1:], stem.with_suffix(".cwd").read_text().strip(), env))
    return out


def _gen(run, out: Path, *extra: str | Path) -> None:
    res = run("gen-scripts", "--out", out, "--models", "llama32-1b", "--datasets", "dolma", *extra)
    assert res.code == 0, res


def _worktrees(root: Path) -> list[str]:
    base = root / ".git" / "quantpatch" / "worktrees"
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []


TORCHRUN_2X8 = [
    "--nnodes",
    "2",
    "--nproc-per-node",
    "8",
    "--rdzv-backend",
    "c10d",
    "--rdzv-endpoint",
]


@pytest.mark.slow
def test_torchrun_two_nodes_and_a_bad_override(make_checkout, tmp_path, stubs, run):
    env, record = stubs
    root = make_checkout()
    out = tmp_path / "scripts"
    _gen(run, out, "--nodes", "2", "--tp", "2")
    script = out / "llama32-1b" / "pretrain_llama32-1b_dolma_FA_mxfp8.sh"
    node = {**env, "MASTER_ADDR": "gpu01", "MASTER_PORT": "29500", "GPUS_PER_NODE": "8"}
    # a bad environment override stops the script before anything starts, with the sentence
    res = subprocess.run(
        [str(script)], cwd=root, env={**node, "TP": "3"}, capture_output=True, text=True
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "error: world size 16 (2 nodes x 8 GPUs) is not divisible by TP 3 x PP 1 x CP 1 = 3; "
        "TP 2 would work."
    )
    assert not list(record.iterdir()) and _worktrees(root) == []
    res = subprocess.run(
        [str(script)],
        cwd=root,
        env={**node, "GLOBAL_BATCH_SIZE": "20"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "global batch 20 is not divisible by micro batch 1 x DP 8" in (
        res.stderr
    )
    for bad, sentence in (
        ({"VPP": "08", "PP": "2"}, "--vpp (VPP) must be an integer from 1 to 1048576"),
        ({"MASTER_ADDR": "localhost"}, "NNODES=2 needs MASTER_ADDR set to a host every node"),
        ({"TP": "$(touch pwned)"}, "--tp (TP) must be an integer"),
        ({"MASTER_PORT": "abc"}, "MASTER_PORT must be a port from 1 to 65535 (got 'abc')."),
    ):
        res = subprocess.run(
            [str(script)], cwd=root, env={**node, **bad}, capture_output=True, text=True
        )
        assert res.returncode == 2 and sentence in res.stderr, res.stderr
    assert not list(record.iterdir()) and _worktrees(root) == []
    assert not (root / "pwned").exists()
    # one node: torchrun's standalone rendezvous (its own free port and id: runs never meet)
    res = subprocess.run(
        [str(script)], cwd=root, env={**env, "NNODES": "1"}, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    ((single, _, _),) = calls(record, "torchrun")
    assert single[:6] == [
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "8",
        "pretrain_gpt.py",
    ]
    for path in record.iterdir():
        path.unlink()
    # the same script on both nodes
    for _ in range(2):
        res = subprocess.run(
            [str(script)],
            cwd=root,
            env={**node, "GLOBAL_BATCH_SIZE": "32"},
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stdout + res.stderr
    (first, cwd, _), (second, _, _) = calls(record, "torchrun")
    assert first == second
    assert first[:11] == [
        *TORCHRUN_2X8,
        "gpu01:29500",
        "--rdzv-id",
        "llama32-1b_dolma_FA_mxfp8_full",
        "pretrain_gpt.py",
    ]
    pairs = dict(zip(first, [*first[1:], ""], strict=True))
    # sequence parallel stays off: the local RMSNorm is torch's norm, which refuses it
    assert pairs["--tensor-model-parallel-size"] == "2" and "--sequence-parallel" not in first
    assert (pairs["--micro-batch-size"], pairs["--global-batch-size"]) == ("1", "32")
    assert Path(cwd).name == "quantpatch__linear-bf16_qk-mxfp8_pv-bf16"
    host = os.uname().nodename.split(".")[0]
    logs = (tmp_path / "runs" / "llama32-1b_dolma_FA_mxfp8_full" / "logs").glob(f"*_{host}.log")
    log = next(logs)  # one per node (both "nodes" are this host here)
    assert (
        "[quantpatch] layout: world 16 (2 nodes x 8 GPUs) = TP 2 x PP 1 x CP 1 x DP 8; "
        "sequence parallel off; global batch 32 = micro batch 1 x DP 8 x 4 accumulation steps"
    ) in log.read_text()


@pytest.mark.slow
def test_slurm_scripts_and_the_sweep_array(make_checkout, tmp_path, stubs, run):
    env, record = stubs
    root = make_checkout()
    out = tmp_path / "scripts"
    config = tmp_path / "cluster.toml"
    config.write_text(
        '[slurm]\npartition = "gpu"\naccount = "proj-42"\ntime = "02:00:00"\nthrottle = 4\n'
    )
    _gen(run, out, "--launcher", "slurm", "--nodes", "2", "--config", config)
    scripts = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.sbatch"))
    assert len(scripts) == 11 and "sweep.sbatch" in scripts
    for path in out.rglob("*.sbatch"):
        subprocess.run(["bash", "-n", str(path)], check=True)
    sc = subprocess.run(
        [SHELLCHECK, "-S", "style", *map(str, out.rglob("*.sbatch"))],
        capture_output=True,
        text=True,
    )
    assert sc.returncode == 0, sc.stdout[-2000:]
    sweep = (out / "sweep.sbatch").read_text()
    assert re.findall(r"^#SBATCH (.*)$", sweep, re.M) == [
        "--job-name=quantpatch-sweep-full",
        "--array=0-9%4",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=24",  # 8 ranks, each with Megatron's 2 data-loader workers
        "--gpus-per-node=8",
        "--output=%x-%A_%a.out",
        "--partition=gpu",
        "--account=proj-42",
        "--time=02:00:00",
    ]
    one = out / "llama32-1b" / "pretrain_llama32-1b_dolma_FA_mxfp8.sbatch"
    assert "#SBATCH --nodes=2\n" in one.read_text()
    # torchrun scripts written into the same folder later: the sbatch files are said to remain
    res = run("gen-scripts", "--out", out, "--models", "llama32-1b", "--datasets", "dolma")
    assert res.code == 0 and "note: 11 other quantpatch script(s)" in res.err
    assert "pretrain_llama32-1b_dolma_FA_hifp8.sbatch" in res.err and one.is_file()
    for path in out.rglob("*.sh"):
        path.unlink()
    # run outside an allocation: refused
    res = subprocess.run(["bash", str(one)], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "submit it with sbatch" in res.stderr
    # submitted from outside the checkout: said so
    res = subprocess.run(
        ["sbatch", str(one)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert res.returncode == 2 and f"MEGATRON_ROOT={tmp_path} is not a git checkout" in res.stderr
    # submitted before the worktrees were prepared: the job stops, it creates nothing
    res = subprocess.run(["sbatch", str(one)], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "no prepared worktree" in res.stderr
    assert _worktrees(root) == [] and not calls(record, "srun")
    # --prepare makes every scheme's worktree before submission
    _gen(run, out, "--launcher", "slurm", "--nodes", "2", "--config", config, "--prepare",
         "--repo", root)  # fmt: skip
    assert len(_worktrees(root)) == 10
    res = subprocess.run(["sbatch", str(one)], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    # the task's output does not start with the full sites table
    assert "roles:" not in res.stdout + res.stderr and "file:line" not in res.stdout
    ((srun, _, _),) = calls(record, "srun")
    wt = str(
        root / ".git" / "quantpatch" / "worktrees" / "quantpatch__linear-bf16_qk-mxfp8_pv-bf16"
    )
    assert srun[:9] == [
        "--nodes",
        "2",
        "--ntasks-per-node",
        "1",
        "--cpus-per-task=24",
        "--kill-on-bad-exit=1",
        "--chdir",
        wt,
        "torchrun",
    ]
    nodes = calls(record, "torchrun")
    assert [e["SLURM_NODEID"] for _, _, e in nodes] == ["0", "1"]
    port = re.search(r"MASTER_PORT=(\d+)", one.read_text())[1]
    for argv, cwd, _ in nodes:
        assert cwd == wt
        assert argv[:11] == [
            *TORCHRUN_2X8,
            f"gpu01:{port}",
            "--rdzv-id",
            "llama32-1b_dolma_FA_mxfp8_full-4242",
            "pretrain_gpt.py",
        ]
        assert argv == srun[9:]
    # the submitting shell's variables do not change the allocation's launch
    first = nodes[0][0]
    for path in record.iterdir():
        path.unlink()
    hostile = {"GPUS_PER_NODE": "3", "MASTER_ADDR": "oldnode07", "NNODES": "1",
               "NODE_RANK": "5", "MASTER_PORT": "1234", "RDZV_ID": "old",
               "PET_NODE_RANK": "5", "PET_MAX_RESTARTS": "7"}  # fmt: skip
    res = subprocess.run(
        ["sbatch", str(one)], cwd=root, env={**env, **hostile}, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    hosts = calls(record, "torchrun")
    assert [a for a, _, _ in hosts] == [first, first]
    assert all("NODE_RANK" not in e for _, _, e in hosts)
    # an allocation other than the one generated for: refused before srun, saying so
    for path in record.iterdir():
        path.unlink()
    res = subprocess.run(
        ["sbatch", str(one)], cwd=root, env={**env, "STUB_GPUS": "4"}, capture_output=True,
        text=True,
    )  # fmt: skip
    assert res.returncode == 2 and "has 4 GPU(s) a node but" in res.stderr
    assert "generated for 8" in res.stderr and not calls(record, "srun")
    # the array: task 3 runs row 3 of the index
    for path in record.iterdir():
        path.unlink()
    index = (out / "index.md").read_text()
    row = re.search(r"^\| 3 \| `([^`]+)` \|", index, re.M)[1]
    res = subprocess.run(
        ["sbatch", str(out / "sweep.sbatch")],
        cwd=root,
        env={**env, "STUB_ARRAY_TASK": "3"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"array task 3 of 10: {row}" in res.stdout
    ((argv, cwd, task_env),) = calls(record, "torchrun")[:1]
    scheme = row.rsplit("_dolma_", 1)[1].removesuffix(".sbatch")
    port = re.search(r"MASTER_PORT=(\d+)", (out / row).read_text())[1]
    assert argv[:11] == [
        *TORCHRUN_2X8,
        f"gpu01:{port}",
        "--rdzv-id",
        f"llama32-1b_dolma_{scheme}_full-4242",
        "pretrain_gpt.py",
    ]
    ((task_srun, _, _),) = calls(record, "srun")
    assert task_srun[:8] == ["--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task=24",
                             "--kill-on-bad-exit=1", "--chdir", cwd]  # fmt: skip
    assert task_srun[9:] == argv
    assert task_env["SLURM_ARRAY_TASK_ID"] == "3" and len(calls(record, "torchrun")) == 2
    values = load_registry().schemes[scheme].values()
    assert Path(cwd).name == (
        f"quantpatch__linear-{values['linear']}_qk-{values['qk']}_pv-{values['pv']}"
    )
    res = subprocess.run(
        ["sbatch", str(out / "sweep.sbatch")],
        cwd=root,
        env={**env, "STUB_ARRAY_TASK": "10"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "array task 10 is not one of 0-9" in res.stderr
    for task in ("010", "08", "-1", "1;id", "18446744073709551617"):  # never octal or wrapped
        res = subprocess.run(
            ["sbatch", str(out / "sweep.sbatch")],
            cwd=root,
            env={**env, "STUB_ARRAY_TASK": task},
            capture_output=True,
            text=True,
        )
        assert res.returncode == 2 and f"array task {task} is not one of 0-9" in res.stderr
    # sbatch runs a copy from its spool directory: the index is found all the same
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "job").write_bytes((out / "sweep.sbatch").read_bytes())
    res = subprocess.run(
        ["bash", str(spool / "job")],
        cwd=root,
        env={**env, "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_ARRAY_TASK_ID": "0"},
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert git.Repo(root).active_branch.name == "main" and not git.Repo(root).is_dirty()


def test_a_job_refuses_a_stale_or_touched_worktree_without_writing(make_checkout, tmp_path, run):
    """`worktree --existing` (what a Slurm job runs) reads only: a worktree whose base moved
    on, that holds edits or commits of its own, is refused, and git's index is not rewritten."""
    root = make_checkout()
    look = ["--repo", root, "worktree", "--scheme", "FA_mxfp8", "--path-only", "--existing"]
    res = run(*look)
    assert res.code == 2 and "has no prepared worktree" in res.err
    assert run("--repo", root, "worktree", "--scheme", "FA_mxfp8").code == 0
    res = run(*look)
    assert res.code == 0, res
    wt = Path(res.out.strip())
    admin = Path(git.Repo(wt).git_dir)
    (wt / "megatron" / "core" / "tensor_parallel" / "layers.py").touch()  # stat-dirty only
    before = {p.name: p.read_bytes() for p in admin.iterdir() if p.is_file()}
    assert run(*look).code == 0
    assert {p.name: p.read_bytes() for p in admin.iterdir() if p.is_file()} == before
    other = wt / "megatron" / "core" / "transformer" / "dot_product_attention.py"
    other.write_text(other.read_text() + "# edited on a compute node\n")
    res = run(*look)
    assert res.code == 2 and "the worktree has uncommitted changes" in res.err
    git.Repo(wt).git.checkout("--", ".")
    git.Repo(wt).git.commit("--allow-empty", "-m", "a commit inside the worktree")
    res = run(*look)
    assert res.code == 2 and "but quantpatch/linear-bf16_qk-mxfp8_pv-bf16 is at" in res.err
    git.Repo(wt).git.checkout("--detach", "HEAD~1")
    assert run(*look).code == 0
    # the base moves on: the prepared worktree would train older code
    repo = git.Repo(root)
    (root / "NOTES").write_text("a fix\n")
    repo.index.add(["NOTES"])
    repo.index.commit("a fix on main")
    res = run(*look)
    assert res.code == 2 and "main has moved on to" in res.err and "older code" in res.err
    assert run("--repo", root, "worktree", "--scheme", "FA_mxfp8").code == 0
    assert run(*look).code == 0


def test_generation_refuses_colliding_names_and_prepares_nothing_it_cannot_write(
    make_checkout, tmp_path, run
):
    config = tmp_path / "odd.toml"
    config.write_text(
        '[datasets.dolma_FA]\ndescription = "x"\nprefix = "{data_root}/x"\nsplit = "1,0,0"\n'
    )
    out = tmp_path / "scripts"
    res = run(
        "gen-scripts", "--out", out, "--config", config, "--models", "llama32-1b",
        "--datasets", "dolma,dolma_FA", "--schemes", "FA_linear_mxfp8,linear_mxfp8",
    )  # fmt: skip
    assert res.code == 2 and not out.exists()
    assert (
        "llama32-1b/dolma/FA_linear_mxfp8 and llama32-1b/dolma_FA/linear_mxfp8 would share"
        in res.err
    )
    root = make_checkout()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    res = run(
        "gen-scripts", "--out", blocked / "x", "--launcher", "slurm", "--prepare",
        "--repo", root, "--models", "llama32-1b", "--datasets", "dolma",
    )  # fmt: skip
    assert res.code == 2 and "cannot be written" in res.err
    assert _worktrees(root) == [] and "quantpatch/" not in git.Repo(root).git.branch("-a")


# -- ms-swift ------------------------------------------------------------------------------


def _swift_wheel(version: str) -> Path:
    """The ms-swift wheel from PyPI (kept in the cache; a pure-Python wheel, ~1 MB)."""
    dest = cache_dir() / "wheels"
    found = sorted(dest.glob(f"ms_swift-{version}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
         "--disable-pip-version-check", "-d", str(dest), f"ms-swift=={version}"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return sorted(dest.glob(f"ms_swift-{version}-*.whl"))[0]


@pytest.fixture(scope="session")
def swift3() -> Path:
    return _swift_wheel("3.12.6")


@pytest.fixture(scope="session")
def swift4() -> Path:
    return _swift_wheel("4.6.0")


def test_swift_arguments_read_from_the_wheels(swift3, swift4):
    three = read_swift(swift3)
    assert three.version == "3.12.6" and three.refusal is None
    assert three.fields == bundled().fields  # the bundled list is what the wheel says
    assert len(three.fields) == 412
    assert {"tensor_model_parallel_size", "micro_batch_size", "transformer_impl"} <= three.fields
    four = read_swift(swift4)
    assert four.version == "4.6.0" and "transformer_impl" not in four.fields
    assert four.refusal is not None and four.refusal.startswith(
        "ms-swift 4.6.0 has no transformer_impl='local'"
    )


def test_swift_refuses_an_ms_swift_that_cannot_run_the_local_layers(run, tmp_path, swift4):
    out = tmp_path / "swift"
    res = run("gen-scripts", "--out", out, "--launcher", "swift", "--swift", swift4)
    assert res.code == 2 and not out.exists()
    assert "ms-swift 4.6.0 has no transformer_impl='local'" in res.err
    assert "would never run" in res.err
    (tmp_path / "empty").mkdir()
    not_a_wheel = tmp_path / "x.whl"
    not_a_wheel.write_text("no zip")
    for source, sentence in (
        (tmp_path / "empty", "holds no ms-swift (no swift/version.py)"),
        (not_a_wheel, "not a wheel (zip)"),
        (tmp_path / "missing", "does not exist"),
    ):
        res = run("gen-scripts", "--out", out, "--launcher", "swift", "--swift", source)
        assert res.code == 2 and sentence in res.err and not out.exists(), res


def test_swift_refusals_followed(make_checkout, run, tmp_path, swift3, swift4):
    """The ms-swift that cannot run the local layers: the release the sentence names (the
    3.x line's 3.12.6) is taken; a scheme carrying Megatron arguments: the launchers named
    write its script."""
    root = make_checkout()
    out = tmp_path / "swift"
    base = ["gen-scripts", "--out", out, "--models", "llama32-1b", "--datasets", "dolma",
            "--profile", "smoke", "--repo", root]  # fmt: skip
    res = run(*base, "--schemes", "bf16", "--launcher", "swift", "--swift", swift4)
    said = " ".join(res.err.split())
    named = re.search(r"\(the 3\.x line, e\.g\. ([\d.]+)\)", said)
    assert res.code == 2 and named, res
    wheel = swift3
    assert wheel.name.startswith(f"ms_swift-{named[1]}-")  # the wheel of the release named
    res = run(*base, "--schemes", "bf16", "--launcher", "swift", "--swift", wheel)
    assert res.code == 0, res
    # a folder without ms-swift: a wheel, as said, is taken
    (tmp_path / "empty").mkdir()
    res = run(*base, "--schemes", "bf16", "--launcher", "swift", "--swift", tmp_path / "empty")
    said = " ".join(res.err.split())
    assert res.code == 2 and "give a wheel, an unpacked wheel or the site-packages" in said
    res = run(*base, "--schemes", "bf16", "--launcher", "swift", "--swift", wheel, "--force")
    assert res.code == 0, res
    config = tmp_path / "mine.toml"
    config.write_text(
        "[schemes.mine]\nlinear = 'bf16'\nqk = 'bf16'\npv = 'bf16'\n"
        "args = ['--log-interval', '5']\n"
    )
    mine = [*base, "--schemes", "mine", "--config", config, "--force"]
    res = run(*mine, "--launcher", "swift", "--swift", wheel)
    said = " ".join(res.err.split())
    named = re.search(r"use --launcher (\w+) or (\w+) for it\.", said)
    assert res.code == 2 and named, res
    for launcher in named.groups():
        res = run(*mine, "--launcher", launcher)
        assert res.code == 0, (launcher, res)
        (script,) = out.rglob("pretrain_*_mine.sh")
        assert "--log-interval 5" in " ".join(script.read_text().split())


def test_swift_script_end_to_end_with_a_stub_megatron(make_checkout, tmp_path, stubs, run, swift3):
    env, record = stubs
    root = make_checkout()
    out = tmp_path / "swift"
    _gen(run, out, "--launcher", "swift", "--swift", swift3, "--profile", "smoke")
    scripts = sorted(out.rglob("*.sh"))
    assert len(scripts) == 10
    for path in scripts:
        subprocess.run(["bash", "-n", str(path)], check=True)
    sc = subprocess.run(
        [SHELLCHECK, "-S", "style", *map(str, scripts)], capture_output=True, text=True
    )
    assert sc.returncode == 0, sc.stdout[-2000:]
    script = out / "llama32-1b" / "swift_pt_llama32-1b_dolma_linear_hifp8.sh"
    node = {
        **env,
        "NNODES": "2",
        "NODE_RANK": "1",
        "GPUS_PER_NODE": "8",
        "MASTER_ADDR": "gpu01",
        "GLOBAL_BATCH_SIZE": "16",
        "TP": "2",
        "SWIFT_DATASET": "/data/dolma.jsonl",
    }
    for bad, sentence in (
        ({"PP": "3"}, "PP 3"),
        ({"NODE_RANK": "5"}, "NODE_RANK must be one of 0-1 for NNODES=2 (got '5')."),
        ({"MASTER_ADDR": "localhost"}, "NNODES=2 needs MASTER_ADDR set to a host"),
    ):
        res = subprocess.run(
            [str(script)], cwd=root, env={**node, **bad}, capture_output=True, text=True
        )
        assert res.returncode == 2 and sentence in res.stderr, res.stderr
    assert not list(record.iterdir())
    res = subprocess.run([str(script)], cwd=root, env=node, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    ((argv, cwd, menv),) = calls(record, "megatron")
    wt = root / ".git" / "quantpatch" / "worktrees" / "quantpatch__linear-hifp8_qk-bf16_pv-bf16"
    assert Path(cwd) == wt and menv["MEGATRON_LM_PATH"] == str(wt)
    assert (
        "custom_quant_type = 'hifp8'"
        in (wt / "megatron/core/tensor_parallel/layers.py").read_text()
    )
    assert {k: menv[k] for k in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR")} == {
        "NPROC_PER_NODE": "8",
        "NNODES": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "gpu01",
    }
    assert argv[:5] == [
        "pt",
        "--model",
        "meta-llama/Llama-3.2-1B",
        "--dataset",
        "/data/dolma.jsonl",
    ]
    pairs = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert pairs["--transformer_impl"] == "local" and pairs["--padding_free"] == "false"
    assert pairs["--tensor_model_parallel_size"] == "2"
    assert (pairs["--micro_batch_size"], pairs["--global_batch_size"]) == ("1", "16")
    runs = tmp_path / "runs" / "llama32-1b_dolma_linear_hifp8_smoke"
    assert argv[-4:] == [
        "--save",
        str(runs / "checkpoints"),
        "--tensorboard_dir",
        str(runs / "tensorboard"),
    ]
    assert "--sequence_parallel" not in argv  # TP 2, but the local RMSNorm refuses it
    # every --flag is an argument of `megatron pt` (read from the wheel), and every extra
    # kwarg is a flag Megatron-LM accepts
    fields = read_swift(swift3).fields
    flags = [a[2:] for a in argv if a.startswith("--")]
    assert set(flags) <= fields, sorted(set(flags) - fields)
    assert len(flags) == len(set(flags))
    extra = json.loads(argv[argv.index("--megatron_extra_kwargs") + 1])
    accepted = release_flags("core_v0.13.1")
    assert extra and all(f"--{k.replace('_', '-')}" in accepted for k in extra), extra


def test_60_scripts_per_launcher_generate_within_a_second(swift3):
    """In-process rendering of all 60 combinations for each launcher (the CLI adds its
    start-up, about 0.1 s; benchmarks/gen_scripts.py measures the command)."""
    reg = load_registry()
    args = (list(reg.models), list(reg.datasets), reg.pick("schemes", None), "full", "core_v0.13.1")
    render_all(reg, *args, "swift", None, swift3)  # warm the caches (templates, ms-swift)
    for launcher in ("torchrun", "slurm", "swift"):
        # this process's CPU time (rendering is single-threaded): other processes' load on a
        # shared machine does not stretch it as it stretches the wall clock
        start = time.process_time()
        scripts = render_all(reg, *args, launcher, None, swift3)
        assert len(scripts) == 60
        assert time.process_time() - start < 1.0, launcher


def test_the_in_script_layout_check_loads_no_renderer_git_or_parser():
    """Every launch script calls `quantpatch layout --line` first: it stays a small command."""
    code = (
        "import sys; from quantpatch import cli\n"
        "sys.argv = ['quantpatch', 'layout', '--line', '--num-layers', '2', '--heads', '4',"
        " '--seq-length', '64', '--micro-batch', '1', '--global-batch', '8']\n"
        "try:\n    cli.main()\nexcept SystemExit as exc:\n    assert exc.code in (0, None)\n"
        "heavy = {'jinja2', 'git', 'libcst', 'torch', 'rich'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "global batch 8 = micro batch 1 x DP 8 x 1 accumulation step" in res.stdout
