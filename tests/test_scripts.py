"""Launch scripts: all 60 per profile checked statically, one executed end to end with a stub
torchrun, concurrency, quoting, every bad input, and validation against the checkout's own
Megatron-LM argument parser (a synthetic one of the real shape, built at test time)."""

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

from quantpatch.launch.registry import load_registry, release_flags, releases
from quantpatch.launch.scripts import body_matches_header, render_all, script_name, shell_quote

from .conftest import snapshot
from .megatron_parser import write_parser

PROFILES = ("full", "fast", "smoke")
QUANTPATCH = str(Path(sys.executable).with_name("quantpatch"))
SHELLCHECK = str(Path(sys.executable).with_name("shellcheck"))
BUNDLED = "Megatron-LM core_v0.13.1 (bundled flag list)"
CHECKOUT = "Megatron-LM 0.15.0rc3 (flags read from the checkout's megatron/training/arguments.py)"


@pytest.fixture(autouse=True)
def _outside_any_checkout(tmp_path, monkeypatch):
    """Every test starts outside a checkout (as a newcomer's run would), with its own state
    home, so the bundled default applies unless a test builds a checkout."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def _argument_flags(text: str) -> set[str]:
    """Every --flag in the script's pretrain_gpt.py argument section."""
    section = text.split("# ---- pretrain_gpt.py arguments", 1)[1].split("# ---- end", 1)[0]
    assert section.split("\n", 1)[1].startswith("if (( NNODES == 1 )); then\n    DISTRIBUTED")
    section = section.split("\nfi\n", 1)[1]  # skip DISTRIBUTED_ARGS (torchrun's own options)
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


@pytest.mark.parametrize(  # the full profile's scripts in the full suite (13 s)
    "profile", [pytest.param(p, marks=pytest.mark.slow) if p == "full" else p for p in PROFILES]
)
def test_all_60_scripts_are_valid(run, tmp_path, profile):
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out, "--profile", profile)
    assert res.code == 0, res
    assert "validated against the bundled Megatron-LM core_v0.13.1 flag list (502 flags" in res.out
    reg = load_registry()
    accepted = release_flags("core_v0.13.1")
    paths = sorted(out.rglob("*.sh"))
    assert len(paths) == 60
    expected = {
        script_name(m, d, s)
        for m in ("llama31-8b", "llama32-1b", "deepseek2_lite")
        for d in ("wikipedia", "dolma")
        for s in reg.pick("schemes", None)
    }
    assert {str(p.relative_to(out)) for p in paths} == expected
    for path in paths:
        text = path.read_text()
        assert os.access(path, os.X_OK)
        assert body_matches_header(text)
        assert f"for {BUNDLED};" in text.split("\n", 3)[2]
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
    assert f"for {BUNDLED}, profile `{profile}`" in index
    assert len(re.findall(r"^\| \d+ \| `", index, re.M)) == 60
    assert (
        "| 58 | `deepseek2_lite/pretrain_deepseek2_lite_dolma_FA_linear_mxfp4.sh` | "
        "deepseek2_lite | dolma | FA_linear_mxfp4 | mxfp4 | mxfp4 | bf16 |" in index
    )


def test_older_release_and_unsupported_release(run, tmp_path):
    res = run("gen-scripts", "--out", tmp_path / "s11", "--megatron-release", "core_v0.11.0")
    assert res.code == 0, res
    accepted = release_flags("core_v0.11.0")
    for path in (tmp_path / "s11").rglob("*.sh"):
        assert _argument_flags(path.read_text()) <= accepted
    res = run("gen-scripts", "--out", tmp_path / "main", "--megatron-release", "main-d98e8a64dd")
    assert res.code == 2 and "Megatron-LM main-d98e8a64dd does not accept" in res.err
    assert "--num-layers," in res.err
    assert "checked against the bundled flag list pretrain-flags-main-d98e8a64dd.txt" in res.err
    # one sentence for all models: flags used by every model, then those of deepseek2_lite
    assert "(used by llama31-8b/full, llama32-1b/full, deepseek2_lite/full)" in res.err
    assert "--moe-router-topk" in res.err and "(used by deepseek2_lite/full)" in res.err
    assert not (tmp_path / "main").exists()
    # followed: the release the hint names takes every flag of every script
    said = " ".join(res.err.split())
    named = re.search(r"give --megatron-release (\S+), whose flag list has them all", said)
    assert named, said
    res = run("gen-scripts", "--out", tmp_path / "main", "--megatron-release", named[1])
    assert res.code == 0, res
    for path in (tmp_path / "main").rglob("*.sh"):
        assert _argument_flags(path.read_text()) <= release_flags(named[1])
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


