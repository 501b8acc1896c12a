"""Tiny random models for running real vLLM engines without a download.

Each writer builds a model from a ``transformers`` config with a fixed seed and saves it with
``save_pretrained`` (safetensors + config.json); vLLM loads the folder like any checkpoint.
Prompts are token ids (engines run with ``skip_tokenizer_init=True``), so no tokenizer is written.

* :func:`write_dense_llama`: a Llama of about 0.6 M parameters, 2 layers, 2 KV heads of 64
  (so TP 2 gives each rank one head).
* :func:`write_hybrid_granite`: a GraniteMoeHybrid with one Mamba2 layer and one attention
  layer and no experts: vLLM runs it with the hybrid memory allocator (a Mamba group and an
  attention group that alias the same memory).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512

DENSE = "dense"
HYBRID = "hybrid"
MODELS = (DENSE, HYBRID)


def write_dense_llama(path: str | Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(LlamaForCausalLM, config, path, seed, torch)


def write_hybrid_granite(path: str | Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        max_position_embeddings=1024,
        position_embedding_type="rope",
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(GraniteMoeHybridForCausalLM, config, path, seed, torch)


def write_model(kind: str, path: str | Path, *, seed: int = 0) -> Path:
    if kind == DENSE:
        return write_dense_llama(path, seed=seed)
    if kind == HYBRID:
        return write_hybrid_granite(path, seed=seed)
    raise ValueError(f"unknown tiny model {kind!r}; known: {', '.join(MODELS)}")


def _save(model_cls: type, config: object, path: str | Path, seed: int, torch: object) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)  # type: ignore[attr-defined]
    model = model_cls(config)
    # Random weights of the init's scale give near-uniform logits; a larger scale makes greedy
    # decoding depend on the whole prompt, so a wrong KV byte changes the tokens.
    with torch.no_grad():  # type: ignore[attr-defined]
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    model.save_pretrained(out, safe_serialization=True)
    # No tokenizer: prompts are token ids. vLLM reads generation_config.json when present.
    (out / "pdwire-tiny-model.json").write_text(json.dumps({"seed": seed}))
    return out
