"""Every generated script starts Megatron: its arguments go through what ``pretrain_gpt.py``
does before the first step, on CPU, with megatron-core's own code (``megatron_startup_probe``).

The scripts are generated for an ``init``ed checkout of the real megatron-core 0.13.1 tree,
launched through a stub ``torchrun`` that records the exact argv and environment, and each
recorded launch is handed to the probe: the argument namespace with core_v0.13.1's defaults,
the validation that decides what is built, ``initialize_model_parallel`` over a fake process
group of the run's world size, the micro-batch calculator, and the first and last pipeline
stage's ``GPTModel`` built from the local layer spec. The same table runs on a fork-shaped
clone (``tests/forklike.py``: its local ``DotProductAttention`` lacks MLA's head dims until
``init``) with the scripts validated against its 0.15.0rc3 parser; that parser is a flag list
only, so there the namespace comes from the table too. Every model x profile at its default
layout runs, with a table of other layouts; launches the scripts refuse are checked to be ones
Megatron refuses too.

PyPI's megatron-core holds ``megatron/core`` only, so by default the argument namespace comes
from a table of core_v0.13.1's parser (``data/megatron-args-core_v0.13.1.json``) and the probe
mirrors the parts of ``validate_args`` that decide what is built. With
``QUANTPATCH_MEGATRON_LM`` naming a Megatron-LM clone at core_v0.13.1 (and its Python
dependencies installed), the same test runs on that clone: the scripts are validated against
its parser, and the probe calls its own ``parse_args``, ``validate_args`` and
``core_transformer_config_from_args``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import git
import pytest

from quantpatch.checkout.init import init
from quantpatch.launch.registry import load_registry

from .test_scripts import QUANTPATCH, STUB, _records

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

PROBE = Path(__file__).with_name("megatron_startup_probe.py")
MODELS = ("llama31-8b", "llama32-1b", "deepseek2_lite")
PROFILES = ("smoke", "fast", "full")
# (model, profile, environment): layouts besides the defaults, each one Megatron must build
LAYOUTS: list[tuple[str, str, dict[str, str]]] = [
    # the README's example: 16 GPUs, TP 2 (sequence parallel stays off with the local norms)
    ("llama31-8b", "full", {"NNODES": "2", "MASTER_ADDR": "node-0", "TP": "2"}),
    ("llama31-8b", "full", {"TP": "4", "PP": "2"}),
    ("llama31-8b", "fast", {"PP": "2", "VPP": "2"}),
    ("llama32-1b", "fast", {"TP": "2", "PP": "2", "VPP": "2", "GLOBAL_BATCH_SIZE": "64"}),
    ("llama32-1b", "smoke", {"GPUS_PER_NODE": "2", "TP": "2"}),
    ("deepseek2_lite", "full", {"EP": "8"}),
    ("deepseek2_lite", "fast", {"TP": "2"}),
    ("deepseek2_lite", "smoke", {"GPUS_PER_NODE": "4", "EP": "2", "PP": "2"}),
]
# (model, profile, environment, what the script says): layouts the scripts refuse
REFUSED: list[tuple[str, str, dict[str, str], str]] = [
    (
        "llama31-8b",
        "full",
        {"TP": "2", "SEQUENCE_PARALLEL": "on"},
        "SEQUENCE_PARALLEL=off",
    ),
    (
        "deepseek2_lite",
        "full",
        {"TP": "2", "EP": "2"},
        "needs sequence parallel, which the local layers cannot run",
    ),
    (
        "llama31-8b",
        "fast",
        {"PP": "4", "VPP": "2", "GLOBAL_BATCH_SIZE": "6"},
        "GLOBAL_BATCH_SIZE=8",
    ),
]


def _probe(cases: list[dict], root: Path, tmp_path: Path) -> dict[str, dict]:
    src, out = tmp_path / "cases.json", tmp_path / "results.json"
    src.write_text(json.dumps(cases))
    res = subprocess.run(
        [sys.executable, str(PROBE), str(src), str(out)],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return {r["name"]: r for r in json.loads(out.read_text())}


def _launch(
    script: Path, root: Path, env: dict[str, str], stub_dir: Path, vocab: int
) -> dict | str:
    """The launch the script makes (argv after pretrain_gpt.py, environment, world), or the
    refusal it prints."""
    for f in stub_dir.iterdir():
        f.unlink()
    res = subprocess.run([str(script)], cwd=root, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        return res.stderr
    ((argv, _, stub_env),) = _records(stub_dir)
    nodes = int(argv[argv.index("--nnodes") + 1])
    per_node = int(argv[argv.index("--nproc-per-node") + 1])
    launch_env = dict(line.split("=", 1) for line in stub_env.splitlines() if "=" in line)
    return {
        "argv": argv[argv.index("pretrain_gpt.py") + 1 :],
        "env": launch_env,
        "world": nodes * per_node,
        "vocab": vocab,
    }


def _launch_all(root: Path, tmp: Path) -> dict[str, dict | str]:
    """Every launch of the table, made by the bf16 scripts ``gen-scripts`` writes for the
    ``init``ed checkout ``root`` (no warning: every model can be built there)."""
    bin_dir, stub_dir = tmp / "bin", tmp / "stub"
    bin_dir.mkdir()
    stub_dir.mkdir()
    (bin_dir / "torchrun").write_text(STUB)
    (bin_dir / "torchrun").chmod(0o755)
    base_env = {
        **{k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(stub_dir),
        "QUANTPATCH": QUANTPATCH,
        "OUTPUT_ROOT": str(tmp / "runs"),
        "DATA_ROOT": str(tmp / "data"),  # the scripts check the dataset exists
    }
    (tmp / "data" / "wikipedia").mkdir(parents=True)
    for model in MODELS:
        for suffix in (".bin", ".idx"):
            (tmp / "data" / "wikipedia" / f"{model}_text_document{suffix}").write_bytes(b"")
    scripts = tmp / "scripts"
    for profile in PROFILES:
        res = subprocess.run(
            [
                QUANTPATCH,
                "--repo",
                str(root),
                "gen-scripts",
                "--out",
                str(scripts / profile),
                "--profile",
                profile,
                "--datasets",
                "wikipedia",
                "--schemes",
                "bf16",
            ],
            # the data the scripts read is there, so gen-scripts has no data warning either
            env={**os.environ, "DATA_ROOT": base_env["DATA_ROOT"]},
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        assert "warning:" not in res.stderr, res.stderr

    def script(model: str, profile: str) -> Path:
        return scripts / profile / model / f"pretrain_{model}_wikipedia_bf16.sh"

    vocab = {m: load_registry(None).models[m].vocab_size for m in MODELS}
    launches: dict[str, dict | str] = {}
    for model in MODELS:
        for profile in PROFILES:
            launches[f"{model}/{profile}"] = _launch(
                script(model, profile), root, base_env, stub_dir, vocab[model]
            )
    for model, profile, env in [*LAYOUTS, *((m, p, e) for m, p, e, _ in REFUSED)]:
        name = f"{model}/{profile} " + " ".join(f"{k}={v}" for k, v in env.items())
        launches[name] = _launch(
            script(model, profile), root, {**base_env, **env}, stub_dir, vocab[model]
        )
    return launches


@pytest.fixture(scope="module")
def launched(tmp_path_factory, trees):
    """Every launch of the table, made by the generated scripts of an ``init``ed checkout."""
    tmp = tmp_path_factory.mktemp("startup")
    root = tmp / "megatron-lm"
    full = os.environ.get("QUANTPATCH_MEGATRON_LM")
    if full:  # a Megatron-LM clone at core_v0.13.1: its own parser and validate_args are used
        shutil.copytree(full, root, ignore=shutil.ignore_patterns(".git"))
    else:
        shutil.copytree(trees["0.13.1"], root / "megatron")
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as cw:
        cw.set_value("user", "name", "Test")
        cw.set_value("user", "email", "test@example.com")
    repo.git.add("-A")
    repo.git.commit("-qm", "megatron-core 0.13.1")
    init(root)
    return root, _launch_all(root, tmp)


@pytest.fixture(scope="module")
def launched_on_the_fork(tmp_path_factory, trees):
    """The same launches on a fork-shaped clone (``git clone -b quant``: history, label sites,
    its own dispatch chains and saver, a 0.15.0rc3 parser, its local DotProductAttention
    without MLA's head dims) after ``init``."""
    from .forklike import build_fork, clone_quant

    tmp = tmp_path_factory.mktemp("startup-fork")
    fork = build_fork(tmp / "origin", trees["0.13.1"], history=2, full=True)
    root = clone_quant(fork, tmp / "Megatron-LM")
    init(root)
    return root, _launch_all(root, tmp)


def _every_launch_starts(root: Path, launches: dict[str, dict | str], tmp_path: Path) -> None:
    refused = {k: v for k, v in launches.items() if isinstance(v, str)}
    expected_refusals = {
        f"{m}/{p} " + " ".join(f"{k}={v}" for k, v in e.items()): says for m, p, e, says in REFUSED
    }
    assert set(refused) == set(expected_refusals), refused
    for name, says in expected_refusals.items():
        assert says in refused[name], (name, refused[name])
    cases = [{"name": n, **v} for n, v in launches.items() if isinstance(v, dict)]
    assert len(cases) == len(MODELS) * len(PROFILES) + len(LAYOUTS)
    results = _probe(cases, root, tmp_path)
    failed = {n: r["error"] for n, r in results.items() if not r["ok"]}
    assert not failed, json.dumps(failed, indent=1)[:6000]
    for name, r in results.items():
        assert r["built"], name
    # what was built: MLA with the local attention, MoE layers, every pipeline stage
    ds = " ".join(results["deepseek2_lite/full"]["built"])
    assert "multi_latent_attention.MLASelfAttention" in ds and "moe_layer.MoELayer" in ds
    assert "dot_product_attention.DotProductAttention" in ds and "27 layers" in ds
    pp = results["llama31-8b/full TP=4 PP=2"]["built"]
    assert len(pp) == 2 and all("16 layers" in b for b in pp)
    # TP > 1 launches carry the variable Megatron requires
    readme = launches["llama31-8b/full NNODES=2 MASTER_ADDR=node-0 TP=2"]
    assert isinstance(readme, dict) and readme["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "--sequence-parallel" not in readme["argv"]


def test_every_model_profile_and_layout_starts_megatron(launched, tmp_path):
    root, launches = launched
    _every_launch_starts(root, launches, tmp_path)


def test_every_model_profile_and_layout_starts_megatron_on_the_fork_clone(
    launched_on_the_fork, tmp_path
):
    """The fork clone's own code builds every launch, DeepSeek-V2-Lite's MLA included (the
    head dims ``init`` gave its DotProductAttention)."""
    root, launches = launched_on_the_fork
    _every_launch_starts(root, launches, tmp_path)


def test_megatron_refuses_what_the_scripts_refuse_and_what_they_leave_out(launched, tmp_path):
    """Each rule the scripts follow is one Megatron enforces: the launches without it fail in
    the probe with Megatron's own message (the state before this change)."""
    root, launches = launched
    smoke = launches["llama32-1b/smoke"]
    tp2 = launches["llama32-1b/smoke GPUS_PER_NODE=2 TP=2"]
    ds = launches["deepseek2_lite/smoke"]
    vpp = launches["llama32-1b/fast TP=2 PP=2 VPP=2 GLOBAL_BATCH_SIZE=64"]
    assert all(isinstance(x, dict) for x in (smoke, tp2, ds, vpp))

    def without(launch: dict, *flags: str) -> list[str]:
        return [a for a in launch["argv"] if a not in flags]

    def replaced(argv: list[str], flag: str, value: str) -> list[str]:
        out = list(argv)
        out[out.index(flag) + 1] = value
        return out

    cases = [
        # persist_layer_norm (Megatron's default) with the local RMSNorm
        ("persist", without(smoke, "--no-persist-layer-norm"), {}, 1, "persist_layer_norm"),
        # sequence parallel with the local RMSNorm
        (
            "sp",
            [*tp2["argv"], "--sequence-parallel"],
            tp2["env"],
            2,
            "sequence parallel not supported by torch LayerNorm",
        ),
        # TP 2 without CUDA_DEVICE_MAX_CONNECTIONS=1
        ("connections", tp2["argv"], {}, 2, "CUDA_DEVICE_MAX_CONNECTIONS"),
        # VPP with micro-batches that are not a multiple of PP (64 / (1 x 2) = 32 -> 6 / 2 = 3)
        (
            "vpp",
            replaced(vpp["argv"], "--global-batch-size", "6"),
            vpp["env"],
            8,
            "the remainder of M=3 by N=2",
        ),
        # expert parallel with TP and no sequence parallel
        (
            "ep",
            [
                *replaced(ds["argv"], "--tensor-model-parallel-size", "2"),
                *("--expert-model-parallel-size", "2"),
            ],
            {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
            4,
            "sequence parallelism must be used",
        ),
    ]
    results = _probe(
        [{"name": n, "argv": a, "env": e, "world": w, "vocab": 128256} for n, a, e, w, _ in cases],
        root,
        tmp_path,
    )
    for name, _, _, _, says in cases:
        assert not results[name]["ok"] and says in results[name]["error"], results[name]


def test_mla_needs_the_head_dims_init_teaches(launched, tmp_path, trees):
    """Stock megatron-core 0.13.1 cannot build DeepSeek-V2-Lite with the local attention (MLA
    hands it k_channels / v_channels); the checkout ``init`` made can."""
    _, launches = launched
    ds = launches["deepseek2_lite/smoke"]
    assert isinstance(ds, dict)
    stock = tmp_path / "stock"
    shutil.copytree(trees["0.13.1"], stock / "megatron")
    results = _probe([{"name": "stock", **ds}], stock, tmp_path)
    assert not results["stock"]["ok"]
    assert "unexpected keyword argument 'k_channels'" in results["stock"]["error"]
