"""Checkpointing cases that run on every rank of a RankPool (and a crash script, at the end).

Data is fed by step index (`_batch(step)`), so an interrupted run sees the same batches as an
uninterrupted one; dropout makes the losses depend on each rank's RNG stream.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import smp
from smp.testing.distributed import full_tensor, local_rows, world_mean
from smp.testing.models import TinyTransformer, loss_of, random_batch, tiny_llama

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 256


def _batch(step: int) -> torch.Tensor:
    return random_batch(GLOBAL_BATCH, SEQ, VOCAB, seed=1000 + step)


def _llama(seed: int, dropout: float = 0.0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_llama(attention_dropout=dropout, **overrides)


def _optim(model: torch.nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # lr changes mid-run
    return opt, sched


def _steps(model, opt, sched, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        loss = loss_of(model, local_rows(_batch(step)))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(world_mean(loss))
    return losses


def _params(model) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def _tp_sharded(model) -> bool:
    """Whether tensor parallelism really split some parameter (a "tp" mesh axis of size > 1)."""
    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            if p.device_mesh["tp"].size() > 1:
                return True
    return False


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------------------------------------
# Exact resume at the same world size


def exact_resume(config: dict, root: str, steps: int = 4, save_at: int = 2, async_save: bool = False,
                 reseed_after_load: bool = False) -> dict:
    """Uninterrupted `steps` steps (saving at `save_at` on the way) vs a fresh model loaded from
    that checkpoint and continued. `reseed_after_load` throws the restored RNG away (must fail)."""
    with smp.session(config):
        model = smp.transform(_llama(0, dropout=0.2))
        opt, sched = _optim(model)
        path = os.path.join(root, f"step_{save_at}")
        losses = _steps(model, opt, sched, 0, save_at)
        smp.checkpointing.save(path, model, opt, extra={"step": save_at, "scheduler": sched.state_dict()},
                               async_save=async_save)
        losses += _steps(model, opt, sched, save_at, steps)  # runs while an async save writes
        smp.checkpointing.wait()
        final = _params(model)

        fresh = smp.transform(_llama(99, dropout=0.2))  # other weights: load must replace them
        fresh_opt, fresh_sched = _optim(fresh)
        extra = smp.checkpointing.load(smp.checkpointing.latest(root), fresh, fresh_opt)
        fresh_sched.load_state_dict(extra["scheduler"])
        if reseed_after_load:
            torch.manual_seed(4321)
        resumed = _steps(fresh, fresh_opt, fresh_sched, extra["step"], steps)
        return {
            "losses": losses, "resumed": resumed, "step": extra["step"],
            "param_diff": _max_diff(final, _params(fresh)),
            "lr": (opt.param_groups[0]["lr"], fresh_opt.param_groups[0]["lr"]),
        }


def saving_changes_nothing(config: dict, root: str, steps: int = 3) -> dict:
    """Losses of a run that saves (before its first step, and midway) vs one that never does,
    and of a run resumed from the step-0 checkpoint."""
    with smp.session(config):
        ck = smp.checkpointing

        def run(save: bool) -> list[float]:
            torch.manual_seed(5)
            model = smp.transform(_llama(0, dropout=0.2))
            opt, sched = _optim(model)
            losses = []
            for step in range(steps):
                if save:
                    ck.save(os.path.join(root, f"s{step}"), model, opt,
                            extra={"step": step, "scheduler": sched.state_dict()})
                losses += _steps(model, opt, sched, step, step + 1)
            return losses

        plain, saving = run(False), run(True)
        model = smp.transform(_llama(99, dropout=0.2))
        opt, sched = _optim(model)
        extra = ck.load(os.path.join(root, "s0"), model, opt)
        sched.load_state_dict(extra["scheduler"])
        return {"plain": plain, "saving": saving, "from_step_0": _steps(model, opt, sched, 0, steps)}


# ---------------------------------------------------------------------------------------------
# Resharding: save at one layout, load at another, against the single-process run


def _reference_losses(steps: int) -> list[float]:
    """The single-process run on the whole global batch: the oracle for every layout."""
    model = _llama(0)
    opt, sched = _optim(model)
    losses = []
    for step in range(steps):
        loss = loss_of(model, _batch(step))
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(float(loss))
    return losses


def reshard_save(config: dict, path: str, save_at: int) -> list[float]:
    with smp.session(config):
        model = smp.transform(_llama(0))
        opt, sched = _optim(model)
        losses = _steps(model, opt, sched, 0, save_at)
        smp.checkpointing.save(path, model, opt, extra={"step": save_at, "scheduler": sched.state_dict()})
        return losses


def reshard_resume(config: dict, path: str, steps: int, with_optimizer: bool = True) -> dict:
    with smp.session(config):
        model = smp.transform(_llama(99))
        opt, sched = _optim(model)
        extra = smp.checkpointing.load(path, model, opt if with_optimizer else None)
        sched.load_state_dict(extra["scheduler"])
        resumed = _steps(model, opt, sched, extra["step"], steps)
        return {"resumed": resumed, "step": extra["step"], "reference": _reference_losses(steps),
                "tp": _tp_sharded(model)}


def plain_dcp_load(path: str) -> float:
    """Read an smp checkpoint with torch.distributed.checkpoint alone into an unsharded model;
    return the largest difference from the single-process model trained the same steps."""
    import torch.distributed.checkpoint as dcp

    model = _llama(99)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    reference = _llama(0)
    opt, sched = _optim(reference)
    for step in range(2):
        loss_of(reference, _batch(step)).backward()
        opt.step(), sched.step(), opt.zero_grad()
    return _max_diff(dict(model.named_parameters()), dict(reference.named_parameters()))


# ---------------------------------------------------------------------------------------------
# Atomicity: a failing save, keep-last-N


class _InjectedFailure(RuntimeError):
    pass


def failed_save_keeps_previous(config: dict, root: str) -> dict:
    """Save step_1, then a save whose storage write fails on rank 1 part-way; the previous
    checkpoint must stay latest() and load."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    with smp.session(config):
        model = smp.transform(TinyTransformer())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        smp.checkpointing.save(os.path.join(root, "step_1"), model, opt, extra={"step": 1})
        at_1 = _params(model)
        loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, 128, seed=3))).backward()
        opt.step()

        original = FileSystemWriter.write_data

        def failing(self, plan, planner):
            if dist.get_rank() == 1:
                original(self, plan, planner)  # this rank's file is half the checkpoint
                raise _InjectedFailure("disk full (injected)")
            return original(self, plan, planner)

        FileSystemWriter.write_data = failing
        error = ""
        try:
            smp.checkpointing.save(os.path.join(root, "step_2"), model, opt, extra={"step": 2})
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            error = f"{type(e).__name__}: {e}"
        finally:
            FileSystemWriter.write_data = original
        dist.barrier()
        latest = smp.checkpointing.latest(root)
        fresh = smp.transform(TinyTransformer(dim=32))
        extra = smp.checkpointing.load(latest, fresh)
        return {
            "error": error, "latest": os.path.basename(latest), "step": extra["step"],
            "param_diff": _max_diff(at_1, _params(fresh)), "listing": sorted(os.listdir(root)),
        }


