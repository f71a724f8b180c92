"""KV block map (every physical block of the pool) and one request's block table."""
from __future__ import annotations

import math

import numpy as np

from inspector.figures.layout import _axis, _axname, _fig, _grid, _layout, _lst, empty_spec
from inspector.figures.style import (CACHED_COLOR, CATEGORY_COLORS, FREE_COLOR, N_CATS, OWNER_PALETTE, SHARED_COLOR,
                                     _discrete_colorscale, _owner_color_index, owner_color)
from inspector.recorder import kv_replicas


def _grid_shape(n: int, max_cols: int = 64) -> tuple[int, int]:
    cols = min(max_cols, max(8, 2 ** math.ceil(math.log2(max(1.0, math.sqrt(n * 2))))))
    return math.ceil(n / cols), cols


def block_states(kv: dict) -> dict:
    """Per-block state arrays and owners from a kv snapshot (`loop.kv_snapshot()`)."""
    n = int(kv["num_blocks"])
    ref = np.asarray(kv.get("ref_counts") or [0] * n, dtype=np.int64)
    cached = np.asarray(kv.get("cached") or [False] * n, dtype=bool)
    owners: list[list[str]] = [[] for _ in range(n)]
    for rid, table in (kv.get("block_tables") or {}).items():
        for b in table:
            if 0 <= b < n:
                owners[b].append(rid)
    cat = np.zeros(n, dtype=np.int64)                   # free
    cat[(ref == 0) & cached] = 1                        # cached-free
    in_use = ref > 0
    cat[ref > 1] = 2                                    # shared
    for b in np.nonzero(ref == 1)[0]:
        cat[b] = 3 + (_owner_color_index(owners[b][0]) if owners[b] else 0)
    null_free = 1 if (n and ref[0] == 0) else 0         # block 0: the reserved null block
    fill = block_fill(kv)
    return dict(n=n, ref=ref, cached=cached, owners=owners, cat=cat, fill=fill,
                reserved_slots=int(in_use.sum()) * int(kv.get("block_size", 16)), used_slots=int(fill[in_use].sum()),
                num_free=int(((ref == 0) & ~cached).sum()) - null_free,
                num_cached_free=int(((ref == 0) & cached).sum()),
                num_in_use=int(in_use.sum()), num_shared=int((ref > 1).sum()))


def block_fill(kv: dict) -> np.ndarray:
    """Slots of each physical block that hold a computed token: the most any holder has written there (a block
    shared through the prefix cache is full in every holder)."""
    n, bs = int(kv["num_blocks"]), int(kv.get("block_size", 16))
    fill = np.zeros(n, dtype=np.int64)
    computed = kv.get("num_computed_tokens") or {}
    for rid, table in (kv.get("block_tables") or {}).items():
        c = int(computed.get(rid, 0))
        for i, b in enumerate(table):
            if 0 <= b < n:
                fill[b] = max(fill[b], min(bs, max(0, c - i * bs)))
    return fill


def block_map_spec(kv: dict | None, highlight: str | None = None, height: int | None = None,
                   max_cells: int = 4096) -> dict:
    """Every physical block of the KV pool as a cell: free / cached-free / shared / owner request.
    Pools larger than `max_cells` are drawn as cells of consecutive blocks (majority state). Data-parallel
    replicas (a kv snapshot with "replicas"): a map per replica."""
    title = "KV block map"
    pools = kv_replicas(kv)
    if not pools or not all(p.get("num_blocks") for p in pools):
        return empty_spec(title, "no KV snapshot yet", height or 300, "blockmap")
    if len(pools) > 1:
        return replica_block_maps_spec(pools, highlight, height, max_cells)
    kv = pools[0]
    st = block_states(kv)
    n = st["n"]
    cells, marks, rows, cols, group = _pool_traces(kv, st, highlight, max_cells)
    data = cells + _legend() + marks
    host = kv.get("host")
    used_pct = 100.0 * st["num_in_use"] / max(1, n - 1)
    res, used = st["reserved_slots"], st["used_slots"]
    frag = f" ({100.0 * (res - used) / res:.0f}% reserved but empty)" if res else ""
    tier = ""
    if host and host.get("num_blocks"):
        swapped = host.get("block_tables") or {}
        tier = (f"<br>host tier (rows below the gap): {host['num_blocks']} blocks · "
                f"{sum(map(len, swapped.values()))} held by {len(swapped)} swapped-out requests · "
                f"{len(host.get('cached') or [])} cached (evicted prefix blocks)")
    sub = (f"{_pool_kind(kv)} · {n} blocks × "
           f"{kv.get('block_size', '?')} tokens · "
           f"{st['num_in_use']} in use ({used_pct:.0f}%) · "
           f"{st['num_shared']} shared · {st['num_cached_free']} cached-free · {max(0, st['num_free'])} free"
           f"<br>slots: {res} reserved by requests · {used} hold a token{frag}"
           + (f" · 1 cell = {group} blocks" if group > 1 else "") + " · hover a cell for owners" + tier)
    h = height or int(min(560, max(240, 110 + rows * (20 if cols <= 32 else 13))))
    lay = _layout(title, h, "blockmap", sub, margin=dict(l=10, r=10, t=70, b=10),
                  xaxis=dict(visible=False, range=[-0.5, cols - 0.5]),
                  yaxis=dict(visible=False, autorange="reversed"),
                  legend=dict(orientation="h", yanchor="top", y=-0.02, xanchor="left", x=0.0, font=dict(size=11)))
    return {"data": data, "layout": lay}


