"""Activation checkpointing (full / selective) and offloading.

What is proven, and how:
- Gradients and loss are bitwise equal to mode `none` for every mode, alone and under FSDP2
  (full shard, hybrid 2x2, bf16 mixed precision): the same kernels run on the same values, only
  when they run (recompute) or where the saved values live (host) changes. Against the
  single-process run the usual FSDP tolerance holds (1e-5; bf16 2e-2).
- Recompute is counted in backward with a TorchDispatchMode (not forward hooks: non-reentrant
  recompute skips module hooks and stops early): `full` re-runs matmuls, `selective` re-runs
  pointwise ops but no matmul.
- Memory: bytes alive after forward, per block, measured from the tensors ops created
  (`SavedActivationMeter`): `full` keeps only each block's input; offloading keeps nothing on
  the device but the last block's output (the head still needs it).
- The loading horizon bounds the blocks resident in backward: exactly min(horizon, L), with no
  on-demand loads; a schedule that ignores the horizon is caught by the same measurement.
"""

from __future__ import annotations

import pytest
import torch

import smp
from smp.activations.checkpointing import is_checkpointed
from tests.training import activation_cases as cases
from tests.training.activation_cases import GLOBAL_BATCH, LAYERS, SEQ, single_process_run

OFF = {"activation_offloading": True, "activation_offload_min_bytes": 0}
FULL = {"activation_checkpointing": "full"}
SELECTIVE = {"activation_checkpointing": "selective"}
MODES = [{}, FULL, SELECTIVE, OFF, {**OFF, **FULL}, {**OFF, **SELECTIVE}]
DIM = {"plain": 32, "llama": 64}  # hidden sizes of the test models (fp32: 4 bytes)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("config,key", [
    ({"activation_loading_horizon": 0}, "activation_loading_horizon"),
    ({"activation_checkpointing": "fancy"}, "activation_checkpointing.mode"),
    ({"activation_checkpointing": {"mode": "full", "every_n_layers": 0}}, "every_n_layers"),
    ({"activation_checkpointing": {"mode": "selective", "save_ops": ["aten.no_such_op"]}}, "save_ops"),
    ({"activation_checkpointing": {"mode": "selective", "save_ops": ["mm"]}}, "save_ops"),
    ({"activation_offload_min_bytes": -1}, "activation_offload_min_bytes"),
    ({"activation_ofloading": True}, "activation_offloading"),  # typo: suggests the key
])
def test_bad_values_raise_config_error(config, key):
    with pytest.raises(smp.ConfigError, match=key):
        smp.load_config(config)


def test_spellings():
    assert smp.load_config({"activation_checkpointing": "full"}).activation_checkpointing.mode == "full"
    assert smp.load_config({"activation_checkpointing": True}).activation_checkpointing.mode == "full"
    assert smp.load_config({"activation_offloading": True}).activation_offloading
    cfg = smp.load_config({"activation_checkpointing": {"mode": "selective", "save_ops": ["aten.mm.default"]}})
    assert cfg.activation_checkpointing.save_ops == ["aten.mm.default"]


# --------------------------------------------------------------------------- single process


@pytest.fixture(scope="module")
def plain_modes():
    return single_process_run("plain", MODES)


def test_every_mode_is_bitwise_equal_to_none(plain_modes):
    for mode, result in zip(MODES, plain_modes):
        assert result["loss_bitwise"] and result["grads_bitwise"], (mode, result["grad_diff"])
        # Parameter names / state-dict keys are untouched (checkpoints stay compatible).
        assert result["state_dict_keys"] == plain_modes[0]["state_dict_keys"], mode


def test_recompute_is_counted_in_backward(plain_modes):
    none, full, selective = plain_modes[:3]
    # full re-runs the block's matmuls in backward (all but the last: recompute stops early).
    assert full["backward_matmuls"] - none["backward_matmuls"] >= 2 * LAYERS
    # selective keeps matmul outputs: no matmul runs twice ...
    assert selective["backward_matmuls"] == none["backward_matmuls"]
    # ... but the cheap pointwise ops are recomputed; without checkpointing they never run in backward.
    assert none["backward_ops"].get("aten.gelu", 0) == 0
    assert selective["backward_ops"]["aten.gelu"] == LAYERS
    assert full["backward_ops"]["aten.gelu"] == LAYERS


def test_checkpointing_keeps_block_inputs_only(plain_modes):
    none, full, selective = plain_modes[:3]
    block_input = GLOBAL_BATCH * SEQ * DIM["plain"] * 4
    assert full["live_per_layer"] == [block_input] * LAYERS  # each block's output = next input
    assert all(n >= 8 * f for n, f in zip(none["live_per_layer"], full["live_per_layer"]))
    assert all(f < s < n for n, f, s in zip(none["live_per_layer"], full["live_per_layer"],
                                           selective["live_per_layer"]))


