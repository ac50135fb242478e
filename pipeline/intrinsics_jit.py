"""LLVM intrinsics shared by the compiled loops (numba), imported only where numba is
installed: cache-line prefetch hints for scattered reads and writes, and arrays of
memory named by its address.

A hint never changes a result, so a loop cached on disk by numba (``cache=True``, keyed
on its own file alone) that inlined an older version of these stays correct.
``pointer_like`` is a plain cast that must keep its meaning for the same reason.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import cgutils, types  # type: ignore[import-untyped]
from numba.extending import intrinsic  # type: ignore[import-untyped]

# How far ahead a scattered loop prefetches, in elements: at 2% changed a 64-element
# lead keeps about a dozen misses in flight (2.4x faster than no hint for a gather
# over a 272 MB tensor).
AHEAD = 64


def _prefetch(
    context: Any, builder: Any, sig: Any, args: Any, write: int, locality: int = 3
) -> Any:
    data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
    byte_pointer = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    function = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]),
        "llvm.prefetch.p0",
    )
    address = builder.bitcast(builder.gep(data, [args[1]]), byte_pointer)
    # (address, read 0 / write 1, temporal locality 3 (all levels) .. 0, data cache)
    builder.call(
        function,
        [address, ir.Constant(i32, write), ir.Constant(i32, locality), ir.Constant(i32, 1)],
    )
    return context.get_dummy_value()


@intrinsic  # type: ignore[untyped-decorator,misc]
def prefetch_write(typingctx: Any, array: Any, index: Any) -> Any:
    """Hint that array[index] is about to be written (no effect on results)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _prefetch(context, builder, sig, args, 1)

    return types.none(array, index), codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def prefetch_read(typingctx: Any, array: Any, index: Any) -> Any:
    """Hint that array[index] is about to be read (no effect on results)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _prefetch(context, builder, sig, args, 0)

    return types.none(array, index), codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def prefetch_read_l2(typingctx: Any, array: Any, index: Any) -> Any:
    """Hint that array[index] is about to be read, into the L2 cache and up, not L1
    (no effect on results): for a loop that asks for its lines a batch before it
    reads them (the delta walk's gather)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return _prefetch(context, builder, sig, args, 0, locality=2)

    return types.none(array, index), codegen


@intrinsic  # type: ignore[untyped-decorator,misc]
def pointer_like(typingctx: Any, address: Any, like: Any) -> Any:
    """``address`` (an int64) as a pointer to elements of ``like``'s dtype: with
    ``numba.carray``, the memory of a tensor named by its address, so that one call
    can go over many tensors. The caller vouches for the address and the size."""
    signature = types.CPointer(like.dtype)(address, like)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen
