"""The gateway's exact response cache: a deterministic request asked again returns the answer
stored the first time (docs/router.md, "Response cache")."""
