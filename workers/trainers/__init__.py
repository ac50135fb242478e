"""The trainer side: emitting steps (one process or sharded ranks) and watching a
checkpoint folder.
"""
