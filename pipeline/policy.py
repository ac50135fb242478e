"""When a run's chain should become a new anchor."""

from __future__ import annotations

from pipeline import chain
from pipeline.store.base import ObjectStore


def compaction_reason(
    store: ObjectStore, run: str, version: int, max_chain: int, max_delta_fraction: float
) -> str | None:
    """Why version ``version`` should be compacted now, or None.

    Two limits bound what a new replica must replay: the number of deltas since
    the anchor, and their bytes as a fraction of the anchor's bytes.
    """
    plan = chain.resolve(store, run, version)
    if not plan.deltas:
        return None
    if len(plan.deltas) >= max_chain:
        return f"chain of {len(plan.deltas)} deltas reached {max_chain}"
    anchor_bytes = plan.anchor.total_bytes
    delta_bytes = sum(m.total_bytes for m in plan.deltas)
    if anchor_bytes and delta_bytes >= max_delta_fraction * anchor_bytes:
        return (
            f"delta bytes {delta_bytes} reached {max_delta_fraction:g} of the anchor's "
            f"{anchor_bytes}"
        )
    return None
