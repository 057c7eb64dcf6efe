"""Small transformers models, as torch.export sees them: random weights, two layers, no
download; decoders without their key-value cache (a DynamicCache is no pytree torch.export
knows). The language models among them combine their attention masks with `&`, which
torch.export writes as `aten.__and__.Tensor`: the case a saved program's operator check must
accept (tests/reliability/test_saved_transformers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VOCAB, SEQ, BATCH = 100, 8, 2

_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 64, "max_position_embeddings": 64, "vocab_size": VOCAB}


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(**_SIZES))


def _distilbert() -> torch.nn.Module:
    from transformers import DistilBertConfig, DistilBertModel

    return DistilBertModel(DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2,
                                            hidden_dim=64, max_position_embeddings=64))


def _roberta() -> torch.nn.Module:
    from transformers import RobertaConfig, RobertaModel

    return RobertaModel(RobertaConfig(**_SIZES, pad_token_id=1))


def _electra() -> torch.nn.Module:
    from transformers import ElectraConfig, ElectraModel

    return ElectraModel(ElectraConfig(**_SIZES, embedding_size=16))


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    return LlamaModel(LlamaConfig(**_SIZES, num_key_value_heads=1, use_cache=False))


def _gpt_neox() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXModel

    return GPTNeoXModel(GPTNeoXConfig(**_SIZES, use_cache=False))


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2Model

    return Qwen2Model(Qwen2Config(**_SIZES, num_key_value_heads=1, use_cache=False))


def _opt() -> torch.nn.Module:
    from transformers import OPTConfig, OPTModel

    return OPTModel(OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, ffn_dim=64, max_position_embeddings=64,
                              word_embed_proj_dim=32, use_cache=False))


ZOO: dict[str, Callable[[], torch.nn.Module]] = {
    "bert": _bert, "distilbert": _distilbert, "roberta": _roberta, "electra": _electra,
    "llama": _llama, "gpt_neox": _gpt_neox, "qwen2": _qwen2, "opt": _opt,
}


def example_inputs(seed: int = 0) -> tuple[tuple[torch.Tensor], dict[str, Any]]:
    """Token ids and an attention mask with padding in the second row (so the mask matters)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0
    return (ids,), {"attention_mask": mask}


def export_zoo_model(name: str) -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    """The model `name`, in eval mode with seeded weights, and its export."""
    torch.manual_seed(0)
    model = ZOO[name]().eval()
    args, kwargs = example_inputs()
    with torch.no_grad():
        return model, torch.export.export(model, args, kwargs)
