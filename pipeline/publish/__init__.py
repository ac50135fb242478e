"""Writing versions: the diff step, parts and uploads, compaction, repair, offline deltas,
dead letters; the diff worker's caches (caches/) and sharded steps (ranks/).
"""
