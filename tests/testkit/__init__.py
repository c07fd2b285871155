"""Test support shared by every component's tests (importable as ``testkit``)."""
