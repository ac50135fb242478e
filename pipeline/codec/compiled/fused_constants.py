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

# encode_sparse outcome besides DONE: another encoding applies
FALLBACK = 1

MAX_PARAM = 40  # rice.MAX_PARAM (rice.py imports fused.py)

# Sign-magnitude contents when at least SIGNMAG_ONES / SIGNMAG_OF of the
# differences are +-1: from there on they are the smaller of the two methods, on
# every magnitude distribution measured (docs/PERFORMANCE.md, contents).
SIGNMAG_ONES = 2
SIGNMAG_OF = 5
