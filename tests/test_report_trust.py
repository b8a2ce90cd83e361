"""A sweep's report a researcher can share and trust: every fact it states true
(mock data, the attention path, the dataset's files, the tokenizer folder), paths that work
from any directory, files colleagues can read, provenance, validation loss and the noise of
seeds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .test_data_prepare import corpus, make_tokenizer, write_jsonl
from .test_scripts import QUANTPATCH
from .test_sweep import (
    SELECT,
    calls,
    record,
    sweep_env,  # noqa: F401 (the fixture)
)

DOC = "llama32-1b_text_document"


def run_cli(*args, env=None, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [QUANTPATCH, "data", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


def prepare(tok: Path | str, src: Path, root: Path, *, cwd: Path | None = None):
    return run_cli("prepare", "wikipedia", "--input", src, "--models", "llama32-1b",
                   "--tokenizer", f"llama32-1b={tok}", "--data-root", root,
                   cwd=cwd)  # fmt: skip


def status(root: Path, tokenizer: str | None, *, cwd: Path | None = None):
    env = {"TOKENIZER_MODEL": tokenizer} if tokenizer else {}
    return run_cli("status", "--models", "llama32-1b", "--datasets", "wikipedia",
                   "--data-root", root, "--json", env=env, cwd=cwd)  # fmt: skip


# -- the dataset's files against the manifest --------------------------------------------


def test_a_file_cut_or_replaced_differs_from_its_manifest(tmp_path):
    """The comparison itself, on files written here: the size first, then the hash of head
    and tail (a file of the same size with other content at its end)."""
    from quantpatch.data_prep.layout import SAMPLE_BYTES, files_problem, sample_hash

    prefix = tmp_path / "doc"
    data = {"bin": os.urandom(3 * SAMPLE_BYTES + 5), "idx": os.urandom(300)}
    for s, b in data.items():
        Path(f"{prefix}.{s}").write_bytes(b)
    manifest = {
        "files": {s: len(b) for s, b in data.items()},
        "samples": {s: sample_hash(Path(f"{prefix}.{s}")) for s in data},
    }
    assert files_problem(prefix, manifest) is None
    Path(f"{prefix}.bin").write_bytes(data["bin"][:100])
    assert "doc.bin is 100 bytes, its manifest says 3,145,733" in str(
        files_problem(prefix, manifest)
    )
    Path(f"{prefix}.bin").write_bytes(data["bin"][:-1] + bytes([data["bin"][-1] ^ 1]))
    assert "doc.bin's content is not what its manifest recorded" in str(
        files_problem(prefix, manifest)
    )
    Path(f"{prefix}.bin").write_bytes(data["bin"])
    del manifest["samples"]  # a manifest of the previous release: sizes only
    assert files_problem(prefix, manifest) is None


@pytest.mark.slow  # 9 s alone, 40 s on a busy machine: three data prepare runs
def test_status_and_the_launch_check_find_a_cut_or_swapped_dataset(tok, tmp_path):
    """`.bin` cut to 0 and to 100 bytes, and `.bin`/`.idx` swapped for another tokenizer's
    (the same sizes would pass a size check: the hash of head and tail does not): `data
    status` says so and exits 1, the pre-launch check refuses with the same finding."""
    from quantpatch.data_prep.layout import Need

    src = write_jsonl(tmp_path / "c.jsonl", corpus(60))
    root, other = tmp_path / "d", tmp_path / "o"
    assert prepare(tok, src, root).returncode == 0
    other_tok = make_tokenizer(tmp_path / "tok2", vocab=300)
    assert prepare(other_tok, src, other).returncode == 0
    prefix = root / "wikipedia" / DOC
    manifest = json.loads(Path(f"{prefix}.json").read_text())
    assert set(manifest["samples"]) == {"bin", "idx"}
    assert manifest["sha256"]["bin"].startswith("sha256:")
    good = {s: Path(f"{prefix}.{s}").read_bytes() for s in ("bin", "idx")}
    res = status(root, str(tok))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["datasets"][0]["files_match"] is True
    need = Need("llama32-1b", "wikipedia", prefix, str(tok))
    assert need.problem() is None

    def cut(n: int) -> None:
        Path(f"{prefix}.bin").write_bytes(good["bin"][:n])

    def swapped() -> None:
        for s in ("bin", "idx"):
            shutil.copyfile(other / "wikipedia" / f"{DOC}.{s}", f"{prefix}.{s}")
        # the other tokenizer's data forced to this dataset's sizes: only the hash tells
        for s in ("bin", "idx"):
            data = Path(f"{prefix}.{s}").read_bytes()
            want = len(good[s])
            Path(f"{prefix}.{s}").write_bytes((data * (want // len(data) + 1))[:want])

    for damage, says in ((lambda: cut(0), "is 0 bytes"), (lambda: cut(100), "is 100 bytes"),
                         (swapped, "content is not what its manifest recorded")):  # fmt: skip
        damage()
        res = status(root, str(tok))
        row = json.loads(res.stdout)["datasets"][0]
        assert res.returncode == 1 and row["files_match"] is False, (says, res)
        assert says in row["files_problem"]
        res = run_cli("status", "--models", "llama32-1b", "--datasets", "wikipedia",
                      "--data-root", root, env={"TOKENIZER_MODEL": str(tok)})  # fmt: skip
        assert res.returncode == 1 and "MISMATCH" in res.stdout, res
        assert "not what data prepare made" in " ".join(res.stderr.split())
        problem = need.problem()
        assert problem is not None and says in problem and "replaced or cut short" in problem
        for s, b in good.items():
            Path(f"{prefix}.{s}").write_bytes(b)
    assert need.problem() is None
    # prepare makes a damaged dataset again (it is not up to date)
    cut(100)
    res = prepare(tok, src, root)
    assert res.returncode == 0 and "wrote" in res.stdout, res
    assert Path(f"{prefix}.bin").read_bytes() == good["bin"]


# -- a tokenizer folder is known by its absolute path and all its files -------------------


def test_a_local_folder_named_like_a_hub_id_is_recorded_local_and_never_matched_by_name(
    tok, tmp_path
):
    """`meta-llama/Llama-3.2-1B` as a folder here (the model's own hub id): recorded as an
    absolute path marked local; from another directory, where the name is the hub's, status
    says mismatch, never "matches" by name."""
    work = tmp_path / "work"
    folder = work / "meta-llama" / "Llama-3.2-1B"
    shutil.copytree(tok, folder)
    src = write_jsonl(tmp_path / "c.jsonl", corpus(30))
    root = tmp_path / "d"
    assert prepare("meta-llama/Llama-3.2-1B", src, root, cwd=work).returncode == 0
    made = json.loads((root / "wikipedia" / f"{DOC}.json").read_text())["tokenizer"]
    assert made["name"] == str(folder) and made["local"] is True
    # here, the folder is what the scripts' name resolves to: matched by its files
    res = status(root, None, cwd=work)
    assert json.loads(res.stdout)["datasets"][0]["tokenizer_matches"] is True, res
    # elsewhere the same name is the hub's tokenizer: not the one the data was made with
    res = status(root, None, cwd=tmp_path)
    row = json.loads(res.stdout)["datasets"][0]
    assert res.returncode == 1 and row["tokenizer_matches"] is False, res
    assert row["made_with"] == str(folder)
    # a relative TOKENIZER_MODEL is made absolute (the scripts start in the checkout)
    res = status(root, "meta-llama/Llama-3.2-1B", cwd=work)
    assert json.loads(res.stdout)["datasets"][0]["tokenizer"] == str(folder)


def test_the_fingerprint_covers_every_file_of_the_folder(tmp_path):
    from quantpatch.data_prep.layout import files_hash, legacy_files_hash

    folder = tmp_path / "tok"
    (folder / "code").mkdir(parents=True)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "cl100k.tiktoken").write_text("AAAA 0\n")
    (folder / "code" / "tokenization_mine.py").write_text("X = 1\n")
    first, legacy = files_hash(folder), legacy_files_hash(folder)
    for name, text in (("cl100k.tiktoken", "AAAB 0\n"), ("code/tokenization_mine.py", "X=2\n")):
        (folder / name).write_text(text)
        assert files_hash(folder) != first, name
        first = files_hash(folder)
    assert legacy_files_hash(folder) == legacy  # what the old fingerprint missed
    os.symlink(folder / "cl100k.tiktoken", folder / "linked.tiktoken")
    assert files_hash(folder) != first


# -- mock data and the attention path, as the runs take them ----------------------------


@pytest.mark.slow  # about 12 s
def test_a_mock_data_sweep_is_recorded_and_reported_as_mock(
    sweep_env,  # noqa: F811 - the fixture imported above
    run,
    monkeypatch,
    tmp_path,
):
    """The smoke profile's scripts default MOCK_DATA=1 (--mock-data, NullTokenizer): with
    DATA_ROOT and TOKENIZER_MODEL exported the record and the report still say mock data and
    no tokenizer."""
    root, _env, _stub, out = sweep_env
    tok = tmp_path / "mytok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("DATA_ROOT", str(tmp_path / "data"))
    monkeypatch.setenv("TOKENIZER_MODEL", str(tok))
    monkeypatch.delenv("MOCK_DATA", raising=False)
    res = run("sweep", "run", out, "--models", "llama32-1b", "--datasets", "wikipedia",
              "--profile", "smoke", "--schemes", "bf16", "--repo", root)  # fmt: skip
    assert res.code == 0, res
    rec = record(out)
    assert rec["data"]["mock"] is True and rec["data"]["checked"] == []
    html = (out / "report.html").read_text()
    assert "mock data (MOCK_DATA=1" in html and "NullTokenizer" in html
    assert str(tok) not in html, "the report names a tokenizer the runs never loaded"


@pytest.mark.slow  # about 45 s
def test_flash_runs_on_an_older_runtime_are_refused_before_anything_is_written(
    sweep_env,  # noqa: F811 - the fixture imported above
    run,
    make_checkout,
):
    """A checkout set up by the previous release (no bf16 flash route): an FA sweep, whose
    bf16 baseline is to take the flash path, is refused naming `quantpatch upgrade`, and
    nothing is written; after the upgrade it is taken (and, as the sentence also says, the
    same sweep with --attention stock runs without the upgrade)."""
    from .oldrelease import make_old_release

    _root, _env, stub, out = sweep_env
    root = make_checkout(inject=False)
    assert run("init", "--repo", root).code == 0
    make_old_release(root)
    res = run("sweep", "run", out, *SELECT, "--repo", root)
    said = " ".join(res.err.split())
    assert res.code == 2 and "run `quantpatch upgrade` there first" in said, res
    assert "ops" in said and not out.exists() and not calls(stub)
    # the other advice of the sentence, followed: the same sweep on stock attention
    stock = out.parent / "stock"
    assert "(or give --attention stock)" in said
    res = run("sweep", "run", stock, *SELECT, "--attention", "stock", "--repo", root)
    assert res.code == 0, res
    assert {r["attention"] for r in record(stock)["runs"]} == {"stock"}
    assert run("upgrade", "--repo", root).code == 0
    res = run("sweep", "run", out, *SELECT, "--repo", root)
    assert res.code == 0, res
    assert {r["attention"] for r in record(out)["runs"]} == {"flash"}


# -- paths that work from any directory and after a move -----------------------------------


def test_status_and_report_work_from_anywhere_after_a_move_and_migrate_an_old_record(
    run, tmp_path, monkeypatch
):
    """A record of the previous release keeps each log relative to the directory `sweep run`
    ran in: read from another directory, from inside the folder (`.`) and after the folder
    moved; the first write keeps them relative to the sweep's folder."""
    from quantpatch.analysis import plots
    from quantpatch.launch import sweep as sweep_mod

    from .test_sweep_report import fake_sweep

    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)  # the tables are the test
    work = tmp_path / "work"
    work.mkdir()
    sweep_dir, rec = fake_sweep(work)
    for r in rec["runs"]:  # as that release wrote them, from `cd work && sweep run sweep`
        r["log"] = str(Path(r["log"]).relative_to(work))
    (sweep_dir / "sweep.json").write_text(json.dumps(rec))
    names = [r["name"] for r in rec["runs"]]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = tmp_path / "shared" / "sweep-moved"
    for cwd, target in ((elsewhere, sweep_dir), (sweep_dir, Path(".")), (elsewhere, moved)):
        if target == moved and not moved.exists():
            moved.parent.mkdir()
            shutil.move(sweep_dir, moved)
        monkeypatch.chdir(cwd)
        res = run("sweep", "status", target)
        assert res.code == 0 and "2 runs: 2 finished" in res.out, res
        res = run("sweep", "report", target)
        assert res.code == 0, (cwd, target, res)
        html = (target / "report.html").read_text().replace("<wbr>", "")
        for name in names:
            assert f">{name}<" in html, (cwd, target, name)
    loaded = sweep_mod.load(moved)
    assert loaded is not None
    sweep_mod.save(moved, loaded)
    saved = json.loads((moved / "sweep.json").read_text())
    assert saved["version"] == sweep_mod.VERSION == 2
    assert [r["log"] for r in saved["runs"]] == [
        f"runs/{n}/logs/{Path(r['log']).name}" for n, r in zip(names, rec["runs"], strict=True)
    ]


