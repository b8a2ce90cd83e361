"""Launch scripts: all 60 per profile checked statically, one executed end to end with a stub
torchrun, concurrency, quoting, and every bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import git
import pytest

from quantpatch.registry import load_registry, release_flags, releases
from quantpatch.scripts import body_matches_header, render_all, script_name, shell_quote

from .conftest import snapshot

PROFILES = ("full", "fast", "smoke")
QUANTPATCH = str(Path(sys.executable).with_name("quantpatch"))
SHELLCHECK = str(Path(sys.executable).with_name("shellcheck"))


def _argument_flags(text: str) -> set[str]:
    """Every --flag in the script's pretrain_gpt.py argument section."""
    section = text.split("# ---- pretrain_gpt.py arguments", 1)[1].split("# ---- end", 1)[0]
    section = section.split(")", 1)[1]  # skip DISTRIBUTED_ARGS (torchrun's own options)
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", section))


def test_bundled_flag_lists():
    """Facts of the bundled lists (one line per flag of the release's training parser)."""
    assert releases() == ["core_v0.11.0", "core_v0.13.1", "main-d98e8a64dd"]
    sizes = {r: len(release_flags(r)) for r in releases()}
    assert sizes == {"core_v0.11.0": 407, "core_v0.13.1": 502, "main-d98e8a64dd": 400}
    for release in releases():
        assert all(re.fullmatch(r"--[A-Za-z0-9][\w-]*", f) for f in release_flags(release))
    v13 = release_flags("core_v0.13.1")
    assert {"--transformer-impl", "--no-gradient-accumulation-fusion", "--mtp-num-layers"} <= v13
    assert "--mtp-num-layers" not in release_flags("core_v0.11.0")
    assert "--num-layers" not in release_flags("main-d98e8a64dd")


@pytest.mark.parametrize("profile", PROFILES)
def test_all_60_scripts_are_valid(run, tmp_path, profile):
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out, "--profile", profile)
    assert res.code == 0, res
    reg = load_registry()
    accepted = release_flags("core_v0.13.1")
    paths = sorted(out.rglob("*.sh"))
    assert len(paths) == 60
    expected = {
        script_name(m, d, s)
        for m in ("llama31-8b", "llama32-1b", "deepseek2_lite")
        for d in ("wikipedia", "dolma")
        for s in reg.schemes
    }
    assert {str(p.relative_to(out)) for p in paths} == expected
    for path in paths:
        text = path.read_text()
        assert os.access(path, os.X_OK)
        assert body_matches_header(text)
        flags = _argument_flags(text)
        assert "--num-layers" in flags and "--transformer-impl" in flags
        assert flags <= accepted, sorted(flags - accepted)
        scheme = re.search(r"^readonly SCHEME=(\S+)$", text, re.M).group(1)
        values = {
            r: re.search(rf"^readonly QUANT_{r.upper()}=(\S+)$", text, re.M).group(1)
            for r in ("linear", "qk", "pv")
        }
        assert values == reg.schemes[scheme].values()
        assert "sed " not in text and "CUSTOM_QUANT_TYPE=" not in text
    for path in paths:  # bash -n checks only its first file: one call per script
        subprocess.run(["bash", "-n", str(path)], check=True)
    sc = subprocess.run(
        [SHELLCHECK, "-S", "style", *map(str, paths)], capture_output=True, text=True
    )
    assert sc.returncode == 0, sc.stdout[-2000:]
    index = (out / "index.md").read_text()
    assert index.count("\n| `") == 60
    assert (
        "| `deepseek2_lite/pretrain_deepseek2_lite_dolma_FA_linear_mxfp4.sh` | "
        "deepseek2_lite | dolma | FA_linear_mxfp4 | mxfp4 | mxfp4 | bf16 |" in index
    )


def test_older_release_and_unsupported_release(run, tmp_path):
    res = run("gen-scripts", "--out", tmp_path / "s11", "--megatron-release", "core_v0.11.0")
    assert res.code == 0, res
    accepted = release_flags("core_v0.11.0")
    for path in (tmp_path / "s11").rglob("*.sh"):
        assert _argument_flags(path.read_text()) <= accepted
    res = run("gen-scripts", "--out", tmp_path / "main", "--megatron-release", "main-d98e8a64dd")
    assert res.code == 2 and "main-d98e8a64dd does not accept" in res.err
    assert "--num-layers," in res.err
    assert not (tmp_path / "main").exists()
    res = run("gen-scripts", "--out", tmp_path / "x", "--megatron-release", "v9")
    assert res.code == 2 and "unknown release 'v9'" in res.err


