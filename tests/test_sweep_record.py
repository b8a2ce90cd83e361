"""sweep.json read into typed records and written back byte for byte."""

from __future__ import annotations

import json

import pytest

from quantpatch.base.errors import UserError
from quantpatch.launch.sweep_record import RunState, SweepRecord, SweepRun, load, save

# as quantpatch writes it: a local run that finished, a Slurm run (keys set in the order
# submit and refresh set them, one quantpatch does not know) and one made before seeds
RECORD = {
    "version": 2,
    "checkout": "/src/Megatron-LM",
    "launcher": "local",
    "selection": {
        "models": ["llama32-1b"], "datasets": None, "schemes": ["bf16", "mxfp8"],
        "profile": "smoke", "launcher": "local", "parallel": 2, "gpus": ["0", "1"],
        "config": None, "extra": ["--log-interval", "1"], "gpus_per_node": None, "nodes": None,
        "attention": "auto", "seeds": 1,
    },
    "slurm_job": None,
    "created": "2026-01-02T03:04:05+00:00",
    "layout": {"gpus_per_node": 1, "nodes": 1},
    "attention": {"choice": "auto", "path": "stock"},
    "provenance": {"quantpatch": "1.0", "megatron": "0.13.1", "base": {}, "args": {}},
    "data": {"env": {"DATA_ROOT": "/d"}, "mock": True, "checked": []},
    "runs": [
        {
            "name": "m_d_bf16_smoke", "seed": None, "folder": "runs/m_d_bf16_smoke",
            "model": "m", "dataset": "d", "scheme": "bf16", "args": [], "profile": "smoke",
            "script": "scripts/a.sh", "state": "finished", "exit_code": 0,
            "log": "runs/m_d_bf16_smoke/logs/a.log", "commit": "a" * 40,
            "started": "2026-01-02T03:04:06+00:00", "ended": "2026-01-02T03:05:06+00:00",
            "gpus": "0", "array_task": None, "pid": None, "attention": "stock",
            "env": {"PATH": "/bin"},
        },
        {
            "name": "m_d_mxfp8_smoke", "seed": None, "folder": "runs/m_d_mxfp8_smoke",
            "model": "m", "dataset": "d", "scheme": "mxfp8", "args": ["--x"],
            "profile": "smoke", "script": "scripts/b.sh", "state": "submitted",
            "exit_code": None, "log": None, "commit": None, "started": None, "ended": None,
            "gpus": None, "array_task": 1, "pid": None, "attention": None, "slurm_job": "7",
            "slurm_state": None, "submitted": "2026-01-02T03:04:06+00:00", "reason": None,
            "slurm_output": None, "env": {}, "note": ["kept"],
        },
        {"name": "old", "model": "m", "dataset": "d", "scheme": "bf16", "profile": "smoke",
         "script": "scripts/c.sh", "state": "interrupted", "exit_code": -15, "log": None},
    ],
}  # fmt: skip


def _write(tmp_path, record) -> bytes:
    text = (json.dumps(record, indent=1) + "\n").encode()
    (tmp_path / "sweep.json").write_bytes(text)
    return text


def test_a_record_reads_typed_and_writes_back_byte_for_byte(tmp_path):
    before = _write(tmp_path, RECORD)
    record = load(tmp_path)
    assert record is not None
    done, slurm, old = record.runs
    assert done.state is RunState.FINISHED and isinstance(done.state, RunState)
    assert slurm.is_slurm_live and slurm.extra == {"note": ["kept"]}
    assert old.seed is None and old.folder is None and old.state is RunState.INTERRUPTED
    assert record.selection.parallel == 2 and record.data_env == {"DATA_ROOT": "/d"}
    assert record.counts()["finished"] == 1 and record.counts()["submitted"] == 1
    save(tmp_path, record)
    assert (tmp_path / "sweep.json").read_bytes() == before


