"""Pause of one delta apply vs a full weight reload, on the same live vLLM engine.

Builds a Qwen3 model of the given size locally (no download), starts one in-process
vLLM engine with the deltasync worker extension, and measures in the same run:

- delta: ``VllmTarget.apply_delta`` of a delta changing ``--changed`` of all
  elements by one bf16 unit (the typical RL step): pause = commit RPC + prefix-cache
  reset, as ApplyReport.pause_s (the prepare, decoding and verifying on a worker
  thread, runs while the engine could serve); apply = prepare + pause;
- walked: the same delta with no memory for decoded patches
  (``DELTASYNC_PATCH_MEMORY_MB=0``: the workers walk it into their shadow, and the
  commit reads the changes back from it), right after each kept apply;
- reload: vLLM's own ``reload_weights`` of the whole checkpoint from the local
  safetensors folder, plus the prefix-cache reset (alternating with the deltas, so
  both see the same load on a shared machine);
- decode speed of the engine (``--cpu-linear plain`` or ``packed`` weights);
- load_files: ``VllmTarget.load_files`` (full reload through deltasync, which also
  rebuilds the shadow and weight map);
- engine start: a fresh ``LLM(...)`` on the checkpoint (once).

Run: ``python benchmarks/bench_vllm_apply.py [--hidden 512 --layers 4 ...]``.
Prints one JSON document (vLLM logs to stdout too: use ``--out`` for a clean file).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from pipeline.codec import CODEC_NAME, CODEC_VERSION, encode_delta
from pipeline.format.hashes.hashing import content_hash, sha256_bytes
from pipeline.format.manifest import (
    CodecInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    compute_state_hash,
    dtype_name,
    now_iso,
)
from pipeline.targets.base import ApplyReport
from pipeline.targets.proving import DEFAULT_PATCH_MEMORY_BYTES
from pipeline.targets.vllm.target import EXTENSION_CLS, VllmTarget, start_engine


def build(folder: Path, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return load_file(str(folder / "model.safetensors"))


def nudge(weights: dict[str, torch.Tensor], fraction: float) -> dict[str, torch.Tensor]:
    """Change ``fraction`` of the elements by one unit in the last place."""
    generator = torch.Generator().manual_seed(1)
    new = {}
    for name, tensor in weights.items():
        bits = tensor.view(torch.int16).clone()
        chosen = torch.rand(bits.shape, generator=generator) < fraction
        sign = torch.where(torch.rand(bits.shape, generator=generator) < 0.5, 1, -1)
        bits[chosen] += sign[chosen].to(torch.int16)
        new[name] = bits.view(torch.bfloat16)
    return new


def delta(
    version: int, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> tuple[Manifest, dict[str, bytes]]:
    names = sorted(new)
    data = encode_delta((n, base[n], new[n]) for n in names)
    key = "part-00000.safetensors"
    tensors = tuple(
        TensorEntry(
            n,
            dtype_name(new[n].dtype),
            tuple(new[n].shape),
            content_hash(new[n]),
            key,
            int((base[n].view(torch.int16) != new[n].view(torch.int16)).sum()),
        )
        for n in names
    )
    manifest = Manifest(
        run="bench",
        version=version,
        kind="delta",
        parent=version - 1,
        anchor=0,
        codec=CodecInfo(CODEC_NAME, CODEC_VERSION, 1),
        objects=(ObjectEntry(key, len(data), sha256_bytes(data)),),
        tensors=tensors,
        state_hash=compute_state_hash(tensors),
        created=now_iso(),
    )
    return manifest, {key: data}


class Walked:
    """Applies with no memory for decoded patches: pauses, applies, phases."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.applies: list[float] = []
        self.phases: dict[str, list[float]] = {}
        self.tensors: list[int] = []

    def add(self, target: VllmTarget, report: ApplyReport) -> None:
        self.pauses.append(report.pause_s)
        self.applies.append(sum(target.last_timings.values()))
        self.tensors.append(report.walked)
        for phase, seconds in target.last_timings.items():
            self.phases.setdefault(phase, []).append(seconds)

    def summary(self, kept_pause: float, kept_apply: float) -> dict[str, Any]:
        pause, apply = statistics.median(self.pauses), statistics.median(self.applies)
        return {
            "tensors_walked": self.tensors[0] if self.tensors else 0,
            "pause_s_median": pause,
            "apply_s_median": round(apply, 5),
            "pause_over_kept": round(pause / kept_pause, 3),
            "apply_over_kept": round(apply / kept_apply, 3),
            "pause_s_all": [round(p, 5) for p in self.pauses],
            "phases_s_median": {k: round(statistics.median(v), 5) for k, v in self.phases.items()},
        }


