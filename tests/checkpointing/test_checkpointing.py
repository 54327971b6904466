"""smp.checkpointing: exact resume, resharding, atomic commits, HF export/import, errors.

Tolerances: at the same world size resume is bitwise (same shards, same optimizer state, same
RNG streams, same batches). After resharding (world 4 HSDP 2x2 -> world 2 full shard, or
TP 2) the losses are compared with the single-process run, as in test_fsdp.py: sharded
reductions reorder float sums; measured differences are 2.4e-7 before the save and 0 (full
shard) / 4.8e-7 (TP 2) after the resume; we assert 1e-4, the AdamW drift bound in docs/platform.md.
Dropping the optimizer state on resume moves the next loss by 7e-3, which the same check
catches. Export/import copy tensors verbatim: parameters bitwise, logits to <= 6e-6 (sharded vs
unsharded kernels), 8.7e-3 for a bf16 export (bf16 rounding of the weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.checkpointing import checkpoint_cases as cases
from tests import REPO_ROOT

RESHARD_TOL = 1e-4
REPO = str(REPO_ROOT)


# --- exact resume -----------------------------------------------------------------------------

@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_exact_resume_is_bitwise(ranks, tmp_path, async_save):
    for r in ranks(2).run(cases.exact_resume, config={}, root=str(tmp_path),
                          steps=4, save_at=2, async_save=async_save):
        assert r["step"] == 2 and r["lr"][0] == r["lr"][1]
        assert r["resumed"] == r["losses"][2:], r  # bitwise, dropout included
        assert r["param_diff"] == 0.0, r


@pytest.mark.slow
def test_exact_resume_hybrid_world4(ranks, tmp_path):
    for r in ranks(4).run(cases.exact_resume, config={"hybrid_shard_degree": 2}, root=str(tmp_path),
                          steps=3, save_at=1):
        assert r["resumed"] == r["losses"][1:] and r["param_diff"] == 0.0, r


def test_saving_does_not_change_the_run(ranks, tmp_path):
    """Saving (even before the first optimizer step) leaves the run bitwise unchanged, and a
    resume from the step-0 checkpoint replays it."""
    for r in ranks(2).run(cases.saving_changes_nothing, config={}, root=str(tmp_path)):
        assert r["saving"] == r["plain"], r
        assert r["from_step_0"] == r["plain"], r


def test_resume_without_rng_is_caught(ranks, tmp_path):
    """The bitwise check must fail when the restored RNG streams are thrown away (dropout)."""
    for r in ranks(2).run(cases.exact_resume, config={}, root=str(tmp_path),
                          steps=4, save_at=2, reseed_after_load=True):
        assert r["resumed"] != r["losses"][2:], r


# --- resharding -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hybrid_checkpoint(ranks, tmp_path_factory):
    """Two AdamW steps at world 4, HSDP 2x2, saved at step 2."""
    path = str(tmp_path_factory.mktemp("reshard") / "step_2")
    losses = ranks(4).run(cases.reshard_save, config={"hybrid_shard_degree": 2}, path=path, save_at=2)[0]
    return path, losses


@pytest.mark.slow
def test_reshard_hybrid4_to_full_shard2(ranks, hybrid_checkpoint):
    path, saved_losses = hybrid_checkpoint
    meta = json.loads(open(os.path.join(path, "smp_meta.json")).read())
    assert (meta["world_size"], meta["dp_replicate"], meta["dp_shard"], meta["tp"]) == (4, 2, 2, 1)
    assert meta["torch_version"] and meta["smp_version"] and len(meta["fingerprint"]) == 16
    assert meta["params"]["lm_head.weight"] == [256, 64] and meta["has_optimizer"]
    for r in ranks(2).run(cases.reshard_resume, config={}, path=path, steps=4):
        ref = r["reference"]
        assert r["step"] == 2
        assert max(abs(a - b) for a, b in zip(saved_losses, ref[:2])) < RESHARD_TOL
        assert max(abs(a - b) for a, b in zip(r["resumed"], ref[2:])) < RESHARD_TOL, r


@pytest.mark.slow
def test_reshard_without_optimizer_state_is_caught(ranks, hybrid_checkpoint):
    path, _ = hybrid_checkpoint
    for r in ranks(2).run(cases.reshard_resume, config={}, path=path, steps=4, with_optimizer=False):
        assert max(abs(a - b) for a, b in zip(r["resumed"], r["reference"][2:])) > 10 * RESHARD_TOL


@pytest.mark.slow
def test_reshard_to_tensor_parallel(ranks, hybrid_checkpoint):
    path, _ = hybrid_checkpoint
    for r in ranks(2).run(cases.reshard_resume, config={"tensor_parallel_degree": 2}, path=path, steps=4):
        assert r["tp"], r  # the loading model really is tensor-parallel
        assert max(abs(a - b) for a, b in zip(r["resumed"], r["reference"][2:])) < RESHARD_TOL, r


def test_reshard_tensor_parallel_to_full_shard(ranks, tmp_path):
    path = str(tmp_path / "step_2")
    saved = ranks(2).run(cases.reshard_save, config={"tensor_parallel_degree": 2}, path=path, save_at=2)[0]
    for r in ranks(2).run(cases.reshard_resume, config={}, path=path, steps=4):
        assert not r["tp"] and r["step"] == 2
        assert max(abs(a - b) for a, b in zip(saved, r["reference"][:2])) < RESHARD_TOL, r
        assert max(abs(a - b) for a, b in zip(r["resumed"], r["reference"][2:])) < RESHARD_TOL, r


@pytest.mark.slow
def test_plain_dcp_reads_smp_checkpoint(ranks, hybrid_checkpoint):
    """No smp on the reading side: torch.distributed.checkpoint into an unsharded model."""
    path, _ = hybrid_checkpoint
    for diff in ranks(2).run(cases.plain_dcp_load, path=path):
        assert diff < RESHARD_TOL


# --- atomic commits ---------------------------------------------------------------------------

def test_failed_save_leaves_previous_latest(ranks, tmp_path):
    for r in ranks(2).run(cases.failed_save_keeps_previous, config={}, root=str(tmp_path)):
        assert "disk full (injected)" in r["error"], r
        assert r["latest"] == "step_1" and r["step"] == 1 and r["param_diff"] == 0.0, r
        assert r["listing"] == ["step_1"], r  # the failed save cleaned its partial directory


@pytest.mark.parametrize("point", ["write", "commit"])
def test_killed_save_leaves_previous_latest(ranks, tmp_path, point):
    """SIGKILL mid-save (shards half written / marker written, rename not done)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpointing.checkpoint_cases", str(tmp_path), point],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr)  # really killed
    assert os.path.isdir(tmp_path / ".step_2.partial")  # the dead save's leftovers
    assert not os.path.exists(tmp_path / "step_2")
    from smp.checkpointing import latest

    assert latest(tmp_path) == str(tmp_path / "step_1")
    for r in ranks(2).run(cases.load_latest_into_fresh, config={}, root=str(tmp_path)):  # world 1 -> 2
        assert r["latest"] == "step_1" and r["step"] == 1 and r["param_diff"] == 0.0, r
        assert r["listing"] == ["step_1", "step_3"], r


def test_keep_last_and_overwrite(ranks, tmp_path):
    for r in ranks(2).run(cases.keep_last, config={}, root=str(tmp_path)):
        assert r["listing"] == ["step_3", "step_4"], r
        assert r["latest"] == "step_3" and r["step"] == 33, r


def test_async_save_snapshots_state(ranks, tmp_path):
    for diff in ranks(2).run(cases.async_snapshot, config={}, root=str(tmp_path)):
        assert diff == 0.0


def test_async_save_committed_by_shutdown(ranks, tmp_path):
    assert ranks(2).run(cases.async_committed_by_shutdown, config={}, root=str(tmp_path)) == ["b", "b"]


def test_latest_of_empty_or_missing_root(tmp_path):
    from smp.checkpointing import latest

    assert latest(tmp_path) is None
    assert latest(tmp_path / "absent") is None
    (tmp_path / ".step_9.partial").mkdir()
    (tmp_path / "step_8").mkdir()  # no commit marker
    assert latest(tmp_path) is None


# --- Hugging Face ------------------------------------------------------------------------------

EXPORTS = [
    # config, tied embeddings, export dtype, logit tolerance (bf16 export: bf16 rounding, ~1e-3)
    ({}, False, None, 1e-4),
    ({"tensor_parallel_degree": 2}, True, None, 1e-4),
    ({}, False, "bfloat16", 3e-2),
]


