"""``quantpatch data prepare`` / ``data status``: a corpus and a BPE tokenizer made
in the test, the output equal byte for byte to Megatron's own preprocessing (reproduced from
the megatron-core wheel's ``IndexedDatasetBuilder``, see ``megatron_preprocess_reference``),
read back by the wheel's ``IndexedDataset`` and ``GPTDataset``, every input format,
idempotence, a SIGKILL mid-run, and every bad input refused."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantpatch.data_prep.prepare import BATCH_DOCS

from .test_scripts import QUANTPATCH

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

REFERENCE = Path(__file__).with_name("megatron_preprocess_reference.py")
EOS = "<|endoftext|>"


def make_tokenizer(folder: Path, *, eos: bool = True, vocab: int = 400) -> Path:
    """A byte-level BPE trained here, saved as a Hugging Face folder (tokenizer.json and its
    config) that ``AutoTokenizer.from_pretrained`` loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus()[:200], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, **({"eos_token": EOS} if eos else {})
    )
    fast.save_pretrained(folder)
    return folder


def corpus(n: int = 300) -> list[str | list[str]]:
    """Unicode of every kind, empty and whitespace-only documents, one very long document."""
    base = [
        "The quick brown fox jumps over the lazy dog.",
        "Grüße aus Köln — naïve café, façade; ½ ≠ ∞",
        "日本語のテキストと中文文本、한국어 텍스트",
        "emoji 👩‍👩‍👧‍👦 🏳️‍🌈 and combining e\u0301 a\u0308",
        "مرحبا بالعالم שלום עולם",
        "line\nbreaks\r\nand\ttabs and \u2028 separators \u2029 and \x00 nul",
        "",
        "   ",
        "\ud7ff surrogate-adjacent \U0001f600 \U000e0041",
    ]
    docs: list[str | list[str]] = [f"{base[i % len(base)]} #{i}" if i % 7 else base[i % len(base)]
                                   for i in range(n)]  # fmt: skip
    special: dict[int, str | list[str]] = {
        5: "",
        17: "long " * 20_000 + "end",
        23: ["first sentence.", "", "second sentence."],  # Megatron's list form
        24: ["", ""],
    }
    for i, doc in special.items():
        if i < n:
            docs[i] = doc
    return docs


def write_jsonl(path: Path, docs: list, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as fh:
        for i, d in enumerate(docs):
            fh.write(json.dumps({"id": i, "text": d}, ensure_ascii=i % 2 == 0) + "\n")
    return path


def run_cli(*args, env=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [QUANTPATCH, "data", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wheel_python(trees, *args) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REFERENCE), *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(trees["0.13.1"].parent)},
        timeout=600,
    )


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