def test_an_index_md_quantpatch_did_not_write_is_kept(run, tmp_path):
    """``index.md`` is protected like the scripts: a user's own, or one edited by hand, is
    overwritten only with --force."""
    out = tmp_path / "s"
    args = ("gen-scripts", "--out", out, "--models", "llama32-1b", "--datasets", "dolma")
    out.mkdir()
    (out / "index.md").write_text("# My experiment notes\n")
    res = run(*args)
    assert res.code == 2 and "index.md" in res.err and "--force" in res.err
    assert [p.name for p in out.iterdir()] == ["index.md"]
    assert (out / "index.md").read_text() == "# My experiment notes\n"
    assert run(*args, "--force").code == 0
    index = out / "index.md"
    assert index.read_text().startswith("# Launch scripts")
    assert run(*args, "--profile", "fast").code == 0  # its own index is replaced freely
    index.write_text(index.read_text().replace("## Layouts", "## Layouts (my note)"))
    res = run(*args)
    assert res.code == 2 and "index.md" in res.err
    assert "(my note)" in index.read_text()
    # one written before the index carried its hash is quantpatch's
    index.write_text(index.read_text().split("\n<!-- quantpatch body-sha256:")[0])
    assert run(*args).code == 0 and run(*args, "--check").code == 0


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
        "twice": (
            "[models.llama32-1b.args]\nexpert-model-parallel-size = 2\n",
            "llama32-1b/full: expert-model-parallel-size must not be set in args, since the "
            "script passes it itself; drop expert-model-parallel-size from the "
            "[models.llama32-1b.args] table (ep = 2 in the [profiles.full.parallel] table sets "
            "it) in a --config.",
        ),
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
env | grep -E '^(TENSOR_SAVE_|CUSTOM_QUANT_TYPE|CUDA_DEVICE_MAX|QUANTPATCH_FLASH)' | sort \\
    > "$STUB_DIR/env.$$"
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
    "--standalone",
    "--nnodes",
    "1",
    "--nproc-per-node",
    "1",
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
    "--no-persist-layer-norm",
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
    # no scaled_masked_softmax_cuda where the tests run: the script turns the fusion off
    "--no-masked-softmax-fusion",
]


def _attention_env(text: str) -> tuple[str, str]:
    """The QUANTPATCH_FLASH and QUANTPATCH_FLASH_BF16 a script exports by default."""
    found = [
        re.search(rf'^if \[\[ -z "\$\{{{name}:-\}}" \]\]; then {name}=(\S+); fi$', text, re.M)
        for name in ("QUANTPATCH_FLASH", "QUANTPATCH_FLASH_BF16")
    ]
    assert all(found) and "\nexport QUANTPATCH_FLASH QUANTPATCH_FLASH_BF16\n" in text
    return found[0].group(1), found[1].group(1)


def test_the_attention_path_is_chosen_for_the_whole_set(run, tmp_path):
    """--attention auto gives every script of the set, the bf16 baseline's too,
    the path of its FA schemes (flash when one quantizes Q.K^T, else stock); flash and stock
    force it; the scripts export what the runtime reads, and shellcheck finds nothing."""
    common = ("--profile", "smoke", "--models", "llama32-1b", "--datasets", "wikipedia")
    bf16 = "llama32-1b/pretrain_llama32-1b_wikipedia_bf16.sh"
    fa = "llama32-1b/pretrain_llama32-1b_wikipedia_FA_mxfp8.sh"
    cases = [
        ("auto", "bf16,FA_mxfp8", {bf16: ("auto", "1"), fa: ("auto", "1")}),
        ("auto", "bf16,linear_mxfp8", {bf16: ("0", "0")}),
        ("stock", "bf16,FA_mxfp8", {bf16: ("0", "0"), fa: ("0", "0")}),
        ("flash", "bf16", {bf16: ("auto", "1")}),
    ]
    paths = []
    for i, (choice, schemes, want) in enumerate(cases):
        out = tmp_path / f"s{i}"
        res = run("gen-scripts", "--out", out, *common, "--schemes", schemes, "--attention", choice)
        assert res.code == 0, res
        for rel, env in want.items():
            assert _attention_env((out / rel).read_text()) == env, (choice, schemes, rel)
            paths.append(str(out / rel))
    sc = subprocess.run([SHELLCHECK, "-S", "style", *paths], capture_output=True, text=True)
    assert sc.returncode == 0, sc.stdout[-2000:]
    res = run("gen-scripts", "--out", tmp_path / "bad", *common, "--attention", "fast")
    assert res.code == 2 and "--attention: unknown choice 'fast'" in res.err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
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

    runs = tmp_path / "runs" / "llama32-1b_wikipedia_FA_mxfp8_smoke"
    ckpt, tb = str(runs / "checkpoints"), str(runs / "tensorboard")
    expected = [{"CKPT": ckpt, "TB": tb}.get(a, a) for a in EXPECTED_SMOKE_ARGV]
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
    # the check's values in the header, not its sites table (a task's output stays short)
    assert "(smoke): linear=bf16 qk=mxfp8 pv=bf16" in res.stdout and "roles:" not in res.stdout
    # the set holds FA schemes: every run, the bf16 baseline's too, on the flash kernel
    assert "QUANTPATCH_FLASH=auto\nQUANTPATCH_FLASH_BF16=1\n" in saver_env
    said = "[quantpatch] attention: QUANTPATCH_FLASH=auto QUANTPATCH_FLASH_BF16=1 (auto: Q.K^T "
    assert said in next((runs / "logs").glob("*.log")).read_text()
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


