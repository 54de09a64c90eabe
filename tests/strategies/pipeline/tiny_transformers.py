"""Tiny Hugging Face models built from their default configs (no downloads), and their batches.

Only sizes are changed (layers, widths, heads, vocabulary, experts), never the attention
implementation, the cache or any other behaviour; dropout is turned off (`build(dropout=False)`, the
default) for the exactness comparisons only."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["TRANSFORMERS", "DROPOUT", "FLOAT32", "NORM_IN_FLOAT32", "ENCODER_DECODER", "SEQUENCE_CLASSIFIERS", "PAD",
           "LABELS", "build", "encoded", "lm_batches", "lm_loss", "own_loss"]

VOCAB, SEQ = 100, 8
PAD, LABELS = 0, 3  # the pad token of the classification batches (eos, as HF's examples pad GPT-2); classes

_DECODER = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0}
_ENCODER = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
            "max_position_embeddings": 64}

#: name -> (model class, config class, tiny sizes)
TRANSFORMERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0}),
    "bert": ("BertForMaskedLM", "BertConfig", _ENCODER),
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER),
    "mistral": ("MistralForCausalLM", "MistralConfig", {**_DECODER, "num_key_value_heads": 1, "head_dim": 16}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {**_DECODER, "head_dim": 16}),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                 {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}),
    "opt": ("OPTForCausalLM", "OPTConfig",
            {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "ffn_dim": 64,
             "word_embed_proj_dim": 32, "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 0,
             "eos_token_id": 0}),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig",
                   {"n_layers": 2, "dim": 32, "n_heads": 2, "hidden_dim": 64, "max_position_embeddings": 64}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           {"num_layers": 2, "num_decoder_layers": 2, "d_model": 32, "d_kv": 16, "d_ff": 64, "num_heads": 2,
            "decoder_start_token_id": 0}),
}

#: sequence classification heads on a family of :data:`TRANSFORMERS` (its config and sizes, ``num_labels=3``,
#: ``pad_token_id`` = :data:`PAD` where the config has none, as HF's examples set it). GPT-2 and Llama
#: pool the last non-pad token, found from ``input_ids`` (an index that depends on the data); BERT pools
#: the first token
SEQUENCE_CLASSIFIERS: dict[str, str] = {"bert": "BertForSequenceClassification",
                                        "gpt2": "GPT2ForSequenceClassification",
                                        "llama": "LlamaForSequenceClassification"}

#: the config fields holding each model's dropout probabilities (set to 0 for exactness comparisons)
DROPOUT: dict[str, tuple[str, ...]] = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "llama": (), "mistral": (), "qwen3": (), "mixtral": (),  # no dropout by default
    "gpt_neox": (),
    "opt": ("dropout",),
    "distilbert": ("dropout", "attention_dropout"),
    "t5": ("dropout_rate",),
}

#: models compared in float32: transformers' default mixture-of-experts kernel (grouped matmul) refuses
#: float64 on the CPU, in one process too; every other model runs in float64
FLOAT32 = {"mixtral"}

#: float64 models that normalise in float32 (RMSNorm's ``hidden_states.to(torch.float32)``; T5's
#: variance): the backward rounds their gradients to float32 there, so a loss scale applied before it
#: (one process: each of M micro-batches' losses / M) and one applied after it (data parallelism: the
#: allreduce's average over R) round differently unless the scale is a power of two (3 ranks: 1/3)
NORM_IN_FLOAT32 = {"llama", "mistral", "qwen3", "mixtral", "t5"}

#: models whose forward takes decoder inputs (``decoder_input_ids``; or ``labels``, shifted right)
ENCODER_DECODER = {"t5"}


def _transformers() -> Any:
    """transformers, imported without torchvision when torchvision's C++ ops do not load with this torch
    (transformers then imports its image utilities without it)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]  # find_spec then says "absent"
    return importlib.import_module("transformers")


def build(name: str, seed: int = 0, meta: bool = False, dropout: bool = False,
          dtype: torch.dtype | None = None, classify: bool = False) -> nn.Module:
    """The tiny model `name` from its default config (default attention, ``use_cache`` as the config
    has it) with tiny sizes, in `dtype` (default float64, float32 for :data:`FLOAT32`); dropout off
    unless `dropout` (then the config's defaults); with `meta`, built on the meta device (no
    storage: `seed` plays no part); with `classify`, its sequence classification head
    (:data:`SEQUENCE_CLASSIFIERS`) instead of the language-model head."""
    tf = _transformers()
    model_cls, config_cls, kwargs = TRANSFORMERS[name]
    off = {} if dropout else {k: 0.0 for k in DROPOUT[name]}
    config = getattr(tf, config_cls)(vocab_size=VOCAB, **kwargs, **off)
    if classify:
        model_cls, config.num_labels = SEQUENCE_CLASSIFIERS[name], LABELS
        if config.pad_token_id is None:  # GPT-2 and Llama have none: batches of several rows need one
            config.pad_token_id = PAD
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = getattr(tf, model_cls)(config)
    return model.to(dtype or (torch.float32 if name in FLOAT32 else torch.float64))


def lm_batches(n: int, steps: int, seed: int = 0, mask: bool = True, lengths: tuple[int, ...] = (SEQ,),
               decoder: bool = False, labels: bool = False,
               classify: bool = False) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """(inputs as keyword arguments, targets) batches of `n` sequences, step i of ``lengths[i % len]``
    tokens; attention masks with padded tails when `mask`; with `decoder`, ``decoder_input_ids`` of
    half the length (+1), which the targets then follow; with `labels`, the targets also among the
    inputs (the model computes its own loss), -100 (ignored) where the mask pads. With `classify`:
    one of :data:`LABELS` classes per sequence, :data:`PAD` in the padded tails and nowhere else (as
    a tokenizer pads), so a classifier's last non-pad token differs between rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        length = lengths[i % len(lengths)]
        ids = torch.randint(PAD + 1 if classify else 0, VOCAB, (n, length), generator=g)
        inputs = {"input_ids": ids}
        if mask:
            keep = torch.randint(length // 2, length + 1, (n, 1), generator=g)
            inputs["attention_mask"] = (torch.arange(length) < keep).long()
            if classify:
                inputs["input_ids"] = ids.masked_fill(inputs["attention_mask"] == 0, PAD)
        if decoder:
            inputs["decoder_input_ids"] = torch.randint(0, VOCAB, (n, length // 2 + 1), generator=g)
        targets = torch.randint(0, VOCAB, (n, inputs.get("decoder_input_ids", ids).shape[1]), generator=g)
        if classify:
            targets = torch.randint(0, LABELS, (n,), generator=g)
        elif labels and mask and not decoder:
            targets = targets.masked_fill(inputs["attention_mask"] == 0, -100)
        if labels:
            inputs["labels"] = targets
        out.append((inputs, targets))
    return out


def encoded(batches: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> list[tuple[Any, torch.Tensor]]:
    """The batches with their inputs as a tokenizer returns them (``tokenizer(texts, padding=True,
    return_tensors="pt")``): a ``BatchEncoding``, a mapping that is not a dict."""
    batch_encoding = _transformers().BatchEncoding
    return [(batch_encoding(x), y) for x, y in batches]


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the output's logits (a ModelOutput, as the model returns it) against labels."""
    return nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))


def own_loss(out: Any, _targets: Any) -> torch.Tensor:
    """The model's own loss (``labels`` among the inputs), as Hugging Face's examples train."""
    return out.loss


