"""The garbage collector in a serving process. What a process builds at start-up (torch, Triton, the model, the
web stack: a few hundred thousand tracked objects) lives as long as the process, yet every full collection walks
it: 100-400 ms during which the process streams nothing. Once started, a serving process freezes that heap, as
vLLM's engine core and API server do, so a full collection walks only what serving allocated since."""
import gc


def freeze_gc_heap() -> int:
    """Collect, then move every object alive now to the permanent generation, which collections skip (objects
    freed later by reference counting are still freed). Returns the number of frozen objects."""
    gc.collect()                # garbage frozen now could never be collected
    gc.freeze()
    return gc.get_freeze_count()