def _files(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.mark.slow  # Megatron's own tool on the whole corpus; the fast suite keeps the rest
def test_byte_identical_to_megatron_and_read_back_by_megatron(tok, tmp_path, trees):
    docs = corpus()
    src = write_jsonl(tmp_path / "corpus.jsonl", docs)
    ref = tmp_path / "ref" / "out_text_document"
    ref.parent.mkdir()
    res = wheel_python(trees, "write", src, tok, ref)
    assert res.returncode == 0, res.stderr[-3000:]
    root = tmp_path / "data"
    res = run_cli("prepare", "wikipedia", "--input", src, "--models", "llama32-1b",
                  "--tokenizer", f"llama32-1b={tok}", "--data-root", root, "--workers", "2",
                  "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    prefix = root / "wikipedia" / "llama32-1b_text_document"
    ((one,),) = [report["datasets"]]
    assert one["state"] == "written" and one["prefix"] == str(prefix)
    assert one["documents"] == len(docs) and not res.stderr.strip()  # quiet under --json
    assert _files(prefix) == _files(ref)
    manifest = json.loads(Path(f"{prefix}.json").read_text())
    assert manifest["tokenizer"]["name"] == str(tok) and manifest["tokenizer"]["eod"] == 0
    assert manifest["tokenizer"]["vocab_size"] == 400 and manifest["documents"] == len(docs)
    assert manifest["inputs"][0]["size"] == src.stat().st_size
    assert manifest["inputs"][0]["hash"].startswith("sha256:")
    # Parquet, gzip and zstd JSON Lines, a save_to_disk folder: the same bytes
    pq.write_table(pa.table({"text": [d if isinstance(d, str) else None for d in docs]}),
                   tmp_path / "plain.parquet")  # fmt: skip
    flat = [d for d in docs if isinstance(d, str)]
    pq.write_table(pa.table({"text": flat}), tmp_path / "corpus.parquet")
    write_jsonl(tmp_path / "flat.jsonl", flat)
    ref_flat = tmp_path / "ref" / "flat_text_document"
    assert wheel_python(trees, "write", tmp_path / "flat.jsonl", tok, ref_flat).returncode == 0
    write_jsonl(tmp_path / "corpus.jsonl.gz", docs, gzip.open)
    with open(tmp_path / "corpus.jsonl.zst", "wb") as fh:
        fh.write(zstandard.ZstdCompressor().compress(src.read_bytes()))
    hf = tmp_path / "hf"
    hf.mkdir()
    table = pa.table({"text": flat})
    arrow = "data-00000-of-00001.arrow"
    with (
        pa.OSFile(str(hf / arrow), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table, max_chunksize=50)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": arrow}]}))
    (hf / "dataset_info.json").write_text("{}")
    for given, expect in (
        (tmp_path / "corpus.jsonl.gz", ref),
        (tmp_path / "corpus.jsonl.zst", ref),
        (tmp_path / "corpus.parquet", ref_flat),
        (hf, ref_flat),
    ):
        other = tmp_path / f"data-{given.name}"
        res = run_cli("prepare", "dolma", "--input", given, "--models", "llama32-1b",
                      "--tokenizer", f"llama32-1b={tok}", "--data-root", other)  # fmt: skip
        assert res.returncode == 0, (given, res.stderr)
        assert _files(other / "dolma" / "llama32-1b_text_document") == _files(expect), given
    # read back: the wheel's IndexedDataset and GPTDataset through its dataset builder, on CPU
    res = wheel_python(trees, "read", prefix, tok, tmp_path / "cache", tmp_path / "read.json")
    assert res.returncode == 0, res.stderr[-3000:]
    read = json.loads((tmp_path / "read.json").read_text())
    hf_tok = transformers.AutoTokenizer.from_pretrained(tok)
    expected = []
    for d in docs:
        ids = [i for s in ([d] if isinstance(d, str) else d) for i in hf_tok(s).input_ids]
        expected.append([*ids, hf_tok.eos_token_id] if ids else [])
    assert read["dtype"] == "uint16"
    assert len(read["document_indices"]) == len(docs) + 1
    by_doc = []
    ends = read["document_indices"]
    for start, end in itertools.pairwise(ends):
        by_doc.append([t for s in read["sequences"][start:end] for t in s])
    assert by_doc == expected
    assert read["train_samples"] >= 20 and len(read["sample_tokens"]) == 32
    assert read["sample_tokens"][1:] == read["sample_labels"][:-1]


@pytest.mark.slow
def test_rerun_is_up_to_date_shared_tokenizers_once_changes_rebuild_and_status(tok, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", corpus(60))
    root = tmp_path / "data"
    args = ("prepare", "wikipedia", "--input", src, "--models", "llama32-1b,llama31-8b",
            "--tokenizer", f"llama32-1b={tok}", "--tokenizer", f"llama31-8b={tok}",
            "--data-root", root)  # fmt: skip
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("tokenized once for llama32-1b, llama31-8b") == 2
    a = root / "wikipedia" / "llama32-1b_text_document"
    b = root / "wikipedia" / "llama31-8b_text_document"
    assert _files(a) == _files(b)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    res = run_cli(*args)
    assert res.returncode == 0 and res.stdout.count("is up to date") == 2, res
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps
    names = ("llama32-1b", "llama31-8b")
    # beside them only the per-prefix lock files (never removed: see prefix_locks)
    assert sorted(p.name for p in (root / "wikipedia").iterdir() if p.suffix != ".lock") == sorted(
        f"{m}_text_document.{s}" for m in names for s in ("bin", "idx", "json")
    )
    # a changed input rebuilds
    write_jsonl(src, corpus(61))
    res = run_cli(*args, "--json")
    assert [d["state"] for d in json.loads(res.stdout)["datasets"]] == ["written", "written"]
    assert json.loads(Path(f"{a}.json").read_text())["documents"] == 61
    # status: the tokenizer the scripts pass (the registry's) is not the one it was made with
    res = run_cli("status", "--models", "llama32-1b", "--datasets", "wikipedia,dolma",
                  "--data-root", root, "--json")  # fmt: skip
    rows = json.loads(res.stdout)["datasets"]
    assert [(r["dataset"], r["exists"], r["documents"], r["tokenizer_matches"]) for r in rows] == [
        ("wikipedia", True, 61, False),
        ("dolma", False, None, None),
    ]
    res = run_cli("status", "--models", "llama32-1b", "--datasets", "wikipedia",
                  "--data-root", root, "--json", env={"TOKENIZER_MODEL": str(tok)})  # fmt: skip
    assert json.loads(res.stdout)["datasets"][0]["tokenizer_matches"] is True
    res = run_cli("status", "--models", "llama32-1b", "--data-root", root)
    assert res.returncode == 1 and "MISMATCH" in res.stdout  # a mismatch is a failure
    assert "export TOKENIZER_MODEL" in " ".join(res.stderr.split())


@pytest.mark.parametrize("at", ["batch", "rename"])
def test_sigkill_leaves_no_dataset_under_the_final_name_and_the_rerun_completes(tok, tmp_path, at):
    src = write_jsonl(tmp_path / "c.jsonl", corpus(3000))
    root = tmp_path / "data"
    args = ("prepare", "wikipedia", "--input", src, "--models", "llama32-1b",
            "--tokenizer", f"llama32-1b={tok}", "--data-root", root)  # fmt: skip
    # step 1: after the first batch is written; then one step a batch, the .bin's rename next
    batches = -(-3000 // BATCH_DOCS)
    assert batches > 1
    fault = {"QUANTPATCH_FAULT_AT": "1" if at == "batch" else str(batches + 1)}
    res = run_cli(*args, env=fault)
    assert res.returncode == -9, res
    prefix = root / "wikipedia" / "llama32-1b_text_document"
    assert not Path(f"{prefix}.idx").exists() and not Path(f"{prefix}.json").exists()
    if at == "batch":
        assert not Path(f"{prefix}.bin").exists()
    assert any(p.name.startswith(".") for p in prefix.parent.iterdir())  # the killed run's
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in prefix.parent.iterdir() if p.suffix != ".lock") == [
        f"{prefix.name}.{s}" for s in ("bin", "idx", "json")
    ]


@pytest.mark.slow
def test_bad_inputs_are_refused_naming_file_and_line(tok, tmp_path):
    root = tmp_path / "data"
    good = write_jsonl(tmp_path / "good.jsonl", corpus(20))
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text('{"text": "a"}\n{"body": "b"}\n')
    not_str = tmp_path / "num.jsonl"
    not_str.write_text('{"text": 3}\n')
    no_eos = make_tokenizer(tmp_path / "noeos", eos=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [
        ((tmp_path / "missing.jsonl", tok, root), "missing.jsonl: no such input"),
        ((bad_json, tok, root), f"{bad_json}:3: not a JSON line"),
        ((no_key, tok, root), f"{no_key}:2: the record has no 'text' field"),
        ((not_str, tok, root), f"{not_str}:1: 'text' is a int, not a string"),
        ((tmp_path / "x.csv", tok, root), "unknown input format"),
        ((good, tmp_path / "no-such-tok", root), "cannot be loaded"),
        ((good, no_eos, root), "has no EOS token"),
        ((good, tok, blocker / "data"), "is not writable"),
    ]
    (tmp_path / "x.csv").write_text("text\n")
    for (src, tokenizer, data_root), says in cases:
        res = run_cli("prepare", "wikipedia", "--input", src, "--models", "llama32-1b",
                      "--tokenizer", f"llama32-1b={tokenizer}",
                      "--data-root", data_root)  # fmt: skip
        said = " ".join(res.stderr.split())
        assert res.returncode == 2 and says in said, (says, res.stderr)
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 3
        prefix = root / "wikipedia" / "llama32-1b_text_document"
        leftover = (
            [p for p in prefix.parent.glob("*") if p.suffix != ".lock"]
            if prefix.parent.exists()
            else []
        )
        assert leftover == [], (says, leftover)


def test_data_commands_load_no_tokenizer_library_at_start_up():
    code = (
        "import sys; from quantpatch import cli; sys.argv = ['quantpatch', 'data', 'prepare', "
        "'--help']\ntry:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "heavy = {'torch', 'transformers', 'tokenizers', 'pyarrow', 'zstandard', 'numpy'}\n"
        "print(sorted(heavy & set(sys.modules)))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("[]"), res


def test_data_prepare_without_torch_prints_no_transformers_advice(tok, tmp_path):
    """Where torch is not installed (`quantpatch[data]` alone),
    transformers' "PyTorch was not found" advice is not printed by `data prepare`."""
    src = write_jsonl(tmp_path / "c.jsonl", corpus(5))
    code = (
        "import sys; sys.modules['torch'] = None\n"  # as an install without torch
        "from quantpatch import cli\n"
        f"sys.argv = ['quantpatch', 'data', 'prepare', 'wikipedia', '--input', {str(src)!r}, "
        f"'--models', 'llama32-1b', '--tokenizer', 'llama32-1b={tok}', '--data-root', "
        f"{str(tmp_path / 'data')!r}]\n"
        "cli.main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout and "PyTorch was not found" not in res.stderr, res.stderr