def replica_block_maps_spec(pools: list[dict], highlight: str | None = None, height: int | None = None,
                            max_cells: int = 4096) -> dict:
    """Data parallelism: each replica's KV pool (kv_replicas) as its own block map, up to four side by side."""
    n = len(pools)
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    states = [block_states(kv) for kv in pools]
    titles = [f"replica {r} · {st['num_in_use']}/{st['n'] - 1} blocks in use "
              f"({100.0 * st['num_in_use'] / max(1, st['n'] - 1):.0f}%)" for r, st in enumerate(states)]
    res, used = sum(st["reserved_slots"] for st in states), sum(st["used_slots"] for st in states)
    frag = f" ({100.0 * (res - used) / res:.0f}% reserved but empty)" if res else ""
    kv0 = pools[0]
    total = {k: sum(max(0, st[k]) for st in states)
             for k in ("num_in_use", "num_shared", "num_cached_free", "num_free")}
    sub = (f"{n} data-parallel replicas · {_pool_kind(kv0)} · {kv0['num_blocks']} blocks × "
           f"{kv0.get('block_size', '?')} tokens each · all replicas: {total['num_in_use']} in use · "
           f"{total['num_shared']} shared · {total['num_cached_free']} cached-free · {total['num_free']} free"
           f"<br>slots: {res} reserved by requests · {used} hold a token{frag} · hover a cell for owners")
    lay = _layout("KV block map", 0, "blockmap", sub, margin=dict(l=10, r=10, t=100, b=10),
                  legend=dict(orientation="h", yanchor="top", y=-0.02, xanchor="left", x=0.0, font=dict(size=11)))
    refs = _grid(lay, rows=[1.0] * nrows, cols=[1.0] * ncols, vspace=0.1, hspace=0.03, titles=titles)
    data, marks, most_rows, px = [], [], 1, 20
    for r, (kv, st) in enumerate(zip(pools, states)):
        xa, ya = refs[(r // ncols + 1, r % ncols + 1)]
        cells, hl, rows, cols, _ = _pool_traces(kv, st, highlight, max_cells, f"replica {r} · ",
                                                dict(xaxis=xa, yaxis=ya))
        data += cells
        marks += hl
        lay[_axname(xa, "x")].update(visible=False, range=[-0.5, cols - 0.5])
        lay[_axname(ya, "y")].update(visible=False, autorange="reversed")
        most_rows, px = max(most_rows, rows), min(px, 20 if cols <= 32 else 13)
    for k in range(n, nrows * ncols):               # the grid's unused cells
        xa, ya = refs[(k // ncols + 1, k % ncols + 1)]
        lay[_axname(xa, "x")].update(visible=False)
        lay[_axname(ya, "y")].update(visible=False)
    lay["height"] = height or int(min(900, max(270, 140 + nrows * (40 + most_rows * px))))
    return {"data": data + _legend() + marks, "layout": lay}


def _pool_kind(kv: dict) -> str:
    fmt = kv.get("kv_format")
    fmt = {"float8_e4m3fn": "fp8 e4m3"}.get(fmt, fmt)
    return f"{kv.get('kv_cache_layout', 'paged')}{' · ' + fmt if fmt else ''}"


def _legend() -> list[dict]:
    return [dict(type="scatter", x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                 marker=dict(symbol="square", size=12, color=color, line=dict(width=1, color="#999")))
            for name, color in (("free", FREE_COLOR), ("cached-free", CACHED_COLOR), ("shared (ref>1)", SHARED_COLOR),
                                ("in use (colour = request)", OWNER_PALETTE[0]))]


def _pool_traces(kv: dict, st: dict, highlight: str | None, max_cells: int, prefix: str = "",
                 axes: dict | None = None) -> tuple[list[dict], list[dict], int, int, int]:
    """One KV pool's cells: its heatmap (with its host tier's below) and the highlighted request's blocks.
    prefix: before every hover text; axes: the panel's {"xaxis", "yaxis"} in a grid.
    -> (cell traces, highlight traces, rows drawn, columns, blocks per cell)."""
    n = st["n"]
    group = max(1, math.ceil(n / max_cells))
    cells = math.ceil(n / group)
    rows, cols = _grid_shape(cells)
    z = np.full(rows * cols, np.nan)
    text = [""] * (rows * cols)
    cat, ref, cached, owners = st["cat"], st["ref"], st["cached"], st["owners"]
    if group == 1:
        z[:n] = cat
        for b in range(n):
            if ref[b] == 0:
                if b == 0:
                    text[b] = "block 0 · null block (reserved, never allocated)"
                    z[0] = np.nan
                else:
                    text[b] = f"block {b} · " + ("cached-free (evictable, prefix hash kept)" if cached[b] else "free")
            else:
                own = ", ".join(owners[b][:6]) + (" …" if len(owners[b]) > 6 else "")
                state = "shared" if ref[b] > 1 else "in use"
                text[b] = (f"block {b} · {state} · ref {ref[b]}{' · cached' if cached[b] else ''}"
                           f" · {st['fill'][b]}/{kv.get('block_size', '?')} slots used"
                           f"<br>owner{'s' if len(owners[b]) > 1 else ''}: {own or '?'}")
    else:
        for c in range(cells):
            lo, hi = c * group, min(n, (c + 1) * group)
            seg = cat[lo:hi]
            used = int((ref[lo:hi] > 0).sum())
            cf = int(((ref[lo:hi] == 0) & cached[lo:hi]).sum())
            if (ref[lo:hi] > 1).any():
                z[c] = 2
            elif used > (hi - lo) / 2:
                vals, counts = np.unique(seg[seg >= 3], return_counts=True)
                z[c] = vals[np.argmax(counts)] if len(vals) else 3
            else:
                z[c] = 1 if cf > (hi - lo) / 2 else 0
            text[c] = f"blocks {lo}–{hi - 1} · {used} in use · {cf} cached-free · {hi - lo - used - cf} free"
    if prefix:
        text = [prefix + t if t else t for t in text]
    axes = axes or {}
    zg = z.reshape(rows, cols)
    data = [dict(type="heatmap", z=[_lst(r) for r in zg], text=[text[r * cols:(r + 1) * cols] for r in range(rows)],
                 hovertemplate="%{text}<extra></extra>", zmin=-0.5, zmax=N_CATS - 0.5,
                 colorscale=_discrete_colorscale(CATEGORY_COLORS), showscale=False, xgap=1, ygap=1, name="blocks",
                 **axes)]
    host = kv.get("host")
    host_rows = 0
    if host and host.get("num_blocks"):
        hz, htext, host_rows = host_cells(host, cols, max_cells)
        data.append(dict(type="heatmap", z=[_lst(r) for r in hz], y0=rows + 1, dy=1,
                         text=[[prefix + t if t else t for t in htext[r * cols:(r + 1) * cols]]
                               for r in range(host_rows)],
                         hovertemplate="%{text}<extra></extra>", zmin=-0.5, zmax=N_CATS - 0.5,
                         colorscale=_discrete_colorscale(CATEGORY_COLORS), showscale=False, xgap=1, ygap=1,
                         name="host tier", **axes))
    marks = []
    if highlight and group == 1:
        blocks = (kv.get("block_tables") or {}).get(highlight) or []
        if blocks:
            marks.append(dict(type="scatter", x=[b % cols for b in blocks], y=[b // cols for b in blocks],
                              mode="markers+text", text=[str(i) for i in range(len(blocks))],
                              textfont=dict(size=8, color="#000"), name=f"{highlight} (logical index)",
                              marker=dict(symbol="square-open", size=13, color="#000", line=dict(width=2)),
                              hovertemplate="logical block %{text}<extra>" + highlight + "</extra>", **axes))
    return data, marks, rows + host_rows + (1 if host_rows else 0), cols, group


def host_cells(host: dict, cols: int, max_cells: int) -> tuple[np.ndarray, list[str], int]:
    """The host tier's blocks as cells of the block map: a swapped-out request's (its colour), cached, free."""
    n = int(host["num_blocks"])
    group = max(1, math.ceil(n / max_cells))
    cat = np.zeros(n, dtype=np.int64)
    text = [f"host block {b} · free" for b in range(n)]
    for b in host.get("cached") or []:
        cat[b] = 1
        text[b] = f"host block {b} · cached (an evicted prefix block, fetched back on a hash hit)"
    for rid, table in (host.get("block_tables") or {}).items():
        for i, b in enumerate(table):
            cat[b] = 3 + _owner_color_index(rid)
            text[b] = f"host block {b} · swapped out · {rid} logical block {i}"
    cells = math.ceil(n / group)
    z = np.full(math.ceil(cells / cols) * cols, np.nan)
    out = [""] * len(z)
    for c in range(cells):
        seg = cat[c * group:(c + 1) * group]
        z[c] = np.bincount(seg).argmax()
        out[c] = text[c * group] if group == 1 else f"host blocks {c * group}–{min(n, (c + 1) * group) - 1}"
    host_rows = len(z) // cols
    return z.reshape(host_rows, cols), out, host_rows


def block_table_spec(kv: dict | None, request_id: str | None, height: int = 200) -> dict:
    """A request's block table: logical block i -> physical block id (colour: private / cached / shared)."""
    title = "Block table"
    if not request_id:
        return empty_spec(title, "select a request to see its block table (logical → physical)", height, "blocktable")
    pools = kv_replicas(kv)
    r = next((i for i, p in enumerate(pools) if (p.get("block_tables") or {}).get(request_id)), None)
    if r is None:
        return empty_spec(f"{title}: {request_id}", "this request holds no KV blocks right now "
                          "(waiting, preempted or finished)", height, "blocktable")
    kv = pools[r]
    table = kv["block_tables"][request_id]
    if len(pools) > 1:
        title = f"{title} (replica {r})"
    ref = kv.get("ref_counts") or []
    cached = kv.get("cached") or []
    bs = kv.get("block_size", 16)
    # the leading blocks a prefix-cache hit gave it at admission (recorder adds num_cached_tokens to kv)
    n_hit = min(len(table), int(((kv.get("num_cached_tokens") or {}).get(request_id) or 0)) // bs)
    cols = min(32, len(table))
    rows = math.ceil(len(table) / cols)
    z = np.full(rows * cols, np.nan)
    text = [""] * (rows * cols)
    hover = [""] * (rows * cols)
    for i, b in enumerate(table):
        r = ref[b] if b < len(ref) else 1
        c = bool(cached[b]) if b < len(cached) else False
        z[i] = 2 if r > 1 else (1 if c else 0)
        text[i] = f"{b}*" if i < n_hit else str(b)
        hover[i] = (f"logical {i} (tokens {i * bs}–{(i + 1) * bs - 1}) → physical {b}<br>ref {r}"
                    f"{' · shared' if r > 1 else ''}{' · cached (full, hashed)' if c else ''}"
                    f"{' · from the prefix cache (hit at admission)' if i < n_hit else ''}")
    zg = z.reshape(rows, cols)
    data = [dict(type="heatmap", z=[_lst(r) for r in zg], text=[text[i * cols:(i + 1) * cols] for i in range(rows)],
                 customdata=[hover[i * cols:(i + 1) * cols] for i in range(rows)], texttemplate="%{text}",
                 hovertemplate="%{customdata}<extra></extra>", zmin=-0.5, zmax=2.5, showscale=False,
                 xgap=2, ygap=2, colorscale=_discrete_colorscale([owner_color(request_id), CACHED_COLOR, SHARED_COLOR]))]
    lay = _layout(f"{title}: {request_id}", max(height, 130 + 28 * rows), "blocktable",
                  f"{len(table)} blocks · {n_hit} from the prefix cache (*) · cell = physical block id · "
                  f"row r, column c = logical block r·{cols}+c · colours: private / cached (full, hashed) / shared",
                  xaxis=_axis(title=dict(text="logical block"), dtick=1 if cols <= 16 else 4),
                  yaxis=dict(visible=False, autorange="reversed"))
    return {"data": data, "layout": lay}


block_map_figure = _fig(block_map_spec)
block_table_figure = _fig(block_table_spec)
