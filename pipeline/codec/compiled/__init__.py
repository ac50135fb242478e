"""The compiled kernels of level 1 (numba, loaded by name) and their constants."""
