"""Level 3: chunked, base-conditioned streams that decode independently (compiled walk on
CPU threads, torch ops on devices)."""
