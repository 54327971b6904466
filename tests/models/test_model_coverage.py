"""Model coverage generated from transformers' registry, not a hand-written list: every
causal-LM family whose config ships a `base_model_tp_plan` (plus BERT-MLM, T5 and GPT-2, which
have none), at a tiny shape, under FSDP full shard, delayed initialisation, TP=2 with the
model's own plan, TP=2 + sequence parallel, and full checkpointing + activation offloading, at
world 2, and FSDP hybrid sharding (2 replicas x 2 shards) and TP=2 x FSDP 2 + sequence
parallel at world 4. Beside them, transformers' own TP=2 (the peer): wherever it is exact,
smp's TP=2 must be exact too. Two columns for what fine-tuning runs bring: packed sequences
through smp.step (TP=2 + SP, FSDP 2 for a family not exact there), held to one process whose
own packed run is first held to the documents run one by one; and PEFT LoRA on every linear
but the head under TP=2. Their negative controls: positions left global (a mismatch), a
reference that attends across the documents (not packing-aware, never exact), a row-wise
adapter's output left unreduced (a mismatch).

Each family must be exact against one process or refused by smp with a reason; a crash, a
silent mismatch, or a mode that did nothing (TP split no parameter, nothing offloaded) fails.
A fast subset runs by default; the whole matrix is `slow` + `coverage` and runs only when
selected (`pytest -m coverage`). scripts/model_coverage.py writes the same matrix to
docs/model-coverage.md.

The page's second table (vision, multimodal and speech families, tests/models/model_coverage_vlm_cases.py,
`scripts/model_coverage.py --section vision`) is checked here by its machinery: the registry
enumeration, one fast cell (ViT under FSDP), the renderer, and its negative controls (a rank
whose images are dropped, a contrastive loss without the gather: both mismatch, not exact); and
by smp's refusal of BatchNorm in training mode under data parallelism, which that table found.
"""

from __future__ import annotations

import pytest

from tests.models import model_coverage_cases as cases
from tests import REPO_ROOT

# mode -> the families the default suite runs it on: each TP branch (the model's own plan,
# smp's table for GPT-2, the refusal for a family with no plan), T5's nested configs under
# checkpointing.
FAST = {
    "fsdp": ["llama", "qwen2", "gemma", "gpt2", "bert-mlm", "t5"],
    "delayed": ["llama", "qwen2", "gemma", "gpt2", "bert-mlm", "t5"],
    "tp2": ["qwen2", "gpt2", "t5"],
    "tp2-sp": ["llama", "gpt2"],
    "ac-offload": ["llama", "t5"],
    "tp2-fsdp2-sp": ["llama"],
    "hybrid": ["llama"],
    "peer": ["qwen3"],  # per-head q/k norms: `replicated_with_grad_allreduce` in both TPs
    "packed": ["llama"],
    "lora-tp2": ["llama"],
}


def _all_families() -> list[tuple[str, str | None]]:
    return cases.registry_families() + [(f, None) for f in cases.EXTRA_FAMILIES]


def _check(ranks, family: str, reason: str | None, mode: str) -> None:
    reason = reason or cases.can_build(family)
    if reason:
        pytest.skip(reason)
    if mode == "peer":
        return _check_covers_peer(ranks, family)
    world = cases.WORLD.get(mode, 2)
    case = cases.CASE_FUNCTIONS.get(mode, cases.classify)  # pp2: tests/models/model_coverage_pp_cases.py
    for result in ranks(world).run(case, family=family, timeout=240, **cases.MODES[mode]):
        # "not run": the column does not apply, for a reason outside smp (packed rows that
        # transformers' own model mixes, a plan that splits no adapted layer, PEFT's own refusal)
        assert result["status"] in ("exact", "refused", "not run"), f"{family} under {mode}: {result}"
        if result["status"] != "exact":
            assert len(result["detail"]) > 20, result  # the error names its reason


