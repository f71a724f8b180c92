"""Small helpers several test files share (imported as `helpers`: pytest puts tests/ on sys.path)."""
import time


def drain(eng) -> dict:
    """Step an LLMEngine until nothing is left; its finished outputs by request id."""
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def wait_idle(loop, timeout: float = 5.0) -> dict:
    """Wait until every KV block is back on the free list and nothing runs or waits; the loop's stats."""
    full = loop.engine.num_blocks - 1
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        s = loop.stats()
        if s["num_free_blocks"] == full and s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        time.sleep(0.01)
    raise AssertionError(f"KV blocks not freed or requests left: {loop.stats()}")
