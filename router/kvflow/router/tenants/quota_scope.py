"""The namespace of a router's quota keys in a shared Redis (`--quota-scope`): routers with
the same scope share a tenant's limits. Kept apart from the Redis store so that parsing the
command line imports no Redis client (which pulls in the OpenTelemetry SDK)."""

from __future__ import annotations

import re

DEFAULT_QUOTA_SCOPE = "default"
QUOTA_SCOPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")
