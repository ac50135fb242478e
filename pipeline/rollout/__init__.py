"""The rollout node: bootstrap and follow a run, fetch and verify objects, apply them to a
target, report, scrub.
"""
