"""Safetensors checkpoints: reading, writing, tensor naming forms and a sharded
trainer's rank layouts.
"""
