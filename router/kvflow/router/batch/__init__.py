"""The Batch API (docs/router.md, "Batch API"): files, batches, and the runner that spends
spare capacity on them."""
