"""The KV cache a model declares: what one page of each layer holds (vLLM v1's kv_cache_interface).

The runner never assumes a K/V pair. It asks the model for a `KVCacheSpec` and sizes, allocates,
reads, writes and copies the pool from it; the model's attention receives each layer's pages in
the spec's layout. Two layouts exist:

- `KVPages`: a K page and a V page per layer, each [page_size, kv_heads, head_dim] (GQA);
- `LatentPages`: one page per layer of [page_size, width] (MLA's compressed latent plus its rotary
  key, jengine/models/layers/mla.py).

A layer's pool is a tuple of arrays, one per component (`components`), each
[num_pages, page_size, *page_shape]. One array per layer and component, not one stacked array:
each layer's scatter then updates its own donated buffer in place (see ModelRunner).

Page `NULL_PAGE` (0) is the null page: padding rows and padded block-table entries point there.
No real request ever owns it, so a row that maps to it is a padding row: its KV write is dropped
(jengine/models/dense.py) and nothing real is ever read from it.
"""

from __future__ import annotations

from dataclasses import dataclass

NULL_PAGE = 0


@dataclass(frozen=True)
class KVPages:
    """K and V pages of [page_size, kv_heads, head_dim] each."""

    kv_heads: int
    head_dim: int
    components = ("k", "v")

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class LatentPages:
    """One page of [page_size, width]: a latent vector per position (MLA)."""

    width: int
    components = ("latent",)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.width,)


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer, what one position of the KV cache holds; all layers alike (see __post_init__)."""

    layers: tuple[KVPages | LatentPages, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("KVCacheSpec.layers is empty: a model declares one entry per layer")
        for i, layer in enumerate(self.layers):
            for name, value in vars(layer).items():
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"KVCacheSpec.layers[{i}].{name}={value!r} must be a positive "
                                     "integer")
        # The retraction image (`page_image_shape`) stacks layers into one array; layers of
        # different layouts would need a ragged image, which nothing needs yet.
        if len(set(self.layers)) != 1:
            layouts = sorted(set(map(repr, self.layers)))
            raise ValueError(f"KVCacheSpec.layers mixes page layouts {layouts}; every layer must "
                             "have the same layout")

    @property
    def layout(self) -> KVPages | LatentPages:
        return self.layers[0]

    @property
    def values_per_token(self) -> int:
        """Values one position holds across every layer and component: what a token costs in
        the pool, in elements (MLA: the latent width per layer, not the expanded heads)."""
        per_layer = len(self.layout.components)
        for n in self.layout.page_shape:
            per_layer *= n
        return per_layer * len(self.layers)

    def allocate(self, num_pages: int, page_size: int, dtype, device=None):
        """The zeroed pool: per layer, a tuple of one array per component. device: a Sharding
        to create them with (never staged whole on the default device); None = default."""
        import jax.numpy as jnp

        shape = (num_pages, page_size, *self.layout.page_shape)
        return tuple(tuple(jnp.zeros(shape, dtype, device=device) for _ in layer.components)
                     for layer in self.layers)

    def page_image_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """Shape of the host image of `num_pages` pages (ModelRunner.read_pages):
        [components, layers, pages, page_size, *page_shape]."""
        return (len(self.layout.components), len(self.layers), num_pages, page_size,
                *self.layout.page_shape)
