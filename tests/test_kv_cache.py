"""The model-declared KV cache spec and the pool's page operations on it (jengine/models/kv_cache.py,
jengine/engine/kv_pool.py): byte-exact copies for either page layout."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jengine.engine.kv_pool import KVPool
from jengine.models.kv_cache import KVCacheSpec, KVPages, LatentPages

PAGE = 4


def _bytes(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("layout", [LatentPages(width=24), KVPages(kv_heads=2, head_dim=8)],
                         ids=["latent", "kv"])
def test_pages_round_trip_byte_for_byte(layout):
    spec = KVCacheSpec(layers=(layout,) * 3)
    pool = KVPool(spec, num_pages=6, page_size=PAGE, dtype=jnp.bfloat16)
    assert [len(layer) for layer in pool.arrays] == [len(layout.components)] * 3  # one array each
    assert pool.arrays[0][0].shape == (6, PAGE, *layout.page_shape)

    # Random bit patterns (subnormals, infinities and signed zeros included) survive byte for
    # byte. NaNs are left out: XLA:CPU canonicalised some NaN payloads (0x7fbf -> 0x7fc0) in this
    # write, as it did before the spec; a finite KV never holds one.
    shape = spec.page_image_shape(2, PAGE)
    bits = np.random.default_rng(0).integers(0, 1 << 16, shape, np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] &= 0xFF80  # NaN -> infinity of the same sign
    image = bits.view(jnp.bfloat16)
    pool.write([1, 3], image)
    assert np.array_equal(_bytes(pool.read([1, 3])), _bytes(image))
    assert not _bytes(pool.read([2])).any()  # untouched pages stay zero

    pool.copy([3], [5])
    assert np.array_equal(_bytes(pool.read([5])), _bytes(image[:, :, 1:2]))
    assert np.array_equal(_bytes(pool.read([1, 3])), _bytes(image))  # the source is unchanged

    with pytest.raises(ValueError, match=r"image has shape .* expected"):
        pool.write([1], image)  # two pages' image for one page


def test_spec_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match=r"layers\[0\].width=0 must be a positive integer"):
        KVCacheSpec(layers=(LatentPages(width=0),))
    with pytest.raises(ValueError, match="mixes page layouts"):
        KVCacheSpec(layers=(LatentPages(width=8), KVPages(kv_heads=1, head_dim=8)))
    with pytest.raises(ValueError, match="empty"):
        KVCacheSpec(layers=())
