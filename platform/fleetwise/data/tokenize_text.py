"""Tokenise text files into a fleetwise token file (byte-level, so no tokenizer to train or download).

    fleetwise tokenize corpus.txt [more.txt ...] --out data/corpus.bin

Writes OUT (.bin: little-endian uint16 token ids, the UTF-8 bytes of the text, one 0x0A between
files) and OUT with a .json suffix: {"dtype", "vocab_size", "num_tokens", "space_id"}. vocab_size is
257: the 256 byte values plus one id that never occurs in the data, which ERNIE's masked LM uses as
[MASK]. Train on it with `data=token_file data.path=OUT model.vocab_size=257`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from fleetwise.data.tokens import write_token_file

VOCAB = 257  # bytes + the reserved [MASK]
SPACE = 32


def tokenize(paths: list[Path]) -> np.ndarray:
    chunks = []
    for i, path in enumerate(paths):
        if i:
            chunks.append(np.array([10], dtype=np.uint16))
        chunks.append(np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="fleetwise tokenize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", type=Path, help="UTF-8 text files")
    p.add_argument("--out", type=Path, required=True, help="output .bin path")
    args = p.parse_args(argv)
    missing = [str(x) for x in args.inputs if not x.is_file()]
    if missing:
        print(f"error: not a file: {', '.join(missing)}", file=sys.stderr)
        return 2
    tokens = tokenize(args.inputs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = write_token_file(args.out, tokens, VOCAB, space_id=SPACE, tokenizer="bytes")
    print(
        f"{len(tokens):,} tokens -> {out} (+ {out.with_suffix('.json').name}); use model.vocab_size={VOCAB}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
