"""Megatron-LM core_v0.13.1's ``tools/preprocess_data.py --json-keys text --tokenizer-type
HuggingFaceTokenizer --append-eod`` (one partition, no sentence splitting), reproduced for the
tests with the megatron-core wheel's own ``IndexedDatasetBuilder`` (the tool itself lives in
the Megatron-LM repository, not in the wheel, and CI cannot fetch it): each line
``json.loads``-ed, the text tokenized as ``_HuggingFaceTokenizer.tokenize`` does
(``AutoTokenizer.from_pretrained(path)(text).input_ids``), empty sentences dropped, the EOS
id appended to a document that has tokens, ``add_document`` per line and ``finalize``; the
dtype from ``DType.optimal_dtype(len(tokenizer))``. Also reads a prefix back through the
wheel's ``IndexedDataset`` and ``GPTDataset`` (``BlendedMegatronDatasetBuilder``) on CPU.

Run with the wheel's tree on PYTHONPATH:
  python megatron_preprocess_reference.py write INPUT.jsonl TOKENIZER OUTPUT_PREFIX
  python megatron_preprocess_reference.py read PREFIX TOKENIZER CACHE_DIR OUT.json
"""

import json
import sys


def write(input_path: str, tokenizer_path: str, prefix: str) -> None:
    import transformers
    from megatron.core.datasets import indexed_dataset

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    builder = indexed_dataset.IndexedDatasetBuilder(
        prefix + ".bin", dtype=indexed_dataset.DType.optimal_dtype(len(tok))
    )
    with open(input_path, encoding="utf-8") as fin:
        for line in fin:
            text = json.loads(line)["text"]
            sentences = text if isinstance(text, list) else [text]
            doc_ids, lens = [], []
            for sentence in sentences:
                ids = tok(sentence).input_ids
                if len(ids) > 0:
                    doc_ids.extend(ids)
                    lens.append(len(ids))
            if len(doc_ids) > 0:
                doc_ids.append(tok.eos_token_id)
                lens[-1] += 1
            builder.add_document(doc_ids, lens)
    builder.finalize(prefix + ".idx")


def read(prefix: str, tokenizer_path: str, cache: str, out: str) -> None:
    import numpy
    import transformers
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_path)

    class Tok:  # the two ids GPTDataset asks a MegatronTokenizer for
        eod = hf.eos_token_id
        pad = hf.eos_token_id
        unique_identifiers = {"class": "Tok", "name": tokenizer_path}  # noqa: RUF012

    ds = IndexedDataset(prefix)
    sequences = [ds[i].tolist() for i in range(len(ds))]
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=32,
        blend=([prefix], None),
        split="1,0,0",  # every document in train: a split with no tokens never ends an epoch
        path_to_cache=cache,
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [20, 2, 1], lambda: True, config
    ).build()
    sample = train[0]
    with open(out, "w") as fh:
        json.dump(
            {
                "sequences": sequences,
                "document_indices": ds.document_indices.tolist(),
                "dtype": numpy.dtype(ds.index.dtype).name,
                "train_samples": len(train),
                "sample_tokens": sample["tokens"].tolist(),
                "sample_labels": sample["labels"].tolist(),
            },
            fh,
        )


if __name__ == "__main__":
    {"write": write, "read": read}[sys.argv[1]](*sys.argv[2:])
