"""Chaos soak: mixed load through real gateways while their parts are killed at random."""
