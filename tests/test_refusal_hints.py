"""Every refusal of ``sweep run`` and ``gen-scripts`` that gives advice, followed as written
(the option, the config table and key, the variable, the command) and shown accepted. The
advice is parsed from the sentence itself (``follow``), so a hint naming a table that does not
exist, or a value that is refused again, fails here. Slurm's partition is stubbed (sinfo,
scontrol); the real two-node Slurm follows the layout refusal in test_sweep_slurm_nodes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .test_scripts import QUANTPATCH
from .test_sweep import SACCT, SBATCH, SQUEUE, TORCHRUN, empty_wikipedia

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SINFO = r"""#!/usr/bin/env bash
printf '%s\n' "${STUB_SINFO:-1 gpu:2 8 64000}"
"""
# the partition (MaxNodes from STUB_MAX_NODES), else the task of test_sweep's scontrol
SCONTROL_PARTITION = r"""#!/usr/bin/env bash
if [[ "$1 $2" == "show partition" ]]; then
    echo "PartitionName=debug Default=YES MaxNodes=${STUB_MAX_NODES:-UNLIMITED} State=UP"
    exit 0
fi
echo "JobId=4243 ArrayJobId=4242 ArrayTaskId=0 JobState=PENDING Reason=None ExitCode=0:0"
"""
SCANCEL = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$STUB_DIR/scancel.args"
"""


@pytest.fixture
def cluster(tmp_path, make_checkout, monkeypatch):
    """A checkout, and Slurm's clients and torchrun stubbed on PATH (a partition of
    ``STUB_SINFO`` nodes)."""
    root = make_checkout()
    bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub.mkdir()
    stubs = (("torchrun", TORCHRUN), ("sbatch", SBATCH), ("squeue", SQUEUE),
             ("sacct", SACCT), ("scontrol", SCONTROL_PARTITION), ("sinfo", SINFO),
             ("scancel", SCANCEL))  # fmt: skip
    for name, text in stubs:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_DIR", str(stub))
    monkeypatch.setenv("QUANTPATCH", QUANTPATCH)
    return root, stub


def follow(said: str, args: list[str], config: Path) -> list[str]:
    """The command line and ``config`` as the refusal ``said`` tells: ``give --opt V``,
    ``--opt V instead of --opt W`` (the option's value replaced or added), ``key = value in
    the [table] table of a --config`` (written into ``config``, which the command then
    names). Fails where the sentence gives no advice of these forms."""
    said = " ".join(said.split())
    option = re.search(r"\bgive (--[a-z-]+) (\S+?)[ ,;.)]", said) or re.search(
        r"\((--[a-z-]+) (\S+) instead of --[a-z-]+ \S+\)", said
    )
    table = re.search(r"(\w[\w-]*) = (\S+?)\)? in the \[([\w.-]+)\] table of a --config", said)
    assert option or table, f"no advice to follow in: {said}"
    args = list(args)
    if option and not (table and option.start() > table.start()):
        name, value = option[1], option[2]
        if name in args:
            args[args.index(name) + 1] = value
        else:
            args += [name, value]
        return args
    assert table is not None
    key, value, where = table[1], table[2], table[3]
    data = tomllib.loads(config.read_text()) if config.exists() else {}
    node = data
    for part in where.split("."):
        node = node.setdefault(part, {})
    node[key] = tomllib.loads(f"v = {value}")["v"]
    config.write_text(_toml(data))
    if "--config" not in args:
        args += ["--config", str(config)]
    return args


def _toml(data: dict, prefix: str = "") -> str:
    plain = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict)]
    out = f"[{prefix}]\n" + "\n".join(plain) + "\n" if prefix and plain else ""
    for k, v in data.items():
        if isinstance(v, dict):
            out += _toml(v, f"{prefix}.{k}" if prefix else k)
    return out


SMOKE = ("--models", "llama32-1b", "--datasets", "wikipedia", "--schemes", "bf16",
         "--profile", "smoke")  # fmt: skip


def _refused_then_followed(run, command: list[str], config: Path, says: str) -> str:
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and says in said, res
    followed = follow(said, command, config)
    res = run(*followed)
    assert res.code == 0, (followed, config.read_text() if config.exists() else "", res)
    return said


@pytest.mark.parametrize(
    "extra, config_text, says",
    [
        # a size given on the command line: the option, with the value that works
        (["--gpus-per-node", "2", "--tp", "3"], "", "TP 2 would work (--tp 2 instead of --tp 3)"),
        # a size of the profile's table: that table's key
        (["--gpus-per-node", "2"], "[profiles.smoke.parallel]\ntp = 3\n",
         "(tp = 2 in the [profiles.smoke.parallel] table of a --config)"),
        # the batch: the profile's args table (not GLOBAL_BATCH_SIZE, not `--`)
        (["--gpus-per-node", "2", "--nodes", "2"], "",
         "global batch 4 would work (global-batch-size = 4 in the [profiles.smoke.args] table"),
        # a model's own profile args hold the batch: that table
        (["--gpus-per-node", "3"], "[models.llama32-1b.profiles.smoke.args]\n"
         "global-batch-size = 2\n", "[models.llama32-1b.profiles.smoke.args] table"),
        # sequence parallel (a string in TOML)
        (["--gpus-per-node", "2"], "[profiles.smoke.parallel]\ntp = 2\n"
         "sequence_parallel = \"on\"\n",
         "sequence_parallel = \"off\" in the [profiles.smoke.parallel] table"),
    ],
)  # fmt: skip
def test_a_layout_refusal_of_gen_scripts_followed(
    run, tmp_path, make_checkout, extra, config_text, says
):
    root = make_checkout()
    config = tmp_path / "mine.toml"
    command = ["gen-scripts", "--out", str(tmp_path / "s"), *SMOKE, "--repo", str(root), *extra]
    if config_text:
        config.write_text(config_text)
        command += ["--config", str(config)]
    _refused_then_followed(run, command, config, says)


def test_a_layout_refusal_of_sweep_run_followed(cluster, run, tmp_path):
    root, _stub = cluster
    config = tmp_path / "mine.toml"
    config.write_text("[profiles.smoke.parallel]\ntp = 3\n")
    command = ["sweep", "run", str(tmp_path / "sw"), *SMOKE, "--launcher", "slurm",
               "--gpus-per-node", "2", "--config", str(config), "--repo", str(root)]  # fmt: skip
    _refused_then_followed(run, command, config, "tp = 2 in the [profiles.smoke.parallel]")


