"""Reading a sharded run (tensors stored in pieces, manifest schema 3): replicas,
chain reconstruction, verify and compaction, against the full state of every
version. The run is written by ``tests/sharded_store.py`` (real safetensors objects
in a file store), not by the diff side."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from pipeline.codec import encode_delta
from pipeline.errors import ChainError, ConfigError, CorruptObjectError, MismatchError, TargetError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes.hashing import sha256_bytes
from pipeline.format.manifest import Manifest, ObjectEntry, Piece, TensorEntry, to_json
from pipeline.format.signing import generate_keypair, load_public_key, private_key_from
from pipeline.publish.compaction import compact
from pipeline.publish.offline import apply_delta as offline_apply
from pipeline.publish.version import PublishOptions, publish_anchor
from pipeline.rollout.fetch import stream_anchor_pieces
from pipeline.rollout.node import NodeOptions, RolloutNode
from pipeline.store import open_store
from pipeline.store.file import FileStore
from pipeline.targets.base import ApplyReport, EarlyProof, Target, TensorSpec, VerifyMode
from pipeline.targets.patching import int_view
from pipeline.targets.setup import TargetSetup
from pipeline.targets.torch import TorchTarget
from pipeline.testing.sharded import piece_of, rank_ranges
from pipeline.testing.synthetic import save_state
from pipeline.versions import chain
from pipeline.versions.verify import verify
from tests.sharded_store import ALGORITHM, PiecedRun, build_pieced_run, rank_part
from tests.targets.test_walked_apply import failing_on_tensor

RUN = "sharded"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


@pytest.fixture(params=[1, 3], ids=["level1", "level3"])
def level(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def built(store: FileStore) -> PiecedRun:
    return build_pieced_run(store, RUN, deltas=3)


@pytest.fixture
def short(store: FileStore) -> PiecedRun:
    """Versions 0-2, for a replica to hold v2 before v3 is written."""
    return build_pieced_run(store, RUN, deltas=2)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and tuple(got.shape) == tuple(want.shape)
        and torch.equal(
            int_view(got.cpu().contiguous()).view(-1), int_view(want.contiguous()).view(-1)
        )
    )


def assert_state(held: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert sorted(held) == sorted(want)
    for name, tensor in want.items():
        assert same_bits(held[name], tensor), name
        assert ALGORITHM.full(held[name]) == ALGORITHM.full(tensor), name


def node_target(store: FileStore, device: str = "cpu") -> TorchTarget:
    """A rollout node's torch target, built as ``deltasync rollout`` builds it."""
    setup = TargetSetup(store=store, run=RUN, stop=threading.Event(), device=device)
    target = TorchTarget.for_node(setup)
    assert target is not None
    return target


def held_state(target: TorchTarget) -> dict[str, torch.Tensor]:
    return {name: target.tensor(name) for name in target.specs()}


def rewrite(store: FileStore, manifest: Manifest, **changes: object) -> Manifest:
    """Put a changed manifest as is (no check: what a broken or hostile writer leaves)."""
    changed = dataclasses.replace(manifest, **changes)  # type: ignore[arg-type]
    store.put(manifest.key, to_json(changed))
    return changed


def with_tensor(manifest: Manifest, name: str, **changes: object) -> tuple[TensorEntry, ...]:
    return tuple(
        dataclasses.replace(t, **changes) if t.name == name else t  # type: ignore[arg-type]
        for t in manifest.tensors
    )


def shift_first_cut(entry: TensorEntry, by: int) -> TensorEntry:
    """``entry`` with the boundary of its first two pieces moved by ``by`` elements."""
    a, b, *rest = entry.pieces
    moved = (dataclasses.replace(a, stop=a.stop + by), dataclasses.replace(b, start=b.start + by))
    return dataclasses.replace(entry, pieces=(*moved, *rest))


# -- the builder -------------------------------------------------------------------------


