"""Connections between the engine's processes (multiprocessing Connections over local TCP sockets)."""
from __future__ import annotations

import os
import socket


def set_nodelay(conn) -> None:
    """Turn Nagle's algorithm off on a Connection over TCP (a no-op on other sockets). The engine core and the
    serving process exchange small messages both ways (outputs each step one way, new requests the other):
    with Nagle on, a message waits for the ACK of the one before it, which the peer's delayed ACK holds back
    up to 40 ms, so outputs reach clients in bunches."""
    s = socket.socket(fileno=os.dup(conn.fileno()))      # the same socket; only the duplicate fd is closed
    try:
        if s.family in (socket.AF_INET, socket.AF_INET6):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        s.close()
