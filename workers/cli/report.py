"""`deltasync report`: draw a run from its event stream (workers/report.py)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.option("--run", help="The run (default: the only run with events in Redis).")
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the picture (PNG), or the page with --html.",
)
@click.option("--html", "as_html", is_flag=True, help="A self-contained HTML page instead.")
@click.pass_context
def report(ctx: click.Context, run: str | None, out: Path, as_html: bool) -> None:
    """A picture of a run: changed fraction, bytes against full and raw, sync latency
    per version, and each replica's lag over time (needs the `report` extra).

    \b
    Examples:
      deltasync report --run grpo-7 --out run.png
      deltasync report --run grpo-7 --html --out run.html
    """
    from pipeline.versions.history import collect
    from workers.ops import only_run
    from workers.report import write_report
    from workers.runtime import from_context

    runtime = from_context(ctx)
    data = collect(runtime.redis, runtime.store, run or only_run(runtime))
    written = write_report(data, out, as_html=as_html)
    click.echo(f"{written}: {len(data.versions)} versions, {len(data.nodes)} replicas")


COMMANDS: list[click.Command] = [report]