def test_offloading_moves_saved_activations_to_host(plain_modes):
    none, offload, offload_full = plain_modes[0], plain_modes[3], plain_modes[4]
    block_output = GLOBAL_BATCH * SEQ * DIM["plain"] * 4
    # Nothing saved stays on the device; the last block's output is alive because the head uses it.
    assert offload["live_per_layer"] == [0] * (LAYERS - 1) + [block_output]
    stats = offload["stats"]
    assert stats["offloaded_bytes"] == stats["saved_bytes"] and min(stats["saved_bytes"]) > block_output
    assert stats["resident_bytes"] == [0] * LAYERS
    assert sum(none["live_per_layer"]) > 20 * block_output
    # With checkpointing, the only saved tensors of a block are its input: that is what moves.
    assert offload_full["stats"]["saved_bytes"] == [block_output] * LAYERS
    assert offload_full["stats"]["offloaded_bytes"] == [block_output] * LAYERS


def test_small_tensors_stay_on_device():
    none, offload = single_process_run("plain", [{}, {**OFF, "activation_offload_min_bytes": 1 << 30}])
    assert offload["stats"]["offloaded_bytes"] == [0] * LAYERS
    assert offload["stats"]["saved_bytes"] == offload["stats"]["resident_bytes"]
    assert offload["live_per_layer"] == none["live_per_layer"]
    assert offload["grads_bitwise"]


@pytest.mark.parametrize("horizon", [1, 2, 3, LAYERS + 1])
def test_loading_horizon_bounds_resident_layers(horizon):
    none, offload = single_process_run("plain", [{}, {**OFF, "activation_loading_horizon": horizon}])
    stats = offload["stats"]
    assert stats["max_layers_resident"] == min(horizon, LAYERS), stats
    assert stats["demand_loads"] == 0 and stats["prefetch_loads"] > 0  # all loaded ahead of need
    assert offload["grads_bitwise"]


def test_horizon_check_catches_a_greedy_schedule():
    """The measurement is not vacuous: a loader that ignores the horizon is seen exceeding it."""

    def ignore_horizon(model):
        if hasattr(model, "_smp_activation_offloader"):
            model._smp_activation_offloader.horizon = LAYERS

    _, broken = single_process_run("plain", [{}, {**OFF, "activation_loading_horizon": 2}], mutate=ignore_horizon)
    assert broken["stats"]["max_layers_resident"] == LAYERS > 2


def test_every_n_layers():
    none, every2 = single_process_run(
        "plain", [{}, {"activation_checkpointing": {"mode": "full", "every_n_layers": 2}}]
    )
    block_input = GLOBAL_BATCH * SEQ * DIM["plain"] * 4
    live = every2["live_per_layer"]
    assert live[0] == live[2] == block_input and live[1] == none["live_per_layer"][1]
    assert every2["grads_bitwise"]


def test_llama_modes_and_recompute():
    results = single_process_run("llama", [{}, FULL, SELECTIVE, {**OFF, **SELECTIVE}], layers=2)
    none, full, selective, offload_selective = results
    for result in results:
        assert result["grads_bitwise"] and result["loss_bitwise"]
    assert full["backward_matmuls"] > none["backward_matmuls"]
    assert selective["backward_matmuls"] == none["backward_matmuls"]
    assert selective["backward_ops"]["aten.silu"] == 2 and none["backward_ops"].get("aten.silu", 0) == 0
    assert offload_selective["stats"]["offloaded_bytes"] == [GLOBAL_BATCH * SEQ * DIM["llama"] * 4] * 2


def test_selective_in_eager_warns_with_the_numbers(caplog):
    """Eager selective checkpointing is slower than full on a host-bound step (measured): the
    transform says so, with the figures and what to pick; full, and selective under compile,
    say nothing (negative control)."""
    from smp.testing.models import tiny_llama

    said = {}
    for name, config in {"selective": SELECTIVE, "full": FULL,
                         "selective compiled": {**SELECTIVE, "compile": {"enabled": True, "backend": "aot_eager"}}}.items():
        caplog.clear()
        with caplog.at_level("WARNING", logger="smp"), smp.session(config):
            smp.transform(tiny_llama(num_hidden_layers=2))
        said[name] = " ".join(r.getMessage() for r in caplog.records if "selective in eager" in r.getMessage())
    assert "selective 1.57x, full 1.19x" in said["selective"] and "pick full" in said["selective"], said
    assert said["full"] == "" and said["selective compiled"] == "", said


