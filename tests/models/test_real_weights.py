"""Fine-tuning a real pretrained model: SmolLM2-135M-Instruct (from the package index, see
tests/models/real_weights.py), built on the meta device and filled by `smp.transform(model,
weights=folder)`, under FSDP 2, TP 3 (its 9 heads and 3 KV heads split three ways) and PP 2:
one training step equals `from_pretrained` of the same folder in one process (loss and every
gradient), with a negative control. Opt-in (downloads ~93 MB once): pytest -m real_weights."""

from __future__ import annotations

import pytest

from tests.models import real_weights_cases as cases

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5

LAYOUTS = {
    "fsdp2": (2, {"random_seed": 0}),
    "tp3": (3, {"tensor_parallel_degree": 3}),
    "pp2": (2, {"pipeline_parallel_degree": 2, "pipeline": {"microbatches": 2}}),
}


@pytest.fixture(scope="module")
def folder(request):
    if "real_weights" not in (request.config.option.markexpr or ""):
        pytest.skip("downloads a real model (~93 MB) once: runs only when selected, pytest -m real_weights")
    from tests.models.real_weights import smollm2_folder

    return smollm2_folder()


@pytest.mark.real_weights
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_real_model_fine_tunes_like_one_process(ranks, folder, layout):
    world, config = LAYOUTS[layout]
    results = ranks(world).run(cases.fine_tune_step, config=config, folder=folder, timeout=600)
    for r in results:
        assert r["ref_loss"] < 6.0, r  # real weights on English text (random init: ~10.8)
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_TOL, r
        assert r["grad_gap"] <= GRAD_TOL, r


@pytest.mark.real_weights
def test_a_missed_tensor_is_caught(ranks, folder):
    """Negative control: the final norm left at its init value after the load."""
    world, config = LAYOUTS["fsdp2"]
    results = ranks(world).run(cases.fine_tune_step, config=config, folder=folder, broken="unloaded_norm", timeout=600)
    assert all(abs(r["loss"] - r["ref_loss"]) > LOSS_TOL for r in results), results