# -- what the user shares is readable by colleagues -----------------------------------------


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_shared_files_get_the_umask_mode_and_are_still_atomic(run, tmp_path, mask, mode):
    """report.html and sweep.json were 0600 whatever the umask (mkstemp's temp files renamed
    into place); the figures `runs --plot` writes are checked too."""
    from quantpatch.analysis import plots
    from quantpatch.launch import sweep as sweep_mod

    from .test_sweep_report import fake_sweep

    sweep_dir, _ = fake_sweep(tmp_path)
    old = os.umask(mask)
    try:
        res = run("sweep", "report", sweep_dir)
        assert res.code == 0, res
        loaded = sweep_mod.load(sweep_dir)
        assert loaded is not None
        sweep_mod.save(sweep_dir, loaded)
        shared = [sweep_dir / "report.html", sweep_dir / "sweep.json"]
        if plots.have_matplotlib():
            res = run("runs", sweep_dir / "runs", "--plot", tmp_path / "figs")
            assert res.code == 0, res
            shared += sorted((tmp_path / "figs").glob("*.png"))
            assert len(shared) > 2
    finally:
        os.umask(old)
    for path in shared:
        assert path.stat().st_mode & 0o777 == mode, (path, oct(path.stat().st_mode))
    # nothing but the files themselves: no temp file left beside them
    assert not [p for p in sweep_dir.iterdir() if p.name.startswith(".")]


