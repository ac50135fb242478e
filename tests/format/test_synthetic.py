"""The update generator: deterministic by seed, realistic changed fractions."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from pipeline.errors import ConfigError
from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state, state_bytes

TINY = ModelConfig.preset("tiny")


def bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.int16) for name, t in state.items()}


def test_names_follow_hf_llama_checkpoints() -> None:
    state = UpdateGenerator(TINY).state()
    names = list(state)
    assert names[0] == "model.embed_tokens.weight"
    assert names[-1] == "lm_head.weight"
    assert "model.norm.weight" in names
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ):
        assert f"model.layers.1.{part}.weight" in names
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert sum(t.numel() for t in state.values()) == TINY.num_parameters()
    assert state["model.layers.0.mlp.up_proj.weight"].shape == (
        TINY.intermediate_size,
        TINY.hidden_size,
    )


def test_same_seed_same_states_different_seed_different() -> None:
    a = UpdateGenerator(TINY, lr=1e-5, seed=3)
    b = UpdateGenerator(TINY, lr=1e-5, seed=3)
    c = UpdateGenerator(TINY, lr=1e-5, seed=4)
    for _ in range(2):
        sa, sb, sc = bits(a.step()), bits(b.step()), bits(c.step())
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_changed_fraction_is_realistic() -> None:
    gen = UpdateGenerator(TINY, lr=1e-6, seed=0)
    before = bits(gen.state())
    fractions = []
    for _ in range(3):
        after = bits(gen.step())
        total = sum(t.numel() for t in after.values())
        diffs = torch.cat([(after[k] - before[k]).view(-1) for k in after])
        nonzero = diffs[diffs != 0]
        fractions.append(nonzero.numel() / total)
        # Mostly one unit in the last place.
        assert (nonzero.abs() == 1).float().mean().item() > 0.6
        before = after
    assert all(0.005 < f < 0.2 for f in fractions), fractions
    assert gen.steps_taken == 3


def test_loss_goes_down_at_a_higher_learning_rate() -> None:
    gen = UpdateGenerator(TINY, lr=3e-3, seed=0)
    gen.step()
    first = gen.last_loss
    for _ in range(15):
        gen.step()
    assert gen.last_loss < first


def test_state_files_load_back_bitwise(tmp_path: Path) -> None:
    state = UpdateGenerator(TINY).state()
    save_state(state, tmp_path / "model.safetensors")
    loaded = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    from_bytes = safetensors.torch.load(state_bytes(state))
    for name, t in state.items():
        assert torch.equal(loaded[name].view(torch.int16), t.view(torch.int16))
        assert torch.equal(from_bytes[name].view(torch.int16), t.view(torch.int16))


def test_unknown_preset_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="huge"):
        ModelConfig.preset("huge")