@pytest.mark.parametrize("variant", ["option", "config"])
def test_the_partitions_gpus_and_nodes_followed(cluster, run, tmp_path, monkeypatch, variant):
    """The nodes advice names the table that holds `nodes` (not the profile's own table,
    which has no such field), and a partition whose MaxNodes is 0 (no limit) counts its
    nodes (not 0, which --nodes refuses)."""
    root, _stub = cluster
    monkeypatch.setenv("STUB_SINFO", "2 gpu:2 8 64000")
    monkeypatch.setenv("STUB_MAX_NODES", "0")
    config = tmp_path / f"{variant}.toml"
    base = ["sweep", "run", str(tmp_path / variant), *SMOKE, "--launcher", "slurm",
            "--repo", str(root)]  # fmt: skip
    # GPUs a node: 4 asked, the nodes have 2
    config.write_text("[profiles.smoke]\ngpus_per_node = 4\n[profiles.smoke.args]\n"
                      "global-batch-size = 12\n")  # fmt: skip
    command = [*base, "--config", str(config)]
    if variant == "option":
        command += ["--gpus-per-node", "4"]
    said = _refused_then_followed(run, command, config, "give --gpus-per-node 2")
    if variant == "config":
        assert "gpus_per_node = 2 in the [profiles.smoke] table" in said
    # nodes: 3 asked, the partition has 2 (MaxNodes=0: no limit)
    out = tmp_path / f"{variant}-nodes"
    config.write_text("[profiles.smoke.args]\nglobal-batch-size = 12\n"
                      "[profiles.smoke.parallel]\nnodes = 3\n")  # fmt: skip
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--repo", str(root),
               "--config", str(config)]  # fmt: skip
    if variant == "option":
        command += ["--nodes", "3"]
    said = _refused_then_followed(run, command, config, "give --nodes 2")
    assert "(or nodes = 2 in the [profiles.smoke.parallel] table of a --config)" in said
    assert json.loads((out / "sweep.json").read_text())["layout"]["nodes"] == 2


def test_max_nodes_zero_is_no_limit(cluster, run, tmp_path, monkeypatch):
    root, _stub = cluster
    monkeypatch.setenv("STUB_SINFO", "4 gpu:2 8 64000")
    monkeypatch.setenv("STUB_MAX_NODES", "0")
    res = run("sweep", "run", tmp_path / "sw", *SMOKE, "--launcher", "slurm", "--nodes", "2",
              "--repo", root)  # fmt: skip
    assert res.code == 0, res


def test_the_cpus_a_node_offers_followed(cluster, run, tmp_path, monkeypatch):
    """Each node's task asks for the CPUs its ranks need; a partition whose nodes
    have fewer is refused naming `cpus_per_task` of `[slurm]`, and that is accepted."""
    root, _stub = cluster
    monkeypatch.setenv("STUB_SINFO", "1 gpu:8 16 64000")
    config = tmp_path / "mine.toml"
    config.write_text("[profiles.smoke.args]\nglobal-batch-size = 8\n")
    out = tmp_path / "sw"
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--gpus-per-node", "8",
               "--config", str(config), "--repo", str(root)]  # fmt: skip
    said = _refused_then_followed(run, command, config, "24 CPUs for each node's task")
    assert "cpus_per_task = 16 in the [slurm] table" in said
    assert "#SBATCH --cpus-per-task=16\n" in (out / "sweep.sbatch").read_text()


def test_a_partition_without_gpus_followed(cluster, run, tmp_path, monkeypatch):
    root, _stub = cluster
    monkeypatch.setenv("STUB_SINFO", "2 (null) 8 64000")
    out = tmp_path / "sw"
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--repo", str(root)]
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "sinfo shows gpu GRES in no partition" in said, res
    res = run(*follow(said, command, tmp_path / "cpu.toml"))
    assert res.code == 0, res
    assert "gpu" not in (out / "sweep.sbatch").read_text().split("set -euo")[0].replace(
        "quantpatch-sweep", ""
    )


def _partitions(bin_dir: Path, nodes: dict[str, str]) -> None:
    """sinfo and scontrol stubs of these partitions, the first Slurm's default: its name ->
    what ``sinfo -o '%D %G %c %m'`` says of its nodes."""
    default = next(iter(nodes))
    cases = "".join(f'    *"-p {name}"*) echo "{line}" ;;\n' for name, line in nodes.items())
    gres = " ".join(
        shlex.quote(f"{name}{'*' if name == default else ''} {line.split()[1]}")
        for name, line in nodes.items()
    )
    (bin_dir / "sinfo").write_text(
        f'#!/usr/bin/env bash\ncase "$*" in\n{cases}'
        f"    *\"%P %G\"*) printf '%s\\n' {gres} ;;\n"
        f'    *) echo "{nodes[default]}" ;;\nesac\n'
    )
    shown = "".join(
        f'    echo "PartitionName={name}{" Default=YES" if name == default else ""} '
        'MaxNodes=UNLIMITED State=UP"\n'
        for name in nodes
    )
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\nif [[ "$1 $2" == "show partition" ]]; then\n'
        f"{shown}    exit 0\nfi\n"
        'echo "JobId=4243 ArrayJobId=4242 ArrayTaskId=0 JobState=PENDING Reason=None '
        'ExitCode=0:0"\n'
    )


def test_a_partition_without_gpus_names_the_one_with_gpus_followed(cluster, run, tmp_path):
    """The default partition has no GPUs and another has: the refusal names it as the
    [slurm] partition, and the sweep sent there is submitted to it."""
    root, _stub = cluster
    _partitions(tmp_path / "bin", {"cpu": "2 (null) 8 64000", "gpu": "1 gpu:2 8 64000"})
    out = tmp_path / "sw"
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--repo", str(root)]
    res = run(*command)
    said = " ".join(res.err.split())
    named = re.search(r'choose a partition with GPUs, (partition = "\w+") in the \[slurm\] '
                      r"table of a --config \(sinfo shows gpu GRES in gpu\)", said)  # fmt: skip
    assert res.code == 2 and named, res
    config = tmp_path / "gpu.toml"
    config.write_text(f"[slurm]\n{named[1]}\n")
    res = run(*command, "--config", config)
    assert res.code == 0, res
    assert "#SBATCH --partition=gpu\n" in (out / "sweep.sbatch").read_text()


def test_a_local_sweep_on_several_nodes_followed(cluster, run, tmp_path, monkeypatch):
    root, _stub = cluster
    monkeypatch.setenv("STUB_SINFO", "2 gpu:2 8 64000")
    command = ["sweep", "run", str(tmp_path / "sw"), *SMOKE, "--nodes", "2",
               "--repo", str(root)]  # fmt: skip
    res = run(*command)
    assert res.code == 2 and "(use --launcher slurm)" in res.err, res
    assert not (tmp_path / "sw").exists()
    res = run(*command, "--launcher", "slurm")
    assert res.code == 0, res


