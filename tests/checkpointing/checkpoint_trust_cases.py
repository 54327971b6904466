"""Rank-side cases of tests/checkpointing/test_checkpoint_trust.py: a checkpoint is untrusted input.

Each case saves a real checkpoint, damages or forges it the way an accident or an attacker
would (rank 0 edits the files, then every rank loads), and reports what `load`, `latest` and
`keep_last` did. A forger rewrites the digests in smp_meta.json too (`_forge`): the digests
catch accidents, the allow-lists must stop the code.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil

import torch
import torch.distributed as dist

import smp
from smp.checkpointing.trust import digest
from smp.testing.distributed import full_tensor, local_rows
from smp.testing.models import TinyTransformer, loss_of, random_batch

GLOBAL_BATCH, SEQ = 8, 16


class Payload:
    """Unpickling this runs `os.mkdir(marker)`: the proof that a load executed code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _rank0() -> bool:
    return dist.get_rank() == 0


def _params(model) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def _unchanged(before: dict, model) -> bool:
    after = _params(model)
    return all(torch.equal(before[k], after[k]) for k in before)


def _train_step(model, opt, seed: int = 3) -> None:
    loss_of(model, local_rows(random_batch(GLOBAL_BATCH, SEQ, 128, seed=seed))).backward()
    opt.step()
    opt.zero_grad()


def _error(fn, *args, **kwargs) -> str:
    """The CheckpointError's message, "" when none; any other exception type is reported by
    name (the cases assert on it: a KeyError or a BaseException from DCP is a bug)."""
    try:
        fn(*args, **kwargs)
    except smp.CheckpointError as e:
        return str(e)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"NOT A CheckpointError: {type(e).__name__}: {e}"
    return ""


def _on_rank0(fn) -> None:
    """Change the folder on rank 0 only after every rank is done with what came before, and
    let no rank go on before the change is made. A collective that just ran (load's path check)
    does not order a rank's later reads: rank 0 leaves it as soon as the others' data is in,
    while they may still be about to read the folder. Without the first barrier rank 0 removed
    a checkpoint that rank 1 then found half deleted (commit marker gone, `.metadata` still
    there: "incomplete checkpoint" instead of the planted file's name) or gone."""
    dist.barrier()
    if _rank0():
        fn()
    dist.barrier()


def _copy(src: str, dst: str) -> str:
    _on_rank0(lambda: shutil.copytree(src, dst, symlinks=True))
    return dst


def _forge(path: str, rel: str) -> None:
    """(rank 0) Rewrite smp_meta.json's record of `rel` to match the file as it is now."""
    meta_file = os.path.join(path, "smp_meta.json")
    meta = json.load(open(meta_file))
    full = os.path.join(path, rel)
    meta.setdefault("files", {})[rel] = {"bytes": os.path.getsize(full), "digest": digest.file_digest(full, "xxh3_64")}
    json.dump(meta, open(meta_file, "w"))


def _write(path: str, rel: str, data: bytes, forge: bool) -> None:
    def edit():
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
        if forge:
            _forge(path, rel)
    _on_rank0(edit)


def _fresh(optim: bool = True, **options):
    model = smp.transform(TinyTransformer())
    return model, (torch.optim.AdamW(model.parameters(), lr=1e-2, **options) if optim else None)


def _saved(root: str, name: str = "good") -> tuple[str, dict]:
    """A trained model + AdamW checkpoint with an `extra`; its parameters."""
    model, opt = _fresh()
    _train_step(model, opt)
    path = os.path.join(root, name)
    smp.checkpointing.save(path, model, opt, extra={"step": 1, "sched": {"lr": [0.01], "last_epoch": 1}})
    return path, _params(model)


# ---------------------------------------------------------------------------------------------
# 1. Security: loading never runs code from the checkpoint