def _check_covers_peer(ranks, family: str) -> None:
    """The peer column's claim: where transformers' own TP=2 is exact, smp's TP=2 is exact too
    (the peer's own crashes and mismatches are findings about it, recorded in the docs)."""
    peer = ranks(2).run(cases.peer_tp2, family=family, timeout=240)
    if any(r["status"] != "exact" for r in peer):
        pytest.skip(f"transformers' own TP=2 is not exact on {family}: {peer[0]['status']}")
    for result in ranks(2).run(cases.classify, family=family, timeout=240, **cases.MODES["tp2"]):
        assert result["status"] == "exact", f"{family}: the peer is exact, smp's TP=2 is not: {result}"


def test_peer_comparison_catches_a_corrupt_shard(ranks):
    """Negative control for the peer column: one rank's shard of one split parameter nudged by
    1e-3 after loading must read as a mismatch, not exact."""
    for result in ranks(2).run(cases.peer_tp2, family="qwen3", corrupt_shard=True, timeout=240):
        assert result["status"] == "mismatch", result
        assert result["detail"]["grad_diff"] > cases.TOL or result["detail"]["loss_diff"] > cases.TOL, result


def test_packed_under_fsdp_is_exact(ranks):
    """The packed column's other layout (a family not exact at TP 2 + SP runs under FSDP 2): exact
    too, and the cell names the layout."""
    for result in ranks(2).run(cases.packed, family="llama", layout="fsdp", timeout=240):
        assert result["status"] == "exact" and result["note"] == "under FSDP 2", result


def test_packed_positions_left_global_are_caught(ranks):
    """Negative control for the packed column: the smp run's positions count over the whole row
    (not restarting at each document) must read as a mismatch, not exact."""
    for result in ranks(2).run(cases.packed, family="llama", global_positions=True, timeout=240):
        assert result["status"] == "mismatch" and result["detail"]["grad_diff"] > 1e-3, result


def test_packed_reference_attending_across_documents_is_not_exact(ranks):
    """Negative control for the packed column's reference: a one-process run that attends across
    the documents (built with a cache, transformers then ignores them in position_ids) differs
    from the documents run one by one, so the cell is "not packing-aware", never exact."""
    for result in ranks(2).run(cases.packed, family="llama", cache_in_reference=True, timeout=240):
        assert result["status"] == "not run" and "not packing-aware in transformers" in result["detail"], result


def test_lora_adapter_output_not_reduced_is_caught(ranks):
    """Negative control for the LoRA x TP 2 column (tests/tensor_parallel/lora_tp_cases.py's): a
    row-wise layer's lora_A output left as each rank's partial sum must read as a mismatch."""
    for result in ranks(2).run(cases.lora_tp2, family="llama", corrupt="unreduced", timeout=240,
                               **cases.MODES["lora-tp2"]):
        assert result["status"] == "mismatch" and result["detail"]["adapters_split"] > 0, result
        assert max(result["detail"]["loss_diff"], result["detail"]["grad_diff"]) > 1e-3, result


def test_packed_with_use_cache_only_in_kwargs(ranks):
    """GraniteMoE (its forward takes use_cache through **kwargs, not by name) on packed rows under
    FSDP 2: exact, smp.step turning the cache off for it too (before: loss 1.1e-2 off)."""
    for result in ranks(2).run(cases.packed, family="granitemoe", layout="fsdp", timeout=240):
        assert result["status"] == "exact", result


def test_lora_frozen_per_head_parameter_is_refused(ranks):
    """Doge under LoRA x TP 2: its per-head parameter A is frozen (the base is), and still sized for
    every head: refused with smp's reason, as at TP 2 without adapters (before: a crash in
    attention, the frozen parameter left unchecked)."""
    for result in ranks(2).run(cases.lora_tp2, family="doge", timeout=240, **cases.MODES["lora-tp2"]):
        assert result["status"] == "refused", result


