"""mixsum-128's keys, apart from mixsum.py: its compiled loops (mixsum_jit.py) read them
without importing the module that loads those loops."""

from __future__ import annotations

# k0 (positions), k1 (lane A), k2 (lane B), k3 (odd multiplier of the bits, lane B).
KEYS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89 | 1)
