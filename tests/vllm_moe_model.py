"""Tiny local Mixture-of-Experts models for vLLM tests, and real AdamW versions.

Two families, built with transformers from a seed (nothing downloaded) and saved in
bf16 with ``save_pretrained``, so the files hold the checkpoint format:

- ``mixtral``: MixtralForCausalLM, 4 experts (top 2), tied embeddings;
- ``qwen2_moe``: Qwen2MoeForCausalLM, 4 experts (top 2) plus a gated shared expert,
  untied lm_head, attention biases.

Sizes keep CPU attention happy (head_dim 32) and the CPU MoE kernel's alignment
(hidden and expert intermediate sizes multiples of 32). Versions come from AdamW
steps on an fp32 master copy, cast to bf16, converted to the checkpoint format the
way ``save_pretrained`` does it (transformers keeps experts fused in memory).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
)
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import PreTrainedModel, remove_tied_weights_from_state_dict

VOCAB = 1024
WEIGHTS_FILE = "model.safetensors"
FAMILIES = ("mixtral", "qwen2_moe")

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def config(family: str) -> PretrainedConfig:
    if family == "mixtral":
        return MixtralConfig(
            **_COMMON,
            head_dim=32,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=True,
        )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **_COMMON,
            intermediate_size=256,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown MoE family {family!r}")


def build_model(folder: Path, family: str, seed: int = 0) -> Path:
    """Write a randomly initialised tiny MoE model of ``family`` (bf16) into ``folder``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family)).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if not (folder / WEIGHTS_FILE).exists():
        raise RuntimeError(f"{folder}: transformers wrote no {WEIGHTS_FILE}")
    return folder


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / WEIGHTS_FILE))


def checkpoint_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for ``model`` (bf16), as a state dict."""
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    state = revert_weight_conversion(model, state)
    return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in state.items()}


def load_trainable(folder: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model


def train_steps(
    model: PreTrainedModel, steps: int, seed: int = 1, lr: float = 1e-4
) -> Iterator[None]:
    """Run ``steps`` AdamW steps on ``model`` (fp32), yielding after each."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (4, 32), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield


def train_versions(folder: Path, steps: int, seed: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint-format bf16 weights after each of ``steps`` AdamW steps."""
    model = load_trainable(folder)
    for _ in train_steps(model, steps, seed):
        yield checkpoint_state(model)
