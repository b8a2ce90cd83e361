"""Every command with a progress display, run at a real terminal (a pty), as an interactive
user runs it: no internal error, the exit code the command means, and the cursor
shown again at the end whenever the display hid it, on success, on an error and on Ctrl-C.

The child's output is read until end of file (the pty's other side closed by the exit), so
nothing here waits on time."""

from __future__ import annotations

import os
import pty
import subprocess
from pathlib import Path

import pytest

from .test_data_prepare import corpus, make_tokenizer, write_jsonl
from .test_scripts import QUANTPATCH

torch = pytest.importorskip("torch")

HIDE, SHOW = "\x1b[?25l", "\x1b[?25h"


def run_in_pty(*args: object, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``quantpatch ARGS`` with its stdin, stdout and stderr on a pty; its exit code and all
    it wrote there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [QUANTPATCH, *map(str, args)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm-256color", **(env or {})},
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every holder of the other side has closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), b"".join(chunks).decode("utf-8", "replace")


def assert_cursor_shown(text: str, *, hidden: bool = True) -> None:
    assert "internal error" not in text, text
    assert "Traceback" not in text, text
    if hidden:
        assert HIDE in text, "the progress display never showed: the test tests nothing"
    if HIDE in text:
        assert SHOW in text and text.rindex(SHOW) > text.rindex(HIDE), repr(text[-400:])


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


@pytest.mark.slow  # builds the demo checkout and runs the linear layer in each format (~1 min)
def test_demo_at_a_terminal(tmp_path):
    # its spinners are rich's status displays (building, then the linear layer's errors)
    code, text = run_in_pty("demo", tmp_path / "demo")
    assert code == 0, text[-2000:]
    assert_cursor_shown(text)
    assert "try: cd" in text
