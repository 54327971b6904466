"""smp as the parallelism backend of transformers' `Trainer` and of Trainer subclasses (TRL).

    from smp.integrations import SMPTrainer
    trainer = SMPTrainer(model=model, args=training_args, train_dataset=ds, smp_config="smp.yaml")

    SFTTrainer = smp_trainer_class(trl.SFTTrainer)      # any Trainer subclass, same argument

The seam (docs/trainer.md says why): the Trainer delegates parallelism to its accelerate
`Accelerator`; here smp takes over exactly those delegations and nothing else:
  model      smp.transform before accelerate sees it, marked as prepared (no DDP wrap); the
             Trainer's bf16 / gradient_checkpointing become smp's policy / checkpointing (mapping.py)
  data       accelerate's prepare_data_loader, sharded by smp's dp rank / dp size (data.py);
             eval outputs gathered over the dp ranks only
  no_sync    smp.no_sync for the micro-steps of gradient accumulation
  clipping   smp.clip_grad_norm_ (global norm over shards and TP ranks)
  checkpoints smp.checkpointing.save / load (model, optimizer, scheduler, RNG, trainer state)
  save_model smp.checkpointing.export_hf (a from_pretrained folder) or the PEFT adapter
The training loop, loss scaling, logging, callbacks and schedules stay the Trainer's.
Pipeline parallelism is refused at construction (checks.check_no_pipeline): the Trainer calls
the whole model per rank, a pipelined model trains only through smp.step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import smp
from smp._compat import check_trainer_overrides, mark_prepared, trainer_batch_size
from smp.checkpointing.format import rng
from smp.config import ConfigSource, SMPConfig, load_config
from smp.integrations.checks import check_no_pipeline, check_training_arguments
from smp.integrations.data import gather_for_metrics_by_dp, prepare_data_loader_by_dp
from smp.integrations.mapping import map_training_arguments
from smp.integrations.peft import is_peft_model, save_adapter
from smp.integrations.saving import export_hf_folder
from smp.reliability.exit import end_run_at_exit
from smp.seeding import trainer_seed_wins
from smp.transform import apply_parallelism, is_transformed

log = logging.getLogger(__name__)


def _resolve_config(source: ConfigSource) -> SMPConfig:
    """The config this trainer runs with: the given one, else the one smp.init already ran with,
    else $SMP_CONFIG or the defaults (as smp.init(None) reads them)."""
    if source is None and smp.is_initialized():
        return smp.state.config
    return load_config(source)


def _is_rank0() -> bool:
    """Rank 0 of the launch, before smp.init (torchrun's RANK; a world of one without it)."""
    return int(os.environ.get("RANK", "0")) == 0


def _report_mapped(mapped: list[str]) -> None:
    if mapped and _is_rank0():
        print(f"smp: TrainingArguments mapped onto the smp config: {'; '.join(mapped)}", flush=True)


def _unwrap_optimizer(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's AcceleratedOptimizer: DCP reads and fills its state."""
    return getattr(optimizer, "optimizer", optimizer)


class SMPTrainerMixin:
    """Put before a transformers Trainer class in the bases (`smp_trainer_class` does it); adds the
    keyword argument `smp_config` (a path, a dict, an SMPConfig, or None for $SMP_CONFIG /
    the config smp.init already ran with)."""

    def __init__(self, *args: Any, smp_config: ConfigSource = None, **kwargs: Any):
        check_trainer_overrides()  # the Trainer methods overridden below still exist
        self._smp_config = _resolve_config(smp_config)
        check_no_pipeline(self._smp_config)  # before anything else: the reason and the alternative
        # Mapped or refused before any collective: the Trainer's own setup may run some (dataset
        # preparation under main_process_first, accelerate's state).
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        # The Trainer (and TRL, which enables gradient checkpointing on PEFT models itself) gets
        # the arguments with bf16 / gradient checkpointing off where smp takes them over.
        training_args, self._smp_model_config, mapped = map_training_arguments(training_args, self._smp_config)
        if "args" in kwargs:
            kwargs["args"] = training_args
        elif len(args) > 1:
            args = (args[0], training_args, *args[2:])
        _report_mapped(mapped)
        model = kwargs.get("model", args[0] if args else None)
        check_training_arguments(
            training_args, self._smp_config,
            is_peft=is_peft_model(model) or kwargs.get("peft_config") is not None,
            has_model_init=kwargs.get("model_init") is not None,
        )
        self._smp_resume_extra: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------------------------------
    # Setup: Trainer.__init__ calls this once the model is final (after a TRL trainer wrapped it
    # in PEFT) and before anything places, wraps or inspects it for training.

    def create_accelerator_and_postprocess(self) -> None:
        # Arguments a Trainer subclass built itself (TRL's own defaults when none were given);
        # arguments mapped in __init__ come back unchanged.
        self.args, self._smp_model_config, mapped = map_training_arguments(self.args, self._smp_model_config)
        _report_mapped(mapped)
        check_training_arguments(self.args, self._smp_config, is_peft=is_peft_model(self.model), has_model_init=False)
        opened_here = not smp.is_initialized()
        smp.init(self._smp_config)  # a no-op when smp.init already ran with this config
        # accelerate made the process group (TrainingArguments did), so smp.shutdown would leave
        # it and its gloo threads to interpreter finalization, which can abort a finished run.
        end_run_at_exit(smp.state.mesh, smp.state.dp_mesh)
        if self.model is not None:
            self.model = self._smp_transform(self.model)
        if opened_here:  # smp.init reseeded the process after the Trainer seeded it
            trainer_seed_wins(smp.state.config, self.args.seed, self.args.full_determinism, smp.state.rank)
        super().create_accelerator_and_postprocess()
        accelerator = self.accelerator
        # Instance attributes: Accelerator.prepare() and the Trainer's accumulation loop call
        # these two by name; everything else of the accelerator stays as it is.
        accelerator.prepare_data_loader = functools.partial(
            prepare_data_loader_by_dp, accelerator, dp_rank=smp.state.dp_rank, dp_size=smp.state.dp_size
        )
        accelerator.no_sync = smp.no_sync
        if smp.state.dp_size < smp.state.world_size:  # ranks beside the dp ones (TP) hold the same rows
            accelerator.gather_for_metrics = functools.partial(
                gather_for_metrics_by_dp, accelerator, group=smp.state.dp_mesh.get_group()
            )
            # The Trainer took the bound method already (and resets to the attribute after each eval).
            self.gather_function = functools.partial(
                accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
            )

    def _smp_transform(self, model: nn.Module) -> nn.Module:
        if not is_transformed(model):  # a model the user already transformed is not wrapped again
            # smp.transform's recipe with the mapped config (bf16 / gradient checkpointing from the
            # TrainingArguments); smp.init ran with the config as given. In place: the Trainer's
            # own reference is this module too.
            st = smp.state
            model = apply_parallelism(model, self._smp_model_config, st.dims, st.mesh, st.device)
        # accelerate's guard against wrapping twice: prepare() hands the model back as it is
        # (no DDP around the DTensor parameters, no autocast; smp's policy casts).
        mark_prepared(model)
        return model

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # smp.transform placed every shard; .to() on FSDP2 (or CPU-offloaded) parameters fails.
        pass

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            # No backward follows the eval forwards, so the units smp keeps gathered after
            # forward (the root) would stay unsharded, their full parameters registered in place
            # of the DTensor shards that checkpoints and the optimizer hold. Local, no collective.
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        # The Trainer sums the count over every process; the ranks of a TP group read the same rows.
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // smp.state.tp_size

    def get_tp_size(self) -> int:
        # The Trainer divides by it: global batch = world / tp ranks, and the loss scale of
        # average_tokens_across_devices (TP ranks of a group share one batch).
        return smp.state.tp_size

    def train(self, *args: Any, **kwargs: Any):
        st = smp.state
        if st.rank == 0:
            per_device, accumulation = trainer_batch_size(self), self.args.gradient_accumulation_steps
            print(
                f"smp: {st.dims.describe()}; global batch = {per_device} per device x {accumulation} accumulation "
                f"x {st.dp_size} data-parallel = {per_device * accumulation * st.dp_size} sequences per step",
                flush=True,
            )
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------------------------------
    # Gradients

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return smp.clip_grad_norm_(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        if grad_norm is None:  # max_grad_norm <= 0: the norm for the log, scaling by exactly 1
            grad_norm = smp.clip_grad_norm_(model, float("inf"))
        return grad_norm

    # ------------------------------------------------------------------------------------------
    # Checkpoints: one smp checkpoint per save step; resume at any world size

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        path = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._record_callback_states()
        extra = {
            "trainer_state": dataclasses.asdict(self.state),
            "scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            # Where the data stands: the Trainer re-derives the loader position from the step and
            # epoch (seeded sampler + skip_first_batches), so a resumed run reads the same rows.
            "data_position": {"global_step": self.state.global_step, "epoch": self.state.epoch,
                              "samples_seen": self.state.global_step * self.get_total_train_batch_size(self.args)},
            # Per rank (smp saves `extra` rank by rank), as plain values: smp reads `extra` with
            # torch.load(weights_only=True).
            "rng": rng.capture(),
            "world_size": smp.state.world_size,
        }
        limit = self.args.save_total_limit
        optimizer = None if self.args.save_only_model else _unwrap_optimizer(self.optimizer)
        smp.checkpointing.save(path, self.model, optimizer, extra=extra,
                               keep_last=limit if limit and limit > 0 else None)
        if self.args.should_save:
            # The Trainer reads these when resuming (train(resume_from_checkpoint=...)); the
            # authoritative copy of the state is the one inside the committed checkpoint.
            self.state.save_to_json(os.path.join(path, TRAINER_STATE_NAME))
            torch.save(self.args, os.path.join(path, TRAINING_ARGS_NAME))
        if _shadowed_save_steps(type(self))[0]:
            self._write_trl_model_card()

    def _write_trl_model_card(self) -> None:
        """TRL's trainers write a draft model card (`output_dir/README.md`) in their own
        `_save_checkpoint`, which this class's sits in front of: take that step here, as TRL does."""
        name = self.args.hub_model_id.split("/")[-1] if self.args.hub_model_id else os.path.basename(
            os.path.normpath(self.args.output_dir))
        self.create_model_card(model_name=name)

    def _record_callback_states(self) -> None:
        """As Trainer._save_checkpoint does: stateful callbacks' states into self.state."""
        from transformers.trainer_callback import ExportableState

        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # train() calls this before the optimizer exists; smp loads model and optimizer together
        # in _load_optimizer_and_scheduler. Here only what must hold before anything is built:
        # the Trainer reads trainer_state.json next. Rank 0 writes that file right after the
        # commit, so a rank 0 that died in between leaves a committed checkpoint without it; the
        # state itself is inside the commit (`extra`, digested), and the file is rewritten from it.
        state_file = os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)
        problem = None
        if smp.state.rank == 0 and not os.path.isfile(state_file):
            try:
                _restore_trainer_state(resume_from_checkpoint, state_file)
            except smp.CheckpointError as e:
                problem = str(e)
        box = [problem]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)  # also the barrier: the file is there for all
        if box[0]:
            raise smp.CheckpointError(box[0])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer = None if self.args.save_only_model else _unwrap_optimizer(self.optimizer)
        extra = smp.checkpointing.load(checkpoint, self.model, optimizer)
        saved_step = extra["trainer_state"]["global_step"]
        if saved_step != self.state.global_step:
            raise smp.CheckpointError(
                f"{checkpoint!r}: the sharded checkpoint holds step {saved_step} but its {TRAINER_STATE_NAME} says "
                f"{self.state.global_step}; the folder was modified after saving"
            )
        if extra["scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(extra["scheduler"])
        self._smp_resume_extra = extra

    def _load_scaler(self, checkpoint: str | None) -> None:
        pass  # no GradScaler: mixed precision is smp's FSDP policy

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # The Trainer calls this at the point of the resumed epoch where the generators must be
        # back (after fast-forwarding the loader). A rank's own generators exist only when the
        # world size is the one saved with.
        extra = self._smp_resume_extra
        if checkpoint is None or extra is None or extra["world_size"] != smp.state.world_size:
            return
        rng.restore(extra["rng"])

    # ------------------------------------------------------------------------------------------
    # The final model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A folder `from_pretrained` loads: the whole model (safetensors, via smp.checkpointing.export_hf),
        or for a PEFT model its adapter (as PeftModel.save_pretrained writes it). Collective."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if is_peft_model(self.model):
            save_adapter(self.model, output_dir)
        else:
            export_hf_folder(output_dir, self.model)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _restore_trainer_state(checkpoint: str, state_file: str) -> None:
    """(rank 0) Write `trainer_state.json` of a committed smp checkpoint from the Trainer state
    its commit holds (rank 0's `extra`, checked against its recorded digest first)."""
    from smp.checkpointing.commit import atomic
    from smp.checkpointing.format import metadata
    from smp.checkpointing.trust import digest, safe_read

    extra_file = "smp_extra/rank_0.pt"
    why = None if atomic.is_committed(checkpoint) else "it is not a committed smp checkpoint"
    if why is None:
        meta = metadata.read(checkpoint)
        files = meta.get("files") or {}
        found = digest.problems(checkpoint, files, [extra_file], read=True) if extra_file in files else [
            f"{extra_file} is not among its recorded files"]
        why = "; ".join(found) or None
    if why is None:
        try:
            saved = safe_read.read_extra(os.path.join(checkpoint, extra_file), allow_pickle=False)
            fields = saved["extra"]["trainer_state"]
            state = TrainerState(**{k: v for k, v in fields.items() if k in TrainerState.__dataclass_fields__})
        except Exception as e:  # noqa: BLE001 - any unreadable or foreign extra
            why = f"its Trainer state cannot be read ({type(e).__name__}: {e})"
    if why is not None:
        raise smp.CheckpointError(
            f"{checkpoint!r} has no {TRAINER_STATE_NAME} and {why}; resume from another checkpoint "
            f"(train(resume_from_checkpoint='<output_dir>/checkpoint-N'))"
        )
    log.warning("smp: %r has no %s (rank 0 stopped between the commit and writing it); restored it from "
                "the Trainer state inside the committed checkpoint", checkpoint, TRAINER_STATE_NAME)
    tmp = state_file + ".tmp"
    state.save_to_json(tmp)
    os.replace(tmp, state_file)


class SMPTrainer(SMPTrainerMixin, Trainer):
    """transformers.Trainer with smp doing the parallelism: `SMPTrainer(..., smp_config=path_or_dict)`."""


@functools.cache
def smp_trainer_class(trainer_cls: type) -> type:
    """`trainer_cls` (transformers.Trainer or a subclass, e.g. trl.SFTTrainer) with smp doing the
    parallelism: the returned class takes the extra keyword `smp_config`."""
    if issubclass(trainer_cls, SMPTrainerMixin):
        return trainer_cls
    if not issubclass(trainer_cls, Trainer):
        raise TypeError(f"smp_trainer_class expects a transformers.Trainer subclass, got {trainer_cls!r}")
    trl_classes, other_classes = _shadowed_save_steps(trainer_cls)
    if other_classes:
        log.warning(
            "smp_trainer_class(%s): smp writes the checkpoints, so the _save_checkpoint of %s does not run; "
            "move what it adds into a TrainerCallback.on_save", trainer_cls.__name__,
            ", ".join(c.__qualname__ for c in other_classes))
    return type(f"SMP{trainer_cls.__name__}", (SMPTrainerMixin, trainer_cls), {"__module__": trainer_cls.__module__})


@functools.cache
def _shadowed_save_steps(trainer_cls: type) -> tuple[list[type], list[type]]:
    """The classes between smp's mixin and transformers.Trainer that override `_save_checkpoint`
    (smp's replaces theirs), split into TRL's (whose one extra step, the model card, smp takes)
    and the rest."""
    shadowed = [c for c in trainer_cls.__mro__
                if c is not Trainer and issubclass(c, Trainer) and not issubclass(c, SMPTrainerMixin)
                and "_save_checkpoint" in vars(c)]
    trl = [c for c in shadowed if c.__module__.split(".")[0] == "trl"]
    return trl, [c for c in shadowed if c not in trl]