def test_registry_drives_the_matrix():
    families = dict(cases.registry_families())
    assert len(families) > 20 and "llama" in families and "qwen2" in families
    assert "gpt2" not in families  # no base_model_tp_plan: covered as an extra family
    assert {f for fs in FAST.values() for f in fs} <= set(families) | set(cases.EXTRA_FAMILIES)


@pytest.mark.parametrize("family,mode", [(f, m) for m, fs in FAST.items() for f in fs],
                         ids=[f"{f}-{m}" for m, fs in FAST.items() for f in fs])
def test_fast_subset(ranks, family, mode):
    _check(ranks, family, dict(_all_families()).get(family), mode)


@pytest.mark.parametrize("config,why", [
    ({**cases.AC_OFFLOAD, "activation_offload_min_bytes": 1 << 40}, "offloading moved no activation"),
    ({**cases.TP2, "tensor_parallel": {"plan": {"model.norm": "replicate"}}}, "tensor parallel split no parameter"),
], ids=["nothing-offloaded", "nothing-split"])
def test_mode_that_did_nothing_is_not_exact(ranks, config, why):
    """Negative control: numbers equal to one process prove nothing when the mode did nothing
    (every activation under the offload threshold; a TP plan that splits no parameter)."""
    for result in ranks(2).run(cases.classify, config=config, family="llama"):
        assert result["status"] == "unproven" and why in result["detail"], result


@pytest.mark.slow
@pytest.mark.coverage
@pytest.mark.parametrize("mode", cases.MODES)
@pytest.mark.parametrize("family,reason", _all_families(), ids=[f for f, _ in _all_families()])
def test_every_family(ranks, request, family, reason, mode):
    if "coverage" not in (request.config.option.markexpr or ""):
        pytest.skip("the whole matrix (~600 cells) runs only when selected: pytest -m coverage")
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


def test_colwise_fused_gate_up_is_refused(ranks):
    """Inkling2 ships 'colwise' on its experts' fused [gate | up] (the forward chunks it in two):
    split contiguously, one rank held the gates and the other the ups, and TP=2 trained silently
    wrong (loss 1e-3, gradients 1.2e-2 off). Refused, naming the entry to pass instead."""
    for result in ranks(2).run(cases.classify, family="inkling2_text", **cases.MODES["tp2"]):
        assert result["status"] == "refused", result
        assert "'model.layers.*.mlp.experts.gate_up_proj': 'packed_colwise'" in result["detail"], result


