"""The README's walk for a user's own fork, every command as the README
writes it, run in one shell: a fork-shaped clone (`git clone -b quant`), `check`, `init`,
`check`, `data prepare` with a locally trained tokenizer and a 300-document corpus, a Slurm
sweep on a real one-node Slurm whose node declares 2 GPUs (`--gpus-per-node 2`), its status
until every run ended, the report, and a checkout that `git status` finds clean. Only
`torchrun` is a stub (Megatron's log lines)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from .conftest import git_out
from .forklike import build_fork
from .test_data_prepare import corpus, make_tokenizer, write_jsonl
from .test_scripts import QUANTPATCH
from .test_sweep import TORCHRUN
from .test_sweep_slurm import one_node_slurm

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm")]  # one cluster at a time

README = Path(__file__).parent.parent / "README.md"
HEADING = "## Your own fork, from clone to report"
URL = "https://github.com/YOU/Megatron-LM.git"


def readme_walk() -> tuple[list[str], str]:
    """The section's commands (continuation lines joined) and its TOML block."""
    text = README.read_text(encoding="utf-8")
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    console = section.split("```console\n", 1)[1].split("```", 1)[0]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    commands: list[str] = []
    joining = False
    for line in console.splitlines():
        if joining:
            commands[-1] += "\n" + line
        elif line.startswith("$ "):
            commands.append(line[2:])
        joining = line.rstrip().endswith("\\")
    return commands, toml


def test_the_readme_walk_on_a_fork_and_a_two_gpu_slurm(tmp_path, trees, capfd):
    commands, toml = readme_walk()
    assert commands[0].startswith(f"git clone -b quant {URL}")
    assert any(c.startswith("quantpatch init") for c in commands)
    assert any("--launcher slurm --gpus-per-node 2" in " ".join(c.split()) for c in commands)
    origin = build_fork(tmp_path / "fork" / "Megatron-LM", trees["0.13.1"], full=False)
    home = tmp_path / "home"  # where the user works: the clone, corpus, tokenizer, sweeps
    home.mkdir()
    make_tokenizer(home / "tok")
    write_jsonl(home / "mytext.jsonl", corpus(300))
    (home / "study.toml").write_text(toml)
    bin_dir, stub = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub.mkdir()
    (bin_dir / "torchrun").write_text(TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    quantpatch_dir = str(Path(QUANTPATCH).parent)
    script = "set -euo pipefail\n" + "\n".join(commands).replace(URL, str(origin.origin)) + "\n"
    with one_node_slurm(tmp_path / "slurm", gpus=2) as slurm_env:
        env = {
            **os.environ,
            **slurm_env,
            "PATH": f"{bin_dir}{os.pathsep}{quantpatch_dir}{os.pathsep}{os.environ['PATH']}",
            "STUB_DIR": str(stub),
            "QUANTPATCH": QUANTPATCH,
            "COLUMNS": "200",
            # the user's git identity (their ~/.gitconfig): init commits on quant
            "GIT_AUTHOR_NAME": "Researcher",
            "GIT_AUTHOR_EMAIL": "researcher@lab.invalid",
            "GIT_COMMITTER_NAME": "Researcher",
            "GIT_COMMITTER_EMAIL": "researcher@lab.invalid",
        }
        for key in ("DATA_ROOT", "DATA_PREFIX", "TOKENIZER_MODEL", "MOCK_DATA"):
            env.pop(key, None)
        done = subprocess.run(
            ["bash", "-c", script], cwd=home, env=env, capture_output=True, text=True
        )
        # the same sweep without --gpus-per-node: the fast profile's 8 GPUs a node, refused by
        # Slurm's own sinfo before anything is written or submitted
        sweep_line = next(c for c in commands if c.startswith("quantpatch sweep run"))
        refused = " ".join(sweep_line.replace("\\\n", " ").split())
        refused = refused.replace(" --gpus-per-node 2", "")
        refused = refused.replace("../sweeps/study", "../sweeps/refused")
        exports = next(c for c in commands if c.startswith("export "))
        no = subprocess.run(
            ["bash", "-c", f"cd Megatron-LM && {exports} && {refused}"],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
        )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-6000:]
    assert no.returncode == 2, no.stdout + no.stderr
    assert "partition debug has 1 node with gpu:2: give --gpus-per-node 2" in " ".join(
        no.stderr.split()
    )
    assert not (home / "sweeps" / "refused").exists()
    clone = home / "Megatron-LM"
    assert git_out(clone, "branch", "--show-current").strip() == "quant"
    assert git_out(clone, "status", "--porcelain") == ""
    assert "linear=hifp8" in said and "initialised" in said
    assert "PyTorch was not found" not in said
    record = json.loads((home / "sweeps" / "study" / "sweep.json").read_text())
    assert [r["state"] for r in record["runs"]] == ["finished", "finished"]
    assert record["layout"] == {"gpus_per_node": 2, "nodes": 1}
    assert record["data"]["env"]["TOKENIZER_MODEL"] == str(home / "tok")
    sbatch = (home / "sweeps" / "study" / "sweep.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=2" in sbatch
    html = (home / "sweeps" / "study" / "report.html").read_text().replace("<wbr>", "")
    assert "slurm (job array" in html and str(home / "tok") in html
    for r in record["runs"]:
        assert r["commit"] and r["commit"][:12] in html
    # every slurm task's output starts with quantpatch's own lines, not the sites table
    for out in (home / "sweeps" / "study" / "slurm").glob("*.out"):
        assert "roles:" not in out.read_text()
    assert re.search(r"submitted 2 runs as Slurm job array [0-9]+", said)
