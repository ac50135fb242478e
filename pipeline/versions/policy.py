"""When a run's chain should become a new anchor."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from pipeline.errors import ChainError, CorruptObjectError, SignatureError
from pipeline.format.manifest import Manifest
from pipeline.store.base import ObjectStore
from pipeline.versions import chain

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ChainTally:
    """What the policy weighs of a version's chain: the newest anchor at or below it,
    and the deltas since."""

    version: int
    anchor: int
    anchor_bytes: int
    deltas: int
    delta_bytes: int

    def reason(self, max_chain: int, max_delta_fraction: float) -> str | None:
        """Why the version should be compacted now, or None.

        Two limits bound what a new replica must replay: the number of deltas since
        the anchor, and their bytes as a fraction of the anchor's bytes."""
        if not self.deltas:
            return None
        if self.deltas >= max_chain:
            return f"chain of {self.deltas} deltas reached {max_chain}"
        if self.anchor_bytes and self.delta_bytes >= max_delta_fraction * self.anchor_bytes:
            return (
                f"delta bytes {self.delta_bytes} reached {max_delta_fraction:g} of the "
                f"anchor's {self.anchor_bytes}"
            )
        return None


def tally(
    store: ObjectStore,
    run: str,
    version: int,
    *,
    last: ChainTally | None = None,
    published: Manifest | None = None,
) -> ChainTally | None:
    """The chain tally of ``version``, None when its chain cannot be resolved (logged:
    the version is published, and its job must not fail over what it cannot mend).
    From ``last``, the tally of its parent, when ``published`` is the version's delta
    manifest and the newest anchor is still ``last``'s: a step then costs one listing
    instead of a parse of every manifest of its chain (3 ms each at 219 tensors)."""
    index = chain.list_versions(store, run)
    if (
        last is not None
        and published is not None
        and published.kind == "delta"
        and published.version == version
        and published.parent == last.version
        and index.anchor_at_or_below(version) == last.anchor
    ):
        return ChainTally(
            version,
            last.anchor,
            last.anchor_bytes,
            last.deltas + 1,
            last.delta_bytes + published.total_bytes,
        )
    try:
        plan = chain.resolve(store, run, version, index=index)
    except (ChainError, CorruptObjectError, SignatureError) as exc:
        log.warning(
            "the head cannot be rebuilt from the store: no new node can bootstrap",
            run=run,
            version=version,
            error=str(exc),
        )
        return None
    return ChainTally(
        plan.version,
        plan.anchor.version,
        plan.anchor.total_bytes,
        len(plan.deltas),
        sum(m.total_bytes for m in plan.deltas),
    )
