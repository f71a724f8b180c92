"""`python -m engine.runtime.core_main`: the engine core process (core_proc.core_main), started by
EngineCoreClient as a fresh interpreter, so the user's script is never imported again. It connects back to the
client's listener (KVSCOPE_CORE_ADDRESS, KVSCOPE_CORE_AUTHKEY), receives its config, and serves."""
import marshal
import os
from multiprocessing.connection import Client

from engine.ipc import set_nodelay
from engine.runtime.core_proc import core_main, watch_parent

if __name__ == "__main__":
    host, port = os.environ["KVSCOPE_CORE_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["KVSCOPE_CORE_AUTHKEY"]))
    set_nodelay(conn)
    watch_parent(int(os.environ["KVSCOPE_CORE_PARENT"]))
    core_main(marshal.loads(conn.recv_bytes()), conn)
