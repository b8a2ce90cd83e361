"""``quantpatch sweep --launcher slurm`` against a real one-node Slurm (Debian's 22.05: munged,
MariaDB, slurmdbd, slurmctld, slurmd), started by ``tests/slurm/cluster.sh`` for this module and
stopped after it. The runs' ``torchrun`` is the stub of test_sweep (Megatron's log lines; it
fails or hangs on request); everything else (sbatch, the job array, srun, sacct, scancel, the
time limit) is Slurm's own.

What one node cannot show, several nodes (the rendezvous taken from the allocation's first
node), is tested with stub sbatch / srun / scontrol in test_launchers and test_sweep only.

The cluster needs root (its daemons) and apt-get (where the packages are missing): without
them this module is skipped, saying why, except where ``QUANTPATCH_REAL_SLURM=1`` is set (CI
sets it), where a cluster that cannot start fails the test instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import git
import pytest

from quantpatch.launch.sweep import run_logs
from quantpatch.launch.sweep_record import load as load_record

from .test_scripts import QUANTPATCH
from .test_sweep import TORCHRUN

# the real-Slurm tests (here, test_sweep_slurm_nodes, test_fork_walk): one cluster at a time on
# a machine, so tests/conftest.py keeps them on one worker, one after another
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]

CLUSTER = Path(__file__).parent / "slurm" / "cluster.sh"
REQUIRED = os.environ.get("QUANTPATCH_REAL_SLURM") == "1"
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct")


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a real Slurm needs root (it starts munged, slurmdbd, slurmctld and slurmd)"
    if shutil.which("apt-get") is None and not all(shutil.which(d) for d in DAEMONS):
        return "a real Slurm needs Debian's slurm packages or apt-get to install them"
    return None


@contextmanager
def one_node_slurm(where: Path, gpus: int = 8, nodes: int = 1) -> Iterator[dict[str, str]]:
    """A running one-node cluster whose node declares ``gpus`` GPUs: the environment its
    clients need (SLURM_CONF); ``nodes`` > 1: that many nodes, each a ``slurmd -N`` of
    this machine. Skipped (or failed, under QUANTPATCH_REAL_SLURM=1) where it
    cannot start. One cluster at a time on this machine (its daemons take fixed ports): a
    second user (another xdist worker) waits on a lock until the first stopped its cluster."""
    why = _unavailable()
    if why is not None:
        if REQUIRED:
            pytest.fail(f"QUANTPATCH_REAL_SLURM=1 but {why}")
        pytest.skip(why)
    with open(Path(tempfile.gettempdir()) / "quantpatch-one-node-slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with _started(where, gpus, nodes) as client:
                yield client
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _started(where: Path, gpus: int, nodes: int = 1) -> Iterator[dict[str, str]]:
    timings = {}
    env = {**os.environ, "SLURM_NODE_GPUS": str(gpus), "SLURM_NODES": str(nodes)}
    for step, args in (("install", ["install"]), ("start", ["start", str(where)])):
        began = time.monotonic()
        res = subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, env=env)
        timings[step] = time.monotonic() - began
        if res.returncode != 0:
            subprocess.run(["bash", str(CLUSTER), "stop", str(where)], check=False)
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                for p in sorted((where / "log").glob("*.log"))
            )
            message = f"the one-node Slurm did not {step}: {res.stderr[-2000:]}\n{logs}"
            if REQUIRED or step == "start":
                pytest.fail(message)
            pytest.skip(message)
    print(f"slurm cluster: install {timings['install']:.1f} s, start {timings['start']:.1f} s")
    client = {"SLURM_CONF": str(where / "etc" / "slurm.conf")}
    try:
        yield client
    finally:
        cleanup = {**os.environ, **client}
        subprocess.run(["scancel", "--user", "root"], env=cleanup, check=False)
        subprocess.run(["bash", str(CLUSTER), "stop", str(where)], check=False)


@pytest.fixture(scope="module")
def real_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running one-node cluster (8 GPUs declared)."""
    with one_node_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def _wait(pred, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


SELECT = (
    "--models", "llama32-1b", "--datasets", "wikipedia", "--profile", "smoke",
    "--schemes", "bf16,FA_mxfp8,linear_mxfp4,FA_hifp8", "--launcher", "slurm",
)  # fmt: skip


def test_a_study_on_a_real_one_node_slurm(real_slurm, make_checkout, tmp_path, monkeypatch, run):
    root = make_checkout()
    bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub.mkdir()
    (bin_dir / "torchrun").write_text(TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    for key, value in {
        **real_slurm,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(stub),
        "QUANTPATCH": QUANTPATCH,
        "STUB_FAIL": "linear-mxfp4",  # exits 3
        "STUB_HANG": "qk-hifp8",  # FA_hifp8: sleeps until it is cancelled or times out
    }.items():
        monkeypatch.setenv(key, value)  # sbatch --export=ALL hands them to the tasks
    out, timed, cancelled = tmp_path / "sweep", tmp_path / "timed", tmp_path / "cancelled"

    def status(folder: Path) -> dict[str, dict]:
        res = run("sweep", "status", folder, "--json")
        assert res.code == 0, res
        return {r["scheme"]: r for r in json.loads(res.out)["runs"]}

    # a sweep whose task Slurm's time limit kills (one minute: Slurm's smallest), running
    # beside the other
    cluster_toml = tmp_path / "cluster.toml"
    cluster_toml.write_text('[slurm]\ntime = "1"\n')
    res = run("sweep", "run", timed, *SELECT[:6], "--schemes", "FA_hifp8", "--launcher", "slurm",
              "--config", cluster_toml, "--repo", root)  # fmt: skip
    assert res.code == 0 and "submitted 1 runs as Slurm job array" in res.out, res

    # a sweep to cancel with `sweep cancel`
    res = run("sweep", "run", cancelled, *SELECT[:6], "--schemes", "FA_hifp8", "--launcher",
              "slurm", "--repo", root)  # fmt: skip
    assert res.code == 0 and "submitted 1 runs" in res.out, res

    res = run("sweep", "run", out, *SELECT, "--repo", root)
    assert res.code == 0, res
    assert "submitted 4 runs as Slurm job array" in res.out
    job = json.loads((out / "sweep.json").read_text())["slurm_job"]
    _wait(
        lambda: (
            [s["state"] for s in status(out).values()].count("finished") == 2
            and status(out)["linear_mxfp4"]["state"] == "failed"
            and any("qk-hifp8" in line and "start" in line for line in _calls(stub))
        ),
        "two runs finished, one failed and the hanging one started",
    )
    runs = status(out)
    assert runs["FA_hifp8"]["state"] == "running"
    # a conflicting selection while the array still runs: refused, nothing changed
    before = (out / "sweep.json").read_text()
    res = run("sweep", "run", out, *SELECT[:-4], "--schemes", "bf16", "--launcher", "slurm",
              "--repo", root)  # fmt: skip
    assert res.code == 2 and "pending or running in Slurm" in " ".join(res.err.split()), res
    assert (out / "sweep.json").read_text() == before
    hang = runs["FA_hifp8"]
    subprocess.run(["scancel", f"{hang['slurm_job']}_{hang['array_task']}"], check=True)
    _wait(lambda: status(out)["FA_hifp8"]["state"] == "interrupted", "the cancelled run")

    rec = {r["scheme"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    shown = status(out)
    for scheme, state, code in (
        ("bf16", "finished", 0),
        ("FA_mxfp8", "finished", 0),
        ("linear_mxfp4", "failed", 3),
        ("FA_hifp8", "interrupted", None),
    ):
        for r in (rec[scheme], shown[scheme]):
            assert r["state"] == state, (scheme, r)
            assert r["slurm_job"] == job and isinstance(r["array_task"], int)
            if code is not None:
                assert r["exit_code"] == code, (scheme, r)
    assert rec["linear_mxfp4"]["reason"] == "FAILED"
    assert rec["FA_hifp8"]["reason"].startswith("CANCELLED")
    repo = git.Repo(root)
    for scheme, values in (("bf16", "bf16_qk-bf16_pv-bf16"), ("FA_mxfp8", "bf16_qk-mxfp8_pv-bf16")):
        r = rec[scheme]
        log = out / r["log"]  # the sweep folder's
        assert log.is_file() and log.is_relative_to(out / "runs"), r
        assert r["commit"] == repo.commit(f"quantpatch/linear-{values}").hexsha
        started, ended = datetime.fromisoformat(r["started"]), datetime.fromisoformat(r["ended"])
        assert started <= ended
        assert (out / r["slurm_output"]).parent == out / "slurm"
    # nothing in the checkout: the tasks' output went under the sweep folder
    assert repo.git.status("--porcelain") == ""
    assert len(list((out / "slurm").glob(f"{job}_*.out"))) == 4

    # resume: exactly the two unfinished runs, in one new array; they finish now
    monkeypatch.delenv("STUB_FAIL")
    monkeypatch.delenv("STUB_HANG")
    res = run("sweep", "run", out, "--repo", root)
    assert res.code == 0, res
    assert "submitted 2 runs as Slurm job array" in res.out and "2 finished" in res.out, res
    again = {r["scheme"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert {s for s, r in again.items() if r["slurm_job"] != job} == {"linear_mxfp4", "FA_hifp8"}
    assert again["bf16"] == rec["bf16"]  # finished runs kept as they were
    _wait(
        lambda: all(r["state"] == "finished" for r in status(out).values()),
        "the resubmitted runs",
    )
    assert all(r["exit_code"] == 0 and r["log"] for r in status(out).values())
    res = run("sweep", "run", out, "--repo", root)
    assert res.code == 0 and "nothing to submit" in res.out and "4 finished" in res.out, res
    res = run("sweep", "report", out)
    assert res.code == 0, res
    html = (out / "report.html").read_text()
    final = json.loads((out / "sweep.json").read_text())
    typed = load_record(out)
    assert typed is not None
    logs = run_logs(out, typed)  # the report's: each run's last log, not the failed attempts'
    assert sorted(logs) == sorted(out / r["log"] for r in final["runs"])
    assert len(logs) == 4 and len(list((out / "runs").rglob("*.log"))) == 6
    for scheme in ("bf16", "FA_mxfp8", "linear_mxfp4", "FA_hifp8"):
        assert scheme in html
    assert repo.git.status("--porcelain") == ""

    # the time limit: failed with TIMEOUT, and it runs again on resume
    _wait(
        lambda: status(timed)["FA_hifp8"]["state"] in ("finished", "failed", "interrupted"),
        "the time limit",
    )
    r = status(timed)["FA_hifp8"]
    assert (r["state"], r["reason"]) == ("failed", "TIMEOUT"), r
    res = run("sweep", "run", timed, "--repo", root)
    assert res.code == 0 and "submitted 1 runs" in res.out, res
    _wait(lambda: status(timed)["FA_hifp8"]["state"] == "finished", "the rerun after TIMEOUT")

    # sweep cancel: its pending or running task scancelled, recorded interrupted, gone from
    # Slurm's queue; cancelling again has nothing to do
    res = run("sweep", "cancel", cancelled)
    assert res.code == 0 and "cancelled 1 run(s), recorded interrupted" in res.out, res
    r = status(cancelled)["FA_hifp8"]
    assert r["state"] == "interrupted" and r["reason"] == "CANCELLED", r
    _wait(
        lambda: (
            subprocess.run(
                ["squeue", "-h", "-j", r["slurm_job"]], capture_output=True, text=True
            ).stdout.strip()
            == ""
        ),
        "the cancelled task to leave the queue",
    )
    assert status(cancelled)["FA_hifp8"]["state"] == "interrupted"
    res = run("sweep", "cancel", cancelled)
    assert res.code == 0 and "nothing to cancel" in res.out, res


def _calls(stub: Path) -> list[str]:
    path = stub / "calls"
    return path.read_text().splitlines() if path.exists() else []