def no_code_runs(config: dict, root: str) -> dict:
    with smp.session(config):
        ck = smp.checkpointing
        good, _ = _saved(root)
        marker = os.path.join(root, "PWNED")
        out: dict = {}

        def attempt(key: str, path: str, **kwargs) -> None:
            model, opt = _fresh()
            before = _params(model)
            out[key] = _error(ck.load, path, model, opt, **kwargs)
            out[key + "_ran_code"] = os.path.exists(marker)
            out[key + "_model_unchanged"] = _unchanged(before, model) and not opt.state
            _on_rank0(lambda: os.path.exists(marker) and os.rmdir(marker))

        # The extra-state file: a __reduce__ payload, digest forged to match.
        buffer = io.BytesIO()
        torch.save({"extra": Payload(marker), "rng": {}}, buffer)  # what today's loader reads
        evil_extra = buffer.getvalue()
        path = _copy(good, os.path.join(root, "evil_extra"))
        for r in range(dist.get_world_size()):
            _write(path, f"smp_extra/rank_{r}.pt", evil_extra, forge=True)
        attempt("extra", path)
        # ... the same file, digest not forged: refused as damaged before it is even unpickled.
        path = _copy(good, os.path.join(root, "evil_extra_unforged"))
        _write(path, "smp_extra/rank_0.pt", evil_extra, forge=False)
        attempt("extra_unforged", path)
        # DCP's .metadata: a bare payload, and one hidden inside otherwise valid metadata.
        path = _copy(good, os.path.join(root, "evil_metadata"))
        _write(path, ".metadata", pickle.dumps(Payload(marker)), forge=True)
        attempt("metadata", path)
        from smp.checkpointing.trust.safe_read import read_dcp_metadata

        md = read_dcp_metadata(good)
        md.planner_data = {"x": Payload(marker)}
        path = _copy(good, os.path.join(root, "evil_metadata_nested"))
        _write(path, ".metadata", pickle.dumps(md), forge=True)
        attempt("metadata_nested", path)
        # A non-tensor entry inside the shards (an optimizer hyperparameter): smp's own save
        # writes it with valid digests, DCP's reader would torch.load it with weights_only=False.
        model, opt = _fresh()
        opt.param_groups[0]["lr"] = Payload(marker)
        ck.save(os.path.join(root, "evil_bytes"), model, opt)
        attempt("bytes", os.path.join(root, "evil_bytes"))
        # The same for a safe checkpoint whose extra is an arbitrary object: refused unless the
        # caller trusts it; with allow_pickle=True it loads (that is what the opt-in means).
        model, opt = _fresh()
        ck.save(os.path.join(root, "odd_extra"), model, opt, extra={"cls": Payload})
        out["odd_extra"] = _error(ck.load, os.path.join(root, "odd_extra"), *_fresh())
        out["odd_extra_trusted"] = _error(ck.load, os.path.join(root, "odd_extra"), *_fresh(), allow_pickle=True)

        # Files outside the folder: .metadata pointing at ../ and at an absolute path.
        outside = os.path.join(root, "outside")
        _on_rank0(lambda: os.makedirs(outside))
        for key, prefix in (("dotdot", "../outside/"), ("absolute", outside + "/")):
            md = read_dcp_metadata(good)
            for info in md.storage_data.values():
                info.relative_path = prefix + info.relative_path
            path = _copy(good, os.path.join(root, f"escape_{key}"))
            _on_rank0(lambda: [shutil.copy(os.path.join(good, f), outside) for f in os.listdir(good)
                               if f.endswith(".distcp")])
            _write(path, ".metadata", pickle.dumps(md), forge=True)
            attempt(key, path)
        # A data file replaced by a symbolic link to a copy of itself (same bytes, same digest).
        path = _copy(good, os.path.join(root, "symlinked"))
        shard = f"__{dist.get_world_size() - 1}_0.distcp"

        def link():
            shutil.move(os.path.join(path, shard), os.path.join(outside, "moved.distcp"))
            os.symlink(os.path.join(outside, "moved.distcp"), os.path.join(path, shard))
        _on_rank0(link)
        attempt("symlink", path)
        out["shard"] = shard
        out["ok"] = _error(ck.load, good, *_fresh())  # the untouched checkpoint loads
        return out


# ---------------------------------------------------------------------------------------------
# 2. Integrity: damage is found before anything is copied into the model


