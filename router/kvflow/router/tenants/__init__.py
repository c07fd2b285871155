"""Tenants: API keys (stored as hashes), quotas and rate limits, cache salts, usage."""
