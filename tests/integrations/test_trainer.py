"""transformers Trainer (and PEFT LoRA) with smp as its parallelism backend (smp.integrations).

Each multi-rank run is compared with a plain single-process Trainer on the same global batch,
same seed and same sampler order (tests/integrations/trainer_cases.py). fp32 on CPU: sharded reductions
reorder float sums, so losses agree to ~1e-6; we assert 1e-5. Feeding the ranks of a TP group
different rows moves the loss by far more (test_world_rank_sharding_is_caught).

LoRA x TP 2 (and TP 2 x dp 2), random A and B on q, v, up, o, down, AdamW, 4 steps: losses
<= 4.8e-7, adapters and the saved adapter file 2.4e-7 from the plain Trainer's; the negative
control (a row-wise adapter's output left unreduced) moves the loss by 3.6e-2 and the adapters by
3.9e-2.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

import smp  # noqa: E402

from smp.config import ConfigError  # noqa: E402
from tests.integrations import trainer_cases  # noqa: E402

LOSS_TOL = 1e-5
ADAPTER_TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs, computed once per (grad_accum, lora)."""
    cache = {}

    def get(grad_accum: int = 1, lora: bool = False) -> dict:
        key = (grad_accum, lora)
        if key not in cache:
            out = tmp_path_factory.mktemp("reference")
            cache[key] = trainer_cases.reference(str(out), grad_accum=grad_accum, lora=lora)
        return cache[key]

    return get


def assert_same_losses(results: list[dict], expected: list[float]) -> None:
    for r in results:
        assert len(r["losses"]) == len(expected), (r["losses"], expected)
        diff = max(abs(a - b) for a, b in zip(r["losses"], expected))
        assert diff < LOSS_TOL, (r["losses"], expected)
    assert expected[-1] != expected[0]  # it trains


CASES = [
    # world, smp config, gradient accumulation, name
    (2, {}, 1, "fsdp-2"),
    (2, {}, 2, "fsdp-2-accum-2"),
    (4, {"hybrid_shard_degree": 2}, 1, "hybrid-2x2"),
    (4, {"hybrid_shard_degree": 2, "activation_checkpointing": "full"}, 2, "hybrid-2x2-ac-accum-2"),
    (2, {"tensor_parallel_degree": 2}, 1, "tp-2"),
]


@pytest.mark.parametrize("world,config,grad_accum,name", CASES, ids=[c[3] for c in CASES])
def test_matches_single_process_trainer(ranks, reference, tmp_path, world, config, grad_accum, name):
    results = ranks(world).run(trainer_cases.train, config=config, output_dir=str(tmp_path), grad_accum=grad_accum)
    assert all(r["dp"] == world // config.get("tensor_parallel_degree", 1) for r in results)
    assert_same_losses(results, reference(grad_accum)["losses"])


def test_tp_2_fsdp_2(ranks, reference, tmp_path):
    """Also what the Trainer counts and gathers: with 2 TP ranks per dp rank, every token and
    every eval row counts once (accelerate's own gather, the control, returns each twice)."""
    results = ranks(4).run(trainer_cases.train, config={"tensor_parallel_degree": 2}, output_dir=str(tmp_path),
                           eval_probe=True)
    assert all(r["dp"] == 2 for r in results)
    assert_same_losses(results, reference()["losses"])
    eval_rows = trainer_cases.TokenRows(rows=trainer_cases.EVAL_ROWS, seed=5).rows
    for r in results:
        assert r["tokens_seen"] == 4 * trainer_cases.GLOBAL_BATCH * trainer_cases.SEQ  # 4 steps of the global batch
        assert torch.equal(r["eval_labels"], eval_rows)  # each row once, in order, the last batch's padding dropped
        assert r["eval_predictions_rows"] == trainer_cases.EVAL_ROWS
        assert r["gathered_dp_ranks"] == [0, 1]
        assert r["gathered_dp_ranks_by_world"] == [0, 0, 1, 1]  # the control: once per TP rank


def test_world_rank_sharding_is_caught(ranks, reference, tmp_path):
    """accelerate's own sharding (by world rank) under TP: the two TP ranks read different rows."""
    results = ranks(2).run(trainer_cases.train, config={"tensor_parallel_degree": 2}, output_dir=str(tmp_path),
                           world_rank_data=True)
    expected = reference()["losses"]
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], expected)) > 100 * LOSS_TOL


def _adapter_diff(params: dict, expected: dict) -> float:
    assert sorted(n for n in params if "lora_" in n) == sorted(expected), sorted(params)
    return max(float((params[n] - t).abs().max()) for n, t in expected.items())


def _saved_adapter_diff(ours, theirs) -> float:
    """The adapter folder SMPTrainer.save_model wrote vs the plain Trainer's (PEFT's save_pretrained)."""
    import json

    from safetensors.torch import load_file

    def config(folder):  # target_modules: a set PEFT writes in no fixed order
        saved = json.loads((folder / "adapter_config.json").read_text())
        return {**saved, "target_modules": sorted(saved["target_modules"])}
    assert config(ours) == config(theirs)
    a, b = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("world", [2, 4], ids=["tp-2", "tp-2-dp-2"])
def test_lora_under_tp_matches_single_process(ranks, reference, tmp_path, world):
    """LoRA x tensor parallel through the Trainer: per-step losses, the adapters after training
    and the adapter folder save_model writes equal the plain Trainer's in one process."""
    import pathlib

    results = ranks(world).run(trainer_cases.train, config={"tensor_parallel_degree": 2}, output_dir=str(tmp_path),
                               lora="random", export=True)
    ref = reference(lora="random")
    assert_same_losses(results, ref["losses"])
    assert all(r["dp"] == world // 2 for r in results)
    for r in results:
        assert r["trainable"] and all("lora_" in n for n in r["trainable"]), r["trainable"]
        assert r["optimized"] == len(r["trainable"])
    assert _adapter_diff(results[0]["params"], ref["adapters"]) < ADAPTER_TOL
    assert _saved_adapter_diff(tmp_path / "final", pathlib.Path(ref["adapter_dir"])) < ADAPTER_TOL
    assert results[0]["logits_diff"] < 1e-5  # PeftModel.from_pretrained(base, adapter folder)


def test_lora_under_tp_unreduced_adapter_is_caught(ranks, reference, tmp_path):
    """Negative control: a row-wise layer's adapter output left as each TP rank's partial sum."""
    results = ranks(2).run(trainer_cases.train, config={"tensor_parallel_degree": 2}, output_dir=str(tmp_path),
                           lora="random", corrupt="unreduced")
    ref = reference(lora="random")
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref["losses"])) > 100 * LOSS_TOL
    assert _adapter_diff(results[0]["params"], ref["adapters"]) > 100 * ADAPTER_TOL


def test_lora_under_fsdp_matches_single_process(ranks, reference, tmp_path):
    config = {"activation_checkpointing": "full"}
    results = ranks(2).run(trainer_cases.train, config=config, output_dir=str(tmp_path), lora=True, export=True)
    ref = reference(lora=True)
    assert_same_losses(results, ref["losses"])
    for r in results:
        assert r["trainable"] and all("lora_" in n for n in r["trainable"]), r["trainable"]
        assert r["optimized"] == len(r["trainable"])  # the optimizer holds the adapters only
    assert results[0]["logits_diff"] < 1e-5  # PeftModel.from_pretrained(base, adapter folder)
    assert (tmp_path / "final" / "adapter_model.safetensors").exists()
    assert (tmp_path / "final" / "adapter_config.json").exists()


def test_export_loads_with_from_pretrained(ranks, tmp_path):
    results = ranks(2).run(trainer_cases.train, config={"hybrid_shard_degree": 1}, output_dir=str(tmp_path),
                           steps=2, export=True)
    assert results[0]["logits_diff"] < 1e-5
    assert (tmp_path / "final" / "config.json").exists()
    assert not (tmp_path / "final" / "smp_commit.json").exists()  # a plain HF folder, not an smp export