@pytest.mark.parametrize("config,tie,dtype,tol", EXPORTS, ids=["full-shard-2", "tp2-tied", "bf16"])
def test_export_hf_loads_with_from_pretrained(ranks, tmp_path, config, tie, dtype, tol):
    out = str(tmp_path / "hf")
    for r in ranks(2).run(cases.export_then_from_pretrained, config=config, out=out,
                          max_shard_bytes=60_000, tie=tie, dtype=dtype):
        assert r["logit_diff"] < tol, r
        assert r["file_dtype"] == {None: "F32", "bfloat16": "BF16"}[dtype], r
        shards = [f for f in r["files"] if f.endswith(".safetensors")]
        assert len(shards) > 1 and "model.safetensors.index.json" in r["files"], r
        assert "config.json" in r["files"] and "sharded" not in r["files"], r
        assert r["tp"] == ("tensor_parallel_degree" in config), r
        assert r["round_trip_diff"] == 0.0, r  # export -> load_hf into a fresh model is exact


@pytest.mark.parametrize("config,tie,dtype", [
    ({}, False, "float32"), ({}, True, "bfloat16"), ({"tensor_parallel_degree": 2}, True, "float32"),
], ids=["untied-fp32", "tied-bf16", "tp2-tied-fp32"])
def test_load_hf_into_sharded_model(ranks, tmp_path, config, tie, dtype):
    for r in ranks(2).run(cases.import_hf, config=config, hf_dir=str(tmp_path / "hf"), tie=tie, dtype=dtype):
        assert r["files"] > 1, r  # a multi-file checkpoint with an index
        assert r["tp"] == ("tensor_parallel_degree" in config), r
        # Streaming: each rank reads about its half, never the whole model.
        assert r["read_fraction"] < 0.75, r
        assert r["param_diff"] == 0.0, r
        assert r["logit_diff"] < 1e-4, r


def test_export_integer_tensors_load_bitwise(ranks, tmp_path):
    """Integer tensors (ResNet's num_batches_tracked after 3 training steps, MaskFormer-Swin's
    persistent relative_position_index) come back bitwise from from_pretrained and load_hf,
    every key found, none unexpected; they sit in one more file listed in the index."""
    for r in ranks(2).run(cases.export_integer_tensors, config={}, root=str(tmp_path)):
        for name, m in r.items():
            assert m["from_pretrained"] == [] and m["load_hf"] == [], (name, m)
            assert m["info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}, m
            assert "model-00002-of-00002.safetensors" in m["files"], m["files"]
        counts = r["resnet"]["integers"]
        assert len(counts) == 8 and set(counts.values()) == {3}, counts  # 8 BatchNorms, 3 steps each
        assert len(r["swin"]["integers"]) == 2, r["swin"]["integers"]


@pytest.mark.parametrize("broken", ["omit", "wrong"])
def test_export_integer_tensors_control(ranks, tmp_path, broken):
    """Negative controls: an export without the integer file, or with each value off by one,
    fails the comparison above (omitted: from_pretrained reports them missing, load_hf refuses)."""
    for r in ranks(2).run(cases.export_integer_tensors, config={}, root=str(tmp_path), broken=broken, only="resnet"):
        m = r["resnet"]
        assert len(m["from_pretrained"]) == 8 and all(k.endswith("num_batches_tracked") for k in m["from_pretrained"]), m
        if broken == "omit":
            assert len(m["info"]["missing_keys"]) == 8 and "missing keys (8" in m["load_hf"], m
        else:
            assert m["load_hf"] == m["from_pretrained"] and m["info"]["missing_keys"] == [], m


def test_export_integer_tensors_refused(ranks, tmp_path):
    """An integer buffer that differs between ranks, or is sharded, is refused on every rank
    by name before anything is written."""
    for r in ranks(2).run(cases.export_integer_refusals, config={}, root=str(tmp_path)):
        assert "embedder.normalization.num_batches_tracked differs between ranks" in r["differs"], r["differs"]
        assert "classifier.bucket is a DTensor placed (Shard(dim=0),)" in r["sharded"], r["sharded"]
        assert r["listing"] == [], r["listing"]  # no folder, no partial


def test_export_integer_tensors_pipelined(ranks, tmp_path):
    """At pp 2 each stage's integer buffer reaches the folder (rank 0 writes both)."""
    pp2 = {"pipeline_parallel_degree": 2, "pipeline": "1f1b"}
    for r in ranks(2).run(cases.export_integer_pipelined, config=pp2, out=str(tmp_path / "hf")):
        assert len(r["local"]) == 1, r  # one stage's buffer per rank
        assert r["held"] == {"model.layers.0.step_index": [0, 10, 20], "model.layers.3.step_index": [3, 13, 23]}, r


def test_export_integer_nonfloat_dtypes(tmp_path):
    """(One process) every dtype safetensors holds passes the check and is written into the
    folder's last file, bitwise; complex128, which it cannot hold, is refused by name; a folder
    whose files are not the consolidation's names is refused, not guessed at."""
    import json

    from safetensors.torch import load_file, save_file

    from smp.checkpointing.hf import nonfloat as hf_nonfloat
    from smp.errors import CheckpointError

    values = {"mask": torch.tensor([True, False]), "i8": torch.tensor([-3], dtype=torch.int8),
              "u8": torch.tensor(7, dtype=torch.uint8), "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
              "c64": torch.tensor([1 + 2j], dtype=torch.complex64)}
    checked = hf_nonfloat.check(values, None, "out")
    save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 8}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    hf_nonfloat.write(str(tmp_path), checked)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"w": "model-00001-of-00002.safetensors",
                                   **dict.fromkeys(values, "model-00002-of-00002.safetensors")}, index
    assert index["metadata"]["total_size"] == 8 + sum(v.numel() * v.element_size() for v in values.values())
    back = load_file(str(tmp_path / "model-00002-of-00002.safetensors"))
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in values.items()), back
    with pytest.raises(CheckpointError, match="c128 is torch.complex128, which safetensors cannot hold"):
        hf_nonfloat.check({"c128": torch.zeros(1, dtype=torch.complex128)}, None, "out")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "weights.safetensors"}}))
    with pytest.raises(CheckpointError, match="not the files"):
        hf_nonfloat.write(str(tmp_path), {"x": torch.tensor([1])})  # no renaming of files it does not know


