"""Tilings of the quantised kernel (`quant_matmul`) measured per device and shape.

The fastest tiling of one product depends on the device and the weight's shape more than
a rule of thumb captures, so `bench/gpu/quant_matmul.py --sweep --table FILE` times every
tiling of a model's projections at a range of row counts and writes the fastest as a
table; tables for the devices measured so far are shipped in `tuned/`, vLLM's way with its
fused-MoE configurations. `PIPPIN_QUANT_TILES` names a table to use instead.

A table (JSON): ``{"devices": [names the table is for, matched as substrings of the
device's name], "shapes": {"BITS:NxK": {"ROWS": [MT, NT, WN, WK, DEPTH], ...}}}``. A product of
m rows takes the entry of the fewest measured rows at or above m; shapes and row counts
the table lacks keep `quant_matmul.plan`'s rule.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import mlx.core as mx

from pippin import envs

TUNED = Path(__file__).parent / "tuned"

Tiles = tuple[int, int, int, int, int]  # as quant_matmul.Tiles
Table = dict[str, dict[int, Tiles]]


def device_name() -> str:
    return str(mx.device_info().get("device_name", ""))


def parse(doc: dict) -> Table:
    return {
        shape: {int(rows): (t[0], t[1], t[2], t[3], t[4]) for rows, t in by_rows.items()}
        for shape, by_rows in doc.get("shapes", {}).items()
    }


@cache
def table() -> Table:
    """This device's table: `PIPPIN_QUANT_TILES`'s, else the shipped one whose device
    names match this device's, else none."""
    chosen = envs.PIPPIN_QUANT_TILES
    if chosen:
        return parse(json.loads(Path(chosen).read_text()))
    name = device_name()
    for path in sorted(TUNED.glob("*.json")):
        doc = json.loads(path.read_text())
        if name and any(d in name for d in doc.get("devices", [])):
            return parse(doc)
    return {}


def lookup(m: int, n: int, k: int, bits: int) -> Tiles | None:
    by_rows = table().get(f"{bits}:{n}x{k}")
    if not by_rows:
        return None
    above = [r for r in by_rows if r >= m]
    return by_rows[min(above)] if above else None
