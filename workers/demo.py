"""`deltasync demo`: trainer, real workers and replicas on one machine, then a report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from pipeline.config import set_in_environment
from pipeline.coord.events import (
    AnchorAvailable,
    DeltaApplied,
    DeltaAvailable,
    Event,
    ReplicaError,
)
from pipeline.coord.stream import EventStream
from pipeline.errors import ServiceUnavailableError
from pipeline.format.checkpoints.checkpoint import CheckpointReader
from pipeline.format.hashes import content_hashes
from pipeline.format.hashes.hashing import state_hash
from pipeline.logs import configure_logging, get_logger
from pipeline.testing import synthetic
from pipeline.versions import history, verify
from workers.runtime import Runtime
from workers.trainers.trainer import Emitter
from workers.warm import warm

log = get_logger(__name__)


@dataclass(frozen=True)
class DemoOptions:
    steps: int = 12
    model_size: str = "small"
    lr: float = 1e-6
    replicas: int = 2
    diff_workers: int = 1
    compact_every: int = 5
    run: str | None = None
    with_vllm: bool = False
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class VersionRow:
    """What the demo knows of a version beyond its events: the trainer's state hash,
    and whether each replica's equalled it."""

    version: int
    kind: str = "?"
    trainer_hash: str = ""
    matched: dict[str, bool] = field(default_factory=dict)  # node -> state hash equal


# Wide enough for the result table: rich would cut it to 80 columns off a terminal.
REPORT_WIDTH = 160


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and verify.count_differing(a, b) == 0