def test_selection_check_and_hand_edits(run, tmp_path):
    out = tmp_path / "s"
    args = (
        "gen-scripts",
        "--out",
        out,
        "--models",
        "llama32-1b",
        "--datasets",
        "dolma",
        "--schemes",
        "bf16,FA_hifp8",
    )
    assert run(*args).code == 0
    assert sorted(p.name for p in out.rglob("*.sh")) == [
        "pretrain_llama32-1b_dolma_FA_hifp8.sh",
        "pretrain_llama32-1b_dolma_bf16.sh",
    ]
    assert run(*args, "--check").code == 0
    script = out / "llama32-1b" / "pretrain_llama32-1b_dolma_bf16.sh"
    script.write_text(script.read_text().replace("--train-iters 250000", "--train-iters 9"))
    assert not body_matches_header(script.read_text())
    res = run(*args, "--check")
    assert res.code == 1 and "pretrain_llama32-1b_dolma_bf16.sh" in res.err
    before = snapshot(out)
    res = run(*args)
    assert res.code == 2 and "edited by hand" in res.err and "--force" in res.err
    assert snapshot(out) == before
    assert run(*args, "--force").code == 0
    assert body_matches_header(script.read_text())
    assert run(*args, "--check").code == 0
    # a script still matching its own hash (older profile) is replaced without --force
    assert run(*args, "--profile", "fast").code == 0
    assert "--train-iters 200" in script.read_text()


def test_bad_inputs_exit_2_and_write_nothing(run, tmp_path):
    out = tmp_path / "s"
    cases = [
        (
            ("--models", "gpt5"),
            "unknown model 'gpt5'; valid: llama31-8b, llama32-1b, deepseek2_lite",
        ),
        (("--datasets", "c4"), "unknown dataset 'c4'; valid: wikipedia, dolma"),
        (("--schemes", "FA_fp8"), "unknown scheme 'FA_fp8'; valid: bf16, FA_mxfp8"),
        (("--profile", "huge"), "unknown profile 'huge'; valid: full, fast, smoke"),
    ]
    for extra, message in cases:
        res = run("gen-scripts", "--out", out, *extra)
        assert res.code == 2 and message in res.err, res
        assert not out.exists()
    configs = {
        "missing": (
            "[models.tiny]\ndescription = 't'\ntokenizer_type = 'x'\n"
            "tokenizer_model = 'x'\n[models.tiny.args]\nnum-layers = 2\n",
            "models.tiny is missing field 'vocab_size'",
        ),
        "type": (
            "[datasets.wikipedia]\nsplit = 949\n",
            "datasets.wikipedia.split has the wrong type (expected str, got int)",
        ),
        "field": ("[profiles.full]\ngpus = 4\n", "profiles.full has unknown field 'gpus'"),
        "table": ("[modles.x]\n", "unknown table 'modles'"),
        "toml": ("[models\n", "not valid TOML"),
        "args": ("[models.llama32-1b.args]\n'--num-layers' = 3\n", "args.--num-layers"),
    }
    for name, (body, message) in configs.items():
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(body)
        res = run("gen-scripts", "--out", out, "--config", cfg)
        assert res.code == 2 and message in res.err, (name, res)
        assert not out.exists()
    res = run("gen-scripts", "--out", out, "--config", tmp_path / "absent.toml")
    assert res.code == 2 and "config file not found" in res.err
    # unwritable: the output path lies under a regular file (holds even for root)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = run("gen-scripts", "--out", blocker / "s")
    assert res.code == 2 and "cannot be written" in res.err
    assert blocker.read_text() == "x"


def test_config_adds_a_model_and_overrides_a_dataset(run, tmp_path):
    cfg = tmp_path / "mine.toml"
    cfg.write_text(
        textwrap.dedent("""
        [models.tiny]
        description = "a 2-layer test model"
        tokenizer_type = "GPT2BPETokenizer"
        tokenizer_model = "gpt2"
        vocab_size = 50257
        [models.tiny.args]
        num-layers = 2
        hidden-size = 256
        num-attention-heads = 4
        [datasets.wikipedia]
        prefix = "{data_root}/my wiki/$HOME/{model}"
        [schemes.pv_only_mxfp8]
        linear = "bf16"
        qk = "bf16"
        pv = "mxfp8"
    """)
    )
    res = run("list", "--json", "--config", cfg)
    data = json.loads(res.out)
    assert "tiny" in data["models"] and data["schemes"]["pv_only_mxfp8"]["pv"] == "mxfp8"
    res = run(
        "gen-scripts",
        "--out",
        tmp_path / "s",
        "--config",
        cfg,
        "--models",
        "tiny",
        "--schemes",
        "pv_only_mxfp8",
        "--datasets",
        "wikipedia",
    )
    assert res.code == 0, res
    text = (tmp_path / "s" / "tiny" / "pretrain_tiny_wikipedia_pv_only_mxfp8.sh").read_text()
    assert "DATA_PREFIX=\"$DATA_ROOT\"'/my wiki/$HOME/tiny'" in text


