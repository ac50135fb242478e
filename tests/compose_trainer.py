"""A trainer for the compose run, executed inside a one-off container of the worker image
(`docker compose run -T --entrypoint python diff-worker - ARGS < this file`).

Trains the tiny synthetic model from its seed up to step ``--last`` and emits steps
``--first``..``--last`` through the stack's Redis and staging volume. The weights of
the last step are also saved, untouched by deltasync, under ``--keep`` for
`deltasync verify --against`. With ``--weights DIR`` it trains nothing: it emits
``DIR/step-N.safetensors`` for each step as they are (a model made on the host).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file

from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from workers.trainers.trainer import Emitter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, required=True)
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--weights", type=Path)
    args = parser.parse_args()
    if args.weights is not None:
        emit_files(args.run, args.weights, args.first, args.last)
        return
    if args.keep is None:
        parser.error("--keep is required without --weights")
    generator = UpdateGenerator(ModelConfig.preset("tiny"), lr=1e-6, seed=0)
    emitter = Emitter(args.run)
    state = generator.state()
    for step in range(1, args.last + 1):
        state = generator.step()
        if step >= args.first:
            emitted = emitter.emit_state(step, state)
            print(f"emitted {emitted.run} step {step}", flush=True)
    args.keep.mkdir(parents=True, exist_ok=True)
    save_state(state, args.keep / f"step-{args.last}.safetensors")


def emit_files(run: str, folder: Path, first: int, last: int) -> None:
    emitter = Emitter(run)
    for step in range(first, last + 1):
        weights = load_file(str(folder / f"step-{step}.safetensors"))
        emitter.emit_state(step, weights, dtype=None)
        print(f"emitted {run} step {step}", flush=True)


if __name__ == "__main__":
    main()
