"""The soak test's view of the server's health: gauges parsed from `/metrics`, the server's RSS, a sampler that
writes one row per period, and a wait for the server to go idle."""
from __future__ import annotations

import asyncio
import bisect
import re
import time

import httpx

from benchmarks.soak_users import BAD, GOOD, Tally

_LINE = re.compile(r'^kvscope:(\w+)(\{[^}]*\})?\s+([-+0-9.eEinfaN]+)$')


def parse_metrics(text: str) -> dict:
    """The gauges the sampler needs, and API responses summed by status class."""
    out = {"http_2xx": 0.0, "http_4xx": 0.0, "http_5xx": 0.0}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "api_requests_total":
            st = re.search(r'status="(\d)', labels)
            if st and f"http_{st.group(1)}xx" in out:
                out[f"http_{st.group(1)}xx"] += value
            if 'status="503"' in labels:
                out["http_503"] = out.get("http_503", 0.0) + value
        elif name == "cache_config_info":
            mm = re.search(r'max_model_len="(\d+)"', labels)
            if mm:
                out["max_model_len"] = int(mm.group(1))
        elif name in ("num_requests_running", "num_requests_waiting", "num_kv_blocks", "num_free_kv_blocks",
                      "num_preemptions_total"):
            out[name] = out.get(name, 0.0) + value          # summed over the engine="N" replicas
            if name == "num_kv_blocks":
                out["replicas"] = out.get("replicas", 0) + 1
    if "num_kv_blocks" in out:                              # block 0 of each replica's pool is reserved
        out["kv_blocks_in_use"] = out["num_kv_blocks"] - out["replicas"] - out["num_free_kv_blocks"]
    return out


def rss_mib(pid: int | None) -> float:
    if not pid:
        return float("nan")
    import psutil
    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
        return sum(q.memory_info().rss for q in procs if q.is_running()) / 2**20
    except psutil.Error:
        return float("nan")


def slope_per_s(ts: list[float], ys: list[float]) -> float:
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


async def sampler(base: str, pid: int | None, t0: float, rows: list, period: float, stop: asyncio.Event):
    async with httpx.AsyncClient(base_url=base, timeout=30.0) as client:
        while True:
            done = stop.is_set()
            t = time.monotonic() - t0
            try:
                m = parse_metrics((await client.get("/metrics")).text)
            except Exception as e:
                m = {"error": str(e)}
            rows.append(dict(t_s=round(t, 2), rss_mib=round(rss_mib(pid), 1),
                             kv_blocks_in_use=m.get("kv_blocks_in_use"), kv_blocks_total=m.get("num_kv_blocks"),
                             running=m.get("num_requests_running"), waiting=m.get("num_requests_waiting"),
                             preemptions=m.get("num_preemptions_total"), server_2xx=m.get("http_2xx"),
                             server_4xx=m.get("http_4xx"), server_5xx=m.get("http_5xx")))
            if done:
                return
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass


async def wait_idle(base: str, timeout: float) -> dict:
    """Poll /metrics until nothing runs or waits and no KV block is in use (or the timeout)."""
    end = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base, timeout=30.0) as client:
        while True:
            m = parse_metrics((await client.get("/metrics")).text)
            idle = not m.get("num_requests_running") and not m.get("num_requests_waiting")
            if (idle and m.get("kv_blocks_in_use") == 0) or time.monotonic() > end:
                return m
            await asyncio.sleep(0.5)


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation, None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def annotate(rows: list[dict], tally: Tally) -> None:
    """Add the clients' side to the sampler's rows, from the per-request records: requests sent and outcomes so
    far, and over the window since the previous row the streams' TTFT (p50 / p99, ms) and good requests
    finished per second."""
    recs = sorted(tally.records, key=lambda r: r[1])
    done_at = [r[1] for r in recs]
    prev = 0.0
    for row in rows:
        t = row["t_s"]
        done = recs[:bisect.bisect_right(done_at, t)]
        window = done[bisect.bisect_right(done_at, prev):]
        ttfts = [r[4] * 1e3 for r in window if r[2] == "stream" and r[4] is not None]
        p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
        row.update(requests_sent=sum(r[0] <= t for r in recs),
                   good_ok=sum(r[2] in GOOD and r[3] == "ok" for r in done),
                   bad_4xx=sum(r[2] in BAD and r[3] == "ok" for r in done),
                   client_failures=sum(r[3] == "fail" for r in done),
                   ttft_p50_ms=None if p50 is None else round(p50, 1), ttft_p99_ms=None if p99 is None else round(p99, 1),
                   good_per_s=round(sum(r[2] in GOOD and r[3] == "ok" for r in window) / max(t - prev, 1e-9), 2))
        prev = t

