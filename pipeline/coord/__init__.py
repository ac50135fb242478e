"""Coordination over Redis: connections, typed events and their stream, part hints,
heartbeats and locks, failing nodes.
"""
