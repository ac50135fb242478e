"""TorchTarget: in-place, all-or-nothing, bit-exact patching of state dicts and modules."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pipeline.codec import encode_delta
from pipeline.errors import ConfigError, CorruptObjectError, MismatchError
from pipeline.format.hashes.hashing import content_hash, sha256_bytes, state_hash
from pipeline.format.manifest import (
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    dtype_name,
    now_iso,
)
from pipeline.store.file import FileStore
from pipeline.targets import (
    TARGETS,
    build_target,
    known_targets,
    patching,
    register_target,
    target_class,
)
from pipeline.targets.patching import int_view
from pipeline.targets.setup import TargetSetup
from pipeline.targets.torch import TorchTarget

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# -- helpers ---------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    return int_view(t.detach().cpu().contiguous()).view(-1)


def assert_bitwise_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(bits(got[name]), bits(tensor)), name
        assert content_hash(got[name]) == content_hash(tensor), name


def nudge(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """A copy with ``fraction`` of the elements moved by +-1 unit in the last place
    (how a small optimizer step changes bf16 weights)."""
    g = torch.Generator().manual_seed(seed)
    out = t.detach().cpu().clone()
    flat = int_view(out).view(-1)
    n = flat.numel()
    k = max(1, int(n * fraction))
    positions = torch.randperm(n, generator=g)[:k]
    steps = torch.randint(0, 2, (k,), generator=g).to(flat.dtype) * 2 - 1
    flat[positions] += steps
    return out.to(t.device)


def make_delta(
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    version: int = 2,
    parent: int = 1,
    with_parent_hash: bool = True,
    names: list[str] | None = None,
) -> tuple[Manifest, dict[str, bytes]]:
    """A one-object delta version from ``base`` to ``new`` (what publish would write)."""
    names = list(new) if names is None else names
    data = encode_delta((n, base[n], new[n]) for n in names)
    key = "part-00000.safetensors"
    entries = tuple(
        TensorEntry(
            name=n,
            dtype=dtype_name(new[n].dtype),
            shape=tuple(new[n].shape),
            hash=content_hash(new[n]),
            object=key,
            changed=int((bits(base[n]) != bits(new[n])).sum()),
        )
        for n in names
    )
    manifest = Manifest(
        run="r",
        version=version,
        kind="delta",
        parent=parent,
        anchor=0,
        codec=CodecInfo("deltasync-bitdelta", 1, 1),
        objects=(ObjectEntry(key, len(data), sha256_bytes(data)),),
        tensors=entries,
        state_hash=state_hash((e.name, e.hash) for e in entries),
        created=now_iso(),
        parent_state_hash=(
            state_hash((n, content_hash(base[n])) for n in names) if with_parent_hash else None
        ),
    )
    return manifest, {key: data}


def specials(dtype: torch.dtype) -> torch.Tensor:
    """NaN payloads, -0.0, infinities and subnormals, as bit patterns of ``dtype``."""
    view = int_view(torch.empty(0, dtype=dtype)).dtype
    if dtype == torch.bfloat16:
        raw = [0x7FC1, 0x7F81, -0x7F, -0x8000, 0x7F80, -0x80, 0x0001, 0x8001 - 0x10000]
    elif dtype == torch.float16:
        raw = [0x7E01, 0x7C01, -0x8000, 0x7C00, -0x400, 0x0001, 0x3C00, -0x4400]
    else:
        raw = [0x7FC00001, 0x7F800001, -0x80000000, 0x7F800000, 0x00000001, 0x3F800000]
    return torch.tensor(raw, dtype=view).view(dtype)


def state(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "a.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
        "a.bias": torch.randn(64, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(32, 64, generator=g).to(torch.float16),
        "c.scale": torch.randn(257, generator=g),
        "d.special": torch.cat([specials(torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)]),
        "e.scalar": torch.tensor(1.5, dtype=torch.float32),
    }
    return {k: v.to(device) for k, v in sd.items()}


def next_state(sd: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    out = {n: nudge(t, 0.02, seed + i) for i, (n, t) in enumerate(sd.items())}
    out["e.scalar"] = sd["e.scalar"].clone()  # an unchanged tensor
    return out


# -- registry --------------------------------------------------------------------------


def test_registry_resolves_torch_and_lists_known_names_for_unknown() -> None:
    assert target_class("torch") is TorchTarget
    assert set(TARGETS) >= {"torch", "vllm"}
    with pytest.raises(ConfigError, match=r"unknown target 'tpu'.*torch.*vllm"):
        target_class("tpu")


def test_registry_builds_a_torch_target_for_a_node_from_a_checkpoint(tmp_path: Path) -> None:
    held = state("cpu")
    path = tmp_path / "model.safetensors"
    save_file({n: t.contiguous() for n, t in held.items()}, str(path))
    setup = TargetSetup(
        store=FileStore(tmp_path / "store"),
        run="r",
        stop=threading.Event(),
        model_path=path,
        patch_memory_bytes=1 << 20,
    )
    built = build_target("torch", setup)
    assert isinstance(built, TorchTarget) and built.patch_memory_bytes == 1 << 20
    assert_bitwise_equal(dict(built.export()), held)
    with pytest.raises(ConfigError, match=r"^unknown target 'tpu'; known targets: torch, vllm$"):
        build_target("tpu", setup)


def test_registered_targets_are_imported_on_first_use_only() -> None:
    register_target("later", "deltasync_no_such_module:Target")  # nothing imported here
    try:
        assert "later" in known_targets()
        with pytest.raises(ConfigError, match="deltasync_no_such_module"):
            target_class("later")
        register_target("plain", "pipeline.format.tensors:TensorSpec")
        with pytest.raises(ConfigError, match=r"has no for_node"):
            target_class("plain")
        with pytest.raises(ConfigError, match="must look like"):
            register_target("bad", "no-colon")
    finally:
        TARGETS.pop("later", None)
        TARGETS.pop("plain", None)


# -- state dicts -----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_chain_is_bit_exact_and_in_place(device: str) -> None:
    held = state(device)
    ids = {n: (id(t), t.data_ptr()) for n, t in held.items()}
    target = TorchTarget(held)
    versions = [{k: v.clone() for k, v in held.items()}]
    for step in range(3):
        versions.append(next_state(versions[-1], seed=10 * step))
    for v in range(1, len(versions)):
        manifest, objects = make_delta(versions[v - 1], versions[v], version=v, parent=v - 1)
        report = target.apply_delta(manifest, objects, "touched")
        assert report.version == v
        assert report.changed == sum(e.changed for e in manifest.tensors)
        assert report.tensors == sum(1 for e in manifest.tensors if e.changed)
        assert_bitwise_equal(held, versions[v])  # the caller's own tensors changed
        assert target.hashes() == {n: content_hash(t) for n, t in versions[v].items()}
    assert {n: (id(t), t.data_ptr()) for n, t in held.items()} == ids


def test_special_values_change_bit_for_bit() -> None:
    base = {"x": torch.zeros(8, dtype=torch.float32)}
    new = {"x": torch.cat([specials(torch.float32), torch.tensor([-0.0, 2.0])])}
    held = {"x": base["x"].clone()}
    target = TorchTarget(held)
    manifest, objects = make_delta(base, new)
    target.apply_delta(manifest, objects, "all")
    assert_bitwise_equal(held, new)


def test_load_state_copies_bits_in_place_and_checks_first() -> None:
    held = state("cpu")
    ptrs = {n: t.data_ptr() for n, t in held.items()}
    target = TorchTarget(held)
    source = state("cpu", seed=7)
    target.load_state(source.items())
    assert_bitwise_equal(held, source)
    assert {n: t.data_ptr() for n, t in held.items()} == ptrs

    before = {n: t.clone() for n, t in held.items()}
    wrong_shape = dict(source, **{"a.bias": torch.zeros(63, dtype=torch.bfloat16)})
    with pytest.raises(MismatchError, match=r"a\.bias.*shape"):
        target.load_state(wrong_shape.items())
    wrong_dtype = {"a.weight": source["a.weight"].float()}
    with pytest.raises(MismatchError, match=r"a\.weight.*dtype"):
        target.load_state(wrong_dtype.items())
    with pytest.raises(MismatchError, match=r"'zzz' .*not in the torch target"):
        target.load_state([("zzz", torch.zeros(1))])
    assert_bitwise_equal(held, before)  # each check ran before its tensor was written
    partial = {k: v for k, v in source.items() if k != "c.scale"}
    with pytest.raises(MismatchError, match=r"c\.scale"):
        target.load_state(partial.items())


# -- refusals leave the weights untouched ----------------------------------------------


def _refused(
    target: TorchTarget,
    held: dict[str, torch.Tensor],
    manifest: Manifest,
    objects: dict[str, bytes],
    *,
    error: type[Exception],
    match: str,
) -> None:
    before = {n: t.clone() for n, t in held.items()}
    hashes = target.hashes()
    with pytest.raises(error, match=match):
        target.apply_delta(manifest, objects, "touched")
    assert target.hashes() == hashes
    assert_bitwise_equal(held, before)


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_base_by_state_hash_is_refused_before_writing(device: str) -> None:
    held = state(device)
    target = TorchTarget(held)
    other = next_state(held, seed=99)
    manifest, objects = make_delta(other, next_state(other, seed=5))
    _refused(target, held, manifest, objects, error=MismatchError, match="not the delta's base")


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_base_without_state_hash_is_undone_after_post_verify(device: str) -> None:
    held = state(device)
    target = TorchTarget(held)
    other = {n: nudge(t, 0.05, seed=1) for n, t in held.items()}  # every tensor differs
    manifest, objects = make_delta(other, next_state(other, seed=5), with_parent_hash=False)
    _refused(target, held, manifest, objects, error=MismatchError, match="manifest")


@pytest.mark.parametrize("device", DEVICES)
def test_failed_post_verify_restores_every_patched_tensor(device: str) -> None:
    held = state(device)
    target = TorchTarget(held)
    new = next_state(held, seed=3)
    manifest, objects = make_delta(held, new)
    # The last changed tensor's hash is wrong: the ones patched before it must be undone.
    last = [e for e in manifest.tensors if e.changed][-1]
    bad = tuple(
        TensorEntry(e.name, e.dtype, e.shape, "0" * 32, e.object, e.changed) if e is last else e
        for e in manifest.tensors
    )
    bad_manifest = Manifest(**{**manifest.__dict__, "tensors": bad})
    _refused(
        target,
        held,
        bad_manifest,
        objects,
        error=MismatchError,
        match=last.name.replace(".", r"\."),
    )
    # The good delta still applies afterwards.
    target.apply_delta(manifest, objects, "touched")
    assert_bitwise_equal(held, new)


@pytest.mark.parametrize("device", DEVICES)
def test_unknown_missing_misshapen_mistyped_tensors_and_corrupt_objects_are_refused(
    device: str,
) -> None:
    held = state(device)
    target = TorchTarget(held)
    new = next_state(held, seed=3)

    extra_base = dict(held, **{"z.extra": torch.zeros(4)})
    extra_new = dict(new, **{"z.extra": torch.ones(4)})
    manifest, objects = make_delta(extra_base, extra_new, with_parent_hash=False)
    _refused(target, held, manifest, objects, error=MismatchError, match=r"z\.extra")

    shaped_base = dict(held, **{"a.bias": torch.zeros(65, dtype=torch.bfloat16)})
    shaped_new = dict(new, **{"a.bias": torch.ones(65, dtype=torch.bfloat16)})
    manifest, objects = make_delta(shaped_base, shaped_new, with_parent_hash=False)
    _refused(target, held, manifest, objects, error=MismatchError, match=r"a\.bias.*shape")

    typed_base = dict(held, **{"c.scale": held["c.scale"].double()})
    typed_new = dict(new, **{"c.scale": new["c.scale"].double()})
    manifest, objects = make_delta(typed_base, typed_new, with_parent_hash=False)
    _refused(target, held, manifest, objects, error=MismatchError, match=r"c\.scale.*dtype")

    manifest, objects = make_delta(held, new, names=[n for n in held if n != "a.bias"])
    _refused(target, held, manifest, objects, error=MismatchError, match=r"held tensor 'a\.bias'")

    manifest, objects = make_delta(held, new)
    ((key, data),) = objects.items()
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    _refused(target, held, manifest, {key: bytes(flipped)}, error=CorruptObjectError, match=key)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_all_catches_an_untouched_tensor_that_drifted(device: str) -> None:
    held = state(device)
    target = TorchTarget(held)
    target.hashes()  # the target now knows its hashes
    new = next_state(held, seed=3)
    manifest, objects = make_delta(held, new, with_parent_hash=False)
    # Someone writes an untouched tensor behind the target's back.
    held["e.scalar"].fill_(9.0)
    with pytest.raises(MismatchError, match=r"e\.scalar"):
        target.apply_delta(manifest, objects, "all")
    assert float(held["e.scalar"]) == 9.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_a_write_failing_midway_is_rolled_back_on_every_device(
    device: str, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patches proven on the host for any device (the old contents kept there) are
    written, and taken back when the write fails after some tensors were written; a
    zero patch budget walks CPU tensors only."""
    held = state(device)
    target = TorchTarget(held, patch_memory_bytes=budget)
    new = next_state(held, seed=8)
    manifest, objects = make_delta(held, new)
    before = {n: t.clone() for n, t in held.items()}
    hashes = target.hashes()
    real = patching.apply_patch
    calls = []

    def failing(tensor: torch.Tensor, patch: object) -> None:
        calls.append(patch)
        if len(calls) == 3:
            raise RuntimeError("device lost during the write")
        real(tensor, patch)  # type: ignore[arg-type]

    monkeypatch.setattr(patching, "apply_patch", failing)
    written = sum(1 for e in manifest.tensors if e.changed)
    if device == "cpu" and budget == 0:
        target.apply_delta(manifest, objects, "touched")  # walked: no patch is written
        assert not calls
        assert_bitwise_equal(held, new)
        return
    with pytest.raises(RuntimeError, match="device lost"):
        target.apply_delta(manifest, objects, "touched")
    assert len(calls) == 3 < written
    assert_bitwise_equal(held, before)
    assert target.hashes() == hashes
    monkeypatch.undo()
    target.apply_delta(manifest, objects, "touched")
    assert_bitwise_equal(held, new)


