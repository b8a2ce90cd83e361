"""``data prepare`` / ``data status`` against inputs and places that used to give a silently
wrong dataset (exit 0), an internal error (exit 3) or a hang: each is now one
sentence and exit 2 with nothing changed, or the right dataset."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from .test_data_prepare import corpus, make_tokenizer, run_cli, write_jsonl

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

DOC = "llama32-1b_text_document"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


def prepare(tok: Path, src: Path, root: Path, *more: object, env=None):
    return run_cli("prepare", "wikipedia", "--input", src, "--models", "llama32-1b",
                   "--tokenizer", f"llama32-1b={tok}", "--data-root", root, *more,
                   env=env)  # fmt: skip


def refused(res, says: str) -> None:
    said = " ".join(res.stderr.split())
    assert res.returncode == 2 and says in said, (says, res.returncode, res.stderr)
    assert "internal error" not in said and "Traceback" not in said
    assert len(res.stderr.strip().splitlines()) <= 3, res.stderr


def documents_of(root: Path) -> int:
    return json.loads((root / "wikipedia" / f"{DOC}.json").read_text())["documents"]


def dataset_files(root: Path) -> dict[str, bytes]:
    folder = root / "wikipedia"
    if not folder.exists():
        return {}
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix != ".lock"}


def lines(n: int) -> list[str]:
    return [json.dumps({"text": f"document number {i}"}) + "\n" for i in range(n)]


# -- .zst read to the end of its last frame, or refused ---------------------------------


@pytest.mark.slow  # about 18 s
def test_zst_every_frame_read_and_a_cut_or_foreign_file_refused(tok, tmp_path):
    cctx = zstandard.ZstdCompressor()
    half = "".join(lines(4000)[:2000]).encode(), "".join(lines(4000)[2000:]).encode()
    frames = [cctx.compress(half[0]), cctx.compress(half[1])]
    whole = tmp_path / "c.jsonl.zst"
    whole.write_bytes(b"".join(frames))
    root = tmp_path / "d"
    res = prepare(tok, whole, root)
    assert res.returncode == 0, res.stderr
    assert documents_of(root) == 4000  # both frames (the old reader stopped after the first)
    good = dataset_files(root)
    cuts = {
        "in the second frame": b"".join(frames)[: len(frames[0]) + len(frames[1]) // 2],
        "in the first frame": frames[0][: len(frames[0]) // 2],
        "the first 100 bytes": frames[0][:100],
        "not zstd": b"this is no zstd at all\n" * 10,
    }
    for what, data in cuts.items():
        bad = tmp_path / f"cut-{what.replace(' ', '-')}.jsonl.zst"
        bad.write_bytes(data)
        res = prepare(tok, bad, root)
        refused(res, f"{bad}: cannot be decompressed")
        assert dataset_files(root) == good, what  # the good dataset is kept


# -- one prefix, one run at a time --------------------------------------------------------


def test_a_prefix_another_run_is_writing_is_refused(tok, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", corpus(30))
    root = tmp_path / "d"
    folder = root / "wikipedia"
    folder.mkdir(parents=True)
    # hold the lock as a running data prepare holds it (the kernel's flock, no timing)
    fd = os.open(folder / f".{DOC}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        res = prepare(tok, src, root)
        refused(res, "another data prepare is writing this dataset")
        assert dataset_files(root) == {}
    finally:
        os.close(fd)
    res = prepare(tok, src, root)  # released: the next run goes ahead
    assert res.returncode == 0, res.stderr


# -- a save_to_disk folder: exactly its split's files, each whole -------------------------


def _arrow(path: Path, start: int, batches: int, rows: int = 1000, *, eos: bool = True) -> int:
    """An Arrow stream of ``batches`` batches; the size of the stream before its end marker."""
    schema = pa.schema([("text", pa.string())])
    sink = pa.BufferOutputStream()
    writer = pa.ipc.new_stream(sink, schema)
    for b in range(batches):
        texts = [f"row {start + b * rows + i}" for i in range(rows)]
        writer.write_batch(pa.record_batch([pa.array(texts)], schema=schema))
    writer.close()
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data if eos else data[:-8])
    return len(data) - 8


def _hf(folder: Path, files: list[str], *, state: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text("{}")
    if state:
        listed = [{"filename": f} for f in files]
        (folder / "state.json").write_text(json.dumps({"_data_files": listed}))
    return folder


@pytest.mark.slow  # about 18 s
def test_save_to_disk_reads_exactly_its_split_and_refuses_a_cut_file(tok, tmp_path):
    root = tmp_path / "d"
    split = _hf(tmp_path / "train", ["data-00000-of-00001.arrow"])
    _arrow(split / "data-00000-of-00001.arrow", 0, 3)
    _arrow(split / "cache-1a2b.arrow", 0, 3)  # a map() cache beside it: not the split
    res = prepare(tok, split, root)
    assert res.returncode == 0, res.stderr
    assert documents_of(root) == 3000
    good = dataset_files(root)
    # without state.json nothing says which *.arrow are the split's
    (split / "state.json").unlink()
    refused(prepare(tok, split, root), "without state.json")
    # a listed file cut at a batch boundary (2 of its 3 batches, no end marker)
    cut = _hf(tmp_path / "cut", ["data.arrow"])
    size = _arrow(tmp_path / "two.arrow", 0, 2)
    _arrow(cut / "data.arrow", 0, 3)
    (cut / "data.arrow").write_bytes((cut / "data.arrow").read_bytes()[:size])
    refused(prepare(tok, cut, root), f"{cut / 'data.arrow'}: cut short")
    # and cut in the middle of a batch (pyarrow's error, once an internal error)
    (cut / "data.arrow").write_bytes((cut / "data.arrow").read_bytes()[: size - 500])
    refused(prepare(tok, cut, root), f"{cut / 'data.arrow'}: cut short or corrupt")
    assert dataset_files(root) == good


# -- status compares the tokenizer's files, not its name ----------------------------------


def test_status_notices_a_tokenizer_retrained_into_the_same_folder(tmp_path):
    folder = make_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "c.jsonl", corpus(30))
    root = tmp_path / "d"
    assert prepare(folder, src, root).returncode == 0

    def matches() -> bool:
        res = run_cli("status", "--models", "llama32-1b", "--datasets", "wikipedia",
                      "--data-root", root, "--json",
                      env={"TOKENIZER_MODEL": str(folder)})  # fmt: skip
        return json.loads(res.stdout)["datasets"][0]["tokenizer_matches"]

    assert matches() is True
    shutil.rmtree(folder)
    make_tokenizer(folder, vocab=300)  # another tokenizer, the same folder name
    assert matches() is False


# -- an empty input, two models on one prefix ------------------------------------------


def test_an_empty_input_is_refused_and_the_dataset_kept(tok, tmp_path):
    root = tmp_path / "d"
    assert prepare(tok, write_jsonl(tmp_path / "c.jsonl", corpus(30)), root).returncode == 0
    good = dataset_files(root)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refused(prepare(tok, empty, root), f"{empty}: holds no documents")
    assert dataset_files(root) == good


def test_a_config_prefix_without_model_is_refused_before_any_work(tok, tmp_path):
    other = make_tokenizer(tmp_path / "other", vocab=300)
    config = tmp_path / "q.toml"
    config.write_text(
        '[datasets.shared]\ndescription = "one prefix for all"\n'
        'prefix = "{data_root}/shared/text_document"\nsplit = "949,50,1"\n'
    )
    src = write_jsonl(tmp_path / "c.jsonl", corpus(30))
    root = tmp_path / "d"
    for second in (other, tok):  # two tokenizers; one tokenizer (was SameFileError)
        res = run_cli("prepare", "shared", "--config", config, "--input", src,
                      "--models", "llama32-1b,llama31-8b", "--tokenizer", f"llama32-1b={tok}",
                      "--tokenizer", f"llama31-8b={second}", "--data-root", root)  # fmt: skip
        refused(res, "llama32-1b and llama31-8b would both write")
        assert not (root / "shared").exists()


# -- internal errors that are the user's: one sentence, exit 2 -------------------------------


@pytest.mark.slow
def test_hostile_texts_and_files_are_one_sentence(tok, tmp_path):
    root = tmp_path / "d"
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n')
    refused(prepare(tok, surrogate, root), f"{surrogate}:2: 'text' holds a lone surrogate")
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    refused(prepare(tok, deep, root), f"{deep}:2: JSON nested too deeply")
    # a Parquet file whose data pages are damaged
    table = pa.table({"text": [f"row {i} " * 20 for i in range(3000)]})
    good = tmp_path / "good.parquet"
    pq.write_table(table, good, compression="snappy")
    data = bytearray(good.read_bytes())
    for i in range(200, len(data) // 2, 7):
        data[i] ^= 0x5A
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(bytes(data))
    res = prepare(tok, broken, root)
    refused(res, f"{broken}: cut short or corrupt after row 0")
    # a UTF-8 error is reported on its own line (the text layer reads ahead)
    utf = tmp_path / "utf.jsonl"
    utf.write_bytes("".join(lines(60)).encode().replace(b"number 50", b"number \xff50"))
    refused(prepare(tok, utf, root), f"{utf}:51: not UTF-8")
    assert dataset_files(root) == {}


@pytest.mark.slow
def test_symlinks_fifos_and_directories_in_the_way(tok, tmp_path):
    root = tmp_path / "d"
    src = write_jsonl(tmp_path / "c.jsonl", corpus(30))
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    refused(prepare(tok, loop, root), f"{loop}: cannot be read")
    root_loop = tmp_path / "rootloop"
    root_loop.symlink_to(root_loop)
    refused(prepare(tok, src, root_loop), f"{root_loop}: a symlink loop")
    # a hub cache's symlink is known by its own name, not its blob's
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.copyfile(src, blobs / "9f2c1e")
    link = tmp_path / "train.jsonl"
    link.symlink_to(blobs / "9f2c1e")
    res = prepare(tok, link, root)
    assert res.returncode == 0, res.stderr
    shutil.rmtree(root)
    # a FIFO would hang (read once to fingerprint it, once to tokenize it)
    fifo = tmp_path / "x.jsonl"
    os.mkfifo(fifo)
    refused(prepare(tok, fifo, root), f"{fifo}: not a regular file")
    # a folder where one of the dataset's files goes: refused before anything is written
    for suffix in ("bin", "idx", "json"):
        where = root / "wikipedia" / f"{DOC}.{suffix}"
        where.mkdir(parents=True)
        refused(prepare(tok, src, root), f"{where}: not a regular file")
        assert [p.name for p in (root / "wikipedia").iterdir() if p.suffix != ".lock"] == [
            where.name
        ]
        where.rmdir()
    # a missing tokenizer folder is named as a folder, not as a hub repo id
    refused(prepare(tmp_path / "no" / "tok", src, root), "there is no such folder")
    refused(prepare("./missing-tok", src, root), "there is no such folder")  # type: ignore[arg-type]


def test_a_full_disk_keeps_the_old_dataset(tok, tmp_path):
    root = tmp_path / "d"
    assert prepare(tok, write_jsonl(tmp_path / "c.jsonl", corpus(30)), root).returncode == 0
    good = dataset_files(root)
    other = write_jsonl(tmp_path / "o.jsonl", corpus(40))
    res = prepare(tok, other, root,
                  env={"QUANTPATCH_FAULT_AT": "1", "QUANTPATCH_FAULT_KIND": "enospc"})  # fmt: skip
    refused(res, "cannot write the dataset (No space left on device)")
    assert dataset_files(root) == good


@pytest.mark.slow  # about 18 s
def test_a_hand_edited_manifest_is_reported_and_prepare_heals_it(tok, tmp_path):
    root = tmp_path / "d"
    src = write_jsonl(tmp_path / "c.jsonl", corpus(30))
    assert prepare(tok, src, root).returncode == 0
    manifest = root / "wikipedia" / f"{DOC}.json"
    good = json.loads(manifest.read_text())
    for edit in ({"documents": "30"}, {"tokenizer": "bpe"}, {"files": [1, 2]}):
        manifest.write_text(json.dumps({**good, **edit}))
        res = run_cli("status", "--models", "llama32-1b", "--datasets", "wikipedia",
                      "--data-root", root)  # fmt: skip
        assert res.returncode == 0 and "malformed manifest" in res.stdout, (edit, res)
        res = run_cli("status", "--models", "llama32-1b", "--datasets", "wikipedia",
                      "--data-root", root, "--json")  # fmt: skip
        assert res.returncode == 0, res.stderr
        res = prepare(tok, src, root)
        assert res.returncode == 0 and "wrote" in res.stdout, (edit, res)
        assert json.loads(manifest.read_text())["documents"] == 30


def test_workers_are_capped_at_the_cores_with_one_warning(tok, tmp_path):
    res = prepare(tok, write_jsonl(tmp_path / "c.jsonl", corpus(30)), tmp_path / "d",
                  "--workers", "10000")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("warning: --workers 10000 is more than the") == 1, res.stderr
