"""The Triton launches the engine makes at the Llama-3-8B widths (DeepSeek's for MLA,
Qwen3-30B-A3B's for the routed experts), for an offline compile: each as (label, kernel, argument
types, constexprs, options or tile).

scripts/triton_aot_check.py compiles them for sm_90; the GPU scripts and tests that inspect one
launch's PTX import them from here. A launch added to a leaf belongs here too, or CI never
compiles it for the GPU.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gemm_kernels():
    """(label, fn, args, consts, warps, stages) of every GEMM launch the tuned tiles make."""
    from pallas_kernels import _triton_gemm_epilogue_kernels as E
    from pallas_kernels import _triton_gemm_kernels as K
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels.fixed_order import next_pow2
    from pallas_kernels.triton_gemm_tiles import TILES

    shapes = {**{(n, k): [n] for n, k, dtype in TILES.tuned() if dtype == "bf16"},
              (6144, 4096): [4096, 1024, 1024],  # q/k/v grouped
              (28672, 4096): [14336, 14336]}  # gate/up grouped
    launches = [((n, k), members, tg.tile_for(members[0], k, "bf16"))
                for (n, k), members in shapes.items()]
    launches += [((n, k), members, tile)  # the launch shapes by M (by_m) of the same keys
                 for (n, k), members in shapes.items()
                 for _, tile in TILES.by_m.get((members[0], k, "bf16"), ())]
    # once each: a by_m rule may name the entry's own tile (64 < M <= 128 keeps it)
    launches = [launch for i, launch in enumerate(launches) if launch not in launches[:i]]
    for (n, k), members, tile in launches:
        # The serial schedule in one K loop too, for every tile with K chunks: a table may give
        # any of them flat_k (the same bits; its speed is the H200's to measure).
        flats = (False, True) if tile.k_split > 1 else (False,)
        for partial, flat in [(False, f) for f in flats] + [(True, False)]:
            out = "*fp32" if partial else "*bf16"
            common = dict(K=k, HAS_BIAS=False, IEEE_F32=False, BM=tile.block_m, BN=tile.block_n,
                          BK=tile.block_k, GROUP_M=tile.group_m, KSPLIT=tile.k_split,
                          PARTIAL=partial, FLAT_K=flat)
            label = f"N={'+'.join(map(str, members))} K={k} {tile.describe()} " + (
                "split" if partial else "serial flat-k" if flat else "serial")
            if len(members) == 1:
                args = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", M="i32", out_ptr=out)
                yield label, K.fixed_tile_gemm_kernel, args, dict(N=n, **common), tile
            else:
                n0, n1, n2 = (*members, 0)[:3]
                args = {**{p: "*bf16" for p in ("x_ptr", "w0_ptr", "w1_ptr", "w2_ptr", "b0_ptr",
                                               "b1_ptr", "b2_ptr")},
                        "M": "i32", "out0_ptr": out, "out1_ptr": out, "out2_ptr": out}
                consts = dict(N0=n0, N1=n1, N2=n2, **common,
                              EVEN_N=all(m % tile.block_n == 0 for m in members))
                # grouped_gemm_kernel's constexpr order: N0 N1 N2 K HAS_BIAS ... FLAT_K EVEN_N
                yield label, K.grouped_gemm_kernel, args, consts, tile
            if partial and tile.fused_reduce:  # the split schedule with its reduce inside
                fused = {key: v for key, v in common.items() if key not in ("PARTIAL", "FLAT_K")}
                if len(members) == 1:
                    args = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", M="i32",
                                sem_in_ptr="*i32", part_ptr="*fp32", out_ptr="*bf16",
                                sem_ptr="*i32")
                    yield (label + " fused", K.fixed_tile_gemm_fused_kernel, args,
                           dict(N=n, **fused), tile)
                    # M = 1 arrives as a constant from jax-triton (it specializes scalars of 1).
                    yield (label + " fused M=1", K.fixed_tile_gemm_fused_kernel,
                           {a: t for a, t in args.items() if a != "M"}, dict(N=n, M=1, **fused),
                           tile)
                    # ...and with the layer boundary after it (triton_gemm_add_norm.py, an
                    # experiment: o_proj / down_proj, whose N is the hidden size)
                    args = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", res_ptr="*bf16",
                                nw_ptr="*bf16", eps="fp32", M="i32", sem_in_ptr="*i32",
                                part_ptr="*fp32", h_ptr="*bf16", out_ptr="*bf16",
                                new_res_ptr="*bf16", sem_ptr="*i32")
                    block = next_pow2(n)
                    norm = dict(N=n, **fused, BLOCK=block, LOG2=block.bit_length() - 1)
                    yield label + " + add_rmsnorm", E.gemm_add_rmsnorm_kernel, args, norm, tile
                    yield (label + " + add_rmsnorm M=1", E.gemm_add_rmsnorm_kernel,
                           {a: t for a, t in args.items() if a != "M"}, dict(norm, M=1), tile)
                else:
                    args = {**{p: "*bf16" for p in ("x_ptr", "w0_ptr", "w1_ptr", "w2_ptr",
                                                   "b0_ptr", "b1_ptr", "b2_ptr")}, "M": "i32",
                            "sem_in_ptr": "*i32",
                            **{p: "*fp32" for p in ("p0_ptr", "p1_ptr", "p2_ptr")},
                            **{p: "*bf16" for p in ("out0_ptr", "out1_ptr", "out2_ptr")},
                            "sem_ptr": "*i32"}
                    consts = dict(N0=n0, N1=n1, N2=n2, **fused,
                                  EVEN_N=all(m % tile.block_n == 0 for m in members))
                    yield label + " fused", K.grouped_gemm_fused_kernel, args, consts, tile
            if partial and len(members) > 1:
                args = {**{p: "*fp32" for p in ("p0_ptr", "p1_ptr", "p2_ptr")},
                        **{p: "*bf16" for p in ("b0_ptr", "b1_ptr", "b2_ptr")}, "M": "i32",
                        **{p: "*bf16" for p in ("out0_ptr", "out1_ptr", "out2_ptr")}}
                consts = dict(N0=n0, N1=n1, N2=n2, HAS_BIAS=False, KSPLIT=tile.k_split,
                              BLOCK=tg.REDUCE_BLOCK)
                yield label + " reduce", K.grouped_reduce_kernel, args, consts, None

    # SwiGLU's gate and up with the activation in one launch (triton_gemm_swiglu.py, an
    # experiment), on every tile the table gives gate/up, and in one K loop
    swiglu = {tile for (n, k), members, tile in launches if members == [14336, 14336]}
    for tile in sorted(swiglu, key=lambda t: t.describe()):
        for flat in (False, True):
            args = dict(x_ptr="*bf16", wg_ptr="*bf16", wu_ptr="*bf16", M="i32",
                        sem_in_ptr="*i32", gate_ptr="*bf16", up_ptr="*bf16", out_ptr="*bf16",
                        sem_ptr="*i32")
            consts = dict(N=14336, K=4096, IEEE_F32=False, BM=tile.block_m, BN=tile.block_n,
                          BK=tile.block_k, GROUP_M=tile.group_m, KSPLIT=tile.k_split,
                          FLAT_K=flat)
            yield (f"N=14336 K=4096 {tile.describe()} swiglu" + (" flat-k" if flat else ""),
                   E.gemm_swiglu_kernel, args, consts, tile)

    # down_proj with SwiGLU's activation made in its A loads (scripts/gpu_silu_down.py, an
    # experiment): the decode tiles with a fused reduce, A of RB real rows up to all BM
    down = {tile for (n, k), members, tile in launches
            if members == [4096] and k == 14336 and tile.fused_reduce}
    args = dict(g_ptr="*bf16", u_ptr="*bf16", w_ptr="*bf16", M="i32", sem_in_ptr="*i32",
                part_ptr="*fp32", out_ptr="*bf16", sem_ptr="*i32")
    for tile in sorted(down, key=lambda t: t.describe()):
        for rb in sorted({1, 2, 4, 16, tile.block_m}):
            consts = dict(N=4096, K=14336, BM=tile.block_m, BN=tile.block_n, BK=tile.block_k,
                          KSPLIT=tile.k_split, RB=rb)
            yield (f"N=4096 K=14336 {tile.describe()} silu + gemm RB={rb}",
                   E.silu_gemm_rows_kernel, args, consts, tile)


def norm_kernels():
    """The layer boundary (one row per program, and each rows-per-program launch triton_norm plans)
    and the SiLU at the Llama-3-8B widths: (label, fn, args, consts, options)."""
    from pallas_kernels import _triton_kernels as K
    from pallas_kernels import triton_activation, triton_norm

    consts, warps = triton_norm._launch_params(4096)
    args = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", eps="fp32", out_ptr="*bf16",
                new_res_ptr="*bf16")
    for round_sum in (False, True):
        yield (f"add_rmsnorm H=4096 bf16 ROUND_SUM={round_sum}", K.add_rmsnorm_kernel, args,
               dict(consts, ROUND_SUM=round_sum), (warps, 1, True))
    rows_args = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", eps="fp32", M="i32",
                     out_ptr="*bf16", new_res_ptr="*bf16")
    for rows, w in sorted({(r, w) for _, r, w in triton_norm.ROWS_PLAN}):
        yield (f"add_rmsnorm rows H=4096 bf16 ROWS={rows} w{w}", K.add_rmsnorm_rows_kernel,
               rows_args, dict(consts, ROWS=rows), (w, 1, True))
    for n in (14336, 4096 * 14336):
        yield (f"silu N={n} bf16 times", K.silu_kernel,
               dict(x_ptr="*bf16", up_ptr="*bf16", out_ptr="*bf16"),
               dict(N=n, BLOCK=triton_activation.BLOCK, HAS_TIMES=True), (4, 1, True))


def _launch_options(c: dict, options: dict | None = None) -> tuple:
    """(warps, stages, fp fusion, register bound) the attention leaf launches constexprs c with
    (`options`: the leaf's launch options where it planned them)."""
    from pallas_kernels import triton_attention_plan as tap

    o = options or tap.launch_options(c)
    return o["num_warps"], o["num_stages"], o["enable_fp_fusion"], o.get("maxnreg")


def split_consts(c: dict) -> dict:
    """c with the split kernel's own constexprs: 8 splits' partials, the planned merge stages (the
    engine's launches add the same two: pallas_kernels/triton_attention.py)."""
    from pallas_kernels import triton_attention_plan as tap

    return dict(c, NSPLIT=8, MERGE_STAGES=tap.MERGE_STAGES)


def attention_kernels():
    """(label, fn, args, consts, (warps, stages, fp_fusion[, maxnreg])) of the attention leaf's two
    kernels and the rope_write leaf's, for the Llama-3-8B heads (32 q / 8 kv, D 128) and the tiny
    model's, bf16 and f32."""
    from pallas_kernels import _triton_attention_kernels as K
    from pallas_kernels import _triton_rope_write_kernels as RW
    from pallas_kernels import triton_attention_plan as tap

    for (hq, hkv, d) in ((32, 8, 128), (4, 2, 16)):
        for dtype in ("bf16", "fp32"):
            geo = tap.geometry(hq, hkv, d)
            c = dict(geo, BLOCK_N=tap.BLOCK_N, SPLIT=tap.SPLIT, IEEE=dtype == "fp32",
                     ROWSUM=0, PAGES=0)
            launch = _launch_options(c)
            inputs = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
                      "bt_ptr": "*i32", "pos_ptr": "*i32", "tiles_ptr": "*i32", "num_tiles": "i32",
                      "page_size": "i32", "table_width": "i32", "scale": "fp32"}
            label = f"attention hq={hq} hkv={hkv} D={d} {dtype}"
            yield (label + " serial", K.attention_serial_kernel,
                   dict(inputs, out_ptr=f"*{dtype}"), c, launch)
            wide = tap.widened(c, tap.WIDE_MIN_TOKENS, "serial", auto=True)
            wide_label = label + f" serial wide TPP={wide['TPP']} BLOCK_N={wide['BLOCK_N']}"
            if wide is not c:  # --numerics auto's prefill tile (triton_wide_prefill)
                yield (wide_label, K.attention_serial_kernel, dict(inputs, out_ptr=f"*{dtype}"),
                       wide, launch)
            parts = {"sem_in_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                     "part_acc_ptr": "*fp32", "out_ptr": f"*{dtype}", "sem_ptr": "*i32"}
            yield (label + " split", K.attention_split_kernel, dict(inputs, **parts),
                   split_consts(c), launch)
            # the page ids per split (16-position pages) as the leaf's "planned" form launches
            # them (stages, register bound: triton_attention_plan.paged): every launch the leaf
            # makes, labelled as the page-ids-per-tile launch + " pages" (--same-float-ops pairs
            # them so)
            def planned(consts, schedule):
                pc, options = tap.paged(consts, schedule, 16, form="planned")
                return pc, _launch_options(pc, options)
            yield (label + " serial pages", K.attention_serial_kernel,
                   dict(inputs, out_ptr=f"*{dtype}"), *planned(c, "serial"))
            if wide is not c:
                yield (wide_label + " pages", K.attention_serial_kernel,
                       dict(inputs, out_ptr=f"*{dtype}"), *planned(wide, "serial"))
            pc, options = planned(split_consts(c), "split")
            yield (label + " split pages", K.attention_split_kernel, dict(inputs, **parts),
                   pc, options)
            if hq == 32:  # the layout-free row sums (JENGINE_ATTENTION_ROWSUM=tree / dot, gpu_run.sh
                # attention_rows_<form> / attention_split_<form>) at what they launch
                for form, code in (("tree", 1), ("dot", 2)):
                    if (form, dtype) == ("tree", "fp32"):
                        continue
                    alt = dict(c, ROWSUM=code)
                    for tpp, warps in ((4, 4), (4, 1), (8, 8), (16, 4), (32, 8)):
                        yield (label + f" serial {form} TPP={tpp} w{warps}",
                               K.attention_serial_kernel, dict(inputs, out_ptr=f"*{dtype}"),
                               dict(alt, TPP=tpp), (warps, tap.NUM_STAGES, False))
                    yield (label + f" split {form}", K.attention_split_kernel,
                           dict(inputs, **parts), split_consts(alt), launch)
            if (hq, dtype) == (32, "bf16"):  # JENGINE_ATTENTION_KV_TILE=64 (gpu_run.sh
                # kvtile_ab_*): every launch it plans, on the dot sum, as the plan launches them
                kv = dict(c, BLOCK_N=64, ROWSUM=tap.ROWSUM_FORMS["dot"])
                for name, fn, schedule, consts, out in (
                        ("serial", K.attention_serial_kernel, "serial", kv, {"out_ptr": "*bf16"}),
                        (f"serial wide TPP={tap.WIDE_ROWS // kv['GP']}", K.attention_serial_kernel,
                         "serial", dict(kv, TPP=tap.WIDE_ROWS // kv["GP"]), {"out_ptr": "*bf16"}),
                        ("split", K.attention_split_kernel, "split", split_consts(kv), parts)):
                    yield (label + f" kv64 {name}", fn, dict(inputs, **out),
                           *planned(consts, schedule))
            rope = {**{p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr")},
                    "page_ptr": "*i32", "slot_ptr": "*i32", "kc_ptr": f"*{dtype}",
                    "vc_ptr": f"*{dtype}", "num_pages": "i32", "page_size": "i32",
                    **{p: f"*{dtype}" for p in ("q_out_ptr", "kc_out_ptr", "vc_out_ptr")}}
            for qkv in (False, True) if (hq, dtype) == (32, "bf16") else (False,):
                yield (f"rope_write hq={hq} hkv={hkv} D={d} {dtype}" + (" qkv" if qkv else ""),
                       RW.rope_write_kernel, rope,
                       dict(HQ=hq, HKV=hkv, HQP=hq, HKVP=hkv, D=d, QKV=qkv), (4, 1, False))
    yield from rope_attention_kernels()


def engine_split_consts(hq: int, hkv: int, d: int, dtype: str) -> tuple[dict, tuple]:
    """(constexprs, options) of the split launch as the engine plans it today, with no switch
    set (triton_attention_plan: the default KV tile and row sum, the page ids per split; the
    leaf's 16-position pages)."""
    from pallas_kernels import triton_attention_plan as tap

    ieee = dtype == "fp32"
    c = dict(tap.geometry(hq, hkv, d), BLOCK_N=tap.BLOCK_N if ieee else tap.DEFAULT_KV_TILE,
             SPLIT=tap.SPLIT, IEEE=ieee, ROWSUM=tap.ROWSUM_FORMS[tap.DEFAULT_ROWSUM], PAGES=0)
    pc, options = tap.paged(split_consts(c), "split", 16, form="planned")
    return pc, _launch_options(pc, options)


def rope_attention_kernels():
    """RoPE + the KV write inside the split launch (triton_rope_attention.py, an experiment), at
    the engine's split-launch constexprs, each after the split launch it replaces (the same
    constexprs: `rope_attention_report` compares the two): "rope_attention ... split" and
    "rope_attention ... fused" (+ " qkv": auto's merged q / k / v)."""
    from pallas_kernels import _triton_attention_kernels as K
    from pallas_kernels import _triton_rope_attention_kernels as R
    from pallas_kernels import triton_rope_attention as tra

    for (hq, hkv, d) in ((32, 8, 128), (4, 2, 16)):
        for dtype in ("bf16", "fp32"):
            consts, options = engine_split_consts(hq, hkv, d, dtype)
            label = f"rope_attention hq={hq} hkv={hkv} D={d} {dtype}"
            table = {"bt_ptr": "*i32", "pos_ptr": "*i32", "tiles_ptr": "*i32"}
            sizes = {"num_tiles": "i32", "page_size": "i32", "table_width": "i32",
                     "scale": "fp32"}
            parts = {"sem_in_ptr": "*i32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                     "part_acc_ptr": "*fp32", "out_ptr": f"*{dtype}"}
            split = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", **table,
                     **sizes, **parts, "sem_ptr": "*i32"}
            yield label + " split", K.attention_split_kernel, split, consts, options
            fused = {**{p: f"*{dtype}" for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr",
                                                 "sin_ptr")},
                     "page_ptr": "*i32", "slot_ptr": "*i32", "kc_ptr": f"*{dtype}",
                     "vc_ptr": f"*{dtype}", **table, "num_pages": "i32", **sizes, **parts,
                     "kc_out_ptr": f"*{dtype}", "vc_out_ptr": f"*{dtype}", "sem_ptr": "*i32"}
            for merged in (False, True):
                yield (label + " fused" + (" qkv" if merged else ""),
                       R.attention_rope_split_kernel, fused,
                       dict(consts, **tra.layout(hq, hkv, d, merged)), options)


def mla_attention_kernels():
    """The MLA leaf's three kernels at DeepSeek's widths (kv_lora_rank 512, rope 64; 16 and 128
    heads), bf16."""
    from pallas_kernels import _triton_mla_kernels as K
    from pallas_kernels import triton_mla_attention as tm

    launch = (tm.NUM_WARPS, tm.NUM_STAGES, False)
    for (h, r, p, dtype) in ((16, 512, 64, "bf16"), (128, 512, 64, "bf16")):
        geo = tm.geometry(h, r, p)
        c = dict(geo, BLOCK_N=tm.BLOCK_N, SPLIT=tm.SPLIT, IEEE=dtype == "fp32")
        hb = -(-h // geo["BH"])
        inputs = {"q_ptr": f"*{dtype}", "lat_ptr": f"*{dtype}", "bt_ptr": "*i32", "pos_ptr": "*i32",
                  "tiles_ptr": "*i32", "num_tiles": "i32", "page_size": "i32",
                  "table_width": "i32", "scale": "fp32"}
        label = f"mla h={h} R={r} P={p} {dtype}"
        yield label + " serial", K.mla_serial_kernel, dict(inputs, out_ptr=f"*{dtype}"), c, launch
        parts = {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32"}
        yield (label + " split", K.mla_split_kernel, dict(inputs, **parts),
               dict(c, HB=hb, NSPLIT=8), launch)
        combine = {"pos_ptr": "*i32", "tiles_ptr": "*i32", "num_tiles": "i32", **parts,
                   "out_ptr": f"*{dtype}"}
        yield (label + " combine", K.mla_combine_kernel, combine,
               dict(tm._combine_constexprs(c), HB=hb, NSPLIT=8), launch)


def moe_kernels():
    """The routed experts' grouped GEMM (pallas_kernels/triton_moe_grouped_gemm.py) at
    Qwen3-30B-A3B's widths (hidden 2048, expert width 768), bf16: gate/up and down_proj on the
    dense leaf's tile for their (N, K), each schedule that tile has, as the leaf launches them."""
    import jax.numpy as jnp

    from pallas_kernels import _triton_gemm_kernels as K
    from pallas_kernels import triton_gemm as tg
    from pallas_kernels.moe_grouped_gemm import block_rows_for
    from pallas_kernels.triton_gemm_tiles import tile_for

    shapes = ((768, 2048), (2048, 768))
    block_rows = block_rows_for(shapes, jnp.bfloat16)
    for n, k in shapes:
        tile = tile_for(n, k, jnp.bfloat16)
        for schedule in ("serial", "split") if tile.k_split > 1 else ("serial",):
            (_, consts), reduce = tg._launches(8192, k, n, jnp.bfloat16, None, tile, schedule)
            out = "*fp32" if schedule == "split" else "*bf16"
            args = dict(x_ptr="*bf16", w_ptr="*bf16", tile_expert_ptr="*i32", M="i32",
                        out_ptr=out)
            label = f"moe expert N={n} K={k} rows={block_rows} {tile.describe()} {schedule}"
            yield label, K.expert_gemm_kernel, args, dict(consts, BLOCK_ROWS=block_rows), tile
            if reduce:
                args = dict(part_ptr="*fp32", bias_ptr="*bf16", M="i32", out_ptr="*bf16")
                yield label + " reduce", K.gemm_reduce_kernel, args, reduce[1], None