# --- errors -----------------------------------------------------------------------------------

def test_error_messages(ranks, tmp_path):
    for e in ranks(2).run(cases.error_messages, config={}, root=str(tmp_path)):
        assert e["ok"] == ""
        assert "does not exist" in e["missing_dir"]
        assert "latest(root) returns None" in e["none_path"]
        assert "not an smp checkpoint" in e["not_checkpoint"]
        assert "incomplete checkpoint" in e["uncommitted"] and "latest(" in e["uncommitted"]
        assert "no optimizer state" in e["no_optimizer"]
        assert "missing keys (12" in e["more_layers"] and "layers.2.attn_in.weight" in e["more_layers"]
        assert "unexpected keys (12" in e["fewer_layers"] and "layers.1.up.bias" in e["fewer_layers"]
        assert "shape mismatches (2)" in e["other_vocab"], e["other_vocab"]
        assert "embed.weight: checkpoint (128, 32) vs model (100, 32)" in e["other_vocab"]
        assert "another model" in e["other_model"]
        assert "not a Hugging Face safetensors checkpoint" in e["hf_not_hf"]
        assert "another model" in e["hf_wrong_model"]
        assert "load_hf" in e["load_of_export"]
        assert "keep_last=0" in e["keep_last_0"]
        assert "must be picklable" in e["unpicklable_extra"], e["unpicklable_extra"]
        for key in ("onto_user_dir", "onto_root", "onto_export"):
            assert "is not an smp sharded checkpoint" in e[key] and "would delete" in e[key], e[key]
        assert e["listing"] == ["half", "hf", "random_dir", "tiny"], e["listing"]
        assert e["latest"] == "tiny"


# --- load_hf through transformers' converters --------------------------------------------------

CONVERTED = [
    # family, smp config, built on meta, folder in the model's own layout, negative control (a
    # mistake the bitwise comparison must catch)
    ("mixtral", {"expert_parallel_degree": 2}, False, False, "expert_order"),
    ("mixtral", {"tensor_parallel_degree": 2}, False, False, "expert_order"),
    ("tipsv2", {}, True, False, "swap_outputs"),
    ("mixtral", {"tensor_parallel_degree": 2}, False, True, "box_read"),
]


