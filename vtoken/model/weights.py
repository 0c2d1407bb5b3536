"""Loading and saving decoder weights as ``config.json`` + ``model.safetensors``.

Naming scheme (Hugging Face ``LlamaForCausalLM``; ``{i}`` = layer index, shapes as
``[out, in]``, Hq = num_heads, Hkv = num_kv_heads, D = head_dim, I = intermediate_size)::

    model.embed_tokens.weight                       [vocab, hidden]
    model.layers.{i}.input_layernorm.weight         [hidden]
    model.layers.{i}.self_attn.q_proj.weight        [Hq*D, hidden]
    model.layers.{i}.self_attn.k_proj.weight        [Hkv*D, hidden]
    model.layers.{i}.self_attn.v_proj.weight        [Hkv*D, hidden]
    model.layers.{i}.self_attn.o_proj.weight        [hidden, Hq*D]
    model.layers.{i}.post_attention_layernorm.weight [hidden]
    model.layers.{i}.mlp.gate_proj.weight           [I, hidden]
    model.layers.{i}.mlp.up_proj.weight             [I, hidden]
    model.layers.{i}.mlp.down_proj.weight           [hidden, I]
    model.norm.weight                               [hidden]
    lm_head.weight                                  [vocab, hidden]  (absent when tied)

RoPE uses HF's rotate-half convention, so a real small Llama checkpoint in one
``model.safetensors`` file loads as is. Loading is strict: a missing, unexpected or
misshapen tensor is an error (``lm_head.weight`` is tolerated and dropped when the config
ties embeddings, as HF checkpoints sometimes carry it).

Owns: nothing (reads and writes the files named).
May call: safetensors, torch, vtoken.model.config, vtoken.model.decoder; never spec/, invariants/,
fuzz/ or reports/.
Costs: O(parameters) per load or save.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vtoken.model.config import DecoderConfig
from vtoken.model.decoder import PagedDecoder
from ..errors import CallError

__all__ = ["load_safetensors", "save_safetensors"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_safetensors(model: PagedDecoder, folder: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``model`` into ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_json(out / CONFIG_NAME)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def load_safetensors(folder: str | os.PathLike[str], dtype: torch.dtype | None = None,
                     batch_invariant: bool = True) -> PagedDecoder:
    """Build a ``PagedDecoder`` from ``folder/config.json`` and ``folder/model.safetensors``.

    ``dtype`` overrides the compute dtype (default float32, whatever the file stores).
    The returned model owns copies of the weights; the files are not kept open.
    """
    src = Path(folder)
    cfg = DecoderConfig.load_json(src / CONFIG_NAME, dtype=dtype or torch.float32)
    model = PagedDecoder(cfg, batch_invariant=batch_invariant)
    state = load_file(str(src / WEIGHTS_NAME))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CallError("bad_weights", f"{src / WEIGHTS_NAME}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CallError("bad_weights", f"{name}: shape {tuple(t.shape)}, expected "
                             f"{tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(cfg.dtype) for k, v in state.items()}, strict=True)
    return model
