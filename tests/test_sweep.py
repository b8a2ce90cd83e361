"""``quantpatch sweep``: a local queue, GPU slices, failures, resume after SIGKILL, Ctrl-C, and
Slurm submission and status, with stub ``torchrun`` / ``sbatch`` / ``squeue`` / ``sacct`` that
print core_v0.13.1's log lines and can fail, hang or be killed on request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from quantpatch.launch.sweep import group_alive

from .test_scripts import QUANTPATCH

pytestmark = pytest.mark.slow

# the scheme comes from the worktree's name (quantpatch__linear-X_qk-Y_pv-Z)
TORCHRUN = r"""#!/usr/bin/env bash
set -u
echo "$$ $(basename "$PWD") ${CUDA_VISIBLE_DEVICES:-none} $(date +%s.%N) start" >> "$STUB_DIR/calls"
trap 'echo "$$ term" >> "$STUB_DIR/calls"; exit 143' TERM
if [[ -n "${STUB_FAIL:-}" && "$PWD" == *"$STUB_FAIL"* ]]; then
    echo "Traceback: stub failure" >&2
    exit 3
fi
LINE=' [2026-11-22 11:25:3%d] iteration %9d/%8d | consumed samples: %12d | '
LINE+='elapsed time per iteration (ms): 96.9 | learning rate: 6.666667E-05 | '
LINE+='global batch size: %5d | lm loss: %.6E | loss scale: 1.0 | grad norm: 2.105 | '
LINE+='number of skipped iterations: %3d | number of nan iterations: %3d |\n'
for i in 1 2 3 4; do
    # shellcheck disable=SC2059
    printf "$LINE" "$i" "$i" 4 "$((2 * i))" 2 "$((10 - i))" 0 0
done
sleep "${STUB_SLEEP:-0}" & wait $!
echo "$$ $(date +%s.%N) end" >> "$STUB_DIR/calls"
"""
SBATCH = r"""#!/usr/bin/env bash
printf '%s\n' "$@" > "$STUB_DIR/sbatch.args"
echo "4242"
"""
SQUEUE = r"""#!/usr/bin/env bash
echo "4242_1|RUNNING"
echo "4242_2|PENDING"
"""
SACCT = r"""#!/usr/bin/env bash
echo "4242_0|COMPLETED"
echo "4242_1|RUNNING"
echo "4242_3|FAILED"
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


def test_a_local_queue_two_at_once_on_their_own_gpus_then_the_report(sweep_env, run, monkeypatch):
    root, _env, stub, out = sweep_env
    monkeypatch.setenv("STUB_SLEEP", "1")
    monkeypatch.setenv("STUB_FAIL", "linear-mxfp4")
    res = run("sweep", "run", out, *SELECT, "--parallel", "2", "--gpus", "0,1", "--repo", root,
              "--", "--eval-iters", "0")  # fmt: skip
    assert res.code == 1, res  # one run failed: not every run finished
    assert "sweep " in res.out and "2 of 3 finished, 1 failed" in res.out
    assert "[1/3 finished, 0 failed, 2 running, 0 pending]" in res.err
    rec = record(out)
    assert rec["version"] == 1 and rec["launcher"] == "local"
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
        log = Path(runs[s]["log"])
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


def _wait_for(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("timed out")


def _state(out: Path) -> list[str]:
    try:
        return [r["state"] for r in record(out)["runs"]]
    except (FileNotFoundError, ValueError):
        return []


def test_sigkill_at_any_moment_leaves_a_readable_record_and_resumes(sweep_env):
    root, env, _, out = sweep_env
    env = {**env, "STUB_SLEEP": "3"}
    proc = subprocess.Popen(
        [QUANTPATCH, "sweep", "run", str(out), *SELECT, "--repo", str(root)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(lambda: "running" in _state(out))
    proc.kill()  # SIGKILL: the sweep dies, its run (its own process group) lives on
    proc.wait()
    rec = record(out)  # readable
    running = [r for r in rec["runs"] if r["state"] == "running"]
    assert len(running) == 1
    res = sweep(env, "run", out, "--repo", root)
    assert res.returncode == 2 and "is still running (process group" in res.stderr
    os.killpg(running[0]["pid"], signal.SIGKILL)
    _wait_for(lambda: not group_alive(running[0]["pid"]))
    # killed again, after the first run finished
    proc = subprocess.Popen(
        [QUANTPATCH, "sweep", "run", str(out), "--repo", str(root)],
        env={**env, "STUB_SLEEP": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(lambda: "finished" in _state(out) and "running" in _state(out))
    proc.kill()
    proc.wait()
    assert "finished" in _state(out)
    for r in record(out)["runs"]:
        if r["state"] == "running":
            _wait_for(lambda r=r: not group_alive(r["pid"]))
    res = sweep({**env, "STUB_SLEEP": "0"}, "run", out, "--repo", root)
    assert res.returncode == 0, res.stderr
    assert _state(out) == ["finished"] * 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_every_child(sweep_env, sig):
    root, env, stub, out = sweep_env
    proc = subprocess.Popen(
        [QUANTPATCH, "sweep", "run", str(out), *SELECT, "--parallel", "2", "--gpus", "0,1",
         "--repo", str(root)],
        env={**env, "STUB_SLEEP": "60"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    _wait_for(lambda: len([c for c in calls(stub) if c[-1] == "start"]) == 2)
    start = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert time.monotonic() - start < 15
    assert "run(s) interrupted" in err and "resumes" in err
    states = _state(out)
    assert states.count("interrupted") == 2 and states.count("pending") == 1
    for pid in {c[0] for c in calls(stub)}:  # every stub torchrun is gone
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert len([c for c in calls(stub) if c[-1] == "term"]) == 2


def test_slurm_submission_and_status(sweep_env, run):
    root, _env, stub, out = sweep_env
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    assert "submitted 3 runs as Slurm job array 4242" in res.out
    args = (stub / "sbatch.args").read_text().splitlines()
    assert args[0] == "--parsable" and args[1] == f"--chdir={root}"
    assert args[-1] == str((out / "sweep.sbatch").resolve())
    rec = record(out)
    assert rec["slurm_job"] == "4242" and rec["launcher"] == "slurm"
    assert [(r["state"], r["array_task"]) for r in rec["runs"]] == [
        ("submitted", 0),
        ("submitted", 1),
        ("submitted", 2),
    ]
    res = run("sweep", "status", out, "--json")
    data = json.loads(res.out)
    assert [(r["state"], r.get("slurm_state")) for r in data["runs"]] == [
        ("finished", "COMPLETED"),
        ("running", "RUNNING"),
        ("submitted", "PENDING"),
    ]
    assert data["counts"]["finished"] == 1 and data["counts"]["running"] == 1
    # the submitted sweep is not submitted twice
    res = run("sweep", "run", out, "--launcher", "slurm", "--repo", root)
    assert res.code == 2 and "was submitted as Slurm job 4242" in " ".join(res.err.split())
    res = run("sweep", "status", out)
    assert res.code == 0 and "submitted (PENDING)" in res.out


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


def test_a_sweep_over_missing_data_starts_and_submits_nothing(
    sweep_env, tmp_path, run, monkeypatch
):
    """Issue 37: every combination's dataset, resolved as the scripts resolve it (DATA_ROOT,
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
