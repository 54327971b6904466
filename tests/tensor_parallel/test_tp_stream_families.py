"""Tensor parallel on families whose code steps outside the usual layer shape, vs one process.

Each crashed inside torch before (issue #13's coverage matrix); each must now match one process
(loss and every gradient within 1e-5 over 2 SGD steps, with parameters split over the TP ranks):

* AFMoE (TP=2 + SP): a dense first layer, which its plan leaves whole, in the same `layers`
  list as the MoE layers: it gathers the sequence like its MoE siblings.
* HRM (TP=2 + SP): a bare parameter (`z_L_init`) added to the sequence-sharded stream at the
  model level: it joins as a Replicate DTensor.
* DeepSeek-V4 (TP=2 + SP): hyper-connections returning several per-token tensors, and a
  model-level `hc_head`: every per-token output rejoins the stream.
* Llama-4 (TP=2): `out = shared_expert(x); out.add_(...)` on a rowwise-closed region.
* Aria (TP=2, TP=2 x FSDP 2 + SP): experts stored [experts, in, out] with transformers'
  dimension-named styles (gate_up 'packed_rowwise', down 'colwise').
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from smp.tensor_parallel.moe import _by_role, expert_placement
from tests.models import model_coverage_cases as cases

TOL = 1e-5
CASES = [
    ("afmoe", "tp2-sp"), ("hrm_text", "tp2-sp"), ("deepseek_v4", "tp2-sp"), ("llama4_text", "tp2"),
    ("aria_text", "tp2"), ("aria_text", "tp2-fsdp2-sp"),
]  # Llama-4 + SP and the rest of the world-4 column: docs/model-coverage.md (pytest -m coverage)


@pytest.mark.parametrize("family,mode", CASES, ids=lambda v: v)
def test_family_matches_single_process(ranks, family, mode):
    world = cases.WORLD.get(mode, 2)
    for report in ranks(world).run(cases.equivalence, family=family, steps=2, timeout=400, **cases.MODES[mode]):
        assert report["tp_split"] > 0, report
        assert report["loss_diff"] < TOL and report["grad_diff"] < TOL, report
        assert report["losses"][-1] < report["losses"][0]  # it trains


def test_transposed_experts_split_the_intermediate_dim_by_either_naming():
    """Aria's shipped names (by tensor dim) and GPT-OSS-style names (by role) on [experts, in,
    out] weights both split the intermediate dim: gate_up's output (dim 2), down's input (dim 1)."""
    def placements(gate_up: str, down: str) -> tuple:
        return (expert_placement(_by_role("gate_up_proj", gate_up), 3, "gate_up_proj", transposed=True),
                expert_placement(_by_role("down_proj", down), 3, "down_proj", transposed=True))

    want = (_StridedShard(2, split_factor=2), Shard(1))
    assert placements("packed_rowwise", "colwise") == want  # transformers' shipped plan (Aria)
    assert placements("packed_colwise", "rowwise") == want  # by role (GPT-OSS user plan)
    # Negative control: read by role alone, Aria's names split the hidden dim (its crash before).
    assert expert_placement("packed_rowwise", 3, "gate_up_proj", transposed=True) == _StridedShard(1, split_factor=2)
    assert expert_placement("colwise", 3, "down_proj", transposed=True) == Shard(2)