def test_real_data_is_checked_before_torchrun(make_checkout, tmp_path, stub_env, run):
    """With MOCK_DATA=0 a missing or unreadable .bin / .idx, or a TOKENIZER_MODEL
    path that does not exist, stops the script before torchrun, exit 2, naming the path and
    the command that makes the dataset; gen-scripts warns in one line."""
    env, stub_dir = stub_env
    root = make_checkout()
    out = tmp_path / "scripts"
    data = tmp_path / "data"
    env["DATA_ROOT"] = str(data)
    res = run("gen-scripts", "--out", out, "--profile", "fast", "--models", "llama32-1b",
              "--datasets", "wikipedia", "--schemes", "bf16")  # fmt: skip
    assert res.code == 0
    warnings = [line for line in res.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "quantpatch data prepare wikipedia" in warnings[0]
    script = out / "llama32-1b" / "pretrain_llama32-1b_wikipedia_bf16.sh"
    prefix = data / "wikipedia" / "llama32-1b_text_document"

    def start(**more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(script)], cwd=root, env={**env, **more}, capture_output=True, text=True
        )

    res = start()
    assert res.returncode == 2 and not list(stub_dir.iterdir())
    said = " ".join(res.stderr.split())
    assert f"{prefix}.bin is missing or unreadable" in said
    assert "quantpatch data prepare wikipedia --input CORPUS --models llama32-1b" in said
    prefix.parent.mkdir(parents=True)
    Path(f"{prefix}.bin").write_bytes(b"")
    res = start()
    assert res.returncode == 2 and f"{prefix}.idx is missing" in res.stderr
    assert not list(stub_dir.iterdir())
    Path(f"{prefix}.idx").write_bytes(b"")
    for bad in (str(tmp_path / "no-such-tokenizer"), "./tok", "a/b/c"):
        res = start(TOKENIZER_MODEL=bad)
        assert res.returncode == 2 and f"TOKENIZER_MODEL={bad} does not exist" in res.stderr
        assert not list(stub_dir.iterdir())
    # a folder or a hub name starts; so does MOCK_DATA=1 with no data at all
    (tmp_path / "tok").mkdir()
    for tok in (str(tmp_path / "tok"), "meta-llama/Llama-3.2-1B"):
        res = start(TOKENIZER_MODEL=tok)
        assert res.returncode == 0, res.stderr
        ((argv, _, _),) = _records(stub_dir)
        assert argv[argv.index("--data-path") + 1] == str(prefix)
        assert argv[argv.index("--tokenizer-model") + 1] == tok
        for f in stub_dir.iterdir():
            f.unlink()
    res = start(DATA_ROOT=str(tmp_path / "elsewhere"), MOCK_DATA="1")
    assert res.returncode == 0, res.stderr
    ((argv, _, _),) = _records(stub_dir)
    assert "--mock-data" in argv


