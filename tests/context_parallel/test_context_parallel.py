"""Context parallel (x FSDP / TP / checkpointing) through smp.transform vs the single-process run.

Families: Llama (GQA 4 / 2 heads, rotary), Qwen2 with a sliding window of 5 and Mistral with
one of 6 (windows that cross chunk boundaries; both GQA), and a user model with learned
positions that calls smp.context_parallel.attention. Sequences of 16 tokens: 4 chunks of 4 with
load balancing at cp = 2.

Tolerances (fp32): the ring sums each softmax in cp pieces merged by their log-sum-exp, so the
loss agrees to ~5e-7 and gradients to ~3e-8 (measured); we assert 1e-5 on both. Merging without
the log-sum-exp weights moves the loss by ~8e-3 and gradients by ~3e-2; skipping the other
ranks' blocks by ~4e-3 / ~1e-1: both caught by the same check.
"""

from __future__ import annotations

import pytest

import smp
from smp.config import load_config
from smp.context_parallel import chunk_positions, shift_labels
from smp.context_parallel.sharding import chunk_segments
from smp.mesh import ParallelDims
from tests.context_parallel import context_parallel_cases

LOSS_TOL, GRAD_TOL = 1e-5, 1e-5

CP2 = {"context_parallel_degree": 2}
CP2_UNBALANCED = {"context_parallel_degree": 2, "context_parallel": {"load_balance": False}}
CP2_ALLGATHER = {"context_parallel_degree": 2, "context_parallel": {"algorithm": "allgather"}}
CP2_ULYSSES = {"context_parallel_degree": 2, "context_parallel": {"algorithm": "ulysses"}}
CP2_ULYSSES_UNBALANCED = {"context_parallel_degree": 2,
                          "context_parallel": {"algorithm": "ulysses", "load_balance": False}}


def _check(reports: list[dict], cp_size: int = 2) -> None:
    for report in reports:
        assert report["cp_size"] == cp_size, report
        assert report["loss_diff"] < LOSS_TOL, report
        assert report["grad_diff"] < GRAD_TOL, report
        assert not report["probe_warnings"], report  # the attention probe ran on the meta device
    assert reports[0]["losses"][1] < reports[0]["losses"][0]  # it trains
    # A cp group shares its batch rows: every data-parallel rank appears with every cp rank.
    pairs = {(r["dp_rank"], r["cp_rank"]) for r in reports}
    assert pairs == {(dp, c) for dp, _ in pairs for c in range(cp_size)}


MATRIX = [
    # world, config, kind, padding
    (2, CP2, "llama", False),
    (2, CP2, "llama", True),
    (2, CP2_UNBALANCED, "llama", True),
    (2, CP2_ALLGATHER, "llama", True),
    (2, CP2, "qwen2", True),
    (2, CP2, "mixtral", True),
    (2, CP2_UNBALANCED, "mistral", False),
    (2, CP2, "user", True),
    (2, CP2_UNBALANCED, "user", False),
    (4, CP2, "llama", True),
    (4, CP2_UNBALANCED, "user", True),
    (2, CP2_ULYSSES, "llama", True),
    (2, CP2_ULYSSES, "qwen2", True),
    (2, CP2_ULYSSES_UNBALANCED, "mistral", False),
    (2, CP2_ULYSSES, "user", True),
    (4, CP2_ULYSSES, "llama", True),
]


