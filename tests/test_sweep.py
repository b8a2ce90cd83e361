"""``quantpatch sweep``: a local queue, GPU slices, failures, resume after SIGKILL, Ctrl-C, and
Slurm submission and status, with stub ``torchrun`` / ``sbatch`` / ``squeue`` / ``sacct`` that
print core_v0.13.1's log lines and can fail, hang or be killed on request. The fast suite
keeps one local sweep, the Slurm submission and the Slurm states; the rest is marked slow."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from quantpatch.launch.sweep import group_alive
from quantpatch.launch.sweep_record import RunState, SweepRecord

from .conftest import Pipe, group_members, paused, release, wait_exited
from .test_scripts import QUANTPATCH


def empty_wikipedia(data_root: Path) -> Path:
    """llama32-1b's wikipedia files (``.bin``, ``.idx``, empty) under ``data_root``, where the
    scripts resolve them: the prefix."""
    from quantpatch.data_prep.layout import data_prefix
    from quantpatch.launch.registry import load_registry

    wiki = load_registry(None).datasets["wikipedia"].prefix
    prefix = data_prefix(wiki, "llama32-1b", {}, data_root=str(data_root))
    prefix.parent.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(b"")
    return prefix


# the scheme comes from the worktree's name (quantpatch__linear-X_qk-Y_pv-Z)
TORCHRUN = r"""#!/usr/bin/env bash
set -u
# the trap before the start line: a test that signals once it reads the line finds it set
trap 'echo "$$ term" >> "$STUB_DIR/calls"; exit 143' TERM
echo "$$ $(basename "$PWD") ${CUDA_VISIBLE_DEVICES:-none} $(date +%s.%N) start" >> "$STUB_DIR/calls"
# a barrier for the test (a named pipe it holds open): this run has started, its trap is set
if [[ -p "$STUB_DIR/started" ]]; then echo "$$ start" > "$STUB_DIR/started"; fi
if [[ -n "${STUB_HANG:-}" && "$PWD" == *"$STUB_HANG"* ]]; then
    sleep 600 & wait $!
fi
if [[ -n "${STUB_FAIL:-}" && "$PWD" == *"$STUB_FAIL"* ]]; then
    echo "Traceback: stub failure" >&2
    exit 3
fi
LINE=' [2026-11-22 11:25:3%d] iteration %9d/%8d | consumed samples: %12d | '
LINE+='elapsed time per iteration (ms): 96.9 | learning rate: 6.666667E-05 | '
LINE+='global batch size: %5d | lm loss: %.6E | loss scale: 1.0 | grad norm: 2.105 | '
LINE+='number of skipped iterations: %3d | number of nan iterations: %3d |\n'
# bf16 going NaN past iteration 2 (core_v0.13.1 leaves lm loss out, prints grad norm: nan)
NAN=' [2026-11-22 11:25:3%d] iteration %9d/%8d | consumed samples: %12d | '
NAN+='elapsed time per iteration (ms): 96.9 | learning rate: 6.666667E-05 | '
NAN+='global batch size: %5d | loss scale: 1.0 | grad norm: nan | '
NAN+='number of skipped iterations: %3d | number of nan iterations: %3d |\n'
for i in 1 2 3 4; do
    # shellcheck disable=SC2059
    if [[ -n "${STUB_NAN:-}" && "$PWD" == *"$STUB_NAN"* && $i -gt 2 ]]; then
        printf "$NAN" "$i" "$i" 4 "$((2 * i))" 2 0 0
    else
        printf "$LINE" "$i" "$i" 4 "$((2 * i))" 2 "$((10 - i))" 0 0
    fi
done
sleep "${STUB_SLEEP:-0}" & wait $!
echo "$$ $(date +%s.%N) end" >> "$STUB_DIR/calls"
"""
# Slurm's client commands, stubbed only for what the real one-node Slurm of
# test_sweep_slurm.py does not show: Slurm's GPU refusal (that cluster has the gpu GRES) and a
# cluster whose accounting is off (sacct refuses; squeue, scontrol and the task's output speak)
SBATCH = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$STUB_DIR/sbatch.args"
printf '%s\n' "${DATA_ROOT:-}" "${TOKENIZER_MODEL:-}" > "$STUB_DIR/sbatch.data"
if [[ -n "${STUB_SBATCH_REFUSES:-}" ]]; then
    echo "sbatch: error: Batch job submission failed: $STUB_SBATCH_REFUSES" >&2
    exit 1
fi
echo "4242"
"""
SQUEUE = r"""#!/usr/bin/env bash
echo "4242_1|RUNNING|4244"
echo "4242_2|PENDING|4245"
"""
SACCT = r"""#!/usr/bin/env bash
echo "sacct: error: Slurm accounting storage is disabled" >&2
exit 1
"""
SCONTROL = r"""#!/usr/bin/env bash
echo "JobId=4243 ArrayJobId=4242 ArrayTaskId=0 JobState=${STUB_TASK0:-COMPLETED} Reason=None \
ExitCode=${STUB_TASK0_EXIT:-0:0} StartTime=2026-11-27T10:00:00 EndTime=2026-11-27T10:05:00"
"""


