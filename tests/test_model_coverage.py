"""Model coverage generated from transformers' registry, not a hand-written list: every
causal-LM family whose config ships a `base_model_tp_plan` (plus BERT-MLM, T5 and GPT-2, which
have none), at a tiny shape, under FSDP full shard and delayed initialisation at world 2.

Each family must be exact against one process or refused by smp with a reason; a crash or a
silent mismatch fails. A fast subset runs by default; the whole matrix is `slow` + `coverage`
and runs only when selected (`pytest -m coverage`). scripts/model_coverage.py writes the same
matrix to docs/model-coverage.md.
"""

from __future__ import annotations

import pytest

from tests import model_coverage_cases as cases

MODES = {"fsdp": False, "delayed": True}  # mode -> delayed initialisation
FAST = ["llama", "qwen2", "gemma", "gpt2", "bert-mlm", "t5"]


def _all_families() -> list[tuple[str, str | None]]:
    return cases.registry_families() + [(f, None) for f in cases.EXTRA_FAMILIES]


def _check(ranks, family: str, reason: str | None, mode: str) -> None:
    reason = reason or cases.can_build(family)
    if reason:
        pytest.skip(reason)
    for result in ranks(2).run(cases.classify, config={}, family=family, delayed=MODES[mode]):
        assert result["status"] in ("exact", "refused"), f"{family} under {mode}: {result}"
        if result["status"] == "refused":
            assert len(result["detail"]) > 20, result  # the error names its reason


def test_registry_drives_the_matrix():
    families = dict(cases.registry_families())
    assert len(families) > 20 and "llama" in families and "qwen2" in families
    assert "gpt2" not in families  # no base_model_tp_plan: covered as an extra family
    assert set(FAST) <= set(families) | set(cases.EXTRA_FAMILIES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAST)
def test_fast_subset(ranks, family, mode):
    _check(ranks, family, dict(_all_families()).get(family), mode)


@pytest.mark.slow
@pytest.mark.coverage
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family,reason", _all_families(), ids=[f for f, _ in _all_families()])
def test_every_family(ranks, request, family, reason, mode):
    if "coverage" not in (request.config.option.markexpr or ""):
        pytest.skip("the whole matrix (~200 cells) runs only when selected: pytest -m coverage")
    _check(ranks, family, reason, mode)


@pytest.mark.parametrize("family", ["minimax", "olmo_hybrid"])
def test_constructor_draws_are_refused(family):
    """MiniMax builds an attention it then replaces, OLMo-Hybrid draws A_log/dt_bias in __init__:
    the replay of init calls would draw the random generator otherwise than eager construction,
    shifting every later value (silently, before this check). Refused, with the reason."""
    import torch

    from smp.errors import ConfigError
    from smp.sharding import materialize_meta_model

    with torch.device("meta"):
        model = cases.build_family(family)
    with pytest.raises(ConfigError, match="draws the random generator .* times, the replay"):
        materialize_meta_model(model, torch.device("cpu"), seed=0)


def test_matching_draws_materialise_like_eager():
    """Control: a family whose constructor draws only in init calls passes the check, bitwise."""
    import torch

    from smp.sharding import materialize_meta_model

    torch.manual_seed(0)
    eager = cases.build_family("qwen2")
    with torch.device("meta"):
        model = cases.build_family("qwen2")
    materialize_meta_model(model, torch.device("cpu"), seed=0)
    expected = eager.state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in model.state_dict().items())
