"""Rank-side cases for model coverage: the families users bring (registry-generated decoders,
BERT masked LM, T5, GPT-2) under FSDP, activation checkpointing, delayed initialisation and
`load_hf`, each compared with one process. Each function returns plain data to the test."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import traceback
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import smp
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import random_batch, tiny_gpt2, tiny_llama, tiny_llama_config
from tests.models import model_coverage_pp_cases as pp_cases  # the pipeline column ("pp2")

GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 256
TOL = 1e-5

# The tiny shape every family is built at (a config ignores the keys it does not have).
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=128, head_dim=16,
    # Mixture-of-experts and other per-family sizes, kept small and consistent with the above.
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, first_k_dense_replace=1, shared_expert_intermediate_size=32,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    sliding_window=16, layer_types=None,
)

# Families without a `base_model_tp_plan` (tests and the script). Under TP they get smp's own
# table (GPT-2) or its refusal.
EXTRA_FAMILIES = ("bert-mlm", "t5", "gpt2")

# The matrix's modes (its columns), as arguments of their case function (`classify`, or the one
# CASE_FUNCTIONS names): the tests and the script share them.
TP2 = {"tensor_parallel_degree": 2}  # the model's own plan (base_model_tp_plan)
# Offload every saved activation: the default threshold (1 MiB) keeps all of a tiny model's on device.
AC_OFFLOAD = {"activation_checkpointing": "full", "activation_offloading": True, "activation_offload_min_bytes": 0}
MODES = {
    "fsdp": dict(config={}, delayed=False),
    "delayed": dict(config={}, delayed=True),
    "tp2": dict(config=TP2, delayed=False),
    "tp2-sp": dict(config={**TP2, "tensor_parallel": {"sequence_parallel": True}}, delayed=False),
    "ac-offload": dict(config=AC_OFFLOAD, delayed=False),
    # world 4: TP=2 inside, FSDP over the 2 data-parallel ranks outside
    "tp2-fsdp2-sp": dict(config={**TP2, "tensor_parallel": {"sequence_parallel": True}}, delayed=False),
    # world 4: FSDP hybrid sharding, 2 replicas x 2 shards
    "hybrid": dict(config={"hybrid_shard_degree": 2}, delayed=False),
    # transformers' own TP=2 (`from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`):
    # the peer, for the side-by-side with smp's TP=2 column
    "peer": dict(),
    # pipeline 2 stages, 1F1B, 4 micro-batches (world 2): tests/models/model_coverage_pp_cases.py
    "pp2": dict(config=pp_cases.PP2),
    # packed sequences through smp.step, TP 2 + SP (the script falls back to FSDP 2 for a family
    # not exact at TP 2 + SP): `packed` below
    "packed": dict(layout="tp2-sp"),
    # PEFT LoRA on every linear but the head, TP 2 with the model's own plan: `lora_tp2` below
    "lora-tp2": dict(config=TP2),
}
WORLD = {"tp2-fsdp2-sp": 4, "hybrid": 4}  # the world size of a mode, when not 2


# --- building -------------------------------------------------------------------------------

def tiny_bert_mlm(**overrides):
    from transformers import BertConfig, BertForMaskedLM

    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(BertConfig(**{**kwargs, **overrides}))


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=VOCAB, dropout_rate=0.0,
        decoder_start_token_id=0,
    ))


def registry_families() -> list[tuple[str, str | None]]:
    """(model_type, reason it cannot be covered or None) for every causal-LM family in
    transformers' registry whose config ships a `base_model_tp_plan`, in registry order."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = CONFIG_MAPPING[model_type]
        except (KeyError, ImportError, AttributeError):
            continue
        if not getattr(config_class, "base_model_tp_plan", None):
            continue
        sub = getattr(config_class, "sub_configs", None) or {}
        reason = (f"composite config ({', '.join(sorted(sub))}): needs inputs beyond input_ids"
                  if sub else None)
        families.append((model_type, reason))
    return families


