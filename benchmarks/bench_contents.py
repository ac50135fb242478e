"""Bytes of the two contents methods against the share of +-1 differences.

    python benchmarks/bench_contents.py [--changes 1e6] [--seed 0]

For each share f of +-1 differences and each distribution of the larger
magnitudes (random signs throughout), encodes the same bf16 differences both ways
(byte planes: zigzag, zstd; sign-magnitude: sign bits, Rice-coded indices of the
large ones, their zstd byte planes) and prints bits per change, with the method
the encoder picks (``contents.signmag_pays``). Where the smaller method and the
pick disagree, the line is marked: the rule's threshold should sit where the
two methods cross on every distribution.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from pipeline.codec import contents, rice

Draw = Callable[[np.random.Generator, int], npt.NDArray[np.int64]]

MAGNITUDES: dict[str, Draw] = {
    "2": lambda g, n: np.full(n, 2, np.int64),
    "2-4": lambda g, n: g.integers(2, 5, n),
    "2-16": lambda g, n: g.integers(2, 17, n),
    "geometric": lambda g, n: 1 + g.geometric(0.3, n),
    "log-normal": lambda g, n: np.maximum(2, np.round(np.exp(g.normal(1.5, 1.2, n)))).astype(
        np.int64
    ),
    "2-1000": lambda g, n: g.integers(2, 1001, n),
}
SHARES = (0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 2 / 3, 0.8, 0.9)


def sizes(diff: npt.NDArray[np.uint16]) -> tuple[int, int]:
    """(byte planes, sign-magnitude) bytes of the same differences."""
    planes = contents.encode_planes(contents.zigzag(diff)).size
    signed = diff.view(np.int16).astype(np.int64)
    magnitude = np.abs(signed)
    big = np.flatnonzero(magnitude > 1)
    unary, fixed, _ = rice.encode_positions(big)
    mags = contents.encode_planes((magnitude[big] - 2).astype(np.uint16)).size if big.size else 0
    return planes, (diff.size + 7) // 8 + unary.size + fixed.size + mags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=float, default=1e6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n = int(args.changes)
    gen = np.random.default_rng(args.seed)
    print("| f (+-1) | magnitudes > 1 | byte planes bits | sign-magnitude bits | picked |")
    print("| ---: | --- | ---: | ---: | --- |")
    for share in SHARES:
        for label, draw in MAGNITUDES.items():
            magnitude = np.where(gen.random(n) < share, 1, draw(gen, n))
            signed = np.where(gen.random(n) < 0.5, -magnitude, magnitude)
            diff = signed.astype(np.int16).view(np.uint16)
            planes, signmag = sizes(diff)
            ones = int(np.count_nonzero(magnitude == 1))
            picked = "signmag" if contents.signmag_pays(ones, n) else "planes"
            smaller = "signmag" if signmag < planes else "planes"
            mark = "" if picked == smaller else " (not the smaller)"
            print(
                f"| {share:.3f} | {label} | {8 * planes / n:.3f} | {8 * signmag / n:.3f} "
                f"| {picked}{mark} |"
            )


if __name__ == "__main__":
    main()
