"""Expert parallelism (--ep-size) of a tiny Qwen3-MoE on 8 fake CPU devices: EP1 = EP2 = EP4 = EP8
bitwise with the slot-order combine, the rank-order combine as its control, the all-to-all dispatch
in the step program and alone (rows not a multiple of E, a row's slots all on one rank), and the
invariance harness at EP4; the same for a tiny DeepSeek-V3 (MLA, a dense layer, two MoE layers
with a shared expert) at EP1 = EP4. tests/ep_probe.py measures both models in one subprocess (one
start of 8 fake devices, shared by the module's fixtures); the claims are asserted here."""

import pytest

from tests.fake_devices import run_probe


@pytest.fixture(scope="module")
def ep_runs():
    return run_probe("ep_probe.py", "ep_sizes")


@pytest.fixture(scope="module")
def harness_runs():
    """The invariance harness at EP4 of both models: four more MoE engines, so `-m slow`."""
    return run_probe("ep_probe.py", "harness")


@pytest.fixture(scope="module")
def probe(ep_runs):
    return ep_runs["qwen3_moe"]


@pytest.fixture(scope="module")
def harness(harness_runs):
    return harness_runs["qwen3_moe"]


def test_experts_are_split_over_the_expert_axis(probe):
    run = probe["slot_ep4"]
    assert run["expert_weight_spec"] == "P('expert', None, None)"
    assert run["expert_weight_local_experts"] == 2  # 8 experts over 4 ranks
    assert run["parallelism"]["mesh"] == {"data": 1, "expert": 4, "tensor": 1}


def test_ep1_ep2_ep4_ep8_are_bitwise_equal_with_the_slot_combine(probe):
    """Teacher-forced logits (float32, top-4 routing) at EP 1, 2, 4 and 8: every bit equal, and
    each EP size batch-invariant (a prompt alone vs packed after another)."""
    for ep in (1, 2, 4, 8):
        run = probe[f"slot_ep{ep}"]
        assert run["elements"] > 0
        assert (run["differing_vs_ep1"], run["batch_differing"]) == (0, 0), ep


def test_rank_combine_is_batch_invariant_but_not_ep_invariant(probe):
    """The negative control: folding per-rank partials in rank order changes the association with
    the placement, so EP4 differs from EP1 (measured: most logits), while staying batch-invariant."""
    run = probe["rank_ep4"]
    assert run["differing_vs_ep1"] > 0
    assert run["batch_differing"] == 0


def test_step_program_dispatches_by_all_to_all(probe):
    """The EP4 step (16-token bucket, 64 wide, top-4; two MoE layers): per layer, the rows and their
    ids and weights go out and the outputs come back by all-to-all in [E, C = 16/4 * 4, ...]
    buffers, and the only all-gather is of the folded [T, H] outputs -- no [E, T, k, H] gather."""
    moved = probe["slot_ep4"]["collectives"]
    assert moved["all_to_all"] == ["4x16x64xf32", "4x16xi32", "4x16xf32", "4x16x64xf32"] * 2
    assert moved["all_gather"] == ["16x64xf32"] * 2


@pytest.mark.parametrize("routing", ["mixed", "one_owner"])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_all_to_all_dispatch_puts_every_slot_where_one_device_does(probe, routing, ep):
    """13 rows (no multiple of E), k = 4 of 32 stand-in experts: every slot's output and id reach
    the fold in the bits one device computes, with a row's k slots all on one rank (`mixed`: the
    first and the last rank) and every pair on rank 0 (`one_owner`: full buffers); the control is
    the same comparison catching two slots exchanged."""
    run = probe["dispatch"][f"{routing}_ep{ep}"]
    assert (run["differing"], run["slots_differing"]) == (0, 0)
    assert run["differing_if_slots_swapped"] > 0


@pytest.mark.slow
def test_invariance_harness_at_ep4(harness):
    run = harness["rl-bitwise ep4"]
    assert run["modes"] == ["overlap-off", "packed", "prefix-hit", "rerun"] and run["compared_values"] > 0
    assert run["divergences"] == [], run["table"]


@pytest.mark.slow
def test_invariance_harness_auto_control_at_ep4(harness):
    run = harness["auto ep4 f32"]
    assert run["compared_values"] > 0
    assert run["divergences"], run["table"]


# DeepSeek-V3: the routed experts split over the expert axis, the shared experts, the router and the
# latent KV pool whole on every rank.
@pytest.fixture(scope="module")
def deepseek_probe(ep_runs):
    return ep_runs["deepseek_v3"]


@pytest.fixture(scope="module")
def deepseek_harness(harness_runs):
    return harness_runs["deepseek_v3"]


def test_deepseek_ep1_ep4_bitwise_equal_and_rank_combine_differs(deepseek_probe):
    ep4 = deepseek_probe["slot_ep4"]
    assert ep4["expert_weight_spec"] == "P('expert', None, None)"
    assert ep4["expert_weight_local_experts"] == 4  # 16 experts over 4 ranks
    for ep in (1, 4):
        run = deepseek_probe[f"slot_ep{ep}"]
        assert run["elements"] > 0
        assert (run["differing_vs_ep1"], run["batch_differing"]) == (0, 0), ep
    rank = deepseek_probe["rank_ep4"]
    assert rank["differing_vs_ep1"] > 0 and rank["batch_differing"] == 0


@pytest.mark.slow
def test_deepseek_invariance_harness_at_ep4(deepseek_harness):
    run = deepseek_harness["rl-bitwise ep4"]
    assert {"packed", "prefix-hit", "rerun"} <= set(run["modes"]) and run["compared_values"] > 0
    assert run["divergences"] == [], run["table"]
    control = deepseek_harness["auto ep4 f32"]
    assert control["compared_values"] > 0 and control["divergences"], control["table"]
