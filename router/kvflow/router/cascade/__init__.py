"""Model cascade: a small model answers first, a large one when its answer fails a check."""