@pytest.mark.slow
def test_extra_arguments_fusion_probe_and_device_connections(
    make_checkout, tmp_path, stub_env, run
):
    """Arguments after `--` and EXTRA_ARGS reach pretrain_gpt.py after the generated ones and
    are logged; a flag the release does not accept stops the launch; the masked-softmax fusion
    follows what the training Python imports; TP > 1 exports CUDA_DEVICE_MAX_CONNECTIONS=1."""
    env, stub_dir = stub_env
    root = make_checkout()
    out = tmp_path / "scripts"
    assert (
        run("gen-scripts", "--out", out, "--profile", "smoke", "--models", "llama32-1b").code == 0
    )
    script = str(out / "llama32-1b" / "pretrain_llama32-1b_wikipedia_bf16.sh")

    def launch(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        for f in stub_dir.iterdir():
            f.unlink()
        return subprocess.run(
            [script, *args], cwd=root, env={**env, **extra}, capture_output=True, text=True
        )

    res = launch(
        "--", "--lr", "2e-4", "--train-iters=7", EXTRA_ARGS="--eval-iters 3 --exit-signal-handler"
    )
    assert res.returncode == 0, res.stderr
    ((argv, _, stub_envs),) = _records(stub_dir)
    assert argv[-7:] == [
        "--no-masked-softmax-fusion",
        "--eval-iters",
        "3",
        "--exit-signal-handler",
        "--lr",
        "2e-4",
        "--train-iters=7",
    ]
    assert "--no-persist-layer-norm" in argv
    assert "extra arguments: --eval-iters 3 --exit-signal-handler --lr 2e-4 --train-iters=7" in (
        res.stdout
    )
    assert "fusions: masked softmax fusion off (no scaled_masked_softmax_cuda in" in res.stdout
    assert "CUDA_DEVICE_MAX_CONNECTIONS=(unset)" in res.stdout  # TP 1: nothing to require
    assert "CUDA_DEVICE_MAX" not in stub_envs
    # quoted words in EXTRA_ARGS stay one word; nothing in them is expanded
    res = launch(EXTRA_ARGS="--wandb-exp-name 'a b $HOME'")
    assert res.returncode == 0, res.stderr
    ((argv, _, _),) = _records(stub_dir)
    assert argv[-2:] == ["--wandb-exp-name", "a b $HOME"]
    # refused before anything starts: an unknown flag, words before `--`, an unclosed quote
    for args, extra, says in (
        (("--", "--no-such-flag", "1"), {}, "does not accept --no-such-flag"),
        ((), {"EXTRA_ARGS": "--lr=1 --bogus-flag"}, "does not accept --bogus-flag"),
        (("--lr",), {}, "takes pretrain_gpt.py arguments after '--'"),
        ((), {"EXTRA_ARGS": "--lr 'x"}, "cannot be split as bash words"),
        ((), {"MASKED_SOFTMAX_FUSION": "maybe"}, "MASKED_SOFTMAX_FUSION must be auto, on or off"),
    ):
        res = launch(*args, **extra)
        assert res.returncode == 2 and says in res.stderr, (args, res.stderr)
        assert not _records(stub_dir)
    # a training Python that imports the fused softmax extension keeps Megatron's default
    fake = tmp_path / "fused"
    fake.mkdir()
    (fake / "scaled_masked_softmax_cuda.py").write_text("")
    res = launch(PYTHONPATH=str(fake), PYTHON=sys.executable)
    assert res.returncode == 0, res.stderr
    ((argv, _, _),) = _records(stub_dir)
    assert "--no-masked-softmax-fusion" not in argv
    assert "masked softmax fusion on (scaled_masked_softmax_cuda imports in" in res.stdout
    res = launch(MASKED_SOFTMAX_FUSION="off", PYTHONPATH=str(fake), PYTHON=sys.executable)
    ((argv, _, _),) = _records(stub_dir)
    assert argv[-1] == "--no-masked-softmax-fusion"
    # TP 2 (sequence parallel stays off with the local RMSNorm): the connections variable is set
    res = launch(TP="2", GPUS_PER_NODE="2")
    assert res.returncode == 0, res.stderr
    ((argv, _, stub_envs),) = _records(stub_dir)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in stub_envs
    assert "--sequence-parallel" not in argv and "sequence parallel off" in res.stdout
    assert launch(TP="2", GPUS_PER_NODE="2", CUDA_DEVICE_MAX_CONNECTIONS="4").returncode == 0
    assert "CUDA_DEVICE_MAX_CONNECTIONS=4" in _records(stub_dir)[0][2]
    res = launch(TP="2", GPUS_PER_NODE="2", SEQUENCE_PARALLEL="on")
    assert res.returncode == 2
    assert "their RMSNorm is torch's norm (WrappedTorchNorm), which refuses it" in res.stderr
    assert "SEQUENCE_PARALLEL=off" in res.stderr


@pytest.mark.slow
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
        "quantpatch__linear-hifp8_qk-hifp8_pv-bf16",
        "quantpatch__linear-mxfp4_qk-bf16_pv-bf16",
    ]
    assert git.Repo(root).active_branch.name == "main" and not git.Repo(root).is_dirty()