def test_no_grad_and_deepcopy():
    import copy

    from smp.sharding import find_blocks
    from smp.testing.models import TinyTransformer

    model = TinyTransformer(layers=2)
    cfg = smp.load_config({**FULL, **OFF})
    cases.apply_activations(model, find_blocks(model), cfg)
    twin = copy.deepcopy(model)
    assert all(is_checkpointed(b) for b in twin.layers)
    assert twin.layers[0].forward.module is twin.layers[0]  # the copy recomputes itself
    x = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))
    assert model._smp_activation_offloader.stats.total_saved_bytes == 0  # nothing saved without grad


# --------------------------------------------------------------------------- under FSDP2

DIST_MODES = [{}, FULL, SELECTIVE, OFF, {**OFF, **FULL}]


def _check_dist(reports, modes=DIST_MODES, loss_tol=1e-5, grad_tol=1e-5):
    """modes[0] must be none and modes[1] full."""
    for rank_reports in reports:
        for mode, report in zip(modes, rank_reports):
            assert report["grads_bitwise"] and report["loss_bitwise"], (mode, report["grad_diff"])
            assert report["loss_vs_single"] < loss_tol and report["grad_vs_single"] < grad_tol, (mode, report)
            stats = report["stats"]
            if stats is not None:
                assert stats["max_layers_resident"] == 2 and stats["demand_loads"] == 0, (mode, stats)
                assert stats["resident_bytes"] == [0] * LAYERS
        none, full = rank_reports[0], rank_reports[1]
        assert full["backward_matmuls"] > none["backward_matmuls"]
        assert max(full["live_per_layer"]) * 8 <= min(none["live_per_layer"])


@pytest.mark.parametrize("kind", ["plain", "llama"])
def test_fsdp_full_shard(ranks, kind):
    _check_dist(ranks(2).run(cases.run_modes, base={}, modes=DIST_MODES, kind=kind))


@pytest.mark.slow
def test_fsdp_hybrid_2x2(ranks):
    modes = [{}, FULL, {**OFF, **SELECTIVE}]  # 4 ranks share 2 cores: the mixes only, one step
    _check_dist(ranks(4).run(cases.run_modes, base={"hybrid_shard_degree": 2},
                             modes=modes, kind="llama", steps=1), modes)


def test_fsdp_bf16_mixed_precision(ranks):
    base = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
    reports = ranks(2).run(cases.run_modes, base=base, modes=DIST_MODES, kind="plain")
    _check_dist(reports, loss_tol=2e-2, grad_tol=2e-2)
    assert reports[0][0]["loss_vs_single"] > 0  # bf16 really ran


@pytest.mark.slow
def test_tensor_parallel_with_checkpointing_and_offloading(ranks):
    """TP 2 (Llama's own plan): saved activations are DTensors / sharded locals; bitwise vs none."""
    modes = [{}, FULL, {**OFF, **SELECTIVE}, OFF]
    for rank_reports in ranks(2).run(cases.run_modes, base={"tensor_parallel_degree": 2}, modes=modes,
                                     kind="llama", steps=1):
        for mode, report in zip(modes, rank_reports):
            assert report["grads_bitwise"] and report["loss_bitwise"], (mode, report["grad_diff"])
            assert report["loss_vs_single"] < 1e-5 and report["grad_vs_single"] < 1e-5, (mode, report)
        assert rank_reports[1]["backward_matmuls"] > rank_reports[0]["backward_matmuls"]
        assert rank_reports[3]["stats"]["max_layers_resident"] == 2
        assert sum(rank_reports[3]["stats"]["offloaded_bytes"]) > 0


def test_hf_kv_cache_is_turned_off_under_checkpointing():
    from smp.activations import apply_activation_checkpointing
    from smp.sharding import find_blocks
    from smp.testing.models import tiny_llama

    model = tiny_llama()
    assert model.config.use_cache
    apply_activation_checkpointing(model, find_blocks(model), mode="full")
    assert not model.config.use_cache  # recompute would otherwise append to the cache twice


def test_delayed_init_and_transform_route(ranks):
    """The user's route: meta-device model, smp.transform materialises it; still the single-process run."""
    from tests.sharding import dist_cases

    config = {**FULL, **OFF, "delayed_param_initialization": True}
    for report in ranks(2).run(dist_cases.equivalence, config=config, kind="llama", delayed=True):
        assert report["loss_diff"] < 1e-5 and report["grad_diff"] < 1e-5, report
        assert report["losses"][1] < report["losses"][0]