def tiny_config(model_type: str):
    """`model_type`'s config at the tiny shape, dropout off (dropout draws differ per rank)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    overrides = {k: v for k, v in TINY.items() if hasattr(defaults, k)}
    if "layer_types" in overrides:
        overrides.pop("layer_types")  # recomputed from num_hidden_layers by the config itself
    config = config_class(**overrides)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids of the default vocab
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= VOCAB:
            setattr(config, name, 0)
    for name, value in vars(config).items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            setattr(config, name, 0.0)
    return config


def build_family(family: str) -> torch.nn.Module:
    if family == "bert-mlm":
        return tiny_bert_mlm()
    if family == "t5":
        return tiny_t5()
    if family == "gpt2":
        return tiny_gpt2()
    if family == "llama":
        return tiny_llama()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(family))


def loss_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Masked-LM, seq2seq or causal-LM loss on `input_ids` as the labels too."""
    return model(input_ids=input_ids, labels=input_ids).loss


# --- comparison -----------------------------------------------------------------------------

def _grad_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest gradient gap by parameter name; a parameter no loss reached (None) counts as 0."""
    ref = dict(reference.named_parameters(remove_duplicate=False))  # both names of a tied tensor (pp stages)
    worst = 0.0
    for name, p in model.named_parameters():
        g = torch.zeros(p.shape) if p.grad is None else full_tensor(p.grad).float()
        r = torch.zeros(p.shape) if ref[name].grad is None else ref[name].grad.float()
        worst = max(worst, float((g - r).abs().max()) if g.numel() else 0.0)
    return worst


def _param_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    ref = dict(reference.named_parameters())
    ref.update(dict(reference.named_buffers()))
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return max(float((full_tensor(t.detach()).float() - ref[n].detach().float()).abs().max())
               for n, t in tensors if t.numel())


def compare(model: torch.nn.Module, reference: torch.nn.Module, steps: int) -> dict:
    """Loss, gradient and parameter gaps of `model` (transformed) vs `reference` (one process)
    over `steps` SGD steps on one global batch."""
    report = {"param_diff": _param_diff(model, reference), "loss_diff": 0.0, "grad_diff": 0.0, "losses": []}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
    for _ in range(steps):
        loss = loss_of(model, local_rows(batch))
        loss.backward()
        ref_loss = loss_of(reference, batch)
        ref_loss.backward()
        report["losses"].append(float(ref_loss))
        report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss) - float(ref_loss)))
        report["grad_diff"] = max(report["grad_diff"], _grad_diff(model, reference))
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    return report


def training_forward_is_random(model: torch.nn.Module) -> bool:
    """Whether `model`'s training forward draws random numbers (same batch, other seed, other
    loss): PhiMoE's sparsemixer router samples its experts in training mode, whatever the config's
    jitter. Such draws differ between one process and each rank's rows; they are not sharding."""
    state = torch.get_rng_state()
    batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
    losses = []
    with torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            losses.append(float(loss_of(model, batch)))
    torch.set_rng_state(state)
    return losses[0] != losses[1]