def test_a_field_set_later_goes_last_as_a_dict_would_put_it(tmp_path):
    run = SweepRun(name="r", script="r.sh", state=RunState.PENDING)
    run.update(state="running", env={"A": "1"}, pid=12)
    out = run.as_dict()
    assert list(out)[-1] == "env" and out["state"] == "running" and out["pid"] == 12
    assert json.loads(json.dumps(out)) == out  # the state is written as its word
    assert f"{run.state}" == "running" and str(run.state) == "running"
    with pytest.raises(AttributeError):
        run.update(nope=1)
    with pytest.raises(ValueError):
        run.update(state="done")


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda r: r["runs"][0].update(state="done"), 'runs[0].state is "done", not one of'),
        (lambda r: r["runs"][1].update(pid="12"), 'runs[1].pid is "12", not an integer'),
        (lambda r: r["runs"][2].pop("script"), "runs[2].script is null, not a string"),
        (lambda r: r["selection"].update(seeds="2"), 'selection.seeds is "2", not an integer'),
        (lambda r: r["selection"]["extra"].append(3), "selection.extra holds 3, not a string"),
        (lambda r: r["data"]["env"].update(X=1), "data.env.X is 1, not a string"),
        (lambda r: r.update(launcher="pbs"), 'launcher is "pbs", not one of local, slurm'),
    ],
)
def test_a_hand_edited_record_is_refused_in_one_sentence(tmp_path, edit, said):
    record = json.loads(json.dumps(RECORD))
    edit(record)
    _write(tmp_path, record)
    with pytest.raises(UserError) as err:
        load(tmp_path)
    assert said in str(err.value)
    assert str(err.value).endswith("move the file away to start a new sweep.")
    assert str(err.value).count(". ") == 0


def test_a_record_round_trips_through_its_dict():
    record = SweepRecord.from_dict(RECORD)
    assert record.as_dict() == RECORD
    assert [r.as_dict() for r in record.runs] == RECORD["runs"]


def _run(name="r", state=RunState.PENDING, **fields):
    return SweepRun(name=name, script=f"{name}.sh", state=state, **fields)


def test_a_resume_keeps_what_still_stands_and_says_why_a_run_runs_again():
    from quantpatch.launch.sweep import Resume, Selection

    commit, moved = "a" * 40, "b" * 40
    before = {
        "live": _run("live", slurm_job="7", array_task=0, state=RunState.SUBMITTED),
        "failed": _run("failed", state=RunState.FAILED, exit_code=1),
        "done": _run("done", state=RunState.FINISHED, commit=commit, attention=None, log="l"),
        "other_path": _run("other_path", state=RunState.FINISHED, attention="flash"),
        "moved": _run("moved", state=RunState.FINISHED, commit=moved),
        "stopped": _run("stopped", state=RunState.INTERRUPTED, exit_code=-15),
    }
    plan = Resume(before, Selection(attention="auto"), repo=None, only_pending=True)
    new = {name: _run(name, attention="stock") for name in before}
    kept = {name: plan.run(run, commit) for name, run in new.items()}
    assert kept["live"].state is RunState.SUBMITTED and kept["live"] is not before["live"]
    assert kept["failed"].state is RunState.FAILED  # --only-pending keeps a failed run
    assert (kept["done"].state, kept["done"].log, kept["done"].attention) == (
        RunState.FINISHED, "l", "stock"
    )  # fmt: skip
    assert kept["other_path"] is new["other_path"] and kept["moved"] is new["moved"]
    assert kept["stopped"] is new["stopped"]
    assert [n.split(":")[0] for n in plan.notes] == ["other_path", "moved"]
    assert "attention path is stock now (--attention auto), it ran on flash" in plan.notes[0]
    assert f"moved from {moved[:10]} to {commit[:10]} since it finished" in plan.notes[1]
    again = Resume(before, Selection(), repo=None, only_pending=False)
    assert again.run(new["failed"], commit) is new["failed"]