# -- validation loss and perplexity ----------------------------------------------------------

VALIDATION_LOG = Path(__file__).parent / "data" / "training-log-validation-core_v0.13.1.txt"
"""core_v0.13.1's iteration lines with the validation lines ``evaluate_and_print_results``
prints between them (framed by dashes; at the end ``on validation set`` and ``on test set``)."""


def _validated_run(folder: Path, scheme: str, shift: float) -> Path:
    text = VALIDATION_LOG.read_text()
    if shift:  # the other scheme's validation losses, moved by ``shift``
        out = []
        for line in text.splitlines():
            if "lm loss value: " in line:
                head, rest = line.split("lm loss value: ", 1)
                value, tail = rest.split(" |", 1)
                line = f"{head}lm loss value: {float(value) + shift:.6E} |{tail}"
            out.append(line)
        text = "\n".join(out) + "\n"
    log = folder / f"llama32-1b_wikipedia_{scheme}_fast" / "logs" / "20261122-112539.log"
    log.parent.mkdir(parents=True)
    log.write_text(
        f"[quantpatch] llama32-1b / wikipedia / {scheme} (fast): linear=bf16 qk=bf16 pv=bf16\n"
        + text
        + "[quantpatch] training exited with status 0\n"
    )
    return log


def test_validation_loss_and_perplexity_are_parsed_shown_and_in_runs_json(
    run, tmp_path, monkeypatch
):
    from quantpatch.analysis import plots
    from quantpatch.analysis.training_logs import parse_log

    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)  # the figure: its own test

    folder = tmp_path / "runs"
    log = _validated_run(folder, "bf16", 0.0)
    _validated_run(folder, "FA_mxfp8", 0.25)
    r = parse_log(log)
    # each validation, the end's "on validation set" too; the test set's is not validation
    assert [(i, round(v, 6)) for i, v, _ in r.validation] == [
        (10, 9.730112), (20, 9.180551), (30, 8.912337), (30, 8.905512),
    ]  # fmt: skip
    assert round(r.validation[-1][2], 1) == 7372.5
    assert list(r.iterations) == [10, 20, 30]  # the iteration lines read as before
    res = run("runs", folder, "--json")
    assert res.code == 0, res
    rows = {row["scheme"]: row for row in json.loads(res.out)["runs"]}
    assert rows["bf16"]["val_loss"] == pytest.approx(8.905512)
    assert rows["bf16"]["val_ppl"] == pytest.approx(7372.499)
    assert rows["bf16"]["val_at"] == 30
    assert rows["FA_mxfp8"]["val_delta_vs_bf16"] == pytest.approx(0.25)
    res = run("report", "--runs", folder, "--out", tmp_path / "r.html")
    assert res.code == 0, res
    html = (tmp_path / "r.html").read_text().replace("<wbr>", "")
    assert "8.906" in html and "7372" in html  # val loss, val ppl of bf16


