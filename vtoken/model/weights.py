"""Loading and saving decoder weights as ``config.json`` + ``model.safetensors``.

Tensor names are Hugging Face ``LlamaForCausalLM``'s (``model.embed_tokens.weight``,
``model.layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}.weight``, ``model.norm.weight``, ``lm_head.weight`` unless tied),
linear shapes ``[out, in]``; RoPE is rotate-half, so a small real Llama checkpoint loads as
is. Loading is strict: a missing, unexpected or misshapen tensor is an error
(``lm_head.weight`` is dropped when the config ties embeddings).

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
    """Build a ``PagedDecoder`` from ``folder/config.json`` and ``folder/model.safetensors``;
    ``dtype`` overrides the compute dtype (default float32). The model owns copies of the
    weights; the files are not kept open."""
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
