"""The one click group (main.py) and its commands."""

import sys

# redis-py imports OpenTelemetry's metrics SDK whenever it is installed (vLLM brings it
# in): 0.2-0.4 s of every command's start. The CLI never turns redis-py's telemetry on,
# so the import is refused (redis-py then runs without it). `deltasync serve` keeps it:
# the vLLM server in its process is the user's to instrument.
if sys.argv[1:2] != ["serve"] and "opentelemetry.sdk.metrics" not in sys.modules:
    sys.modules["opentelemetry.sdk.metrics"] = None  # type: ignore[assignment]  # import fails
