"""smp.checkpointing.Checkpointer (resume / save / maybe_save / wait over save, load, latest) and
the storage seam every checkpoint file operation goes through (smp/checkpointing/storage.py).

Resume is compared with the uninterrupted run bitwise: same world size, same shards, same
optimizer, scheduler and data position; no dropout, so no RNG stream is involved.
"""

from __future__ import annotations

import os

import pytest
import torch

import smp
from smp.checkpointing import storage
from smp.testing.models import TinyTransformer
from tests.checkpointing import checkpointer_cases as cases


# --- resume under a Checkpointer, 2 ranks, FSDP --------------------------------------------------

def test_resume_continues_the_run_exactly(ranks, tmp_path):
    for r in ranks(2).run(cases.resume_under_checkpointer, root=str(tmp_path / "ckpt"), steps=8, every=3):
        assert r["first_start"] == 0 and r["resumed_at"] == 6, r
        assert r["folders"] == ["step_3", "step_6"], r  # every=3; keep_last=2
        assert r["resumed"] == r["losses"][6:] and r["param_diff"] == 0.0, r  # bitwise
        # The scheduler and the data cursor came back with the model and optimizer.
        assert r["scheduler_epoch"] == 6 and r["resumed_lrs"] == r["lrs"][6:], r
        assert r["cursor"] == 8, r


def test_resume_without_the_scheduler_is_caught(ranks, tmp_path):
    """Negative control: a resume not given the scheduler restarts its schedule (the optimizer
    brings the step-6 lr back, the scheduler's next step does not follow it), and the checks of
    the test above see it."""
    for r in ranks(2).run(cases.resume_under_checkpointer, root=str(tmp_path / "ckpt"), steps=8, every=3,
                          drop_scheduler=True):
        assert r["resumed_at"] == 6 and r["scheduler_epoch"] == 0, r
        assert r["resumed_lrs"] != r["lrs"][6:], r
        assert r["param_diff"] > 0, r  # step 7 updated with the restarted schedule's lr


# --- what a Checkpointer refuses -------------------------------------------------------------------

class _OnlySaves:
    def state_dict(self) -> dict:
        return {}


def test_a_stateful_without_load_state_dict_is_refused_by_name(tmp_path):
    model = TinyTransformer(vocab=32, dim=16, hidden=32, layers=1)
    with pytest.raises(smp.CheckpointError, match=r"`loader=` \(_OnlySaves\) has no load_state_dict\(\)"):
        smp.checkpointing.Checkpointer(tmp_path, model, loader=_OnlySaves())
    with pytest.raises(smp.CheckpointError, match=r"`seed=` \(int\) has no state_dict\(\) or load_state_dict\(\)"):
        smp.checkpointing.Checkpointer(tmp_path, model, seed=3)
    with pytest.raises(smp.CheckpointError, match=r"`step=` is reserved"):
        smp.checkpointing.Checkpointer(tmp_path, model, step=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(smp.CheckpointError, match="every=0"):
        smp.checkpointing.Checkpointer(tmp_path, model, every=0)


def test_resume_of_an_empty_root_changes_nothing_and_a_missing_stateful_is_named(tmp_path):
    model = TinyTransformer(vocab=32, dim=16, hidden=32, layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = smp.checkpointing.Checkpointer(tmp_path / "ckpt", model, opt, every=2)
    assert ckpt.resume() == 0 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not ckpt.maybe_save(1) and ckpt.maybe_save(2)
    assert smp.checkpointing.latest(tmp_path / "ckpt") == str(tmp_path / "ckpt" / "step_2")
    with pytest.raises(smp.CheckpointError, match=r"holds no state for `scheduler`"):
        smp.checkpointing.Checkpointer(tmp_path / "ckpt", model, opt, scheduler=sched).resume()


# --- the storage seam ----------------------------------------------------------------------------

class _Recording(storage.LocalStorage):
    """LocalStorage that records each call (method name, paths relative to `root`)."""

    def __init__(self, root: str, fail_on: str | None = None) -> None:
        self.root, self.fail_on, self.calls = root, fail_on, []


def _recorded(name: str):
    def method(self, *args, **kwargs):
        paths = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in args if not isinstance(a, (bytes, dict))]
        shown = tuple(os.path.relpath(a, self.root) if isinstance(a, str) and a.startswith(self.root) else a
                      for a in paths)
        self.calls.append((name, *shown, *(k for k, v in kwargs.items() if v is True)))
        if name == self.fail_on:
            raise OSError(f"{name} refused (injected)")
        return getattr(storage.LocalStorage, name)(self, *args, **kwargs)
    return method


for _name in [n for n in vars(storage.LocalStorage) if not n.startswith("_")]:
    setattr(_Recording, _name, _recorded(_name))


def test_the_commit_goes_through_the_storage_seam_in_protocol_order(tmp_path, monkeypatch):
    recording = _Recording(str(tmp_path))
    monkeypatch.setattr(storage, "DEFAULT", recording)
    smp.checkpointing.save(tmp_path / "step_1", TinyTransformer(vocab=32, dim=16, hidden=32, layers=1))
    writes = [c for c in recording.calls if c[0] in ("make_dirs", "write_file", "torch_save", "open_stream",
                                                     "fsync_dir", "rename", "remove")]
    partial = ".step_1.partial"
    assert writes == [
        ("make_dirs", partial),
        ("write_file", f"{partial}/smp_partial.json"),  # the partial folder names its run first
        ("make_dirs", f"{partial}/smp_extra"),
        ("torch_save", f"{partial}/smp_extra/rank_0.pt"),
        ("open_stream", f"{partial}/__0_0.distcp", "wb"),  # DCP's shard, hashed as written
        ("open_stream", f"{partial}/.metadata.tmp", "wb"),  # DCP's index (DCP renames it itself)
        ("write_file", f"{partial}/smp_meta.json", "durable"),
        ("write_file", f"{partial}/smp_commit.json", "durable"),  # the marker, after the metadata
        ("fsync_dir", partial),
        ("rename", partial, "step_1"),  # the commit
        ("fsync_dir", "."),
        ("remove", "step_1/smp_partial.json"),
    ], writes
    recording.calls.clear()
    assert smp.checkpointing.latest(tmp_path) == str(tmp_path / "step_1")
    smp.checkpointing.load(tmp_path / "step_1", TinyTransformer(vocab=32, dim=16, hidden=32, layers=1))
    reads = {c[:2] for c in recording.calls}
    assert {("read_regular", "step_1/smp_commit.json"), ("read_regular", "step_1/smp_meta.json"),
            ("open_regular", "step_1/.metadata"), ("open_regular", "step_1/smp_extra/rank_0.pt"),
            ("open_stream", "step_1/__0_0.distcp")} <= reads, sorted(reads)


def test_a_failing_rename_in_the_seam_leaves_no_checkpoint(tmp_path, monkeypatch):
    """Negative control: the seam really carries the commit: a storage whose rename fails makes
    the save fail, with nothing committed and the partial folder removed."""
    monkeypatch.setattr(storage, "DEFAULT", _Recording(str(tmp_path), fail_on="rename"))
    with pytest.raises(smp.CheckpointError, match="rename refused"):
        smp.checkpointing.save(tmp_path / "step_1", TinyTransformer(vocab=32, dim=16, hidden=32, layers=1))
    monkeypatch.setattr(storage, "DEFAULT", storage.LocalStorage())
    assert smp.checkpointing.latest(tmp_path) is None and os.listdir(tmp_path) == []