@pytest.mark.slow  # about 12 s (matplotlib)
def test_the_validation_loss_has_its_figure(tmp_path):
    from quantpatch.analysis import plots, training_logs

    pytest.importorskip("matplotlib")
    folder = tmp_path / "runs"
    _validated_run(folder, "bf16", 0.0)
    _validated_run(folder, "FA_mxfp8", 0.25)
    written = plots.plot_runs(training_logs.runs([folder]), tmp_path)
    assert [p.name for p in written if p.name.startswith("val_loss_")] == [
        "val_loss_llama32-1b_wikipedia_fast.png"
    ]


# -- provenance ------------------------------------------------------------------------------


def provenance_sweep(tmp_path: Path) -> tuple[Path, str]:
    """The fake Slurm sweep of test_sweep_report with what `sweep run` now records: its
    provenance, the manifest's facts, an nvfp4_recipe run."""
    from quantpatch.launch.sweep import manifest_facts

    from .test_sweep_report import fake_sweep

    sweep_dir, rec = fake_sweep(tmp_path)
    rec["runs"][1]["scheme"] = "nvfp4_recipe"  # nvfp4-2d and nvfp4-rht, recipe layers
    prefix = Path(rec["data"]["checked"][0]["prefix"])
    prefix.parent.mkdir(parents=True)
    Path(f"{prefix}.json").write_text(json.dumps({
        "documents": 1234, "tokens": 567890,
        "tokenizer": {"name": str(tmp_path / "tok"), "local": True, "hash": "sha256:" + "ab" * 32,
                      "vocab_size": 128256},
        "sha256": {"bin": "sha256:" + "cd" * 32, "idx": "sha256:" + "ef" * 32},
    }))  # fmt: skip
    rec["data"]["checked"][0].update(manifest_facts(prefix))
    base = "f" * 40
    rec["provenance"] = {
        "quantpatch": "0.0.9",
        "megatron": "0.13.1",
        "base": {"commit": base, "branch": "main"},
        "args": {"llama32-1b": {"seq-length": 2048, "global-batch-size": 32, "lr": 0.0003,
                                "train-iters": 200, "num-layers": 16}},
    }  # fmt: skip
    (sweep_dir / "sweep.json").write_text(json.dumps(rec))
    return sweep_dir, base


