"""Structured output on the gateway side: request formats -> checked constraints."""
