"""Decoder configuration and its ``config.json`` form, with Hugging Face Llama keys
(``num_hidden_layers``, ...), so a small real Llama checkpoint's config loads unchanged.
Unimplemented features (RoPE scaling, biases, an activation other than SiLU) are rejected
on load.

Owns: nothing (a frozen config dataclass and its JSON form).
May call: dataclasses, json, os, torch (dtypes); never spec/, invariants/, fuzz/ or reports/.
Costs: O(1); ``load_json``/``save_json`` O(file).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from ..errors import ConfigError

__all__ = ["DecoderConfig"]

# dataclass field -> Hugging Face config.json key
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
    "max_position_embeddings": "max_position_embeddings",
}


@dataclass(frozen=True)
class DecoderConfig:
    """Geometry and numerics of the paged Llama-style decoder. ``max_position_embeddings`` only
    sizes the initial RoPE table (it grows beyond); ``seed``, ``init_std``: the random init;
    ``dtype``: weights and compute (the KV cache may store another); ``tie_word_embeddings``
    False by default (a tied random head echoes its input, making greedy checks vacuous)."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 344
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("inconsistent", f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError("unsupported", f"head_dim must be even for RoPE, got {self.head_dim}")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ConfigError("out_of_range", f"{f} must be positive")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    # ------------------------------------------------------------------ JSON
    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {hf: getattr(self, f) for f, hf in _HF_KEYS.items()}
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                 attention_bias=False, mlp_bias=False, rope_scaling=None,
                 torch_dtype=str(self.dtype).removeprefix("torch."))
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], **overrides: Any) -> "DecoderConfig":
        if d.get("rope_scaling") not in (None, {}):
            raise ConfigError("unsupported", f"rope_scaling {d['rope_scaling']!r} is not supported")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag):
                raise ConfigError("unsupported", f"{flag}=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError("unsupported", f"hidden_act {d['hidden_act']!r} is not supported (silu only)")
        kw: dict[str, Any] = {}
        for f, hf in _HF_KEYS.items():
            if hf in d and d[hf] is not None:
                kw[f] = d[hf]
        if "head_dim" not in kw and "hidden_size" in kw and "num_heads" in kw:
            kw["head_dim"] = kw["hidden_size"] // kw["num_heads"]
        if "num_kv_heads" not in kw and "num_heads" in kw:
            kw["num_kv_heads"] = kw["num_heads"]
        kw.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in names})

    def save_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_hf_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")

    @classmethod
    def load_json(cls, path: str | os.PathLike[str], **overrides: Any) -> "DecoderConfig":
        with open(path) as fh:
            return cls.from_hf_dict(json.load(fh), **overrides)
