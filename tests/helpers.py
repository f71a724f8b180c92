"""Small helpers several test files share (imported as `helpers`: pytest puts tests/ on sys.path)."""
import time

import torch


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


def every_code_weight(fmt: str, N: int, K: int, device="cpu") -> dict:
    """A weight of the format whose codes run through every value (fp8: every finite bit pattern, subnormals
    included), with unit scales and zero mins: it dequantizes to the code values themselves."""
    i = torch.arange(N * K, device=device).view(N, K)
    if fmt == "int8":
        return {"weight": (i % 255 - 127).to(torch.int8), "weight_scale": torch.ones(N, 1, device=device)}
    if fmt == "fp8":
        bits = (i % 254).to(torch.uint8)
        bits = torch.where(bits >= 127, bits + 1, bits)                # skip 0x7F (NaN); 0xFF never occurs
        return {"weight": bits.view(torch.float8_e4m3fn),
                "weight_scale_inv": torch.ones(-(-N // 128), -(-K // 128), device=device)}
    return {"qweight": (i[:, :K // 2] % 256).to(torch.uint8),
            "scales": torch.ones(N, K // 128, dtype=torch.float16, device=device),
            "mins": torch.zeros(N, K // 128, dtype=torch.float16, device=device)}
