"""Reading a run from the store: the chain of versions, verification, retention, compaction
policy, the run's instance binding and history.
"""
