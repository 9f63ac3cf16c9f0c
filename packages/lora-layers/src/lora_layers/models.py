"""A small, seeded decoder-shaped model for examples, tests and ``lora-sim``.

Layout (names as in Llama-style checkpoints, so PEFT adapters target them the
usual way): ``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj``
(or a fused ``qkv_proj``), ``model.layers[i].mlp.{gate,up,down}_proj`` (or a
fused ``gate_up_proj``), ``lm_head``. With ``num_experts > 0`` the MLP is a
mixture of experts shaped like transformers' Mixtral: ``mlp.gate`` (the router,
top-``num_experts_per_tok``) and ``mlp.experts`` with fused ``gate_up_proj (E, 2I, H)``
and ``down_proj (E, H, I)`` (docs/moe.md). The token mixer is a per-token gated
stand-in for attention: every op is applied token by token, so any split of a
flattened batch into requests gives the same result per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyConfig", "TinyDecoder"]


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    fused: bool = False
    seed: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


class _Attention(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.sizes = (q, kv, kv)
        self.group = c.num_attention_heads // c.num_key_value_heads
        if c.fused:
            self.qkv_proj = nn.Linear(c.hidden_size, q + 2 * kv, bias=False)
            self.qkv_proj.output_sizes = self.sizes  # slice widths, as vLLM's QKVParallelLinear has them
        else:
            self.q_proj = nn.Linear(c.hidden_size, q, bias=False)
            self.k_proj = nn.Linear(c.hidden_size, kv, bias=False)
            self.v_proj = nn.Linear(c.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        k = k.repeat_interleave(self.group, dim=-1)
        v = v.repeat_interleave(self.group, dim=-1)
        return self.o_proj(torch.sigmoid(q * k) * v)


class _MLP(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        if c.fused:
            self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
            self.gate_up_proj.output_sizes = (c.intermediate_size, c.intermediate_size)
        else:
            self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
            self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class _Experts(nn.Module):
    """Fused experts in transformers' layout: ``forward(x (T, H), top_k_index, top_k_weights (T, K))``."""

    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.act_fn = F.silu

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):  # each expert on the tokens that picked it
            tokens, k = torch.nonzero(top_k_index == e, as_tuple=True)
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, tokens, y * top_k_weights[tokens, k, None])
        return out


class _MoE(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = _Experts(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.softmax(self.gate(flat).float(), dim=-1).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        return self.experts(flat, index, weights).reshape(x.shape)


class _Block(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.hidden_size)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size)
        self.mlp = _MoE(c) if c.num_experts else _MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Block(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.LayerNorm(c.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyDecoder(nn.Module):
    """``ids: (..., )`` int64 -> logits ``(..., vocab_size)``; weights seeded by ``config.seed``."""

    def __init__(self, config: TinyConfig = TinyConfig()) -> None:
        super().__init__()
        self.config = config
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        try:
            self.model = _Backbone(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            for p in self.parameters():  # unit-scale activations regardless of sizes
                if p.dim() in (2, 3):  # 3-D: fused experts (E, out, in)
                    nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p is not self.model.embed_tokens.weight else 1.0)
        finally:
            torch.random.set_rng_state(generator_state)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))

    def fuse_from(self, unfused: TinyDecoder) -> TinyDecoder:
        """Copy an unfused model's weights into this fused one (same config otherwise)."""
        state = {}
        for name, tensor in unfused.state_dict().items():
            state[name] = tensor
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            state[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [state.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            if not self.config.num_experts:  # the experts are fused already
                state[p + "mlp.gate_up_proj.weight"] = torch.cat(
                    [state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")])
        self.load_state_dict(state)
        return self
