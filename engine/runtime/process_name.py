"""Name a server process as `top`, `ps -o comm` and psutil show it: kvscope-core, kvscope-api0, ... (Linux)."""
from __future__ import annotations


def set_process_name(name: str) -> None:
    """The process's name (at most 15 bytes on Linux); elsewhere nothing changes."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