def test_the_report_states_where_everything_came_from_made_from_another_directory(
    run, tmp_path, monkeypatch
):
    """Release and base commit, quantpatch's version, each model's hyperparameters, the data
    manifest's counts and hashes, the tokenizer's fingerprint and vocabulary, a legend of
    every value used (its values-table row and reference), the BF16 layer policy resolved to
    layer numbers and what the step times are; from a directory that is not the sweep's."""
    from quantpatch import __version__
    from quantpatch.analysis import plots
    from quantpatch.base.values import value_table

    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    sweep_dir, base = provenance_sweep(tmp_path)
    monkeypatch.chdir(tmp_path.parent)
    res = run("sweep", "report", sweep_dir)
    assert res.code == 0, res
    from html import unescape

    text = unescape((sweep_dir / "report.html").read_text().replace("<wbr>", ""))
    for fact in (
        f"0.0.9 ran the sweep; {__version__} wrote this report",
        f"0.13.1; base commit {base} (main)",
        "seq-length 2048, global-batch-size 32, train-iters 200, lr 0.0003, num-layers 16",
        "emulation's, not the format's",
        ">1234<", ">567890<", ">" + "cd" * 8 + "<", ">" + "ab" * 8 + "<", ">128256<",
        # the recipe's 2 and 8 of 62 layers, scaled to 16: layers 1 and 15-16
        "nvfp4_recipe (llama32-1b, 16 layers): recipe,output = layers 1, 15-16 and the output "
        "layer in BF16",
    ):  # fmt: skip
        assert fact in text, fact
    for value in ("bf16", "nvfp4-2d", "nvfp4-rht"):
        assert f">{value}<" in text and value_table()[value]["reference"] in text, value


