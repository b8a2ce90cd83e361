"""Datasets for training: raw text (JSON Lines, Parquet, a ``datasets`` folder) tokenized into
Megatron's indexed dataset (``.bin`` / ``.idx``) at the prefix every script reads
(``prepare``, ``indexed``, ``inputs``), with a manifest beside it that says what it was made
from; where a script's data is looked for and whether it is there (``layout``).

Heavy libraries (tokenizers, transformers, pyarrow, zstandard) load only inside ``prepare`` and
``inputs``; ``layout`` is what ``gen-scripts`` and ``sweep run`` read.

Imports: ``quantpatch.base`` (and ``quantpatch.__version__``)."""