def test_the_builder_writes_a_genuine_pieced_run(built: PiecedRun, store: FileStore) -> None:
    ranges = rank_ranges()
    assert sorted(ranges) == [0, 1, 2]
    # one tensor held by one rank only, one with a one-element piece, an fp32 tensor
    holders = {
        t.name: [r for r, held in ranges.items() if any(x.name == t.name for x in held)]
        for t in built.tensors
    }
    assert holders["model.norm.weight"] == [1]
    assert any(x.numel == 1 for held in ranges.values() for x in held)
    for version, manifest in enumerate(built.manifests):
        again = chain.load_manifest(store, RUN, manifest.kind, version)
        assert again.schema == 3 and again.is_pieced and again.content_hash == ALGORITHM.name
        assert [o.key for o in again.objects] == [rank_part(r) for r in ranges]
        state = built.states[version]
        for entry in again.tensors:
            assert entry.hash == ALGORITHM.full(state[entry.name])
            for piece in entry.pieces:
                part = entry.region(piece).take(state[entry.name])
                assert piece.hash == ALGORITHM.piece(part, entry.region(piece))
        if version:
            # every tensor touched, about 2% of the bf16 elements
            before = built.states[version - 1]
            for entry in again.tensors:
                differing = int((int_view(state[entry.name]) != int_view(before[entry.name])).sum())
                assert entry.changed == differing > 0, entry.name
            total = sum(t.numel for t in again.tensors)
            assert 0.01 < again.extra["changed"] / total < 0.03  # type: ignore[operator]


# -- replicas ----------------------------------------------------------------------------


@pytest.mark.parametrize("verify_mode", ["touched", "all", "none"])
def test_torch_replica_bootstraps_and_follows_bit_exact(
    store: FileStore, verify_mode: VerifyMode, level: int
) -> None:
    built = build_pieced_run(store, RUN, deltas=3, level=level)
    # A node bootstraps from the anchor and replays the chain to the head.
    target = node_target(store)
    tensors_before = {n: t.data_ptr() for n, t in held_state(target).items()}
    node = RolloutNode(store, RUN, target, NodeOptions(verify=verify_mode))
    assert node.step_once() == 3
    assert node.last_error is None
    assert_state(held_state(target), built.states[3])
    # The tensors were written in place, never replaced.
    assert {n: t.data_ptr() for n, t in held_state(target).items()} == tensors_before
    # A full proof (what a bootstrap, --verify all and the scrubber compare) holds:
    # algorithm.full of a held tensor is its entry's hash, the sum of its pieces'.
    head = built.manifests[3]
    assert target.hashes() == {t.name: t.hash for t in head.tensors}
    assert all(target.scrub(n) for n in target.scrub_names())

    # Every later version, one at a time.
    for _ in range(2):
        manifest = built.write_delta()
        assert node.step_once() == manifest.version
        assert node.last_error is None
        assert_state(held_state(target), built.states[-1])
        assert target.hashes() == {t.name: t.hash for t in manifest.tensors}
    assert node.applied_state_hash == built.manifests[-1].state_hash


@pytest.mark.parametrize("device", DEVICES)
def test_replica_holds_every_version_of_the_chain(
    store: FileStore, device: str, level: int
) -> None:
    built = build_pieced_run(store, RUN, deltas=3, level=level)
    target = node_target(store, device)
    loaded = chain.load_manifest(store, RUN, "anchor", 0)
    target.load_pieces(stream_anchor_pieces(store, loaded, inline, 1, False))
    assert_state(held_state(target), built.states[0])
    for version in range(1, 4):
        manifest = built.manifests[version]
        objects = {o.key: chain.fetch_object(store, manifest, o) for o in manifest.objects}
        # Early proofs (part hints) leave pieces to the apply, which proves them whole.
        early = [target.prove_object(k, d, sha256_bytes(d)) for k, d in objects.items()]
        report = target.apply_delta(manifest, objects, "touched", early)
        assert report.changed == manifest.extra["changed"] and report.early_tensors == 0
        assert_state(held_state(target), built.states[version])


def test_a_replica_over_its_patch_budget_walks_each_piece_bit_exact(
    store: FileStore, level: int
) -> None:
    """With no memory for patches (``DELTASYNC_PATCH_MEMORY_MB=0``) a sharded run's
    tensors are proven whole, then written by walking each piece's record into its
    range of the held tensor (level 1's sparse records; others keep their patches)."""
    built = build_pieced_run(store, RUN, deltas=3, level=level)
    target = walking_target(store)
    for version in range(1, 4):
        manifest = built.manifests[version]
        report = target.apply_delta(manifest, objects_of(store, manifest), "touched")
        assert report.changed == manifest.extra["changed"]
        touched = sum(1 for e in manifest.tensors if e.changed)
        # The builder's runs give every level some level-1 sparse records.
        assert 0 < report.walked <= touched, report
        assert_state(held_state(target), built.states[version])
        assert target.hashes() == {t.name: t.hash for t in manifest.tensors}