@pytest.mark.parametrize("family,config,meta,model_layout,tamper", CONVERTED,
                         ids=["mixtral-ep2", "mixtral-tp2", "tipsv2-meta-fsdp2", "mixtral-tp2-fused-file"])
def test_load_hf_convert_equals_from_pretrained(ranks, tmp_path, family, config, meta, model_layout, tamper):
    """A folder save_pretrained wrote in the layout transformers converts on load (Mixtral's
    per-expert w1/w2/w3 stacked and joined; TIPSv2's fused qkv and w12 chunked) loads through
    load_hf at world 2 bitwise equal to from_pretrained of the folder, every parameter and
    persistent buffer: expert-parallel, tensor-parallel (the experts' packed gate|up split),
    and a meta model under FSDP. Negative controls beside them: experts stacked in reverse order
    or two chunks swapped differ, so the comparison would see a wrong conversion. The last case
    holds the fused layout in the file (nothing to convert) under TP: the packed gate|up is read
    box by box (packed.boxes); read as DCP's one box per rank (the control) it differs."""
    from tests.checkpointing import hf_conversion_cases as hcases

    for r in ranks(2).run(hcases.load_like_from_pretrained, config=config, family=family, meta=meta,
                          model_layout=model_layout, directory=str(tmp_path / family),
                          tampers=("", tamper), timeout=240):
        assert bool(r["converted_keys"]) != model_layout, r  # the folder's layout, as intended
        assert r[""]["error"] == "" and r[""]["differ"] == [] and r[""]["missing"] == [], r
        assert r[""]["compared"] > 10, r
        broken = r[tamper]
        assert broken["error"] == "" and broken["differ"], r
        assert all(("experts" in n) if family == "mixtral" else ("proj" in n) for n in broken["differ"]), broken


