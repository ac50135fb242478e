"""A sharded trainer's step: each host diffs its ranks' parts (fanout), one coordinator
writes the manifest.
"""