def test_run_dry_run_prints_the_command(make_checkout, tmp_path, stub_env):
    env, stub_dir = stub_env
    root = make_checkout()
    write_parser(root)  # the checkout's own parser (untracked: worktrees need not hold it)
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
    assert "validated against the checkout's Megatron 0.15.0rc3" in res.stderr
    line = res.stdout.strip().splitlines()[-1]
    assert (
        line.startswith("cd ")
        and " && torchrun --standalone --nnodes 1 --nproc-per-node 1 " in line
    )
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


# -- the checkout's own Megatron-LM release ------------------------------------------------


def _megatron_checkout(root: Path, **parser: object) -> Path:
    """A git checkout whose parser accepts the bundled core_v0.13.1 flags (some of them from a
    fork's extension module) and says it is 0.15.0rc3."""
    write_parser(root, extension=["--transformer-impl", "--num-layers"], **parser)
    (root / "README.md").write_text("a Megatron-LM checkout\n")
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "Test")
        cw.set_value("user", "email", "test@example.com")
    repo.git.add("-A")
    repo.git.commit("-qm", "fixture")
    return root


def test_gen_scripts_inside_a_checkout_uses_its_own_parser(run, tmp_path, monkeypatch):
    root = _megatron_checkout(tmp_path / "Megatron-LM")
    monkeypatch.chdir(root / "megatron" / "training")  # the git root above is found
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out)
    assert res.code == 0, res
    assert (
        "validated against the checkout's Megatron 0.15.0rc3 (megatron/training/arguments.py, "
        "megatron/training/quant_extension_args.py, 502 flags)" in res.out
    )
    assert "60 torchrun scripts (full, Megatron-LM 0.15.0rc3)" in res.out
    paths = sorted(out.rglob("*.sh"))
    assert len(paths) == 60
    for path in paths:
        header = path.read_text().split("\n", 3)[2]
        assert header.startswith("# generated by quantpatch ") and f"for {CHECKOUT};" in header
    assert f"for {CHECKOUT}, profile `full`" in (out / "index.md").read_text()
    assert len(list((root / ".git" / "quantpatch" / "cache").glob("flags-*.json"))) == 1
    assert run("gen-scripts", "--out", out, "--check").code == 0
    # an explicit release keeps using the bundled list (and is recorded as such)
    res = run("gen-scripts", "--out", out, "--megatron-release", "core_v0.13.1")
    assert res.code == 0 and "the bundled Megatron-LM core_v0.13.1 flag list" in res.out
    assert f"for {BUNDLED};" in paths[0].read_text()
    res = run("gen-scripts", "--out", out, "--check")
    assert res.code == 1  # the recorded release differs from the checkout's
    # --repo names the checkout from anywhere
    monkeypatch.chdir(tmp_path)
    res = run("gen-scripts", "--out", out, "--repo", root)
    assert res.code == 0 and "checkout's Megatron 0.15.0rc3" in res.out
    assert f"for {CHECKOUT};" in paths[0].read_text()


def test_warm_gen_scripts_in_a_checkout_never_loads_libcst(tmp_path):
    root = _megatron_checkout(tmp_path / "Megatron-LM")
    code = (
        "import sys; from quantpatch.cli import main\n"
        f"sys.argv = ['quantpatch', 'gen-scripts', '--out', {str(tmp_path / 's')!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print('libcst' in sys.modules)\n"
    )
    cold, warm = (
        subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
        ).stdout.split()[-1]
        for _ in range(2)
    )
    assert (cold, warm) == ("True", "False")


