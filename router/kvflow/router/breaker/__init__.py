"""Circuit breakers: per worker and per pool, whether requests should stop going there for a
while because too many of them failed. Pure (the caller passes the time): `machine.py` is
one breaker, `window.py` its sliding window, `pool.py` what a pool's circuit refuses."""
