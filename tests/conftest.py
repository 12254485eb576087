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


# -- pytest-xdist (.ci/run: `-n 2 --dist loadfile`) ------------------------------------------------
# Each file runs whole on one worker: most files share a module-scoped engine, server or probe
# between their tests, which a second worker would build again. The two workers take files in
# collection order, one at a time, so a file of several minutes taken last leaves one core idle
# while it finishes: the heaviest files (the last CI's --durations, seconds on 2 loaded cores)
# start first. A stale list costs minutes, never a result.
HEAVIEST_FIRST = (
    "test_docs.py",                # ~300 s: every README/docs block, a server or two
    "test_tp_engine.py",           # ~230 s: TP engines and harnesses on 8 fake devices
    "test_production_shapes.py",   # ~230 s: vocab 151936 / 128256 align + harness
    "test_invariance.py",          # ~180 s: the harness, every mode and family
    "test_expert_parallel.py",     # ~160 s
    "test_attention_shapes.py",    # ~150 s: Triton interpreter cases
    "test_mla_align.py",           # ~140 s
    "test_longcat_flash.py",       # ~90 s
    "test_server_abuse.py",        # ~80 s
    "test_bench.py",               # ~65 s
)


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile":  # the xdist controller
        config.option.loadscopereorder = False  # xdist would sort files by test count instead


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):
        return  # not an xdist worker: one process runs everything anyway, in pytest's order
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep order
