"""The vLLM mapping on Mixture-of-Experts loaders, without an engine: keyword loaders
(FusedMoE's ``weight_name``, ``shard_id``, ``expert_id``), experts stacked into one
parameter, fused checkpoint tensors loaded in several calls, and tied parameters."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from pipeline.errors import TargetError
from pipeline.targets.vllm.mapping import (
    placed_view,
    probe_placement,
    route_names,
    scatter_positions,
    scatter_rows,
)

EXPERTS, ROWS, HIDDEN = 3, 4, 6


class StackedExperts(torch.nn.Module):
    """w13[e] = [gate_e; up_e], w2[e] = down_e, loaded by keyword as FusedMoE does."""

    def __init__(self) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(
            torch.zeros(EXPERTS, 2 * ROWS, HIDDEN, dtype=torch.bfloat16), requires_grad=False
        )
        self.w2 = torch.nn.Parameter(
            torch.zeros(EXPERTS, HIDDEN, ROWS, dtype=torch.bfloat16), requires_grad=False
        )
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self,
        param: torch.Tensor,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool:
        offset = ROWS if shard_id == "w3" else 0
        rows = loaded_weight.shape[0]
        param.data[expert_id].narrow(0, offset, rows).copy_(loaded_weight)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            parts = name.split(".")
            # As vLLM's loaders: rotary caches and experts with no mapping entry
            # (an index beyond the config) are skipped without an error.
            if "rotary_emb.inv_freq" in name or (parts[1].isdecimal() and int(parts[1]) >= EXPERTS):
                continue
            if parts[1] == "gate_up_proj":  # fused: every expert, gate then up
                for expert in range(tensor.shape[0]):
                    for shard, half in (("w1", 0), ("w3", 1)):
                        self._load("w13", tensor[expert].chunk(2)[half], shard, expert)
                continue
            expert, shard = int(parts[1]), {"gate": "w1", "up": "w3", "down": "w2"}[parts[2]]
            self._load("w2" if shard == "w2" else "w13", tensor, shard, expert)

    def _load(self, stem: str, tensor: torch.Tensor, shard: str, expert: int) -> None:
        param = getattr(self, stem)
        param.weight_loader(
            param=param,
            loaded_weight=tensor,
            weight_name=f"experts.{stem}",
            shard_id=shard,
            expert_id=expert,
            return_success=True,
        )


def test_keyword_loaders_route_and_place_each_expert_in_its_slice() -> None:
    model = StackedExperts()
    shapes = {
        f"experts.{e}.{kind}": (
            torch.bfloat16,
            (HIDDEN, ROWS) if kind == "down" else (ROWS, HIDDEN),
        )
        for e in range(EXPERTS)
        for kind in ("gate", "up", "down")
    }
    routes = route_names(model, model.load_weights, shapes)
    route = routes["experts.2.up"]
    assert route.parameter == "w13" and route.args == ()
    assert dict(route.kwargs)["expert_id"] == 2 and dict(route.kwargs)["shard_id"] == "w3"
    generator = torch.Generator().manual_seed(1)
    sources = {
        n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, (_, s) in shapes.items()
    }
    reference = StackedExperts()
    reference.load_weights(sources.items())  # the loader's own result
    for name, source in sources.items():
        placement = probe_placement(
            model, name, routes[name], tuple(source.shape), model.weight_loader
        )
        assert placement is not None, name
        assert placement.lead == (int(name.split(".")[1]),)
        positions = torch.arange(source.numel())
        rows = scatter_rows(placement, tuple(source.shape), positions)
        assert rows is not None  # whole rows: the fast path applies
        keep, flat = scatter_positions(placement, tuple(source.shape), positions)
        param = model.get_parameter(placement.parameter)
        placed_view(param, placement).view(-1).index_copy_(0, flat, source.reshape(-1)[keep])
    for stem in ("w13", "w2"):
        got = getattr(model, stem).data.view(torch.int16)
        assert torch.equal(got, getattr(reference, stem).data.view(torch.int16)), stem


def test_a_fused_tensor_loaded_in_several_calls_takes_the_loading_path() -> None:
    model = StackedExperts()
    shape = (EXPERTS, 2 * ROWS, HIDDEN)
    routes = route_names(
        model, model.load_weights, {"experts.gate_up_proj": (torch.bfloat16, shape)}
    )
    route = routes["experts.gate_up_proj"]
    assert route.parameter == "w13" and route.calls == 2 * EXPERTS
    assert probe_placement(model, "experts.gate_up_proj", route, shape, model.weight_loader) is None


def test_a_tied_parameter_gets_its_own_loader_back() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Module()
            self.head = torch.nn.Module()
            self.embed.weight = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
            self.head.weight = self.embed.weight  # one parameter, two names
            self.embed.weight.weight_loader = self.load_one  # type: ignore[attr-defined]

        def load_one(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
            param.data.copy_(loaded)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            for _, tensor in weights:
                self.embed.weight.weight_loader(self.embed.weight, tensor)  # type: ignore[operator]

    model = Tied()
    routes = route_names(model, model.load_weights, {"embed.weight": (torch.float32, (4, 2))})
    assert routes["embed.weight"].parameter == "embed.weight"
    assert model.embed.weight.weight_loader == model.load_one  # type: ignore[attr-defined]
    placement = probe_placement(
        model, "embed.weight", routes["embed.weight"], (4, 2), model.load_one
    )
    assert placement is not None and placement.size == (4, 2)


def test_an_expert_the_loader_skips_is_refused_and_nothing_changes() -> None:
    model = StackedExperts()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in (model.w13, model.w2):
            param.copy_(torch.randn(param.shape, generator=generator))
    before = {n: p.detach().clone().view(torch.int16) for n, p in model.named_parameters()}
    shapes = {
        "experts.0.gate": (torch.bfloat16, (ROWS, HIDDEN)),
        # Accepted: vLLM drops it on purpose, recomputed from the config.
        "layers.0.rotary_emb.inv_freq": (torch.float32, (HIDDEN // 2,)),
        f"experts.{EXPERTS + 6}.down": (torch.bfloat16, (HIDDEN, ROWS)),
    }
    with pytest.raises(TargetError, match=rf"^tensor experts\.{EXPERTS + 6}\.down: ") as caught:
        route_names(model, model.load_weights, shapes)
    assert "\n" not in str(caught.value)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach().view(torch.int16), before[name]), name
        assert param.weight_loader == model.weight_loader  # type: ignore[attr-defined]
    del shapes[f"experts.{EXPERTS + 6}.down"]
    routes = route_names(model, model.load_weights, shapes)
    assert routes["layers.0.rotary_emb.inv_freq"].parameter is None
    assert routes["experts.0.gate"].parameter == "w13"
