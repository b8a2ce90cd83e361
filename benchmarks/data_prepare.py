"""Tokens per second of ``quantpatch data prepare`` and of Megatron-LM's own
``tools/preprocess_data.py`` (core_v0.13.1) on the same corpus, with the same tokenizer and
the same number of workers, in one run; the two outputs are checked byte-identical.

    python benchmarks/data_prepare.py --megatron-lm DIR [--docs 30000] [--workers 2] [--json F]

``DIR`` is a Megatron-LM tree at core_v0.13.1 holding ``tools/preprocess_data.py`` and
``megatron/`` (e.g. ``git -C <clone> archive core_v0.13.1 tools megatron | tar -x -C DIR``;
its tool needs ``six`` and ``transformers`` in this Python). The corpus is synthetic English-
like JSON Lines (seeded), the tokenizer a byte-level BPE trained on part of it with the
``tokenizers`` library and saved as a Hugging Face folder with an EOS token. Each tool is timed
from start to exit (start-up included), tokens/s = tokens written / wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUANTPATCH = os.environ.get("QUANTPATCH") or str(Path(sys.executable).with_name("quantpatch"))


def make_corpus(path: Path, docs: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    syll = ["ka", "to", "ri", "en", "st", "an", "ex", "qu", "or", "lo", "mi", "ne", "th", "ar"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(5000)]
    words += ["the", "of", "and", "in", "to", "a", "is", "was", "for", "on", "München", "東京"]
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(docs):
            n = int(rng.expovariate(1 / 180)) + 5
            text = " ".join(rng.choice(words) for _ in range(n))
            text = ". ".join(s.capitalize() for s in text.split(" the "))
            fh.write(json.dumps({"id": i, "text": text}, ensure_ascii=False) + "\n")


def make_tokenizer(corpus: Path, folder: Path, vocab: int = 16000) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    with open(corpus, encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for _, line in zip(range(3000), fh, strict=False)]
    tok.train_from_iterator(texts, trainer=trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>"
    ).save_pretrained(folder)


def timed(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if res.returncode != 0:
        sys.exit(f"{cmd[:3]} failed:\n{res.stderr[-3000:]}")
    return took


def tokens_in(idx: Path) -> int:
    import numpy as np

    raw = idx.read_bytes()
    count = int.from_bytes(raw[18:26], "little")
    return int(np.frombuffer(raw, dtype=np.int32, count=count, offset=34).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", type=Path, required=True)
    ap.add_argument("--docs", type=int, default=30000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        corpus, tok = tmp / "corpus.jsonl", tmp / "tokenizer"
        make_corpus(corpus, args.docs)
        make_tokenizer(corpus, tok)
        env = {**os.environ, "PYTHONPATH": str(args.megatron_lm.resolve())}
        megatron_prefix = tmp / "megatron" / "out"
        megatron_prefix.parent.mkdir()
        megatron_s = timed(
            [
                sys.executable,
                "tools/preprocess_data.py",
                "--input",
                str(corpus),
                "--output-prefix",
                str(megatron_prefix),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(tok),
                "--json-keys",
                "text",
                "--append-eod",
                "--workers",
                str(args.workers),
            ],
            env,
            cwd=args.megatron_lm,
        )
        ours_s = timed(
            [
                QUANTPATCH,
                "data",
                "prepare",
                "wikipedia",
                "--input",
                str(corpus),
                "--models",
                "llama32-1b",
                "--tokenizer",
                f"llama32-1b={tok}",
                "--data-root",
                str(tmp / "qp"),
                "--workers",
                str(args.workers),
                "--json",
            ],
            dict(os.environ),
        )
        theirs = Path(f"{megatron_prefix}_text_document")
        ours = tmp / "qp" / "wikipedia" / "llama32-1b_text_document"
        same = all(
            Path(f"{theirs}.{s}").read_bytes() == Path(f"{ours}.{s}").read_bytes()
            for s in ("bin", "idx")
        )
        tokens = tokens_in(Path(f"{ours}.idx"))
        size = corpus.stat().st_size
    result = {
        "docs": args.docs,
        "corpus_mb": round(size / 1e6, 2),
        "tokens": tokens,
        "workers": args.workers,
        "megatron_s": round(megatron_s, 2),
        "quantpatch_s": round(ours_s, 2),
        "megatron_tokens_per_s": round(tokens / megatron_s),
        "quantpatch_tokens_per_s": round(tokens / ours_s),
        "ratio": round(megatron_s / ours_s, 2),
        "byte_identical": same,
    }
    print(
        f"{args.docs} documents, {size / 1e6:.1f} MB, {tokens:,} tokens, {args.workers} workers\n"
        f"Megatron tools/preprocess_data.py: {megatron_s:6.2f} s  "
        f"{tokens / megatron_s / 1e6:.2f} M tokens/s\n"
        f"quantpatch data prepare:           {ours_s:6.2f} s  "
        f"{tokens / ours_s / 1e6:.2f} M tokens/s\n"
        f"ratio {megatron_s / ours_s:.2f}x; outputs byte-identical: {same}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