def test_resume_is_bitwise_at_same_world_size(ranks, tmp_path):
    first = ranks(2).run(trainer_cases.train, config={}, output_dir=str(tmp_path / "a"), save_steps=2)
    # save_total_limit=2 -> keep_last=2: both checkpoints of the 4 steps are kept
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    resumed = ranks(2).run(trainer_cases.train, config={}, output_dir=str(tmp_path / "b"), save_steps=2,
                           resume=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed[0]["losses"] == first[0]["losses"]
    for name, p in first[0]["params"].items():
        assert torch.equal(p, resumed[0]["params"][name]), name


def test_resume_at_another_world_size(ranks, tmp_path):
    first = ranks(2).run(trainer_cases.train, config={}, output_dir=str(tmp_path / "a"), save_steps=2)
    resumed = ranks(4).run(trainer_cases.train, config={"hybrid_shard_degree": 2}, output_dir=str(tmp_path / "b"),
                           resume=str(tmp_path / "a" / "checkpoint-2"))
    assert_same_losses(resumed, first[0]["losses"])


def test_bf16_and_gradient_checkpointing_map_onto_the_smp_config(tmp_path):
    """TRL's defaults (bf16=True, gradient_checkpointing=True) become smp's policy and checkpointing."""
    from smp.config import load_config
    from smp.integrations.mapping import map_training_arguments

    args = trainer_cases.training_args(str(tmp_path), 1, bf16=True, gradient_checkpointing=True)
    mapped, cfg, notes = map_training_arguments(args, load_config({}))
    assert (cfg.mixed_precision.param_dtype, cfg.mixed_precision.reduce_dtype) == ("bfloat16", "float32")
    assert (cfg.activation_checkpointing.mode, cfg.activation_checkpointing.every_n_layers) == ("full", 1)
    # The Trainer's own cast and checkpointing are off in the copy it gets; the caller's object is as given.
    assert (mapped.bf16, mapped.mixed_precision, mapped.gradient_checkpointing, mapped.activation_checkpointing) == (
        False, "no", False, False)
    assert args.bf16 and args.gradient_checkpointing and args.mixed_precision == "bf16"
    assert len(notes) == 2 and "param_dtype: bf16" in notes[0] and "activation_checkpointing: full" in notes[1]

    # The same settings in the smp config: nothing to map, the Trainer's own still off.
    both = load_config({"mixed_precision": {"param_dtype": "bf16"}, "activation_checkpointing": "full"})
    mapped, cfg, notes = map_training_arguments(args, both)
    assert cfg == both and notes == [] and not mapped.bf16 and not mapped.gradient_checkpointing

    every_2 = trainer_cases.training_args(str(tmp_path), 1, activation_checkpointing=True,
                                          activation_checkpointing_kwargs={"every_n_layers": 2})
    assert map_training_arguments(every_2, load_config({}))[1].activation_checkpointing.every_n_layers == 2

    plain = trainer_cases.training_args(str(tmp_path), 1)
    assert map_training_arguments(plain, load_config({})) == (plain, load_config({}), [])


def test_sft_trainer_matches_single_process(ranks, tmp_path):
    """TRL's SFTTrainer on the chat example (its tokenizer, template and data), FSDP over 2 ranks,
    with TRL's default gradient_checkpointing=True: smp checkpoints the blocks instead of
    transformers, and the losses equal a single-process SFTTrainer's (transformers' checkpointing)."""
    pytest.importorskip("trl")
    expected = trainer_cases.sft_reference(str(tmp_path / "reference"))["losses"]
    results = ranks(2).run(trainer_cases.sft_train, config={}, output_dir=str(tmp_path / "smp"))
    assert len(expected) == trainer_cases.SFT_STEPS
    assert_same_losses(results, expected)
    for r in results:
        assert r["checkpointed_blocks"] == 2  # the tiny Llama's two decoder layers
        assert r["caller_gradient_checkpointing"] and not r["trainer_gradient_checkpointing"]
        assert r["checkpoint_committed"] and r["model_card"], r


def test_conflicting_settings_are_refused(tmp_path, monkeypatch):
    """Refused in the constructor, before smp.init or any collective: one message naming both."""
    from smp.integrations import SMPTrainer

    model = trainer_cases.build_model()
    data = trainer_cases.TokenRows()
    cases = [
        # TrainingArguments, environment (as `accelerate launch` sets it), smp config, named in the error
        (dict(fsdp="full_shard"), {}, {}, "`fsdp`"),
        (dict(fsdp_config={"version": 2}), {}, {}, "`fsdp_config`"),
        ({}, {"ACCELERATE_USE_FSDP": "true"}, {}, "ACCELERATE_USE_FSDP"),
        # (TrainingArguments(deepspeed=...) itself needs deepspeed installed; the launcher's flag does not)
        ({}, {"ACCELERATE_USE_DEEPSPEED": "true"}, {}, "DeepSpeed"),
        # bf16 / gradient checkpointing are mapped onto the smp config (test below) unless it sets them otherwise
        (dict(bf16=True), {}, {"mixed_precision": {"param_dtype": "fp16"}}, "`bf16=True`"),
        (dict(fp16=True), {}, {"mixed_precision": {"param_dtype": "bf16"}}, "mixed_precision.param_dtype='bf16'"),
        (dict(fp16=True), {}, {}, "`fp16=True`"),  # needs the Trainer's loss scaler: never mapped
        (dict(activation_checkpointing=True), {}, {"activation_checkpointing": "selective"},
         "`activation_checkpointing`"),
        (dict(gradient_checkpointing=True), {}, {"activation_checkpointing": "none"}, "`gradient_checkpointing`"),
    ]
    for overrides, env, config, needle in cases:
        args = trainer_cases.training_args(str(tmp_path), 1, **overrides)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            with pytest.raises(ConfigError, match="smp") as info:
                SMPTrainer(model=model, args=args, train_dataset=data, smp_config=config)
        assert needle in str(info.value), (needle, str(info.value))
    assert not smp.is_initialized()  # nothing started: every refusal came first


def test_pipeline_parallel_is_refused_at_construction(tmp_path):
    """The Trainer runs the whole model's forward per rank; a pipelined model cannot: refused in
    the constructor (before smp.init), naming the key, the reason and the alternative."""
    from smp.integrations import SMPTrainer, smp_trainer_class

    data = trainer_cases.TokenRows()
    from transformers import Trainer

    for cls in (SMPTrainer, smp_trainer_class(Trainer)):
        with pytest.raises(ConfigError) as info:
            cls(model=trainer_cases.build_model(), args=trainer_cases.training_args(str(tmp_path), 1),
                train_dataset=data, smp_config={"pipeline_parallel_degree": 2})
        message = str(info.value)
        assert "pipeline_parallel_degree=2" in message and "smp.step(model, batch)" in message, message
        assert "examples/finetune_causal_lm.py" in message, message
    assert not smp.is_initialized()


def test_shadowed_save_checkpoint_steps(caplog):
    """smp's _save_checkpoint sits in front of a subclass's: TRL's one extra step (the model card)
    is taken by smp (test_sft_trainer_matches_single_process checks the file); any other
    subclass's override is named in a warning, not dropped silently."""
    import logging

    from transformers import Trainer

    from smp.integrations.trainer import _shadowed_save_steps, smp_trainer_class

    class ExtraFilesTrainer(Trainer):
        def _save_checkpoint(self, model, trial):
            super()._save_checkpoint(model, trial)

    with caplog.at_level(logging.WARNING, logger="smp.integrations.trainer"):
        smp_trainer_class(ExtraFilesTrainer)
    assert "ExtraFilesTrainer" in caplog.text and "TrainerCallback.on_save" in caplog.text
    trl = pytest.importorskip("trl")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="smp.integrations.trainer"):
        smp_trainer_class(trl.SFTTrainer)
    assert not caplog.text
    assert trl.SFTTrainer in _shadowed_save_steps(trl.SFTTrainer)[0]


SEED_CASES = [({}, 1, "fsdp-2"), ({}, 2, "fsdp-2-accum-2"), ({"tensor_parallel_degree": 2}, 1, "tp-2")]


@pytest.mark.parametrize("config,grad_accum,name", SEED_CASES, ids=[c[2] for c in SEED_CASES])
def test_trainer_seed_decides_the_data_order(ranks, reference, tmp_path, config, grad_accum, name):
    """SMPTrainer opening the smp session itself (smp.init seeds with random_seed) keeps the
    Trainer's seed for the default random sampler: the plain single-process Trainer's losses."""
    results = ranks(2).run(trainer_cases.train_smp_opens_session, config=config, output_dir=str(tmp_path),
                           grad_accum=grad_accum)
    assert_same_losses(results, reference(grad_accum)["losses"])


def test_trainer_seed_comparison_catches_another_seed(ranks, reference, tmp_path):
    """Negative control: another Trainer seed (another data order) moves the losses."""
    results = ranks(2).run(trainer_cases.train_smp_opens_session, config={}, output_dir=str(tmp_path), seed=1)
    expected = reference(1)["losses"]
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], expected)) > 100 * LOSS_TOL