@pytest.mark.slow
def test_the_record_refusals_followed(cluster, run, tmp_path):
    """A record that is not one, or was edited by hand: move it away; a different selection
    while Slurm has runs: `quantpatch sweep cancel`."""
    root, stub = cluster
    out = tmp_path / "sw"
    res = run("sweep", "run", out, *SMOKE, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    good = (out / "sweep.json").read_text()
    for text in ("{not json", '{"version": 7, "runs": []}',
                 good.replace('"launcher": "slurm"', '"launcher": 5', 1)):  # fmt: skip
        (out / "sweep.json").write_text(text)
        res = run("sweep", "status", out)
        assert res.code == 2 and "move the file away to start a new sweep" in " ".join(
            res.err.split()
        ).replace("move it away", "move the file away"), res
        (out / "sweep.json").rename(tmp_path / "moved.json")  # followed
        res = run("sweep", "run", out, *SMOKE, "--launcher", "slurm", "--repo", root)
        assert res.code == 0, res
    # the array is Slurm's (squeue: running, pending): another selection is refused
    res = run("sweep", "run", out, *SMOKE[:-1], "fast", "--launcher", "slurm", "--repo", root)
    said = " ".join(res.err.split())
    assert res.code == 2 and f"`quantpatch sweep cancel {out}`" in said, res
    res = run("sweep", "cancel", out)  # followed
    assert res.code == 0 and (stub / "scancel.args").exists(), res
    os.environ["MOCK_DATA"] = "1"  # the fast profile reads real data: not this test's point
    try:
        res = run("sweep", "run", out, *SMOKE[:-1], "fast", "--launcher", "slurm",
                  "--gpus-per-node", "2", "--repo", root)  # fmt: skip
    finally:
        del os.environ["MOCK_DATA"]
    assert res.code == 0, res


@pytest.mark.slow
def test_a_run_left_running_followed(cluster, run, tmp_path):
    """A run whose process group still lives: `kill -TERM -- -PGID`, as said, then it runs."""
    root, _stub = cluster
    out = tmp_path / "sw"
    res = run("sweep", "run", out, *SMOKE, "--gpus", "0", "--repo", root)
    assert res.code == 0, res
    left = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        data = json.loads((out / "sweep.json").read_text())
        data["runs"][0].update(state="running", pid=left.pid)
        (out / "sweep.json").write_text(json.dumps(data))
        res = run("sweep", "run", out, "--repo", root)
        said = " ".join(res.err.split())
        assert res.code == 2 and f"(kill -TERM -- -{left.pid})" in said, res
        os.killpg(left.pid, signal.SIGTERM)  # followed
        left.wait()
        res = run("sweep", "run", out, "--repo", root)
        assert res.code == 0, res
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()


def test_data_that_is_not_ready_followed(cluster, run, tmp_path, monkeypatch):
    root, _stub = cluster
    monkeypatch.setenv("DATA_ROOT", str(tmp_path / "nodata"))
    command = ["sweep", "run", str(tmp_path / "sw"), *SMOKE[:-1], "fast", "--launcher",
               "slurm", "--gpus-per-node", "2", "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "or set MOCK_DATA=1" in said, res
    monkeypatch.setenv("MOCK_DATA", "1")  # followed
    res = run(*command)
    assert res.code == 0, res


def test_scripts_edited_by_hand_followed(run, tmp_path, make_checkout):
    root = make_checkout()
    out = tmp_path / "s"
    command = ["gen-scripts", "--out", out, *SMOKE, "--repo", root]
    assert run(*command).code == 0
    script = next(out.rglob("pretrain_*.sh"))
    script.write_text(script.read_text() + "# mine\n")
    res = run(*command)
    assert res.code == 2 and "--force overwrites them" in res.err, res
    res = run(*command, "--force")
    assert res.code == 0 and "# mine" not in script.read_text(), res


def test_colliding_names_followed(run, tmp_path, make_checkout):
    """Two combinations on one run folder: rename one of them in the --config file."""
    root = make_checkout()
    config = tmp_path / "odd.toml"
    table = '[datasets.{}]\ndescription = "x"\nprefix = "{{data_root}}/x"\nsplit = "1,0,0"\n'
    config.write_text(table.format("dolma_FA"))
    command = ["gen-scripts", "--out", tmp_path / "s", "--config", config, "--models",
               "llama32-1b", "--datasets", "dolma,dolma_FA", "--schemes",
               "FA_linear_mxfp8,linear_mxfp8", "--repo", root]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "rename one of the datasets or schemes in the --config file" in said
    config.write_text(table.format("dolmafa"))  # followed: the dataset renamed
    res = run(*[w if w != "dolma,dolma_FA" else "dolma,dolmafa" for w in command])
    assert res.code == 0, res


# sbatch as a node that has STUB_NODE_GPUS GPUs and STUB_NODE_CPUS CPUs to give (its memory
# handed out per CPU, say), whatever sinfo shows: the job's own #SBATCH lines judged
SBATCH_NODE = r"""#!/usr/bin/env bash
script="${@: -1}"
want() { sed -n "s/^#SBATCH --$1=\([0-9]*\)$/\1/p" "$script" | head -1; }
gpus="$(want gpus-per-node)"; cpus="$(want cpus-per-task)"; nodes="$(want nodes)"
if (( ${gpus:-0} > STUB_NODE_GPUS || ${cpus:-1} > STUB_NODE_CPUS || ${nodes:-1} > 1 )); then
    printf 'sbatch: error: Batch job submission failed: %s\n' \
        "Requested node configuration is not available" >&2
    exit 1
fi
echo "4242"
"""


def _follow_node_hint(said: str, args: list[str], config: Path) -> list[str]:
    """The node-configuration advice, taken literally: options in backquotes for sweep run,
    or a key of a --config table."""
    quoted = re.search(r"`(--gpus-per-node \d+ --nodes \d+)` to sweep run", said)
    if quoted:
        args = list(args)
        words = quoted[1].split()
        for name, value in zip(words[::2], words[1::2], strict=True):
            if name in args:
                args[args.index(name) + 1] = value
            else:
                args += [name, value]
        return args
    return follow(said, args, config)


@pytest.mark.parametrize(
    "sinfo, node_gpus, node_cpus, hints",
    [
        # sinfo says the node fits; Slurm refuses the CPUs (their memory): one CPU a rank
        ("1 gpu:2 8 64000", 2, 2, ["cpus_per_task = 2 in the [slurm] table of a --config"]),
        # sinfo says nothing: one CPU a rank first, then the smallest GPU request
        (" ", 1, 64, ["cpus_per_task = 2 in the [slurm] table of a --config",
                      "`--gpus-per-node 1 --nodes 1` to sweep run"]),
    ],
)  # fmt: skip
def test_sbatchs_node_configuration_refusal_followed(
    cluster, run, tmp_path, monkeypatch, sinfo, node_gpus, node_cpus, hints
):
    """sbatch's `Requested node configuration is not available` where sinfo did not foresee
    it: the hint gives the values to ask for, and the sweep asking for them is submitted."""
    root, _stub = cluster
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text(SBATCH_NODE)
    monkeypatch.setenv("STUB_SINFO", sinfo)
    monkeypatch.setenv("STUB_NODE_GPUS", str(node_gpus))
    monkeypatch.setenv("STUB_NODE_CPUS", str(node_cpus))
    config = tmp_path / "mine.toml"
    out = tmp_path / "sw"
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--gpus-per-node", "2",
               "--repo", str(root)]  # fmt: skip
    for hint in hints:
        res = run(*command)
        said = " ".join(res.err.split())
        assert res.code == 2 and "Requested node configuration is not available" in said, res
        assert hint in said, said
        command = _follow_node_hint(said, command, config)
    res = run(*command)
    assert res.code == 0, (command, res)
    text = (out / "sweep.sbatch").read_text()
    assert f"#SBATCH --cpus-per-task={min(node_cpus, 2)}\n" in text
    assert f"#SBATCH --gpus-per-node={node_gpus}\n" in text


# sbatch takes a job for partition b only
SBATCH_B_ONLY = r"""#!/usr/bin/env bash
if ! grep -qx '#SBATCH --partition=b' "${@: -1}"; then
    printf 'sbatch: error: Batch job submission failed: %s\n' \
        "Requested node configuration is not available" >&2
    exit 1
fi
echo "4242"
"""


def test_the_smallest_request_refused_names_another_gpu_partition_followed(cluster, run, tmp_path):
    """sbatch refuses one GPU on one node where sinfo says it fits: nothing smaller to ask
    for, so the hint names another partition sinfo shows with GPUs, and the sweep sent there
    is submitted to it."""
    root, _stub = cluster
    _partitions(tmp_path / "bin", {"a": "1 gpu:1 8 64000", "b": "1 gpu:1 8 64000"})
    (tmp_path / "bin" / "sbatch").write_text(SBATCH_B_ONLY)
    config = tmp_path / "mine.toml"
    config.write_text("[slurm]\ncpus_per_task = 1\n")
    out = tmp_path / "sw"
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--gpus-per-node", "1",
               "--config", str(config), "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and 'send it to another partition, partition = "b" in the [slurm]' in (
        said
    ), res
    assert not (out / "sweep.json").exists()
    res = run(*follow(said, command, config))
    assert res.code == 0, (config.read_text(), res)
    assert "#SBATCH --partition=b\n" in (out / "sweep.sbatch").read_text()


