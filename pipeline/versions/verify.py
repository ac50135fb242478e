"""Checking a stored version against a checkpoint, bit for bit (``deltasync verify``).

Every object of the version's chain is fetched and checked (size, sha256), then the
version is rebuilt part by part and each tensor compared with the checkpoint's as
integers of the same width, so NaN payloads and -0.0 count as different. A sharded
run's version (tensors in pieces) is rebuilt part by part from its pieces and each
tensor assembled whole before the comparison (``chain.reconstruct_tensors``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.errors import CorruptObjectError, StoreError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes import content_hashes
from pipeline.format.matching import difference
from pipeline.format.tensors import TensorSpec
from pipeline.store.base import ObjectStore
from pipeline.versions.chain import fetch_object, reconstruct_tensors, resolve


@dataclass(frozen=True)
class TensorDifference:
    name: str
    reason: str  # "content", "dtype", "shape", "missing", "extra", "manifest-hash"
    differing: int = 0  # elements that differ (content only)


@dataclass
class VerifyReport:
    run: str
    version: int
    tensors: int = 0  # tensors compared
    objects: int = 0  # objects whose size and sha256 were checked
    bad_objects: list[str] = field(default_factory=list)
    differences: list[TensorDifference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_objects and not self.differences

    def describe(self) -> str:
        head = f"run {self.run} version {self.version}"
        if self.bad_objects:
            return f"{head}: {len(self.bad_objects)} bad object(s): {self.bad_objects[0]}"
        if not self.differences:
            return f"{head}: bit-identical ({self.tensors} tensors, {self.objects} objects checked)"
        shown = ", ".join(
            f"{d.name} ({d.reason}" + (f", {d.differing} elements)" if d.differing else ")")
            for d in self.differences[:3]
        )
        more = f" and {len(self.differences) - 3} more" if len(self.differences) > 3 else ""
        return f"{head}: {len(self.differences)} tensor(s) differ: {shown}{more}"


_BIT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the same width (compare these, never floats)."""
    return tensor.contiguous().view(_BIT_VIEWS[tensor.element_size()])


def count_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((bit_view(a) != bit_view(b)).sum().item())


def verify(
    store: ObjectStore,
    run: str,
    version: int,
    against_checkpoint: str | os.PathLike[str],
) -> VerifyReport:
    """Compare a stored version bitwise with a checkpoint; also check every object."""
    plan = resolve(store, run, version)
    report = VerifyReport(run, version)
    for m in plan.manifests:
        for entry in m.objects:
            try:
                fetch_object(store, m, entry)
            except (CorruptObjectError, StoreError) as e:
                report.bad_objects.append(str(e))
            report.objects += 1
    if report.bad_objects:
        return report
    with CheckpointReader(Path(against_checkpoint)) as reader:
        target = {t.name: t for t in plan.target.tensors}
        algorithm = content_hashes.of(plan.target)
        for name in target:
            if name not in reader:
                report.differences.append(TensorDifference(name, "missing"))
        for name in reader.names():
            if name not in target:
                report.differences.append(TensorDifference(name, "extra"))
        for name, tensor in reconstruct_tensors(
            store, run, version, plan=plan, verify_hashes=False
        ):
            report.tensors += 1
            if algorithm.full(tensor) != target[name].hash:
                report.differences.append(TensorDifference(name, "manifest-hash"))
            if name not in reader:
                continue
            ours = TensorSpec(tensor.dtype, tuple(tensor.shape))
            differs = difference(ours, reader.spec(name))
            if differs is not None:
                report.differences.append(TensorDifference(name, differs))
                continue
            # Mapped for the comparison alone: a checkpoint larger than RAM stays one
            # tensor resident.
            n = reader.read_mapped(name, functools.partial(count_differing, tensor))
            if n:
                report.differences.append(TensorDifference(name, "content", n))
    return report
