"""A small Llama-style paged decoder driven by slots (see ``decoder.py`` for contracts).

Owns: nothing (re-exports).
May call: vtoken.model.config, .decoder, .rope, .weights; never spec/, invariants/, fuzz/ or
reports/.
Costs: importing it imports torch and safetensors.
"""

from __future__ import annotations

from vtoken.model.config import DecoderConfig
from vtoken.model.decoder import DecodeItem, PagedDecoder, RMSNorm, greedy
from vtoken.model.rope import RopeTable, apply_rope
from vtoken.model.weights import load_safetensors, save_safetensors

__all__ = [
    "DecodeItem",
    "DecoderConfig",
    "PagedDecoder",
    "RMSNorm",
    "RopeTable",
    "apply_rope",
    "greedy",
    "load_safetensors",
    "save_safetensors",
]