def engine(folder: Path, plain: bool) -> Any:
    return start_engine(
        model=str(folder),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        skip_tokenizer_init=True,
        distributed_executor_backend="uni",
        worker_extension_cls=EXTENSION_CLS,
        cpu_plain_linear=plain,
    )


def decode_tokens_per_s(llm: Any, vocab: int, batch: int = 4, tokens: int = 32) -> float:
    """Greedy decode speed on ``batch`` short prompts (median of three runs)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [
        TokensPrompt(prompt_token_ids=[(7 * i + j) % vocab for j in range(16)])
        for i in range(batch)
    ]
    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(batch * tokens / (time.perf_counter() - started))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--changed", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--cpu-linear",
        choices=["plain", "packed"],
        default="plain",
        help="plain: linear weights kept as tensors, deltas written in place (the "
        "default of start_engine); packed: vLLM's prepacked CPU GEMM weights",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        base = build(folder, args)
        new = nudge(base, args.changed)
        forward, back = delta(1, base, new), delta(2, new, base)
        params = sum(t.numel() for t in base.values())
        changed = sum(e.changed for e in forward[0].tensors)

        started = time.perf_counter()
        llm = engine(folder, args.cpu_linear == "plain")
        engine_start = time.perf_counter() - started
        target = VllmTarget(llm)
        target.load_model_files(version=0)
        decode_rate = decode_tokens_per_s(llm, args.vocab)

        # Delta and full reload alternate, so both see the same load on a shared
        # machine; each pair gives one ratio.
        delta_pauses: list[float] = []
        reload_pauses: list[float] = []
        ratios: list[float] = []
        applies: list[float] = []
        phases: dict[str, list[float]] = {}
        walked = Walked()
        for _ in range(args.repeats):
            started = time.perf_counter()
            llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True}
            )
            llm.reset_prefix_cache()
            reload_pauses.append(time.perf_counter() - started)
            # Each round: 0 -> 1 with patches kept, then 1 -> 0 walked, from the
            # target's shadow (back at version 0 for the next round). The reload put
            # the model at version 0, which changes nothing in the work a delta does
            # (the same elements are written).
            target.version = None
            target.patch_memory_bytes = DEFAULT_PATCH_MEMORY_BYTES
            delta_pauses.append(target.apply_delta(*forward, "touched").pause_s)
            ratios.append(delta_pauses[-1] / reload_pauses[-1])
            applies.append(sum(target.last_timings.values()))
            for phase, seconds in target.last_timings.items():
                phases.setdefault(phase, []).append(seconds)
            target.version = None
            target.patch_memory_bytes = 0
            walked.add(target, target.apply_delta(*back, "touched"))

        load_files = []
        for _ in range(max(1, args.repeats // 2)):
            started = time.perf_counter()
            target.load_files([str(folder)], version=0)
            load_files.append(time.perf_counter() - started)

        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    result = {
        "cpu_linear": args.cpu_linear,
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
            "parameters": params,
            "checkpoint_bytes": params * 2,
        },
        "delta": {
            "changed_elements": changed,
            "changed_fraction": round(changed / params, 5),
            "object_bytes": forward[0].objects[0].size,
            # Engine unavailable: the commit and the prefix-cache reset (the prepare
            # runs on a worker thread while the engine serves).
            "pause_s_median": statistics.median(delta_pauses),
            "apply_s_median": round(statistics.median(applies), 5),
            "pause_s_all": [round(p, 5) for p in delta_pauses],
            "phases_s_median": {k: round(statistics.median(v), 5) for k, v in phases.items()},
        },
        "walked": walked.summary(statistics.median(delta_pauses), statistics.median(applies)),
        "reload_weights_s_median": statistics.median(reload_pauses),
        "reload_weights_s_all": [round(p, 5) for p in reload_pauses],
        "pause_over_reload_median": round(statistics.median(ratios), 4),
        "load_files_s_median": statistics.median(load_files),
        "decode_tokens_per_s": round(decode_rate, 1),
        "engine_start_s": round(engine_start, 3),
        "torch_threads": torch.get_num_threads(),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
