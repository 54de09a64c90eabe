"""Tiny Hugging Face models built from configs (no downloads), float64, dropout off, and their batches."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["TRANSFORMERS", "build", "lm_batches", "lm_loss", "mlm_loss"]

VOCAB, SEQ = 100, 8

#: name -> (model class, config class, config arguments beyond the shared tiny sizes)
TRANSFORMERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    "bert": ("BertForMaskedLM", "BertConfig",
             {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 32, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
               "intermediate_size": 64, "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0}),
}


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


def build(name: str, seed: int = 0, meta: bool = False) -> nn.Module:
    """The tiny model `name`, float64, from its default config (default attention, ``use_cache``
    left as the config has it) but tiny sizes and dropout 0 (exactness comparisons); with `meta`,
    built on the meta device (no storage: `seed` plays no part)."""
    tf = _transformers()
    model_cls, config_cls, kwargs = TRANSFORMERS[name]
    config = getattr(tf, config_cls)(vocab_size=VOCAB, **kwargs)
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return getattr(tf, model_cls)(config).double()


def lm_batches(n: int, steps: int, seed: int = 0, mask: bool = True) -> list[tuple[dict[str, torch.Tensor],
                                                                                torch.Tensor]]:
    """(inputs as keyword arguments, labels) batches; attention masks with padded tails when `mask`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        inputs = {"input_ids": ids}
        if mask:
            lengths = torch.randint(SEQ // 2, SEQ + 1, (n, 1), generator=g)
            inputs["attention_mask"] = (torch.arange(SEQ) < lengths).long()
        out.append((inputs, torch.randint(0, VOCAB, (n, SEQ), generator=g)))
    return out


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the output's logits (a ModelOutput, as the model returns it) against labels."""
    return nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))


mlm_loss = lm_loss
