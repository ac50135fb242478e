"""deltasync library: codec, manifests, chain, stores, events and targets.

This package never imports rq and never configures process-wide state
(logging, signals); entry points in ``workers/`` do that.
"""

__version__ = "0.1.0"
