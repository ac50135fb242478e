"""Level 3 end to end: an offline delta of a training step with odd dtypes, created at
level 3 and applied through the same path a target uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.publish.offline import apply_delta, create_delta
from tests.format.test_checkpoint import same_bits
from tests.publish.test_offline import _training_pair

pytestmark = pytest.mark.kernels  # rerun with bounds checks (scripts/test.sh)


@pytest.mark.parametrize("sharded", [False, True])
def test_level_3_round_trip(tmp_path: Path, sharded: bool) -> None:
    a, b, new = _training_pair(tmp_path, sharded=sharded)
    summary = create_delta(a, b, tmp_path / "d", level=3, part_bytes=50_000)
    assert 0 < summary.changed < summary.total
    out = tmp_path / ("c" if sharded else "c.safetensors")
    apply_delta(a, tmp_path / "d", out)
    with CheckpointReader(out) as result:
        for name, tensor in new.items():
            assert same_bits(result.get(name), tensor), name