def test_bf16_layer_numbers_are_the_runtimes():
    from quantpatch.base.config import bf16_layer_numbers
    from quantpatch.runtime import quantpatch_layers

    for spec in ("recipe", "first:2,last:8", "1,2,25-32", "last:40", "3-5,recipe"):
        for n in (2, 16, 32, 62):
            want = sorted(quantpatch_layers.resolve(spec, n))
            assert bf16_layer_numbers(spec, n) == want, (spec, n)


@pytest.mark.parametrize("width", [1000, 1280])
def test_the_report_with_its_provenance_fits_the_page(run, tmp_path, width):
    """The header, legend and data tables in headless Chromium: nothing past the right edge
    (a screenshot kept under /tmp for the reader)."""
    from .test_sweep_report import _PROBE, CHROMIUM

    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium)")
    sweep_dir, _ = provenance_sweep(tmp_path)
    assert run("sweep", "report", sweep_dir, "--title", "NVFP4 recipe ablation").code == 0
    probe = tmp_path / "probe.html"
    probe.write_text((sweep_dir / "report.html").read_text() + _PROBE)
    base = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--window-size={width},1600", f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run(
        [*base, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    from html import unescape

    seen = json.loads(unescape(dom.stdout.split("<title>", 1)[1].split("</title>", 1)[0]))
    assert seen["width"] == width and seen["cut"] == [] and seen["scroll"] <= width, seen
    shot = tmp_path / f"report-{width}.png"
    subprocess.run([*base, f"--screenshot={shot}", (sweep_dir / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)  # fmt: skip
    assert shot.stat().st_size > 0
    html = (sweep_dir / "report.html").read_text()
    assert "<h1>NVFP4 recipe ablation</h1>" in html
    assert "<title>NVFP4 recipe ablation - quantpatch report</title>" in html


# -- noise: every scheme over several seeds ----------------------------------------------------

SEEDED_TORCHRUN = r"""#!/usr/bin/env bash
set -u
seed=none
prev=""
for a in "$@"; do
    if [[ "$prev" == "--seed" ]]; then seed="$a"; fi
    prev="$a"
done
echo "$$ $(basename "$PWD") seed=$seed $OUTPUT_ROOT start" >> "$STUB_DIR/calls"
off=$(( ${seed/none/1234} - 1234 ))
case "$PWD" in
    *linear-mxfp4*) loss=5.30 ;;           # outside bf16's 5.00 to 5.02
    *qk-mxfp8*) loss=5.01 ;;               # within it
    *) loss="5.0$(( 2 * off ))" ;;         # bf16: 5.00 and 5.02
esac
LINE=' [2026-11-22 11:25:3%d] iteration %9d/%8d | consumed samples: %12d | '
LINE+='elapsed time per iteration (ms): 96.9 | learning rate: 6.666667E-05 | '
LINE+='global batch size: %5d | lm loss: %s | loss scale: 1.0 | grad norm: 2.105 | '
LINE+='number of skipped iterations: %3d | number of nan iterations: %3d |\n'
for i in 1 2 3 4; do
    # shellcheck disable=SC2059
    printf "$LINE" "$i" "$i" 4 "$((2 * i))" 2 "$loss" 0 0
done
echo " validation loss at iteration 4 | lm loss value: $loss | lm loss PPL: 150.0 | "
"""


@pytest.mark.slow  # about 45 s
def test_seeds_give_each_scheme_a_mean_and_spread_against_bf16s(
    sweep_env,  # noqa: F811 - the fixture imported above
    run,
    monkeypatch,
    tmp_path,
):
    """`sweep run --seeds 2`: each scheme twice, with Megatron's --seed 1234 and 1235, in its
    own folder; the report's noise table gives each scheme's mean and spread and marks
    FA_mxfp8 (5.01) within and linear_mxfp4 (5.30) outside bf16's 5.00 to 5.02."""
    root, _env, stub, out = sweep_env
    (tmp_path / "bin" / "torchrun").write_text(SEEDED_TORCHRUN)
    res = run("sweep", "run", out, *SELECT, "--seeds", "2", "--parallel", "2", "--gpus", "0,1",
              "--repo", root)  # fmt: skip
    assert res.code == 0, res
    rec = record(out)
    assert rec["selection"]["seeds"] == 2 and len(rec["runs"]) == 6
    started = [c for c in calls(stub) if c[-1] == "start"]
    assert sorted(c[2] for c in started) == ["seed=1234"] * 3 + ["seed=1235"] * 3
    assert {c[3] for c in started if c[2] == "seed=1235"} == {str(out.resolve() / "runs/seed1235")}
    for r in rec["runs"]:
        assert (out / r["log"]).is_file() and (out / r["log"]).is_relative_to(out / r["folder"])
    parsed = json.loads(
        subprocess.run(
            [QUANTPATCH, "runs", "--json", str(out / "runs")], capture_output=True, text=True
        ).stdout
    )["runs"]
    assert sorted((r["scheme"], r["seed"]) for r in parsed) == [
        (s, seed) for s in ("FA_mxfp8", "bf16", "linear_mxfp4") for seed in (1234, 1235)
    ]
    html = (out / "report.html").read_text().replace("<wbr>", "")
    assert "<th>seed</th>" in html  # the runs table tells the seeds apart
    assert "Noise: each scheme over its seeds" in html
    rows = html.split("Noise: each scheme over its seeds", 1)[1].split("</table>", 1)[0]
    cells = {
        row.split('class="t">', 5)[4].split("<", 1)[0]: row for row in rows.split("<tr")[2:]
    }  # scheme -> its row
    assert "within" in cells["FA_mxfp8"] and "outside" in cells["linear_mxfp4"], cells
    assert ">validation loss<" in cells["bf16"] and ">0.02<" in cells["bf16"]  # the spread
    assert ">5.01<" in cells["bf16"] and ">0.29<" in cells["linear_mxfp4"]  # mean, Δ


# -- readable -----------------------------------------------------------------------------------


def test_watch_without_a_terminal_prints_only_changes(tmp_path):
    """`sweep status --watch` into a pipe: the table once, then one line per change of
    state (never the whole table again), then the counts."""
    from .test_sweep_report import fake_sweep

    sweep_dir, rec = fake_sweep(tmp_path)
    for r in rec["runs"]:  # a local sweep, both runs still going
        r.update(state="running", slurm_job=None, slurm_state=None, exit_code=None)
    rec["launcher"] = "local"
    (sweep_dir / "sweep.json").write_text(json.dumps(rec))
    proc = subprocess.Popen(
        [QUANTPATCH, "sweep", "status", str(sweep_dir), "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = []
    while not (line := proc.stdout.readline()).startswith("2 runs:"):  # the first table
        assert line, proc.stderr.read() if proc.stderr else ""
        first.append(line)
    names = [r["name"] for r in rec["runs"]]
    rec["runs"][0].update(state="finished", exit_code=0)
    (sweep_dir / "sweep.json").write_text(json.dumps(rec))
    line = proc.stdout.readline()  # a barrier: the change seen
    assert line.split()[1:] == [f"{names[0]}:", "running", "->", "finished"], line
    rec["runs"][1].update(state="failed", exit_code=1)
    (sweep_dir / "sweep.json").write_text(json.dumps(rec))
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert rest.splitlines()[0].split()[1:] == [f"{names[1]}:", "running", "->", "failed"]
    assert rest.splitlines()[1:] == ["2 runs: 1 finished, 1 failed"], rest
    assert "run" not in rest.split()[0] and rest.count("│") == 0  # no table redrawn


def test_the_run_log_header_names_the_bf16_layer_policy(run, tmp_path):
    out = tmp_path / "scripts"
    res = run("gen-scripts", "--out", out, "--models", "llama32-1b", "--datasets", "wikipedia",
              "--schemes", "nvfp4_recipe,bf16", "--profile", "fast",
              "--megatron-release", "core_v0.13.1")  # fmt: skip
    assert res.code == 0, res
    recipe = (out / "llama32-1b/pretrain_llama32-1b_wikipedia_nvfp4_recipe.sh").read_text()
    bf16 = (out / "llama32-1b/pretrain_llama32-1b_wikipedia_bf16.sh").read_text()
    # llama32-1b's 16 layers: the recipe's 2 and 8 of 62 are its first 1 and last 2
    # (and the output layer: NVIDIA's recipe keeps it in BF16 too)
    want = "BF16 layers: recipe,output = layers 1, 15-16 of 16 and the output layer in BF16"
    assert f"echo '[quantpatch] {want}'" in recipe
    assert "[quantpatch] BF16 layers: none" in bf16


@pytest.mark.parametrize("width", [80, 100])
def test_list_wraps_instead_of_cutting(width):
    """At 80 and 100 columns `list` showed `mxfp8-…`, `e8m0-fl…`, and `nvfp4_recipe` and
    `nvfp4_recipe_no_rht` alike: every value, scheme and model name, and every value's
    scale, is whole now, and no line is wider than the terminal."""
    import io
    import re

    from rich.console import Console

    from quantpatch.base.values import value_table
    from quantpatch.cli.launch import list_tables
    from quantpatch.launch.registry import load_registry

    reg = load_registry(None)
    console = Console(width=width, file=io.StringIO(), emoji=False, highlight=False)
    for table in list_tables(reg):
        console.print(table)
    text = console.file.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    words = set(re.findall(r"[^\s,]+", text))
    for name in [*value_table(), *reg.schemes, *reg.models]:
        assert name in words, (name, width)
    for v in value_table().values():
        assert v["scale"] is None or v["scale"] in words, (v["name"], v["scale"])
    for scheme in reg.schemes.values():  # fprop:X, dgrad:Y, wgrad:Z: each whole
        for part in scheme.linear_text.split(","):
            assert part in words, (scheme.name, part)


def test_sweep_run_refuses_a_dataset_that_is_not_its_manifests(
    sweep_env,  # noqa: F811 - the fixture imported above
    run,
    monkeypatch,
    tmp_path,
):
    """The pre-launch check of `sweep run`: a `.bin` cut to 0 or 100 bytes, or
    replaced by another of the same size, is refused before anything is written."""
    from quantpatch.data_prep.layout import data_prefix, files_hash, sample_hash
    from quantpatch.launch.registry import load_registry

    root, _env, stub, out = sweep_env
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "mine"}')
    data = tmp_path / "data"
    prefix = data_prefix(
        load_registry(None).datasets["wikipedia"].prefix, "llama32-1b", {}, data_root=str(data)
    )
    prefix.parent.mkdir(parents=True)
    good = {"bin": os.urandom(4096), "idx": os.urandom(512)}
    for s, b in good.items():
        Path(f"{prefix}.{s}").write_bytes(b)
    Path(f"{prefix}.json").write_text(json.dumps({
        "documents": 3, "tokens": 2048,
        "tokenizer": {"name": str(tok), "local": True, "hash": files_hash(tok),
                      "fingerprint": "every-file/1"},
        "files": {s: len(b) for s, b in good.items()},
        "samples": {s: sample_hash(Path(f"{prefix}.{s}")) for s in good},
    }))  # fmt: skip
    monkeypatch.setenv("DATA_ROOT", str(data))
    monkeypatch.setenv("TOKENIZER_MODEL", str(tok))
    select = ("--models", "llama32-1b", "--datasets", "wikipedia", "--schemes", "bf16",
              "--profile", "fast", "--repo", root)  # fmt: skip
    for damaged, says in (
        (b"", "is 0 bytes, its manifest says 4,096"),
        (good["bin"][:100], "is 100 bytes, its manifest says 4,096"),
        (os.urandom(4096), "content is not what its manifest recorded"),
    ):
        Path(f"{prefix}.bin").write_bytes(damaged)
        res = run("sweep", "run", out, *select)
        said = " ".join(res.err.split())
        assert res.code == 2 and says in said and "replaced or cut short" in said, res
        assert "quantpatch data prepare wikipedia --input CORPUS --models llama32-1b" in said
        assert not out.exists() and not calls(stub)
