"""Megatron's indexed dataset, written as core_v0.13.1's
``megatron/core/datasets/indexed_dataset.py`` ``IndexedDatasetBuilder`` writes it (the tests
prove the bytes equal to that builder's, fed as ``tools/preprocess_data.py`` feeds it):

- ``.bin``: every document's token ids, back to back, in the index's dtype;
- ``.idx``: ``MMIDIDX\\0\\0``, version 1 (<Q), the dtype code (<B), the sequence count (<Q),
  the document count (<Q, one more than the documents: a leading 0), the sequence lengths
  (int32), the sequence byte offsets (int64), the document indices (int64, the sequence index
  where each document ends).

The dtype is uint16 for a vocabulary under 65500 (``DType.optimal_dtype``), else int32."""

from __future__ import annotations

import struct
from array import array
from pathlib import Path
from typing import IO, Any

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def optimal_dtype(vocab_size: int) -> Any:
    return np.uint16 if vocab_size < 65500 else np.int32


class Writer:
    """Documents appended in order to ``<prefix>.bin``; ``finish`` writes ``<prefix>.idx``."""

    def __init__(self, prefix: Path, vocab_size: int) -> None:
        self.dtype = np.dtype(optimal_dtype(vocab_size))
        self.prefix = prefix
        self.bin: IO[bytes] = open(f"{prefix}.bin", "wb")  # noqa: SIM115 (closed by finish)
        self.lengths = array("q")
        self.document_ends = array("q", [0])
        self.tokens = 0

    def add(self, flat: list[int], lengths: list[int], ends_at: list[int]) -> None:
        """A batch: its token ids back to back, each sequence's length, and for each document
        the number of sequences of the batch up to its end."""
        self.bin.write(np.asarray(flat, dtype=self.dtype).tobytes())
        base = len(self.lengths)
        self.lengths.extend(lengths)
        self.document_ends.extend(base + e for e in ends_at)
        self.tokens += len(flat)

    @property
    def documents(self) -> int:
        return len(self.document_ends) - 1

    def finish(self) -> None:
        self.bin.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int64) if self.lengths else np.zeros(0)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(f"{self.prefix}.idx", "wb") as fh:
            fh.write(HEADER)
            fh.write(struct.pack("<Q", 1))
            fh.write(struct.pack("<B", CODES[self.dtype.name]))
            fh.write(struct.pack("<Q", len(lengths)))
            fh.write(struct.pack("<Q", len(self.document_ends)))
            fh.write(lengths.astype(np.int32).tobytes())
            fh.write(pointers.tobytes())
            fh.write(np.frombuffer(self.document_ends, dtype=np.int64).tobytes())

    def abandon(self) -> None:
        self.bin.close()