def walking_target(store: FileStore) -> TorchTarget:
    """A node's torch target with no memory for patches, holding the anchor."""
    setup = TargetSetup(store=store, run=RUN, stop=threading.Event(), patch_memory_bytes=0)
    target = TorchTarget.for_node(setup)
    assert target is not None
    loaded = chain.load_manifest(store, RUN, "anchor", 0)
    target.load_pieces(stream_anchor_pieces(store, loaded, inline, 1, False))
    return target


@pytest.mark.parametrize("fail_on", [1, 4])
def test_a_walked_pieced_write_failing_midway_leaves_every_tensor_as_it_was(
    store: FileStore, monkeypatch: pytest.MonkeyPatch, fail_on: int
) -> None:
    """Pieces already walked into their ranges are walked back, patched tensors
    restored; the same version then applies."""
    built = build_pieced_run(store, RUN, deltas=1, level=1)
    target = walking_target(store)
    manifest = built.manifests[1]
    before = {n: t.clone() for n, t in held_state(target).items()}
    hashes = target.hashes(algorithm=ALGORITHM.name)
    failing_on_tensor(fail_on, monkeypatch)
    with pytest.raises(RuntimeError, match="device lost"):  # at the fail_on-th walk
        target.apply_delta(manifest, objects_of(store, manifest), "touched")
    monkeypatch.undo()
    assert_state(held_state(target), before)
    assert target.hashes(algorithm=ALGORITHM.name) == hashes
    target.apply_delta(manifest, objects_of(store, manifest), "touched")
    assert_state(held_state(target), built.states[1])


def inline(fn: Callable[..., object], *args: object) -> Future[object]:
    """A download run now, its result as a future (the node's submit, without threads)."""
    done: Future[object] = Future()
    done.set_result(fn(*args))
    return done


def follow_to(store: FileStore, version: int) -> tuple[TorchTarget, RolloutNode]:
    target = node_target(store)
    node = RolloutNode(store, RUN, target)
    assert node.step_once() == version
    return target, node


def objects_of(store: FileStore, manifest: Manifest) -> dict[str, bytes]:
    return {o.key: chain.fetch_object(store, manifest, o) for o in manifest.objects}


def refused(
    target: TorchTarget, manifest: Manifest, objects: dict[str, bytes], error: type[Exception]
) -> str:
    before = {n: t.clone() for n, t in held_state(target).items()}
    with pytest.raises(error) as caught:
        target.apply_delta(manifest, objects, "touched")
    message = str(caught.value)
    assert "\n" not in message
    assert_state(held_state(target), before)  # nothing written
    return message


def test_a_corrupted_piece_object_is_refused_and_nothing_written(
    short: PiecedRun, store: FileStore
) -> None:
    target, node = follow_to(store, 2)
    bad = short.write_delta()
    key = rank_part(1)
    # Bytes that no longer match the manifest's sha256.
    objects = objects_of(store, bad)
    flipped = bytearray(objects[key])
    flipped[-3] ^= 0x10
    assert "sha256" in refused(target, bad, {**objects, key: bytes(flipped)}, CorruptObjectError)

    # An object whose sha256 the manifest carries, re-encoded with one changed element
    # of a piece three units off its base instead of one: same count, wrong result.
    base, new = short.states[2], {n: t.clone() for n, t in short.states[3].items()}
    name = "model.embed_tokens.weight"
    r = next(x for x in rank_ranges()[1] if x.name == name)
    moved = (int_view(new[name]).view(-1) != int_view(base[name]).view(-1)).nonzero()
    inside = [int(i) for i in moved.view(-1) if r.start <= int(i) < r.stop]
    at = inside[0]
    int_view(new[name]).view(-1)[at] = int_view(base[name]).view(-1)[at] + 3
    data = encode_delta(
        [(x.name, piece_of(base, x), piece_of(new, x)) for x in rank_ranges()[1]], short.level
    )
    objects[key] = data
    forged = dataclasses.replace(
        bad,
        objects=tuple(
            ObjectEntry(key, len(data), sha256_bytes(data)) if o.key == key else o
            for o in bad.objects
        ),
    )
    message = refused(target, forged, objects, MismatchError)
    assert name in message and "content hash" in message

    # Through the node: the store's object is damaged; the node keeps v2 and says why.
    path = Path(store.root) / bad.object_key(key)
    path.write_bytes(bytes(flipped))
    before = {n: t.clone() for n, t in held_state(target).items()}
    assert node.step_once() == 2
    assert isinstance(node.last_error, CorruptObjectError)
    assert "\n" not in str(node.last_error)
    assert_state(held_state(target), before)