def keep_last(config: dict, root: str) -> dict:
    with smp.session(config):
        model = smp.transform(TinyTransformer())
        for step in range(1, 5):
            smp.checkpointing.save(os.path.join(root, f"step_{step}"), model, extra={"step": step}, keep_last=2)
        # Overwriting a name in place keeps it complete and makes it the newest.
        smp.checkpointing.save(os.path.join(root, "step_3"), model, extra={"step": 33}, keep_last=2)
        latest = smp.checkpointing.latest(root)
        return {"listing": sorted(os.listdir(root)), "latest": os.path.basename(latest),
                "step": smp.checkpointing.load(latest, model)["step"]}


def async_snapshot(config: dict, root: str) -> float:
    """An async save holds the state as of the call, though training mutates it right after."""
    with smp.session(config):
        model = smp.transform(TinyTransformer())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        before = _params(model)
        smp.checkpointing.save(os.path.join(root, "a"), model, opt, async_save=True)
        for _ in range(2):
            loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, 128, seed=4))).backward()
            opt.step(), opt.zero_grad()
        assert _max_diff(before, _params(model)) > 1e-3  # training really moved the weights
        smp.checkpointing.wait()
        smp.checkpointing.load(os.path.join(root, "a"), model, opt)
        return _max_diff(before, _params(model))