# -- modules ---------------------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.bn = nn.BatchNorm1d(16)  # buffers: running_mean, running_var, num_batches_tracked
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.norm(self.embed(ids)))
        return self.head(h)


def module_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "carried",
    [["embed.weight"], ["head.weight"], ["embed.weight", "head.weight"]],
    ids=["embed-only", "head-only", "both"],
)
def test_module_with_tied_weights_and_buffers(carried: list[str]) -> None:
    torch.manual_seed(0)
    model = TiedLM().to(torch.bfloat16).eval()
    target = TorchTarget(model)
    assert target.aliases() == {"head.weight": "embed.weight"}
    params_before = {n: id(p) for n, p in model.named_parameters()}
    base = module_state(model)
    new = {
        n: nudge(t, 0.05, seed=i) if t.is_floating_point() else t + 1
        for i, (n, t) in enumerate(base.items())
    }
    new["head.weight"] = new["embed.weight"]
    names = [n for n in base if n not in ("embed.weight", "head.weight")] + carried
    manifest, objects = make_delta(base, new, names=names)
    report = target.apply_delta(manifest, objects, "all")
    # The tied weight counts once however many names the checkpoint carries.
    assert report.changed == sum(
        e.changed
        for e in manifest.tensors
        if e.name != "head.weight" or "embed.weight" not in carried
    )
    assert report.tensors == len(base) - 1
    assert_bitwise_equal(module_state(model), new)
    assert model.head.weight is model.embed.weight
    assert {n: id(p) for n, p in model.named_parameters()} == params_before
    assert int(model.bn.num_batches_tracked) == int(new["bn.num_batches_tracked"])
    # The live module computes with the new weights.
    fresh = TiedLM().to(torch.bfloat16).eval()
    fresh.load_state_dict(new)
    ids = torch.arange(12).view(3, 4) % 50
    with torch.no_grad():
        assert torch.equal(bits(model(ids.view(-1))), bits(fresh(ids.view(-1))))
    # export uses the names the checkpoint carries.
    assert [n for n, _ in target.export()] == names


