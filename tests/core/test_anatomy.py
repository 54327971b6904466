"""The model's anatomy (smp/anatomy.py) finds the parts the old finders found.

tests/fixtures/model_parts.json was recorded by scripts/record_model_parts.py with the finders
smp had before the anatomy existed (sharding/blocks.find_blocks, pipeline/split.find_parts,
tensor_parallel/tp_plan._head_name, two `is_norm`), for every family of the model-coverage matrix
at its tiny config, on the meta device. The same script, run on today's code (where every one of
those reads the anatomy), must record the same parts.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from smp import anatomy
from tests import REPO_ROOT

ROOT = REPO_ROOT
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "model_parts.json").read_text())

# What the anatomy changes on purpose: the pipeline's FLOPs count no longer counts a family's own
# `...LayerNorm` class (CohereLayerNorm) as matmul FLOPs: pipeline/split.py's old `is_norm` knew
# only `...RMSNorm`, tensor_parallel/rules.py's knew both. Their split (layer ranges) and
# parameter counts are as recorded; their FLOPs are lower by the norms' weights.
FEWER_FLOPS = {"cohere", "cohere2", "cohere2_moe"}


def _recorder():
    spec = importlib.util.spec_from_file_location("record_model_parts", ROOT / "scripts" / "record_model_parts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECORDER = _recorder()
BUILT = sorted(f for f, r in FIXTURE.items() if "build" not in r)


def _without_flops(record: dict) -> dict:
    """`record` with each pipeline stage's FLOPs left out (see FEWER_FLOPS)."""
    pipeline = record.get("pipeline")
    if isinstance(pipeline, dict) and isinstance(pipeline.get("stages"), list):
        record = {**record, "pipeline": {**pipeline, "stages": [s[:3] for s in pipeline["stages"]]}}
    return record


def _record_now(family: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = RECORDER.build_on_meta(family, FIXTURE[family]["kind"])
        return json.loads(json.dumps({"kind": FIXTURE[family]["kind"], **RECORDER.parts_of(model)}))


@pytest.mark.parametrize("family", BUILT)
def test_anatomy_finds_what_the_old_finders_found(family):
    now, before = _record_now(family), FIXTURE[family]
    if family not in FEWER_FLOPS:
        assert now == before
        return
    assert _without_flops(now) == _without_flops(before)
    assert all(n[3] < b[3] for n, b in zip(now["pipeline"]["stages"], before["pipeline"]["stages"]))


def test_fixture_covers_the_matrix():
    """The record spans the matrix: causal LMs and vision / speech families, splittable and not."""
    kinds = {r["kind"] for r in FIXTURE.values()}
    assert len(BUILT) >= 250 and {"causal", "image-text", "contrastive"} <= kinds
    splittable = [f for f in BUILT if "layers" in FIXTURE[f]["pipeline"]]
    assert len(splittable) >= 80 and len(BUILT) - len(splittable) >= 80


def test_a_wrong_anatomy_changes_the_record(monkeypatch):
    """Negative control: an anatomy that does not recognise norms changes what the record shows
    (sequence parallel's norm assignments; the pipeline's FLOPs), so the comparison above can fail."""
    monkeypatch.setattr(anatomy, "is_norm", lambda module: False)
    monkeypatch.setattr("smp.tensor_parallel.rules.is_norm", lambda module: False)
    monkeypatch.setattr("smp.pipeline.split.is_norm", lambda module: False)
    now = _record_now("llama")
    assert now["tp_sp"] != FIXTURE["llama"]["tp_sp"]
    assert now["pipeline"]["stages"] != FIXTURE["llama"]["pipeline"]["stages"]


def test_a_wrong_head_changes_the_record(monkeypatch):
    """Negative control: an anatomy that names no head changes the TP assignments."""
    real = anatomy.describe
    monkeypatch.setattr("smp.tensor_parallel.tp_plan.describe",
                        lambda model, *a: real(model, *a).__class__(**{**vars(real(model, *a)), "head": None}))
    assert _record_now("gpt2")["tp"] != FIXTURE["gpt2"]["tp"]


def test_one_is_norm():
    """The steps share the anatomy's `is_norm`: torch's norms and a family's own *Norm classes."""
    from smp.pipeline import split
    from smp.tensor_parallel import rules

    assert split.is_norm is anatomy.is_norm and rules.is_norm is anatomy.is_norm

    class CohereLayerNorm(nn.Module):
        pass

    assert all(anatomy.is_norm(m) for m in (nn.LayerNorm(4), nn.RMSNorm(4), CohereLayerNorm()))
    assert not anatomy.is_norm(nn.Linear(4, 4))


def test_anatomy_of_a_causal_lm():
    """One picture of LLaMA: blocks, pipeline parts, embedding, head, final norm, attention and
    MLP modules, ties; a plain model without one layer list records why it cannot be split."""
    from smp.testing.models import tiny_llama

    with torch.device("meta"):
        model = tiny_llama()
    a = anatomy.describe(model)
    assert a.blocks == ("model.layers.0", "model.layers.1")
    assert a.layers == "model.layers" and a.final_norm == "model.norm"
    assert (a.embedding, a.head, a.decoder) == ("model.embed_tokens", "lm_head", "model")
    assert a.attention == ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert a.mlp == ("model.layers.0.mlp", "model.layers.1.mlp")
    assert a.towers == () and a.scalars == () and a.experts == ()
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    refused = anatomy.describe(plain)
    assert refused.pipeline is None and "0 nn.ModuleList children" in refused.pipeline_refusal
    with pytest.raises(anatomy.ConfigError, match="nn.ModuleList"):
        refused.require_pipeline()