def async_committed_by_shutdown(config: dict, root: str) -> str | None:
    """An async save never waited for is committed by smp.shutdown (the session's end), not lost."""
    with smp.session(config):
        model = smp.transform(TinyTransformer())
        smp.checkpointing.save(os.path.join(root, "b"), model, async_save=True)
    found = smp.checkpointing.latest(root)
    return found and os.path.basename(found)


# ---------------------------------------------------------------------------------------------
# Hugging Face export / import


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids).logits
    return full_tensor(out).float()


def export_then_from_pretrained(config: dict, out: str, max_shard_bytes: int, tie: bool = False,
                                dtype: str | None = None) -> dict:
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    with smp.session(config):
        model = smp.transform(_llama(0, tie_word_embeddings=tie))
        opt, sched = _optim(model)
        _steps(model, opt, sched, 0, 1)  # trained weights, not the init
        model.eval()
        ids = _batch(7)
        logits = _logits(model, ids)
        cast = getattr(torch, dtype) if dtype else None
        smp.checkpointing.export_hf(out, model, max_shard_bytes=max_shard_bytes, dtype=cast)
        hf = LlamaForCausalLM.from_pretrained(out)  # plain transformers, no smp involved
        hf.eval()
        back = smp.transform(_llama(99, tie_word_embeddings=tie))  # round trip into a fresh model
        smp.checkpointing.load_hf(out, back)
        expected = {k: v.to(cast).float() if cast else v for k, v in _params(model).items()}
        files = sorted(os.listdir(out))
        with safe_open(os.path.join(out, [f for f in files if f.endswith(".safetensors")][0]), "pt") as f:
            file_dtype = str(f.get_slice(next(iter(f.keys()))).get_dtype())
        return {"logit_diff": float((hf(input_ids=ids).logits.detach().float() - logits).abs().max()),
                "round_trip_diff": _max_diff(expected, _params(back)), "file_dtype": file_dtype,
                "files": files, "tp": _tp_sharded(model)}


class _count_reads:
    """Count the tensor elements HuggingFaceStorageReader hands this rank (streaming proof)."""

    def __init__(self):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        self.cls, self.original, self.elements = HuggingFaceStorageReader, HuggingFaceStorageReader._process_read_request, 0
        counter = self

        def counted(reader, f, req, planner):
            counter.elements += int(torch.tensor(req.lengths).prod())
            return counter.original(reader, f, req, planner)

        HuggingFaceStorageReader._process_read_request = counted

    def undo(self):
        self.cls._process_read_request = self.original


def import_hf(config: dict, hf_dir: str, tie: bool, dtype: str) -> dict:
    """A folder written by transformers' save_pretrained streamed into a sharded model."""
    with smp.session(config):
        reference = _llama(7, tie_word_embeddings=tie)
        if dist.get_rank() == 0:
            reference.to(getattr(torch, dtype)).save_pretrained(hf_dir, max_shard_size="40KB")
        reference = reference.to(getattr(torch, dtype)).float()
        dist.barrier()
        model = smp.transform(_llama(99, tie_word_embeddings=tie))
        read = _count_reads()
        try:
            smp.checkpointing.load_hf(hf_dir, model)
        finally:
            read.undo()
        ids = _batch(5)
        model.eval(), reference.eval()
        ref_params = dict(reference.named_parameters())
        return {
            "param_diff": max(float((full_tensor(p.detach()) - ref_params[n]).abs().max()) for n, p in model.named_parameters()),
            "logit_diff": float((_logits(model, ids) - _logits(reference, ids)).abs().max()),
            "files": len([f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]),
            "tp": _tp_sharded(model),
            # elements this rank read from the files / elements in the files
            "read_fraction": read.elements / sum(p.numel() for p in reference.parameters()),
        }


