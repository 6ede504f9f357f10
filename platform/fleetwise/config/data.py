"""What a job trains on: the `data` config group (conf/data/: synthetic, bundled, token_file,
image_folder, image_array, custom, jsonl).

Which sources a model family reads is the family's (`Family.data_sources`); whether a file exists
and has the right shape is checked by config/rules/datafiles.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fleetwise.config.base import Section


class DataConfig(Section):
    source: Literal["synthetic", "bundled", "token_file", "image_folder", "image_array", "custom", "jsonl"] = Field(
        "synthetic",
        description="synthetic (seeded, layout-independent), bundled (real data every installation "
        "has: the standard library's text as byte tokens for GPT/ERNIE, scikit-learn's 8x8 digits "
        "for ResNet), a file reader (jsonl: fine-tuning documents for Llama), or custom (your own Dataset, "
        "`dataset`).",
    )
    path: str | None = Field(
        None,
        description="token_file: .bin of token ids (+ .json meta); image_*: folder or .npz; jsonl: one "
        '{"text": …} or {"prompt": …, "response": …} object per line.',
    )
    tokenizer: str | None = Field(
        None,
        description="data=jsonl: a tokenizer.json (or a directory holding one) for the `tokenizers` "
        "library (null: model.init_from's).",
    )
    seed: int = Field(1234, description="Seed of the synthetic data and of masking.")
    num_samples: int = Field(
        1_000_000, ge=1, description="Synthetic: distinct samples before the stream repeats (an epoch)."
    )
    zipf_alpha: float = Field(1.1, gt=1, description="CTR synthetic ids: Zipf exponent of id popularity.")
    dataset: dict[str, Any] | None = Field(
        None,
        description="data=custom: your map-style torch Dataset as Hydra instantiates it (`_target_` and its "
        "keyword arguments); its items are dicts of tensors.",
    )