@pytest.fixture
def sweep_env(tmp_path, make_checkout, monkeypatch):
    root = make_checkout()
    bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub.mkdir()
    for name, text in (
        ("torchrun", TORCHRUN),
        ("sbatch", SBATCH),
        ("squeue", SQUEUE),
        ("sacct", SACCT),
        ("scontrol", SCONTROL),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(stub),
        "QUANTPATCH": QUANTPATCH,
    }
    for key in ("PATH", "STUB_DIR", "QUANTPATCH"):  # the in-process runs see them too
        monkeypatch.setenv(key, env[key])
    return root, env, stub, tmp_path / "sweep"


def sweep(env, *args, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [QUANTPATCH, "sweep", *map(str, args)], env=env, capture_output=True, text=True, **kw
    )


def record(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep.json").read_text())


def calls(stub: Path) -> list[list[str]]:
    path = stub / "calls"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


SELECT = (
    "--models", "llama32-1b", "--datasets", "wikipedia", "--profile", "smoke",
    "--schemes", "bf16,FA_mxfp8,linear_mxfp4",
)  # fmt: skip


@pytest.mark.slow
def test_a_local_queue_two_at_once_on_their_own_gpus_then_the_report(sweep_env, run, monkeypatch):
    root, _env, stub, out = sweep_env
    monkeypatch.setenv("STUB_SLEEP", "1")
    monkeypatch.setenv("STUB_FAIL", "linear-mxfp4")
    monkeypatch.setenv("STUB_NAN", "qk-mxfp8")  # FA_mxfp8 trains on through a NaN loss
    res = run("sweep", "run", out, *SELECT, "--parallel", "2", "--gpus", "0,1", "--repo", root,
              "--", "--eval-iters", "0")  # fmt: skip
    assert res.code == 1, res  # one run failed: not every run finished
    assert "sweep " in res.out and "2 of 3 finished, 1 failed" in res.out
    assert "; 1 run went NaN (status nan in its runs table)" in res.out  # exit 0, yet NaN
    assert "[1/3 finished, 0 failed, 2 running, 0 pending]" in res.err
    rec = record(out)
    assert rec["version"] == 2 and rec["launcher"] == "local"
    assert rec["checkout"] == str(root) and rec["selection"]["extra"] == ["--eval-iters", "0"]
    runs = {r["scheme"]: r for r in rec["runs"]}
    assert {s: r["state"] for s, r in runs.items()} == {
        "bf16": "finished",
        "FA_mxfp8": "finished",
        "linear_mxfp4": "failed",
    }
    assert runs["linear_mxfp4"]["exit_code"] == 3
    for r in rec["runs"]:
        assert r["name"] == f"llama32-1b_wikipedia_{r['scheme']}_smoke"
        assert r["gpus"] in ("0", "1") and r["started"] and r["ended"]
    for s in ("bf16", "FA_mxfp8"):
        log = out / runs[s]["log"]  # the sweep folder's
        assert log.is_file() and log.is_relative_to(out / "runs")
        assert f"source commit {runs[s]['commit']}" in log.read_text()
        assert "--eval-iters 0" in log.read_text()  # the extra arguments reached the run
    # two at once, never three, each on its own GPU
    starts = [c for c in calls(stub) if c[-1] == "start"]
    assert len(starts) == 3 and {c[2] for c in starts[:2]} == {"0", "1"}
    assert (out / "report.html").is_file()
    parsed = json.loads(
        subprocess.run(
            [QUANTPATCH, "runs", "--json", str(out / "runs")], capture_output=True, text=True
        ).stdout
    )["runs"]
    assert {r["scheme"]: r["status"] for r in parsed}["FA_mxfp8"] == "nan"
    assert sorted((r["scheme"], r["iterations"]) for r in parsed) == [
        ("FA_mxfp8", 4),
        ("bf16", 4),
        ("linear_mxfp4", 0),
    ]
    html = (out / "report.html").read_text()
    assert "FA_mxfp8" in html and "bf16" in html
    # resume with no options: the failed run again (it passes now), finished ones kept
    monkeypatch.delenv("STUB_FAIL")
    res = run("sweep", "run", out, "--repo", root)
    assert res.code == 0, res
    assert "3 of 3 finished, 0 failed" in res.out
    assert len([c for c in calls(stub) if c[-1] == "start"]) == 4
    # status: the table, counts and JSON
    res = run("sweep", "status", out, "--json")
    data = json.loads(res.out)
    assert data["counts"]["finished"] == 3 and len(data["runs"]) == 3
    res = run("sweep", "status", out, "--watch")  # nothing left to wait for: one table
    assert res.code == 0 and "3 runs: 3 finished" in res.out
    assert "llama32-1b_wikipedia_FA_mxfp8_smoke" in res.out
    res = run("sweep", "report", out, "--out", out / "again.html")
    assert res.code == 0 and (out / "again.html").is_file()
    assert "; 1 run went NaN" in res.out


@pytest.mark.slow
def test_a_moved_scheme_branch_runs_again_and_only_pending_keeps_failures(
    sweep_env, run, monkeypatch
):
    root, _env, stub, out = sweep_env
    monkeypatch.setenv("STUB_FAIL", "linear-mxfp4")
    res = run("sweep", "run", out, *SELECT, "--repo", root)
    monkeypatch.delenv("STUB_FAIL")
    assert res.code == 1
    # --only-pending: the failed run is kept as it is, nothing runs
    res = run("sweep", "run", out, "--only-pending", "--repo", root)
    assert res.code == 1 and len([c for c in calls(stub) if c[-1] == "start"]) == 3
    # the base moves on: every finished run's scheme branch moves with it
    (root / "NOTES.md").write_text("a note\n")
    subprocess.run(["git", "-C", str(root), "add", "NOTES.md"], check=True)
    subprocess.run(["git", "-C", str(root), "commit", "-qm", "notes"], check=True)
    res = run("sweep", "run", out, "--repo", root)
    assert res.code == 0, res
    assert "llama32-1b_wikipedia_bf16_smoke: running it again, its scheme branch moved" in (
        " ".join(res.err.split())
    )
    assert len([c for c in calls(stub) if c[-1] == "start"]) == 6


@pytest.mark.slow
def test_resume_names_the_runs_an_upgrade_changed(sweep_env, run, make_checkout):
    """A sweep finished on a checkout of the previous release (on stock attention: its
    runtime has no bf16 flash route); after ``quantpatch upgrade`` the resume runs every run
    again, naming the upgrade as why its source changed."""
    from .oldrelease import make_old_release

    _root, _env, stub, out = sweep_env
    root = make_checkout(inject=False)
    assert run("init", "--repo", root).code == 0
    make_old_release(root)
    res = run("sweep", "run", out, *SELECT, "--attention", "stock", "--repo", root)
    assert res.code == 0, res
    assert run("upgrade", "--repo", root).code == 0
    res = run("sweep", "run", out, "--repo", root)
    assert res.code == 0, res
    said = " ".join(res.err.split())
    for scheme in ("bf16", "FA_mxfp8", "linear_mxfp4"):
        assert f"llama32-1b_wikipedia_{scheme}_smoke: running it again" in said
    assert said.count("its source changed with 'quantpatch upgrade' at") == 3, said
    assert len([c for c in calls(stub) if c[-1] == "start"]) == 6


def _state(out: Path) -> list[str]:
    try:
        return [r["state"] for r in record(out)["runs"]]
    except (FileNotFoundError, ValueError):
        return []


def _gone(pgid: int) -> None:
    """Until every process of the run's group has exited: each pass waits on the pidfds of
    the members there are (no polling); a script that goes on starts new ones meanwhile, so
    the group is listed again until none runs."""
    while group_alive(pgid):
        wait_exited(group_members(pgid))


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_readable_record_and_resumes(sweep_env, tmp_path):
    """The sweep is held at its ``run started`` barrier (``faults.pause``: the record says
    running, the run's process is started) and killed there; no moment is waited for."""
    root, env, stub, out = sweep_env
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    held = {**env, "QUANTPATCH_FAULT_PAUSE": str(gate), "QUANTPATCH_FAULT_PAUSE_AT": "run started"}
    started = Pipe(stub / "started")
    # the run started first hangs until the test kills it (no other starts meanwhile)
    first = {**held, "STUB_HANG": "quantpatch"}
    proc = subprocess.Popen(
        [QUANTPATCH, "sweep", "run", str(out), *SELECT, "--repo", str(root)],
        env=first,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert paused(gate).endswith("run started")
    assert started.line().endswith("start")  # and its torchrun runs
    proc.kill()  # SIGKILL: the sweep dies, its run (its own process group) lives on
    proc.wait()
    rec = record(out)  # readable
    running = [r for r in rec["runs"] if r["state"] == "running"]
    assert len(running) == 1
    res = sweep(env, "run", out, "--repo", root)
    assert res.returncode == 2 and "is still running (process group" in res.stderr
    os.killpg(running[0]["pid"], signal.SIGKILL)
    _gone(running[0]["pid"])
    # killed again, after the first run finished: released at each start until one has
    proc = subprocess.Popen(
        [QUANTPATCH, "sweep", "run", str(out), "--repo", str(root)],
        env=held,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while True:
        assert paused(gate).endswith("run started")
        if "finished" in _state(out):
            break
        assert proc.poll() is None, "the sweep ended before a second run started"
        release(gate)
    assert "running" in _state(out)
    proc.kill()
    proc.wait()
    assert "finished" in _state(out)
    for r in record(out)["runs"]:
        if r["state"] == "running":
            _gone(r["pid"])
    started.close()
    res = sweep({**env, "STUB_SLEEP": "0"}, "run", out, "--repo", root)
    assert res.returncode == 0, res.stderr
    assert _state(out) == ["finished"] * 3


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_every_child(sweep_env, sig):
    """Signalled once both runs' torchrun have started (a barrier each: their start line
    through a named pipe) and hang: the sweep stops both at once. It never waits for them:
    they would hang for 600 s, and the guard on its exit is 120 s."""
    root, env, stub, out = sweep_env
    started = Pipe(stub / "started")
    proc = subprocess.Popen(
        [QUANTPATCH, "sweep", "run", str(out), *SELECT, "--parallel", "2", "--gpus", "0,1",
         "--repo", str(root)],
        env={**env, "STUB_HANG": "quantpatch"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert started.line().endswith("start") and started.line().endswith("start")
    finally:
        started.close()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "run(s) interrupted" in err and "resumes" in err
    states = _state(out)
    assert states.count("interrupted") == 2 and states.count("pending") == 1
    for pid in {c[0] for c in calls(stub)}:  # every stub torchrun is gone
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert len([c for c in calls(stub) if c[-1] == "term"]) == 2


def test_slurm_submission_and_status_where_accounting_is_off(sweep_env, run):
    root, _env, stub, out = sweep_env
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    assert "submitted 3 runs as Slurm job array 4242" in res.out
    args = (stub / "sbatch.args").read_text().splitlines()
    assert args[0] == "--parsable" and args[1] == f"--chdir={root}"
    assert args[2] == f"--output={(out / 'slurm').resolve()}/%A_%a.out"
    assert args[3] == "--array=0,1,2%8"
    assert args[-1] == str((out / "sweep.sbatch").resolve())
    rec = record(out)
    assert rec["slurm_job"] == "4242" and rec["launcher"] == "slurm"
    assert [(r["state"], r["slurm_job"], r["array_task"]) for r in rec["runs"]] == [
        ("submitted", "4242", 0),
        ("submitted", "4242", 1),
        ("submitted", "4242", 2),
    ]
    res = run("sweep", "status", out, "--json")
    data = json.loads(res.out)
    assert [(r["state"], r.get("slurm_state")) for r in data["runs"]] == [
        ("finished", "COMPLETED"),  # scontrol show job
        ("running", "RUNNING"),  # squeue
        ("pending", "PENDING"),
    ]
    first = data["runs"][0]
    assert first["exit_code"] == 0 and first["reason"] is None
    assert first["started"].startswith("2026-11-27T") and first["ended"] > first["started"]
    assert data["counts"]["finished"] == 1 and data["counts"]["running"] == 1
    assert record(out)["runs"][0]["state"] == "finished"  # status refreshed the record
    # again with the same selection: every run is Slurm's or finished, nothing is submitted
    (stub / "sbatch.args").unlink()
    res = run("sweep", "run", out, "--launcher", "slurm", "--repo", root)
    assert res.code == 0 and "nothing to submit" in res.out, res
    assert not (stub / "sbatch.args").exists()
    # a different selection while the array runs: refused, the record as it was
    before = (out / "sweep.json").read_text()
    res = run("sweep", "run", out, "--schemes", "bf16", "--repo", root)
    assert res.code == 2 and "pending or running in Slurm" in " ".join(res.err.split()), res
    assert (out / "sweep.json").read_text() == before
    res = run("sweep", "status", out)
    assert res.code == 0 and "pending (PENDING)" in res.out


@pytest.mark.slow
def test_a_failed_slurm_run_is_resubmitted_alone_unless_only_pending(sweep_env, run, monkeypatch):
    root, _env, stub, out = sweep_env
    monkeypatch.setenv("STUB_TASK0", "FAILED")
    monkeypatch.setenv("STUB_TASK0_EXIT", "3:0")
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    res = run("sweep", "run", out, "--only-pending", "--repo", root)
    assert res.code == 0, res
    assert (
        "nothing to submit: of 3 runs 0 finished, 2 still pending or running in Slurm, 1 "
        "failed (kept by --only-pending)."
    ) in " ".join(res.out.split())
    first = record(out)["runs"][0]
    assert (first["state"], first["exit_code"], first["reason"]) == ("failed", 3, "FAILED")
    res = run("sweep", "run", out, "--repo", root)
    assert res.code == 0 and "submitted 1 runs as Slurm job array 4242" in res.out, res
    assert "--array=0%8" in (stub / "sbatch.args").read_text().splitlines()
    assert [r["state"] for r in record(out)["runs"]] == ["submitted", "running", "pending"]


@pytest.mark.slow
def test_slurm_refusals_say_what_to_change(sweep_env, run, monkeypatch, tmp_path):
    root, _env, _stub, out = sweep_env
    monkeypatch.setenv("STUB_SBATCH_REFUSES", "Invalid generic resource (gres) specification")
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    said = " ".join(res.err.split())
    assert res.code == 2, res
    assert (
        "sbatch refused the sweep: Batch job submission failed: Invalid generic resource (gres) "
        "specification (the scripts ask for --gpus-per-node=N: gpu_request in the [slurm] table "
        "of --config changes that, to gpus-per-node, gres, or none for a CPU partition)."
    ) in said
    assert not (out / "sweep.json").exists()  # no record of a sweep sbatch did not take
    # gpu_request = "gres": the scripts ask with --gres
    cfg = tmp_path / "cluster.toml"
    cfg.write_text('[slurm]\ngpu_request = "gres"\n')
    monkeypatch.delenv("STUB_SBATCH_REFUSES")
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--config", cfg, "--repo", root)
    assert res.code == 0, res
    text = (out / "sweep.sbatch").read_text()
    assert "#SBATCH --gres=gpu:1" in text and "--gpus-per-node" not in text
    cfg.write_text('[slurm]\ngpu_request = "all"\n')
    res = run("sweep", "run", tmp_path / "other", *SELECT, "--launcher", "slurm", "--config", cfg,
              "--repo", root)  # fmt: skip
    assert res.code == 2 and "slurm.gpu_request must be one of gpus-per-node, gres, none" in res.err
    # no sbatch on PATH: refused before anything is written
    only_git = tmp_path / "only-git"
    only_git.mkdir()
    (only_git / "git").symlink_to(shutil.which("git"))
    monkeypatch.setenv("PATH", str(only_git))
    res = run("sweep", "run", tmp_path / "third", *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 2 and "sbatch is not on PATH" in res.err, res
    assert not (tmp_path / "third").exists()


@pytest.mark.slow
def test_refusals_change_nothing(sweep_env, tmp_path, run, monkeypatch):
    root, _env, _stub, out = sweep_env
    for args, says in (
        (("--gpus", "0,x"), "--gpus must be GPU indices"),
        (("--gpus", "0,0"), "--gpus names a GPU twice"),
        (("--parallel", "0"), "--parallel must be from 1 to 64"),
        (("--launcher", "pbs"), "unknown launcher 'pbs'"),
    ):
        res = run("sweep", "run", out, *SELECT, *args, "--repo", root)
        assert res.code == 2 and says in res.err, (args, res)
    assert not out.exists()
    res = run("sweep", "status", tmp_path / "nowhere")
    assert res.code == 2 and "not a sweep" in res.err
    res = run("sweep", "report", tmp_path / "nowhere")
    assert res.code == 2 and "not a sweep" in res.err
    out.mkdir()
    for text in ("{not json", '{"version": 7, "runs": []}'):
        (out / "sweep.json").write_text(text)
        res = run("sweep", "run", out, "--repo", root)
        assert res.code == 2 and "is not a" in res.err and "sweep record" in res.err, res
        assert (out / "sweep.json").read_text() == text
    # a sweep that needs more GPUs per run than there are
    (out / "sweep.json").unlink()
    res = run("sweep", "run", out, *SELECT, "--gpus", "0", "--repo", root)
    assert res.code == 0, res  # the smoke profile: one GPU a run
    monkeypatch.setenv("MOCK_DATA", "1")  # the fast profile's data is checked first
    res = run("sweep", "run", out, "--profile", "fast", "--gpus", "0,1", "--repo", root)
    assert res.code == 2 and "each run needs 8 GPUs" in " ".join(res.err.split())
    monkeypatch.delenv("MOCK_DATA")
    # a report before any run wrote a log
    fresh = tmp_path / "fresh"
    res = run("sweep", "run", fresh, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0
    res = run("sweep", "report", fresh)
    assert res.code == 2 and "no run of the sweep has written a log yet" in res.err


def test_slurm_states_map_to_quantpatch_states_and_the_output_speaks_last(tmp_path, monkeypatch):
    from quantpatch.launch import slurm

    for said, state in (
        ("COMPLETED", "finished"),
        ("FAILED", "failed"),
        ("NODE_FAIL", "failed"),
        ("OUT_OF_MEMORY", "failed"),
        ("TIMEOUT", "failed"),
        ("CANCELLED by 0", "interrupted"),
        ("PREEMPTED", "interrupted"),
        ("PENDING", "pending"),
        ("REQUEUED", "pending"),
        ("RUNNING", "running"),
    ):
        assert slurm.state_of(said) == state, said
    # no Slurm command answers (accounting off, the job long forgotten): the task's output
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    (tmp_path / "slurm").mkdir()
    slurm.output_file(tmp_path, "77", 1).write_text(
        "[quantpatch] source commit " + "a" * 40 + " in /wt\n"
        "[quantpatch] training exited with status 3\n"
    )
    rec = SweepRecord.from_dict(
        {
            "checkout": "/c",
            "launcher": "slurm",
            "selection": {},
            "runs": [
                {"name": n, "script": f"{n}.sh", "state": "submitted", "slurm_job": "77",
                 "array_task": i}
                for i, n in enumerate("ab")
            ],
        }
    )  # fmt: skip
    assert slurm.refresh(tmp_path, rec)
    unknown, failed = rec.runs
    assert unknown.state is RunState.SUBMITTED  # nothing says how it stands: left as it was
    assert (failed.state, failed.exit_code, failed.reason) == (RunState.FAILED, 3, "FAILED")
    assert failed.commit == "a" * 40 and failed.ended
    assert failed.as_dict()["state"] == "failed"
    assert not slurm.refresh(tmp_path, rec)  # nothing new


@pytest.mark.slow
def test_a_sweep_over_missing_data_starts_and_submits_nothing(
    sweep_env, tmp_path, run, monkeypatch
):
    """Every combination's dataset, resolved as the scripts resolve it (DATA_ROOT,
    DATA_PREFIX, TOKENIZER_MODEL, MOCK_DATA), is checked before anything is written, started
    or submitted; the refusal names every missing dataset."""
    root, _env, stub, out = sweep_env
    data = tmp_path / "data"
    monkeypatch.setenv("DATA_ROOT", str(data))
    select = ("--models", "llama32-1b,llama31-8b", "--datasets", "wikipedia,dolma",
              "--profile", "fast", "--schemes", "bf16")  # fmt: skip
    made = data / "dolma" / "llama31-8b_text_document"
    made.parent.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        Path(f"{made}{suffix}").write_bytes(b"")
    for launcher in ("local", "slurm"):
        res = run("sweep", "run", out, *select, "--launcher", launcher, "--repo", root)
        said = " ".join(res.err.split())
        assert res.code == 2 and "the sweep's data is not ready" in said, res
        for model in ("llama32-1b", "llama31-8b"):
            for dataset in ("wikipedia", "dolma"):
                prefix = data / dataset / f"{model}_text_document"
                assert (f"{prefix}.bin" in said) == (prefix != made), (prefix, said)
        assert "quantpatch data prepare wikipedia --input CORPUS --models llama31-8b" in said
        assert not out.exists() and not calls(stub) and not (stub / "sbatch.args").exists()
    # DATA_PREFIX names one dataset for every run, as in the scripts; a TOKENIZER_MODEL path
    # that does not exist is refused too
    monkeypatch.setenv("DATA_PREFIX", str(made))
    monkeypatch.setenv("TOKENIZER_MODEL", str(tmp_path / "no-tokenizer"))
    res = run("sweep", "run", out, *select, "--repo", root)
    assert res.code == 2 and "is neither a folder nor a Hugging Face model name" in res.err
    assert not out.exists()
    # a manifest that names another tokenizer than the one the scripts pass
    monkeypatch.delenv("TOKENIZER_MODEL")
    (made.parent / f"{made.name}.json").write_text(json.dumps({"tokenizer": {"name": "gpt2"}}))
    res = run("sweep", "run", out, *select, "--launcher", "slurm", "--repo", root)
    said = " ".join(res.err.split())
    assert res.code == 2 and "was tokenized with gpt2, not with meta-llama/Llama-3.2-1B" in said
    assert not out.exists()


SINFO = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$STUB_DIR/sinfo.args"
printf '%s\n' "${STUB_SINFO:-1 gpu:2 8 64000}"
"""
SCONTROL_PARTITION = r"""#!/usr/bin/env bash
if [[ "$1 $2" == "show partition" ]]; then
    echo "PartitionName=debug AllowGroups=ALL Default=YES MaxNodes=UNLIMITED State=UP"
    exit 0
fi
echo "JobId=4243 ArrayJobId=4242 ArrayTaskId=0 JobState=COMPLETED Reason=None \
ExitCode=0:0 StartTime=2026-11-27T10:00:00 EndTime=2026-11-27T10:05:00"
"""


def test_a_slurm_sweep_is_checked_against_the_nodes_gpus(sweep_env, run, monkeypatch, tmp_path):
    """The fast profile asks for 8 GPUs a node; on a partition whose node
    declares 2 (`gres/gpu`), `sweep run` refuses before writing or submitting anything with
    one sentence naming the node's GPUs and `--gpus-per-node 2`; with it the sweep is
    submitted asking for 2, a resume keeps it, and sbatch's own node-configuration refusal
    gets the same hint."""

    root, _env, stub, out = sweep_env
    bin_dir = tmp_path / "bin"
    for name, text in (("sinfo", SINFO), ("scontrol", SCONTROL_PARTITION)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    data = tmp_path / "data"
    empty_wikipedia(data)
    monkeypatch.setenv("DATA_ROOT", str(data))
    select = ("--models", "llama32-1b", "--datasets", "wikipedia", "--schemes", "bf16",
              "--profile", "fast", "--launcher", "slurm", "--repo", root)  # fmt: skip
    res = run("sweep", "run", out, *select)
    said = " ".join(res.err.split())
    assert res.code == 2, res
    assert said == (
        "error: the fast profile asks Slurm for 1 node(s) with 8 GPU(s) each, but partition "
        "debug has 1 node with gpu:2: give --gpus-per-node 2 to sweep run or gen-scripts (or "
        "gpus_per_node = 2 in the [profiles.fast] table of a --config)."
    )
    assert (stub / "sinfo.args").read_text().split() == ["-h", "-p", "debug", "-o", "%D", "%G",
                                                         "%c", "%m"]  # fmt: skip
    assert not out.exists() and not (stub / "sbatch.args").exists()
    # gen-scripts writes the scripts and warns with the same sentence
    res = run("gen-scripts", "--out", tmp_path / "scripts", "--launcher", "slurm",
              *select[:6], "--profile", "fast", "--repo", root)  # fmt: skip
    assert res.code == 0 and "give --gpus-per-node 2" in " ".join(res.err.split()), res
    res = run("sweep", "run", out, *select, "--gpus-per-node", "2")
    assert res.code == 0, res
    assert "#SBATCH --gpus-per-node=2" in (out / "sweep.sbatch").read_text()
    rec = record(out)
    assert rec["selection"]["gpus_per_node"] == 2
    assert rec["layout"] == {"gpus_per_node": 2, "nodes": 1}
    # sbatch's own refusal (a node that declares GPUs sinfo does not show this way)
    monkeypatch.setenv("STUB_SINFO", "1 gpu:8 32 64000")  # 24 CPUs for 8 ranks: there
    monkeypatch.setenv("STUB_SBATCH_REFUSES", "Requested node configuration is not available")
    other = tmp_path / "other"
    res = run("sweep", "run", other, *select)
    said = " ".join(res.err.split())
    assert res.code == 2, res
    assert (
        "sbatch refused the sweep: Batch job submission failed: Requested node configuration "
        "is not available (the scripts ask for 1 node(s) with 8 GPU(s) each and 24 CPUs for "
        "each node's task; partition debug has 1 node with gpu:8, which sinfo says fits: ask "
        "for one CPU per rank, cpus_per_task = 8 in the [slurm] table of a --config, since "
        "Slurm often gives each CPU its share of a node's memory)."
    ) in said
    assert not (other / "sweep.json").exists()


def test_your_own_tokenizer_names_every_fix_and_a_resume_remembers_it(
    sweep_env, run, monkeypatch, tmp_path
):
    """Data made with a local tokenizer (`data prepare ... --tokenizer
    llama32-1b=./tok`) is refused naming every fix (TOKENIZER_MODEL, a [models.M]
    tokenizer_model override, preparing again); `data status` exits 1 on the mismatch; the
    sweep records the data root, prefixes and tokenizer it checked, and a resume from a new
    shell (neither variable exported) uses them, a relative tokenizer folder made absolute."""
    from quantpatch.data_prep.layout import files_hash

    root, _env, stub, out = sweep_env
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "mine"}')
    data = tmp_path / "data"
    prefix = empty_wikipedia(data)
    Path(f"{prefix}.json").write_text(
        json.dumps(
            {  # the fields data prepare writes (a manifest without them is malformed)
                "documents": 0,
                "tokens": 0,
                "tokenizer": {"name": "./tok", "hash": files_hash(tok)},
                "files": {"bin": 0, "idx": 0},
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATA_ROOT", str(data))
    monkeypatch.delenv("TOKENIZER_MODEL", raising=False)
    select = ("--models", "llama32-1b", "--datasets", "wikipedia", "--schemes", "bf16",
              "--profile", "fast", "--gpus-per-node", "2", "--launcher", "slurm",
              "--repo", root)  # fmt: skip
    res = run("sweep", "run", out, *select)
    said = " ".join(res.err.split())
    assert res.code == 2, res
    assert "was tokenized with ./tok, not with meta-llama/Llama-3.2-1B" in said
    assert f"export TOKENIZER_MODEL={tok} (the tokenizer it was made with)" in said
    assert f'tokenizer_model = "{tok}" in the [models.llama32-1b] table of a --config' in said
    assert "quantpatch data prepare wikipedia --input CORPUS --models llama32-1b" in said
    assert not out.exists()
    res = run("data", "status", "--models", "llama32-1b", "--datasets", "wikipedia")
    assert res.code == 1 and "MISMATCH" in res.out, res
    # the fix the sentence names, with the folder as the user wrote it
    monkeypatch.setenv("TOKENIZER_MODEL", "./tok")
    res = run("data", "status", "--models", "llama32-1b", "--datasets", "wikipedia")
    assert res.code == 0 and "(matches)" in res.out, res
    monkeypatch.setenv("STUB_TASK0", "FAILED")
    res = run("sweep", "run", out, *select)
    assert res.code == 0, res
    assert (stub / "sbatch.data").read_text().split() == [str(data), str(tok)]
    rec = record(out)
    assert rec["data"]["env"] == {"DATA_ROOT": str(data), "TOKENIZER_MODEL": str(tok)}
    checked = [{k: v for k, v in c.items() if k != "manifest"} for c in rec["data"]["checked"]]
    assert checked == [
        {
            "model": "llama32-1b",
            "dataset": "wikipedia",
            "prefix": str(prefix),
            "tokenizer": str(tok),
        }
    ]
    assert rec["data"]["checked"][0]["manifest"]["made_with"] == "./tok"  # for the report
    # a new shell: nothing exported, the resume uses what the sweep recorded
    monkeypatch.delenv("TOKENIZER_MODEL")
    monkeypatch.delenv("DATA_ROOT")
    monkeypatch.chdir(root)
    (stub / "sbatch.data").unlink()
    res = run("sweep", "run", out, "--repo", root)
    assert res.code == 0 and "submitted 1 runs" in res.out, res
    assert (stub / "sbatch.data").read_text().split() == [str(data), str(tok)]


SQUEUE_WITH_START = r"""#!/usr/bin/env bash
echo "4242_0|COMPLETING|4243|2026-11-27T09:58:00"
echo "4242_1|RUNNING|4244|2026-11-27T10:00:00"
echo "4242_2|PENDING|4245|N/A"
"""


def test_the_first_status_of_a_slurm_sweep_has_gpus_and_start(sweep_env, run, tmp_path):
    """`sweep status` of a Slurm sweep fills the gpus column (the
    allocation the scripts ask for) and `started` on the first status of a running task
    (squeue's %S), never a start for a pending one."""
    from quantpatch.launch.slurm import parse_squeue

    root, _env, _stub, out = sweep_env
    (tmp_path / "bin" / "squeue").write_text(SQUEUE_WITH_START)
    (tmp_path / "bin" / "scontrol").write_text("#!/usr/bin/env bash\nexit 1\n")
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    res = run("sweep", "status", out, "--json")
    runs = json.loads(res.out)["runs"]
    assert [(r["state"], r["gpus"]) for r in runs] == [
        ("running", "1 GPU"),
        ("running", "1 GPU"),
        ("pending", "1 GPU"),
    ]
    assert runs[1]["started"].startswith("2026-11-27T")  # in UTC: the hour is the zone's
    assert runs[2]["started"] is None
    res = run("sweep", "status", out)
    assert res.code == 0 and "1 GPU" in res.out
    found = parse_squeue("4242_3|RUNNING|99|2026-11-27T10:00:00\n4242_4|PENDING|98|N/A\nbad\n")
    assert found[("4242", 3)].start is not None and found[("4242", 4)].start is None
    assert found[("4242", 3)].job_id == "99" and len(found) == 2


@pytest.mark.slow
def test_the_attention_choice_is_recorded_kept_on_resume_and_a_new_one_reruns(sweep_env, run):
    """--attention is recorded; a resume keeps it (the scripts export it again);
    another choice runs every finished run again, so no report compares two kernels; the
    report shows each run's path from its log and from the record."""
    root, _env, stub, out = sweep_env
    select = (*SELECT[:-1], "bf16,FA_mxfp8")
    res = run("sweep", "run", out, *select, "--attention", "stock", "--repo", root)
    assert res.code == 0, res
    rec = record(out)
    assert rec["selection"]["attention"] == "stock"
    assert rec["attention"] == {"choice": "stock", "path": "stock", "why": "--attention stock"}
    assert [r["attention"] for r in rec["runs"]] == ["stock", "stock"]
    for r in rec["runs"]:
        assert (
            "attention: QUANTPATCH_FLASH=0 QUANTPATCH_FLASH_BF16=0" in (out / r["log"]).read_text()
        )
    html = (out / "report.html").read_text()
    assert html.count(">stock (asked)<") == 2 and html.count(">stock (sweep: stock)<") == 2

    res = run("sweep", "run", out, "--repo", root)  # resume: the choice kept, nothing to run
    assert res.code == 0, res
    assert record(out)["selection"]["attention"] == "stock"
    assert len([c for c in calls(stub) if c[-1] == "start"]) == 2
    bf16 = (out / "llama32-1b/pretrain_llama32-1b_wikipedia_bf16.sh").read_text()
    assert 'then QUANTPATCH_FLASH=0; fi\nif [[ -z "${QUANTPATCH_FLASH_BF16:-}" ]]; then' in bf16

    res = run("sweep", "run", out, "--attention", "auto", "--repo", root)
    assert res.code == 0, res
    said = " ".join(res.err.split())
    for scheme in ("bf16", "FA_mxfp8"):
        assert (
            f"llama32-1b_wikipedia_{scheme}_smoke: running it again, its attention path is flash "
            "now (--attention auto), it ran on stock"
        ) in said
    assert len([c for c in calls(stub) if c[-1] == "start"]) == 4
    rec = record(out)
    assert rec["attention"]["path"] == "flash" and rec["selection"]["attention"] == "auto"
    for r in rec["runs"]:
        assert r["attention"] == "flash"
        assert (
            "attention: QUANTPATCH_FLASH=auto QUANTPATCH_FLASH_BF16=1"
            in (out / r["log"]).read_text()
        )
