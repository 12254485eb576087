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
# Every program, not only those over 0.5 s: the suite's many small ones recur across tests, server
# and probe processes and both xdist workers (measured on two pairs of test files, one process,
# cold cache: 175 -> 155 s and 222 -> 201 s). Entries are written unlocked (no size limit: JAX's
# eviction rescans the folder on every write); a half-written one read by the other worker fails
# to load, and JAX then warns and compiles.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JENGINE_CACHE_DIR", str(_ROOT / ".cache" / "jengine"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402  (after the environment above, like everything else)


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """Two tiny random Qwen3 checkpoints, W0 and W1 (seeds 0 and 1), for the weight-update tests
    (tests/test_weight_update.py, tests/test_server_rl_live.py), which only read them."""
    from interop.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("checkpoints")
    return {w: make_tiny_hf_model(root / w, "Qwen3ForCausalLM", seed=i)
            for i, w in enumerate(("w0", "w1"))}


@pytest.fixture(scope="session")
def moe_ckpts(tmp_path_factory):
    """Two tiny random Qwen3-MoE checkpoints (8 experts, top-2), W0 and W1 (seeds 0 and 1), as
    transformers' save_pretrained writes them (one tensor per expert), for the MoE weight-layout
    and Orbax tests (tests/test_moe_weight_layouts.py, tests/test_orbax.py), which only read them."""
    from interop.testing import make_tiny_hf_model

    root = tmp_path_factory.mktemp("moe-checkpoints")
    return {w: make_tiny_hf_model(root / w, "Qwen3MoeForCausalLM", seed=i)
            for i, w in enumerate(("w0", "w1"))}