def test_a_piece_at_a_shifted_range_is_refused(short: PiecedRun, store: FileStore) -> None:
    target, _ = follow_to(store, 2)
    bad = short.write_delta()
    name = "model.embed_tokens.weight"
    entry = bad.tensor(name)
    for by in (1, -1):
        shifted = dataclasses.replace(
            bad, tensors=with_tensor(bad, name, pieces=shift_first_cut(entry, by).pieces)
        )
        message = refused(target, shifted, objects_of(store, bad), MismatchError)
        assert name in message and "wrong place" in message

    # A shifted anchor piece: the node refuses the anchor, nothing is loaded.
    anchor = short.manifests[0]
    rewrite(
        store,
        anchor,
        tensors=with_tensor(anchor, name, pieces=shift_first_cut(anchor.tensor(name), 3).pieces),
    )
    fresh = node_target(store)
    node = RolloutNode(store, RUN, fresh)
    assert node.step_once() is None
    assert isinstance(node.last_error, CorruptObjectError)
    assert "\n" not in str(node.last_error)


def test_a_manifest_whose_pieces_do_not_sum_is_refused(short: PiecedRun, store: FileStore) -> None:
    target, node = follow_to(store, 2)
    bad = short.write_delta()
    name = "lm_head.weight"
    entry = bad.tensor(name)
    first = entry.pieces[0]
    wrong = dataclasses.replace(
        first,
        hash=ALGORITHM.piece(torch.zeros(first.numel, dtype=torch.bfloat16), entry.region(first)),
    )
    rewrite(store, bad, tensors=with_tensor(bad, name, pieces=(wrong, *entry.pieces[1:])))
    before = {n: t.clone() for n, t in held_state(target).items()}
    assert node.step_once() == 2
    assert isinstance(node.last_error, CorruptObjectError)
    assert "\n" not in str(node.last_error) and name in str(node.last_error)
    assert_state(held_state(target), before)
    # Change counts that do not add up either.
    rewrite(store, bad, tensors=with_tensor(bad, name, changed=entry.changed + 1))
    assert node.step_once() == 2
    assert isinstance(node.last_error, CorruptObjectError)
    assert_state(held_state(target), before)


def test_a_target_that_cannot_read_pieces_is_refused_at_bootstrap(
    built: PiecedRun, store: FileStore
) -> None:
    class WholeTensorsOnly(Target):
        """A target with whole-tensor loads only (``capabilities.pieces`` left False)."""

        def __init__(self, inner: TorchTarget) -> None:
            self.inner = inner

        def specs(self) -> dict[str, TensorSpec]:
            return self.inner.specs()

        def load_state(
            self,
            tensors: Iterable[tuple[str, torch.Tensor]],
            hashes: Mapping[str, str] | None = None,
        ) -> None:
            self.inner.load_state(tensors, hashes)

        def apply_delta(
            self,
            manifest: Manifest,
            objects: dict[str, bytes],
            verify: VerifyMode,
            early: Sequence[EarlyProof] = (),
        ) -> ApplyReport:
            return self.inner.apply_delta(manifest, objects, verify, early)

        def hashes(
            self, names: Sequence[str] | None = None, algorithm: str | None = None
        ) -> dict[str, str]:
            return self.inner.hashes(None, algorithm)

        def export(self) -> Iterator[tuple[str, torch.Tensor]]:
            return self.inner.export()

    node = RolloutNode(store, RUN, WholeTensorsOnly(node_target(store)))
    assert node.step_once() is None
    assert isinstance(node.last_error, TargetError)
    assert "sharded" in str(node.last_error) and "\n" not in str(node.last_error)


# -- reconstruction, verify, compaction ---------------------------------------------------


