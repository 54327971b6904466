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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
            "same_proxy": st is smp.state,
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