# ---------------------------------------------------------------------------------------------
# export_hf of integer tensors (BatchNorm's num_batches_tracked, Swin's relative_position_index)

def _integer_models():
    """(name, tiny transformers model): ResNet (BatchNorm: int64 num_batches_tracked, 0-d) and
    MaskFormer-Swin (a persistent int64 relative_position_index buffer, 2-d)."""
    from transformers import MaskFormerSwinConfig, MaskFormerSwinModel, ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    resnet = ResNetForImageClassification(ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))
    swin = MaskFormerSwinModel(MaskFormerSwinConfig(
        image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2,
        drop_path_rate=0.0))
    return [("resnet", resnet), ("swin", swin)]


def _whole_state(model) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v.detach()).clone() for k, v in model.state_dict().items()}


def _bitwise_differences(expected: dict, got: dict) -> list[str]:
    """Names whose dtype, shape or any bit differ (or that `got` lacks)."""
    return sorted(k for k, v in expected.items()
                  if k not in got or got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v))


def _train(model, name: str, steps: int) -> None:
    """`steps` SGD steps on the same images on every rank (so every buffer stays the same on
    every rank)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(step))
        result = model(pixel_values=pixels)
        loss = (torch.nn.functional.cross_entropy(result.logits, torch.tensor([0, 2])) if name == "resnet"
                else result.last_hidden_state.square().mean())
        loss.backward()
        opt.step()
        opt.zero_grad()


def export_integer_tensors(config: dict, root: str, broken: str | None = None, only: str | None = None) -> dict:
    """Each tiny model trained 3 steps in one process (BatchNorm in training mode counts them
    in num_batches_tracked; smp refuses that mode under data parallelism), transformed, trained
    one more step under smp (BatchNorm frozen), export_hf'd, then loaded with transformers'
    from_pretrained and with load_hf into a fresh transformed model: per model, the names that
    are not bitwise the trained ones, from_pretrained's loading info, the files and the integer
    values (or load_hf's refusal). `broken` (negative controls): "omit" leaves the integer
    tensors out of the folder, "wrong" writes each one plus 1; `only`: that model only."""
    from smp.checkpointing.hf import nonfloat as hf_nonfloat

    write = hf_nonfloat.write
    if broken == "omit":
        hf_nonfloat.write = lambda directory, values: None
    elif broken == "wrong":
        hf_nonfloat.write = lambda directory, values: write(directory, {k: v + 1 for k, v in values.items()})
    out = {}
    try:
        with smp.session(config):
            for name, model in _integer_models():
                if only not in (None, name):
                    continue
                cls = type(model)
                model.train()
                _train(model, name, 3)
                model = smp.transform(model)
                model.eval() if name == "resnet" else model.train()
                _train(model, name, 1)
                expected = _whole_state(model)
                folder = os.path.join(root, name)
                smp.checkpointing.export_hf(folder, model)
                back, info = cls.from_pretrained(folder, output_loading_info=True)  # plain transformers
                fresh = smp.transform(cls(model.config))
                loaded = _error(smp.checkpointing.load_hf, folder, fresh)
                out[name] = {
                    "from_pretrained": _bitwise_differences(expected, back.state_dict()),
                    "load_hf": loaded or _bitwise_differences(expected, _whole_state(fresh)),
                    "info": {k: sorted(map(str, v)) for k, v in info.items()},
                    "files": sorted(os.listdir(folder)),
                    "integers": {k: v.tolist() for k, v in expected.items() if not v.is_floating_point()},
                }
    finally:
        hf_nonfloat.write = write
    return out


def export_integer_refusals(config: dict, root: str) -> dict:
    """export_hf of an integer buffer that differs between the ranks, and of one sharded over
    them (a DTensor placed Shard(0)): the message on each rank, and what the root holds after."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    out = {}
    with smp.session(config):
        model = smp.transform(_integer_models()[0][1])
        if dist.get_rank() == 1:
            model.resnet.embedder.embedder.normalization.num_batches_tracked += 1
        out["differs"] = _error(smp.checkpointing.export_hf, os.path.join(root, "differs"), model)
        model = smp.transform(_integer_models()[0][1])
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model.classifier.register_buffer("bucket", distribute_tensor(torch.arange(8), mesh, [Shard(0)]))
        out["sharded"] = _error(smp.checkpointing.export_hf, os.path.join(root, "sharded"), model)
        dist.barrier()
        out["listing"] = sorted(os.listdir(root))
    return out


def export_integer_pipelined(config: dict, out: str) -> dict:
    """A pipelined tiny Llama with a persistent int64 buffer in a layer of each stage (layers 0
    and 3 of 4 at pp 2), export_hf'd: the tensors of the folder's files, by name, read with
    safetensors (from_pretrained would call the buffers unexpected keys), and the buffers this
    rank's stage holds."""
    from safetensors.torch import load_file

    with smp.session(config):
        model = _llama(0, num_hidden_layers=4)
        for i in (0, 3):
            model.model.layers[i].register_buffer("step_index", torch.arange(3) * 10 + i)
        model = smp.transform(model)
        smp.checkpointing.export_hf(out, model)
        held = {}
        for name in sorted(os.listdir(out)):
            if name.endswith(".safetensors"):
                held.update({k: v.tolist() for k, v in load_file(os.path.join(out, name)).items() if not v.is_floating_point()})
        local = sorted(n for n, b in model.named_buffers() if n.endswith("step_index"))
        return {"held": held, "local": local}


# ---------------------------------------------------------------------------------------------
# Error paths: each returns the message smp raised (or "" when nothing was raised)


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except smp.CheckpointError as e:
        return str(e)
    return ""


def error_messages(config: dict, root: str) -> dict[str, str]:
    with smp.session(config):
        ck = smp.checkpointing
        model = smp.transform(TinyTransformer())
        ck.save(os.path.join(root, "tiny"), model)  # model only, no optimizer
        rank0 = dist.get_rank() == 0
        if rank0:
            os.makedirs(os.path.join(root, "random_dir"), exist_ok=True)
            open(os.path.join(root, "random_dir", "notes.txt"), "w").close()
            os.makedirs(os.path.join(root, "half"), exist_ok=True)
            open(os.path.join(root, "half", ".metadata"), "w").close()  # DCP data, never committed
            open(os.path.join(root, "half", "smp_meta.json"), "w").close()  # by smp (a plain DCP folder has none)
        dist.barrier()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tiny = os.path.join(root, "tiny")
        out = {
            "missing_dir": _error(ck.load, os.path.join(root, "nope"), model),
            "none_path": _error(ck.load, None, model),
            "not_checkpoint": _error(ck.load, os.path.join(root, "random_dir"), model),
            "uncommitted": _error(ck.load, os.path.join(root, "half"), model),
            "no_optimizer": _error(ck.load, tiny, model, opt),
            "more_layers": _error(ck.load, tiny, smp.transform(TinyTransformer(layers=3))),
            "fewer_layers": _error(ck.load, tiny, smp.transform(TinyTransformer(layers=1))),
            "other_vocab": _error(ck.load, tiny, smp.transform(TinyTransformer(vocab=100))),
            "other_model": _error(ck.load, tiny, smp.transform(_llama(0))),
            "hf_not_hf": _error(ck.load_hf, os.path.join(root, "random_dir"), model),
            "keep_last_0": _error(ck.save, os.path.join(root, "x"), model, None, None, keep_last=0),
            "unpicklable_extra": _error(ck.save, os.path.join(root, "y"), model, None, {"f": lambda: 0}),
        }
        ck.export_hf(os.path.join(root, "hf"), smp.transform(_llama(0)))
        out["hf_wrong_model"] = _error(ck.load_hf, os.path.join(root, "hf"), model)
        out["load_of_export"] = _error(ck.load, os.path.join(root, "hf"), model)
        # A save never deletes what is not its own kind of checkpoint: user files, a root
        # holding checkpoints, an export in place of a checkpoint.
        out["onto_user_dir"] = _error(ck.save, os.path.join(root, "random_dir"), model)
        out["onto_root"] = _error(ck.save, root, model)
        out["onto_export"] = _error(ck.save, os.path.join(root, "hf"), model)
        out["ok"] = _error(ck.load, tiny, model)  # the right model loads: no error
        out["listing"] = sorted(os.listdir(root))  # failed saves left nothing behind
        out["latest"] = os.path.basename(ck.latest(root))  # the export "hf" is newer: not a checkpoint
        return out


def load_latest_into_fresh(config: dict, root: str) -> dict:
    """After a killed save (see `crash` below): what latest() returns, and whether it loads."""
    with smp.session(config):
        latest = smp.checkpointing.latest(root)
        model = smp.transform(TinyTransformer())
        torch.manual_seed(0)
        expected = TinyTransformer()  # the crash script saved this init at step_1
        extra = smp.checkpointing.load(latest, model)
        diff = _max_diff(_params(model), dict(expected.named_parameters()))
        # The next save with keep_last clears what the killed save left behind.
        smp.checkpointing.save(os.path.join(root, "step_3"), model, keep_last=5)
        return {"latest": os.path.basename(latest), "step": extra["step"], "param_diff": diff,
                "listing": sorted(os.listdir(root))}


def crash(root: str, point: str) -> None:
    """(A child process) save step_1, then SIGKILL itself part-way through saving step_2."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from smp.checkpointing import storage

    smp.init({})
    torch.manual_seed(0)
    model = smp.transform(TinyTransformer())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    smp.checkpointing.save(os.path.join(root, "step_1"), model, opt, extra={"step": 1})
    loss_of(model, random_batch(GLOBAL_BATCH, SEQ, 128, seed=3)).backward()
    opt.step()

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "write":  # shards half written: the DCP write of step_2 starts, then death
        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            fut = original(self, plan, planner)
            fut.wait() if hasattr(fut, "wait") else None
            die()

        FileSystemWriter.write_data = write_then_die
    elif point == "commit":  # every byte and the commit marker written, rename not yet done
        storage.LocalStorage.fsync_dir = die  # first called on the partial folder, after the marker
    smp.checkpointing.save(os.path.join(root, "step_2"), model, opt, extra={"step": 2})
    print("not killed", flush=True)


# ---------------------------------------------------------------------------------------------
# Packed tensor-parallel weights (GPT-2's fused q|k|v c_attn, Mixtral's gate|up) across layouts


def _packed_model(family: str, seed: int) -> torch.nn.Module:
    """Tiny GPT-2 / Mixtral from transformers configs, no dropout: losses at two layouts differ
    only by the order of float sums."""
    import transformers as T

    from tests.checkpointing.hf_conversion_cases import build

    torch.manual_seed(seed)
    if family == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return build(family)


def _with_state(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW exp_avg / exp_avg_sq, whole."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full_tensor(p.detach()).clone()
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.ndim:
                out[f"{name}:{key}"] = full_tensor(value).clone()
    return out


def _data_files_differ(a: str, b: str) -> list[str]:
    """The DCP data files (`*.distcp`) not byte-identical between two checkpoint folders, and
    `.metadata` when the tensors it describes (names, shapes, chunks, offsets) differ."""
    from torch.distributed.checkpoint import FileSystemReader

    names = sorted({n for d in (a, b) for n in os.listdir(d) if n.endswith(".distcp")})
    differ = [n for n in names if not (os.path.exists(os.path.join(a, n)) and os.path.exists(os.path.join(b, n)))
              or open(os.path.join(a, n), "rb").read() != open(os.path.join(b, n), "rb").read()]
    meta = [FileSystemReader(d).read_metadata() for d in (a, b)]
    if meta[0].state_dict_metadata != meta[1].state_dict_metadata or meta[0].planner_data != meta[1].planner_data:
        differ.append(".metadata")
    return differ


def packed_tp_resume(family: str, save_config: dict, load_config: dict, path: str, steps: int = 4,
                     save_at: int = 2, async_save: bool = False) -> dict:
    """Train `steps` steps at `save_config`, saving at `save_at`; load that checkpoint at
    `load_config` into a model with other weights and continue. Returns the uninterrupted and
    resumed losses, the names (parameters, `<name>:exp_avg`...) not bitwise equal after the load,
    the packed parameters at each layout, and the negative controls: the load with packed
    detection off (`box_read`: DCP's one box per rank), and at a packed save layout the save
    and export_hf with detection off (DCP's own error). At a packed save layout also the
    parameters from_pretrained reads from export_hf's folder, and those plain `dcp.load` reads
    from the checkpoint into an unsharded model, that are not bitwise the model's."""
    from smp.checkpointing.format import packed

    def box_read():
        original = packed.read_whole
        packed.read_whole = lambda t: False
        return lambda: setattr(packed, "read_whole", original)

    out: dict = {}
    with smp.session(save_config):
        model = smp.transform(_packed_model(family, 0))
        opt, sched = _optim(model)
        out["losses"] = _steps(model, opt, sched, 0, steps)[save_at:]
        model = smp.transform(_packed_model(family, 0))
        opt, sched = _optim(model)
        _steps(model, opt, sched, 0, save_at)
        out["packed_saved"] = sorted(n for n, p in model.named_parameters() if packed.read_whole(p))
        if out["packed_saved"]:
            undo = box_read()
            try:
                smp.checkpointing.save(path + "_box", model, opt)
                out["box_save_error"] = ""
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                out["box_save_error"] = f"{type(e).__name__}: {e}"[:300]
            finally:
                undo()
        smp.checkpointing.save(path, model, opt, extra={"step": save_at, "scheduler": sched.state_dict()},
                               async_save=async_save)
        smp.checkpointing.wait()
        if async_save:  # the same state saved sync: the same data files, byte for byte
            smp.checkpointing.save(path + "_sync", model, opt, extra={"step": save_at, "scheduler": sched.state_dict()})
            out["async_files_differ"] = _data_files_differ(path, path + "_sync")
        saved = _with_state(model, opt)
        if out["packed_saved"]:
            import torch.distributed.checkpoint as dcp

            plain = _packed_model(family, 99).state_dict()  # torch alone, into an unsharded model
            dcp.load({"model": plain}, checkpoint_id=path)
            out["plain_dcp_differ"] = sorted(n for n in saved if ":" not in n and not torch.equal(plain[n], saved[n]))
            undo = box_read()
            try:
                smp.checkpointing.export_hf(path + "_box_hf", model)
                out["box_export_error"] = ""
            except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                out["box_export_error"] = f"{type(e).__name__}: {e}"[:4000]
            finally:
                undo()
            smp.checkpointing.export_hf(path + "_hf", model)
            hf = type(_packed_model(family, 0)).from_pretrained(path + "_hf").state_dict()
            names = [n for n, _ in model.named_parameters()]
            out["export_differ"] = sorted(n for n in names if n not in hf or not torch.equal(hf[n], saved[n]))
    with smp.session(load_config):
        fresh = smp.transform(_packed_model(family, 99))
        fresh_opt, fresh_sched = _optim(fresh)
        out["packed_loaded"] = sorted(n for n, p in fresh.named_parameters() if packed.read_whole(p))
        undo = box_read()
        try:
            smp.checkpointing.load(path, fresh, fresh_opt)
        finally:
            undo()
        loaded = _with_state(fresh, fresh_opt)
        out["box_differ"] = sorted(k for k in saved if not torch.equal(saved[k], loaded[k]))
        extra = smp.checkpointing.load(path, fresh, fresh_opt)
        loaded = _with_state(fresh, fresh_opt)
        out["differ"] = sorted(k for k in saved if not torch.equal(saved[k], loaded[k]))
        out["compared"] = len(saved)
        fresh_sched.load_state_dict(extra["scheduler"])
        out["resumed"] = _steps(fresh, fresh_opt, fresh_sched, save_at, steps)
    return out


if __name__ == "__main__":
    crash(sys.argv[1], sys.argv[2])