def damage_is_refused(config: dict, root: str) -> dict:
    with smp.session(config):
        ck = smp.checkpointing
        world = dist.get_world_size()
        first, _ = _saved(root, "step_1")
        good, saved = _saved(root, "step_2")
        out: dict = {}

        def attempt(key: str, path: str, **options) -> None:
            model, opt = _fresh(**options)
            _train_step(model, opt, seed=11)  # live state that a failed load must not touch
            before = _params(model)
            state_before = {k: {n: full_tensor(t).clone() for n, t in s.items() if torch.is_tensor(t)}
                            for k, s in opt.state.items()}
            out[key] = _error(ck.load, path, model, opt)
            out[key + "_unchanged"] = _unchanged(before, model) and all(
                torch.equal(full_tensor(opt.state[k][n]), v) for k, s in state_before.items() for n, v in s.items())

        shard = f"__{world - 1}_0.distcp"
        data = open(os.path.join(good, shard), "rb").read()
        path = _copy(good, os.path.join(root, "flipped"))
        middle = len(data) // 2
        _write(path, shard, data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:], forge=False)
        attempt("flipped", path)
        path = _copy(good, os.path.join(root, "truncated"))
        _write(path, "__0_0.distcp", open(os.path.join(good, "__0_0.distcp"), "rb").read()[:-1000], forge=False)
        attempt("truncated", path)
        path = _copy(good, os.path.join(root, "truncated_extra"))
        extra = f"smp_extra/rank_{world - 1}.pt"
        _write(path, extra, open(os.path.join(good, extra), "rb").read()[:100], forge=False)
        attempt("truncated_extra", path)
        # A failure inside DCP itself, after every check passed: the read raises half-way.
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        original = FileSystemReader.read_data

        def read_then_fail(self, plan, planner):
            original(self, plan, planner)  # the tensors are filled: only a copy may have been
            raise OSError(errno.EIO, "injected read error")

        FileSystemReader.read_data = read_then_fail
        try:
            attempt("dcp_fails", good)
        finally:
            FileSystemReader.read_data = original

        # Tampered smp_meta.json: valid JSON of the wrong shape, missing fields, not JSON, empty.
        meta = open(os.path.join(good, "smp_meta.json")).read()
        no_files = json.loads(meta)
        del no_files["files"], no_files["params"]
        for key, text in (("meta_list", "[1, 2]"), ("meta_missing", json.dumps(no_files)),
                          ("meta_not_json", meta[: len(meta) // 2]), ("meta_empty", "")):
            path = _copy(good, os.path.join(root, key))
            _write(path, "smp_meta.json", text.encode(), forge=False)
            attempt(key, path)
        # Optimizer built with other options than the saved one.
        attempt("amsgrad", good, amsgrad=True)
        model = smp.transform(TinyTransformer())
        two_groups = torch.optim.AdamW([{"params": list(model.parameters())[:2]},
                                        {"params": list(model.parameters())[2:]}], lr=1e-2)
        out["param_groups"] = _error(ck.load, good, model, two_groups)
        out["param_groups_untouched"] = not two_groups.state
        # A deleted data file: latest() skips the checkpoint; loading it names the file.
        latest_root = os.path.join(root, "latest_root")
        _copy(first, os.path.join(latest_root, "step_1"))
        _copy(good, os.path.join(latest_root, "step_2"))
        out["latest_before"] = os.path.basename(ck.latest(latest_root))
        dist.barrier()  # every rank has looked before rank 0 deletes (else a slow rank sees step_1)
        _on_rank0(lambda: os.remove(os.path.join(latest_root, "step_2", shard)))
        out["latest_after_delete"] = os.path.basename(ck.latest(latest_root))
        attempt("deleted", os.path.join(latest_root, "step_2"))
        out["shard"] = shard
        model, opt = _fresh()
        out["ok"] = _error(ck.load, good, model, opt)  # the untouched checkpoint loads exactly
        out["ok_exact"] = _unchanged(saved, model)
        return out


def _bytes_dcp_reads(path: str, shard: str) -> list[bool]:
    """Which bytes of `shard` a plain DCP load of `path` reads (a spy on its file stream)."""
    import contextlib

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

    read = [False] * os.path.getsize(os.path.join(path, shard))

    class Spy:
        def __init__(self, raw):
            self._raw = raw

        def readinto(self, buffer):
            at, n = self._raw.tell(), self._raw.readinto(buffer)
            read[at:at + n] = [True] * n
            return n

        def read(self, size=-1):
            at, data = self._raw.tell(), self._raw.read(size)
            read[at:at + len(data)] = [True] * len(data)
            return data

        def __getattr__(self, name):
            return getattr(self._raw, name)

    class SpyFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, file, mode):
            with super().create_stream(file, mode) as raw:
                yield Spy(raw) if os.path.basename(file) == shard else raw

    model, opt = _fresh()
    state = {"model": smp.checkpointing.sharded.get_model_state_dict(model)}
    reader = FileSystemReader(path)
    reader.fs = SpyFileSystem()
    dcp.load(state, storage_reader=reader, planner=smp.checkpointing.trust.safe_read.SafeLoadPlanner())
    return read


def inline_digests(config: dict, root: str) -> dict:
    """Digests taken from the bytes DCP writes and reads (smp/checkpointing/trust/inline_digest.py)."""
    with smp.session(config):
        world = dist.get_world_size()
        good, saved = _saved(root, "good")
        meta = json.load(open(os.path.join(good, "smp_meta.json")))
        out: dict = {"recorded_equal_file": {
            f: digest.file_digest(os.path.join(good, f), e["digest"].split(":")[0]) == e["digest"]
            for f, e in meta["files"].items()}}
        # A clean load hashes no data file a second time.
        hashed_again = []
        whole_file = digest.file_digest

        def counting(file, algo):
            hashed_again.append(os.path.basename(file))
            return whole_file(file, algo)

        digest.file_digest = counting
        try:
            model, opt = _fresh()
            out["ok"] = _error(smp.checkpointing.load, good, model, opt)
        finally:
            digest.file_digest = whole_file
        out["ok_exact"] = _unchanged(saved, model)
        out["hashed_again"] = [f for f in hashed_again if f.endswith(".distcp")]
        # A flipped byte where DCP never reads (zip padding): only hashing the whole file sees it.
        shard = f"__{world - 1}_0.distcp"
        read = _bytes_dcp_reads(good, shard)
        out["unread_bytes"] = read.count(False)
        if out["unread_bytes"]:
            at = read.index(False)
            data = open(os.path.join(good, shard), "rb").read()
            path = _copy(good, os.path.join(root, "flipped_unread"))
            _write(path, shard, data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:], forge=False)
            model, opt = _fresh()
            _train_step(model, opt, seed=11)
            before = _params(model)
            out["flipped_unread"] = _error(smp.checkpointing.load, path, model, opt)
            out["flipped_unread_unchanged"] = _unchanged(before, model)
        out["shard"] = shard
        return out


# ---------------------------------------------------------------------------------------------
# 3. keep_last and latest() in a root shared with the user and with other runs


def shared_root(config: dict, root: str) -> dict:
    with smp.session(config):
        ck = smp.checkpointing
        model, _ = _fresh(optim=False)
        other = os.path.join(os.path.dirname(root), "other_run")
        ck.save(os.path.join(other, "step_100"), model, extra={"step": 100})  # same run, other root
        ck.save(os.path.join(root, "theirs_step_0"), model, extra={"step": 0})

        def populate():
            notes = os.path.join(root, ".my_notes.partial")
            os.makedirs(notes)
            open(os.path.join(notes, "todo.txt"), "w").write("mine")
            marker = os.path.join(root, "theirs_step_0", "smp_commit.json")  # another run's save
            data = json.load(open(marker))
            data["run_id"] = "another-run"
            json.dump(data, open(marker, "w"))
            os.symlink(os.path.join(other, "step_100"), os.path.join(root, "best"))
        _on_rank0(populate)
        for step in range(1, 5):
            ck.save(os.path.join(root, f"step_{step}"), model, extra={"step": step}, keep_last=2)
            if step == 2:
                _on_rank0(lambda: os.symlink("step_2", os.path.join(root, "latest")))

        def skew_clocks():
            # Wall clocks say step_3 is newest (a node whose clock ran ahead); mtimes agree.
            marker = os.path.join(root, "step_3", "smp_commit.json")
            data = json.load(open(marker))
            data["committed_at_ns"] *= 2
            json.dump(data, open(marker, "w"))
            os.utime(os.path.join(root, "step_3"), (4e9, 4e9))
        _on_rank0(skew_clocks)
        latest = ck.latest(root)
        return {
            "listing": sorted(os.listdir(root)),
            "notes_kept": os.path.exists(os.path.join(root, ".my_notes.partial", "todo.txt")),
            "theirs_loads": ck.load(os.path.join(root, "theirs_step_0"), model) == {"step": 0},
            "other_run_loads": ck.load(os.path.join(other, "step_100"), model) == {"step": 100},
            "links": (os.readlink(os.path.join(root, "latest")), os.readlink(os.path.join(root, "best"))),
            "latest": os.path.basename(latest),
            "latest_step": ck.load(latest, model)["step"],
        }


# ---------------------------------------------------------------------------------------------
# 4. A full disk


def _full_writes(where: str, rank: int):
    """Make one kind of write of the next saves raise ENOSPC on `rank`; returns the undo.
    "data": DCP's shard writes. "partial_marker" / "commit": the file that opens a partial
    folder / smp_meta.json, which rank 0 writes before / after the shards (the file is created,
    then the write fails, as on a disk that fills up)."""
    import builtins
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from smp.checkpointing import storage
    from smp.checkpointing.commit import atomic
    from smp.checkpointing.format import metadata

    def full() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "unexpected_pos":  # torch.save's report of a short write, with free space left
        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            if dist.get_rank() == rank and "smp_extra" in str(f):
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 470")
            return original_save(obj, f, *args, **kwargs)
        torch.save = save
        return lambda: setattr(torch, "save", original_save)
    if where == "data":
        original = FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if dist.get_rank() == rank:
                raise full()
            return original(self, plan, planner)
        FileSystemWriter.write_data = write_data
        return lambda: setattr(FileSystemWriter, "write_data", original)
    name = {"partial_marker": atomic.PARTIAL_FILE, "commit": metadata.META_FILE}[where]

    def open_(file, mode="r", *args, **kwargs):
        f = builtins.open(file, mode, *args, **kwargs)
        if dist.get_rank() == rank and "w" in mode and os.path.basename(file) == name:
            f.close()
            raise full()
        return f
    storage.open = open_  # the storage module's own name for open shadows the builtin
    return lambda: delattr(storage, "open")


def disk_full(config: dict, root: str, inject: str | None) -> dict:
    """Save step_1, train, then save step_2 (sync, then async) on a disk that fills up: a real
    small tmpfs at `root` (`inject` None), or ENOSPC injected into one kind of write (see
    `_full_writes`): DCP's shard writes on the last rank, or rank 0's own files."""
    with smp.session(config):
        ck = smp.checkpointing
        model, opt = _fresh()
        _train_step(model, opt)
        ck.save(os.path.join(root, "step_1"), model, opt, extra={"step": 1})
        at_1 = _params(model)
        _train_step(model, opt, seed=5)
        last = dist.get_world_size() - 1
        undo = _full_writes(inject, last if inject in ("data", "unexpected_pos") else 0) if inject else None
        out = {}
        try:
            out["sync"] = _error(ck.save, os.path.join(root, "step_2"), model, opt, extra={"step": 2})
            dist.barrier()
            out["sync_listing"] = sorted(os.listdir(root))
            dist.barrier()  # rank 0 starts the async save (a new partial folder) only after every rank listed

            def async_save():
                ck.save(os.path.join(root, "step_2"), model, opt, extra={"step": 2}, async_save=True)
                ck.wait()
            out["async"] = _error(async_save)
            dist.barrier()
            out["async_listing"] = sorted(os.listdir(root))
        finally:
            if undo:
                undo()
        fresh, fresh_opt = _fresh()
        out["latest"] = os.path.basename(ck.latest(root))
        out["step"] = ck.load(ck.latest(root), fresh, fresh_opt)["step"]
        out["intact"] = _unchanged(at_1, fresh)
        return out


# ---------------------------------------------------------------------------------------------
# 5. Files planted in a shared root: a link to /dev/zero, a FIFO


class _Warnings:
    """The messages smp.checkpointing logs as warnings while active."""

    def __init__(self):
        import logging

        self.messages: list[str] = []
        self._logger = logging.getLogger("smp.checkpointing")
        self._handler = logging.Handler(logging.WARNING)
        self._handler.emit = lambda record: self.messages.append(record.getMessage())

    def __enter__(self):
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self._handler)


