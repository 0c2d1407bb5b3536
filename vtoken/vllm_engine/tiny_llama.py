"""A tiny Llama with real, seeded weights, written at run time (no download, nothing committed).

vLLM's ``load_format="dummy"`` fills weights uniform in +-1e-3: greedy output is then a
context-free loop, and a wrong K/V read would not change it. These weights are seeded normal
draws scaled so attention is sharp: the output depends on which K/V each step reads, so an
oracle comparing tokens (Naive-Evict vs vtoken, or a poisoned-source control) can fail.

:func:`ensure_tiny_llama` writes ``config.json`` and ``model.safetensors`` (about 1.2 MB) into a
folder keyed by the recipe (default under ``~/.cache/vtoken/models/``), once; later calls
reuse it. No tokenizer: prompts are token ids.
Owns: the folder it writes.
May call: torch, safetensors, json.
Costs: about 0.1 s to write; O(1) to reuse.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 64, "num_hidden_layers": 2, "max_position_embeddings": 4096, "vocab_size": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
RECIPE = 1  # bump when the weights' recipe changes (the cache key)


def _weights(cfg: dict, seed: int, std: float) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, cfg["torch_dtype"])
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def w(*shape, scale=1.0):  # fan-in scaled, with a gain that keeps attention far from uniform
        return (torch.randn(*shape, generator=g) * (4.0 * std * scale / shape[-1] ** 0.5)).to(dt)

    sd = {"model.embed_tokens.weight": torch.randn(v, h, generator=g).to(dt),
          "model.norm.weight": torch.ones(h, dtype=dt), "lm_head.weight": w(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=dt)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dt)
        sd[p + "self_attn.q_proj.weight"] = w(nh * hd, h, scale=2.0)
        sd[p + "self_attn.k_proj.weight"] = w(nkv * hd, h, scale=2.0)
        sd[p + "self_attn.v_proj.weight"] = w(nkv * hd, h)
        sd[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
        sd[p + "mlp.gate_proj.weight"] = w(f, h)
        sd[p + "mlp.up_proj.weight"] = w(f, h)
        sd[p + "mlp.down_proj.weight"] = w(h, f)
    return {k: t.contiguous() for k, t in sd.items()}


def ensure_tiny_llama(root: str | os.PathLike | None = None, *, seed: int = 0, std: float = 0.5) -> Path:
    """The model folder for ``(seed, std)``, written if missing; returns its path."""
    from safetensors.torch import save_file

    key = hashlib.sha256(json.dumps([RECIPE, CONFIG, seed, std], sort_keys=True).encode()).hexdigest()[:12]
    base = Path(root) if root is not None else Path(os.environ.get("VTOKEN_MODEL_CACHE") or
                                                   Path.home() / ".cache" / "vtoken" / "models")
    out = base / f"tiny-llama-{key}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    tmp = base / f".tiny-llama-{key}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=1))
    save_file(_weights(CONFIG, seed, std), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        os.replace(tmp, out)  # atomic: a concurrent writer's folder wins, this one is dropped
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
