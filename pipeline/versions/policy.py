"""When a run's chain should become a new anchor."""

from __future__ import annotations

import structlog

from pipeline.errors import ChainError, CorruptObjectError, SignatureError
from pipeline.store.base import ObjectStore
from pipeline.versions import chain

log = structlog.get_logger(__name__)


def compaction_reason(
    store: ObjectStore, run: str, version: int, max_chain: int, max_delta_fraction: float
) -> str | None:
    """Why version ``version`` should be compacted now, or None.

    Two limits bound what a new replica must replay: the number of deltas since
    the anchor, and their bytes as a fraction of the anchor's bytes.
    """
    try:
        plan = chain.resolve(store, run, version)
    except (ChainError, CorruptObjectError, SignatureError) as exc:
        # The version is published; its job must not fail over what it cannot mend.
        log.warning(
            "the head cannot be rebuilt from the store: no new node can bootstrap",
            run=run,
            version=version,
            error=str(exc),
        )
        return None
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
