"""The codec's names and choices, importable without torch: settings check a level or
an anchor compression, and manifests name the codec, in processes that never encode."""

from __future__ import annotations

CODEC_NAME = "deltasync-bitdelta"
CODEC_VERSION = 1
LEVELS = (1, 2, 3)
DEFAULT_LEVEL = 1
ANCHOR_COMPRESSIONS = ("none", "zstd")
