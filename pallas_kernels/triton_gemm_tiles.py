"""The Triton GEMM's tiles as data: named tables keyed by (N, K, dtype), and per-dtype defaults.

The tiles live in triton_gemm_tiles.json beside this module (shipped as package data): a set of
named tiles, tables whose entries give one of them for an exact (N, K, dtype) -- the Llama-3-8B H200
table is one table among others -- and, per dtype, rules for every other shape ("N >= min_n takes
this tile", first match wins).

What a row's bits depend on, and so what may never follow M: the K schedule -- the tile's k_split
fixed K chunks, each accumulated from zero in order, the chunk sums added in order. The entry's
tile fixes it from the static (N, K, dtype) alone. The launch shape (block_m, block_n, block_k,
warps, stages) does not reach the bits: the MMA steps K 16 at a time whatever the tile, and on the
H200 every launch shape tried with the same k_split gave 0 differing f32 outputs at M = 1..200 while
twice the chunks changed thousands (scripts/gpu_gemm_decode_tiles.py, docs/gpu-validation.md). So
a bf16 entry may name `by_m` launch shapes for small M (decode steps stream weights: smaller
tiles, more programs), each keeping the entry's k_split; loading refuses one that does not.

Loading checks the file: every tile field known and typed, every name resolved, each dtype's rules
ending in one that matches any N, no key given two different tiles by two tables (which table
wins would otherwise be an accident of file order, and so would the GPU bits), and by_m tiles on
the entry's K schedule, in increasing max_m.
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
    """One tiling. Its k_split is the K schedule (the bits); the rest is the launch shape."""

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
    # The split schedule's reduce inside the GEMM launch (the last program of a tile adds its
    # chunks, in the same order): one launch instead of two, for decode steps where a launch's
    # host and device overhead is a share of the step.
    fused_reduce: bool = False
    # The serial schedule walks every chunk in one K loop, closing a chunk into the running sum
    # when it ends (the same operations, so the same bits), instead of one loop per chunk: one
    # software pipeline over the whole of K, and no chunk-boundary drain.
    flat_k: bool = False
    # A group's members (q/k/v, gate/up) that share this tile run as one grouped launch; False
    # launches each alone on it (the same tile body, so the same bits), for a tile whose grouped
    # form measured slower than its members' launches added up.
    grouped: bool = True

    def describe(self) -> str:
        split = f" k{self.k_split}" if self.k_split > 1 else ""
        always = " split-always" if self.split_at_every_m and self.k_split > 1 else ""
        fused = " fused" if self.fused_reduce and self.k_split > 1 else ""
        flat = " flat-k" if self.flat_k and self.k_split > 1 else ""
        alone = "" if self.grouped else " ungrouped"
        return (f"BM{self.block_m}xBN{self.block_n}xBK{self.block_k} g{self.group_m} "
                f"w{self.num_warps} s{self.num_stages}{split}{always}{fused}{flat}{alone}")


class TileTableError(ValueError):
    """The tile file is malformed or two of its tables disagree."""


TileKey = tuple[int, int, str]  # (N, K, dtype name)


@dataclass(frozen=True)
class TileTables:
    """Every table's entries (name -> key -> tile) and each dtype's default rules."""

    tables: Mapping[str, Mapping[TileKey, GemmTile]]
    defaults: Mapping[str, tuple[tuple[int, GemmTile], ...]]  # dtype -> ((min_n, tile), ...)
    # key -> ((max_m, launch shape), ...), increasing max_m; each on the key's tile's k_split
    by_m: Mapping[TileKey, tuple[tuple[int, GemmTile], ...]] = dataclasses.field(
        default_factory=dict)

    def tuned(self) -> dict[TileKey, GemmTile]:
        """Every (N, K, dtype) some table gives a tile for (the tables agree, see load)."""
        return {key: tile for table in self.tables.values() for key, tile in table.items()}

    def tile_for(self, n: int, k: int, dtype, m: int | None = None) -> GemmTile:
        """The tile of x[M, K] @ w[K, N]. Without m, or past every by_m rule, the entry's own
        tile; its k_split is the same whatever m is (load checks), so the bits are too."""
        name = dtype_name(dtype)
        if m is not None:
            for max_m, tile in self.by_m.get((n, k, name), ()):
                if m <= max_m:
                    return tile
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
        want = bool if fields[key] == "bool" else int  # the field's declared type
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
    by_m: dict[TileKey, tuple[tuple[int, GemmTile], ...]] = {}
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
            rules = _by_m(where, entry.get("by_m", []), key, tile, resolve)
            if key in by_m and by_m[key] != rules:
                raise TileTableError(f"{where}: (N, K, dtype)={key} is given two by_m lists")
            if rules:
                by_m[key] = rules

    defaults: dict[str, tuple[tuple[int, GemmTile], ...]] = {}
    for dtype, rules in doc.get("defaults", {}).items():
        where = f"defaults {dtype!r}"
        resolved = tuple((int(rule.get("min_n", 0)), resolve(where, rule.get("tile")))
                         for rule in rules)
        if not resolved or resolved[-1][0] != 0:
            raise TileTableError(f"defaults {dtype!r}: the last rule must have min_n=0 (any N)")
        defaults[dtype] = resolved
    return TileTables(tables, defaults, by_m)


def _by_m(where: str, rules, key: TileKey, tile: GemmTile, resolve):
    """An entry's by_m list: [{"max_m": int, "tile": name}, ...] -> ((max_m, tile), ...)."""
    if not isinstance(rules, list):
        raise TileTableError(f"{where}: by_m={rules!r} must be a list of {{max_m, tile}}")
    out, last = [], 0
    for j, rule in enumerate(rules):
        at = f"{where} by_m {j}"
        max_m = rule.get("max_m") if isinstance(rule, dict) else None
        if type(max_m) is not int or max_m <= last:
            raise TileTableError(f"{at}: max_m={max_m!r} must be an int above {last} "
                                 "(rules in increasing max_m)")
        shape = resolve(at, rule.get("tile"))
        if key[2] != "bf16":
            raise TileTableError(f"{at}: by_m is measured for bf16 only, not dtype={key[2]}")
        if shape.k_split != tile.k_split:
            raise TileTableError(
                f"{at}: tile={rule.get('tile')!r} has k_split={shape.k_split}, the entry's tile "
                f"k_split={tile.k_split}: the K chunks are the bits, so they may not follow M")
        out.append((max_m, shape))
        last = max_m
    return tuple(out)


TILES = load()
tile_for = TILES.tile_for
