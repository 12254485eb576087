"""The Triton GEMM's tiles as data: named tables keyed by (N, K, dtype), and per-dtype defaults.

The tiles live in triton_gemm_tiles.json beside this module (shipped as package data): a set of
named tiles, tables whose entries give one of them for an exact (N, K, dtype) -- the Llama-3-8B H200
table is one table among others -- and, per dtype, rules for every other shape ("N >= min_n takes
this tile", first match wins). A tile is a function of the static (N, K, dtype) alone, never of M,
so a row's bits cannot depend on how many rows share the call.

Loading checks the file: every tile field known and typed, every name resolved, each dtype's rules
ending in one that matches any N, and no key given two different tiles by two tables (which table
wins would otherwise be an accident of file order, and so would the GPU bits).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from pallas_kernels._triton_launch import dtype_name

TILES_PATH = Path(__file__).with_name("triton_gemm_tiles.json")


@dataclass(frozen=True)
class GemmTile:
    """One fixed tiling. Never chosen from M (that would make a row's bits depend on the batch)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    k_split: int = 1  # fixed K chunks; K must be a multiple of k_split * block_k when > 1
    # Run the split schedule at every M, not only when output tiles are few. The serial schedule
    # keeps the running sum and the current chunk's accumulator live together; at k_split 4 that
    # measured 2-2.5x slower than split + reduce at M = 4096 on the H200 (docs/performance.md).
    split_at_every_m: bool = False

    def describe(self) -> str:
        split = f" k{self.k_split}" if self.k_split > 1 else ""
        always = " split-always" if self.split_at_every_m and self.k_split > 1 else ""
        return (f"BM{self.block_m}xBN{self.block_n}xBK{self.block_k} g{self.group_m} "
                f"w{self.num_warps} s{self.num_stages}{split}{always}")


class TileTableError(ValueError):
    """The tile file is malformed or two of its tables disagree."""


TileKey = tuple[int, int, str]  # (N, K, dtype name)


@dataclass(frozen=True)
class TileTables:
    """Every table's entries (name -> key -> tile) and each dtype's default rules."""

    tables: Mapping[str, Mapping[TileKey, GemmTile]]
    defaults: Mapping[str, tuple[tuple[int, GemmTile], ...]]  # dtype -> ((min_n, tile), ...)

    def tuned(self) -> dict[TileKey, GemmTile]:
        """Every (N, K, dtype) some table gives a tile for (the tables agree, see load)."""
        return {key: tile for table in self.tables.values() for key, tile in table.items()}

    def tile_for(self, n: int, k: int, dtype) -> GemmTile:
        name = dtype_name(dtype)
        for table in self.tables.values():
            if (n, k, name) in table:
                return table[(n, k, name)]
        rules = self.defaults.get(name)
        if rules is None:
            raise ValueError(f"gemm tiles: dtype={name} has no default tile (dtypes with one: "
                             f"{sorted(self.defaults)})")
        return next(tile for min_n, tile in rules if n >= min_n)  # load: the last takes any N


def _tile(name: str, spec) -> GemmTile:
    fields = {f.name: f.type for f in dataclasses.fields(GemmTile)}
    if not isinstance(spec, dict):
        raise TileTableError(f"tile {name!r} must be an object of GemmTile fields, got {spec!r}")
    values = {k: v for k, v in spec.items() if k != "note"}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TileTableError(f"tile {name!r}: unknown fields {unknown} (known: {sorted(fields)})")
    for key, value in values.items():
        want = bool if key == "split_at_every_m" else int
        if type(value) is not want:
            raise TileTableError(f"tile {name!r}: {key}={value!r} must be {want.__name__}")
    try:
        return GemmTile(**values)
    except TypeError as exc:
        raise TileTableError(f"tile {name!r}: {exc}") from None


def load(path: Path = TILES_PATH) -> TileTables:
    """Read and check a tile file (see the module docstring for the rules)."""
    doc = json.loads(Path(path).read_text())
    tiles = {name: _tile(name, spec) for name, spec in doc.get("tiles", {}).items()}

    def resolve(where: str, name) -> GemmTile:
        if name not in tiles:
            raise TileTableError(f"{where}: tile={name!r} is not one of the named tiles "
                                 f"{sorted(tiles)}")
        return tiles[name]

    tables: dict[str, dict[TileKey, GemmTile]] = {}
    origin: dict[TileKey, tuple[str, GemmTile]] = {}
    for table_name, table in doc.get("tables", {}).items():
        entries = tables[table_name] = {}
        for i, entry in enumerate(table.get("entries", [])):
            where = f"table {table_name!r} entry {i}"
            try:
                key = (int(entry["n"]), int(entry["k"]), str(entry["dtype"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise TileTableError(f"{where}: needs integer n, k and a dtype ({exc!r})") from None
            tile = resolve(where, entry.get("tile"))
            if key in entries and entries[key] != tile:
                raise TileTableError(f"{where}: (N, K, dtype)={key} is given two tiles")
            if key in origin and origin[key][1] != tile:
                first, theirs = origin[key]
                raise TileTableError(f"(N, K, dtype)={key}: table {first!r} gives "
                                     f"{theirs.describe()}, table {table_name!r} {tile.describe()}")
            origin.setdefault(key, (table_name, tile))
            entries[key] = tile

    defaults: dict[str, tuple[tuple[int, GemmTile], ...]] = {}
    for dtype, rules in doc.get("defaults", {}).items():
        where = f"defaults {dtype!r}"
        resolved = tuple((int(rule.get("min_n", 0)), resolve(where, rule.get("tile")))
                         for rule in rules)
        if not resolved or resolved[-1][0] != 0:
            raise TileTableError(f"defaults {dtype!r}: the last rule must have min_n=0 (any N)")
        defaults[dtype] = resolved
    return TileTables(tables, defaults)


TILES = load()
tile_for = TILES.tile_for
