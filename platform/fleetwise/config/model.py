"""What is trained: the `model` config group, one schema per model family.

Transformer families (GPT, ERNIE) share one naming scheme: num_layers, hidden_size,
num_attention_heads, ffn_hidden_size, vocab_size, seq_len.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fleetwise.config.base import Section

# Embedding and LM-head rows are padded to a multiple of this, independent of the layout, so a model
# has the same parameters under every mp_degree (checkpoints reshard; parity tests compare exactly).
VOCAB_MULTIPLE = 64


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


class TransformerModel(Section):
    num_layers: int = Field(ge=1, description="Transformer blocks.")
    hidden_size: int = Field(ge=1, description="Model width h.")
    num_attention_heads: int = Field(ge=1, description="Attention heads a (h must divide by a).")
    ffn_hidden_size: int = Field(ge=1, description="Width of the MLP inside each block (usually 4h).")
    vocab_size: int = Field(
        ge=2, description="Token vocabulary (embedding rows are padded to a multiple of 64)."
    )
    seq_len: int = Field(ge=2, description="Tokens per sample (also the number of learned positions).")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout probability (0 keeps runs bit-reproducible)."
    )
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init (GPT-2/BERT use 0.02).")

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab(self.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_transformer(self) -> bool:
        return True


class GPTModel(TransformerModel):
    """Decoder-only causal LM (GPT-2/3): pre-LN blocks, learned positions, untied LM head."""

    family: Literal["gpt"] = "gpt"


class ERNIEModel(TransformerModel):
    """Bidirectional encoder pre-trained with knowledge masking (ERNIE 1.0/3.0): post-LN, token types, MLM head."""

    family: Literal["ernie"] = "ernie"
    type_vocab_size: int = Field(4, ge=1, description="Sentence/segment type embeddings.")
    masking: Literal["token", "whole_word", "entity_span"] = Field(
        "whole_word",
        description="Masked-LM unit: single tokens (BERT), whole words or entity/phrase spans (ERNIE 1.0).",
    )
    mask_prob: float = Field(0.15, gt=0, lt=1, description="Fraction of tokens selected for prediction.")
    max_span_words: int = Field(3, ge=1, description="entity_span: longest span of words masked together.")


class ResNetModel(Section):
    """ResNet image classifier (He et al. 2015): stem, four stages of residual blocks, pooling, classifier."""

    family: Literal["resnet"] = "resnet"
    block: Literal["basic", "bottleneck"] = Field("bottleneck", description="Residual block type.")
    layers: list[Annotated[int, Field(ge=1)]] = Field(
        description="Blocks per stage, e.g. [3, 4, 6, 3] for ResNet-50."
    )
    base_width: int = Field(64, ge=1, description="Channels of the first stage (64 in the paper).")
    num_classes: int = Field(1000, ge=2, description="Output classes.")
    image_size: int = Field(224, ge=8, description="Square input resolution.")
    in_channels: int = Field(3, ge=1, description="Input channels.")

    @property
    def is_transformer(self) -> bool:
        return False

    @property
    def num_layers(self) -> int:
        """Residual blocks: the units a pipeline split distributes."""
        return sum(self.layers)


class SparseTable(Section):
    name: str = Field(description="Feature field name (also the parameter name on the servers).")
    num_embeddings: int = Field(ge=1, description="Rows (distinct ids of the field).")
    distributed: bool = Field(
        True,
        description="Rows live only on parameter servers (is_distributed); trainers pull the rows of a batch.",
    )


class CTRModel(Section):
    """Click-through-rate model over sparse id fields and dense features: DeepFM or Wide&Deep."""

    family: Literal["ctr"] = "ctr"
    kind: Literal["deepfm", "wide_deep"] = Field(
        "deepfm", description="DeepFM (Guo et al. 2017) or Wide&Deep."
    )
    embedding_dim: int = Field(ge=1, description="Embedding width of every sparse field.")
    sparse_tables: list[SparseTable] = Field(
        min_length=1, description="One embedding table per sparse field."
    )
    num_dense_features: int = Field(13, ge=0, description="Continuous features (Criteo has 13).")
    mlp_hidden: list[Annotated[int, Field(ge=1)]] = Field(description="Widths of the deep MLP.")

    @property
    def is_transformer(self) -> bool:
        return False

    @property
    def num_layers(self) -> int:
        return len(self.mlp_hidden)


ModelConfig = Annotated[GPTModel | ERNIEModel | ResNetModel | CTRModel, Field(discriminator="family")]
