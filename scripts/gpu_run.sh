#!/usr/bin/env bash
# One device call on the GPU machine, made of named steps, each under its own time limit; a table
# of step results is written last. Carry .whl (jax-triton) and, optionally, .gpu_tiny (a copy of
# ~/.cache/jengine holding the tiny model, so it is not regenerated there).
#   bash scripts/gpu_run.sh "$OUT" attention harness harness_auto profile bench_decode
# Everything a step writes comes back in $OUT/results.tar.gz (and summary.md).
# Steps:
#   attention      scripts/gpu_attention.py: Triton attention bits, accuracy, per-layer timings
#   attention_timing  the same, timings only
#   cmdbuf_ab      decode bs 1 / 64 (both numerics) with XLA's default command buffers (CUDA
#                  graphs) and with them off (--xla_gpu_enable_command_buffer=): blocked,
#                  pipelined and dispatch ms
#   bench_model_rl_decode  rl-bitwise decode rows (bs 1 / 64, ctx 1024) only; with _noby_m the same
#                  with the tile file's by_m launch shapes taken out (restored after); with
#                  _nofuse with its tiles' fused_reduce switched off
#   profile_bs1_rl the rl-bitwise half of profile_bs1
#   gemm_decode_tiles scripts/gpu_gemm_decode_tiles.py: other Triton GEMM tiles with the contract
#                  tile's K schedule at decode M: bits vs the contract tile, device µs per GEMM
#   gemm_decode_tiles_big_m  the by_m picks vs the entry's tile at M = 64 / 128 / 256 (timings)
#   bench_model_decode  roofline + decode rows bs 1 / 64 of both numerics, 30 iterations
#   gemm_prefill_tiles  the same script at prefill M (1024 / 4096): launch shapes and schedules
#                  (serial, split, fused) on the entries' K chunks, and XLA's dot, timings only
#   gemm_mid_m_tiles  the same script at M = 128 / 256 (decode bs 128 / 256, where the table has no
#                  by_m rule): launch shapes and schedules on the entries' K chunks, XLA's dot; timings
#   gemm_gateup_prefill_tiles  the same script on gate/up's grouped launch at 4096 rows: launch
#                  shapes on its K chunks (bits at 1024 rows), XLA's dot; the prefill's largest GEMM
#   gemm_persistent  scripts/gpu_gemm_persistent.py: one program per SM over output tiles, the contract's
#                  K chunks closed in order in one flat loop (no split partials), and the engine's
#                  own flat_k serial schedule (one program per tile) at four launch shapes: bits vs
#                  the engine's launch, ms vs it and cuBLAS at M = 1024 / 4096 (rl-bitwise's
#                  prefill lead; not run yet)
#   gemm_add_norm  scripts/gpu_gemm_add_norm.py: o_proj / down_proj with the layer boundary's add +
#                  norm in the same launch (an experiment): bits vs the two launches it replaces
#                  and JAX vs torch, µs per layer of each at M = 1..64 (CUDA graph of 32 layers;
#                  not run yet)
#   gemm_swiglu    scripts/gpu_gemm_swiglu.py: gate/up with SwiGLU's activation in the same launch (an
#                  experiment): bits vs the grouped GEMM + SiLU and JAX vs torch, µs per layer at
#                  M = 1..4096 for three launch shapes (the one-program form ran in the eighteenth
#                  session; the pair form not yet)
#   launch_forms   scripts/gpu_launch_gaps.py: one kernel chained 256 times in a CUDA graph, with 2
#                  arguments, with 20, and counting its programs with last_to_arrive (µs a launch;
#                  run twice: launch_forms, launch_forms_2); also the release / relaxed counts and
#                  the same add as XLA's own kernel (launch_forms_nopdl: with XLA's PDL off)
#   pdl_check      scripts/gpu_pdl_check.py: XLA's PDL default on this jaxlib; griddepcontrol in the
#                  PTX of a jitted chain under auto (XLA's default) and rl-bitwise (pinned off)
#   pdl_ab         decode bs 1 / 64: auto with PDL (XLA's default) and without (XLA_FLAGS), then
#                  rl-bitwise with its pin and without (the pin edited out of jengine/numerics.py)
#   silu_down      scripts/gpu_silu_down.py: down_proj with SwiGLU's activation made in the loads
#                  of its A (an experiment): bits vs the SiLU launch + down_proj, µs per layer
#   gemm_prefill_warps  the wide prefill tile on 8 warps (today's, which spills) and on 16: bits, ms
#   gemm_prefill_members  the grouped prefill launches against their members alone, 4096 rows (µs)
#   group_members  scripts/gpu_group_members.py: a group's one launch against its members alone on
#                  the same tile, by M: bits, µs (ran: the wide tiles are ungrouped since)
#   engine_ffi_ab_rl  rl-bitwise's Engine workload (overlap on and off, loop overhead) with the
#                  legacy custom call, then the FFI one
#   triton_call_ab_rl  rl-bitwise decode rows with jax-triton's legacy custom call, then the FFI
#                  one (JENGINE_TRITON_CALL=ffi: the step one CUDA graph)
#   triton_layers_ab  decode bs 1 / 64: rl-bitwise on the legacy call, on JENGINE_TRITON_CALL=layers
#                  (a CUDA graph a layer: attention launches legacy, the rest FFI) and on FFI; auto
#                  on legacy and layers
#   engine_layers_ab_rl  rl-bitwise's Engine workload on the legacy call, then on "layers" (the
#                  default since the thirty-eighth session); engine_layers_ab_auto the same for auto
#   layers_flags_ab  rl-bitwise decode bs 1 / 64 on legacy, layers, and layers with two XLA flags
#                  that may cut the host's command-buffer updates (trace cache 64, exclusive lock)
#   goldens_check_layers  goldens_check with JENGINE_TRITON_CALL=layers (same PTX: same bits)
#   gemm_decode_tiles2  timings only, per shape, of launch shapes around the table's by_m picks
#   merge_stages_ab  both modes' bs 1 and 16 x 8k rows with the split launch's merge pipelined
#                  by Triton (MERGE_STAGES 4), without (0: the plain loop; the 2026-12-06 run's 0
#                  was the hand-written load ahead, removed since), with 4 again
#   auto_gate_up_ab  auto's decode rows (bs 1 / 16 / 64 / 256) as planned (xla_gate_up_triton: gate/up
#                  at <= 64 rows on the Triton grouped launch) and with XLA's dots only (xla_native)
#   auto_gemm_plan_ab  auto's decode rows (bs 1 / 64 / 256) with rl-bitwise's Triton GEMM leaves planned
#                  instead of XLA's dots (gpu_plan_ab.py --without), between two planned runs
#   attention_split_auto  today's split launch at SPLIT 64 / 128 / 256, page ids per split (auto's
#                  lever; run 2026-12-06, H100: only bs 1 x 1024 gains, not kept)
#   attention_split scripts/gpu_attention_split.py: the split attention schedule (bs 1 / 16
#                  decode) at other num_warps / num_stages: bits vs today, µs per layer
#   attention_serial  the same script's --serial: the serial schedule (64 / 256 decode rows, a
#                  4096-token prefill) at other num_warps / num_stages: bits vs today, µs per layer
#   attention_rows scripts/gpu_attention_rows.py: does the attention leaf's query tile (ROWS = 16
#                  today) change any bit at 32 / 64 / 128 rows, and what it buys for prefill
#   attention_rows_warps  the same at launches (ROWS, warps) that keep ROWS / warps fixed: against
#                  today's ROWS 16 w4 and against ROWS 16 on one warp (--ref 4,1,2)
#   prefill_flat_ab  rl-bitwise's 4096-token prefill and bs 256 decode (where only gate/up runs an
#                  entry tile) today, then with the tile file's entry tiles on the flat-K serial
#                  schedule (flat_k on, split_at_every_m off; restored after) (run 2026-12-05: 192.0 -> 173.5 ms; adopted, so the edit is now a no-op)
#   goldens_check_flat  the H200 goldens with that tile file edit: every bit must be unchanged
#   epilogues_ab   rl-bitwise's model rows (decode bs 1 / 16 / 64, ctx 1024, the 4096-token prefill)
#                  today, then with the experimental fused leaves planned: add_norm alone, then
#                  add_norm,swiglu (JENGINE_GEMM_EPILOGUES: o_proj / down_proj with the boundary's
#                  add + norm, gate/up with SwiGLU; bench.json's "kernels" names them) (run 2026-12-05: neither pays)
#   goldens_check_epilogues  the H200 goldens with those leaves planned: every bit must be unchanged
#   swiglu_ab      rl-bitwise's model rows (bs 1 / 16 / 64 / 256, the 4096-token prefill) today, then
#                  with JENGINE_GEMM_EPILOGUES=swiglu: since the twenty-fifth session its launch is
#                  the grouped gate/up launch's programs, the second of each pair applying the
#                  activation (no SiLU launch); goldens_check_swiglu its bits (every bit unchanged
#                  expected); gemm_swiglu the launch alone (run 2026-12-05 on an H100: bs 1 +2.8 %,
#                  prefill +2.5 %; not kept)
#   model_auto     auto's model rows (decode bs 1 / 64 / 256, ctx 1024, the 4096-token prefill), 20
#                  iterations (the eighteenth session's change: auto's GEMMs without a bias write bf16
#                  themselves; A/B: `before_model_auto model_auto` with .ab_before at 34c151a)
#   model_auto_unmerged  the same with XLA's dot merger off (--xla_disable_hlo_passes=dot-merger): it
#                  joins q/k/v (three dots of one x) into one dot of concatenated weights -- the
#                  4096-token prefill profile shows the weights concatenated (32 x 27.7 us) and the
#                  output sliced (~1.3 ms) every step, decode bs 256 a 0.81 ms concatenate
#   profile_auto_unmerged  profile_bs1 and profile_prefill of auto with the merger off
#   profile_bs1_rl_epilogues  profile_bs1_rl with them (kernels per layer, device ms)
#   attention_auto_tiles  --numerics auto's prefill attention (triton_wide_prefill: ROWS 64 w4 s2,
#                  BLOCK_N 32, SPLIT 256 then, ~29-68 TFLOP/s; BLOCK_N 64 since the twentieth
#                  session, from this step's result) on wider KV tiles / fewer splits /
#                  8 warps (auto has no bit contract: each launch's error vs f32 is the check; the
#                  sm_90 compile: ROWS 64 on 8 warps at BLOCK_N 64 / 128 spills nothing, today's
#                  launch 12 bytes) (run 2026-12-05)
#   The attention's row sums (JENGINE_ATTENTION_ROWSUM; <form> below is triton, Triton's tl.sum,
#   or one of the layout-free tree / dot -- another numerics definition each):
#   attention_rows_<form>  (ROWS, warps) from both of today's bit classes against ROWS 16 w4, every
#                  launch on that sum -- 0 rows differing makes the wide tile free for rl-bitwise
#                  (tree, 2026-12-05: one class) -- and ms per layer
#   attention_split_<form> / attention_serial_<form>  the decode schedules (split: bs 1 / 16;
#                  serial: 64 / 256 rows) on that sum, warps / stages swept (µs, rows vs the
#                  engine's launch and vs the serial leaf); the split steps also time SPLIT 128 / 64
#   attention_split_quick_<form>  the split schedule's engine launch alone on that sum (µs)
#   attention_rows_dot_splits  the prefill launches on the dot sum at SPLIT 128 / 64, BLOCK_N 64
#                  (ms, error vs f32); attention_tiles_dot the decode schedules so (µs)
#   rowsum_ab_<form>  rl-bitwise's model rows (decode bs 1 / 64 / 256, ctx 1024, the 4096-token
#                  prefill) on that sum (tree / dot: with the wide tile for its prefill steps)
#   accept_llama_<form>  accept_llama on that sum (tree / dot): the trainer's twin runs whole
#                  sequences on the wide tile, the engine decodes on the narrow one, so MATCH
#                  means the layout no longer reaches the bits; harness_prod_llama_<form> after it
#   goldens_record_dot  goldens.py record on the dot sum ($out/h200_dot.json)
#   The KV tile (JENGINE_ATTENTION_KV_TILE=64: every bf16 launch, engine and twin, on 64-position KV
#   tiles -- another numerics definition; auto's wide tile already reads 64):
#   kvtile_ab_rl / kvtile_ab_auto  that mode's model rows (bs 1 / 64 / 256, ctx 1024, the
#                  4096-token prefill) on 32- then 64-position tiles, one machine (the launches
#                  alone: attention_tiles_dot, attention_rows_dot_splits)
#   accept_llama_kv64, harness_prod_llama_kv64, goldens_record_kv64  alignment MATCH, the
#                  production harness and the goldens ($out/h200_kv64.json) on 64
#                  (kvtile_ab ran 2026-12-05 on an H100: prefill 1.12x -> 1.10x auto, decode
#                  unchanged; these three ran 2026-12-06 on the H200, and 64 became the default)
#   goldens_check_kv32  the goldens with JENGINE_ATTENTION_KV_TILE=32 set (tests/goldens/
#                  h200_kv32.json, the definition before)
#   maxnreg_ab     both modes' decode rows (bs 64 / 256, where the narrow serial launch runs) with
#                  its register bound (PAGES_MAXNREG 128, as planned), then unbounded (the plan
#                  file edited, restored after); timings only: a bound moves no float op
#   auto_leaves_ab  auto's model rows (decode bs 1 / 64 / 256, the 4096-token prefill) as planned,
#                  then without the RoPE + KV write on the merged q/k/v output (attention.rope_write.
#                  triton_fused_qkv); timings only (auto has no bit contract)
#   The page ids per split (JENGINE_ATTENTION_PAGES: "planned", the default since the twenty-third
#   session, "tile" the older form, "split" every launch; the same bits every way: each split's
#   page ids loaded once so the tiles' K/V copies run a tile ahead, on 3 stages):
#   attention_pages_ab  every decode / prefill launch with its page ids per tile and per split:
#                  rows differing (0 expected) and µs of each (scripts/gpu_attention_split.py
#                  --pages-ab; split: bs 1 / 16, also at SPLIT 128 / 64 (auto's lever); serial:
#                  64 / 256 rows and a 4096-token prefill, the narrow tile (also under Triton's
#                  maxnreg 128, as planned), rl-bitwise's wide tile (TPP 16, BLOCK_N 32) and auto's
#                  (BLOCK_N 64))
#   pages_crash    auto's wide tile at SPLIT 512 with the page ids per split (an illegal memory
#                  access on the H200 and the H100 until the page window's index was clamped,
#                  thirty-fifth session): each config in its own process, CUDA_LAUNCH_BLOCKING=1
#                  and TRITON_DEBUG=1 (the page window's device asserts); then compute-sanitizer's
#                  memcheck where the machine has it
#   pages_clamp_ab both modes' decode rows as in main (the clamp), then without it (the "before")
#   pages_memcheck compute-sanitizer's memcheck on an engine launch (the kv64 wide serial tile: its
#                  page window ends where its shared memory does, and the pipelined loop gathers
#                  the tile after a split's last), as in main (0 invalid reads expected), then
#                  without the clamp (the negative control: invalid shared reads expected)
#   pages_ab_auto / pages_ab_rl  a mode's model rows (decode bs 1 / 64 / 256, the 4096-token
#                  prefill) with the page ids per tile and as planned, in one call
#   goldens_check_pages  the H200 goldens with the page ids per split in every launch
#   attention_one_warp  the split and serial schedules' decode rows at 1 warp (µs, bits vs today)
#   attention_tpp16  the same with 16 tokens per program (ROWS 64 on 4 warps) at every step
#   mla_digest     scripts/gpu_mla_digest.py: SHA-256 of the Triton MLA leaf's output bits on fixed
#                  inputs, from the tree in the current directory (run it in two trees to compare)
#   mla_attention  scripts/gpu_mla_attention.py: the Triton MLA leaf at DeepSeek widths (R 512,
#                  rope 64, 16/128 heads, ctx 1k/4k, bf16): paged == dense-causal, decode ==
#                  prefill, chunked, bs-64 packing, JAX == torch launch, the GPU plans; decode
#                  timings (bs 64) vs the portable and xla_native leaves -> mla_attention.md
#   silu           scripts/gpu_validate.py --only silu: the SiLU leaf and its SwiGLU form (times up)
#                  across M, torch launch (for times: the SiLU, then torch's multiply) == JAX launch
#   sumexp         scripts/gpu_validate.py --only block_sumexp: block partials across M, torch
#                  launch == JAX launch, vocabularies that are not whole blocks (last completed)
#   gemm           scripts/gpu_validate.py --only gemm: GEMM rows across M (split and serial
#                  schedules), torch launch == JAX launch, error vs float64
#   harness        jengine invariance --numerics rl-bitwise (tiny model, Triton leaves planned)
#   harness_auto   the same under --numerics auto (the negative control: must diverge)
#   refuse_f32     an f32 launch under rl-bitwise on the GPU must be refused (rc != 0, the reason)
#   profile        scripts/gpu_profile_step.py, auto and rl-bitwise, decode bs 64 ctx 1024
#   profile_bs1    the same at batch 1 (profile_bs256: at batch 256; profile_prefill: one
#                  4096-token prefill chunk, both modes)
#   profile_cmdbuf the profile with XLA command buffers for custom calls (an experiment)
#   bench_model_bs256  the decode bs 256 row alone, both modes (the rl-bitwise / auto ratio there)
#   bench_decode   jengine bench --parts roofline model (decode bs 1/16/64/256 + 8k, prefill 4096)
#   bench_final    roofline + decode/prefill rows + the HF peer in one run (the targets table)
#   bench_model    roofline + decode bs 1 / 64 / 256 (blocked on and pipelined) + prefill, 20
#                  iterations, both numerics, no HF (the step goals of issue #19 in ~5 minutes)
#   bench_model_rl the model rows of rl-bitwise alone (an A/B against another tree in one call)
#   before_<step>  <step> run by the tree in .ab_before (an A/B's "before" on the same machine:
#                  `rm -rf .ab_before && mkdir .ab_before && git archive REV | tar -x -C .ab_before`,
#                  carry .ab_before); its table and archive in $out/before_<step>.
#   other_<step>   the same with .ab_other (a third tree)
#   bench_leaves   jengine bench --parts roofline leaves (GEMM leaves per shape and M)
#   sweep_prefill  GEMM tiles with k_split for q/o and down_proj at M = 1, 64, 4096 (prefill leads)
#   sweep_split    the same with the split schedule forced at every M (large-M leads)
#   bench_engine   the end-to-end Engine workload, auto and rl-bitwise, overlap on and off, and
#                  the loop overhead at bs 64
#   bench_engine_rl  bench_engine for rl-bitwise alone (~190 s); bench_engine_auto for auto
#   bench_e2e_auto the engine and server parts for auto in one run (no loop-overhead rows): the
#                  server's ratio to the Engine, and where each run's time went (loop phases
#                  summed over the run, the server's CPU per thread, the clients' CPU), ~300 s
#   bench_e2e_holdN  bench_e2e_auto with --output-hold-ms N (0: the output processor delivers at
#                  once, not in the engine thread's device wait: jengine/engine/host_gate.py), ~200 s
#   bench_engine_nocmdbuf  bench_engine with XLA's command buffers (CUDA graphs, on by default
#                  over fusions, cuBLAS, cuDNN and custom calls) off: on the H200 the loop's host
#                  then blocks in dispatch on a full launch queue (docs/performance.md)
#   plan_ab_attention  auto's decode / prefill rows with the Triton attention and with XLA's paged
#                  attention (scripts/gpu_plan_ab.py unregisters the Triton leaf): does a step in
#                  one CUDA graph beat the faster kernel? (_xla_attention_only: the second half)
#   triton_call_ab decode bs 1 / 64 (both numerics) with the Triton leaves called through
#                  jax-triton's legacy custom call (the default), then through jaxlib's
#                  command-buffer-compatible FFI target (JENGINE_TRITON_CALL=ffi): blocked, pipelined, dispatch
#   cmdbuf_modes   every --xla_gpu_command_buffer_update_mode this jaxlib accepts: the decode
#                  rows (dispatch column) under each (scripts/gpu_cmdbuf_modes.sh)
#   bench_server   256 streaming /generate clients against a server process, auto and rl-bitwise
#   bench_server_auto  the same for auto alone (~120 s; its ratio needs an engine row: --merge).
#                  Both server steps need the server's wheels in .whl (fastapi, uvicorn, starlette,
#                  pydantic and pydantic-core for cp312, annotated-types, typing-inspection,
#                  and for fastapi >= 0.16x opentelemetry-api and annotated-doc):
#                  the image has none of them (docs/gpu-validation.md, 2026-12-01)
#   server_diag    two server runs for auto (~110 s each): the clients unstreamed (--server-stream
#                  off: what the per-token events cost), and the server's GIL switch interval at
#                  0.1 ms instead of 0.5 ms (is the engine thread waiting for the GIL?)
#   bench_hf       the HF transformers generate peer
#   bench_moe      issue 8's MoE shape (Qwen3-30B-A3B, random bf16 weights, 61 GB): roofline +
#                  decode bs 1 / 64 (ctx 1024) + a 4096-token prefill, both numerics: times, the
#                  rl-bitwise / auto ratio, % of the HBM bound of the experts the rows routed to.
#                  auto runs the experts as one XLA einsum over all of them (portable),
#                  rl-bitwise the routed pairs only: which is faster where is what it answers
#   bench_moe_short  the same rows on the shape's first 8 of 48 layers (--layers 8): the whole
#                  shape's model parts printed nothing in 240 s each on an H100 (forty-third
#                  session); the parts now say when the model is built and each step compiled
#   bench_moe_probe  bs 1 only on those 8 layers, both numerics, no roofline or prefill (~3 min at
#                  most): how long building and compiling take, and the einsum (auto) against the
#                  routed pairs (rl-bitwise) at one row
#   moe_compile    scripts/gpu_moe_compile.py: that first bs 1 decode call phase by phase (weights,
#                  trace + lower, XLA's compile, first and second run), auto, auto without XLA's
#                  GEMM autotuner, rl-bitwise, 2 then 4 layers, 80 s each at most
#                  (bench_moe_probe's first steps had not returned after 83 s on 8 layers)
#   bench_moe_hf   the HF transformers generate peer of that shape (Qwen3MoeForCausalLM), bs 16
#   router_topk    scripts/gpu_router_topk.py: the (moe, router_topk) torch leaf vs live torch.topk
#                  (ids and value bits; random, tied, cutoff-tied, near-tied; alone vs packed)
#   router_topk_mid / router_topk_big  the same over E 64, 160 / E 256 at k 6, 8, 12, 16, 33, 50
#                  (router_topk_full, every E and k at once, is longer than a step may run)
#   grouped_gemm   scripts/gpu_grouped_gemm.py: the (moe, grouped_gemm) Triton leaf's routed rows vs
#                  the dense Triton gemm at Qwen3-30B-A3B widths (E 128, top-8, T 1..4096; random
#                  and skewed routings; a shifted-map control), torch == JAX launch, and one
#                  layer's experts routed vs dense (ms medians); last line: a JSON summary
#   grouped_gemm_quick  the same at T 1, 64 (bits) and 1..4096 (timing), 5 iterations
#   grouped_gemm_timing the timings alone (routed vs dense, T 1 / 64 / 1024 / 4096), progress per
#                  phase and a stack dump at 150 s
#   router_grouped scripts/gpu_router_grouped.py: the (moe, router_grouped_topk) torch leaf vs HF's
#                  live DeepseekV3TopkRouter on CUDA (ids in slot order, weight bits; random, tied,
#                  group-tied, near-tied; E 16/64/256, groups 1/4/8, norm on/off)
#   align_<Arch>   scripts/gpu_align.sh for one family, e.g. align_LlamaForCausalLM
#   accept_<case>  scripts/gpu_acceptance.py for one case (llama, llama31, qwen3, qwen2): trainer
#                  alignment at production widths, four logprob forms, stock-torch control
#   accept_qwen3moe  the same for Qwen3-MoE at Qwen3-30B-A3B's widths (64 experts, top-8, 2 layers,
#                  sequences of 1100 and 2048 tokens), under 5 minutes
#   accept_deepseek_v3 / accept_longcat  the same for DeepSeek-V3 (hidden 2048, kv_lora 512, 64 experts
#                  in groups, a shared expert) and LongCat-Flash (zero experts, LoRA scales) at
#                  64, 1100 and 2048 tokens, under 5 minutes each
#   acceptance     all five cases (longer than one device call allows: use accept_<case> steps)
#   goldens_record scripts/goldens.py record: tiny, families and production-width goldens on the
#                  GPU (ids + logprob bits, trainer dumps on CUDA) -> $out/h200.json
#   goldens_check  scripts/goldens.py check tests/goldens/h200.json: every bit unchanged
#   rope_attention scripts/gpu_rope_attention.py: RoPE + KV write in the split launch (planned by
#                  default at <= 16 rows, 2048 positions): bits vs the two launches (a fusion-on control must
#                  diverge), device µs one vs two
#   rope_attention_ab  auto's and rl-bitwise's decode rows (bs 1 / 16) with JENGINE_ATTENTION_ROPE=off
#                  and then as planned; rope_attention_ab_long: bs 16 x ctx 8192 with the two
#                  launches and with the fused one forced past FUSED_MAX_POSITIONS;
#                  goldens_check_rope_off: the goldens without it
#   group_alone_ab rl-bitwise's 4096-token prefill today, with q/k/v launched member by member on
#                  the wide prefill tile (its `grouped` false), and with gate/up alone on a 128 x 256
#                  tile of its own K chunks too; goldens_check_alone: the goldens with both edits
#   goldens_check_ffi  the same with the Triton leaves called through jaxlib's FFI target
#                  (JENGINE_TRITON_CALL=ffi; the step in one CUDA graph)
#   rl_loop_prod   examples/rl_loop.py on a Llama-3-8B-width 2-layer random checkpoint: rollouts from
#                  a real rl-bitwise server, the trainer on CUDA under trainer mode, weights pushed
#                  back over /update_weights_from_tensor; then scripts/memory_release_check.py on
#                  the same checkpoint (device bytes_in_use across release/resume, bits after),
#                  and scripts/gpu_weight_update.py (in-process from CUDA tensors via DLPack, and
#                  from disk: the updated engine == a fresh engine on the new weights, bitwise)
#   rl_loop_only   rl_loop_prod without the memory and weight-update checks
#                  (rl_loop_prod serves over HTTP: carry the server's wheels in .whl too)
#   orbax_load     scripts/orbax_load_bench.py: load time of the Llama-3-8B-width 2-layer random
#                  checkpoint from safetensors vs Orbax into the runner's parameters (median of 3),
#                  and their bits compared (carry orbax-checkpoint and its wheels in .whl too)
#   harness_prod_<case>  jengine invariance on that case's production-width checkpoint (run its
#                  accept_<case> step first in the same call: it builds the checkpoint)
#   harness_deepseek  scripts/gpu_harness_deepseek.py: a random DeepSeek-V3 checkpoint at
#                  accept_deepseek_v3's widths (3 layers, the first dense), the invariance harness
#                  under rl-bitwise (every mode must PASS, T 0 and 1) and auto (the control, T 0);
#                  a verdict table, EP1 (harness_deepseek_auto: the auto control alone, 200 s)
#   norm_mean      scripts/gpu_norm_mean.py: the trainer's op-by-op RMSNorm with the Triton mean twin
#                  (and the XLA one, the control) vs the Triton norm kernel, widths 1536/512/2048/7168
#   bisect_mla     scripts/gpu_bisect_mla.py: the accept_deepseek_v3 checkpoint's longest sequence,
#                  trainer vs the engine's unchunked forward, state by state (norm and block
#                  inputs, MLA operands, router logits / ids / weights, experts, o_proj)
#   bisect_longcat the same with --case longcat: accept_longcat's checkpoint, both blocks per layer
#   mla_decode     scripts/gpu_mla_decode.py: decode step at bs 64, ctx 1024, rl-bitwise and auto,
#                  of a DeepSeek-V3-shaped model with Llama-3-8B's active parameters per token vs
#                  the Llama-3-8B shape, both cut to 8 layers: ms, ratio, parameters, KV bytes/token
set -u
out=${1:-${OUT:-/tmp/out}}; shift
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .gpu_tiny ] && export JENGINE_CACHE_DIR=$PWD/.gpu_tiny
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
echo "| step | result | wall |" > "$out/summary.md"
echo "|---|---|---|" >> "$out/summary.md"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "| $name | rc=$rc | $((SECONDS - t0)) s |" | tee -a "$out/summary.md"
}
with_tiles() {  # with_tiles PY CMD...: CMD with the tile file edited by PY (a statement on its
  # JSON `d`), the file restored after -- an A/B's "before" without a second checkout
  local tiles=pallas_kernels/triton_gemm_tiles.json edit=$1; shift
  cp "$tiles" /tmp/tiles.json.bak
  python3 -c "import json; p = '$tiles'; d = json.load(open(p)); $edit; json.dump(d, open(p, 'w'))"
  "$@"
  cp /tmp/tiles.json.bak "$tiles"
}
with_source_edit() {  # with_source_edit FILE SED CMD...: CMD with FILE edited by SED (refused if
  # it changes nothing), the file restored after -- an A/B's other arm without a second checkout
  local file=$1 edit=$2; shift 2
  cp "$file" /tmp/source_edit.bak
  sed -i "$edit" "$file"
  if cmp -s "$file" /tmp/source_edit.bak; then echo "with_source_edit: '$edit' changed nothing in $file" >&2; return 1; fi
  "$@"
  cp /tmp/source_edit.bak "$file"
}
with_plan_edit() { with_source_edit pallas_kernels/triton_attention_plan.py "$@"; }
# The page window's gather as it was before the thirty-fifth session: its index not clamped to
# [0, PAGES) (pages_memcheck's negative control, pages_clamp_ab's "before").
UNCLAMP='s/tl.gather(split_pages, tl.minimum(tl.maximum(at, 0), PAGES - 1), 0)/tl.gather(split_pages, at, 0)/'
# The Llama-3-8B entries' own tiles (the prefill's: M > 256) on the flat-K serial schedule: the same
# K chunks, so the same bits (_triton_gemm_kernels._gemm_flat); split_at_every_m off so M = 4096
# runs it.
# The prefill GEMMs member by member (group_alone_ab): q/k/v on the wide tile ungrouped, then
# gate/up (k_split 2) on a 128 x 256 flat-K tile of its own from M = 1024, also ungrouped.
QKV_ALONE="d['tiles']['bf16_k4_flat_wide'].update(grouped=False)"
GATE_UP_WIDE="d['tiles']['bf16_k2_flat_wide'] = dict(d['tiles']['bf16_k4_flat_wide'], k_split=2, grouped=False); [e.update(tile='bf16_k2_flat_wide', by_m=e['by_m'] + [dict(max_m=1023, tile='bf16_k2')]) for e in d['tables']['llama3-8b-h200']['entries'] if e['tile'] == 'bf16_k2']"
FLAT_K_ENTRIES="[d['tiles'][n].update(flat_k=True, split_at_every_m=False) for n in ('bf16_k4_split', 'bf16_k2')]"
for s in "$@"; do
  case $s in
    attention) step attention 420 python3 scripts/gpu_attention.py --out "$out" ;;
    mla_digest) step mla_digest 150 python3 "$(dirname "$0")/gpu_mla_digest.py" --out "$out/mla_digest.json" ;;
    mla_attention) step mla_attention 200 python3 scripts/gpu_mla_attention.py --out "$out/mla_attention" ;;
    cmdbuf_ab)
      step model_cbuf_default 240 python3 -m jengine.cli bench --parts model --iters 10 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 115 --out "$out/model_cbuf_default"
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" step model_cbuf_off 240 python3 -m jengine.cli bench --parts model --iters 10 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 115 --out "$out/model_cbuf_off" ;;
    plan_ab_attention)  # auto's model rows with the Triton attention, then with XLA's (the next leaf)
      step model_auto_default 200 python3 -m jengine.cli bench --parts model --numerics auto --iters 10 --batch-sizes 1 64 --long-context 0 --part-timeout 190 --out "$out/model_auto_default"
      step model_auto_xla_attention 200 python3 scripts/gpu_plan_ab.py --without attention.paged.triton_wide_prefill attention.paged.triton_fixed_split --out "$out/model_auto_xla_attention.json" -- --numerics auto --iters 10 --batch-sizes 1 64 --long-context 0 ;;
    auto_gemm_plan_ab)  # auto's decode rows (bs 1 / 64 / 256) as planned, with rl-bitwise's Triton grouped GEMM (q/k/v, gate/up), with its Triton GEMMs too (o, down, LM head), as planned again
      a="--numerics auto --iters 20 --batch-sizes 1 64 256 --long-context 0 --prefill-tokens 0"
      step model_auto_planned 150 python3 -m jengine.cli bench --parts model $a --part-timeout 140 --out "$out/model_auto_planned"
      step model_auto_triton_group 150 python3 scripts/gpu_plan_ab.py --without linear.gemm_group.xla_native --out "$out/model_auto_triton_group.json" -- $a
      step model_auto_triton_gemms 150 python3 scripts/gpu_plan_ab.py --without linear.gemm_group.xla_native linear.gemm.xla_native --out "$out/model_auto_triton_gemms.json" -- $a
      step model_auto_planned2 150 python3 -m jengine.cli bench --parts model $a --part-timeout 140 --out "$out/model_auto_planned2" ;;
    auto_gate_up_ab)  # auto's decode rows with its plan (gate/up at <= 64 rows on the Triton grouped launch), with XLA's dots only, with its plan again
      a="--numerics auto --iters 20 --batch-sizes 1 16 64 256 --long-context 0 --prefill-tokens 0"
      step model_auto_planned 150 python3 -m jengine.cli bench --parts model $a --part-timeout 140 --out "$out/model_auto_planned"
      step model_auto_xla 150 python3 scripts/gpu_plan_ab.py --without linear.gemm.xla_gate_up_triton linear.gemm_group.xla_gate_up_triton --out "$out/model_auto_xla.json" -- $a
      step model_auto_planned2 150 python3 -m jengine.cli bench --parts model $a --part-timeout 140 --out "$out/model_auto_planned2" ;;
    auto_leaves_ab)  # auto's model rows as planned (RoPE + KV write reading q/k/v's merged GEMM output), then without it
      step model_auto_planned 200 python3 -m jengine.cli bench --parts model --numerics auto --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 190 --out "$out/model_auto_planned"
      step model_auto_rope_3buf 200 python3 scripts/gpu_plan_ab.py --without attention.rope_write.triton_fused_qkv --out "$out/model_auto_rope_3buf.json" -- --numerics auto --iters 20 --batch-sizes 1 64 256 --long-context 0 ;;
    plan_ab_xla_attention_only) step model_auto_xla_attention 200 python3 scripts/gpu_plan_ab.py --without attention.paged.triton_wide_prefill attention.paged.triton_fixed_split --out "$out/model_auto_xla_attention.json" -- --numerics auto --iters 10 --batch-sizes 1 64 --long-context 0 ;;
    triton_call_ab)
      JENGINE_TRITON_CALL=legacy step model_triton_legacy 240 python3 -m jengine.cli bench --parts model --iters 10 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 115 --out "$out/model_triton_legacy"
      JENGINE_TRITON_CALL=ffi step model_triton_ffi 240 python3 -m jengine.cli bench --parts model --iters 10 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 115 --out "$out/model_triton_ffi" ;;
    engine_ffi_ab_rl)  # rl-bitwise's Engine workload with jax-triton's legacy custom call, then the FFI one (the step one CUDA graph)
      JENGINE_TRITON_CALL=legacy step bench_engine_rl_legacy 280 python3 -m jengine.cli bench --parts engine --numerics rl-bitwise --part-timeout 270 --out "$out/bench_engine_rl_legacy"
      JENGINE_TRITON_CALL=ffi step bench_engine_rl_ffi 280 python3 -m jengine.cli bench --parts engine --numerics rl-bitwise --part-timeout 270 --out "$out/bench_engine_rl_ffi" ;;
    triton_layers_ab)  # decode bs 1 / 64, 20 iterations: rl-bitwise on the legacy call, on "layers" (a graph a layer: the attention launches legacy, the rest FFI), on FFI (one graph); auto legacy / layers
      a="--parts model --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 140"
      JENGINE_TRITON_CALL=legacy step model_rl_call_legacy 150 python3 -m jengine.cli bench --numerics rl-bitwise $a --out "$out/model_rl_call_legacy"
      JENGINE_TRITON_CALL=layers step model_rl_call_layers 150 python3 -m jengine.cli bench --numerics rl-bitwise $a --out "$out/model_rl_call_layers"
      JENGINE_TRITON_CALL=ffi step model_rl_call_ffi 150 python3 -m jengine.cli bench --numerics rl-bitwise $a --out "$out/model_rl_call_ffi"
      JENGINE_TRITON_CALL=legacy step model_auto_call_legacy 150 python3 -m jengine.cli bench --numerics auto $a --out "$out/model_auto_call_legacy"
      JENGINE_TRITON_CALL=layers step model_auto_call_layers 150 python3 -m jengine.cli bench --numerics auto $a --out "$out/model_auto_call_layers" ;;
    engine_layers_ab_rl)  # rl-bitwise's Engine workload on the legacy call, then on "layers"
      JENGINE_TRITON_CALL=legacy step bench_engine_rl_legacy 280 python3 -m jengine.cli bench --parts engine --numerics rl-bitwise --part-timeout 270 --out "$out/bench_engine_rl_legacy"
      JENGINE_TRITON_CALL=layers step bench_engine_rl_layers 280 python3 -m jengine.cli bench --parts engine --numerics rl-bitwise --part-timeout 270 --out "$out/bench_engine_rl_layers" ;;
    layers_flags_ab)  # rl-bitwise decode bs 1 / 64 (blocked on and pipelined): legacy, layers, layers with a larger command-buffer trace cache, layers with the executable's exclusive GPU lock
      a="--parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 140"
      JENGINE_TRITON_CALL=legacy step model_rl_call_legacy 150 python3 -m jengine.cli bench $a --out "$out/model_rl_call_legacy"
      JENGINE_TRITON_CALL=layers step model_rl_call_layers 150 python3 -m jengine.cli bench $a --out "$out/model_rl_call_layers"
      JENGINE_TRITON_CALL=layers XLA_FLAGS="--xla_cmd_buffer_trace_cache_size=64" step model_rl_layers_cache64 150 python3 -m jengine.cli bench $a --out "$out/model_rl_layers_cache64"
      JENGINE_TRITON_CALL=layers XLA_FLAGS="--xla_gpu_require_exclusive_lock=true" step model_rl_layers_lock 150 python3 -m jengine.cli bench $a --out "$out/model_rl_layers_lock" ;;
    engine_layers_ab_auto)  # auto's Engine workload on the legacy call, then on "layers"
      JENGINE_TRITON_CALL=legacy step bench_engine_auto_legacy 280 python3 -m jengine.cli bench --parts engine --numerics auto --part-timeout 270 --out "$out/bench_engine_auto_legacy"
      JENGINE_TRITON_CALL=layers step bench_engine_auto_layers 280 python3 -m jengine.cli bench --parts engine --numerics auto --part-timeout 270 --out "$out/bench_engine_auto_layers" ;;
    goldens_check_layers) JENGINE_TRITON_CALL=layers step goldens_check_layers 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    triton_call_ab_rl)  # triton_call_ab for rl-bitwise alone, 20 iterations
      JENGINE_TRITON_CALL=legacy step model_rl_triton_legacy 150 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 140 --out "$out/model_rl_triton_legacy"
      JENGINE_TRITON_CALL=ffi step model_rl_triton_ffi 150 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 140 --out "$out/model_rl_triton_ffi" ;;
    gemm_prefill_warps)  # the wide prefill tile (128 x 256, flat-K) on 8 warps (today: 255 registers, ~37 spilled) against 16 (128 a thread): bits at 1024 rows, ms at 4096
      step gemm_prefill_warps 330 python3 scripts/gpu_gemm_decode_tiles.py --budget-s 300 --iters 5 --bits-rows 1024 --time-rows 4096 --xla --shapes q/o_proj "qkv group" down_proj --candidates 128,256,8,3,serial 128,256,16,3,serial 128,256,16,4,serial --out "$out/gemm_prefill_warps" ;;
    group_members)  # the q/k/v group's one launch against its members alone on the same tile: bits (f32), µs at 512..4096 rows (H100, thirty-first session: alone faster from 1024 rows)
      step group_members 150 python3 scripts/gpu_group_members.py --groups q/k/v --rows 512 1024 2048 4096 --out "$out/group_members" ;;
    rope_attention)  # RoPE + the KV write inside the split attention launch (bits vs the two launches, µs at bs 1 / 16 / 32)
      step rope_attention 400 python3 scripts/gpu_rope_attention.py --out "$out/rope_attention" ;;
    rope_attention_ab)  # each mode's decode rows with the two launches, then with the fused one (the default)
      for numerics in auto rl-bitwise; do
        a="--numerics $numerics --iters 20 --batch-sizes 1 16 --long-context 0 --prefill-tokens 0"
        JENGINE_ATTENTION_ROPE=off step "model_${numerics}_rope_two" 120 python3 -m jengine.cli bench --parts model $a --part-timeout 110 --out "$out/model_${numerics}_rope_two"
        step "model_${numerics}_rope_fused" 120 python3 -m jengine.cli bench --parts model $a --part-timeout 110 --out "$out/model_${numerics}_rope_fused"
      done ;;
    rope_attention_ab_long)  # bs 16 x ctx 8192 with the two launches, then with the fused one forced past FUSED_MAX_POSITIONS (H100, thirty-third session: 0.5-0.8 ms slower, hence the limit); ROPE_AB_MODES picks the modes
      for numerics in ${ROPE_AB_MODES:-auto rl-bitwise}; do
        a="--numerics $numerics --iters 20 --batch-sizes 1 --long-context 8192 --prefill-tokens 0"
        JENGINE_ATTENTION_ROPE=off step "model_${numerics}_long_two" 120 python3 -m jengine.cli bench --parts model $a --part-timeout 110 --out "$out/model_${numerics}_long_two"
        with_source_edit pallas_kernels/triton_rope_attention.py 's/^FUSED_MAX_POSITIONS = .*/FUSED_MAX_POSITIONS = 1 << 30  # gpu_run.sh edit/' \
          step "model_${numerics}_long_fused" 120 python3 -m jengine.cli bench --parts model $a --part-timeout 110 --out "$out/model_${numerics}_long_fused"
      done ;;
    goldens_check_rope_off) JENGINE_ATTENTION_ROPE=off step goldens_check_rope_off 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    group_alone_ab)  # rl-bitwise's prefill (and bs 1) today, q/k/v member by member at M >= 1024, gate/up too
      a="--numerics rl-bitwise --iters 10 --batch-sizes 1 --long-context 0"
      step prefill_rl_grouped 150 python3 -m jengine.cli bench --parts model $a --part-timeout 140 --out "$out/prefill_rl_grouped"
      with_tiles "$QKV_ALONE" step prefill_rl_qkv_alone 150 python3 -m jengine.cli bench --parts model $a --part-timeout 140 --out "$out/prefill_rl_qkv_alone"
      with_tiles "$QKV_ALONE; $GATE_UP_WIDE" step prefill_rl_all_alone 150 python3 -m jengine.cli bench --parts model $a --part-timeout 140 --out "$out/prefill_rl_all_alone" ;;
    goldens_check_alone) with_tiles "$QKV_ALONE; $GATE_UP_WIDE" step goldens_check_alone 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    gemm_prefill_members)  # timings only, 4096 rows: the grouped q/k/v and gate/up launches against their members launched alone (the same bits by construction), and XLA's dot
      step gemm_prefill_members 200 python3 scripts/gpu_gemm_decode_tiles.py --skip-bits --budget-s 170 --iters 5 --time-rows 4096 --xla --shapes q/o_proj k/v_proj gate/up_proj "qkv group" "gate_up group" --candidates 128,256,8,3,serial --out "$out/gemm_prefill_members" ;;
    gemm_prefill_tiles)  # timings only: launch shapes on the entries' K chunks at prefill M, and XLA's dot
      step gemm_prefill_tiles 330 python3 scripts/gpu_gemm_decode_tiles.py --skip-bits --budget-s 300 --iters 5 --time-rows 1024 4096 --xla --shapes q/o_proj "qkv group" "gate_up group" down_proj --candidates 128,128,8,4,split 128,128,8,4,fused 128,256,8,3,split 128,256,8,3,fused 256,128,8,3,split 128,128,8,4,serial 64,128,4,4,serial 128,256,8,3,serial 64,256,4,3,serial --out "$out/gemm_prefill_tiles" ;;
    cmdbuf_modes) step cmdbuf_modes 400 bash scripts/gpu_cmdbuf_modes.sh "$out/cmdbuf_modes" ;;
    attention_split) step attention_split 200 python3 scripts/gpu_attention_split.py --out "$out/attention_split" ;;
    attention_serial) step attention_serial 200 python3 scripts/gpu_attention_split.py --serial --out "$out/attention_serial" ;;
    attention_split_auto) step attention_split_auto 150 python3 scripts/gpu_attention_split.py --splits 64 128 256 --configs 4,2 --out "$out/attention_split_auto" ;;
    gemm_decode_tiles2)  # timings only, per shape family: around the table's by_m picks
      step gemm_decode_tiles_qkv_o 120 python3 scripts/gpu_gemm_decode_tiles.py --skip-bits --budget-s 100 --shapes q/o_proj "qkv group" --candidates 64,64,4,3 64,64,4,5 64,32,4,4 64,32,4,6 32,64,4,4 64,64,4,4,serial 64,32,4,4,serial --out "$out/gemm_decode_tiles_qkv_o"
      step gemm_decode_tiles_gate_up 100 python3 scripts/gpu_gemm_decode_tiles.py --skip-bits --budget-s 80 --shapes "gate_up group" --candidates 64,128,4,3 64,128,4,5 64,256,4,3 64,128,4,4,split 64,64,4,4,split 64,64,4,6 --out "$out/gemm_decode_tiles_gate_up"
      step gemm_decode_tiles_down 100 python3 scripts/gpu_gemm_decode_tiles.py --skip-bits --budget-s 80 --shapes down_proj --candidates 64,64,4,3 64,64,4,5 64,64,4,6 64,128,4,3 64,32,4,6 64,64,4,4,serial --out "$out/gemm_decode_tiles_down" ;;
    gemm_mid_m_tiles)  # timings only: launch shapes on the entries' K chunks at M = 128 / 256 (the bs 256 lead), and XLA's dot
      step gemm_mid_m_tiles 330 python3 scripts/gpu_gemm_decode_tiles.py --skip-bits --budget-s 300 --iters 10 --time-rows 128 256 --xla --shapes q/o_proj "qkv group" "gate_up group" down_proj --candidates 128,128,8,4,split 128,128,8,4,fused 64,128,4,4,split 64,128,4,4,fused 128,64,4,4,fused 64,64,4,4,fused 128,256,8,3,split 128,128,8,4,serial 64,128,4,4,serial --out "$out/gemm_mid_m_tiles" ;;
    mid_m_ab)  # q/k/v and o_proj at 128 < M <= 256 on bf16_k4_mid: bits vs the entry's tile at M = 129 / 256, then rl-bitwise's bs 256 rows with it and with the pick before (bf16_k4_split_bk32)
      step gemm_mid_m_bits 150 python3 scripts/gpu_gemm_decode_tiles.py --budget-s 120 --iters 10 --bits-rows 129 256 --time-rows 256 --xla --shapes q/o_proj "qkv group" --candidates 64,128,4,4 64,128,4,4,serial --out "$out/gemm_mid_m_bits"
      step model_rl_mid 150 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 256 --long-context 0 --prefill-tokens 0 --part-timeout 140 --out "$out/model_rl_mid"
      with_tiles "[r.update(tile='bf16_k4_split_bk32') for t in d['tables'].values() for e in t['entries'] for r in e.get('by_m', []) if r['tile'] == 'bf16_k4_mid']" \
        step model_rl_bk32 150 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 256 --long-context 0 --prefill-tokens 0 --part-timeout 140 --out "$out/model_rl_bk32" ;;
    gemm_gateup_prefill_tiles)  # gate/up's prefill launch shapes on its K chunks (52 of rl-bitwise's 137.7 ms at 4096 rows, H100): bits at 1024 rows, ms at 4096, XLA's dot
      step gemm_gateup_prefill_tiles 330 python3 scripts/gpu_gemm_decode_tiles.py --budget-s 300 --iters 10 --bits-rows 1024 --time-rows 4096 --xla --shapes "gate_up group" --candidates 128,128,8,4,serial 128,128,4,4,serial 128,128,4,3,serial 128,128,8,3,serial 128,128,8,5,serial 64,256,4,4,serial 64,256,8,4,serial 256,64,8,4,serial 128,64,4,4,serial --out "$out/gemm_gateup_prefill_tiles" ;;
    gemm_persistent)  # an experiment: a persistent GEMM on the contract's K chunks (bits vs the engine's launch, ms vs cuBLAS)
      step gemm_persistent 420 python3 scripts/gpu_gemm_persistent.py --budget-s 380 --out "$out/gemm_persistent" ;;
    gemm_add_norm)  # an experiment: the layer boundary inside o_proj / down_proj's launch (bits, µs per layer)
      step gemm_add_norm 240 python3 scripts/gpu_gemm_add_norm.py --out "$out/gemm_add_norm" ;;
    pdl_check)  # the no-PDL pin reaches XLA: griddepcontrol in auto's PTX, none in rl-bitwise's
      step pdl_check 200 python3 scripts/gpu_pdl_check.py --out "$out/pdl_check" ;;
    pdl_ab)  # decode rows with and without XLA's PDL, each mode
      a="--parts model --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 140"
      step pdl_auto_on 150 python3 -m jengine.cli bench $a --numerics auto --out "$out/pdl_auto_on"
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_pdl=false" step pdl_auto_off 150 python3 -m jengine.cli bench $a --numerics auto --out "$out/pdl_auto_off"
      step pdl_rl_off 150 python3 -m jengine.cli bench $a --numerics rl-bitwise --out "$out/pdl_rl_off"
      with_source_edit jengine/numerics.py 's/^    t.set("disable_pdl", True)$/    pass  # pdl_ab: rl-bitwise without its pin/' \
        step pdl_rl_on 150 python3 -m jengine.cli bench $a --numerics rl-bitwise --out "$out/pdl_rl_on" ;;
    launch_forms|launch_forms_2)  # the kernel with 2 / 20 arguments and counting its programs: µs a launch in a graph
      step "$s" 200 python3 scripts/gpu_launch_gaps.py --iters 50 --out "$out/$s" ;;
    launch_forms_nopdl)  # the same without XLA's programmatic dependent launch (its "xla" form)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_pdl=false" step "$s" 200 python3 scripts/gpu_launch_gaps.py --iters 50 --out "$out/$s" ;;
    silu_down)  # an experiment: down_proj with SwiGLU's activation made in its A loads (bits, µs per layer at M = 1..64)
      step silu_down 240 python3 scripts/gpu_silu_down.py --out "$out/silu_down" ;;
    gemm_swiglu)  # an experiment: SwiGLU's activation inside the gate/up launch (bits, µs per layer)
      step gemm_swiglu 300 python3 scripts/gpu_gemm_swiglu.py --out "$out/gemm_swiglu" ;;
    gemm_decode_tiles_big_m)  # the by_m picks vs the entry's tile at M = 64 / 128 / 256 (timings)
      step gemm_decode_tiles_big_m 150 python3 scripts/gpu_gemm_decode_tiles.py --skip-bits --budget-s 130 --time-rows 64 128 256 --candidates 64,64,4,6 --out "$out/gemm_decode_tiles_big_m" ;;
    bench_model_bs256) step bench_model_bs256 240 python3 -m jengine.cli bench --parts roofline model --iters 20 --batch-sizes 256 --long-context 0 --prefill-tokens 0 --part-timeout 60 model=110 --out "$out/bench_model_bs256" ;;
    bench_model_decode) step bench_model_decode 240 python3 -m jengine.cli bench --parts roofline model --iters 30 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 60 model=110 --out "$out/bench_model_decode" ;;
    gemm_decode_tiles) step gemm_decode_tiles 450 python3 scripts/gpu_gemm_decode_tiles.py --budget-s 370 --out "$out/gemm_decode_tiles" ;;
    attention_rows_warps)  # which (ROWS, warps) launches give today's bits / ROWS 16 on one warp's
      step attention_rows_warps 200 python3 scripts/gpu_attention_rows.py --configs 4,4,2 4,2,2 4,1,2 8,8,2 16,16,2 16,8,2 16,4,2 32,32,2 --out "$out/attention_rows_warps"
      step attention_rows_w1 200 python3 scripts/gpu_attention_rows.py --ref 4,1,2 --configs 4,1,2 8,2,2 16,4,2 32,8,2 16,4,3 --out "$out/attention_rows_w1" ;;
    attention_auto_tiles)  # auto's prefill attention on wider KV tiles: ms, error vs f32
      step attention_auto_tiles 300 python3 scripts/gpu_attention_rows.py --ref 16,4,2 --configs 16,4,2 16,8,2 16,4,2,64 16,8,2,64 16,8,3,64 16,8,2,128 16,8,2,64,1024 16,8,2,128,1024 32,8,2,64 32,8,2,128 --out "$out/attention_auto_tiles" ;;
    attention_rows_tree|attention_rows_dot)  # a layout-free row sum: one bit class for every (ROWS, warps)? at what cost?
      step "$s" 200 python3 scripts/gpu_attention_rows.py --rowsum "${s#attention_rows_}" --configs 4,4,2 4,1,2 8,8,2 16,4,2 32,8,2 16,8,2 --out "$out/$s" ;;
    attention_rows_triton)  # the same launches on Triton's sum (the two bit classes; the times to compare with)
      step attention_rows_triton 200 python3 scripts/gpu_attention_rows.py --rowsum triton --configs 4,4,2 4,1,2 8,8,2 16,4,2 32,8,2 16,8,2 --out "$out/attention_rows_triton" ;;
    attention_split_tree|attention_split_dot|attention_split_triton)  # the decode split schedule (bs 1 / 16) on that row sum, warps / stages swept
      step "$s" 150 python3 scripts/gpu_attention_split.py --rowsum "${s#attention_split_}" --configs 4,2 4,3 2,2 2,3 1,2 8,2 --splits 128 64 --out "$out/$s" ;;
    attention_split_quick_dot|attention_split_quick_triton)  # the engine's split launch alone (bs 1 / 16: µs)
      step "$s" 90 python3 scripts/gpu_attention_split.py --rowsum "${s#attention_split_quick_}" --configs 4,2 --out "$out/$s" ;;
    attention_rows_dot_splits)  # the prefill on the dot sum with other KV tiles / splits (another definition: ms, error vs f32)
      step "$s" 200 python3 scripts/gpu_attention_rows.py --rowsum dot --ref 16,4,2 --configs 16,4,2 16,4,2,32,128 16,4,2,32,64 32,8,2 32,8,2,32,128 16,4,2,64 32,8,2,64 16,8,2,64 4,4,2,64 4,4,2,32,64 --out "$out/$s" ;;
    attention_tiles_dot)  # the decode schedules on the dot sum with other KV tiles / splits (µs; other bits)
      step attention_split_dot_tiles 150 python3 scripts/gpu_attention_split.py --rowsum dot --configs 4,2 4,2,0,64 4,3,0,64 8,2,0,64 4,2,0,64,128 4,2,0,32,128 4,2,0,32,64 --out "$out/attention_split_dot_tiles"
      step attention_serial_dot_tiles 150 python3 scripts/gpu_attention_split.py --serial --rowsum dot --configs 4,2 4,2,0,64 8,2,0,64 4,2,0,32,128 4,2,0,32,64 --out "$out/attention_serial_dot_tiles" ;;
    attention_serial_dot|attention_serial_triton)  # the serial schedule's decode rows (64 / 256) on that row sum
      step "$s" 150 python3 scripts/gpu_attention_split.py --serial --rowsum "${s#attention_serial_}" --configs 4,2 4,3 8,2 2,2 --out "$out/$s" ;;
    attention_one_warp)  # the decode schedules on one warp (ROWS 16 / 1 warp: the bits of ROWS 64 on 4)
      step attention_split_w1 120 python3 scripts/gpu_attention_split.py --configs 4,2 1,2 1,3 1,4 --out "$out/attention_split_w1"
      step attention_serial_w1 150 python3 scripts/gpu_attention_split.py --serial --configs 4,2 1,2 1,3 1,4 --out "$out/attention_serial_w1" ;;
    attention_tpp16)  # every schedule on ROWS 64 / 4 warps (TPP 16 at G 4): the bits of ROWS 16 on one warp
      step attention_split_tpp16 120 python3 scripts/gpu_attention_split.py --configs 4,2 4,2,16 4,3,16 4,4,16 --out "$out/attention_split_tpp16"
      step attention_serial_tpp16 150 python3 scripts/gpu_attention_split.py --serial --configs 4,2 4,2,16 4,3,16 8,2,32 --out "$out/attention_serial_tpp16" ;;
    attention_rows) step attention_rows 240 python3 scripts/gpu_attention_rows.py --out "$out/attention_rows" ;;
    attention_timing) step attention_timing 150 python3 scripts/gpu_attention.py --skip-checks --out "$out" ;;
    gemm) step gemm 170 python3 scripts/gpu_validate.py --skip-harness --only gemm --out "$out/val" ;;
    silu) step silu 150 python3 scripts/gpu_validate.py --skip-harness --only silu --out "$out/val_silu" ;;
    sumexp) step sumexp 150 python3 scripts/gpu_validate.py --skip-harness --only block_sumexp --out "$out/val_sumexp" ;;
    harness) step harness 170 python3 -m jengine.cli invariance --numerics rl-bitwise --max-new-tokens 8 ;;
    harness_auto) step harness_auto 150 python3 -m jengine.cli invariance --numerics auto --temperature 0 --max-new-tokens 8 ;;
    refuse_f32) step refuse_f32 120 python3 -m jengine.cli generate --model tiny --numerics rl-bitwise --dtype float32 --prompt hi --max-new-tokens 1 --skip-warmup ;;
    profile)
      step profile_auto 150 python3 scripts/gpu_profile_step.py --numerics auto --batch 64 --out "$out"
      step profile_rl 150 python3 scripts/gpu_profile_step.py --numerics rl-bitwise --batch 64 --out "$out" ;;
    profile_bs256)
      step profile_bs256_auto 120 python3 scripts/gpu_profile_step.py --numerics auto --batch 256 --out "$out"
      step profile_bs256_rl 120 python3 scripts/gpu_profile_step.py --numerics rl-bitwise --batch 256 --out "$out" ;;
    profile_prefill)
      step profile_prefill_auto 150 python3 scripts/gpu_profile_step.py --numerics auto --prefill 4096 --steps 3 --out "$out"
      step profile_prefill_rl 150 python3 scripts/gpu_profile_step.py --numerics rl-bitwise --prefill 4096 --steps 3 --out "$out" ;;
    profile_bs1_rl) step profile_bs1_rl 100 python3 scripts/gpu_profile_step.py --numerics rl-bitwise --batch 1 --out "$out" ;;
    profile_bs1)
      step profile_bs1_auto 100 python3 scripts/gpu_profile_step.py --numerics auto --batch 1 --out "$out"
      step profile_bs1_rl 100 python3 scripts/gpu_profile_step.py --numerics rl-bitwise --batch 1 --out "$out" ;;
    profile_cmdbuf)  # the same with XLA command buffers (CUDA graphs) for custom calls too
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL" step profile_cmdbuf_rl 150 python3 scripts/gpu_profile_step.py --numerics rl-bitwise --batch 64 --tag _cmdbuf --out "$out"
      XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL" step profile_cmdbuf_auto 150 python3 scripts/gpu_profile_step.py --numerics auto --batch 64 --tag _cmdbuf --out "$out" ;;
    bench_decode) step bench_decode 560 python3 -m jengine.cli bench --parts roofline model --iters 5 --part-timeout 60 model=240 --out "$out/bench_decode" ;;
    bench_final) step bench_final 400 python3 -m jengine.cli bench --parts roofline model hf --iters 30 --part-timeout 60 model=230 hf=130 --out "$out/bench_final" ;;
    bench_model) step bench_model 420 python3 -m jengine.cli bench --parts roofline model --iters 20 --batch-sizes 1 64 256 --part-timeout 60 model=170 --out "$out/bench_model" ;;
    bench_model_rl_decode) step bench_model_rl_decode 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 190 --out "$out/bench_model_rl_decode" ;;
    bench_model_rl_decode_noby_m)  # the same rows with the tile file's by_m rules taken out (an A/B's "before")
      with_tiles "[e.pop('by_m', None) for t in d['tables'].values() for e in t['entries']]" \
        step "$s" 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 190 --out "$out/$s" ;;
    bench_model_rl_decode_nofuse)  # the same rows with the tile file's fused_reduce switched off
      with_tiles "[t.update(fused_reduce=False) for t in d['tiles'].values() if 'fused_reduce' in t]" \
        step "$s" 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 190 --out "$out/$s" ;;
    bench_model_rl) step bench_model_rl 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 256 --part-timeout 190 --out "$out/bench_model_rl" ;;
    bench_leaves) step bench_leaves 560 python3 -m jengine.cli bench --parts roofline leaves --iters 5 --part-timeout 120 leaves=420 --out "$out/bench_leaves" ;;
    sweep_prefill) step sweep_prefill 200 python3 -m jengine.cli bench --parts leaves --rows 1 64 4096 --iters 5 --leaf-shapes q/o_proj down_proj --tile-candidates 128,128,64,8,8,4,4 128,128,64,8,8,4,2 128,256,64,8,8,3,4 --part-timeout leaves=190 --out "$out/sweep_prefill" ;;
    sweep_split) step sweep_split 200 python3 -m jengine.cli bench --parts leaves --rows 1 64 4096 --iters 5 --leaf-shapes q/o_proj down_proj --tile-candidates 128,128,64,8,8,4,4:split 64,128,128,8,4,3,4:split 64,64,128,8,4,6,4:split 128,128,64,8,8,4,2 --part-timeout leaves=190 --out "$out/sweep_split" ;;
    bench_engine) step bench_engine 590 python3 -m jengine.cli bench --parts engine --part-timeout 285 --out "$out/bench_engine" ;;
    bench_engine_auto) step bench_engine_auto 220 python3 -m jengine.cli bench --parts engine --numerics auto --part-timeout 210 --out "$out/bench_engine_auto" ;;
    bench_engine_rl) step bench_engine_rl 300 python3 -m jengine.cli bench --parts engine --numerics rl-bitwise --part-timeout 285 --out "$out/bench_engine_rl" ;;
    bench_e2e_auto) step bench_e2e_auto 420 python3 -m jengine.cli bench --parts engine server --numerics auto --loop-batch 0 --part-timeout 280 --out "$out/bench_e2e_auto" ;;
    bench_e2e_hold*) step "$s" 420 python3 -m jengine.cli bench --parts engine server --numerics auto --loop-batch 0 --output-hold-ms "${s#bench_e2e_hold}" --part-timeout 280 --out "$out/$s" ;;
    bench_engine_nocmdbuf) XLA_FLAGS="--xla_gpu_enable_command_buffer=" step bench_engine_nocmdbuf 590 python3 -m jengine.cli bench --parts engine --part-timeout 285 --out "$out/bench_engine_nocmdbuf" ;;
    bench_server) step bench_server 590 python3 -m jengine.cli bench --parts server --part-timeout 285 --out "$out/bench_server" ;;
    bench_server_auto) step bench_server_auto 300 python3 -m jengine.cli bench --parts server --numerics auto --part-timeout 285 --out "$out/bench_server_auto" ;;
    server_diag)
      step server_nostream 200 python3 -m jengine.cli bench --parts server --numerics auto --server-stream off --part-timeout 190 --out "$out/server_nostream"
      step server_si100us 200 python3 -m jengine.cli bench --parts server --numerics auto --server-switch-interval 0.0001 --part-timeout 190 --out "$out/server_si100us" ;;
    bench_hf) step bench_hf 200 python3 -m jengine.cli bench --parts hf --part-timeout 190 --out "$out/bench_hf" ;;
    bench_moe) step bench_moe 560 python3 -m jengine.cli bench --parts roofline model --shape qwen3-30b-a3b --iters 10 --batch-sizes 1 64 --long-context 0 --prefill-tokens 4096 --part-timeout 60 model=240 --out "$out/bench_moe" ;;
    bench_moe_short) step bench_moe_short 370 python3 -m jengine.cli bench --parts roofline model --shape qwen3-30b-a3b --layers 8 --iters 10 --batch-sizes 1 64 --long-context 0 --prefill-tokens 4096 --part-timeout 60 model=150 --out "$out/bench_moe_short" ;;
    bench_moe_probe) step bench_moe_probe 200 python3 -m jengine.cli bench --parts model --shape qwen3-30b-a3b --layers 8 --iters 10 --batch-sizes 1 --long-context 0 --prefill-tokens 0 --part-timeout 95 --out "$out/bench_moe_probe" ;;
    moe_compile) step moe_compile 500 python3 scripts/gpu_moe_compile.py --layers 2 4 --numerics auto auto-noautotune rl-bitwise --child-timeout 80 --out "$out/moe_compile" ;;
    bench_moe_hf) step bench_moe_hf 300 python3 -m jengine.cli bench --parts hf --shape qwen3-30b-a3b --hf-batch 16 --hf-new-tokens 32 --part-timeout 290 --out "$out/bench_moe_hf" ;;
    router_topk) step router_topk 300 python3 scripts/gpu_router_topk.py --experts 8 128 --ks 1 2 4 8 32 64 --out "$out/router_topk" ;;
    router_topk_mid) step router_topk_mid 300 python3 scripts/gpu_router_topk.py --experts 64 160 --ks 6 12 16 33 50 --out "$out/router_topk_mid" ;;
    router_topk_big) step router_topk_big 300 python3 scripts/gpu_router_topk.py --experts 256 --ks 6 8 12 16 33 50 --out "$out/router_topk_big" ;;
    router_topk_full) step router_topk_full 590 python3 scripts/gpu_router_topk.py --out "$out/router_topk" ;;
    grouped_gemm_quick) step grouped_gemm_quick 240 python3 scripts/gpu_grouped_gemm.py --tokens 1 64 --timing-ts 1 64 1024 4096 --iters 5 --out "$out/grouped_gemm" ;;
    grouped_gemm_timing) step grouped_gemm_timing 200 python3 -X faulthandler scripts/gpu_grouped_gemm.py --skip-bits --timing-ts 1 64 1024 4096 --iters 5 --watchdog 150 --out "$out/grouped_gemm_timing" ;;
    grouped_gemm) step grouped_gemm 540 python3 scripts/gpu_grouped_gemm.py --out "$out/grouped_gemm" ;;
    router_grouped) step router_grouped 300 env JAX_PLATFORMS=cpu python3 scripts/gpu_router_grouped.py --out "$out/router_grouped" ;;
    align_*) step "$s" 150 bash scripts/gpu_align.sh "$out/$s" "${s#align_}" ;;
    accept_qwen3moe|accept_deepseek_v3|accept_longcat) step "$s" 300 python3 scripts/gpu_acceptance.py --out "$out/$s" --cases "${s#accept_}" ;;
    rowsum_ab_triton|rowsum_ab_tree|rowsum_ab_dot)  # rl-bitwise's model rows on that row sum (tree / dot: the wide tile for its prefill steps too)
      JENGINE_ATTENTION_ROWSUM="${s#rowsum_ab_}" step "model_rl_rowsum_${s#rowsum_ab_}" 300 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 280 --out "$out/model_rl_rowsum_${s#rowsum_ab_}" ;;
    accept_llama_tree|accept_llama_dot)  # trainer alignment at production widths on that row sum: the twin runs whole
      # sequences on the wide tile, the engine decodes on the narrow one -- MATCH means the layout no longer reaches the bits
      JENGINE_ATTENTION_ROWSUM="${s#accept_llama_}" step "$s" 420 python3 scripts/gpu_acceptance.py --out "$out/$s" --cases llama ;;
    harness_prod_llama_tree|harness_prod_llama_dot)  # after accept_llama_<form>
      JENGINE_ATTENTION_ROWSUM="${s#harness_prod_llama_}" step "$s" 300 python3 -m jengine.cli invariance --model /tmp/acceptance/llama --numerics rl-bitwise --max-new-tokens 8 ;;
    goldens_record_dot)  # the goldens on the dot row sum (what adopting it as the definition would record)
      JENGINE_ATTENTION_ROWSUM=dot step goldens_record_dot 560 python3 scripts/goldens.py record --sections tiny families production --device cuda --out "$out/h200_dot.json" ;;
    kvtile_ab_rl|kvtile_ab_auto)  # that mode's model rows on 32-, then 64-position KV tiles (one machine)
      m=$([ "$s" = kvtile_ab_rl ] && echo rl-bitwise || echo auto)
      JENGINE_ATTENTION_KV_TILE=32 step "model_${m}_kv32" 200 python3 -m jengine.cli bench --parts model --numerics "$m" --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 190 --out "$out/model_${m}_kv32"
      JENGINE_ATTENTION_KV_TILE=64 step "model_${m}_kv64" 200 python3 -m jengine.cli bench --parts model --numerics "$m" --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 190 --out "$out/model_${m}_kv64" ;;
    merge_stages_ab)  # the split launch's merge on Triton's pipeliner (MERGE_STAGES 4) against the plain loop (0; the hand-written load ahead when it ran): both modes' split-schedule rows (bs 1, 16 x 8k), 4 / 0 / 4
      for m in rl-bitwise auto; do
        for ms in 4 0 4b; do
          with_plan_edit "s/^MERGE_STAGES = .*/MERGE_STAGES = ${ms%b}  # gpu_run.sh edit/" \
            step "model_${m}_merge$ms" 120 python3 -m jengine.cli bench --parts model --numerics "$m" --iters 20 --batch-sizes 1 --prefill-tokens 0 --part-timeout 110 --out "$out/model_${m}_merge$ms"
        done
      done ;;
    maxnreg_ab)  # the narrow serial attention launch with its register bound, then without
      for m in rl-bitwise auto; do
        step "model_${m}_bound" 150 python3 -m jengine.cli bench --parts model --numerics "$m" --iters 20 --batch-sizes 64 256 --long-context 0 --prefill-tokens 0 --part-timeout 140 --out "$out/model_${m}_bound"
        with_plan_edit 's/^\(PAGES_ENV, PAGES_STAGES, PAGES_MAXNREG = .*\), 128$/\1, None/' \
          step "model_${m}_unbounded" 150 python3 -m jengine.cli bench --parts model --numerics "$m" --iters 20 --batch-sizes 64 256 --long-context 0 --prefill-tokens 0 --part-timeout 140 --out "$out/model_${m}_unbounded"
      done ;;
    accept_llama_kv64)  # trainer alignment at production widths with every bf16 launch on 64-position KV tiles
      JENGINE_ATTENTION_KV_TILE=64 step "$s" 420 python3 scripts/gpu_acceptance.py --out "$out/$s" --cases llama ;;
    harness_prod_llama_kv64)  # after accept_llama_kv64
      JENGINE_ATTENTION_KV_TILE=64 step "$s" 300 python3 -m jengine.cli invariance --model /tmp/acceptance/llama --numerics rl-bitwise --max-new-tokens 8 ;;
    goldens_check_kv32)  # the goldens of the 32-position definition (before the twenty-eighth session's)
      JENGINE_ATTENTION_KV_TILE=32 step goldens_check_kv32 560 python3 scripts/goldens.py check tests/goldens/h200_kv32.json --device cuda ;;
    goldens_record_kv64)  # the goldens on 64-position KV tiles (what adopting them as the definition would record)
      JENGINE_ATTENTION_KV_TILE=64 step goldens_record_kv64 560 python3 scripts/goldens.py record --sections tiny families production --device cuda --out "$out/h200_kv64.json" ;;
    accept_*) step "$s" 420 python3 scripts/gpu_acceptance.py --out "$out/$s" --cases "${s#accept_}" ;;
    acceptance) step acceptance 1500 python3 scripts/gpu_acceptance.py --out "$out/acceptance" ;;
    goldens_record) step goldens_record 560 python3 scripts/goldens.py record --sections tiny families production --device cuda --out "$out/h200.json" ;;
    goldens_check_ffi) JENGINE_TRITON_CALL=ffi step goldens_check_ffi 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    prefill_flat_ab)  # rl-bitwise prefill today, then with the entries' tiles on the flat-K serial schedule
      step prefill_rl_today 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 10 --batch-sizes 256 --long-context 0 --part-timeout 190 --out "$out/prefill_rl_today"
      with_tiles "$FLAT_K_ENTRIES" \
        step prefill_rl_flat 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 10 --batch-sizes 256 --long-context 0 --part-timeout 190 --out "$out/prefill_rl_flat" ;;
    goldens_check_flat)  # the goldens with the entries' tiles on the flat-K serial schedule: every bit must be unchanged
      with_tiles "$FLAT_K_ENTRIES" step goldens_check_flat 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    epilogues_ab)  # rl-bitwise model rows today, then with the fused epilogue leaves planned
      step model_rl_separate 240 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 16 64 --long-context 0 --part-timeout 230 --out "$out/model_rl_separate"
      JENGINE_GEMM_EPILOGUES=add_norm step model_rl_add_norm 240 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 16 64 --long-context 0 --part-timeout 230 --out "$out/model_rl_add_norm"
      JENGINE_GEMM_EPILOGUES=add_norm,swiglu step model_rl_epilogues 240 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 16 64 --long-context 0 --part-timeout 230 --out "$out/model_rl_epilogues" ;;
    model_auto) step model_auto 200 python3 -m jengine.cli bench --parts model --numerics auto --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 190 --out "$out/model_auto" ;;
    model_auto_unmerged) XLA_FLAGS="--xla_disable_hlo_passes=dot-merger" step model_auto_unmerged 200 python3 -m jengine.cli bench --parts model --numerics auto --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 190 --out "$out/model_auto_unmerged" ;;
    profile_auto_unmerged)
      XLA_FLAGS="--xla_disable_hlo_passes=dot-merger" step profile_bs1_auto_unmerged 90 python3 scripts/gpu_profile_step.py --numerics auto --batch 1 --tag _unmerged --out "$out"
      XLA_FLAGS="--xla_disable_hlo_passes=dot-merger" step profile_prefill_auto_unmerged 150 python3 scripts/gpu_profile_step.py --numerics auto --prefill 4096 --steps 3 --tag _unmerged --out "$out" ;;
    swiglu_ab)  # rl-bitwise model rows today, then with SwiGLU's activation in the gate/up launch (the pair form)
      step model_rl_silu_launch 240 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 16 64 256 --long-context 0 --part-timeout 230 --out "$out/model_rl_silu_launch"
      JENGINE_GEMM_EPILOGUES=swiglu step model_rl_swiglu 240 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 1 16 64 256 --long-context 0 --part-timeout 230 --out "$out/model_rl_swiglu" ;;
    goldens_check_swiglu) JENGINE_GEMM_EPILOGUES=swiglu step goldens_check_swiglu 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    goldens_check_epilogues) JENGINE_GEMM_EPILOGUES=add_norm,swiglu step goldens_check_epilogues 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    attention_pages_ab)  # page ids per tile vs per split, every launch: bits (0 rows expected), µs
      step attention_split_pages 150 python3 scripts/gpu_attention_split.py --pages-ab --configs 4,2 4,3 4,4 4,3,0,0,128 4,3,0,0,64 --out "$out/attention_split_pages"
      step attention_serial_pages 240 python3 scripts/gpu_attention_split.py --serial --pages-ab --configs 4,2 4,3 4,4 4,3,0,0,0,128 4,2,16,32 4,3,16,32 4,2,16,64 4,3,16,64 4,4,16,64 8,3,16,64 --out "$out/attention_serial_pages" ;;
    pages_crash)  # auto's wide tile at SPLIT 512 with the page ids per split hit an illegal memory
      # access (twenty-second, twenty-third and thirty-second sessions): each suspect alone,
      # launches synchronous, with Triton's debug on (TRITON_DEBUG=1 compiles _pool_tile's asserts:
      # the page window index, each gathered page id against the block table's; and Triton's
      # integer overflow checks), then the first under compute-sanitizer's memcheck where the
      # machine has it (the faulting access's address and instruction)
      for cfg in 4,3,16,64,512 4,2,16,64,512 4,3,0,0,512 4,3,16,32,512; do
        TRITON_DEBUG=1 CUDA_LAUNCH_BLOCKING=1 step "pages_crash_${cfg//,/_}" 90 python3 scripts/gpu_attention_split.py --serial --pages-ab --configs "$cfg" --out "$out/pages_crash_${cfg//,/_}"
      done
      if command -v compute-sanitizer > /dev/null; then
        step pages_crash_memcheck 200 compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/gpu_attention_split.py --serial --pages-ab --configs 4,3,16,64,512 --out "$out/pages_crash_memcheck"
      else
        echo "pages_crash: no compute-sanitizer on this machine" | tee "$out/pages_crash_memcheck.log"
      fi ;;
    pages_clamp_ab)  # both modes' decode rows as in main (the page window's index clamped), then without the clamp
      a="--parts model --iters 20 --batch-sizes 1 64 256 --long-context 0 --prefill-tokens 0 --part-timeout 110"
      step model_clamp 240 python3 -m jengine.cli bench $a --out "$out/model_clamp"
      with_source_edit pallas_kernels/_triton_attention_kernels.py "$UNCLAMP" \
        step model_noclamp 240 python3 -m jengine.cli bench $a --out "$out/model_noclamp" ;;
    pages_memcheck)  # memcheck on an engine launch whose page window ends where its shared memory does (the kv64 wide serial tile), as in main and without the clamp
      if command -v compute-sanitizer > /dev/null; then
        a="--serial --pages-ab --configs 4,2,16,64,256 --iters 2"
        m="compute-sanitizer --tool memcheck --print-limit 10"
        step pages_memcheck_clamp 240 $m python3 scripts/gpu_attention_split.py $a --out "$out/pages_memcheck_clamp"
        with_source_edit pallas_kernels/_triton_attention_kernels.py "$UNCLAMP" \
          step pages_memcheck_noclamp 240 $m python3 scripts/gpu_attention_split.py $a --out "$out/pages_memcheck_noclamp"
        for f in clamp noclamp; do
          echo "pages_memcheck_$f: $(grep -c 'Invalid __shared__' "$out/pages_memcheck_$f.log") invalid shared reads; $(grep 'ERROR SUMMARY' "$out/pages_memcheck_$f.log")" | tee -a "$out/summary.md"
        done
      else
        echo "pages_memcheck: no compute-sanitizer on this machine" | tee -a "$out/summary.md"
      fi ;;
    pages_ab_auto|pages_ab_rl)  # a mode's model rows with the page ids per tile and as planned (the default), on one machine
      numerics=auto; [ "$s" = pages_ab_rl ] && numerics=rl-bitwise
      JENGINE_ATTENTION_PAGES=tile step "model_${numerics}_pages_tile" 200 python3 -m jengine.cli bench --parts model --numerics "$numerics" --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 190 --out "$out/model_${numerics}_pages_tile"
      step "model_${numerics}_pages_planned" 200 python3 -m jengine.cli bench --parts model --numerics "$numerics" --iters 20 --batch-sizes 1 64 256 --long-context 0 --part-timeout 190 --out "$out/model_${numerics}_pages_planned" ;;
    tiles_wide_ab)  # rl-bitwise's prefill on the entries' 128 x 128 tile (before), then on the wide prefill tile (the file)
      with_tiles "[e.update(tile='bf16_k4_split') for e in d['tables']['llama3-8b-h200']['entries'] if e['tile'] == 'bf16_k4_flat_wide']" \
        step model_rl_tiles_narrow 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 256 --long-context 0 --part-timeout 190 --out "$out/model_rl_tiles_narrow"
      step model_rl_tiles_wide 200 python3 -m jengine.cli bench --parts model --numerics rl-bitwise --iters 20 --batch-sizes 256 --long-context 0 --part-timeout 190 --out "$out/model_rl_tiles_wide" ;;
    norm_rows) step norm_rows 200 python3 scripts/gpu_norm_rows.py --out "$out/norm_rows" ;;  # the boundary on several rows per program: bits, µs
    goldens_check_pages) JENGINE_ATTENTION_PAGES=split step goldens_check_pages 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    profile_bs1_rl_epilogues) JENGINE_GEMM_EPILOGUES=add_norm,swiglu step profile_bs1_rl_epilogues 100 python3 scripts/gpu_profile_step.py --numerics rl-bitwise --batch 1 --out "$out/epilogues" ;;
    goldens_check) step goldens_check 560 python3 scripts/goldens.py check tests/goldens/h200.json --device cuda ;;
    rl_loop_prod|rl_loop_only)
      step rl_checkpoint 90 python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from gpu_acceptance import CASES, build_model; arch, dims = CASES['llama']; build_model(Path('/tmp/rl_llama'), arch, dims, seed=3)"
      step rl_loop_prod 260 python3 examples/rl_loop.py --model /tmp/rl_llama --device cuda --steps 3 --prompts 4 --group 4 --prompt-len 64 --max-new-tokens 32 --max-request-bytes 4294967296
      [ "$s" = rl_loop_only ] && continue
      step memory_release 90 python3 scripts/memory_release_check.py --model-path /tmp/rl_llama
      step weight_update 150 python3 scripts/gpu_weight_update.py --w0 /tmp/rl_llama --work /tmp/wu ;;
    orbax_load) step orbax_load 300 python3 scripts/orbax_load_bench.py --work /tmp/orbax_load ;;
    harness_deepseek) step harness_deepseek 240 python3 scripts/gpu_harness_deepseek.py --out "$out/harness_deepseek" --layers 3 ;;
    norm_mean) step norm_mean 120 python3 scripts/gpu_norm_mean.py ;;
    bisect_mla) step bisect_mla 200 python3 scripts/gpu_bisect_mla.py --out "$out/bisect_mla" ;;
    bisect_longcat) step bisect_longcat 200 python3 scripts/gpu_bisect_mla.py --case longcat --out "$out/bisect_longcat" ;;
    harness_deepseek_auto) step harness_deepseek_auto 240 python3 scripts/gpu_harness_deepseek.py --out "$out/harness_deepseek_auto" --layers 3 --only auto --child-timeout 120 200 ;;
    mla_decode) step mla_decode 300 python3 scripts/gpu_mla_decode.py --out "$out/mla_decode" --layers 8 --child-timeout 70 ;;
    harness_prod_*) step "$s" 300 python3 -m jengine.cli invariance --model "/tmp/acceptance/${s#harness_prod_}" --numerics rl-bitwise --max-new-tokens 8 ;;
    before_*|other_*)  # step ${s#*_} run by another tree of an A/B on the same machine:
      # .ab_before (or .ab_other), made here by `git archive REV | tar -x -C .ab_before` and
      # carried; results in $out/$s (one folder per such step: a second would overwrite a first)
      tree=${s%%_*}
      ln -sfn ../.whl ".ab_$tree/.whl"
      (cd ".ab_$tree" && bash scripts/gpu_run.sh "$out/$s" "${s#*_}" > "$out/$s.log" 2>&1)
      echo "| $s | rc=$? | see $s/summary.md |" | tee -a "$out/summary.md" ;;
    *) echo "unknown step $s" | tee -a "$out/summary.md" ;;
  esac
done
for f in "$out"/*.log; do echo "== $f"; tail -n 8 "$f"; done
# The device tool returns at most 8 files: everything goes back as one archive plus the summary.
# (Folders stay -- a before_<step>'s holds its own summary.md and archive -- unless empty.)
tar czf /tmp/results.tar.gz -C "$out" . \
  && find "$out" -mindepth 1 ! -type d ! -name summary.md -delete \
  && find "$out" -mindepth 1 -type d -empty -delete \
  && mv /tmp/results.tar.gz "$out/results.tar.gz"
cat "$out/summary.md"
