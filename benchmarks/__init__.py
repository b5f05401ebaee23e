"""tqueue's benchmark suite (end-to-end against peers, and micro-benchmarks)."""
