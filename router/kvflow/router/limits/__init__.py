"""Limits at the model, client-IP and global levels (the tenant's are in tenants/): pure
arithmetic (levels.py, decide.py, client_ip.py), an in-process and a Redis store, and the
service the request path calls (service.py). docs/router.md, "Limits at four levels"."""
