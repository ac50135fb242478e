"""A trainer for the compose run, executed inside a one-off container of the worker image
(`docker compose run -T --entrypoint python diff-worker - ARGS < this file`).

Trains the tiny synthetic model from its seed up to step ``--last`` and emits steps
``--first``..``--last`` through the stack's Redis and staging volume. The weights of
the last step are also saved, untouched by deltasync, under ``--keep`` for
`deltasync verify --against`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.testing.synthetic import ModelConfig, UpdateGenerator, save_state
from workers.trainer import Emitter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, required=True)
    parser.add_argument("--keep", type=Path, required=True)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