def _timed(fn, *args) -> tuple[str, float]:
    """(what fn returned or raised, as text; seconds it took)."""
    import time

    start = time.monotonic()
    try:
        result = fn(*args)
        text = os.path.basename(result) if isinstance(result, str) else repr(result)
    except smp.CheckpointError as e:
        text = str(e)
    except BaseException as e:  # noqa: BLE001 - a raw MemoryError / OSError is the bug
        text = f"NOT A CheckpointError: {type(e).__name__}: {e}"
    return text, time.monotonic() - start


def planted_files(config: dict, root: str) -> dict:
    """step_2's smp_meta.json (or its commit marker, or DCP's .metadata) replaced by a link to
    /dev/zero or a FIFO: latest() skips step_2 with a warning and returns step_1; loading step_2
    is a CheckpointError naming the file; each within a second. step_1 still loads (`ok`)."""
    out = {}
    with smp.session(config):
        ck = smp.checkpointing
        model, opt = _fresh()
        ck.save(os.path.join(root, "step_1"), model, opt, extra={"step": 1})
        _train_step(model, opt)
        for plant in ("meta_devzero", "meta_fifo", "commit_fifo", "commit_devzero", "dcp_fifo"):
            path = os.path.join(root, f"{plant}_step_2")
            ck.save(path, model, opt, extra={"step": 2})
            name = {"meta": "smp_meta.json", "commit": "smp_commit.json", "dcp": ".metadata"}[plant.split("_")[0]]

            def replace():
                os.remove(os.path.join(path, name))
                if plant.endswith("fifo"):
                    os.mkfifo(os.path.join(path, name))
                else:
                    os.symlink("/dev/zero", os.path.join(path, name))
            _on_rank0(replace)
            with _Warnings() as warned:
                out[f"{plant}_latest"], out[f"{plant}_latest_s"] = _timed(ck.latest, root)
            out[f"{plant}_warned"] = any(os.path.basename(path) in m for m in warned.messages) or warned.messages
            out[f"{plant}_load"], out[f"{plant}_load_s"] = _timed(ck.load, path, model, opt)
            _on_rank0(lambda: shutil.rmtree(path))
        # A folder torch.distributed.checkpoint wrote without smp: not an unfinished smp save.
        plain = os.path.join(root, "plain_dcp")
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=plain)
        out["plain_dcp"] = _error(ck.load, plain, model)
        fresh, fresh_opt = _fresh()
        out["ok"] = _error(ck.load, os.path.join(root, "step_1"), fresh, fresh_opt)
    return out


