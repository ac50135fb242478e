"""Bytes at rest: tensor specs and dtypes, hashes, safetensors checkpoints, manifests and
their signatures. Imports nothing above it.
"""