# sinfo reads its answer from a file; sbatch refuses more than one node and, doing so, drains
# the partition's second node (what sinfo says next)
SINFO_FILE = r"""#!/usr/bin/env bash
case "$*" in
    *"%P %G"*) echo "debug* gpu:1" ;;
    *) cat "$STUB_DIR/sinfo.txt" ;;
esac
"""
SBATCH_DRAINS = r"""#!/usr/bin/env bash
nodes="$(sed -n 's/^#SBATCH --nodes=\([0-9]*\)$/\1/p' "${@: -1}" | head -1)"
if (( ${nodes:-1} > 1 )); then
    echo "1 gpu:1 8 64000" > "$STUB_DIR/sinfo.txt"
    printf 'sbatch: error: Batch job submission failed: %s\n' \
        "Requested node configuration is not available" >&2
    exit 1
fi
echo "4242"
"""


def test_a_node_gone_between_the_check_and_sbatch_followed(cluster, run, tmp_path):
    """sinfo showed two nodes when sweep run checked the layout; by sbatch's refusal one is
    gone: the hint gives the request that fits what sinfo shows now, and it is submitted."""
    root, stub = cluster
    (stub / "sinfo.txt").write_text("2 gpu:1 8 64000\n")
    for name, text in (("sinfo", SINFO_FILE), ("sbatch", SBATCH_DRAINS)):
        (tmp_path / "bin" / name).write_text(text)
    out = tmp_path / "sw"
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--gpus-per-node", "1",
               "--nodes", "2", "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "add `--gpus-per-node 1 --nodes 1` to sweep run" in said, res
    res = run(*_follow_node_hint(said, command, tmp_path / "mine.toml"))
    assert res.code == 0, res
    assert "#SBATCH --nodes=1\n" in (out / "sweep.sbatch").read_text()


def test_no_sbatch_on_path_followed(cluster, run, tmp_path, monkeypatch):
    """Without Slurm's client commands the refusal names the check (`sbatch --version`) and
    the launcher that runs here; the sweep with that launcher runs."""
    root, _stub = cluster
    (tmp_path / "bin" / "sbatch").unlink()
    shadow = tmp_path / "usr-bin"  # the system's commands but Slurm's sbatch
    shadow.mkdir()
    for exe in Path("/usr/bin").iterdir():
        if exe.name != "sbatch":
            (shadow / exe.name).symlink_to(exe)
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if d]
    path = [str(shadow) if Path(d).resolve() == Path("/usr/bin") else d for d in dirs]
    monkeypatch.setenv(
        "PATH", os.pathsep.join(d for d in path if not (Path(d) / "sbatch").exists())
    )
    out = tmp_path / "sw"
    command = ["sweep", "run", str(out), *SMOKE, "--launcher", "slurm", "--repo", str(root)]
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "sbatch is not on PATH" in said and not out.exists(), res
    assert "`sbatch --version`" in said
    advice = re.search(r"with (--launcher \w+) instead of (--launcher \w+)", said)
    assert advice, said
    followed = " ".join(command).replace(advice[2], advice[1]).split()
    res = run(*followed)
    assert res.code == 0, res
    assert json.loads((out / "sweep.json").read_text())["selection"]["launcher"] == "local"


