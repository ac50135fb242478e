"""The constants of the fused kernels, shared by fused.py and the compiled fused_jit.py.

fused_jit.py names their values in its CONSTANTS line (numba freezes them in its
disk cache), so a change here means editing that line too.
"""

LANES = 64  # elements compared per step; the mask of a step is one uint64
BATCH = 256  # elements decoded ahead of their writes

# walk_sparse modes
APPLY = 0
DECODE = 1
UNDO = 2
DIFFS = 3  # records positions and differences; never reads the target
GATHER = 4  # records positions, new and old contents; writes nothing
CONFIRM = 5  # APPLY, each batch read back from the target right after its writes

# walk_sparse outcomes
DONE = 0
BAD_UNARY = 1  # the unary stream ends early or holds more or fewer codes
BAD_POSITION = 2  # a gap leads past the end of the tensor
BAD_CONTENTS = 3  # a magnitude wraps to zero
BAD_READBACK = 4  # CONFIRM: a written position does not hold what was written
BAD_BIG = 5  # walk_records: the large magnitudes' indices do not decode to their count

# encode_sparse outcome besides DONE: another encoding applies
FALLBACK = 1

# walk_records: one int64 row a record, these columns in this order. Stream sizes
# are in bytes; the record's streams lie back to back from ``streams`` in the
# streams buffer (role order: unary, fixed, then sign, big_unary, big_fixed for
# sign-magnitude contents); ``planes``/``planes_size`` are its decompressed contents
# in the planes buffer, ``out`` where its outputs start, ``bigs`` where its large
# magnitudes' indices (nbig + 1 with the sentinel) go, ``address``/``size`` its
# target's memory and element count; ``zigzag`` is 1 for byte-plane contents.
RECORD_FIELDS = (
    "streams",
    "unary",
    "fixed",
    "sign",
    "big_unary",
    "big_fixed",
    "count",
    "param",
    "zigzag",
    "nbig",
    "big_param",
    "planes",
    "planes_size",
    "out",
    "bigs",
    "address",
    "size",
)

MAX_PARAM = 40  # rice.MAX_PARAM (rice.py imports fused.py)

# Sign-magnitude contents when at least SIGNMAG_ONES / SIGNMAG_OF of the
# differences are +-1: from there on they are the smaller of the two methods, on
# every magnitude distribution measured (docs/PERFORMANCE.md, contents).
SIGNMAG_ONES = 2
SIGNMAG_OF = 5
