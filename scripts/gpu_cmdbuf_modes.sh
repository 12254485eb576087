#!/usr/bin/env bash
# Which values of --xla_gpu_command_buffer_update_mode this jaxlib accepts, and the bench's decode
# dispatch column under each (docs/performance.md, "update-free command buffers"). XLA names the
# modes differently across releases, so every name seen in XLA's sources is tried: a value XLA does
# not know stops a one-line probe, which is cheaper than a bench start.
# Usage: bash scripts/gpu_cmdbuf_modes.sh OUT_DIR
set -u
out=$1
mkdir -p "$out"
XLA_FLAGS="--xla_jengine_no_such_flag=1" python3 -c "import jax; jax.devices()" > "$out/xla_help.txt" 2>&1
grep -i -A2 "command_buffer\|graph_min\|graph_level" "$out/xla_help.txt" > "$out/xla_cmdbuf_flags.txt"
cut -c1-400 "$out/xla_cmdbuf_flags.txt"
for mode in NEVER_UPDATE SKIP_TEMP SKIP_PROFILED CAPTURE_CMD_NEVER_UPDATE VMM_PERSISTENT_TEMP FULL_UPDATE_FREE; do
  flags="--xla_gpu_command_buffer_update_mode=$mode"
  if ! XLA_FLAGS="$flags" timeout 60 python3 -c "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x * 2 + 1)(jnp.ones(4)))" > "$out/probe_$mode.log" 2>&1; then
    echo "mode $mode: refused ($(grep -m1 -o 'Unknown flag.\{0,120\}\|Illegal.\{0,120\}\|not a valid.\{0,120\}\|Unsupported.\{0,120\}' "$out/probe_$mode.log"))"
    continue
  fi
  echo "mode $mode: accepted; bench"
  XLA_FLAGS="$flags" timeout 150 python3 -m jengine.cli bench --parts model --iters 10 --batch-sizes 1 64 --long-context 0 --prefill-tokens 0 --part-timeout 70 --out "$out/model_$mode" > "$out/model_$mode.log" 2>&1
  echo "mode $mode: bench rc=$?"
  grep -h "decode" "$out/model_$mode/bench.md" 2>/dev/null | head -8
done
