"""Contracts every kvflow component shares: gRPC messages and the block-hash chain."""
