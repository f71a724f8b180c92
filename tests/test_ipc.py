"""Connections between the engine's processes send each message at once (no Nagle): checked on the socket."""
import socket
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Client, Listener

from engine.ipc import set_nodelay


def _nodelay(conn) -> int:
    s = socket.socket(fileno=conn.fileno())
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        s.detach()                                  # the fd stays the Connection's


def test_set_nodelay_on_both_ends_of_a_tcp_connection():
    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:
        box = []
        t = threading.Thread(target=lambda: box.append(listener.accept()))
        t.start()
        client = Client(listener.address, authkey=b"k")
        t.join(30)
        server = box[0]
        assert _nodelay(client) == 0 and _nodelay(server) == 0     # Nagle is on by default
        set_nodelay(client)
        set_nodelay(server)
        assert _nodelay(client) != 0 and _nodelay(server) != 0
        client.send_bytes(b"ping")                  # the Connections still work: only a duplicate fd was closed
        assert server.recv_bytes() == b"ping"
        client.close()
        server.close()


def test_set_nodelay_leaves_a_local_pipe_alone():
    a, b = Pipe()
    set_nodelay(a)
    a.send_bytes(b"x")
    assert b.recv_bytes() == b"x"
