"""Test-session setup: CPU platform, the rl-bitwise XLA flags, a persistent compilation cache.

XLA reads its flags once per process, so the flags rl-bitwise needs on the CPU are exported here,
before anything imports jax: an rl-bitwise Engine built later in this process then finds them in
place (auto engines don't care about them). The compilation cache lives in the checkout's ignored
.cache/ folder so a second run of the suite compiles little.
"""

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_BITWISE_CPU_FLAGS = ("--xla_allow_excess_precision=false --xla_cpu_enable_fast_min_max=false "
                      "--xla_cpu_enable_fast_math=false")
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _BITWISE_CPU_FLAGS).strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JENGINE_CACHE_DIR", str(_ROOT / ".cache" / "jengine"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