def test_fused_gate_up_fix_named_in_the_refusal_is_exact(ranks):
    """Control: the same plan with the entry the refusal names is exact against one process."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    plan = {f"model.{k}": v for k, v in CONFIG_MAPPING["inkling2_text"].base_model_tp_plan.items()}
    plan.update({"lm_head": "colwise_gather_output", "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"})
    config = {**cases.TP2, "tensor_parallel": {"plan": plan}}
    for result in ranks(2).run(cases.classify, config=config, family="inkling2_text"):
        assert result["status"] == "exact", result


# --- the vision, multimodal and speech section ----------------------------------------------

def test_vision_section_comes_from_the_registry():
    """Every family of the image-text, contrastive, image / audio classification, backbone,
    speech seq2seq and CTC auto mappings, once each, under the first kind that lists it; tiny
    configs shrink nested sub-configs too."""
    from tests.models import model_coverage_vlm_cases as vcases

    families = vcases.vision_families()
    kinds = dict(families)
    assert len(kinds) == len(families) > 100
    assert {kinds["llava"], kinds["clip"], kinds["vit"], kinds["whisper"], kinds["wav2vec2"]} == {
        "image-text", "contrastive", "image-classification", "speech-seq2seq", "audio-classification"}
    config = vcases.tiny_config("llava", "image-text")
    assert config.text_config.hidden_size == 64 and config.vision_config.num_hidden_layers == 2
    assert config.image_token_id < vcases.VOCAB


def test_vision_cell_is_exact(ranks):
    """One fast cell: ViT classification under FSDP at world 2, exact against one process."""
    from tests.models import model_coverage_vlm_cases as vcases

    for result in ranks(2).run(vcases.classify, family="vit", kind="image-classification", timeout=240,
                               **cases.MODES["fsdp"]):
        assert result["status"] == "exact", result


def test_image_rows_skipped_on_one_rank_are_caught(ranks):
    """Negative control: LLaVA with rank 1's images dropped (its rows run text-only while one
    process sees the images) must read as a mismatch, not exact."""
    from tests.models import model_coverage_vlm_cases as vcases

    results = ranks(2).run(vcases.classify, family="llava", kind="image-text", skip_tower=True, timeout=240,
                           **cases.MODES["fsdp"])
    assert {r["status"] for r in results} == {"mismatch"}, results


def test_a_tower_reading_a_middle_layer_trains_exactly(ranks):
    """LLaVA's projector reads the vision tower's second-to-last layer, so the last layer's output
    goes unused: the tower keeps one FSDP unit per block (a unit merged over such blocks failed
    in backward, 'setStorage ... storage of size 0'), exact against one process."""
    from tests.models import model_coverage_vlm_cases as vcases

    results = ranks(2).run(vcases.classify, family="llava", kind="image-text", timeout=240, **cases.MODES["fsdp"])
    assert {r["status"] for r in results} == {"exact"}, results


def test_contrastive_loss_without_the_gather_is_caught(ranks):
    """Negative control: CLIP's loss over each rank's own rows (no gathered negatives) differs
    from the global-batch loss of one process: a mismatch, not exact."""
    from tests.models import model_coverage_vlm_cases as vcases

    for result in ranks(2).run(vcases.classify, family="clip", kind="contrastive", gather=False, timeout=240,
                               **cases.MODES["fsdp"]):
        assert result["status"] == "mismatch" and result["detail"]["loss_diff"] > cases.TOL, result


def test_vision_section_renders_with_the_page():
    """The second table: a row per family with its kind, a verdict per column, reasons as
    footnotes shared with the text table, skipped families listed under it with their reason."""
    import importlib.util
    import os

    path = os.path.join(str(REPO_ROOT), "scripts", "model_coverage.py")
    spec = importlib.util.spec_from_file_location("model_coverage_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    vision = {
        "vit": {"kind": "image-classification", "fsdp": "exact", "tp2": "refused: ConfigError: no plan",
                "mixed": "not run: n/a: a image-classification model has no text-only rows"},
        "swin": {"kind": "image-classification", **{m: "skipped: does not run" for m in script.vision_columns()}},
    }
    page = script.render({}, vision)
    assert "## Vision, multimodal and speech families" in page
    row = next(line for line in page.splitlines() if line.startswith("| vit |"))
    assert "| image-classification | exact |" in row and "refused [" in row and "not run [" in row
    assert "- swin (image-classification): does not run" in page
    assert "refused: ConfigError: no plan" in page.split("## Reasons")[1]


def test_batch_norm_in_training_mode_is_refused(ranks):
    """BatchNorm normalises each rank's rows with their own statistics in training mode, which
    differs from one process on the global batch (the vision matrix found ResNet, RegNet and
    MobileNet 1e-2 off): refused on every rank, naming the layer and the fixes."""
    from tests.models import model_coverage_vlm_cases as vcases

    for result in ranks(2).run(vcases.classify, family="resnet", kind="image-classification", timeout=240,
                               **cases.MODES["fsdp"]):
        assert result["status"] == "refused", result
        assert "(BatchNorm2d) normalises with the batch statistics" in result["detail"], result


def test_batch_norm_with_frozen_statistics_is_exact(ranks):
    """Control: the same ResNet with its BatchNorm layers in eval mode (frozen statistics) runs
    and matches one process."""
    from tests.models import model_coverage_vlm_cases as vcases

    for result in ranks(2).run(vcases.classify, family="resnet", kind="image-classification", frozen_norms=True,
                               timeout=240, **cases.MODES["fsdp"]):
        assert result["status"] == "exact", result
