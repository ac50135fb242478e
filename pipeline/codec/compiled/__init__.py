"""The compiled kernels of levels 1 and 2 (numba, loaded by name) and their constants."""