def test_load_hf_convert_refuses_what_it_cannot_prove():
    """One process, no data read: load_hf's plan for Mixtral (per-expert tensors stacked by
    transformers' converters) checks every converter on the file's shapes first. A complete
    per-expert file plans one group per fused tensor; a missing expert, a fused tensor in the
    file beside the per-expert ones, and more experts than the model has are refused by name."""
    import smp
    from smp.checkpointing.hf import load as hf_load
    from tests.checkpointing.hf_conversion_cases import build

    with torch.device("meta"):
        model = build("mixtral")
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    saved = {k: s for k, s in shapes.items() if ".experts." not in k}
    for layer in range(2):
        for e in range(4):
            for w, shape in (("w1", [32, 64]), ("w3", [32, 64]), ("w2", [64, 32])):
                saved[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"] = shape

    def plan(file_shapes):
        return hf_load._plan_hf_load(file_shapes, model, shapes, "folder", hf_load._key_converter(model))

    mapping, groups, _ = plan(saved)
    assert sorted(g.layer for g in groups) == sorted(k for k in shapes if ".experts." in k), groups
    assert not any(".experts." in k for k in mapping), mapping
    up = groups[0].sources  # the experts in from_pretrained's order, gate (w1) before up (w3)
    assert [k.split(".experts.")[1] for keys in up.values() for k in keys][:5] == [
        "0.w1.weight", "1.w1.weight", "2.w1.weight", "3.w1.weight", "0.w3.weight"], up

    one_missing = {k: s for k, s in saved.items() if k != "model.layers.0.block_sparse_moe.experts.3.w1.weight"}
    with pytest.raises(smp.CheckpointError, match=r"converter for 'model\.layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight'.*does not run"):
        plan(one_missing)
    both = {**saved, "model.layers.0.mlp.experts.gate_up_proj": [4, 64, 64]}
    with pytest.raises(smp.CheckpointError, match=r"also tensors that from_pretrained converts into it"):
        plan(both)
    extra = {**saved, **{f"model.layers.1.block_sparse_moe.experts.4.{w}.weight": s
                         for w, s in (("w1", [32, 64]), ("w3", [32, 64]), ("w2", [64, 32]))}}
    with pytest.raises(smp.CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.down_proj: checkpoint \(5, 64, 32\) vs model \(4, 64, 32\)"):
        plan(extra)


def test_load_hf_places_experts_as_the_converter_stacks_them(monkeypatch, tmp_path):
    """One process, no data read: for Mixtral's converters (MergeModulelist, then Concatenate w1
    before w3) load_hf's plan places each expert's tensor in its own box of the fused result
    (what lets a rank read only its experts, one at a time, into its shard), and that rule is
    checked against transformers' converter run on small stand-ins. Negative control: a rule that
    joins w3 before w1 disagrees with the converter, and the group falls back to converting
    whole (placed is None). A converter that chunks (TIPSv2's fused qkv) is never placed."""
    from smp.checkpointing.hf import conversion as hf_conversion
    from smp.checkpointing.hf import load as hf_load
    from tests.checkpointing.hf_conversion_cases import build

    with torch.device("meta"):
        model = build("mixtral")
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    saved = {k: s for k, s in shapes.items() if ".experts." not in k}
    for layer in range(2):
        for e in range(4):
            for w, shape in (("w1", [32, 64]), ("w3", [32, 64]), ("w2", [64, 32])):
                saved[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"] = shape
    converter = hf_load._key_converter(model)
    _, groups, _ = hf_load._plan_hf_load(saved, model, shapes, "folder", converter)
    up = next(g for g in groups if g.layer.endswith("layers.0.mlp.experts.gate_up_proj"))
    boxes = {p.key.split(".experts.")[1]: (p.offsets, p.sizes) for p in up.placed[up.layer]}
    assert boxes["2.w1.weight"] == ([2, 0, 0], [1, 32, 64]) and boxes["2.w3.weight"] == ([2, 32, 0], [1, 32, 64]), boxes
    assert all(g.placed is not None for g in groups), groups

    original = hf_conversion._stacked
    monkeypatch.setattr(hf_conversion, "_stacked", lambda steps, order, sources: original(steps, order[::-1], sources))
    _, groups, _ = hf_load._plan_hf_load(saved, model, shapes, "folder", converter)
    assert all(g.placed is None for g in groups if g.layer.endswith("gate_up_proj")), groups
    monkeypatch.undo()

    from smp.checkpointing.hf.checks import read_folder

    build("tipsv2").save_pretrained(tmp_path / "tipsv2")  # fused qkv / w12 in the file
    with torch.device("meta"):
        vision = build("tipsv2")
    vision_shapes = {k: list(v.shape) for k, v in vision.state_dict().items()}
    fused = {k: stored.shape for k, stored in read_folder(str(tmp_path / "tipsv2")).items()}
    _, groups, _ = hf_load._plan_hf_load(fused, vision, vision_shapes, "folder", hf_load._key_converter(vision))
    assert groups and all(g.placed is None for g in groups), groups


# --- packed tensor-parallel weights across a layout change -------------------------------------

TP2 = {"tensor_parallel_degree": 2}
PACKED_RESUME_TOL = 1e-6  # measured 7.2e-7 (GPT-2 FSDP 2 -> TP 2), 4.8e-7 (Mixtral TP 2 -> FSDP 2)


@pytest.mark.parametrize("family,save_config,load_config,async_save", [
    ("gpt2", {}, TP2, False), ("gpt2", TP2, {}, False), ("mixtral", {}, TP2, False), ("mixtral", TP2, TP2, True),
], ids=["gpt2-fsdp2-to-tp2", "gpt2-tp2-to-fsdp2", "mixtral-fsdp2-to-tp2", "mixtral-tp2-to-tp2-async"])
def test_packed_tp_resume_across_layouts(ranks, tmp_path, family, save_config, load_config, async_save):
    """Packed tensor-parallel weights (GPT-2's fused q|k|v `c_attn`, Mixtral's experts'
    `gate_up_proj` gate|up, each rank a slice of every part) save and load exactly at world 2:
    after smp.checkpointing.load every parameter and its AdamW exp_avg / exp_avg_sq equal the
    saved run's bitwise, and the losses of the resumed steps equal the uninterrupted run's
    within 1e-6 (bitwise at the same layout). Negative controls: loaded with the packed
    detection off (DCP's one box per rank) the packed weights and their optimizer state differ;
    saved with it off, DCP refuses the overlapping chunks. export_hf at TP 2 writes a folder
    from_pretrained reads bitwise (with the detection off: DCP's overlapping-chunks error).
    Saved async (packed boxes staged contiguous by the planner), the data files and the
    tensors .metadata describes are byte for byte those of a sync save of the same state."""
    for r in ranks(2).run(cases.packed_tp_resume, family=family, save_config=save_config,
                          load_config=load_config, path=str(tmp_path / "ck"), async_save=async_save, timeout=240):
        packed = r["packed_saved"] or r["packed_loaded"]
        assert packed and all(("c_attn" if family == "gpt2" else "gate_up_proj") in n for n in packed), r
        assert r["differ"] == [] and r["compared"] > 60, r
        if save_config == load_config:
            assert r["resumed"] == r["losses"], r
        assert max(abs(a - b) for a, b in zip(r["resumed"], r["losses"])) <= PACKED_RESUME_TOL, r
        if r["packed_loaded"]:
            assert r["box_differ"] == sorted(f"{n}{s}" for n in r["packed_loaded"]
                                             for s in ("", ":exp_avg", ":exp_avg_sq")), r
        if async_save:
            assert r["async_files_differ"] == [], r
        if r["packed_saved"]:
            assert "overlapping chunks" in r["box_save_error"], r
            assert r["export_differ"] == [] and "overlapping chunks" in r["box_export_error"], r
            assert r["plain_dcp_differ"] == [], r


@pytest.mark.slow
@pytest.mark.parametrize("save_config,load_config", [(TP2, {}), ({}, TP2)], ids=["tp2xfsdp2-to-fsdp4", "fsdp4-to-tp2xfsdp2"])
def test_packed_tp_resume_world4(ranks, tmp_path, save_config, load_config):
    """GPT-2's c_attn under TP 2 x FSDP 2 (packed along its columns, FSDP along its rows) at
    world 4, both ways: as test_packed_tp_resume_across_layouts."""
    for r in ranks(4).run(cases.packed_tp_resume, family="gpt2", save_config=save_config,
                          load_config=load_config, path=str(tmp_path / "ck"), timeout=300):
        assert (r["packed_saved"] or r["packed_loaded"]) and r["differ"] == [], r
        assert max(abs(a - b) for a, b in zip(r["resumed"], r["losses"])) <= PACKED_RESUME_TOL, r
        assert r["box_differ"] if r["packed_loaded"] else r["export_differ"] == [], r


# --- load_hf: which files of the folder, as from_pretrained reads them -------------------------


def test_load_hf_reads_the_files_from_pretrained_reads(ranks, tmp_path):
    """(World 2) load_hf follows from_pretrained's choice of files: the index's files only (a
    stray `*.safetensors` holding `model.norm.weight` = 9.0 is ignored, as from_pretrained
    ignores it), `model.safetensors` alone when there is one; every load bitwise equal to
    from_pretrained of the clean folder. The oracle tells the stray value from the real one (the
    negative control: 9.0 is not what from_pretrained loads). Refused on every rank, naming the
    file, within seconds (a hang would be the pool's timeout): a FIFO the index names or, in a
    folder with no index, a FIFO named `*.safetensors`; a key two read files hold (both named);
    an index entry outside the folder."""
    from tests.checkpointing import hf_conversion_cases as hcases

    for r in ranks(2).run(hcases.folder_files, config={}, root=str(tmp_path / "folders"), timeout=120):
        for kind in ("clean", "stray", "single_stray"):
            assert r[kind]["error"] == "" and r[kind]["differ"] == [], (kind, r[kind])
        assert r["stray_from_pretrained_equal"] and r["single_stray_from_pretrained_equal"], r
        assert r["reference_norm"] != r["stray_norm"], r  # negative control: the stray value is visible
        assert "FIFO" in r["fifo"]["error"] and "model-0000" in r["fifo"]["error"], r["fifo"]
        assert "FIFO" in r["fifo_unindexed"]["error"] and "zz-pipe.safetensors" in r["fifo_unindexed"]["error"], r
        for kind in ("fifo", "fifo_unindexed"):
            assert r[kind]["seconds"] < 10, (kind, r[kind])
        for kind in ("duplicate", "duplicate_unindexed"):
            error = r[kind]["error"]
            assert "'model.norm.weight'" in error and "model-stray.safetensors" in error and "model-0000" in error, (kind, error)
        assert "../elsewhere.safetensors" in r["outside"]["error"] and "inside the folder" in r["outside"]["error"], r
