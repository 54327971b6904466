"""smp.sagemaker cases that run on every rank of a RankPool: the ported SMP v2-style script
(examples/smp_v2_style/train.py) against the same training through smp's native API, the SMP
state names, and transform(load_state_dict_from_rank0=True)."""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

import smp
from tests import REPO_ROOT

REPO = str(REPO_ROOT)
SCRIPT = os.path.join(REPO, "examples", "smp_v2_style", "train.py")


def script():
    """The example script as a module (examples/ is not a package)."""
    name = "smp_v2_style_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ported_script(*, mp_parameters: str | None, argv: list[str]) -> dict:
    """Run the script's train() with SageMaker's config delivery ($SM_HP_MP_PARAMETERS)."""
    with _environment(SM_HP_MP_PARAMETERS=mp_parameters, SMP_CONFIG=None):
        try:
            losses = script().train(script().parse_args(argv))
            return {"losses": losses, "mesh": list(smp.state.mesh.mesh.shape), "dp_rank": smp.state.dp_rank}
        finally:
            smp.shutdown()


def native_training(*, config: dict, argv: list[str]) -> list[float]:
    """The script's training through smp's own API: eager model, smp.transform, smp.clip_grad_norm_."""
    s = script()
    args = s.parse_args(argv)
    with smp.session(config):
        model = smp.transform(s.LlamaForCausalLM(s.get_model_config(args)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        losses = []
        for step in range(args.max_steps):
            input_ids = s.get_batch(args, step, smp.state.dp_rank, smp.state.dp_size)
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            smp.clip_grad_norm_(model, args.grad_clip)
            optimizer.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
        return losses


def state_names(*, config: dict) -> dict:
    import smp.sagemaker as tsm

    ranks = dist.get_process_group_ranks
    with _environment(SM_HP_MP_PARAMETERS=None, SMP_CONFIG=None):
        tsm.init(config)
    try:
        st = tsm.state
        names = {
            "same_run": (st.rank, st.dp_rank, st.mesh) == (smp.state.rank, smp.state.dp_rank, smp.state.mesh),
            "core_lacks_v2_names": not any(hasattr(smp.state, n) for n in ("tensor_parallel_degree", "ranker",
                                                                         "rep_rank_process_group")),
            "degrees": [st.tensor_parallel_degree, st.context_parallel_degree, st.expert_parallel_degree,
                        st.hybrid_shard_degree],
            "offloading": st.sm_activation_offloading,
            "cp": [st.cp_rank, st.cp_size, st.cp_process_group],
            "ep": [st.ep_rank, st.ep_size],
            "tp_group": ranks(st.tp_process_group),
            "rep_group": ranks(st.rep_rank_process_group),
            "world_group": ranks(st.world_process_group),
            "rep_rank": st.ranker.get_rep_rank(),
            "rep_rank_of_3": st.ranker.get_rep_rank(3),
            "rep_groups": st.ranker.get_rep_groups(),
            "tp_groups": st.ranker.get_tp_groups(),
            "shard_groups": st.ranker.get_shard_groups(),
        }
        try:
            st.tensor_parallel_degree = 8
        except AttributeError as e:
            names["assign_error"] = str(e)
        names["tp_after_assign"] = st.tensor_parallel_degree
        try:
            st.ranker.get_pp_rank()
        except NotImplementedError as e:
            names["ranker_error"] = str(e)
        return names
    finally:
        smp.shutdown()


def rank0_weights(*, load_from_rank0: bool, others_meta: bool) -> float | None:
    """Rank 0 builds real weights (seed 99), the others a meta model (or other real weights,
    seed 5); returns on rank 0 the largest difference between rank 0's weights and the sharded
    model's full tensors."""
    import smp.sagemaker as tsm
    from smp.testing.models import tiny_llama

    with _environment(SM_HP_MP_PARAMETERS=None, SMP_CONFIG=None):
        tsm.init({"sm_activation_offloading": False})
    try:
        if dist.get_rank() == 0:
            torch.manual_seed(99)
            model = tiny_llama()
            original = {k: v.detach().clone() for k, v in model.state_dict().items()}
        elif others_meta:
            with torch.device("meta"):
                model = tiny_llama()
        else:
            torch.manual_seed(5)
            model = tiny_llama()
        model = tsm.transform(model, load_state_dict_from_rank0=load_from_rank0)
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        if dist.get_rank() != 0:
            return None
        return max((full[k] - v).abs().max().item() for k, v in original.items())
    finally:
        smp.shutdown()


# --- context parallel on inputs the script cut itself (SMP v2's layout) -------------------------

CP_SEQ, CP_ROWS, CP_STEPS = 16, 2, 3


def smp_v2_cp_cut(t: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """SMP v2 scripts' own cut (written here from the layout's description): the sequence in
    2 x cp chunks, rank i keeps chunks i and 2cp-1-i."""
    if cp_size == 1:
        return t
    chunks = t.view(t.shape[0], 2 * cp_size, t.shape[1] // (2 * cp_size))
    return chunks[:, [cp_rank, 2 * cp_size - 1 - cp_rank]].reshape(t.shape[0], -1)


def cp_rows(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 256, (CP_ROWS, CP_SEQ), generator=g)


def cp_reference_losses() -> list[float]:
    """One process, whole sequences: the model's own positions and label shift."""
    from smp.testing.models import tiny_llama

    torch.manual_seed(1234)
    model = tiny_llama(attn_implementation="sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(CP_STEPS):
        ids = cp_rows(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def cp_precut_losses(*, config: dict, position_handling: bool = True, via_sagemaker: bool = True) -> dict:
    """SMP v2-style loop: tsm.init, tsm.transform, the script's own cp cut, model(input_ids,
    attention_mask=None, labels); losses averaged over ranks. `position_handling=False` switches
    smp's completion of positions and label shift off (the negative control)."""
    import smp.sagemaker as tsm
    from smp.context_parallel import hf
    from smp.testing.models import tiny_llama

    saved = hf.complete_inputs
    if not position_handling:
        hf.complete_inputs = lambda name, inputs, args, kwargs: kwargs
    with _environment(SM_HP_MP_PARAMETERS=None, SMP_CONFIG=None):
        tsm.init(config)
    try:
        torch.manual_seed(1234)
        model = tiny_llama(attn_implementation="sdpa")
        model = tsm.transform(model) if via_sagemaker else smp.transform(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in range(CP_STEPS):
            ids = smp_v2_cp_cut(cp_rows(step), tsm.state.cp_size, tsm.state.cp_rank)
            loss = model(input_ids=ids, attention_mask=None, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / dist.get_world_size())
        return {"losses": losses}
    except smp.Error as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        hf.complete_inputs = saved
        smp.shutdown()


def save_paths(*, root: str) -> dict:
    """Each TP rank saves into its own tp2-<rank> folder: with the default (world) group the ranks
    disagree on the path and every rank is refused; with model.process_group (the ranks that
    share the folder) each folder is a whole checkpoint."""
    import smp.sagemaker as tsm
    from smp.sagemaker.distributed.checkpoint.state_dict_saver import save
    from smp.testing.models import tiny_llama
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with _environment(SM_HP_MP_PARAMETERS=None, SMP_CONFIG=None):
        tsm.init({"tensor_parallel_degree": 2, "sm_activation_offloading": False})
    try:
        model = tsm.transform(tiny_llama())
        folder = os.path.join(root, f"tp2-{tsm.state.tp_rank}")
        state = {"model": get_state_dict(model, [])[0]}
        out = {}
        try:
            save(state, checkpoint_id=folder)
            out["world"] = "saved"
        except smp.Error as e:
            out["world"] = str(e)
        group = model.process_group
        save(state, checkpoint_id=folder, process_group=group, coordinator_rank=min(dist.get_process_group_ranks(group)))
        out["per_group"] = "saved"
        return out
    finally:
        smp.shutdown()


def core_save_paths(*, root: str) -> str:
    """smp.checkpointing.save with a different path on each rank: refused on every rank."""
    from smp.testing.models import tiny_llama

    with smp.session({}):
        model = smp.transform(tiny_llama())
        try:
            smp.checkpointing.save(os.path.join(root, f"rank{dist.get_rank()}"), model)
        except smp.Error as e:
            return str(e)
        return "saved"


def coordinator_global_rank(*, root: str) -> dict:
    """torch's deprecated save_state_dict with SMP v2's coordinator_rank (the group's lowest global
    rank) for a group that does not start at rank 0: saved during a tsm session; after shutdown
    torch 2.13 reads the number as a rank inside the group (the negative control)."""
    import warnings

    from torch.distributed import checkpoint

    import smp.sagemaker as tsm

    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group

    def save(tag: str) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch: save_state_dict is deprecated
            try:
                checkpoint.save_state_dict(
                    state_dict={"x": torch.full((2,), float(rank))},
                    storage_writer=checkpoint.FileSystemWriter(os.path.join(root, f"{tag}{rank}")),
                    process_group=groups[rank], coordinator_rank=rank)
                return "saved"
            except ValueError as e:
                return str(e)

    tsm.init({"sm_activation_offloading": False})
    try:
        out = {"session": save("session")}
    finally:
        smp.shutdown()
    out["torch"] = save("torch")
    return out