def test_a_flag_the_checkout_does_not_accept(run, tmp_path, monkeypatch):
    root = _megatron_checkout(
        tmp_path / "Megatron-LM", drop=["--no-gradient-accumulation-fusion", "--mscale"]
    )
    monkeypatch.chdir(root)
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out)
    assert res.code == 2
    assert res.err.startswith(
        "error: Megatron-LM 0.15.0rc3 does not accept --no-gradient-accumulation-fusion "
        "(used by llama31-8b/full, llama32-1b/full, deepseek2_lite/full), --mscale (used by "
        f"deepseek2_lite/full), checked against {root / 'megatron/training/arguments.py'}; "
        "set no-gradient-accumulation-fusion = false, mscale = false in the "
        "[profiles.full.args] table of a --config to leave them out."
    ), res.err
    assert res.err.count(". ") == 0 and res.err.rstrip().endswith(".")
    assert not out.exists()
    # followed as written: those entries in that table, and every script is one the
    # checkout's own parser takes
    said = " ".join(res.err.split())
    cfg = tmp_path / "mine.toml"
    cfg.write_text(_config_from_hint(said))
    res = run("gen-scripts", "--out", out, "--config", cfg)
    assert res.code == 0, res
    accepted = release_flags("core_v0.13.1") - {"--no-gradient-accumulation-fusion", "--mscale"}
    for path in out.rglob("*.sh"):
        assert _argument_flags(path.read_text()) <= accepted, path
    res = run("gen-scripts", "--out", tmp_path / "smoke", "--models", "llama32-1b", "--profile",
              "smoke")  # fmt: skip
    assert res.code == 2 and "(used by llama32-1b/smoke), checked" in res.err
    # run refuses the same way before anything is launched
    res = run("run", "--model", "llama32-1b", "--dataset", "dolma", "--scheme", "bf16", "--dry-run")
    assert res.code == 2 and "does not accept --no-gradient-accumulation-fusion" in res.err


def test_a_flag_the_script_passes_itself_unaccepted_followed(run, tmp_path):
    """A checkout whose parser lacks a flag every script passes itself: no --config entry can
    leave it out, so the refusal names the checkout, and the same command run from one that
    has it (--repo, as it says) is accepted."""
    old = _megatron_checkout(tmp_path / "old", drop=["--tensor-model-parallel-size"])
    out = tmp_path / "scripts"
    command = ["gen-scripts", "--out", str(out), "--models", "llama32-1b", "--profile", "smoke"]
    res = run(*command, "--repo", old)
    said = " ".join(res.err.split())
    assert res.code == 2 and not out.exists(), res
    assert said.endswith(
        "the scripts pass --tensor-model-parallel-size themselves, so run them from a "
        "Megatron-LM checkout that has it (--repo names one)."
    ), said
    assert re.search(r"\((--repo) names one\)", said)
    good = _megatron_checkout(tmp_path / "good")
    res = run(*command, "--repo", good)
    assert res.code == 0, res
    for path in out.rglob("*.sh"):
        assert "--tensor-model-parallel-size" in path.read_text()


def _config_from_hint(said: str) -> str:
    """The --config a refusal's ``set k = v, ... in the [T] table; ... of a --config`` asks
    for, as TOML."""
    wanted = re.search(r"\bset (.+?) of a --config", said)
    assert wanted, said
    out = ""
    for part in wanted[1].split("; "):
        keys, table = re.fullmatch(r"(.+) in the \[([\w.-]+)\] table", part).groups()
        out += f"[{table}]\n" + "".join(f"{kv}\n" for kv in keys.split(", "))
    return out


def test_a_parser_that_does_not_parse_names_file_and_line(run, tmp_path, monkeypatch):
    root = _megatron_checkout(tmp_path / "Megatron-LM")
    path = root / "megatron" / "training" / "arguments.py"
    lines = path.read_text().splitlines(keepends=True)
    bad = next(i for i, line in enumerate(lines) if "'--seq-length'" in line)
    lines[bad] = lines[bad].replace("'--seq-length',", "'--seq-length' type=int,")
    path.write_text("".join(lines))
    monkeypatch.chdir(root)
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out)
    assert res.code == 2
    assert f"error: {path}:{bad + 1}: the file does not parse as Python" in res.err, res.err
    assert not out.exists()


def test_outside_a_checkout_the_bundled_list_is_used(run, tmp_path, make_checkout, monkeypatch):
    out = tmp_path / "s"
    res = run("gen-scripts", "--out", out, "--models", "llama32-1b", "--schemes", "bf16")
    assert res.code == 0
    assert (
        "validated against the bundled Megatron-LM core_v0.13.1 flag list (502 flags; "
        f"no megatron/training/arguments.py in {Path.cwd()})" in res.out
    )
    assert all(f"for {BUNDLED};" in p.read_text() for p in out.rglob("*.sh"))
    # a git checkout without megatron/training/arguments.py (a megatron-core tree) likewise
    root = make_checkout()
    monkeypatch.chdir(root)
    res = run("gen-scripts", "--out", out, "--models", "llama32-1b", "--schemes", "bf16")
    assert res.code == 0 and f"no megatron/training/arguments.py in {root}" in res.out


