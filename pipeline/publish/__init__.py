"""Writing versions: the diff step, parts and uploads, the diff worker's state cache,
compaction, offline deltas, dead letters.
"""