def test_reconstruction_is_bit_exact_part_by_part_and_whole(
    store: FileStore, tmp_path: Path, level: int
) -> None:
    built = build_pieced_run(store, RUN, deltas=3, level=level)
    for version, state in enumerate(built.states):
        whole = dict(chain.reconstruct_tensors(store, RUN, version))
        assert_state(whole, state)
        manifest = built.manifests[version]
        layout = dict(manifest.layout())
        for key, tensors in chain.reconstruct_parts(store, RUN, version):
            for (entry, piece), (name, t) in zip(layout[key], tensors, strict=True):
                assert name == entry.name and t.dim() == 1
                assert same_bits(t, state[name].reshape(-1)[piece.start : piece.stop])
    only = [k for k, _ in chain.reconstruct_parts(store, RUN, 3, only={rank_part(2)})]
    assert only == [rank_part(2)]
    out = tmp_path / "v3.safetensors"
    chain.reconstruct(store, RUN, 3, out)
    with CheckpointReader(out) as reader:
        assert_state({n: reader.get(n).clone() for n in reader.names()}, built.states[3])
    with pytest.raises(ConfigError, match="pieces"):
        chain.reconstruct(store, RUN, 3, tmp_path / "by-part", by_part=True)


def test_verify_passes_and_catches_a_corrupted_piece(
    built: PiecedRun, store: FileStore, tmp_path: Path
) -> None:
    truth = tmp_path / "truth.safetensors"
    save_state(built.states[3], truth)
    report = verify(store, RUN, 3, truth)
    assert report.ok, report.describe()
    assert report.tensors == len(built.states[3])

    # A piece whose object matches its (re-written) manifest but not its piece hash.
    bad = built.manifests[2]
    key = rank_part(0)
    base, new = built.states[1], {n: t.clone() for n, t in built.states[2].items()}
    name = "model.layers.0.mlp.up_proj.weight"
    int_view(new[name]).view(-1)[7] += 3
    data = encode_delta(
        [(x.name, piece_of(base, x), piece_of(new, x)) for x in rank_ranges()[0]], built.level
    )
    store.put(bad.object_key(key), data)
    rewrite(
        store,
        bad,
        objects=tuple(
            ObjectEntry(key, len(data), sha256_bytes(data)) if o.key == key else o
            for o in bad.objects
        ),
    )
    with pytest.raises(CorruptObjectError) as caught:
        list(chain.reconstruct_tensors(store, RUN, 2))
    assert name in str(caught.value) and "piece hash" in str(caught.value)
    report = verify(store, RUN, 3, truth)
    assert not report.ok and name in report.describe()

    # Bytes that do not match their sha256: a bad object.
    path = Path(store.root) / built.manifests[1].object_key(rank_part(2))
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    report = verify(store, RUN, 3, truth)
    assert report.bad_objects and "sha256" in report.describe()


def test_compaction_keeps_the_pieces_and_a_new_replica_bootstraps_from_it(
    built: PiecedRun, store: FileStore
) -> None:
    delta = built.manifests[3]
    anchor = compact(store, RUN)
    assert anchor.kind == "anchor" and anchor.version == 3 and anchor.schema == 3
    assert anchor.state_hash == delta.state_hash
    assert [o.key for o in anchor.objects] == [o.key for o in delta.objects]
    for a, d in zip(anchor.tensors, delta.tensors, strict=True):
        assert a.hash == d.hash
        assert [(p.object, p.start, p.stop, p.hash) for p in a.pieces] == [
            (p.object, p.start, p.stop, p.hash) for p in d.pieces
        ]
    assert compact(store, RUN) == chain.load_manifest(store, RUN, "anchor", 3)  # idempotent
    assert chain.resolve(store, RUN, 3).deltas == ()
    assert_state(dict(chain.reconstruct_tensors(store, RUN, 3)), built.states[3])

    # A new replica bootstraps from the compacted anchor and follows on.
    built.manifests[-1] = anchor
    target, node = follow_to(store, 3)
    assert_state(held_state(target), built.states[3])
    following = built.write_delta()
    assert node.step_once() == following.version
    assert_state(held_state(target), built.states[-1])

    # The whole-tensor anchor writer refuses a pieced version.
    with pytest.raises(ConfigError, match="pieces"):
        publish_anchor(store, RUN, 9, iter(()), parent=3, reason="x", expected=following)


def test_offline_apply_of_a_pieced_delta_is_bit_exact_and_checks_its_base(
    built: PiecedRun, store: FileStore, tmp_path: Path
) -> None:
    folder = Path(store.root) / built.manifests[1].key
    base = tmp_path / "base.safetensors"
    save_state(built.states[0], base)
    offline_apply(base, folder.parent, tmp_path / "out")
    with CheckpointReader(tmp_path / "out") as reader:
        assert_state({n: reader.get(n) for n in built.states[1]}, built.states[1])
    wrong = tmp_path / "wrong.safetensors"
    save_state(built.states[1], wrong)  # not the delta's base
    with pytest.raises((MismatchError, CorruptObjectError)) as info:
        offline_apply(wrong, folder.parent, tmp_path / "out-wrong")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out-wrong").exists()


