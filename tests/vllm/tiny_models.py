"""Tiny random models for running real vLLM engines without a download.

Each writer builds a model from a ``transformers`` config with a fixed seed and saves it with
``save_pretrained`` (safetensors + config.json); vLLM loads the folder like any checkpoint.
Prompts are token ids (engines run with ``skip_tokenizer_init=True``), so no tokenizer is written.

* :func:`write_dense_llama`: a Llama of about 0.6 M parameters, 2 layers, 2 KV heads of 64
  (so TP 2 gives each rank one head).
* :func:`write_hybrid_granite`: a GraniteMoeHybrid with one Mamba2 layer and one attention
  layer and no experts: vLLM runs it with the hybrid memory allocator (a Mamba group and an
  attention group that alias the same memory).
* :func:`write_mla_deepseek`: a DeepSeek-V2 with multi-head latent attention (a latent of
  ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 per token, the only size vLLM CPU's ``CPU_MLA``
  decode kernel runs), 2 layers with dense MLPs (no experts) and 4 query heads (2 per rank at TP 2).
* :func:`write_sliding_gemma3`: a Gemma3 text model of sliding-window layers (a 64-token window)
  and a last full-attention one (or none): vLLM runs it with the hybrid allocator, one KV cache
  group per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512

DENSE = "dense"
HYBRID = "hybrid"
MLA = "mla"
MODELS = (DENSE, HYBRID, MLA)


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


def write_mla_deepseek(path: str | Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        # every layer below first_k_dense_replace has a dense MLP: no experts are built; the
        # expert fields only have to be valid
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        max_position_embeddings=1024,
        # DeepSeek's own YaRN rope (as DeepSeek-V2 ships it), which vLLM's CPU build runs in
        # PyTorch: its default rope kernel misreads the strided rope halves of MLA's q and k, so
        # a prompt's tokens would depend on the other prompts in its batch
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(DeepseekV2ForCausalLM, config, path, seed, torch)


SLIDING_WINDOW = 64  # tokens; two 32-token blocks, so a prompt of a few blocks leaves some out


def write_sliding_gemma3(path: str | Path, *, seed: int = 0, layers: int = 3, full: bool = True) -> Path:
    """A Gemma3 text model of ``layers`` layers, sliding-window attention of ``SLIDING_WINDOW``
    tokens but the last, which is full attention (``full``; else every layer slides): vLLM runs
    it with the hybrid allocator, one KV cache group per layer kind and page size (here one per
    layer). 2 KV heads of 64 (one per rank at TP 2)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    last = "full_attention" if full else "sliding_attention"
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention"] * (layers - 1) + [last],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _save(Gemma3ForCausalLM, config, path, seed, torch)


def write_model(kind: str, path: str | Path, *, seed: int = 0) -> Path:
    if kind == DENSE:
        return write_dense_llama(path, seed=seed)
    if kind == HYBRID:
        return write_hybrid_granite(path, seed=seed)
    if kind == MLA:
        return write_mla_deepseek(path, seed=seed)
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
