"""A small Llama-style decoder that reads and writes a paged KV cache by slot.

Token embedding -> L x [RMSNorm -> GQA attention with RoPE -> residual, RMSNorm -> SwiGLU MLP
-> residual] -> RMSNorm -> LM head (tied or not); parameter names are Hugging Face
``LlamaForCausalLM``'s. Callers say, per token, which slot to write (``write_slot(s)``) and
which to read (``read_slots``: the live tokens in logical order); their validity is theirs.

Determinism, for a fixed torch thread count on one machine:

* placement invariance (always): logits and attention statistics depend only on the bytes
  of the K/V read and their order, never on which slots hold them;
* batch invariance (``batch_invariant=True``, default): each request's forward runs alone
  with ``[1, hidden]`` activations (batched GEMM rows and vectorised SiLU/exp are not
  bitwise equal to the same row alone). ``False`` batches projections and MLP across
  requests (attention stays per request): placement invariance only.

Owns: its weights and its RoPE table; never the KV cache, the token table or the allocator (callers
pass the cache and the slots).
May call: torch, vtoken.kvcache, vtoken.model.config, vtoken.model.rope; never spec/, invariants/,
fuzz/ or reports/.
Costs: per decode step O(layers x (weights + read slots)) per request (batch-invariant: one forward
per request); prefill O(layers x prompt^2) attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vtoken.kvcache import KVCache
from vtoken.model.config import DecoderConfig
from vtoken.model.rope import RopeTable, apply_rope
from ..errors import CallError

__all__ = ["DecodeItem", "PagedDecoder", "Windowed", "attend", "greedy"]


class DecodeItem(NamedTuple):
    """One request's input to a decode step: ``read_slots``, the slots of its LIVE tokens in
    logical order without the new one; ``write_slot`` (not in ``read_slots``) for the new token's
    K/V; ``position``, the new token's original position id."""

    token_id: int
    position: int
    write_slot: int
    read_slots: torch.Tensor


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request's chunk over the keys it reads: the one implementation of the
    decoder and of vLLM's engine path (``vtoken.vllm_engine.attention``), plain torch.

    q ``[m, Hq, D]`` over k, v ``[T, Hkv, D]`` (``Hq`` a multiple of ``Hkv``) -> (out ``[m, Hq*D]``,
    stat ``[T]``): ``stat[j]`` the probability key j received, summed over the m queries,
    averaged over the Hq heads (what H2O and Scissorhands score). Causal: query i is the i-th
    of the *last* m keys; ``window`` (> 0): a query also sees only its last ``window`` keys."""
    m, t, hq, d = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
    hk = k.shape[1]
    g = hq // hk
    # Fold the query-group and query-row dims together so both products are plain
    # bmm over the KV heads (no broadcast expand copying K/V per query head).
    qh = q.reshape(m, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * m, d)
    scores = torch.bmm(qh, k.permute(1, 2, 0)).view(hk, g, m, t) * scale
    if causal or window:
        qpos = torch.arange(t - m, t, device=scores.device).unsqueeze(1)
        kpos = torch.arange(t, device=scores.device).unsqueeze(0)
        hide = kpos > qpos if causal else None  # a later key
        if window:  # a key outside the window
            hide = kpos <= qpos - window if hide is None else hide | (kpos <= qpos - window)
        scores = scores.masked_fill(hide, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs.view(hk, g * m, t), v.permute(1, 0, 2)).view(hk, g, m, d)
    stat = probs.sum(dim=2).reshape(hq, t).mean(dim=0)
    return out.permute(2, 0, 1, 3).reshape(m, hq * d), stat


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (sqrt then divide, both correctly rounded, not
    ``rsqrt``, whose kernels may round differently)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = (x * x).mean(dim=-1, keepdim=True)
        return x / torch.sqrt(ms + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class _Backbone(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


@dataclass
class _Group:
    """Rows ``[start, stop)`` of the step attend over K/V at ``key_slots`` (gathered
    after this step's writes). ``causal``: row i sees keys ``[0, i]`` (prefill). ``window``
    (> 0): a row also sees only its last ``window`` keys (itself included), as vLLM's sliding
    window: the keys are then consecutive positions."""

    start: int
    stop: int
    key_slots: torch.Tensor
    causal: bool
    window: int = 0


@dataclass
class Windowed:
    """The sliding-window layers of a hybrid model (vLLM's sliding-window KV cache group): the
    layer indices, the slots their K/V of this step's tokens go to (the window group's blocks,
    by position) and the groups they attend over (positional keys with ``window`` set). Their
    attention never feeds the statistics (eviction is the full-attention layers' business)."""

    layers: frozenset
    write_slots: torch.Tensor
    groups: Sequence[_Group]


class PagedDecoder(nn.Module):
    """Llama-style paged decoder (contracts: the module docstring). Random init, when no weights
    are loaded, is fixed by ``config.seed``: linear ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    norms 1. Weights are frozen (inference only)."""

    def __init__(self, config: DecoderConfig | None = None, batch_invariant: bool = True) -> None:
        super().__init__()
        c = self.config = config or DecoderConfig()
        self.batch_invariant = batch_invariant
        # nn.Linear/nn.Embedding draw their default init from the global RNG; fork it so
        # building a decoder never perturbs the caller's random stream (we re-init below).
        with torch.random.fork_rng(devices=[]):
            self.model = _Backbone(c)
            self.lm_head = None if c.tie_word_embeddings else nn.Linear(
                c.hidden_size, c.vocab_size, bias=False)
        self.rope = RopeTable(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self._init_weights()
        self.requires_grad_(False)
        self.to(c.dtype)

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def _init_weights(self) -> None:
        g = torch.Generator().manual_seed(self.config.seed)
        for name, p in self.named_parameters():  # deterministic order
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))

    def make_kv_cache(self, num_blocks: int, block_size: int,
                      dtype: torch.dtype | None = None,
                      device: str | torch.device = "cpu", checked: bool = True) -> KVCache:
        """A ``KVCache`` with this model's geometry (the caller owns it)."""
        c = self.config
        return KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                       dtype=dtype or c.dtype, device=device, checked=checked)

    def _lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _check_cache(self, kv: KVCache) -> None:
        c = self.config
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (
                c.num_layers, c.num_kv_heads, c.head_dim):
            raise CallError("bad_shape", f"{kv!r} does not match the model geometry "
                             f"(L={c.num_layers}, H={c.num_kv_heads}, D={c.head_dim})")

    # ------------------------------------------------------------------ core
    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`attend` with this model's scale."""
        return attend(q, k, v, self.scale, causal, window)

    def _forward(self, kv: KVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                 write_slots: torch.Tensor, groups: Sequence[_Group],
                 rows: slice, windowed: Windowed | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run all layers for ``m`` new tokens; return (logits of ``rows``, stats per group). Each
        layer writes the new K/V to ``write_slots`` before any group gathers, so new tokens are read
        back exactly as later steps read them (cache dtype). The layers of ``windowed`` write and
        read its slots instead (a hybrid model's sliding-window layers)."""
        cos, sin = self.rope.lookup(positions)
        x = self.model.embed_tokens(token_ids.to(self.model.embed_tokens.weight.device))
        stats = [torch.zeros(g.key_slots.numel(), dtype=torch.float32) for g in groups]
        c = self.config
        for li, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            att = layer.self_attn
            q = apply_rope(att.q_proj(h).view(-1, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(att.k_proj(h).view(-1, c.num_kv_heads, c.head_dim), cos, sin)
            v = att.v_proj(h).view(-1, c.num_kv_heads, c.head_dim)
            win = windowed is not None and li in windowed.layers
            kv.write(li, windowed.write_slots if win else write_slots, k, v)
            outs = []
            for gi, g in enumerate(windowed.groups if win else groups):
                gk, gv = kv.gather(li, g.key_slots)
                o, s = self._attend(q[g.start:g.stop], gk.to(q.dtype), gv.to(q.dtype),
                                    g.causal, g.window)
                outs.append(o)
                if not win:
                    stats[gi] += s.float().cpu()
            x = x + att.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.model.norm(x[rows])
        return F.linear(h, self._lm_weight()), stats

    # ------------------------------------------------------------------ public API
    @torch.inference_mode()
    def prefill(self, kv: KVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                write_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Process one request's prompt: causal attention among its ``n`` tokens only, every K/V
        written to ``write_slots`` (caller-owned, distinct). Returns ``(next_logits [vocab],
        attn_stats [n])``: attention token j received, summed over queries and layers, averaged
        over heads."""
        self._check_cache(kv)
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        pos = torch.as_tensor(positions, dtype=torch.int64)
        ws = torch.as_tensor(write_slots, dtype=torch.int64, device=kv.device)
        n = ids.numel()
        if n == 0 or pos.numel() != n or ws.numel() != n:
            raise CallError("bad_shape", f"prefill: need n>0 and equal lengths, got "
                             f"{n}, {pos.numel()}, {ws.numel()}")
        logits, stats = self._forward(kv, ids, pos, ws, [_Group(0, n, ws, True)],
                                      slice(n - 1, n))
        return logits[0], stats[0]

    @torch.inference_mode()
    def decode_step(self, kv: KVCache, batch: Sequence[DecodeItem | tuple]
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One decode step for a batch: per item, write the new token's K/V to ``write_slot``, attend
        over ``read_slots`` then the new token. Returns ``(logits [B, vocab], stats)``, ``stats[i]``
        float32 ``[len(read_slots_i) + 1]``: attention each token received from the new query,
        averaged over heads, summed over layers; the last entry is the new token."""
        self._check_cache(kv)
        items = [DecodeItem(*it) for it in batch]
        if not items:
            return torch.empty(0, self.config.vocab_size, dtype=self.config.dtype), []
        wslots = torch.tensor([it.write_slot for it in items], dtype=torch.int64,
                              device=kv.device)
        if kv.checked and len(set(wslots.tolist())) != len(items):
            raise CallError("duplicate_slot", "decode_step: two requests share a write_slot")
        keys = []
        for it in items:
            rs = torch.as_tensor(it.read_slots, dtype=torch.int64, device=kv.device)
            if kv.checked and bool((rs == it.write_slot).any()):
                raise CallError("duplicate_slot", f"decode_step: write_slot {it.write_slot} is in read_slots")
            keys.append(torch.cat([rs, wslots.new_tensor([it.write_slot])]))
        ids = torch.tensor([it.token_id for it in items], dtype=torch.int64)
        pos = torch.tensor([it.position for it in items], dtype=torch.int64)
        if self.batch_invariant:
            logits, stats = [], []
            for i in range(len(items)):
                lg, st = self._forward(kv, ids[i:i + 1], pos[i:i + 1], wslots[i:i + 1],
                                       [_Group(0, 1, keys[i], False)], slice(0, 1))
                logits.append(lg)
                stats.append(st[0])
            return torch.cat(logits), stats
        groups = [_Group(i, i + 1, keys[i], False) for i in range(len(items))]
        return self._forward(kv, ids, pos, wslots, groups, slice(None))

    # ------------------------------------------------------------------ static shapes (CUDA graphs)
    def rope_tables(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows ``[0, n)`` of the RoPE table on ``device`` (a copy the caller owns), so a
        captured graph never touches the growing host table."""
        self.rope.ensure(n)
        cos, sin = self.rope.cos[:n], self.rope.sin[:n]
        if torch.device(device).type == "cuda":  # pinned and non-blocking: no host wait
            return cos.pin_memory().to(device, non_blocking=True), sin.pin_memory().to(device, non_blocking=True)
        return cos.clone(), sin.clone()

    def _attend_masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_attend`` for one query (``m = 1``) over ``T + 1`` keys of which ``mask`` keeps some:
        masked keys score -inf (probability and stat exactly 0; they must hold finite bytes)."""
        c = self.config
        t = k.shape[0]
        hk, g, d = c.num_kv_heads, c.group_size, c.head_dim
        qh = q.reshape(1, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g, d)
        scores = torch.bmm(qh, k.permute(1, 2, 0)).view(hk, g, 1, t) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs.view(hk, g, t), v.permute(1, 0, 2)).view(hk, g, 1, d)
        stat = probs.sum(dim=2).reshape(c.num_heads, t).mean(dim=0)
        return out.permute(2, 0, 1, 3).reshape(1, c.num_heads * c.head_dim), stat

    @torch.inference_mode()
    def decode_static(self, kv: KVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                      write_slots: torch.Tensor, read_slots: torch.Tensor, num_read: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over fixed-shape device tensors: what a CUDA graph captures.

        Inputs (on ``kv.device``, int64): ``token_ids``, ``positions``, ``write_slots``, ``num_read``
        ``[B]`` and ``read_slots`` ``[B, T]``; row ``i`` attends over ``read_slots[i, :num_read[i]]``
        (the rest ignored) then its new token (written first at ``write_slots[i]``); ``rope``:
        :meth:`rope_tables` covering every position. Returns ``(logits [B, vocab], stats [B, T + 1]
        float32)``: ``stats[i, j < num_read[i]]`` as in :meth:`decode_step`, ``stats[i, T]`` the new
        token's, the rest 0. No host sync, no host-to-device copy, no data-dependent shape, nothing
        validated (the caller checks slots on the host). Logits may differ from :meth:`decode_step`'s
        in the last bits; greedy tokens agree, and placement invariance holds exactly.
        """
        c = self.config
        B, T = read_slots.shape
        dev = read_slots.device
        cos_t, sin_t = rope
        cols = torch.arange(T, device=dev)
        valid = cols.unsqueeze(0) < num_read.unsqueeze(1)  # [B, T]
        # pads read the row's own new token (finite bytes, written before the gather)
        keys = torch.cat([torch.where(valid, read_slots, write_slots.unsqueeze(1)), write_slots.unsqueeze(1)], dim=1)
        mask = torch.cat([valid, torch.ones((B, 1), dtype=torch.bool, device=dev)], dim=1)  # [B, T + 1]
        cos, sin = cos_t.index_select(0, positions), sin_t.index_select(0, positions)
        x_all = self.model.embed_tokens(token_ids)
        flat = kv.flat
        spans = [(i, i + 1) for i in range(B)] if self.batch_invariant else [(0, B)]
        logits, stats = [], []
        for a, b in spans:
            x = x_all[a:b]
            st = torch.zeros((b - a, T + 1), dtype=torch.float32, device=dev)
            ws = write_slots[a:b]
            for li, layer in enumerate(self.model.layers):
                h = layer.input_layernorm(x)
                att = layer.self_attn
                q = apply_rope(att.q_proj(h).view(-1, c.num_heads, c.head_dim), cos[a:b], sin[a:b])
                k = apply_rope(att.k_proj(h).view(-1, c.num_kv_heads, c.head_dim), cos[a:b], sin[a:b])
                v = att.v_proj(h).view(-1, c.num_kv_heads, c.head_dim)
                flat[li, 0].index_copy_(0, ws, k.to(kv.dtype))
                flat[li, 1].index_copy_(0, ws, v.to(kv.dtype))
                outs = []
                for r in range(a, b):
                    gk = flat[li, 0].index_select(0, keys[r])
                    gv = flat[li, 1].index_select(0, keys[r])
                    o, s = self._attend_masked(q[r - a:r - a + 1], gk.to(q.dtype), gv.to(q.dtype), mask[r])
                    outs.append(o)
                    st[r - a] += s.float()
                x = x + att.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits.append(F.linear(self.model.norm(x), self._lm_weight()))
            stats.append(st)
        return torch.cat(logits), torch.cat(stats)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim as int64 (shape ``logits.shape[:-1]``); ties -> lowest id
    (tested). Use ``.tolist()`` for Python ints."""
    return torch.argmax(logits, dim=-1)
