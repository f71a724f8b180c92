"""Device -> host copies that wait without holding the GIL.

`tensor.tolist()` on a CUDA tensor blocks inside a call that keeps the GIL, so while the engine thread waits
for the GPU nothing else in the process runs: not the HTTP server's event loop, not the inspector. A
`HostCopy` starts the copy into pinned memory behind the work already queued, and `tolist()` waits on a
CUDA event (which releases the GIL) before reading it.
"""
from __future__ import annotations

import torch


class HostCopy:
    def __init__(self, t: torch.Tensor, timed: bool = False):
        """timed: the event can time the GPU's work from an earlier timing event (Event.elapsed_time)."""
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event(enable_timing=timed)
            self.event.record()
        else:
            self.host, self.event = t, None

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