def test_list_table(run):
    res = run("list")
    assert res.code == 0
    for word in ("llama31-8b", "deepseek2_lite", "wikipedia", "dolma", "FA_linear_hifp8", "smoke"):
        assert word in res.out


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "with space",
        "dollar $HOME",
        "quote ' \" `x`",
        "semi;colon && rm -rf /",
        "comma,list",
        "",
        "new\nline",
    ],
)
def test_shell_quote_round_trips(value):
    res = subprocess.run(
        ["bash", "-c", f"printf %s {shell_quote(value)}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout == value


# -- end to end with a stub torchrun --------------------------------------------------------

STUB = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$STUB_DIR/argv.$$"
pwd > "$STUB_DIR/cwd.$$"
env | grep -E '^(TENSOR_SAVE_|CUSTOM_QUANT_TYPE)' | sort > "$STUB_DIR/env.$$"
sleep "${STUB_SLEEP:-0}"
exit "${STUB_EXIT:-0}"
"""


@pytest.fixture
def stub_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(STUB)
    (bin_dir / "torchrun").chmod(0o755)
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(stub_dir),
        "QUANTPATCH": QUANTPATCH,
        "CUSTOM_QUANT_TYPE": "hifp8",
        "OUTPUT_ROOT": str(tmp_path / "runs"),
    }
    return env, stub_dir


def _records(stub_dir: Path) -> list[tuple[list[str], str, str]]:
    out = []
    for argv in sorted(stub_dir.glob("argv.*")):
        pid = argv.suffix
        out.append(
            (
                argv.read_text().split("\0")[:-1],
                (stub_dir / f"cwd{pid}").read_text().strip(),
                (stub_dir / f"env{pid}").read_text(),
            )
        )
    return out


EXPECTED_SMOKE_ARGV = [
    "--nproc_per_node",
    "1",
    "--nnodes",
    "1",
    "--node_rank",
    "0",
    "--master_addr",
    "localhost",
    "--master_port",
    "MASTER_PORT",
    "pretrain_gpt.py",
    "--num-layers",
    "2",
    "--hidden-size",
    "2048",
    "--ffn-hidden-size",
    "8192",
    "--num-attention-heads",
    "32",
    "--group-query-attention",
    "--num-query-groups",
    "8",
    "--kv-channels",
    "64",
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "500000",
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "32.0",
    "--max-position-embeddings",
    "4096",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-05",
    "--swiglu",
    "--disable-bias-linear",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "5",
    "--lr",
    "0.0001",
    "--min-lr",
    "1e-05",
    "--lr-decay-style",
    "constant",
    "--lr-warmup-iters",
    "0",
    "--init-method-std",
    "0.02",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "0",
    "--save-interval",
    "1000",
    "--log-interval",
    "1",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-rope-fusion",
    "--bf16",
    "--make-vocab-size-divisible-by",
    "128",
    "--seed",
    "1234",
    "--ckpt-format",
    "torch",
    "--distributed-timeout-minutes",
    "60",
    "--log-throughput",
    "--tensor-model-parallel-size",
    "1",
    "--pipeline-model-parallel-size",
    "1",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "128256",
    "--save",
    "CKPT",
    "--load",
    "CKPT",
    "--tensorboard-dir",
    "TB",
]


def test_smoke_script_end_to_end_with_stub_torchrun(make_checkout, tmp_path, stub_env, run):
    env, stub_dir = stub_env
    root = make_checkout()
    out = tmp_path / "scripts"
    assert (
        run("gen-scripts", "--out", out, "--profile", "smoke", "--models", "llama32-1b").code == 0
    )
    script = out / "llama32-1b" / "pretrain_llama32-1b_wikipedia_FA_mxfp8.sh"
    before = snapshot(root)
    res = subprocess.run([str(script)], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    ((argv, cwd, saver_env),) = _records(stub_dir)
    wt = Path(cwd)
    port = argv[argv.index("--master_port") + 1]
    runs = tmp_path / "runs" / "llama32-1b_wikipedia_FA_mxfp8_smoke"
    ckpt, tb = str(runs / "checkpoints"), str(runs / "tensorboard")
    expected = [
        {"MASTER_PORT": port, "CKPT": ckpt, "TB": tb}.get(a, a) for a in EXPECTED_SMOKE_ARGV
    ]
    assert argv == expected
    # it ran in its own worktree, at a commit holding the scheme; the user's tree is untouched
    assert wt != root and wt.is_relative_to(root / ".git" / "quantpatch" / "worktrees")
    assert (
        "custom_quant_type = 'mxfp8'"
        in (wt / "megatron/core/transformer/dot_product_attention.py").read_text()
    )
    after = snapshot(root)
    assert after["files"] == before["files"] and after["head"] == before["head"]
    assert git.Repo(root).active_branch.name == "main" and not git.Repo(root).is_dirty()
    assert "roles: linear=bf16  qk=mxfp8  pv=bf16" in res.stdout
    assert "CUSTOM_QUANT_TYPE" not in saver_env and "TENSOR_SAVE_ENABLED=false" in saver_env
    head = git.Repo(wt).head.commit.hexsha
    logs = list((runs / "logs").glob("*.log"))
    assert len(logs) == 1 and f"source commit {head}" in logs[0].read_text()
    # the training exit status is the script's exit status
    env["STUB_EXIT"] = "7"
    res = subprocess.run([str(script)], cwd=root, env=env, capture_output=True, text=True)
    assert res.returncode == 7
    # run: the one-shot form prints exactly the command, and runs it
    res = run(
        "run",
        "--repo",
        root,
        "--model",
        "llama32-1b",
        "--dataset",
        "wikipedia",
        "--scheme",
        "FA_mxfp8",
        "--profile",
        "smoke",
        "--dry-run",
    )
    assert res.code == 0


def test_two_scripts_at_once_from_one_checkout(make_checkout, tmp_path, stub_env, run):
    env, stub_dir = stub_env
    env["STUB_SLEEP"] = "1"
    root = make_checkout()
    out = tmp_path / "scripts"
    assert (
        run(
            "gen-scripts",
            "--out",
            out,
            "--profile",
            "smoke",
            "--models",
            "llama32-1b",
            "--datasets",
            "dolma",
        ).code
        == 0
    )
    names = ["FA_linear_hifp8", "linear_mxfp4", "FA_linear_hifp8"]
    procs = [
        subprocess.Popen(
            [str(out / "llama32-1b" / f"pretrain_llama32-1b_dolma_{n}.sh")],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in names
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    records = _records(stub_dir)
    assert len(records) == 3
    cwds = sorted({cwd for _, cwd, _ in records})
    assert [Path(c).name for c in cwds] == [
        "quant__linear-hifp8_qk-hifp8_pv-bf16",
        "quant__linear-mxfp4_qk-bf16_pv-bf16",
    ]
    assert git.Repo(root).active_branch.name == "main" and not git.Repo(root).is_dirty()


def test_run_dry_run_prints_the_command(make_checkout, tmp_path, stub_env):
    env, stub_dir = stub_env
    root = make_checkout()
    res = subprocess.run(
        [
            QUANTPATCH,
            "run",
            "--model",
            "deepseek2_lite",
            "--dataset",
            "dolma",
            "--scheme",
            "linear_hifp8",
            "--profile",
            "smoke",
            "--dry-run",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip().splitlines()[-1]
    assert line.startswith("cd ") and " && torchrun --nproc_per_node 1 " in line
    assert "--moe-layer-freq \\(\\[0\\]\\*1+\\[1\\]\\*1\\)" in line
    assert "--expert-model-parallel-size 1" in line
    assert not list(stub_dir.iterdir())  # nothing was launched
    res = subprocess.run(
        [
            QUANTPATCH,
            "run",
            "--model",
            "deepseek2_lite",
            "--dataset",
            "dolma",
            "--scheme",
            "linear_hifp8",
            "--profile",
            "smoke",
        ],
        cwd=root,
        env={**env, "STUB_EXIT": "3"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 3
    ((argv, _, _),) = _records(stub_dir)
    assert argv[argv.index("--moe-layer-freq") + 1] == "([0]*1+[1]*1)"


def test_rendering_is_deterministic_with_spread_ports():
    reg = load_registry()
    a = render_all(
        reg, list(reg.models), list(reg.datasets), list(reg.schemes), "full", "core_v0.13.1"
    )
    b = render_all(
        reg, list(reg.models), list(reg.datasets), list(reg.schemes), "full", "core_v0.13.1"
    )
    assert [s.text for s in a] == [s.text for s in b]
    assert len({s.text.split("MASTER_PORT=")[1][:4] for s in a}) > 30  # spread-out ports
