"""What a sweep records is what runs, whatever the shell exports (the variables a script owns
and the ones passed through, ``launch.script_env``); a sweep that can never start refused
before it writes; a hand-edited ``sweep.json`` refused with one sentence naming the field;
Slurm's output in any encoding. The same on a real two-node Slurm: test_sweep_slurm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .test_scripts import QUANTPATCH
from .test_sweep import SACCT, SBATCH, SCONTROL, SELECT, SQUEUE, TORCHRUN, record


@pytest.fixture
def sweep_env(tmp_path, make_checkout, monkeypatch):
    """test_sweep's: a checkout, Slurm's clients and torchrun stubbed on PATH."""
    root = make_checkout()
    bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub.mkdir()
    stubs = (("torchrun", TORCHRUN), ("sbatch", SBATCH), ("squeue", SQUEUE),
             ("sacct", SACCT), ("scontrol", SCONTROL))  # fmt: skip
    for name, text in stubs:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_DIR", str(stub))
    monkeypatch.setenv("QUANTPATCH", QUANTPATCH)
    return root, dict(os.environ), stub, tmp_path / "sweep"


# torchrun, stubbed: records its arguments and the environment its workers would get
RECORDER = r"""#!/usr/bin/env bash
n="$STUB_DIR/torchrun-$$"
printf '%s\n' "$@" > "$n.argv"
env > "$n.env"
"""
SBATCH_ENV = r"""#!/usr/bin/env bash
env > "$STUB_DIR/sbatch.env"
echo "4242"
"""

HOSTILE = {
    "GPUS_PER_NODE": "3",
    "NNODES": "2",
    "MASTER_ADDR": "oldnode07",
    "MASTER_PORT": "1234",
    "NODE_RANK": "5",
    "RDZV_ID": "old",
    "TP": "2",
    "MICRO_BATCH_SIZE": "2",
    "GLOBAL_BATCH_SIZE": "3",
    "TOKENIZER_TYPE": "Llama2Tokenizer",
    "QUANTPATCH_FLASH": "1",
    "QUANTPATCH_DRY_RUN": "1",
    "EXTRA_ARGS": "--seed 7",
    "PET_NNODES": "4",
    "CUDA_VISIBLE_DEVICES": "5",
    "SWEEP_DIR": "/elsewhere",
}
PASSED = {"NCCL_DEBUG": "INFO", "TENSOR_SAVE_ENABLED": "false"}


def _recorded(stub: Path) -> list[tuple[list[str], dict[str, str]]]:
    out = []
    for argv in sorted(stub.glob("torchrun-*.argv")):
        env = dict(
            line.split("=", 1)
            for line in argv.with_suffix(".env").read_text().splitlines()
            if "=" in line
        )
        out.append((argv.read_text().splitlines(), env))
    return out


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.slow
def test_a_local_sweep_runs_what_it_recorded_whatever_the_shell_exports(
    sweep_env, run, monkeypatch, tmp_path
):
    root, _env, stub, out = sweep_env
    (tmp_path / "bin" / "torchrun").write_text(RECORDER)
    logs = tmp_path / "elsewhere"
    for key, value in {**HOSTILE, **PASSED, "LOG_DIR": str(logs)}.items():
        monkeypatch.setenv(key, value)
    res = run("sweep", "run", out, *SELECT[:6], "--schemes", "bf16", "--gpus", "0",
              "--repo", root)  # fmt: skip
    assert res.code == 0, res
    ((argv, env),) = _recorded(stub)
    assert argv[:5] == ["--standalone", "--nnodes", "1", "--nproc-per-node", "1"]
    assert _after(argv, "--tensor-model-parallel-size") == "1"
    assert _after(argv, "--global-batch-size") == "2"
    assert _after(argv, "--micro-batch-size") == "1"
    assert _after(argv, "--tokenizer-type") == "NullTokenizer"  # mock data: the model's own
    assert argv.count("--seed") == 1  # the profile's, not EXTRA_ARGS'
    assert (
        env["CUDA_VISIBLE_DEVICES"] == "0" and env["QUANTPATCH_FLASH"] == "0"
    )  # bf16 alone: stock
    assert env["NCCL_DEBUG"] == "INFO"
    assert not any(k.startswith("PET_") for k in env) and "NODE_RANK" not in env
    assert not logs.exists()  # the log went where the sweep looks for it
    (done,) = record(out)["runs"]
    assert done["state"] == "finished" and (out / done["log"]).parent == (  # the folder's
        out / "runs" / done["name"] / "logs"
    )
    assert done["env"] == PASSED  # what was passed through is recorded
    assert record(out)["layout"] == {"gpus_per_node": 1, "nodes": 1}


def test_a_slurm_sweep_hands_sbatch_the_sweeps_environment(sweep_env, run, monkeypatch, tmp_path):
    root, _env, stub, out = sweep_env
    (tmp_path / "bin" / "sbatch").write_text(SBATCH_ENV)
    for key, value in {**HOSTILE, **PASSED, "SBATCH_ACCOUNT": "proj-7"}.items():
        monkeypatch.setenv(key, value)
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    env = dict(
        line.split("=", 1) for line in (stub / "sbatch.env").read_text().splitlines() if "=" in line
    )
    assert not set(HOSTILE) & set(env), set(HOSTILE) & set(env)
    assert env["OUTPUT_ROOT"] == str((out / "runs").resolve())
    assert env["NCCL_DEBUG"] == "INFO" and env["SBATCH_ACCOUNT"] == "proj-7"
    runs = record(out)["runs"]
    assert [r["env"] for r in runs] == [{**PASSED, "SBATCH_ACCOUNT": "proj-7"}] * 3
    # the job array's folder is its own, not the environment's
    assert "SWEEP_DIR=" + str(out.resolve()) in (out / "sweep.sbatch").read_text()


def test_a_local_sweep_that_can_never_start_is_refused_before_writing(sweep_env, run):
    root, _env, _stub, out = sweep_env
    res = run("sweep", "run", out, *SELECT, "--gpus-per-node", "2", "--gpus", "0",
              "--repo", root)  # fmt: skip
    assert res.code == 2 and "each run needs 2 GPUs" in " ".join(res.err.split()), res
    assert not out.exists()
    assert not (root / ".git" / "quantpatch" / "worktrees").exists()


@pytest.mark.slow
def test_the_advice_of_a_local_sweep_that_cannot_start_followed(sweep_env, run, tmp_path):
    root, _env, _stub, out = sweep_env
    res = run("sweep", "run", out, *SELECT, "--gpus-per-node", "2", "--gpus", "0",
              "--repo", root)  # fmt: skip
    said = " ".join(res.err.split())
    assert res.code == 2, res
    assert "each run needs 2 GPUs" in said and "give --gpus-per-node 1" in said, said
    assert not out.exists()
    assert not (root / ".git" / "quantpatch" / "worktrees").exists()
    # the advice, followed: another GPU named, or one GPU a run
    one = (*SELECT[:6], "--schemes", "bf16")
    res = run("sweep", "run", tmp_path / "two", *one, "--gpus-per-node", "2", "--gpus", "0,1",
              "--repo", root)  # fmt: skip
    assert res.code == 0, res
    assert [r["gpus"] for r in record(tmp_path / "two")["runs"]] == ["0,1"]
    res = run("sweep", "run", out, *SELECT, "--gpus-per-node", "1", "--gpus", "0",
              "--repo", root)  # fmt: skip
    assert res.code == 0, res
    assert [r["state"] for r in record(out)["runs"]] == ["finished"] * 3


EDITS = [
    (lambda r: r["layout"].update(nodes="abc"), 'layout.nodes is "abc", not an integer'),
    (lambda r: r.update(layout="2x2"), 'layout is "2x2", not a table'),
    (lambda r: r.update(attention="flash"), 'attention is "flash", not a table'),
    (lambda r: r["data"].update(env="DATA_ROOT=/x"), 'data.env is "DATA_ROOT=/x", not a table'),
    (lambda r: r["runs"][0].update(name=None), "runs[0].name is null, not a string"),
    (lambda r: r["runs"][1].update(scheme=["bf16"]), 'runs[1].scheme is ["bf16"], not a string'),
    (lambda r: r["runs"][0].update(commit=7), "runs[0].commit is 7, not a string or null"),
    (lambda r: r["runs"][2].update(state="done"), 'runs[2].state is "done", not one of'),
    (lambda r: r["selection"].update(models="llama32-1b"), "selection.models is"),
    (lambda r: r.update(runs={}), "runs is {}, not a list"),
]


def test_a_hand_edited_record_is_refused_naming_the_field(sweep_env, run, tmp_path):
    root, _env, _stub, out = sweep_env
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    good = (out / "sweep.json").read_text()
    for edit, says in EDITS:
        data = json.loads(good)
        edit(data)
        text = json.dumps(data)
        (out / "sweep.json").write_text(text)
        for command in (("status",), ("report", "--out", tmp_path / "r.html"), ("cancel",)):
            res = run("sweep", *command[:1], out, *command[1:])
            said = " ".join(res.err.split())
            assert res.code == 2, (command, res)
            assert f"{out / 'sweep.json'}: {says}" in said, said
            assert "internal error" not in said and (out / "sweep.json").read_text() == text
        res = run("sweep", "run", out, "--repo", root)
        assert res.code == 2 and says in " ".join(res.err.split()), res


def test_slurm_output_in_another_encoding_is_read(sweep_env, run, tmp_path, monkeypatch):
    """sinfo, scontrol, squeue and sacct may print bytes that are not UTF-8 (a node's
    features, a job's name or reason): read with replacement, never a traceback."""
    root, _env, _stub, out = sweep_env
    bad = {
        "sinfo": "printf '1 gpu:2 8 64000 \\xff\\xfe\\n'",
        "scontrol": (
            "if [[ \"$1 $2\" == 'show partition' ]]; then\n"
            "printf 'PartitionName=debug Default=YES MaxNodes=0 Info=\\xe9t\\xe9\\n'; exit 0; fi\n"
            "printf 'JobId=4243 ArrayJobId=4242 ArrayTaskId=0 JobState=COMPLETED "
            "Reason=\\xff ExitCode=0:0\\n'"
        ),
        "squeue": "printf '4242_1|RUNNING|4244|2026-11-27T10:00:00 \\xff\\n'",
        "sacct": "printf '4242_2|4245|PENDING \\xff|0:0|Unknown|Unknown\\n'",
    }
    for name, body in bad.items():
        (tmp_path / "bin" / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (tmp_path / "bin" / name).chmod(0o755)
    res = run("sweep", "run", out, *SELECT, "--launcher", "slurm", "--repo", root)
    assert res.code == 0, res
    res = run("sweep", "status", out, "--json")
    assert res.code == 0, res
    states = [r["state"] for r in json.loads(res.out)["runs"]]
    assert states == ["finished", "running", "pending"], states


def test_the_passed_through_variables_are_documented():
    """docs/launch.md names every variable the scripts own and every one passed through."""
    from quantpatch.launch import script_env

    text = (Path(__file__).parents[1] / "docs" / "launch.md").read_text()
    section = text.split("## Environment", 1)[1].split("\n## ", 1)[0]
    for name in (*script_env.OWNED, *script_env.PASSED):
        assert f"`{name}`" in section, name
    for prefix in (*script_env.OWNED_PREFIXES, *script_env.PASSED_PREFIXES):
        assert f"`{prefix}*`" in section, prefix


def test_every_variable_the_scripts_read_is_owned_or_passed_through():
    """The templates' ``${NAME}`` reads of the environment: each one classified."""
    import re

    from quantpatch.launch import script_env
    from quantpatch.launch.shell_render import template_dir

    read = set()
    for path in template_dir().glob("*.j2"):
        text = path.read_text()
        read |= set(re.findall(r'default\("([A-Z_][A-Z0-9_]*)"', text))
        read |= set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):-", text))
    internal = {"SLURM_JOB_ID", "SLURM_GPUS_ON_NODE", "SLURM_JOB_NUM_NODES",
                "SLURM_ARRAY_TASK_ID", "PIPESTATUS"}  # fmt: skip
    swift = {"MEGATRON", "HF_MODEL", "SWIFT_DATASET"}  # ms-swift's scripts: no sweep runs them
    left = {
        n for n in read - internal - swift if not script_env.owned(n) and not script_env.passed(n)
    }
    assert not left, sorted(left)
