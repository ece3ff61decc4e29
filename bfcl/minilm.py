"""A sentence encoder for BERT-architecture sentence-transformers folders (all-MiniLM-L6-v2 and its kind), on torch
and the `tokenizers` library alone.

The sentence-transformers library builds the same model through transformers; importing the two costs 3-4 s of CPU
in every process that embeds (the proxy, each replay, each CLI run), against ~1 s for torch alone. This module runs
the same computation, written out: WordPiece tokens (the folder's tokenizer.json, texts stripped, truncated to the
folder's `max_seq_length`, padded to the batch's longest), BERT's embeddings (word + token type, then position,
LayerNorm), N encoder layers (self-attention by torch's scaled-dot-product attention, LayerNorm after each residual,
GELU), the mean of the token vectors under the attention mask, L2 normalisation. Texts are encoded in batches sorted
by length, as sentence-transformers does, so a text's padding (and its vector) is the same as it gets there.

`load(path)` returns None for a folder this module does not read exactly (another architecture, another pooling,
extra modules): the caller then uses sentence-transformers, if installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

#: the modules a folder may list, in order (the Normalize module is optional: vectors are normalised anyway)
_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
            "sentence_transformers.models.Normalize")


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_out = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.out = nn.Linear(intermediate, hidden)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, h = x.shape
        split = (b, s, self.heads, h // self.heads)
        q = self.query(x).view(split).transpose(1, 2)
        k = self.key(x).view(split).transpose(1, 2)
        v = self.value(x).view(split).transpose(1, 2)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, h)
        attended = self.attention_norm(self.attention_out(context) + x)
        return self.out_norm(self.out(F.gelu(self.intermediate(attended))) + attended)


class Bert(nn.Module):
    """BERT's encoder, inference only (no dropout, no pooler)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("layer_norm_eps", 1e-12))
        self.word = nn.Embedding(int(config["vocab_size"]), hidden)
        self.position = nn.Embedding(int(config["max_position_embeddings"]), hidden)
        self.token_type = nn.Embedding(int(config.get("type_vocab_size", 2)), hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(
            _Layer(hidden, int(config["num_attention_heads"]), int(config["intermediate_size"]), eps)
            for _ in range(int(config["num_hidden_layers"])))

    def forward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Token vectors, shape (batch, tokens, hidden), of `ids` (batch, tokens) under `attention` (1 = a token)."""
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        x = self.word(ids) + self.token_type(torch.zeros_like(ids))
        x = self.norm(x + self.position(positions))
        # a boolean mask over the keys (padding is never attended to); none when the batch has no padding
        mask = None if bool(attention.all()) else attention.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """BERT's checkpoint names (with or without the `bert.` prefix) onto this module's; every weight this
        module has must be there with its shape (ValueError otherwise)."""
        names = {"word.weight": "embeddings.word_embeddings.weight",
                 "position.weight": "embeddings.position_embeddings.weight",
                 "token_type.weight": "embeddings.token_type_embeddings.weight",
                 "norm.weight": "embeddings.LayerNorm.weight", "norm.bias": "embeddings.LayerNorm.bias"}
        parts = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
                 "attention_out": "attention.output.dense", "attention_norm": "attention.output.LayerNorm",
                 "intermediate": "intermediate.dense", "out": "output.dense", "out_norm": "output.LayerNorm"}
        for i in range(len(self.layers)):
            for mine, theirs in parts.items():
                for kind in ("weight", "bias"):
                    names[f"layers.{i}.{mine}.{kind}"] = f"encoder.layer.{i}.{theirs}.{kind}"
        state = {}
        own = self.state_dict()
        for mine, theirs in names.items():
            tensor = tensors.get(theirs, tensors.get(f"bert.{theirs}"))
            if tensor is None or tensor.shape != own[mine].shape:
                raise ValueError(f"the weights have no {theirs} of shape {tuple(own[mine].shape)}")
            state[mine] = tensor.float()
        self.load_state_dict(state)


class Encoder:
    """A folder's tokenizer and BERT, with the folder's `max_seq_length`: `encode(texts)` gives normalised vectors."""

    def __init__(self, tokenizer: Any, bert: Bert, max_seq_length: int) -> None:
        self.tokenizer = tokenizer
        self.bert = bert
        self.max_seq_length = max_seq_length
        self.dim = bert.word.embedding_dim

    def features(self, texts: Sequence[str], max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask (batch, longest), each text stripped, [CLS] ... [SEP], cut to `max_length`
        tokens (default: the folder's `max_seq_length`)."""
        self.tokenizer.enable_truncation(max_length or self.max_seq_length)
        encodings = self.tokenizer.encode_batch([t.strip() for t in texts])
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.long)
        attention = torch.tensor([e.attention_mask for e in encodings], dtype=torch.long)
        return ids, attention

    def vectors(self, model: nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Mean of `model`'s token vectors under the mask, L2-normalised (float32, shape (batch, dim))."""
        with torch.inference_mode():
            tokens = model(ids, attention)
            weights = attention.unsqueeze(-1).to(tokens.dtype)
            mean = (tokens * weights).sum(1) / torch.clamp(weights.sum(1), min=1e-9)
            return F.normalize(mean, p=2, dim=1).float()

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> Any:
        """Normalised vectors of `texts` as a float32 numpy array (len(texts), dim): the texts sorted by length
        (longest first), encoded `batch_size` at a time, returned in the order given."""
        import numpy as np

        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            ids, attention = self.features([texts[i] for i in chunk])
            out[chunk] = self.vectors(self.bert, ids, attention).numpy()
        return out


def readable(path: Path) -> bool:
    """Whether `path` is a folder this module encodes exactly as sentence-transformers would: a BERT transformer
    then mean pooling (and optionally Normalize), its tokenizer.json and safetensors weights present."""
    try:
        modules = json.loads((path / "modules.json").read_text())
        config = json.loads((path / "config.json").read_text())
        pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return False
    kinds = tuple(m.get("type") for m in modules) if isinstance(modules, list) else ()
    modes = {k: v for k, v in pooling.items() if k.startswith("pooling_mode_") and v}
    return (kinds in (_MODULES, _MODULES[:2]) and modules[0].get("path") in ("", None)
            and modules[1].get("path") == "1_Pooling"
            and config.get("model_type") == "bert" and config.get("hidden_act") == "gelu"
            and config.get("position_embedding_type", "absolute") == "absolute"
            and set(modes) == {"pooling_mode_mean_tokens"}
            and (path / "tokenizer.json").is_file() and (path / "model.safetensors").is_file())


def load(path: Path) -> Encoder | None:
    """The encoder of a `readable` folder; None for any other folder. Raises on a readable folder whose files are
    broken (weights missing or of the wrong shape, a tokenizer that does not load)."""
    if not readable(path):
        return None
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    config = json.loads((path / "config.json").read_text())
    try:
        st_config = json.loads((path / "sentence_bert_config.json").read_text())
    except (OSError, ValueError):
        st_config = {}
    max_len = min(int(st_config.get("max_seq_length") or config["max_position_embeddings"]),
                  int(config["max_position_embeddings"]))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_padding(pad_id=int(config.get("pad_token_id", 0)), pad_token="[PAD]")
    bert = Bert(config)
    bert.load_weights(load_file(str(path / "model.safetensors")))
    bert.eval()
    return Encoder(tokenizer, bert, max_len)
