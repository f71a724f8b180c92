"""Colours and fonts shared by the inspector's figures (phase, block-map, region palettes)."""
from __future__ import annotations

import zlib

PHASE_LABELS = {"frontend": "front end"}     # legend names where the phase key is not the label
PHASE_COLORS = {"frontend": "#B07AA1", "waiting": "#C7CDD6", "prefill": "#F28E2B", "decode": "#4E79A7", "preempted": "#E15759", "swapped": "#9C755F"}
# block map categories: 0 free, 1 cached-free (evictable), 2 shared (ref > 1), 3.. owner palette
OWNER_PALETTE = ["#4E79A7", "#59A14F", "#B07AA1", "#EDC948", "#76B7B2", "#FF9DA7", "#9C755F", "#F28E2B",
                 "#86BCB6", "#D37295", "#499894", "#8CD17D"]
FREE_COLOR, CACHED_COLOR, SHARED_COLOR = "#EEF0F3", "#B8E0D2", "#3D2C8D"
# data-parallel replicas' lines, by engine_index
REPLICA_COLORS = ["#E15759", "#4E79A7", "#59A14F", "#B07AA1", "#F28E2B", "#76B7B2", "#EDC948", "#9C755F"]
CATEGORY_COLORS = [FREE_COLOR, CACHED_COLOR, SHARED_COLOR] + OWNER_PALETTE
N_CATS = len(CATEGORY_COLORS)
REGION_COLORS = {"schedule": "#BAB0AC", "draft": "#D4A6C8", "prepare": "#9D7660", "embedding": "#FABFD2",
                 "attention": "#E15759", "mlp": "#4E79A7", "norms": "#76B7B2", "lm_head": "#59A14F",
                 "forward (other)": "#EDC948", "grammar mask": "#8CD17D", "sampling": "#B07AA1",
                 "postprocess": "#FF9DA7", "unaccounted": "#D7D7D7", "all_reduce": "#F28E2B", "all_gather": "#9C755F",
                 "layers": "#F1CE63"}
FONT = dict(family="Inter, system-ui, -apple-system, sans-serif", size=12, color="#222")
GRID = "#ECECEC"


def _owner_color_index(rid: str) -> int:
    return zlib.crc32(rid.encode()) % len(OWNER_PALETTE)


def owner_color(rid: str) -> str:
    return OWNER_PALETTE[_owner_color_index(rid)]


def replica_color(engine_index: int) -> str:
    return REPLICA_COLORS[engine_index % len(REPLICA_COLORS)]


def _discrete_colorscale(colors: list[str]) -> list:
    k = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / k, c], [(i + 1) / k, c]]
    return scale
