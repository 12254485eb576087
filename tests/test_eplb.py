"""EPLB (--enable-eplb, sharding/eplb.py): a rebalance moves no output bit under rl-bitwise, and
after a weight update (full or partial) the physical slots hold the new logical experts.

tests/eplb_probe.py measures on 8 fake CPU devices in a subprocess (a tiny float32 Qwen3-MoE, 8
experts, top-4, EP4 with 4 redundant experts), tests/eplb_update_probe.py the weight updates (EP2
on 2 devices in CI, EP4 on 8 under -m slow); the claims are asserted here, next to unit tests of
the placement, the dispatch and the launch's refusals."""

import json

import numpy as np
import pytest

from jengine.config import LaunchConfig, LaunchRefusal
from jengine.launch import plan_launch
from jengine.numerics import resolve_launch
from sharding import eplb
from tests.fake_devices import run_probe


@pytest.fixture(scope="module")
def probe():
    return run_probe("eplb_probe.py")


@pytest.mark.slow  # the 8-device EPLB engines (~50 s on 2 cores): run with -m slow
def test_a_rebalance_changes_no_bit_and_matches_ep1(probe):
    """Greedy and seeded T=1, with prompt and output logprobs: the EP4 engine rebalancing every 3
    steps (requests in flight) and once between requests gives the EP1 engine's ids and bits."""
    assert sorted(probe["eplb"]) == ["greedy_0", "greedy_1", "t1_0", "t1_1"]
    assert probe["eplb"] == probe["ep1"]
    assert all(case["output_token_logprobs"] for case in probe["ep1"].values())


@pytest.mark.slow  # the 8-device EPLB engines (~50 s on 2 cores): run with -m slow
def test_the_placement_really_changed(probe):
    maps = probe["eplb_maps"]
    assert probe["physical_slots"] == 12                       # 8 experts + 4 redundant
    assert maps[0][0] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # --init-expert-location trivial
    assert maps[1] != maps[0] and maps[2] != maps[1]            # on request; every 3 steps
    assert probe["eplb_rebalances"] > 2                         # more than one mid-request


@pytest.mark.slow  # the 8-device EPLB engines (~50 s on 2 cores): run with -m slow
def test_a_rebalance_compiles_no_step_program(probe):
    """Every prompt fits the same step buckets: the count after the first request (and the
    rebalances during it) is the count at the end, after a dozen more rebalances."""
    first, last = probe["eplb_step_programs"]
    assert first == last > 0


@pytest.mark.slow  # the 8-device EPLB engines (~50 s on 2 cores): run with -m slow
def test_rank_combine_control_changes_bits(probe):
    """The rank-order combine folds per-rank partials: a new placement re-associates the sum, so
    the same request's logprob bits change (which is why rl-bitwise refuses it with EPLB)."""
    run = probe["rank_control"]
    assert run["before"] != run["after"]


@pytest.fixture(scope="module")
def update_params():
    return run_probe("eplb_update_probe.py", "params", "2", "2", devices=2)


def test_a_partial_update_regathers_every_layers_slots(update_params):
    """EP2, 2 redundant experts, slot j holding expert (9 - j) % 8 (so slot e never holds expert
    e): after layer 1's experts (fused, as a transformers 5 trainer sends them), then all of W1
    from disk, every parameter bit -- physical slots and maps -- equals a fresh engine's started
    from those weights with that placement -- the untouched layer 0's slots too, which a gather from
    the held slots as if they were logical experts would scramble on this placement (measured: it
    did, before ExpertPlacementState.logical_experts). Controls: each update changed bits."""
    diff = update_params["differing"]
    assert update_params["placements"][0] == update_params["placements"][1]
    assert update_params["placements"][0][0] == [1, 0, 7, 6, 5, 4, 3, 2, 1, 0]
    assert diff["partial-fresh_partial"] == {} and diff["full-fresh_full"] == {}
    assert len(diff["w0-partial"]) == 3       # layer 1's gate_proj, up_proj and down_proj slots
    assert len(diff["partial-full"]) > 3 and update_params["params"] > 3


@pytest.mark.slow  # three 8-device EP4 engines generating (~60 s on 2 cores): run with -m slow
def test_updated_engine_serves_a_fresh_engines_bits_at_ep4():
    """EP4 with 4 redundant experts, rebalanced to the greedy placement of a request's load, then
    updated partially (layer 1's fused experts) and fully (W1 from disk): greedy and seeded T=1
    ids and logprob bits equal those of fresh engines started with that placement."""
    probe = run_probe("eplb_update_probe.py", "outputs", "4", "4")
    first, _ = probe["placements"]
    assert first == probe["placements"][1] and first[0][:8] != list(range(8))
    assert probe["partial"] == probe["fresh_partial"] and probe["full"] == probe["fresh_full"]
    assert probe["w0"] != probe["partial"] != probe["full"]


def test_balanced_placement_gives_heavy_experts_the_redundant_slots():
    """Loads 100 and 50 take the 4 redundant slots (expert 0: 4 replicas of 25, expert 4: 2 of
    25); the replicas, heaviest first, each go to the least loaded rank with a free slot."""
    p2l = eplb.balanced_placement([100, 10, 10, 10, 50, 10, 10, 0], 12, 4)
    assert p2l.tolist() == [0, 4, 6, 0, 4, 7, 0, 1, 3, 0, 2, 5]


def test_dispatch_takes_replica_row_mod_count():
    p2l = np.array([0, 1, 0, 2], np.int32)  # expert 0 in slots 0 and 2
    ids = np.array([[0, 1], [0, 2], [2, 0]], np.int32)
    assert np.asarray(eplb.dispatch(ids, p2l)).tolist() == [[0, 1], [2, 3], [3, 0]]


def test_initial_placement_from_json(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"physical_to_logical": [3, 2, 1, 0, 0, 1]}))
    got = eplb.initial_placement(str(path), layers=2, num_experts=4, num_physical=6)
    assert got.tolist() == [[3, 2, 1, 0, 0, 1]] * 2
    path.write_text(json.dumps({"physical_to_logical": [3, 2, 1, 1, 0, 1, 1]}))
    with pytest.raises(ValueError, match="must be 6 integers"):
        eplb.initial_placement(str(path), layers=2, num_experts=4, num_physical=6)
    path.write_text(json.dumps({"physical_to_logical": [3, 2, 1, 1, 1, 1]}))
    with pytest.raises(ValueError, match=r"logical experts \[0\] have no physical slot"):
        eplb.initial_placement(str(path), layers=2, num_experts=4, num_physical=6)


class _MoEConfig:  # what plan_launch reads of a MoE checkpoint
    architecture, num_experts, kv_lora_rank = "Qwen3MoeForCausalLM", 8, 0


@pytest.mark.parametrize("launch, refusal", [
    (dict(enable_eplb=True), r"^--enable-eplb True has no effect .*\(--ep-size > 1\)"),
    (dict(enable_eplb=True, ep_size=4, ep_num_redundant_experts=2),
     r"^--ep-num-redundant-experts 2: num_experts 8 \+ 2 = 10 physical slots do not split evenly "
     r"over --ep-size 4"),
    (dict(ep_size=4, ep_num_redundant_experts=4), r"^--ep-num-redundant-experts 4 has no effect"),
])
def test_launch_refusals(launch, refusal, monkeypatch):
    import jengine.launch

    monkeypatch.setattr(jengine.launch, "check_model", lambda resolved, m: None)
    resolved = resolve_launch(LaunchConfig(**launch), hardware="cpu", probe_xla_flags=False)
    with pytest.raises(LaunchRefusal, match=refusal):
        plan_launch(resolved, _MoEConfig)
