"""A TCP port as the command lines take it (``--port``, ``--metrics-port``...): 0, any free
port, to 65535, checked when the flag is parsed. Past that, gRPC binds the number modulo
65536 (a worker asked for 99999 listened on 34463, and for -5 on 65531) and a socket
refuses it only with a traceback."""

from __future__ import annotations

import argparse

MAX_PORT = 65535


def port_number(text: str) -> int:
    """``text`` as a port, for argparse's ``type=``: a clear usage error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port: give a number from 0 (any free port) to {MAX_PORT}"
        ) from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"{value} is not a port: give a number from 0 (any free port) to {MAX_PORT}"
        )
    return value
