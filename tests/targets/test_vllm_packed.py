"""The vLLM target on an engine with vLLM's prepacked CPU linears (``cpu_plain_linear=False``).

There, linear weights are opaque kernel copies: deltas reach them through vLLM's
loading path (whole fused groups reloaded from the shadow). The chain must still end
bit-exact and generate exactly what a fresh engine in the same mode generates.
"""

from __future__ import annotations

from tests import vllm_model as tiny
from tests.targets.test_vllm_target import (
    PROMPTS,
    Chain,
    _hashes,
    chain,
    on_engine,
)

__all__ = ["chain"]  # the module-scoped fixture, shared with test_vllm_target


@on_engine
def test_chain_through_vllm_loader_matches_a_fresh_packed_engine(chain: Chain) -> None:
    from pipeline.targets.vllm.target import VllmTarget

    reference = tiny.engine(chain.versions[-1].folder, cpu_plain_linear=False)
    expected = tiny.greedy(reference, PROMPTS)
    tiny.shutdown(reference)

    llm = tiny.engine(chain.versions[0].folder, load_format="dummy", cpu_plain_linear=False)
    try:
        target = VllmTarget(llm)
        target.load_state(chain.versions[0].weights.items())
        target.version = 0
        # Packed linears cannot be written in place; norms still can.
        assert target.read_parameter("model.layers.0.self_attn.q_proj.weight") is None
        assert target.read_parameter("model.norm.weight") is not None
        for manifest, objects in chain.deltas:
            target.apply_delta(manifest, objects, "touched")
        assert target.hashes() == _hashes(chain.versions[-1].weights)
        assert tiny.greedy(llm, PROMPTS) == expected
    finally:
        tiny.shutdown(llm)