# ---------------------------------------------------------------------------------------------
# 6. A downgrade: smp_meta.json rewritten as format 1 (no file digests)


def _downgrade(path: str) -> None:
    meta_file = os.path.join(path, "smp_meta.json")
    meta = json.load(open(meta_file))
    meta["format_version"] = 1
    del meta["files"]
    json.dump(meta, open(meta_file, "w"))


def downgraded(config: dict, root: str) -> dict:
    """step_2 downgraded to format 1 with a flipped byte in a shard: latest() skips it (warning)
    and load refuses it, naming allow_unverified; with allow_unverified=True a clean downgraded
    copy loads exactly (the opt-in works), and the flipped one loads too: the risk it names."""
    out = {}
    with smp.session(config):
        ck = smp.checkpointing
        model, opt = _fresh()
        ck.save(os.path.join(root, "step_1"), model, opt, extra={"step": 1})
        _train_step(model, opt)
        before = _params(model)
        ck.save(os.path.join(root, "step_2"), model, opt, extra={"step": 2})
        clean = _copy(os.path.join(root, "step_2"), os.path.join(os.path.dirname(root), "clean_step_2"))
        path = os.path.join(root, "step_2")

        def tamper():
            _downgrade(path)
            _downgrade(clean)
            shard = os.path.join(path, "__0_0.distcp")
            data = bytearray(open(shard, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(shard, "wb").write(bytes(data))
        _on_rank0(tamper)
        with _Warnings() as warned:
            out["latest"] = os.path.basename(ck.latest(root))
        out["warned"] = [m for m in warned.messages if "step_2" in m]
        fresh, fresh_opt = _fresh()
        out["refused"] = _error(ck.load, path, fresh, fresh_opt)
        fresh, fresh_opt = _fresh()
        out["clean_opt_in"] = _error(ck.load, clean, fresh, fresh_opt, allow_unverified=True)
        out["clean_exact"] = _unchanged(before, fresh)
        fresh, fresh_opt = _fresh()
        out["flipped_opt_in"] = _error(ck.load, path, fresh, fresh_opt, allow_unverified=True)
    return out


# ---------------------------------------------------------------------------------------------
# 7. Two runs sharing one root


class _RunEnv:
    """A session whose run id comes from the environment (SMP_RUN_ID or torchrun's), restored
    after: pool workers outlive cases."""

    def __init__(self, config: dict, **env: str):
        self.config, self.env = config, env

    def __enter__(self):
        names = ("SMP_RUN_ID", "TORCHELASTIC_RUN_ID")
        self.saved = {k: os.environ.pop(k, None) for k in names}
        os.environ.update(self.env)
        self.session = smp.session(self.config)
        self.session.__enter__()
        return smp.checkpointing

    def __exit__(self, *exc):
        self.session.__exit__(*exc)
        for k, v in self.saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def _value(model) -> float:
    return float(next(iter(_params(model).values())).flatten()[0])


def two_runs(config: dict, root: str) -> dict:
    """Runs A and B (SMP_RUN_ID) save into one root; B must never replace or delete A's folders
    and latest() must give B its own checkpoints; A, restarted with its id, continues its own."""
    out = {}
    model, opt = None, None
    with _RunEnv(config, SMP_RUN_ID="run-a") as ck:
        model, opt = _fresh()
        ck.save(os.path.join(root, "step_1"), model, opt, extra={"step": 1, "run": "a"})
        ck.save(os.path.join(root, "step_2"), model, opt, extra={"step": 2, "run": "a"})
        a_value = _value(model)
    live = os.path.join(root, ".step_3.partial")  # run A writing step_3 right now
    _on_rank0(lambda: (os.makedirs(live), json.dump({"run_id": "run-a"}, open(os.path.join(live, "smp_partial.json"), "w")),
                       open(os.path.join(live, "__0_0.distcp"), "wb").write(b"A's bytes")))
    with _RunEnv(config, SMP_RUN_ID="run-b") as ck:
        with _Warnings() as warned:
            out["b_latest_first"] = ck.latest(root)
        out["b_latest_first_warned"] = [m for m in warned.messages if "run-a" in m]
        model, opt = _fresh()
        _train_step(model, opt, seed=11)  # B's weights differ from A's
        out["b_overwrites"] = _error(ck.save, os.path.join(root, "step_2"), model, opt, extra={"step": 2, "run": "b"})
        out["b_into_live_partial"] = _error(ck.save, os.path.join(root, "step_3"), model, opt, extra={"step": 3})
        out["live_partial_kept"] = os.path.exists(os.path.join(live, "__0_0.distcp"))
        ck.save(os.path.join(root, "b_step_1"), model, opt, extra={"step": 1, "run": "b"})
    _on_rank0(lambda: shutil.rmtree(live))
    with _RunEnv(config, SMP_RUN_ID="run-a") as ck:  # A again, newest save of the root
        fresh, fresh_opt = _fresh()
        out["a_restart_latest"] = os.path.basename(ck.latest(root))
        out["a_restart_extra"] = ck.load(ck.latest(root), fresh, fresh_opt)
        out["a_weights_intact"] = _value(fresh) == a_value
        ck.save(os.path.join(root, "step_2"), fresh, fresh_opt, extra={"step": 2, "run": "a"})  # its own: allowed
        ck.save(os.path.join(root, "step_3"), fresh, fresh_opt, extra={"step": 3, "run": "a"})
    with _RunEnv(config, SMP_RUN_ID="run-b") as ck:
        out["b_latest"] = os.path.basename(ck.latest(root))
        out["b_latest_any"] = os.path.basename(ck.latest(root, run="any"))
        out["b_latest_of_a"] = os.path.basename(ck.latest(root, run="run-a"))
    with _RunEnv(config) as ck:  # no run id from anywhere: which run it continues is not known
        out["unnamed_latest"] = _error(ck.latest, root)
    # torchrun: every restart attempt of one launch has the same TORCHELASTIC_RUN_ID.
    solo = os.path.join(os.path.dirname(root), "solo")
    with _RunEnv(config, TORCHELASTIC_RUN_ID="launch-1") as ck:
        ck.save(os.path.join(solo, "step_1"), model, extra={"step": 1})
    with _RunEnv(config, TORCHELASTIC_RUN_ID="launch-1") as ck:
        out["torchrun_restart_latest"] = os.path.basename(ck.latest(solo))
    with _RunEnv(config, TORCHELASTIC_RUN_ID="launch-2") as ck:
        out["torchrun_new_launch_latest"] = ck.latest(solo)
    # No id at all (a plain script restarted): one run in the root -> its newest; a load takes
    # its id over, so the restarted script replaces and rotates that run's checkpoints.
    with _RunEnv(config, TORCHELASTIC_RUN_ID="none") as ck:
        path = ck.latest(solo)
        out["unnamed_solo_latest"] = os.path.basename(path)
        fresh, _ = _fresh(optim=False)
        ck.load(path, fresh)
        ck.save(os.path.join(solo, "step_1"), fresh, extra={"step": 1})
        ck.save(os.path.join(solo, "step_2"), fresh, extra={"step": 2}, keep_last=1)
        out["unnamed_solo_listing"] = sorted(os.listdir(solo))
    return out


# ---------------------------------------------------------------------------------------------
# 8. load_hf on a damaged or forged safetensors folder


def hf_damage(config: dict, root: str) -> dict:
    """An export truncated, or with a forged DCP_SHARDING_INFO (offsets that place a tensor
    outside itself, or not JSON): a CheckpointError naming the file, never a raw SafetensorError
    or DCP CheckpointException. The clean export loads (`ok`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.checkpointing.checkpoint_cases import _llama

    out = {}
    with smp.session(config):
        ck = smp.checkpointing
        model = smp.transform(_llama(0))
        clean = os.path.join(root, "hf")
        ck.export_hf(clean, model)
        name = next(f for f in sorted(os.listdir(clean)) if f.endswith(".safetensors"))
        out["file"] = name

        def damaged(kind: str) -> str:
            path = os.path.join(root, kind)

            def make():
                shutil.copytree(clean, path)
                file = os.path.join(path, name)
                if kind == "truncated":
                    os.truncate(file, os.path.getsize(file) // 2)
                    return
                with safe_open(file, "pt") as f:
                    tensors = {k: f.get_tensor(k) for k in f.keys()}
                    meta = dict(f.metadata() or {})
                key = sorted(tensors)[0]
                meta["DCP_SHARDING_INFO"] = ("{not json" if kind == "forged_text" else
                                             json.dumps({key: {"saved_offsets": [5] * tensors[key].dim()}}))
                save_file(tensors, file, metadata=meta)
            _on_rank0(make)
            return path

        for kind in ("truncated", "forged_offsets", "forged_text"):
            out[kind] = _error(ck.load_hf, damaged(kind), smp.transform(_llama(1)))
        out["ok"] = _error(ck.load_hf, clean, smp.transform(_llama(1)))
    return out


def one_rank_sees_damage(config: dict, root: str) -> dict:
    """A folder only the last rank finds damaged (its own copy of the marker planted as a FIFO:
    as on a node without the shared filesystem the others see): every rank raises, naming it,
    and none waits for the others in a collective. {"error", "seconds"} per rank."""
    import time

    from smp.checkpointing.trust import verify

    with smp.session(config):
        path, _ = _saved(root)
        model, opt = _fresh()
        original = verify.check_directory

        def seen_by_this_rank(p):
            if dist.get_rank() == dist.get_world_size() - 1:
                raise smp.CheckpointError(f"{os.path.join(p, 'smp_commit.json')!r} is a FIFO (planted on this rank)")
            return original(p)

        verify.check_directory = seen_by_this_rank
        try:
            start = time.monotonic()
            error = _error(smp.checkpointing.load, path, model, opt)
            return {"error": error, "seconds": time.monotonic() - start}
        finally:
            verify.check_directory = original
