"""The `kvflow` command: one entry point that dispatches to each component's own CLI."""
