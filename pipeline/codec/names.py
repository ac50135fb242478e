"""The codec's names and choices, importable without torch: settings check a level or
an anchor compression, and manifests name the codec, in processes that never encode."""

from __future__ import annotations

CODEC_NAME = "deltasync-bitdelta"
CODEC_VERSION = 1
LEVELS = (1, 3)
# Levels once written and no longer read: their objects are refused with this advice.
RETIRED_LEVELS = {2: "level 2 is no longer supported; republish with level 1 or 3"}
DEFAULT_LEVEL = 1
ANCHOR_COMPRESSIONS = ("none", "zstd")
