"""Every command with a progress display, run at a real terminal (a pty), as an interactive
user runs it: no internal error, the exit code the command means, and the cursor
shown again at the end whenever the display hid it, on success, on an error and on Ctrl-C.
``demo``'s spinners are tested so in tests/test_demo.py, whose walk runs at a pty.

The child's output is read until end of file (the pty's other side closed by the exit), so
nothing here waits on time."""

from __future__ import annotations

from pathlib import Path

import pytest

from .terminal import assert_cursor_shown, run_in_pty
from .test_data_prepare import corpus, make_tokenizer, write_jsonl

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


def _prepare(tok: Path, src: Path, root: Path) -> tuple[str, ...]:
    return ("data", "prepare", "wikipedia", "--models", "llama32-1b",
            "--tokenizer", f"llama32-1b={tok}", "--input", src,
            "--data-root", root)  # fmt: skip


def test_data_prepare_at_a_terminal(tok, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", corpus(3000))
    code, text = run_in_pty(*_prepare(tok, src, tmp_path / "d"))
    assert code == 0, text
    assert_cursor_shown(text)
    assert "wrote" in text
    assert (tmp_path / "d" / "wikipedia" / "llama32-1b_text_document.idx").is_file()


def test_data_prepare_at_a_terminal_error_and_ctrl_c_show_the_cursor(tok, tmp_path):
    # an error after the display is up (line 2,501 is not JSON: the first batch is read first)
    src = write_jsonl(tmp_path / "c.jsonl", corpus(2500))
    with open(src, "a", encoding="utf-8") as fh:
        fh.write("{oops\n")
    code, text = run_in_pty(*_prepare(tok, src, tmp_path / "d"))
    assert code == 2 and f"{src}:2501: not a JSON line" in " ".join(text.split()), text
    assert_cursor_shown(text)
    # Ctrl-C right after the first batch is written
    good = write_jsonl(tmp_path / "g.jsonl", corpus(3000))
    fault = {"QUANTPATCH_FAULT_AT": "1", "QUANTPATCH_FAULT_KIND": "interrupt"}
    code, text = run_in_pty(*_prepare(tok, good, tmp_path / "d"), env=fault)
    assert code == 130, text
    assert_cursor_shown(text)


@pytest.fixture(scope="module")
def tensor_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tensors")
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        t = torch.randn(32, 64, generator=gen) * (i + 1)
        torch.save({"tensor": t, "metadata": {"tensor_name": "input", "layer_idx": i % 2}},
                   d / f"{i}.pt")  # fmt: skip
    return d


@pytest.mark.parametrize("command", ["summary", "formats"])
def test_tensors_at_a_terminal(tensor_dir, command):
    # the bar shows after QUANTPATCH_PROGRESS_AFTER seconds (1 by default): 0 here, at once
    code, text = run_in_pty(
        "tensors", command, tensor_dir, "--jobs", "1", env={"QUANTPATCH_PROGRESS_AFTER": "0"}
    )
    assert code == 0, text
    assert_cursor_shown(text)


def test_tensors_plot_at_a_terminal(tensor_dir, tmp_path):
    pytest.importorskip("matplotlib")
    code, text = run_in_pty(
        "tensors", "plot", tensor_dir, "--out", tmp_path / "png", "--jobs", "1",
        env={"QUANTPATCH_PROGRESS_AFTER": "0"},
    )  # fmt: skip
    assert code == 0, text
    assert_cursor_shown(text)
