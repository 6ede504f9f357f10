"""A tiny tokenizer built by the `tokenizers` library in the test (no download): byte-level BPE
trained on a few sentences (fewer than 128 ids), with <s> added before every encoded text (as Llama 3's
<|begin_of_text|>) and </s> named as the end-of-sequence token in tokenizer_config.json, as Hugging
Face model folders ship them."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "question: what is two plus two? answer: four",
    "def add(a, b):\n    return a + b",
    "fleetwise packs documents into rows of seq_len tokens",
]


def write_tokenizer(directory: Path, vocab_size: int = 120) -> Path:
    """`directory`/tokenizer.json (+ tokenizer_config.json); returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))  # only the corpus' characters: a small vocabulary
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    """One line per row: a dict is dumped as JSON, a str is written as it is (a bad line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
