"""The diff worker's local caches: its held state, a sharded host's rank pieces, and the
scrubber that checks both against the store.
"""