def test_tied_names_with_different_hashes_are_refused() -> None:
    model = TiedLM().to(torch.bfloat16)
    target = TorchTarget(model)
    base = module_state(model)
    new = dict(base)
    new["embed.weight"] = nudge(base["embed.weight"], 0.02, seed=1)
    new["head.weight"] = nudge(base["embed.weight"], 0.02, seed=2)
    manifest, objects = make_delta(base, new)
    held = dict(model.state_dict())
    _refused(target, held, manifest, objects, error=MismatchError, match="tied")


@pytest.mark.slow
def test_transformers_llama_model_follows_a_chain() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    live = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    target = TorchTarget(live)
    assert target.aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    # Checkpoint names as save_pretrained writes them: the tied lm_head is left out.
    ckpt = {k: v for k, v in module_state(live).items() if k != "lm_head.weight"}
    states = [ckpt]
    for step in range(2):
        states.append(
            {n: nudge(t, 0.02, seed=100 * step + i) for i, (n, t) in enumerate(states[-1].items())}
        )
    for v in range(1, len(states)):
        manifest, objects = make_delta(states[v - 1], states[v], version=v, parent=v - 1)
        target.apply_delta(manifest, objects, "touched")
    got = {k: v for k, v in module_state(live).items() if k != "lm_head.weight"}
    assert_bitwise_equal(got, states[-1])
    reference = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    reference.load_state_dict(states[-1], strict=False)
    reference.tie_weights()
    ids = torch.arange(16).view(2, 8)
    with torch.no_grad():
        assert torch.equal(bits(live(ids).logits), bits(reference(ids).logits))
    assert math.prod(states[-1]["model.embed_tokens.weight"].shape) == 256 * 64
