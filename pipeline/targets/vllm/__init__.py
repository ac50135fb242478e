"""Everything that runs with or inside vLLM: the target, the engine it drives, the worker
extension and its state, the checkpoint-to-vLLM name mapping and the CPU linear hook.
"""