class Demo:
    def __init__(self, runtime: Runtime, options: DemoOptions) -> None:
        self.runtime = runtime
        self.options = options
        self.run = options.run or datetime.now(UTC).strftime("demo-%Y%m%d-%H%M%S")
        self.folder = runtime.settings.data_dir / "demo" / self.run
        self.console = Console(stderr=True)
        if not self.console.is_terminal:
            self.console = Console(stderr=True, width=REPORT_WIDTH)
        self.rows: dict[int, VersionRow] = {}
        self.events: list[Event] = []  # the run's stream, for the table (history.build)
        self.held: dict[str, int] = {}  # node -> newest version it applied
        self.errors: list[str] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.nodes: list[str] = []
        self.last_event = "0-0"
        self.anchors: dict[int, str] = {}  # version -> why it was made

    # processes --------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        s = self.runtime.settings
        return {
            **os.environ,
            "DELTASYNC_REDIS_URL": self.runtime.redis_url,
            "DELTASYNC_STORE": s.store_url,
            "DELTASYNC_HOME": str(s.data_dir),
            "DELTASYNC_STAGING": str(s.staging_dir),
            "DELTASYNC_CACHE": str(self.folder / "cache"),
            "DELTASYNC_COMPACT_MAX_CHAIN": str(self.options.compact_every),
            "DELTASYNC_LOG_JSON": "1",
            # Two cores: one torch thread per helper process keeps them from thrashing.
            "OMP_NUM_THREADS": "1",
        }

    def _spawn(self, name: str, *args: str) -> None:
        logs = self.folder / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = (logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "workers", *args],
            env=self._env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _start_node(self, name: str, last: int, *, target: str = "torch") -> None:
        self.nodes.append(name)
        options = {"--run": self.run, "--target": target, "--node-id": name, "--until": str(last)}
        options |= {"--verify": "all", "--poll": "1"}
        options["--dump"] = str(self.folder / "dumps" / f"{name}.safetensors")
        if target == "vllm":
            options["--model"] = str(self._vllm_model_folder())
        # --wait: started before the trainer's first step
        self._spawn(name, "rollout", "--wait", *(word for pair in options.items() for word in pair))

    def _vllm_model_folder(self) -> Path:
        """config.json of the synthetic (Llama-shaped) model, no weights and no
        tokenizer: the vLLM node starts on dummy weights and bootstraps from the run."""
        folder = self.folder / "vllm-model"
        folder.mkdir(parents=True, exist_ok=True)
        config = synthetic.ModelConfig.preset(self.options.model_size).hf_config()
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        return folder

    def _stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    # events -----------------------------------------------------------------
    def _drain_events(self, block_ms: int | None = None) -> None:
        stream = EventStream(self.runtime.redis, self.run)
        for event_id, event in stream.read(after_id=self.last_event, block_ms=block_ms, count=500):
            self.last_event = event_id
            if event is None:
                continue
            self.events.append(event)
            row = self.rows.setdefault(event.version, VersionRow(event.version))
            if isinstance(event, DeltaAvailable):
                row.kind = event.kind
            elif isinstance(event, AnchorAvailable):
                self.anchors[event.version] = event.reason
            elif isinstance(event, DeltaApplied):
                row.matched[event.node] = event.state_hash == row.trainer_hash
                self.held[event.node] = max(self.held.get(event.node, -1), event.version)
            elif isinstance(event, ReplicaError):
                self.errors.append(f"{event.node} at v{event.version}: {event.error}")

    def _live_view(self, emitted: int) -> Group:
        head = max((v for v, r in self.rows.items() if r.kind != "?"), default=None)
        summary = (
            f"run [bold]{self.run}[/]  steps emitted {emitted}/{self.options.steps}  "
            f"head {head if head is not None else '-'}"
        )
        table = Table("replica", "holds", "lag", "state")
        for node in self.nodes:
            held = self.held.get(node)
            lag = "-" if head is None or held is None else str(head - held)
            code = self.procs[node].poll() if node in self.procs else None
            state = "following" if code is None else ("done" if code == 0 else f"exit {code}")
            if held is None and code is None:
                state = "bootstrapping"
            table.add_row(node, "-" if held is None else str(held), lag, state)
        return Group(summary, table)

    def _wait_listening(self, live: Live, timeout_s: float) -> None:
        """Until the diff workers listen (their start-up is not a version's sync)."""
        from workers import queues
        from workers.ops import listening_workers

        deadline = time.monotonic() + timeout_s
        while len(listening_workers(self.runtime, queues.DIFF_QUEUE)) < self.options.diff_workers:
            self._check_alive()
            if time.monotonic() > deadline:
                raise ServiceUnavailableError("the demo's diff workers did not start (see logs)")
            live.update(self._live_view(0))
            time.sleep(0.2)

    def _wait_applied(self, version: int, nodes: int, live: Live, timeout_s: float) -> None:
        """Until ``nodes`` replicas applied ``version``."""
        deadline = time.monotonic() + timeout_s
        while sum(v >= version for v in self.held.values()) < nodes:
            self._check_alive()
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(f"the demo's replicas did not reach v{version}")
            self._drain_events(block_ms=250)
            live.update(self._live_view(version + 1))

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ServiceUnavailableError(
                    f"the demo's {name} exited ({proc.returncode}); see "
                    f"{self.folder / 'logs' / (name + '.log')}"
                )

    def _warm(self) -> None:
        """Compile the codec's kernels before the clock starts: numba compiles each on
        first use on a machine (tens of seconds), then loads it from its cache."""
        started = time.perf_counter()
        with self.console.status("codec kernels: compiling on first use on this machine"):
            settings = self.runtime.settings
            warm((settings.level,), content_hash=settings.content_hash)
        self.console.print(
            f"codec kernels ready in {time.perf_counter() - started:.1f} s (compiled once "
            "per machine, then loaded from the kernel cache; not part of the times below)"
        )

    # the run ----------------------------------------------------------------
    def execute(self) -> bool:
        opts = self.options
        if not set_in_environment("log_level"):
            # The live view is the demo's output; the trainer's own logs would interleave.
            configure_logging("warning")
        self.folder.mkdir(parents=True, exist_ok=True)
        config = synthetic.ModelConfig.preset(opts.model_size)
        generator = synthetic.UpdateGenerator(config, lr=opts.lr, seed=opts.seed)
        emitter = Emitter(self.run, settings=self.runtime.settings)
        last = opts.steps - 1
        self.console.print(
            f"deltasync demo: run {self.run}, {opts.model_size} model "
            f"({config.num_parameters():,} parameters), {opts.steps} steps at lr {opts.lr:g}, "
            f"{opts.replicas} replicas; data in {self.runtime.settings.data_dir}"
        )
        self._warm()
        for i in range(opts.diff_workers):
            self._spawn(f"diff-worker-{i}", "worker", "diff")
        self._spawn("compaction-worker", "worker", "compact")
        early = max(opts.replicas - 1, 1)
        for i in range(early):
            self._start_node(f"replica-{i}", last)
        if opts.with_vllm:
            self._start_node("replica-vllm", last, target="vllm")
        final_state: dict[str, torch.Tensor] = {}
        try:
            with Live(self._live_view(0), console=self.console, refresh_per_second=4) as live:
                state = generator.state()
                # The demo's run is new: its first anchor takes the configured hash.
                full = content_hashes.get(self.runtime.settings.content_hash).full
                self._wait_listening(live, opts.timeout_s)
                for step in range(opts.steps):
                    if step == 1:
                        # Replicas bootstrap from the first anchor; later rows are syncs.
                        self._wait_applied(0, early, live, opts.timeout_s)
                    if step:
                        state = generator.step()
                    row = self.rows.setdefault(step, VersionRow(step))
                    hashes = {n: full(t) for n, t in state.items()}
                    row.trainer_hash = state_hash(hashes.items())
                    final_state = {n: t.clone() for n, t in state.items()}
                    emitter.emit_state(step, state)
                    if step == opts.steps // 2 and opts.replicas > early:
                        # A replica that joins late bootstraps from the newest anchor.
                        self._start_node(f"replica-{early}", last)
                    self._drain_events()
                    live.update(self._live_view(step + 1))
                deadline = time.monotonic() + opts.timeout_s
                while time.monotonic() < deadline:
                    self._drain_events(block_ms=250)
                    live.update(self._live_view(opts.steps))
                    if all(self.procs[n].poll() is not None for n in self.nodes):
                        break
                self._drain_events()
            if not self.console.is_terminal:
                self.console.line()  # Live's last frame ends without one off a terminal
        finally:
            self._stop_all()
        return self._report(final_state)

    def _report(self, final_state: dict[str, torch.Tensor]) -> bool:
        ok = True
        full_bytes = sum(t.numel() * t.element_size() for t in final_state.values())
        numel = sum(t.numel() for t in final_state.values())
        # The definitions of `deltasync report` (pipeline/versions/history.py).
        run = history.build(self.run, self.events, full_bytes, numel)
        table = Table(title=f"run {self.run}: per version")
        for col in ("version", "kind", "changed", "bytes", "/full", "/raw", "sync s", "exact"):
            table.add_column(col, justify="right")
        table.add_column("note", justify="left")
        caught_up = False
        for r in run.versions:
            row = self.rows.get(r.version, VersionRow(r.version))
            pct = "-" if r.changed_fraction is None else f"{100 * r.changed_fraction:.2f}%"
            raw = run.raw_bytes(r)
            vs_raw = f"{r.bytes / raw:.3f}" if raw and r.kind == "delta" else "-"
            sync = "-" if r.synced_s is None else f"{r.synced_s:.2f}"
            exact = f"{sum(row.matched.values())}/{len(row.matched)}" if row.matched else "-"
            if row.matched and not all(row.matched.values()):
                ok = False
            late = sorted(set(r.applied_at) - r.followers)
            caught_up = caught_up or bool(late)
            note = f"catch-up: {', '.join(late)}" if late else ""
            if r is run.versions[0]:
                note = "first anchor: replicas start up and bootstrap"
            kind = r.kind + ("+anchor" if r.anchored and r.kind == "delta" else "")
            table.add_row(
                str(r.version),
                kind,
                pct,
                f"{r.bytes:,}",
                f"{r.bytes / full_bytes:.4f}" if full_bytes else "-",
                vs_raw,
                sync,
                exact,
                note,
            )
        self.console.print(table)
        self.console.print(
            "changed: elements that differ from the previous step; /full: bytes over the full "
            "checkpoint; /raw: over an int32 index + value per changed element; sync: "
            "step-completed to the last replica that was following the run applied it (as "
            "`deltasync report` draws it); exact: replicas whose weights hashed equal to the "
            "trainer's after applying that version."
            + (
                " catch-up: a replica that joined late reached this version by bootstrap "
                "and replay, not counted in sync."
                if caught_up
                else ""
            )
        )
        for name in self.nodes:
            dump = self.folder / "dumps" / f"{name}.safetensors"
            if not dump.exists():
                self.console.print(f"[red]{name}: no dump written (see logs)[/]")
                ok = False
                continue
            reader = CheckpointReader(dump)
            same = set(reader.names()) == set(final_state) and all(
                _bits_equal(reader.get(n), t) for n, t in final_state.items()
            )
            ok = ok and same
            self.console.print(
                f"{name}: final weights "
                f"{'[green]bit-identical[/]' if same else '[red]DIFFER[/]'} "
                f"to the trainer's"
            )
        for version, reason in sorted(self.anchors.items()):
            self.console.print(f"compaction: anchor at version {version} ({reason})")
        if not self.anchors:
            self.console.print("no compaction ran (fewer steps than --compact-every)")
        for error in self.errors:
            self.console.print(f"[yellow]replica error (recovered or reported):[/] {error}")
        home = self.runtime.settings.data_dir
        env = f"DELTASYNC_HOME={home} " if set_in_environment("data_dir") else ""
        self.console.print(
            f"\ndata folder: {home} (store: {self.runtime.settings.store_url}, "
            f"logs: {self.folder / 'logs'})\ntry next:\n"
            f"  {env}deltasync tail --run {self.run}\n"
            f"  {env}deltasync status --run {self.run}\n"
            f"  {env}deltasync compact --run {self.run} --wait   "
            f"(needs `deltasync worker compact` running)\n"
            f"  {env}deltasync redis stop   (stops the embedded Redis)"
        )
        self.console.print(
            "[green]every replica matched the trainer bit for bit[/]"
            if ok
            else "[red]a replica differs from the trainer[/]"
        )
        return ok


def run_demo(runtime: Runtime, options: DemoOptions) -> bool:
    return Demo(runtime, options).execute()
