"""A sweep on a real two-node Slurm (two ``slurmd -N`` of this machine, 2 GPUs a node as GRES,
``tests/slurm/cluster.sh`` with ``SLURM_NODES=2``): the layout refusal's advice followed, then
a 2 x 2 run that runs what ``sweep.json`` records, whatever the submitting shell exports. The
runs' ``torchrun`` is a stub recording its arguments on each node; sbatch, the allocation,
``srun`` and ``sacct`` are Slurm's own.

Needs root and Debian's Slurm, as test_sweep_slurm (skipped, or failed under
``QUANTPATCH_REAL_SLURM=1``, without them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .test_scripts import QUANTPATCH
from .test_sweep_slurm import _wait, one_node_slurm

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # one cluster at a time

RECORDER = r"""#!/usr/bin/env bash
n="$STUB_DIR/torchrun-$SLURM_NODEID-$$"
printf '%s\n' "$@" > "$n.argv"
env > "$n.env"
echo "[stub] node $SLURM_NODEID of $SLURM_JOB_NUM_NODES"
"""
HOSTILE = {
    "GPUS_PER_NODE": "3",
    "MASTER_ADDR": "oldnode07",
    "MASTER_PORT": "1234",
    "NNODES": "1",
    "NODE_RANK": "5",
    "RDZV_ID": "old",
    "TP": "2",
    "GLOBAL_BATCH_SIZE": "3",
    "PET_NNODES": "1",
    "QUANTPATCH_DRY_RUN": "1",
}


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_a_two_node_sweep_runs_what_it_recorded_whatever_the_shell_exports(
    make_checkout, tmp_path, monkeypatch, run
):
    with one_node_slurm(tmp_path / "slurm", gpus=2, nodes=2) as client:
        root = make_checkout()
        bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
        bin_dir.mkdir()
        stub.mkdir()
        (bin_dir / "torchrun").write_text(RECORDER)
        (bin_dir / "torchrun").chmod(0o755)
        for key, value in {
            **client,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "STUB_DIR": str(stub),
            "QUANTPATCH": QUANTPATCH,
            "NCCL_DEBUG": "INFO",
            **HOSTILE,
        }.items():
            monkeypatch.setenv(key, value)
        out = tmp_path / "sweep"
        select = ("--models", "llama32-1b", "--datasets", "wikipedia", "--schemes", "bf16",
                  "--profile", "smoke", "--launcher", "slurm", "--nodes", "2",
                  "--gpus-per-node", "2", "--repo", root)  # fmt: skip
        # the smoke profile's global batch (2) over 4 data-parallel ranks: refused, with a fix
        res = run("sweep", "run", out, *select)
        said = " ".join(res.err.split())
        assert res.code == 2 and not out.exists(), res
        assert said.endswith(
            "global batch 4 would work (global-batch-size = 4 in the [profiles.smoke.args] "
            "table of a --config)."
        ), said
        config = tmp_path / "two-nodes.toml"
        config.write_text("[profiles.smoke.args]\nglobal-batch-size = 4\n")  # followed
        res = run("sweep", "run", out, *select, "--config", config)
        assert res.code == 0 and "submitted 1 runs" in res.out, res
        (recorded,) = json.loads((out / "sweep.json").read_text())["runs"]

        def state() -> str:
            res = run("sweep", "status", out, "--json")
            return json.loads(res.out)["runs"][0]["state"]

        _wait(lambda: state() in ("finished", "failed"), "the two-node run", timeout=240)
        rec = json.loads((out / "sweep.json").read_text())
        (done,) = rec["runs"]
        slurm_out = Path(done.get("slurm_output") or "")
        assert done["state"] == "finished", (
            done,
            slurm_out.read_text() if slurm_out.is_file() else "",
        )
        assert rec["layout"] == {"gpus_per_node": 2, "nodes": 2}
        assert recorded["env"]["NCCL_DEBUG"] == "INFO"
        assert not set(HOSTILE) & set(recorded["env"])
        # one torchrun on each node, with the recorded shape and the allocation's rendezvous
        calls = sorted(stub.glob("torchrun-*.argv"))
        assert [p.name.split("-")[1] for p in calls] == ["0", "1"]
        job = done["slurm_job"]
        for path in calls:
            argv = path.read_text().splitlines()
            assert argv[:6] == ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
                                "c10d"]  # fmt: skip
            host, port = _after(argv, "--rdzv-endpoint").split(":")
            assert host == "qp1" and port != "1234"
            assert _after(argv, "--rdzv-id").startswith(f"{done['name']}-")
            assert _after(argv, "--tensor-model-parallel-size") == "1"
            assert _after(argv, "--global-batch-size") == "4"
            env = dict(
                line.split("=", 1)
                for line in path.with_suffix(".env").read_text().splitlines()
                if "=" in line
            )
            assert "NODE_RANK" not in env and "PET_NNODES" not in env
            assert env["NCCL_DEBUG"] == "INFO"
        # the CPUs the run needs: 2 ranks a node, each with 2 data-loader workers
        # (the allocation, and the srun step that runs torchrun)
        res = subprocess.run(
            ["sacct", "-n", "-P", "-j", str(job), "-o", "JobID,AllocCPUS,NNodes"],
            capture_output=True,
            text=True,
            check=True,
        )
        rows = dict(line.split("|", 1) for line in res.stdout.split())
        whole = [v for k, v in rows.items() if "." not in k]
        step = [v for k, v in rows.items() if k.endswith(".0")]
        assert whole == ["12|2"] and step == ["12|2"], res.stdout