def test_a_chain_that_changes_its_pieces_is_refused(built: PiecedRun, store: FileStore) -> None:
    delta = built.manifests[2]
    name = "model.embed_tokens.weight"
    entry = delta.tensor(name)
    a, b, *rest = entry.pieces
    # Same objects, other ranges: what a re-partitioned trainer would write.
    moved = (
        Piece(a.object, a.start, a.stop - 1, a.hash, a.changed),
        Piece(b.object, b.start - 1, b.stop, b.hash, b.changed),
    )
    rewrite(store, delta, tensors=with_tensor(delta, name, pieces=(*moved, *rest)))
    with pytest.raises(ChainError, match="pieces"):
        list(chain.reconstruct_tensors(store, RUN, 3))


def test_a_replica_follows_a_pieced_run_in_s3_through_compaction(s3_url: str) -> None:
    s3 = open_store(s3_url)
    built = build_pieced_run(s3, RUN, deltas=2)
    target = TorchTarget.for_node(TargetSetup(store=s3, run=RUN, stop=threading.Event()))
    assert target is not None
    node = RolloutNode(s3, RUN, target)
    assert node.step_once() == 2
    assert_state(held_state(target), built.states[2])
    built.manifests[-1] = compact(s3, RUN)
    built.write_delta()
    late = TorchTarget.for_node(TargetSetup(store=s3, run=RUN, stop=threading.Event()))
    assert late is not None
    for replica, follower in ((target, node), (late, RolloutNode(s3, RUN, late))):
        assert follower.step_once() == 3
        assert_state(held_state(replica), built.states[3])


def test_load_pieces_needs_every_element_exactly_once(built: PiecedRun, store: FileStore) -> None:
    anchor = built.manifests[0]
    given = list(stream_anchor_pieces(store, anchor, inline, 1, False))
    lacking = [p for p in given if not (p[0] == "lm_head.weight" and p[1].start == 0)]
    twice = [*given, given[0]]
    for pieces in (lacking, twice):
        target = node_target(store)
        with pytest.raises(MismatchError, match="exactly once") as caught:
            target.load_pieces(pieces)
        assert "\n" not in str(caught.value)
    name, piece, tensor = given[1]
    outside = dataclasses.replace(piece, start=piece.start + 10**6, stop=piece.stop + 10**6)
    with pytest.raises(MismatchError, match="outside"):
        node_target(store).load_pieces([(name, outside, tensor)])


def test_pieces_cross_the_vllm_rpc_and_bad_ones_are_refused(built: PiecedRun) -> None:
    from pipeline.targets.vllm.protocol import entry_from_wire, entry_to_wire

    for entry in built.manifests[1].tensors:
        assert entry_from_wire(entry_to_wire(entry)) == entry
    entry = built.manifests[1].tensor("model.embed_tokens.weight")
    wire = entry_to_wire(entry)
    gap = {**wire, "pieces": [p for i, p in enumerate(wire["pieces"]) if i != 1]}
    extra = {
        **wire,
        "pieces": [
            {**wire["pieces"][0], "changed": wire["pieces"][0]["changed"] + 1},
            *wire["pieces"][1:],
        ],
    }
    for bad in (gap, extra, {**wire, "pieces": "all"}):
        with pytest.raises(TargetError) as caught:
            entry_from_wire(bad)
        assert "\n" not in str(caught.value) and "pieces" in str(caught.value)


def test_a_signed_pieced_run_compacts_signed_and_replicas_check_it(
    store: FileStore, tmp_path: Path
) -> None:
    private, public = generate_keypair(tmp_path / "keys")
    key = private_key_from(private.read_bytes())
    built = build_pieced_run(store, RUN, deltas=2, signing_key=key)
    anchor = compact(store, RUN, options=PublishOptions(signing_key=key))
    assert anchor.signature is not None and anchor.is_pieced
    node_store = FileStore(store.root)
    target = node_target(node_store)
    node = RolloutNode(node_store, RUN, target, NodeOptions(public_key=load_public_key(public)))
    assert node.step_once() == 2, node.last_error
    assert_state(held_state(target), built.states[2])
