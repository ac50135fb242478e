"""Realistic weight updates: a small Llama-shaped transformer trained with AdamW.

fp32 master weights take real optimizer steps on a next-token loss over
deterministic synthetic token streams; after every step the weights are cast to
bf16, as a trainer hands them to inference servers. At learning rates of 1e-6
to 1e-5 most updates are smaller than half a bf16 step, so only a few percent
of the bf16 elements change per step, mostly by one unit in the last place.

Parameter names follow Hugging Face Llama checkpoints, and ``hf_config`` gives a
matching ``config.json``, so a state can be loaded by tools that read those.
Results are deterministic for a given seed and torch thread count.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import safetensors.torch
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pipeline.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    max_seq_len: int = 64
    batch_size: int = 4
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    # (vocab_size, hidden_size, num_layers, num_heads, intermediate_size): the fields' order
    PRESETS: ClassVar[dict[str, tuple[int, int, int, int, int]]] = {
        "tiny": (4096, 192, 2, 4, 512),  # ~2.5M parameters: fast enough for unit tests
        "small": (8192, 320, 4, 5, 864),  # ~10M parameters
        "medium": (16384, 512, 6, 8, 1376),  # ~36M parameters: benchmarks
    }

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        try:
            return cls(*cls.PRESETS[name])
        except KeyError:
            raise ConfigError(
                f"unknown model preset {name!r}; choose from {sorted(cls.PRESETS)}"
            ) from None

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ConfigError(
                f"hidden size {self.hidden_size} must split into {self.num_heads} "
                "heads of even size"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        return 2 * v * d + self.num_layers * per_layer + d

    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``LlamaForCausalLM`` config.json for these weights."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": max(self.max_seq_len, 128),
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = x * scale * self.weight
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, d))
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class CausalLM(nn.Module):
    """Llama-shaped decoder; ``state_dict`` names match Hugging Face checkpoints."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        )
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            nn.init.normal_(param, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos = self.rope_cos[:s]
        sin = self.rope_sin[:s]
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


class TokenStream:
    """Deterministic token batches with learnable structure: a fixed random
    successor for every token, followed nine times in ten."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed + 0x5EED)
        self.successor = torch.randperm(cfg.vocab_size, generator=self.gen)

    def batch(self) -> torch.Tensor:
        cfg, gen = self.cfg, self.gen
        b, s, v = cfg.batch_size, cfg.max_seq_len + 1, cfg.vocab_size
        tokens = torch.empty((b, s), dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, v, (b,), generator=gen)
        noise = torch.rand((b, s), generator=gen) < 0.1
        random_tokens = torch.randint(0, v, (b, s), generator=gen)
        for i in range(1, s):  # over sequence positions, not elements
            follow = self.successor[tokens[:, i - 1]]
            tokens[:, i] = torch.where(noise[:, i], random_tokens[:, i], follow)
        return tokens


class UpdateGenerator:
    """Successive bf16 states of a model under training, deterministic by seed."""

    def __init__(self, config: ModelConfig, lr: float = 1e-6, seed: int = 0) -> None:
        self.config = config
        self.steps_taken = 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = CausalLM(config)
        self.data = TokenStream(config, seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01
        )
        self.last_loss = math.nan

    def state(self) -> dict[str, torch.Tensor]:
        """bf16 copies of the current weights, in checkpoint order."""
        return {
            name: param.detach().to(torch.bfloat16) for name, param in self.model.named_parameters()
        }

    def step(self) -> dict[str, torch.Tensor]:
        """One optimizer step on a fresh batch; returns the new bf16 state."""
        tokens = self.data.batch()
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.last_loss = float(loss.detach())
        self.steps_taken += 1
        return self.state()


def save_state(
    state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a state as one safetensors file (``{"format": "pt"}`` metadata as HF does)."""
    meta = {"format": "pt", **(metadata or {})}
    safetensors.torch.save_file(
        {name: t.contiguous() for name, t in state.items()}, str(path), metadata=meta
    )


def state_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """A state as safetensors bytes."""
    return safetensors.torch.save(
        {name: t.contiguous() for name, t in state.items()}, metadata={"format": "pt"}
    )
