"""Ready-made glue between deltasync and training frameworks (``trl``: TRL's trainers).

Each module imports its framework only when it is imported itself; ``import workers``
never does.
"""