@pytest.mark.parametrize("model", ["llama31-8b", "llama32-1b", "deepseek2_lite"])
@pytest.mark.parametrize("profile", PROFILES)
def test_no_script_passes_a_flag_twice(model, profile):
    """The arrays the script hands to pretrain_gpt.py, as bash builds them, in both data modes
    and with tensor parallelism on and off."""
    reg = load_registry()
    (script,) = render_all(reg, [model], ["dolma"], ["bf16"], profile, "core_v0.13.1")
    section = script.text.split("# ---- pretrain_gpt.py arguments", 1)[1]
    section = section.split("# ---- end of arguments", 1)[0]
    arrays = ("MODEL", "TRAINING", "IMPL", "PARALLEL", "DATA", "OUTPUT")
    show = "printf '%s\\n' " + " ".join(f'"${{{a}_ARGS[@]}}"' for a in arrays)
    for mock, tp in ((0, 1), (1, 1), (0, 2), (1, 2)):
        # what `quantpatch layout --line` said, and the other sizes' switches flipped with TP
        sizes = {"LAYOUT": f"...; sequence parallel {'on' if tp > 1 else 'off'}; ..."}
        if tp > 1:
            sizes.update(VPP="2", ETP="1", CP="2")
        argv = subprocess.run(
            ["bash", "-c", section + show],
            env={"PATH": os.environ["PATH"], "MOCK_DATA": str(mock), "TP": str(tp), **sizes},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        flags = [a for a in argv if a.startswith("--")]
        assert flags and len(flags) == len(set(flags)), (mock, tp, flags)
        assert ("--sequence-parallel" in flags) == (tp > 1)
        moe = model == "deepseek2_lite"
        assert flags.count("--expert-model-parallel-size") == (1 if moe else 0)
        assert flags.count("--expert-tensor-parallel-size") == (1 if moe and tp > 1 else 0)
        assert flags.count("--num-virtual-stages-per-pipeline-rank") == (tp > 1)
        assert flags.count("--context-parallel-size") == (tp > 1)


def test_nvfp4_schemes_are_listed_chosen_by_name_and_by_all_but_not_by_default(run, tmp_path):
    reg = load_registry()
    nv = ["FA_nvfp4", "linear_nvfp4", "FA_linear_nvfp4"]
    assert [reg.schemes[n].values() for n in nv] == [
        {"linear": "bf16", "qk": "nvfp4", "pv": "bf16"},
        {"linear": "nvfp4", "qk": "bf16", "pv": "bf16"},
        {"linear": "nvfp4", "qk": "nvfp4", "pv": "bf16"},
    ]
    default = reg.pick("schemes", None)
    assert len(default) == 10 and not set(nv) & set(default)
    paretoq = ["paretoq_w1.58", "paretoq_w2", "paretoq_w4g128"]
    recipe = [  # NVIDIA's NVFP4 recipe and its ablations
        "nvfp4_recipe",
        "nvfp4_recipe_no_rht",
        "nvfp4_recipe_no_bf16_layers",
        "nvfp4_recipe_no_2d",
        "nvfp4_recipe_4over6",  # TE's 4over6 block scaling
    ]
    fp8 = [  # NVIDIA's MXFP8 recipe, the RCEIL values, TE's FP8 recipes
        "mxfp8_recipe",
        "linear_mxfp8-rceil",
        "FA_linear_mxfp8-rceil",
        "linear_mxfp4-rceil",
        "linear_fp8-tensor",
        "linear_fp8-block",
        "linear_fp8-delayed",  # TE's delayed scaling, Megatron's default --fp8-recipe
        "linear_fp8-delayed-e4m3",
    ]
    te = [  # Megatron's FP8 recipes as Megatron + TransformerEngine quantize
        "te_mxfp8_e4m3",
        "te_mxfp8_hybrid",
        "te_tensorwise_hybrid",
        "te_tensorwise_e4m3",
        "te_blockwise_e4m3",
        "te_blockwise_hybrid",
        "te_delayed_hybrid",
        "te_delayed_e4m3",
    ]  # (their native twins need TransformerEngine: by name only, never by all)
    assert reg.pick("schemes", ["all"]) == [*default, *nv, *paretoq, *recipe, *fp8, *te]
    res = run("list")
    assert res.code == 0 and all(n in res.out for n in nv + fp8)
    res = run("gen-scripts", "--out", tmp_path / "all", "--schemes", "all")
    assert res.code == 0, res
    n_schemes = len(reg.pick("schemes", ["all"]))
    written = len(list((tmp_path / "all").rglob("*.sh")))
    models, datasets = len(reg.pick("models", None)), len(reg.pick("datasets", None))
    assert written == n_schemes * models * datasets, (
        f"{written} scripts, not one per scheme ({n_schemes}), default model ({models}) and "
        f"dataset ({datasets})"
    )
    names = {p.name for p in (tmp_path / "all").rglob("*.sh")}
    assert "pretrain_llama32-1b_dolma_linear_fp8-block.sh" in names
    res = run("gen-scripts", "--out", tmp_path / "one", "--schemes", "linear_nvfp4")
    assert res.code == 0, res
    paths = sorted((tmp_path / "one").rglob("*.sh"))
    assert len(paths) == 6 and all(p.name.endswith("_linear_nvfp4.sh") for p in paths)
    assert "readonly QUANT_LINEAR=nvfp4" in paths[0].read_text()


def test_list_states_every_value_with_its_reference(run):
    """``list --json`` carries the table of values (quantpatch.base.values); the text table
    shows each value with its family, elements, block and scale rule."""
    from quantpatch.base.config import QUANT_TYPES

    res = run("list", "--json")
    assert res.code == 0
    values = {v["name"]: v for v in json.loads(res.out)["values"]}
    assert set(values) == set(QUANT_TYPES)
    assert values["mxfp8-rceil"] == {
        "name": "mxfp8-rceil",
        "roles": ["linear", "qk", "pv"],
        "family": "mx",
        "element_forward": "e4m3",
        "element_gradient": "e4m3",
        "block": [1, 32],
        "weight_block": None,
        "scale": "e8m0-rceil",
        "rht": False,
        "gradient_rounding": "nearest",
        "fused_gemm": True,
        "reference": values["mxfp8-rceil"]["reference"],
        "megatron": "--fp8-format e4m3 --fp8-recipe mxfp8",
        "four_over_six": None,
        "e4m3_max": None,
    }
    # the Megatron flags each value emulates, as TE's recipes name them (none for the others)
    assert {n: v["megatron"] for n, v in values.items() if v["megatron"]} == {
        "mxfp8-rceil": "--fp8-format e4m3 --fp8-recipe mxfp8",
        "mxfp8-rceil-hybrid": "--fp8-format hybrid --fp8-recipe mxfp8",
        "fp8-tensor": "--fp8-format hybrid --fp8-recipe tensorwise",
        "fp8-tensor-e4m3": "--fp8-format e4m3 --fp8-recipe tensorwise",
        "fp8-block": "--fp8-format e4m3 --fp8-recipe blockwise",
        "fp8-block-hybrid": "--fp8-format hybrid --fp8-recipe blockwise",
        "fp8-delayed": "--fp8-format hybrid --fp8-recipe delayed",
        "fp8-delayed-e4m3": "--fp8-format e4m3 --fp8-recipe delayed",
    }
    assert "ScaleCalculationMode.RCEIL" in values["mxfp8-rceil"]["reference"]
    assert values["fp8-block"]["weight_block"] == [128, 128]
    assert values["nvfp4-2d"]["weight_block"] == [16, 16] and values["nvfp4-rht"]["rht"]
    assert "NVFP4QuantizerRef" in values["nvfp4"]["reference"]
    text = run("list").out
    assert "e8m0-rceil" in text and "fp8-block" in text and "128 x 128" in text


def test_an_unknown_dataset_names_the_config_table_and_its_fields(run, tmp_path):
    """Bringing one's own dataset: the refusal names `--config`, the
    `[datasets.NAME]` table and every field it needs (`split` explained), and a config with
    that table makes the same `data status` / `gen-scripts` work."""
    res = run("data", "status", "--datasets", "mytext")
    said = " ".join(res.err.split())
    assert res.code == 2, res
    assert (
        "unknown dataset 'mytext'; valid: wikipedia, dolma; one of your own is a "
        "[datasets.mytext] table in a TOML file given with --config, with description, prefix "
        '(e.g. "{data_root}/mytext/{model}_text_document", where data prepare writes it), '
        'split (Megatron\'s --split train,valid,test weights, e.g. "949,50,1")'
    ) in said
    cfg = tmp_path / "mine.toml"
    cfg.write_text(
        '[datasets.mytext]\ndescription = "my corpus"\n'
        'prefix = "{data_root}/mytext/{model}_text_document"\nsplit = "949,50,1"\n'
    )
    res = run("data", "status", "--datasets", "mytext", "--models", "llama32-1b",
              "--config", cfg, "--data-root", tmp_path)  # fmt: skip
    assert res.code == 0 and "mytext" in res.out, res
    res = run("gen-scripts", "--out", tmp_path / "s", "--datasets", "mytext", "--models",
              "llama32-1b", "--schemes", "bf16", "--config", cfg)  # fmt: skip
    assert res.code == 0, res