def test_missing_data_followed_with_the_command_it_names(cluster, run, tmp_path, monkeypatch):
    """A dataset of the user's --config, under a DATA_ROOT and tokenizer of the environment:
    the command the refusal names makes it from a shell that has neither variable (only the
    corpus, CORPUS, is filled in), and the sweep then starts."""
    from .test_data_prepare import corpus, make_tokenizer, write_jsonl

    root, _stub = cluster
    tok = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "data"
    monkeypatch.setenv("DATA_ROOT", str(data))
    monkeypatch.setenv("TOKENIZER_MODEL", str(tok))
    monkeypatch.delenv("MOCK_DATA", raising=False)
    cfg = tmp_path / "mine.toml"
    cfg.write_text(
        '[datasets.mine]\ndescription = "mine"\n'
        'prefix = "{data_root}/mine/{model}_text_document"\nsplit = "98,1,1"\n'
    )
    command = ["sweep", "run", str(tmp_path / "sw"), "--models", "llama32-1b", "--datasets",
               "mine", "--schemes", "bf16", "--profile", "fast", "--launcher", "slurm",
               "--gpus-per-node", "2", "--config", str(cfg), "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "the sweep's data is not ready" in said, res
    given = re.search(r"make them with `(quantpatch data prepare [^`]+)`", said)
    assert given, said
    assert given[1] == (
        f"quantpatch data prepare mine --input CORPUS --models llama32-1b --tokenizer "
        f"llama32-1b={tok} --data-root {data} --config {cfg}"
    )
    src = write_jsonl(tmp_path / "corpus.jsonl", corpus(60))
    words = [str(src) if w == "CORPUS" else w for w in shlex.split(given[1])]
    shell = {k: v for k, v in os.environ.items() if k not in ("DATA_ROOT", "TOKENIZER_MODEL")}
    made = subprocess.run([QUANTPATCH, *words[1:]], capture_output=True, text=True, env=shell,
                          cwd=tmp_path, timeout=600)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    res = run(*command)
    assert res.code == 0, res


@pytest.mark.parametrize(
    "extra, says",
    [
        # more GPUs a run than named: the GPUs there are
        (["--gpus", "0", "--gpus-per-node", "2"], "give --gpus-per-node 1"),
        # several seeds are the local launcher's
        (["--seeds", "2", "--launcher", "slurm"], "give --launcher local"),
    ],
)
def test_a_sweep_options_refusal_followed(cluster, run, tmp_path, extra, says):
    root, _stub = cluster
    command = ["sweep", "run", str(tmp_path / "sw"), *SMOKE, "--repo", str(root), *extra]
    said = _refused_then_followed(run, command, tmp_path / "unused.toml", says)
    assert not (tmp_path / "unused.toml").exists(), said


def test_a_seed_among_the_megatron_arguments_followed(cluster, run, tmp_path):
    """--seeds gives each run its --seed: the one after `--` is dropped, as said."""
    root, _stub = cluster
    command = ["sweep", "run", str(tmp_path / "sw"), *SMOKE, "--gpus", "0", "--seeds", "2",
               "--repo", str(root), "--", "--seed", "7"]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "drop --seed from the arguments after --" in said, res
    res = run(*command[: command.index("--seed")])
    assert res.code == 0, res


def test_a_new_sweep_without_a_selection_followed(cluster, run, tmp_path):
    """``prepare`` of a folder with no sweep and no selection (the CLI gives the defaults
    instead, so only a caller of the function meets it): the options it lists start one."""
    from quantpatch.base.errors import UserError
    from quantpatch.launch import sweep

    root, _stub = cluster
    out = tmp_path / "sw"
    with pytest.raises(UserError) as refused:
        sweep.prepare(out, root, None)
    said = " ".join(str(refused.value).split())
    named = re.search(r"give the sweep's selection \(([^)]*)\) to start one", said)
    assert named, said
    assert not out.exists()
    options = named[1].split(", ")
    assert options == ["--models", "--datasets", "--schemes", "--profile"], options
    values = dict(zip(SMOKE[::2], SMOKE[1::2], strict=True))
    given = [w for o in options for w in (o, values[o])]
    res = run("sweep", "run", out, *given, "--gpus", "0", "--repo", root)
    assert res.code == 0, res
    assert len(json.loads((out / "sweep.json").read_text())["runs"]) == 1


@pytest.mark.slow  # 15 s: the dataset made twice
def test_data_made_with_another_tokenizer_every_fix_followed(cluster, run, tmp_path, monkeypatch):
    """Data made with one tokenizer folder while TOKENIZER_MODEL names another: each of the
    three fixes the refusal names, followed as written (the variable, the --config entry, the
    command that makes the data again with the scripts' tokenizer), is accepted."""
    from .test_data_prepare import corpus, make_tokenizer, write_jsonl

    root, _stub = cluster
    made_with = make_tokenizer(tmp_path / "tok-a", vocab=400)
    scripts_tok = make_tokenizer(tmp_path / "tok-b", vocab=300)
    data = tmp_path / "data"
    cfg = tmp_path / "mine.toml"
    dataset = (
        '[datasets.mine]\ndescription = "mine"\n'
        'prefix = "{data_root}/mine/{model}_text_document"\nsplit = "98,1,1"\n'
    )
    cfg.write_text(dataset)
    src = write_jsonl(tmp_path / "corpus.jsonl", corpus(60))
    prepare = [QUANTPATCH, "data", "prepare", "mine", "--input", str(src), "--models",
               "llama32-1b", "--tokenizer", f"llama32-1b={made_with}", "--data-root", str(data),
               "--config", str(cfg)]  # fmt: skip
    made = subprocess.run(prepare, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    monkeypatch.setenv("DATA_ROOT", str(data))
    monkeypatch.setenv("TOKENIZER_MODEL", str(scripts_tok))
    monkeypatch.delenv("MOCK_DATA", raising=False)

    def sweep(name: str) -> list[str]:
        return ["sweep", "run", str(tmp_path / name), "--models", "llama32-1b", "--datasets",
                "mine", "--schemes", "bf16", "--profile", "fast", "--launcher", "slurm",
                "--gpus-per-node", "2", "--config", str(cfg), "--repo", str(root)]  # fmt: skip

    res = run(*sweep("refused"))
    said = " ".join(res.err.split())
    assert res.code == 2 and f"was tokenized with {made_with}, not with {scripts_tok}" in said
    # 1: the variable
    exported = re.search(r"export TOKENIZER_MODEL=(\S+) \(the tokenizer it was made with\)", said)
    assert exported and exported[1] == str(made_with), said
    monkeypatch.setenv("TOKENIZER_MODEL", exported[1])
    res = run(*sweep("by-variable"))
    assert res.code == 0, res
    monkeypatch.setenv("TOKENIZER_MODEL", str(scripts_tok))
    # 2: the --config entry, with what the sentence says to do with the variable
    entry = re.search(r"(unset TOKENIZER_MODEL and )?put (tokenizer_model = \"[^\"]+\") in the "
                      r"\[models\.llama32-1b\] table of a --config", said)  # fmt: skip
    assert entry, said
    if entry[1]:
        monkeypatch.delenv("TOKENIZER_MODEL")
    cfg.write_text(f"{dataset}[models.llama32-1b]\n{entry[2]}\n")
    res = run(*sweep("by-config"))
    assert res.code == 0, res
    cfg.write_text(dataset)
    monkeypatch.setenv("TOKENIZER_MODEL", str(scripts_tok))
    # 3: the data made again with the scripts' tokenizer, by the command given
    again = re.search(r"with the scripts' tokenizer \(`(quantpatch data prepare [^`]+)`\)", said)
    assert again, said
    words = [str(src) if w == "CORPUS" else w for w in shlex.split(again[1])]
    made = subprocess.run([QUANTPATCH, *words[1:]], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    res = run(*sweep("by-command"))
    assert res.code == 0, res


def _follow_own_flag(said: str, config: Path) -> None:
    """The args refusal's advice applied to ``config``: each `drop FLAG from the [T] table`
    (or a scheme's args list), each `key = value in the [T] table sets it`."""
    data = tomllib.loads(config.read_text())

    def table(where: str) -> dict:
        node = data
        for part in where.split("."):
            node = node.setdefault(part, {})
        return node

    dropped = re.findall(r"drop ([\w-]+) from the \[([^\]]+)\](?: and \[([^\]]+)\])? table", said)
    for flag, *wheres in dropped:
        for where in filter(None, wheres):
            del table(where)[flag]
    for flags, where in re.findall(
        r"must not set (--[\w-]+(?:, --[\w-]+)*), since .* from the args of the \[([^\]]+)\]",
        said,
    ):
        words = table(where)["args"]
        for flag in flags.split(", "):
            at = words.index(flag)
            del words[at : at + 2]
    for key, value, where in re.findall(r"(\w+) = (\S+) in the \[([^\]]+)\] table sets it", said):
        table(where)[key] = tomllib.loads(f"v = {value}")["v"]
    assert dropped or "from the args of the" in said, said
    config.write_text(_toml(data))


@pytest.mark.parametrize(
    "config_text, says, script_has",
    [
        # a parallel size: its key of the profile's parallel table, which the script then uses
        ("[models.llama32-1b.args]\ntensor-model-parallel-size = 2\n",
         "drop tensor-model-parallel-size from the [models.llama32-1b.args] table (tp = 2 in "
         "the [profiles.smoke.parallel] table sets it)", "then TP=2; fi"),
        ("[profiles.smoke.args]\nsequence-parallel = false\n",
         'sequence_parallel = "off" in the [profiles.smoke.parallel] table sets it', None),
        # the tokenizer: the model's own field
        ("[models.llama32-1b.profiles.smoke.args]\ntokenizer-model = \"/tok/mine\"\n",
         'tokenizer_model = "/tok/mine" in the [models.llama32-1b] table sets it', "/tok/mine"),
        # an output flag: the run folder gives it, only dropped
        ("[common.args]\nsave = \"/ckpt\"\n", "(the run's folder gives it)", None),
        # a scheme's own args list
        ("[schemes.mine]\nlinear = \"bf16\"\nqk = \"bf16\"\npv = \"bf16\"\n"
         "args = [\"--context-parallel-size\", \"2\", \"--log-interval\", \"5\"]\n",
         "drop it (with its value) from the args of the [schemes.mine] table", "--log-interval"),
    ],
)  # fmt: skip
def test_a_flag_the_script_passes_itself_followed(
    run, tmp_path, make_checkout, config_text, says, script_has
):
    root = make_checkout()
    config = tmp_path / "mine.toml"
    config.write_text(config_text)
    scheme = "mine" if "[schemes.mine]" in config_text else "bf16"
    out = tmp_path / "s"
    command = ["gen-scripts", "--out", str(out), "--models", "llama32-1b", "--datasets",
               "wikipedia", "--schemes", scheme, "--profile", "smoke", "--gpus-per-node", "2",
               "--config", str(config), "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and says in said, res
    assert not out.exists()
    _follow_own_flag(said, config)
    res = run(*command)
    assert res.code == 0, (config.read_text(), res)
    (script,) = out.rglob("pretrain_*.sh")
    if script_has:
        assert script_has in script.read_text()


def _te_checkout(make_checkout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout with Megatron's TE layers, and a ``transformer_engine`` the training Python
    imports (native schemes ask it for TransformerEngine)."""
    root = make_checkout(extra=("megatron/core/extensions/transformer_engine.py",))
    site = tmp_path / "site"
    (site / "transformer_engine").mkdir(parents=True)
    (site / "transformer_engine" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(site))
    return root


def _follow_scheme_fields(said: str, config: Path, name: str, pick: int) -> None:
    """A scheme table's refusal followed in ``config``: `add KEY = VALUE`, `drop K1, K2`,
    `leave out K1, K2`, `drop native`, `take a value of that recipe (V ...`; where it offers
    two ways, the ``pick``-th."""
    data = tomllib.loads(config.read_text())
    entry = data["schemes"][name]
    advice = said.rsplit("; ", 1)[1].rstrip(".")
    ways = re.split(r",? or (?=add |drop |take )", advice)
    way = ways[min(pick, len(ways) - 1)]
    added = re.match(r"add (\w+) = (\S+)", way)
    taken = re.match(r"take a value of that recipe \(([\w.-]+)", way)
    if added:
        entry[added[1]] = tomllib.loads(f"v = {added[2]}")["v"]
    elif taken:
        entry["linear"] = taken[1]
    else:
        gone = re.fullmatch(r"(?:drop|leave out) ([\w, ]+)", way)
        assert gone, way
        for key in gone[1].split(", "):
            del entry[key]
    config.write_text(_toml(data))


TWO_WAYS = "add te_recipe = true (its GEMMs then follow Megatron's policy) or drop "
FP8_WGRAD = (
    "drop fp8_wgrad, or take a value of that recipe (fp8-delayed or fp8-delayed-e4m3: the "
    "schemes te_delayed_hybrid and te_delayed_e4m3), whose schemes honour it."
)


@pytest.mark.parametrize(
    "fields, says, pick",
    [
        ("linear = 'fp8-tensor'\nfirst_last_layers_bf16 = true",
         f"{TWO_WAYS}first_last_layers_bf16.", 0),
        ("linear = 'fp8-tensor'\nfirst_last_layers_bf16 = true",
         f"{TWO_WAYS}first_last_layers_bf16.", 1),
        ("linear = 'mxfp8'\nfp8_wgrad = false", "recipes; drop fp8_wgrad.", 0),
        ("linear = 'fp8-delayed'\nte_recipe = true\nfirst_last_layers_bf16 = true",
         "drop first_last_layers_bf16.", 0),
        ("linear = 'fp8-tensor'\nte_recipe = true\nfp8_wgrad = false", FP8_WGRAD, 0),
        ("linear = 'fp8-tensor'\nte_recipe = true\nfp8_wgrad = false", FP8_WGRAD, 1),
        ("linear = 'mxfp8'\nnative = true", "leave out linear, or drop native.", 0),
        ("linear = 'mxfp8'\nnative = true", "leave out linear, or drop native.", 1),
        ("linear = 'mxfp8'\nbf16_layers = 'output'\nnative = true\nemulates = 'bf16'",
         "leave out linear, bf16_layers.", 0),
    ],
)  # fmt: skip
def test_a_scheme_table_refusal_followed(
    run, tmp_path, make_checkout, monkeypatch, fields, says, pick
):
    """The fields of a scheme of one's own that Megatron cannot run: each way the sentence
    gives, followed in the --config, and gen-scripts writes the scheme's script."""
    root = _te_checkout(make_checkout, tmp_path, monkeypatch)
    config = tmp_path / "mine.toml"
    config.write_text(f"[schemes.x]\nqk = 'bf16'\npv = 'bf16'\n{fields}\n")
    out = tmp_path / "s"
    command = ["gen-scripts", "--out", str(out), *SMOKE[:4], "--schemes", "x", "--profile",
               "smoke", "--config", str(config), "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and said.endswith(says), res
    _follow_scheme_fields(said, config, "x", pick)
    res = run(*command)
    assert res.code == 0, (config.read_text(), res)
    assert len(list(out.rglob("pretrain_*_x.sh"))) == 1


def test_no_quantpatch_executable_followed(cluster, run, tmp_path, monkeypatch):
    """A Python whose quantpatch is neither beside it nor on PATH (QUANTPATCH unset): the
    sweep's scripts could not call quantpatch back; setting QUANTPATCH, as said, runs it."""
    root, _stub = cluster
    monkeypatch.delenv("QUANTPATCH")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python3"))
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "bin"), "/usr/bin", "/bin"]))
    command = ["sweep", "run", str(tmp_path / "sw"), *SMOKE, "--gpus", "0", "--repo", str(root)]
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "set QUANTPATCH to its path" in said, res
    assert not (tmp_path / "sw").exists(), list((tmp_path / "sw").iterdir())
    single = ["run", "--model", "llama32-1b", "--dataset", "wikipedia", "--scheme", "bf16",
              "--profile", "smoke", "--repo", str(root)]  # fmt: skip
    res = run(*single)
    assert res.code == 2 and "set QUANTPATCH to its path" in " ".join(res.err.split()), res
    assert not (root / ".git" / "quantpatch" / "scripts").exists()
    monkeypatch.setenv("QUANTPATCH", QUANTPATCH)  # followed: the installation's executable
    res = run(*command)
    assert res.code == 0, res
    assert "1 of 1 finished, 0 failed" in res.out
    assert run(*single).code == 0


@pytest.mark.parametrize(
    "command, option, bad",
    [
        ("gen-scripts", "--launcher", "mpirun"),
        ("gen-scripts", "--profile", "huge"),
        ("gen-scripts", "--attention", "fast"),
        ("gen-scripts", "--models", "gpt5"),
        ("gen-scripts", "--datasets", "c4"),
        ("gen-scripts", "--schemes", "FA_fp8"),
        ("sweep", "--launcher", "mpirun"),  # sweep run's own list (local, slurm)
        ("gen-scripts", "--megatron-release", "v9"),
        ("run", "--scheme", "FA_fp8"),
    ],
)
def test_an_unknown_choice_followed_with_a_valid_one(cluster, run, tmp_path, command, option, bad):
    """`unknown X 'V'; valid: A, B` (or `known:`): a listed one given instead is accepted."""
    root, _stub = cluster
    smoke = dict(zip(SMOKE[::2], SMOKE[1::2], strict=True))
    if command == "run":  # one combination: the options in the singular
        smoke = {o.rstrip("s") if o != "--profile" else o: v for o, v in smoke.items()}
    values = {**smoke, option: bad}
    given = [w for o, v in values.items() for w in (o, v)]
    head = {
        "gen-scripts": ["gen-scripts", "--out", str(tmp_path / "s")],
        "sweep": ["sweep", "run", str(tmp_path / "sw"), "--gpus", "0"],
        "run": ["run"],
    }[command]
    res = run(*head, *given, "--repo", str(root))
    said = " ".join(res.err.split())
    valid = re.search(rf"unknown \w+ '{bad}'; (?:valid|known): ([\w.-]+(?:, [\w.-]+)*)", said)
    assert res.code == 2 and valid, res
    listed = valid[1].rstrip(".").split(", ")
    # the smoke selection's own where listed (the others need data or GPUs), else the first
    values[option] = smoke.get(option, listed[0])
    assert values[option] in listed, listed
    given = [w for o, v in values.items() for w in (o, v)]
    res = run(*head, *given, "--repo", str(root))
    assert res.code == 0, (values, res)


@pytest.mark.parametrize("variable", ["DATA_ROOT", "DATA_PREFIX"])
def test_data_elsewhere_followed_by_pointing_at_it(cluster, run, tmp_path, monkeypatch, variable):
    """`point DATA_ROOT / DATA_PREFIX at them`: the data is elsewhere, the variable names it."""

    root, _stub = cluster
    monkeypatch.delenv("MOCK_DATA", raising=False)
    monkeypatch.delenv("DATA_PREFIX", raising=False)
    monkeypatch.setenv("DATA_ROOT", str(tmp_path / "nodata"))
    elsewhere = tmp_path / "elsewhere"
    prefix = empty_wikipedia(elsewhere)
    command = ["sweep", "run", str(tmp_path / "sw"), *SMOKE[:-1], "fast", "--launcher",
               "slurm", "--gpus-per-node", "2", "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "point DATA_ROOT / DATA_PREFIX at them" in said, res
    monkeypatch.setenv(variable, str(elsewhere if variable == "DATA_ROOT" else prefix))
    res = run(*command)
    assert res.code == 0, res
    checked = json.loads((tmp_path / "sw" / "sweep.json").read_text())["data"]["checked"]
    assert [c["prefix"] for c in checked] == [str(prefix)]


def test_a_twin_that_is_no_scheme_followed(run, tmp_path, make_checkout, monkeypatch):
    """A native scheme's `emulates` naming no scheme: one of the schemes listed is taken."""
    root = _te_checkout(make_checkout, tmp_path, monkeypatch)
    config = tmp_path / "mine.toml"
    config.write_text("[schemes.x]\nnative = true\nemulates = 'nothing'\n")
    command = ["gen-scripts", "--out", str(tmp_path / "s"), *SMOKE[:4], "--schemes", "x",
               "--profile", "smoke", "--config", str(config), "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    listed = re.search(r"emulates 'nothing', which is no scheme; valid: ([^.]+)\.", said)
    assert res.code == 2 and listed, res
    assert "bf16" in listed[1].split(", ")
    config.write_text("[schemes.x]\nnative = true\nemulates = 'bf16'\n")
    res = run(*command)
    assert res.code == 0, res


def test_status_of_a_folder_without_a_sweep_followed(cluster, run, tmp_path):
    """`not a sweep (start one with sweep run)`: sweep run there, and status answers."""
    root, _stub = cluster
    out = tmp_path / "sw"
    out.mkdir()
    for command in ("status", "cancel"):
        res = run("sweep", command, out)
        assert res.code == 2 and "(start one with sweep run)" in res.err, res
    res = run("sweep", "run", out, *SMOKE, "--gpus", "0", "--repo", root)
    assert res.code == 0, res
    res = run("sweep", "status", out)
    assert res.code == 0 and "1 runs: 1 finished" in res.out, res


def test_a_flag_of_a_schemes_args_the_release_refuses_followed(run, tmp_path, make_checkout):
    """A scheme's own args with a flag Megatron does not take: the refusal gives the scheme's
    args list without it, and the script of that list is written."""
    root = make_checkout()
    config = tmp_path / "mine.toml"
    config.write_text(
        "[schemes.mine]\nlinear = 'bf16'\nqk = 'bf16'\npv = 'bf16'\n"
        "args = ['--log-interval', '5', '--no-such-flag', '--no-such-size', '3']\n"
    )
    out = tmp_path / "s"
    command = ["gen-scripts", "--out", str(out), *SMOKE[:4], "--schemes", "mine", "--profile",
               "smoke", "--config", str(config), "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    entry = re.search(r"set (args = \[[^\]]*\]) in the \[schemes\.mine\] table of a --config "
                      r"to leave them out", said)  # fmt: skip
    assert res.code == 2 and entry, res
    assert entry[1] == 'args = ["--log-interval", "5"]'
    data = tomllib.loads(config.read_text())
    data["schemes"]["mine"]["args"] = tomllib.loads(entry[1])["args"]
    config.write_text(_toml(data))
    res = run(*command)
    assert res.code == 0, (config.read_text(), res)
    (script,) = out.rglob("pretrain_*_mine.sh")
    assert "--log-interval 5" in " ".join(script.read_text().split())
    assert "--no-such" not in script.read_text()


def test_a_size_that_passes_one_check_followed_to_the_end(run, tmp_path, make_checkout):
    """`TP 2 would pass this check` (32 heads, 6 GPUs: no TP works alone): followed, the next
    refusal names the next change, and that one is accepted."""
    root = make_checkout()
    config = tmp_path / "mine.toml"
    command = ["gen-scripts", "--out", str(tmp_path / "s"), *SMOKE, "--gpus-per-node", "6",
               "--tp", "3", "--repo", str(root)]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "TP 2 would pass this check (--tp 2 instead of --tp 3)" in said, res
    command = follow(said, command, config)
    res = run(*command)
    said = " ".join(res.err.split())
    assert res.code == 2 and "global batch 3 would work" in said, res
    command = follow(said, command, config)
    res = run(*command)
    assert res.code == 0, (config.read_text(), res)


def test_gpus_and_nodes_that_disagree_followed(run):
    """`quantpatch layout --gpus 2 --nodes 2`: give either, as said; --gpus alone is taken.
    And a --gpus that is no whole number of nodes: a number it names is taken."""
    command = ["layout", "--model", "llama32-1b", "--profile", "smoke", "--gpus-per-node", "2",
               "--gpus", "2", "--nodes", "2", "--line"]  # fmt: skip
    res = run(*command)
    assert res.code == 2 and "give either --gpus or --nodes" in res.err, res
    at = command.index("--nodes")
    res = run(*command[:at], *command[at + 2 :])
    assert res.code == 0 and res.out.startswith("world 2 (1 node x 2 GPUs)"), res
    # --gpus 3 on 2-GPU nodes: `2 or 4 GPUs would be`; the first, given, is taken
    res = run(*command[:at], "--gpus", "3", "--line")
    would = re.search(r"; (\d+) or (\d+) GPUs would be\.", " ".join(res.err.split()))
    assert res.code == 2 and would, res
    assert run(*command[:at], "--gpus", would[1], "--line").code == 0


def test_no_scancel_on_path_followed(cluster, run, tmp_path, monkeypatch):
    """`scancel is not on PATH: cancel the sweep from a machine with Slurm`: where scancel
    is there, the same cancel goes through."""
    root, stub = cluster
    out = tmp_path / "sw"
    res = run("sweep", "run", out, *SMOKE, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    scancel = tmp_path / "bin" / "scancel"
    hidden = scancel.rename(tmp_path / "scancel")
    path = os.environ["PATH"]
    monkeypatch.setenv(
        "PATH",
        os.pathsep.join(d for d in path.split(os.pathsep) if not (Path(d) / "scancel").exists()),
    )
    res = run("sweep", "cancel", out)
    assert res.code == 2 and "cancel the sweep from a machine with Slurm" in res.err, res
    hidden.rename(scancel)  # followed: a machine whose PATH has Slurm's scancel
    monkeypatch.setenv("PATH", path)
    res = run("sweep", "cancel", out)
    assert res.code == 0 and (stub / "scancel.args").exists(), res


def test_a_batch_the_layout_command_refuses_followed_both_ways(
    run, tmp_path, make_checkout, monkeypatch
):
    """`global batch 4 (--global-batch 4, GLOBAL_BATCH_SIZE=4) would work`: the option for
    `quantpatch layout` itself (it reads no variable: the variable alone was refused again),
    the variable for a script, whose check is that command."""
    command = ["layout", "--model", "llama32-1b", "--profile", "smoke", "--gpus-per-node", "2",
               "--nodes", "2", "--line"]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    fix = re.search(r"global batch 4 \((--global-batch) (4), (GLOBAL_BATCH_SIZE)=(4)\) would", said)
    assert res.code == 2 and fix, res
    monkeypatch.setenv(fix[3], fix[4])  # the variable does nothing for the command itself
    assert run(*command).code == 2
    res = run(*command, fix[1], fix[2])
    assert res.code == 0 and "global batch 4" in res.out, res
    # a script: the same check refuses it, the variable makes it start
    root = make_checkout()
    out = tmp_path / "s"
    assert run("gen-scripts", "--out", out, *SMOKE, "--repo", root).code == 0
    (script,) = out.rglob("pretrain_*.sh")
    env = {**os.environ, "QUANTPATCH_DRY_RUN": "1", "QUANTPATCH": QUANTPATCH, "NNODES": "2",
           "GPUS_PER_NODE": "2", "MASTER_ADDR": "node0"}  # fmt: skip
    env.pop(fix[3])
    done = subprocess.run([str(script)], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and fix[0] in " ".join(done.stderr.split()), done.stderr
    done = subprocess.run([str(script)], cwd=root, env={**env, fix[3]: fix[4]},
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_recipe_flag_the_checkout_does_not_accept_followed(run, tmp_path, monkeypatch):
    """A checkout whose parser lacks --fp8-recipe, which a native scheme's recipe passes: the
    refusal says to run without that scheme, and --schemes without it is taken."""
    from .test_scripts import _megatron_checkout

    root = _megatron_checkout(tmp_path / "Megatron-LM", drop=["--fp8-recipe"])
    monkeypatch.chdir(root)
    command = ["gen-scripts", "--out", str(tmp_path / "s"), *SMOKE[:4], "--profile", "smoke",
               "--schemes", "bf16,native_tensorwise_hybrid"]  # fmt: skip
    res = run(*command)
    said = " ".join(res.err.split())
    named = re.search(r"give --schemes without ([\w, -]+) \(their recipe passes it\)", said)
    assert res.code == 2 and named, res
    left = [s for s in command[-1].split(",") if s not in named[1].split(", ")]
    assert left == ["bf16"]
    res = run(*command[:-1], ",".join(left))
    assert res.code == 0, res
