"""GQA attention over paged K/V: q/k/v projections (optional biases), optional per-head q/k
RMSNorm (Qwen3), RoPE, the KV write, the planned paged-attention leaf, o_proj (optional bias).

Projections fuse heads and head_dim into one head-major dimension ("heads" / "kv_heads"), so
splitting it gives every rank whole heads. The layer's KV pages arrive as its KVCacheSpec entry
lays them out (jengine/models/kv_cache.py: `KVPages`, a (k_pages, v_pages) pair).
"""

from __future__ import annotations

from flax import nnx
from jax import lax

from jengine.models.kv_cache import KVPages
from jengine.models.layers.linear import Linear, PendingProjection, linears
from jengine.models.layers.norm import RMSNorm


class Attention(nnx.Module):
    defers_projection = True  # __call__ takes pending= (see there)

    @staticmethod
    def specs(cfg, *, dtype) -> dict[str, dict]:
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        bias = bool(cfg.attention_bias)
        specs = {"q_proj": Linear.specs(h, q, ("embed", "heads"), bias=bias, dtype=dtype),
                 "k_proj": Linear.specs(h, kv, ("embed", "kv_heads"), bias=bias, dtype=dtype),
                 "v_proj": Linear.specs(h, kv, ("embed", "kv_heads"), bias=bias, dtype=dtype),
                 "o_proj": Linear.specs(q, h, ("o_heads", "o_embed"), bias=cfg.attention_output_bias,
                                        dtype=dtype)}
        if cfg.qk_norm:
            specs["q_norm"] = RMSNorm.specs(d, "head_dim", dtype=dtype)
            specs["k_norm"] = RMSNorm.specs(d, "head_dim", dtype=dtype)
        return specs

    @staticmethod
    def kv_pages(cfg) -> KVPages:
        return KVPages(kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)

    def __init__(self, cfg, specs: dict, source):
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.eps = cfg.head_dim, cfg.rms_norm_eps
        self.q_proj = Linear(specs["q_proj"], source)
        self.k_proj = Linear(specs["k_proj"], source)
        self.v_proj = Linear(specs["v_proj"], source)
        self.o_proj = Linear(specs["o_proj"], source)
        self.qk_norm = "q_norm" in specs
        if self.qk_norm:
            self.q_norm = RMSNorm(specs["q_norm"], source)
            self.k_norm = RMSNorm(specs["k_norm"], source)

    def __call__(self, kern, x, kv, *, page, slot, cos, sin, block_tables, token_req, positions,
                 dtype, tp=None, pending=False):
        """x [T, H]; kv = (k_pages, v_pages). Returns (output [T, H], the updated pages).
        pending (one device only): the output as a PendingProjection of o_proj instead, for the
        layer boundary to run (dense.py).

        Every row's K/V is written (padding rows to an out-of-bounds page, dropped) before any
        row attends: the planned rope_write leaf rotates q and k and writes the pages
        (pallas_kernels/rope_write.py).

        tp (sharding.tensor_parallel.TensorParallel, inside shard_map): q/k/v are column-parallel,
        so this rank holds whole heads (its share of them, and the matching KV pages); o_proj is
        the "o" reduction site (row-parallel, or column-parallel on hidden under
        --tp-batch-invariant attn/all). Head counts are read from the local arrays, so the same
        code runs a shard and the whole model. Under KV-head replication k/v_proj are whole here
        and only this rank's KV head is computed: its columns are sliced from the weights.
        """
        t, d = x.shape[0], self.head_dim
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if tp is not None and tp.kv_head_replicas > 1:
            head = tp.kv_head_index()
            projections = (self.q_proj, *(_head_columns(p, head, d) for p in projections[1:]))
        q, k, v = linears(kern, x, projections, out_dtype=dtype)
        hq, hkv = q.shape[-1] // d, k.shape[-1] // d
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if self.qk_norm:
            q = self.q_norm(kern, q.reshape(t * hq, d), eps=self.eps).reshape(t, hq, d)
            k = self.k_norm(kern, k.reshape(t * hkv, d), eps=self.eps).reshape(t, hkv, d)
        if kern.rope_paged is not None:  # the two leaves below as one (JENGINE_ATTENTION_ROPE)
            o, (k_pages, v_pages) = kern.rope_paged(q, k, v, cos, sin, kv, page, slot,
                                                    block_tables, token_req, positions,
                                                    scale=d ** -0.5)
        else:
            q, (k_pages, v_pages) = kern.rope_write(q, k, v, cos, sin, kv, page, slot)
            o = kern.attention(q, (k_pages, v_pages), block_tables, token_req, positions,
                               scale=d ** -0.5)
        o = o.reshape(t, hq * d)
        if pending:
            if tp is not None:
                raise ValueError("Attention: pending=True is for one device (tp=None)")
            return PendingProjection(self.o_proj, o), (k_pages, v_pages)
        return self.o_proj(kern, o, out_dtype=dtype, tp=tp, site="o"), (k_pages, v_pages)


class _Columns:
    """A projection's weight (and bias) restricted to some output columns: what `linears` reads."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


def _head_columns(proj: Linear, head, d: int) -> _Columns:
    """Columns [head * d, (head + 1) * d) of a head-major projection (head: a traced index)."""
    weight = lax.dynamic_slice_in_dim(proj.weight[...], head * d, d, axis=1)
    bias = None if proj.bias is None else lax.dynamic_slice_in_dim(proj.bias[...], head * d, d)
    return _Columns(weight, bias)