@pytest.mark.parametrize(
    "world,config,kind,padding", MATRIX,
    ids=[f"w{w}-{'lb' if c.get('context_parallel', {}).get('load_balance', True) else 'nolb'}-"
         f"{c.get('context_parallel', {}).get('algorithm', 'ring')}-{k}{'-pad' if p else ''}" for w, c, k, p in MATRIX],
)
def test_matches_single_process(ranks, world, config, kind, padding):
    _check(ranks(world).run(context_parallel_cases.equivalence, config=config, kind=kind, padding=padding, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
@pytest.mark.parametrize("config", [CP2, CP2_ALLGATHER], ids=["ring", "allgather"])
def test_fsdp_families_slow(ranks, config, kind):
    _check(ranks(4).run(context_parallel_cases.equivalence, config=config, kind=kind, padding=True, timeout=300))


def test_hf_attention_is_replaced(ranks):
    reports = ranks(2).run(context_parallel_cases.equivalence, config=CP2, kind="llama", steps=1)
    assert all(r["attn"] == "smp_cp" for r in reports)


@pytest.mark.parametrize("corrupt", ["drop_lse", "skip_step"])
@pytest.mark.parametrize("config", [CP2, CP2_ALLGATHER], ids=["ring", "allgather"])
def test_wrong_merge_is_caught(ranks, config, corrupt):
    """Negative controls: the same comparison fails on a broken merge or a skipped ring step."""
    reports = ranks(2).run(context_parallel_cases.equivalence, config=config, kind="llama", corrupt=corrupt)
    assert max(max(r["loss_diff"], r["grad_diff"]) for r in reports) > 1e-3


def test_with_tensor_parallel(ranks):
    """cp 2 x tp 2 (sequence parallel) at world 4."""
    config = {**CP2, "tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}
    _check(ranks(4).run(context_parallel_cases.equivalence, config=config, kind="llama", padding=True, timeout=300))


def test_ulysses_with_tensor_parallel(ranks):
    """Ulysses cp 2 x tp 2 (sequence parallel) at world 4: 4 key/value heads, 1 per rank."""
    config = {**CP2_ULYSSES, "tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}
    _check(ranks(4).run(context_parallel_cases.equivalence, config=config, kind="llama_mha", padding=True, timeout=300))


@pytest.mark.parametrize("world,config,expected", [
    (4, {**CP2_ULYSSES, "tensor_parallel_degree": 2},
     "2 key/value heads do not divide by context_parallel_degree x tensor_parallel_degree = 2 x 2"),
    (4, {"context_parallel_degree": 4, "context_parallel": {"algorithm": "ulysses"}},
     "2 key/value heads do not divide by context_parallel_degree = 4"),
])
def test_ulysses_refuses_heads_that_do_not_split(ranks, world, config, expected):
    for message in ranks(world).run(context_parallel_cases.transform_error, config=config, kind="llama"):
        assert message.startswith("ConfigError") and expected in message, message


def test_ulysses_wrong_head_order_is_caught(ranks):
    """Negative control: the output's head groups put back in reverse rank order."""
    reports = ranks(2).run(context_parallel_cases.equivalence, config=CP2_ULYSSES, kind="llama",
                           corrupt="wrong_head_order")
    assert max(max(r["loss_diff"], r["grad_diff"]) for r in reports) > 1e-3


@pytest.mark.parametrize("kind", ["llama", "user"])
def test_with_full_activation_checkpointing(ranks, kind):
    config = {**CP2, "activation_checkpointing": "full"}
    _check(ranks(2).run(context_parallel_cases.equivalence, config=config, kind=kind, padding=True))


def test_with_hybrid_shard_and_mixed_precision_offload(ranks):
    """cp 2 x replicate 2 (HSDP: hybrid_shard_degree counts the cp ranks), delayed init and
    activation offloading; fp32 compute so the 1e-5 bound still applies."""
    config = {**CP2, "hybrid_shard_degree": 2, "delayed_param_initialization": False,
              "activation_offloading": True, "activation_offload_min_bytes": 0}
    _check(ranks(4).run(context_parallel_cases.equivalence, config=config, kind="llama", padding=True, timeout=300))


def test_bf16_mixed_precision_trains(ranks):
    config = {**CP2, "mixed_precision": {"param_dtype": "bf16"}}
    reports = ranks(2).run(context_parallel_cases.equivalence, config=config, kind="llama")
    assert all(r["loss_diff"] < 5e-2 for r in reports), reports


@pytest.mark.parametrize("save_cp,load_cp", [(2, 1), (1, 2)])
def test_checkpoint_resumes_across_cp(ranks, tmp_path, save_cp, load_cp):
    results = ranks(2).run(context_parallel_cases.checkpoint_round_trip, path=str(tmp_path / "ckpt"),
                           save_cp=save_cp, load_cp=load_cp, timeout=300)
    for r in results:
        assert r["param_diff"] == 0.0, r
        assert r["loss_diff"] < LOSS_TOL, r


# ----------------------------------------------------------------------------------------------
# Bad input: one clear error naming the cause, before any collective


@pytest.mark.parametrize(
    "config,seq_len,expected",
    [(CP2, 18, "sequence length 18 does not split into 2 x context_parallel_degree = 4 chunks"),
     (CP2_UNBALANCED, 15, "sequence length 15 does not split into context_parallel_degree = 2 chunks")],
)
def test_sequence_length_error(ranks, config, seq_len, expected):
    for message in ranks(2).run(context_parallel_cases.shard_error, config=config, seq_len=seq_len):
        assert message.startswith("UsageError") and expected in message, message


@pytest.mark.parametrize(
    "kind,expected",
    [("mha", "nn.MultiheadAttention"),
     ("gemma2_softcap", "attention logit soft-capping"),
     ("attention_dropout", "attention_dropout=0.1")],
)
def test_model_errors(ranks, kind, expected):
    for message in ranks(2).run(context_parallel_cases.transform_error, config=CP2, kind=kind):
        assert expected in message, message


@pytest.mark.parametrize(
    "kind,expected",
    [("mixed_sdpa", "layers.1 (InlineSDPABlock) calls F.scaled_dot_product_attention"),
     ("hand_softmax", "layers.1 (HandWrittenAttentionBlock) calls softmax(q @ k^T) itself"),
     ("inline_sdpa", "_LocalAttentionModel calls F.scaled_dot_product_attention"),
     ("no_attention", "_NoAttentionModel's forward never called smp.context_parallel.attention")],
)
def test_attention_smp_cannot_see_is_refused_before_any_collective(ranks, kind, expected):
    """The attention probe replays the first forward on the meta device before FSDP's root
    pre-forward: one layer of inline SDPA among smp-attention layers, a hand-written
    softmax(q @ k^T), or no smp attention at all raise on every rank with zero collectives run."""
    for r in ranks(2).run(context_parallel_cases.first_forward_error, config=CP2, kind=kind):
        assert r["error"].startswith("UsageError") and expected in r["error"], r
        assert "smp.context_parallel.attention(q, k, v, causal=True)" in r["error"], r
        assert r["collectives"] == 0, r


def test_without_the_probe_errors_come_late_or_never(ranks):
    """Negative control: with the probe left out, the runtime check refuses a model that never
    calls smp's attention only after collectives ran (the counter sees FSDP's all-gathers), and
    passes the model with one inline-SDPA layer, which then trains on 1/cp of each sequence."""
    for r in ranks(2).run(context_parallel_cases.first_forward_error, config=CP2, kind="no_attention", probe=False):
        assert "never called smp.context_parallel.attention" in r["error"] and r["collectives"] > 0, r
    for r in ranks(2).run(context_parallel_cases.first_forward_error, config=CP2, kind="mixed_sdpa", probe=False):
        assert r["error"] == "" and r["collectives"] > 0, r


def test_probe_that_cannot_run_falls_back_to_the_runtime_check(ranks):
    """A forward that reads a tensor value cannot run on the meta device: smp warns, watches the
    first real forward for inline SDPA and keeps the runtime check; it passes a model calling
    smp's attention and refuses one that computes attention itself, in every layer or in one."""
    for r in ranks(2).run(context_parallel_cases.first_forward_error, config=CP2, kind="reads_values"):
        assert r["error"] == "", r
        assert any("could not check _ValueReadingModel's attention" in w for w in r["warnings"]), r
    for r in ranks(2).run(context_parallel_cases.first_forward_error, config=CP2, kind="reads_values_inline"):
        assert "never called smp.context_parallel.attention" in r["error"], r
        assert any("could not check" in w for w in r["warnings"]), r
    # One inline layer among smp-attention layers: the first real forward is watched instead.
    for r in ranks(2).run(context_parallel_cases.first_forward_error, config=CP2, kind="reads_values_mixed"):
        assert "layers.1 (InlineSDPABlock) calls F.scaled_dot_product_attention" in r["error"], r
        assert any("could not check" in w for w in r["warnings"]), r


@pytest.mark.parametrize(
    "world,config,shape",
    [(2, CP2, (1, 1, 1, 1, 2, 1)), (4, CP2, (1, 1, 2, 1, 2, 1)), (8, {**CP2, "tensor_parallel_degree": 2}, (1, 1, 2, 1, 2, 2)),
     (8, {**CP2, "hybrid_shard_degree": 4}, (1, 2, 2, 1, 2, 1)), (8, {"context_parallel_degree": 4}, (1, 1, 2, 1, 4, 1))],
)
def test_parallel_dims(world, config, shape):
    dims = ParallelDims.from_config(load_config(config), world)
    assert dims.shape == shape
    assert dims.dp * dims.cp * dims.tp == world


@pytest.mark.parametrize(
    "world,config,bad",
    [(6, {"context_parallel_degree": 4}, "context_parallel_degree=4"),
     (4, {**CP2, "tensor_parallel_degree": 4}, "context_parallel_degree=2"),
     (8, {**CP2, "hybrid_shard_degree": 1}, "hybrid_shard_degree=1"),
     (8, {**CP2, "hybrid_shard_degree": 3}, "hybrid_shard_degree=3")],
)
def test_degree_errors_list_every_degree(world, config, bad):
    with pytest.raises(smp.ConfigError) as err:
        ParallelDims.from_config(load_config(config), world)
    message = str(err.value)
    assert bad in message
    for name in ("tensor_parallel_degree=", "hybrid_shard_degree=", "context_parallel_degree=", f"world_size={world}"):
        assert name in message


def test_load_balanced_chunks():
    assert chunk_segments(16, 2, 0, True) == [(0, 4), (12, 4)]
    assert chunk_segments(16, 2, 1, True) == [(4, 4), (8, 4)]
    assert chunk_positions(8, 2, 1, False).tolist() == [4, 5, 6, 7]
    covered = sorted(i for r in range(4) for i in chunk_positions(32, 4, r, True).tolist())
    assert covered == list(range(32))


def test_labels_shift_across_chunk_boundaries():
    """The last token of one chunk predicts the first token of the next (shift before the cut)."""
    import torch

    from smp.context_parallel.sharding import shard_batch

    ids = torch.arange(8)[None]
    assert shift_labels(ids).tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    first = shard_batch(ids, cp_size=2, cp_rank=0, load_balance=False)
    assert first["labels"].tolist() == [[1, 2, 3, 4]]  # token 3 predicts token 4 on the other rank
    assert first["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert float(first["num_items_in_batch"]) == 7 / 2


def test_ulysses_bytes_match_the_plan(ranks):
    """What one Ulysses forward + backward sends equals the formula `smp plan` reports."""
    for r in ranks(2).run(context_parallel_cases.ulysses_bytes):
        assert r["measured"] == r["formula"] > 0, r