def equivalence(config: dict, family: str, steps: int = 2, delayed: bool = False,
                break_sync: bool = False) -> dict:
    """`family` transformed under `config` vs the same model in one process (same init, same
    global batch). `break_sync` turns off gradient reduction, which the comparison must catch.
    A family whose training forward is random is compared in eval mode (report["eval_mode"])."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build_family(family)
        reference.train()
        eval_mode = training_forward_is_random(copy.deepcopy(reference))  # a forward may update buffers
        if eval_mode:
            reference.eval()
        if delayed:
            with torch.device("meta"):
                model = build_family(family)
        else:
            model = copy.deepcopy(reference)
        model = smp.transform(model)
        if break_sync:
            from tests.sharding.dist_cases import _LocalOnlyReduceScatter

            for m in model.modules():
                if hasattr(m, "set_custom_reduce_scatter"):
                    m.set_custom_reduce_scatter(_LocalOnlyReduceScatter())
        model.train(reference.training)
        report = compare(model, reference, steps)
        return {**report, "eval_mode": eval_mode, **_what_acted(model)}


def _what_acted(model: torch.nn.Module) -> dict:
    """How much the mode under test did: parameters split over the "tp" mesh axis, bytes the
    activation offloader moved to host in the last forward. A cell whose mechanism did nothing
    proves nothing about it, however exact its numbers."""
    from torch.distributed.tensor import DTensor

    from smp.activations import offload_stats

    stats = offload_stats(model)
    return {
        "tp_split": sum(1 for p in model.parameters()
                        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())),
        "offloaded_bytes": stats.total_offloaded_bytes if stats else 0,
    }


def _unproven(config: dict, report: dict) -> str:
    """Why an exact-looking cell proves nothing about its mode ('' when it does)."""
    if config.get("tensor_parallel_degree", 1) > 1 and not report["tp_split"]:
        return "tensor parallel split no parameter: the model ran whole on each rank"
    if config.get("activation_offloading") and not report["offloaded_bytes"]:
        return "activation offloading moved no activation to host"
    return ""


def classify(config: dict, family: str, delayed: bool = False) -> dict:
    """One coverage cell: {"status": exact | refused | unproven | mismatch | crash, "detail"}.

    exact: loss and gradients within TOL of one process (and, for delayed init, parameters
    bitwise equal), with the mode's mechanism at work (TP split parameters, offloading moved
    activations); refused: smp raised one of its own errors (the message is the reason);
    unproven: within TOL but the mechanism did nothing."""
    try:
        report = equivalence(config, family, steps=1, delayed=delayed)
    except smp.Error as e:
        return {"status": "refused", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with its traceback
        return {"status": "crash", "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    exact = report["loss_diff"] < TOL and report["grad_diff"] < TOL and (not delayed or report["param_diff"] == 0.0)
    unproven = _unproven(config, report)
    if exact and unproven:
        return {"status": "unproven", "detail": unproven}
    cell = {"status": "exact" if exact else "mismatch", "detail": {k: v for k, v in report.items() if k != "losses"}}
    if report["eval_mode"]:
        cell["note"] = "eval mode: its training forward draws random numbers (sampled routing)"
    return cell


def can_build(family: str) -> str | None:
    """None, or why the tiny `family` cannot run here at all: built eagerly and trained one
    step in one process, without smp (a family that fails this is a limit of the tiny config
    or of `input_ids`-only inputs, not a finding about smp)."""
    try:
        torch.manual_seed(0)
        model = build_family(family)
        loss_of(model, random_batch(2, SEQ, VOCAB, seed=0)).backward()
    except Exception as e:  # noqa: BLE001 - recorded as the skip reason
        return f"does not run in one process at the tiny shape: {type(e).__name__}: {e}".splitlines()[0][:200]
    return None


# --- the peer: transformers' own tensor parallelism -----------------------------------------

def _peer_compare(peer: torch.nn.Module, reference: torch.nn.Module) -> dict:
    """Loss and gradient gaps of the peer's TP model vs one process after one step on the
    global batch (TP ranks share it), and how many parameters the peer split."""
    batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
    loss = loss_of(peer, batch)
    loss.backward()
    ref_loss = loss_of(reference, batch)
    ref_loss.backward()
    split = sum(1 for p in peer.parameters() if isinstance(p, DTensor) and not all(pl.is_replicate() for pl in p.placements))
    return {"loss_diff": abs(float(full_tensor(loss.detach())) - float(ref_loss.detach())),
            "grad_diff": _grad_diff(peer, reference), "tp_split": split}


def peer_tp2(family: str, corrupt_shard: bool = False) -> dict:
    """One peer cell: `family` written with `save_pretrained`, loaded by transformers' own TP
    (`from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))`, on the process
    group the ranks already hold) vs the same folder loaded in one process: loss and gradients of
    one step on the global batch, as `classify` compares. Statuses as `classify`'s, except that any error from the peer is a crash (it has no
    refusals of its own to tell apart) and "not run" says why the peer had nothing to do.
    No smp session: this measures transformers alone. `corrupt_shard` (negative control) nudges
    rank 1's shard of the first split parameter by 1e-3, which the comparison must catch."""
    from transformers.distributed import DistributedConfig
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # one bar per load and rank otherwise
    torch.manual_seed(0)
    model = build_family(family)
    if not (getattr(model.config, "base_model_tp_plan", None) or getattr(model, "_tp_plan", None)):
        return {"status": "not run", "detail": f"{type(model).__name__} ships no base_model_tp_plan"}
    path = [tempfile.mkdtemp(prefix=f"peer-{family}-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    try:
        if dist.get_rank() == 0:
            model.save_pretrained(path[0])
        dist.barrier()
        try:
            reference = type(model).from_pretrained(path[0], dtype=torch.float32)
        except Exception as e:  # noqa: BLE001 - not the peer's TP: the folder does not round-trip
            return {"status": "not run", "detail": f"one-process from_pretrained fails: {type(e).__name__}: {e}"}
        eval_mode = training_forward_is_random(copy.deepcopy(reference))
        reference.train(not eval_mode)
        try:
            peer = type(model).from_pretrained(path[0], dtype=torch.float32,
                                               distributed_config=DistributedConfig(tp_size=2))
            peer.train(reference.training)
            if corrupt_shard and dist.get_rank() == 1:
                with torch.no_grad():
                    next(p for p in peer.parameters() if isinstance(p, DTensor)
                         and not all(pl.is_replicate() for pl in p.placements)).to_local().add_(1e-3)
            report = _peer_compare(peer, reference)
        except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with its traceback
            return {"status": "crash", "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)
    exact = report["loss_diff"] < TOL and report["grad_diff"] < TOL
    if exact and not report["tp_split"]:
        return {"status": "unproven", "detail": "the peer's TP split no parameter: the model ran whole on each rank"}
    cell = {"status": "exact" if exact else "mismatch", "detail": report}
    if eval_mode:
        cell["note"] = "eval mode: its training forward draws random numbers (sampled routing)"
    return cell


# --- packed sequences ("packed") ------------------------------------------------------------

# Where a packed batch runs: TP 2 + sequence parallel cuts each row between the layers, across
# the documents' boundaries (the harder case), for the families exact there; FSDP 2 splits the
# rows over two data ranks, whose target counts the loss must add up. Both at world 2.
PACKED_LAYOUTS = {"tp2-sp": {**TP2, "tensor_parallel": {"sequence_parallel": True}}, "fsdp": {}}
PACKED_LAYOUT_NAMES = {"tp2-sp": "TP 2 + SP", "fsdp": "FSDP 2"}


def _not_causal(model: torch.nn.Module) -> str:
    """Why packing does not apply to `model` ('' when it does): packed rows are a causal LM's
    (a masked LM attends both ways, T5 takes no position ids)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return ""
    return f"n/a: {type(model).__name__} is not a causal LM (packed rows are a causal LM's training data)"


def _packed_vs_documents(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                         use_cache: bool = False) -> tuple[float, float, float]:
    """One process, no smp: the packed batch's loss (its gradients left in `model`: the reference
    the smp run is held to) and its loss and gradient gaps to the documents run one by one, each
    document's summed token losses over the batch's target count. A gap means transformers'
    model mixes tokens across the documents: its packed run is no reference for per-document
    training.
    `use_cache` (negative control): the packed run builds a cache, with which transformers
    ignores the documents in position_ids."""
    from smp.context_parallel.sharding import shift_labels
    from tests.training.packed_cases import documents_of, hf_loss

    targets = int((shift_labels(batch["labels"]) != -100).sum())
    documents_loss = 0.0
    for document in documents_of(batch):
        loss = loss_of_document(model, document) * (len(document) - 1) / targets
        loss.backward()
        documents_loss += float(loss.detach())
    documents_grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    if use_cache:
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=True).loss
    else:
        loss = hf_loss(model, batch)
    loss.backward()
    grad_gap = 0.0  # a parameter no loss reached (None) counts as 0, as in _grad_diff
    for n, p in model.named_parameters():
        packed_grad = torch.zeros(p.shape) if p.grad is None else p.grad
        documents_grad = torch.zeros(p.shape) if documents_grads[n] is None else documents_grads[n]
        grad_gap = max(grad_gap, float((packed_grad - documents_grad).abs().max()) if p.numel() else 0.0)
    return float(loss.detach()), abs(float(loss.detach()) - documents_loss), grad_gap


def loss_of_document(model: torch.nn.Module, document: torch.Tensor) -> torch.Tensor:
    """One document alone in its row (positions 0, 1, ... by default), its own tokens the labels."""
    return model(input_ids=document[None], labels=document[None], use_cache=False).loss


def packed(family: str, layout: str = "tp2-sp", global_positions: bool = False,
           cache_in_reference: bool = False) -> dict:
    """One "packed" cell: `family` on a packed batch (tests/training/packed_cases.py: four rows
    of three documents, positions restarting at each, each document's first token not a target,
    no attention mask) through smp.step under PACKED_LAYOUTS[layout] vs one process on the same
    batch: loss and every gradient within TOL. First the one-process run is held to the
    documents run one by one; a family whose transformers model attends across the documents
    is "not run" and says so (its packed run is no reference). Negative controls:
    `global_positions`, the smp run's positions count 0, 1, ... over the whole row (a mismatch);
    `cache_in_reference`, the one-process run builds a cache and attends across the documents
    (not packing-aware, never exact)."""
    from tests.training.packed_cases import SEQ as PACKED_SEQ, packed_batch

    config = PACKED_LAYOUTS[layout]
    notes = []
    try:
        with smp.session(config):
            torch.manual_seed(smp.state.config.random_seed)
            reference = build_family(family)
            not_causal = _not_causal(reference)
            if not_causal:
                return {"status": "not run", "detail": not_causal}
            if getattr(reference.config, "output_router_logits", False):
                # the load-balancing loss is a statistic of the whole batch, not a sum over documents
                reference.config.output_router_logits = False
                notes.append("load-balancing loss off")
            reference.train()
            if training_forward_is_random(copy.deepcopy(reference)):
                reference.eval()
                notes.append("eval mode: its training forward draws random numbers (sampled routing)")
            model = copy.deepcopy(reference)
            batch = packed_batch()
            try:
                ref_loss, doc_loss_gap, doc_grad_gap = _packed_vs_documents(reference, batch,
                                                                            use_cache=cache_in_reference)
            except Exception as e:  # noqa: BLE001 - transformers' model, no smp yet
                why = f"one process cannot run the packed rows: {type(e).__name__}: {e}"
                return {"status": "not run", "detail": why.splitlines()[0][:300]}
            if doc_loss_gap >= TOL or doc_grad_gap >= TOL:
                return {"status": "not run", "detail": (
                    f"not packing-aware in transformers: one process on the packed rows differs from the documents "
                    f"run one by one (loss {doc_loss_gap:.1e}, gradients {doc_grad_gap:.1e}): its forward mixes "
                    f"tokens across them")}
            model = smp.transform(model)
            model.train(reference.training)
            rows = {name: local_rows(t) for name, t in batch.items()}
            if global_positions:
                rows["position_ids"] = torch.arange(PACKED_SEQ).expand_as(rows["input_ids"])
            loss = smp.step(model, rows)
            report = {"loss_diff": abs(float(loss) - ref_loss), "grad_diff": _grad_diff(model, reference),
                      "documents_loss_gap": doc_loss_gap, "documents_grad_gap": doc_grad_gap, **_what_acted(model)}
    except smp.Error as e:
        return {"status": "refused", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with its traceback
        return {"status": "crash", "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    exact = report["loss_diff"] < TOL and report["grad_diff"] < TOL
    unproven = _unproven(config, report)
    if exact and unproven:
        return {"status": "unproven", "detail": unproven}
    cell = {"status": "exact" if exact else "mismatch", "detail": report}
    if layout != "tp2-sp":
        notes.insert(0, f"under {PACKED_LAYOUT_NAMES[layout]}")
    if notes:
        cell["note"] = "; ".join(notes)
    return cell


# --- LoRA under tensor parallel ("lora-tp2") ------------------------------------------------

def lora_targets(model: torch.nn.Module) -> str:
    """PEFT's target_modules for `model`: every plain linear layer (GPT-2's Conv1D too) but the
    output head, by full name: the attention and MLP projections (and a router that is a plain
    linear layer). Not PEFT's "all-linear", which also wraps a mixture-of-experts' 3-D expert
    weights (ParamWrapper), refused by smp under TP, which would hide how the family's
    projections fare; nor subclasses of nn.Linear with a forward of their own (Llama 4's router
    returns a tuple, DeepSeek-V4's grouped output projection reshapes): PEFT's LoRA layer
    assumes nn.Linear's forward and fails on them in one process already."""
    import re

    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    names = [n for n, m in model.named_modules() if type(m) in (torch.nn.Linear, Conv1D) and m is not head]
    return "|".join(re.escape(n) for n in names)


@contextlib.contextmanager
def _targets_as_named() -> Iterator[None]:
    """PEFT (0.21) rewrites the targets of a mixture-of-experts family whose layout changed in
    transformers v5 as if they named v4's per-expert linears: every `*.gate_proj` / `up_proj` /
    `down_proj` becomes the experts' 3-D parameters (the dense MLPs and shared experts then get
    no adapter), and a linear router becomes a parameter target. Our targets name v5's own
    modules, so that rewrite stays off while PEFT wraps them."""
    from peft.utils import transformers_weight_conversion as conversion

    rewrite = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda peft_config, model, conversions: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = rewrite


def peft_model(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with LoRA (PEFT) on lora_targets, rank 4. Adapters start random
    (`init_lora_weights=False`): PEFT's B = 0 would leave every A's gradient 0 and hide a wrong
    reduction of A's output."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(model), lora_dropout=0.0,
                        init_lora_weights=False)
    with _targets_as_named():
        return get_peft_model(model, config)


def lora_tp2(config: dict, family: str, corrupt: str | None = None) -> dict:
    """One "lora-tp2" cell: `family` with LoRA (peft_model) under `config` vs the same PeftModel
    in one process: loss and every gradient (adapters; the frozen base has none on either side)
    of one step within TOL, with at least one adapted layer whose base the plan splits over the
    "tp" axis ("not run" when it splits none: the adapters then run beside whole layers; beside
    a split layer they may still be whole, e.g. beside a gathered one: lora.py). `corrupt`:
    tests/tensor_parallel/lora_tp_cases.py's negative controls ("unreduced": a row-wise
    layer's lora_A output left as this rank's partial sum)."""
    from smp.tensor_parallel.lora import is_lora_layer
    from tests.tensor_parallel.lora_tp_cases import _corrupted

    try:
        with smp.session(config):
            torch.manual_seed(smp.state.config.random_seed)
            base = build_family(family)
            eval_mode = training_forward_is_random(copy.deepcopy(base))
            try:
                reference = peft_model(base)
            except Exception as e:  # noqa: BLE001 - PEFT's own limit, before smp
                return {"status": "not run",
                        "detail": f"PEFT cannot wrap it: {type(e).__name__}: {e}".splitlines()[0][:300]}
            reference.train(not eval_mode)
            model = copy.deepcopy(reference)
            batch = random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=100)
            try:
                ref_loss = loss_of(reference, batch)
                ref_loss.backward()
            except Exception as e:  # noqa: BLE001 - PEFT's model in one process, before smp
                why = f"PEFT's LoRA model fails in one process: {type(e).__name__}: {e}"
                return {"status": "not run", "detail": why.splitlines()[0][:300]}
            with _corrupted(corrupt):
                model = smp.transform(model)
            model.train(reference.training)
            loss = loss_of(model, local_rows(batch))
            loss.backward()
            trainable = [p for p in model.parameters() if p.requires_grad]
            report = {"loss_diff": abs(world_mean(loss) - float(ref_loss.detach())),
                      "grad_diff": _grad_diff(model, reference), "adapters": len(trainable),
                      "adapters_split": sum(1 for p in trainable if _on_tp(p)),
                      "layers_split": sum(1 for m in model.modules()
                                          if is_lora_layer(m) and _on_tp(m.base_layer.weight))}
    except smp.Error as e:
        return {"status": "refused", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with its traceback
        return {"status": "crash", "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    exact = report["loss_diff"] < TOL and report["grad_diff"] < TOL
    if exact and not report["layers_split"]:
        # a plan that splits only the experts (GraniteMoE, PhiMoE, DeepSeek-V4): the adapters run
        # whole beside whole layers, which is no case of LoRA under TP
        return {"status": "not run", "detail": (
            "n/a: the family's TP plan splits none of the linear layers LoRA adapts, so every "
            "adapter ran whole (within 1e-5 of one process, which proves nothing about LoRA under TP)")}
    cell = {"status": "exact" if exact else "mismatch", "detail": report}
    if eval_mode:
        cell["note"] = "eval mode: its training forward draws random numbers (sampled routing)"
    return cell


def _on_tp(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())


# mode -> its case function, where it is not `classify`
CASE_FUNCTIONS = {"peer": peer_tp2, "pp2": pp_cases.classify, "packed": packed, "lora-tp2": lora_tp2}


# --- activation checkpointing: nested configs ----------------------------------------------

def t5_checkpointing_with_decoder_cache(config: dict) -> str:
    """Negative control: T5 under full checkpointing with its decoder's own config forced back
    to use_cache=True must fail at recompute (the failure the fix prevents)."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(tiny_t5())
        model.decoder.config.use_cache = True
        try:
            loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=1))).backward()
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return ""


# --- delayed initialisation: every way to build a meta model --------------------------------

META_IDIOMS = ("init_context", "torch_meta", "accelerate", "accelerate_buffers", "from_pretrained_meta")


def _build_llama_on_meta(idiom: str, saved_dir: str) -> torch.nn.Module:
    if idiom == "init_context":
        with smp.init_context():
            return tiny_llama()
    if idiom == "torch_meta":
        with torch.device("meta"):
            return tiny_llama()
    if idiom in ("accelerate", "accelerate_buffers"):
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=idiom == "accelerate_buffers"):
            return tiny_llama()
    if idiom == "from_pretrained_meta":
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(saved_dir, device_map="meta")
    raise ValueError(f"unknown idiom {idiom!r}")


def meta_idiom(config: dict, idiom: str, saved_dir: str, keep_hf_marks: bool = False) -> dict:
    """Llama built by `idiom` then transformed vs eager construction for the same seed:
    {"param_diff", "grad_diff", "error"}. `keep_hf_marks` (negative control) leaves
    transformers' `_is_hf_initialized` marks in place, which must not pass silently."""
    from smp.sharding import delayed_init

    with smp.session(config):
        seed = smp.state.config.random_seed
        if dist.get_rank() == 0 and idiom == "from_pretrained_meta":
            torch.manual_seed(seed + 1)
            tiny_llama().save_pretrained(saved_dir)  # same config, other values than eager's
        dist.barrier()
        torch.manual_seed(seed)
        reference = tiny_llama()
        model = _build_llama_on_meta(idiom, saved_dir)
        clear = delayed_init._clear_hf_init_marks
        if keep_hf_marks:
            delayed_init._clear_hf_init_marks = lambda model: None
        try:
            model = smp.transform(model)
        except (smp.Error, ValueError) as e:
            return {"error": str(e)}
        finally:
            delayed_init._clear_hf_init_marks = clear
        report = compare(model, reference, steps=1)
        return {"error": "", "param_diff": report["param_diff"], "grad_diff": report["grad_diff"],
                "loss": report["losses"][0]}


# --- load_hf: what from_pretrained loads ----------------------------------------------------

def _tiny_bert_base(**overrides):
    from transformers import BertConfig, BertModel

    kwargs = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    return BertModel(BertConfig(**{**kwargs, **overrides}), add_pooling_layer=False)


def _rewrite_safetensors(directory: str, edit) -> None:
    """Apply `edit(dict name -> tensor)` to the single-file checkpoint in `directory`."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    save_file(edit(tensors), path, metadata={"format": "pt"})


def _write_checkpoint(kind: str, directory: str) -> None:
    """One published-checkpoint shape, written with save_pretrained (+ safetensors edits)."""
    from transformers import LlamaModel

    torch.manual_seed(7)
    if kind == "sentence_transformers":  # legacy persistent position_ids buffer in the file
        model = _tiny_bert_base()
        model.save_pretrained(directory)
        _rewrite_safetensors(directory, lambda t: {**t, "embeddings.position_ids": torch.arange(64)[None]})
    elif kind == "bert_prefixed":  # a `bert.`-prefixed file (a task model's base) into BertModel
        _tiny_bert_base().save_pretrained(directory)
        _rewrite_safetensors(directory, lambda t: {f"bert.{k}": v for k, v in t.items()})
    elif kind in ("bert_base_into_mlm", "wrong_key"):  # plain base keys into BertForMaskedLM
        _tiny_bert_base().save_pretrained(directory)
        if kind == "wrong_key":  # negative control: a key that really does not match
            _rewrite_safetensors(directory, lambda t: {**t, "encoder.layer.9.output.dense.weight": torch.zeros(2)})
    elif kind == "llama_base":  # a LlamaModel (no `model.` prefix, no lm_head) into LlamaModel
        LlamaModel(tiny_llama_config()).save_pretrained(directory)
    elif kind == "llama_prefixed_into_base":  # a LlamaForCausalLM file's `model.` keys into LlamaModel
        tiny_llama().save_pretrained(directory)
        _rewrite_safetensors(directory, lambda t: {k: v for k, v in t.items() if k.startswith("model.")})
    elif kind == "llama_sharded_tied":  # several files + index, tied head present once
        tiny_llama(tie_word_embeddings=True).save_pretrained(directory, max_shard_size="40KB")
    elif kind == "llama_tied_twice":  # tied head written under both names
        tiny_llama(tie_word_embeddings=True).save_pretrained(directory)
        _rewrite_safetensors(directory, lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()})
    else:
        raise ValueError(kind)


def _target_model(kind: str) -> torch.nn.Module:
    from transformers import LlamaModel

    torch.manual_seed(99)  # other values than the checkpoint's
    if kind in ("sentence_transformers", "bert_prefixed"):
        return _tiny_bert_base()
    if kind in ("bert_base_into_mlm", "wrong_key"):
        return tiny_bert_mlm()
    if kind in ("llama_base", "llama_prefixed_into_base"):
        return LlamaModel(tiny_llama_config())
    return tiny_llama(tie_word_embeddings=True)


def load_hf_like_from_pretrained(config: dict, kind: str, directory: str) -> dict:
    """load_hf into the transformed model vs transformers' from_pretrained of the same folder:
    {"error", "param_diff", "warnings"} (the warnings smp raised on this rank)."""
    with smp.session(config):
        if dist.get_rank() == 0:
            _write_checkpoint(kind, directory)
        dist.barrier()
        target = _target_model(kind)
        extra = {"add_pooling_layer": False} if type(target).__name__ == "BertModel" else {}
        expected = type(target).from_pretrained(directory, config=target.config, **extra)
        model = smp.transform(target)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                smp.checkpointing.load_hf(directory, model)
            except smp.CheckpointError as e:
                return {"error": str(e), "warnings": []}
        smp_warnings = [str(w.message) for w in caught if "load_hf" in str(w.message)]
        ref = dict(expected.named_parameters())
        # A base checkpoint leaves a task head at its init, in both: compare what the file holds.
        loaded = [(n, p) for n, p in model.named_parameters() if kind != "bert_base_into_mlm" or n.startswith("bert.")]
        diff = max(float((full_tensor(p.detach()) - ref[n].detach()).abs().max()) for n, p in loaded)
        return {"error": "", "param_diff": diff, "warnings": smp_warnings,
                "files": sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))}

