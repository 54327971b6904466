"""A checkpoint is untrusted input: loading never runs code from it, damage is refused before the
model changes, keep_last deletes only what this run wrote, and a full disk is a clear error.

Each case checks what load / latest / keep_last / save did on every rank (tests/
checkpoint_trust_cases.py). Beside each refusal the untouched checkpoint loads (`ok`), so the
checks cannot pass by refusing everything. Before this change, each of these assertions failed:
the payloads created their marker folder, DCP's CheckpointException (a BaseException) or a
KeyError escaped, a flipped byte loaded silently, keep_last deleted the user's folder, another
run's checkpoint and a symlink's target, and a full disk left a RuntimeError and a partial folder.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.checkpointing import checkpoint_trust_cases as cases


def _refused(message: str, *expected: str) -> bool:
    return message.startswith("NOT A") is False and bool(message) and all(e in message for e in expected)


@pytest.mark.parametrize("world", [1, 2])
def test_loading_never_runs_code(ranks, tmp_path, world):
    for r in ranks(world).run(cases.no_code_runs, config={}, root=str(tmp_path)):
        assert r["ok"] == "", r["ok"]
        for key in ("extra", "extra_unforged", "metadata", "metadata_nested", "bytes", "dotdot", "absolute", "symlink"):
            assert r[key] and not r[key].startswith("NOT A"), (key, r[key])
            assert not r[key + "_ran_code"], key
            assert r[key + "_model_unchanged"], key
        assert "allow_pickle=True" in r["extra"], r["extra"]
        assert "smp_extra/rank_0.pt" in r["extra_unforged"] and "replaced" in r["extra_unforged"]
        assert "posix.mkdir" in r["metadata"] and "not part of DCP metadata" in r["metadata"], r["metadata"]
        assert "posix.mkdir" in r["metadata_nested"], r["metadata_nested"]
        assert "points outside the checkpoint folder" in r["dotdot"], r["dotdot"]
        assert "points outside the checkpoint folder" in r["absolute"], r["absolute"]
        assert r["shard"] in r["symlink"] and "symbolic link" in r["symlink"], r["symlink"]
        assert "allow_pickle=True" in r["odd_extra"] and r["odd_extra_trusted"] == "", r


def test_damage_is_refused_before_loading(ranks, tmp_path):
    results = ranks(2).run(cases.damage_is_refused, config={}, root=str(tmp_path))
    for r in results:
        assert r["ok"] == "" and r["ok_exact"], r
        assert _refused(r["flipped"], r["shard"], "digest"), r["flipped"]
        assert _refused(r["truncated"], "__0_0.distcp", "truncated"), r["truncated"]
        assert _refused(r["truncated_extra"], "smp_extra/rank_1.pt"), r["truncated_extra"]
        assert _refused(r["dcp_fails"], "injected read error", "unchanged"), r["dcp_fails"]
        for key in ("meta_list", "meta_missing", "meta_not_json", "meta_empty"):
            assert _refused(r[key], "smp_meta.json"), (key, r[key])
        assert "'files'" in r["meta_missing"] and "'params' is missing" in r["meta_missing"], r["meta_missing"]
        assert _refused(r["amsgrad"], "amsgrad=False in the checkpoint, True here"), r["amsgrad"]
        assert _refused(r["param_groups"], "1 parameter groups in the checkpoint, 2 here"), r["param_groups"]
        assert r["param_groups_untouched"]
        assert r["latest_after_delete"] == "step_1", r
        assert _refused(r["deleted"], r["shard"], "missing"), r["deleted"]
        for key in ("flipped", "truncated", "truncated_extra", "dcp_fails", "meta_list", "meta_missing",
                    "meta_not_json", "meta_empty", "amsgrad", "deleted"):
            assert r[key + "_unchanged"], key  # model and optimizer state exactly as before
        assert r["latest_before"] == "step_2", r


@pytest.mark.parametrize("world", [1, 2])
def test_digests_from_the_bytes_dcp_writes_and_reads(ranks, tmp_path, world):
    """Save records each file's digest as DCP writes it, load checks it from the bytes DCP reads:
    the recorded digests equal a separate hash of each file, a clean load hashes no data file a
    second time, and a byte DCP never reads (zip padding) is still covered."""
    for r in ranks(world).run(cases.inline_digests, config={}, root=str(tmp_path)):
        assert r["recorded_equal_file"] and all(r["recorded_equal_file"].values()), r["recorded_equal_file"]
        assert r["ok"] == "" and r["ok_exact"], r
        assert r["hashed_again"] == [], r["hashed_again"]
        assert r["unread_bytes"] > 0, "DCP read every byte: the unread-byte case proves nothing"
        assert _refused(r["flipped_unread"], r["shard"], "digest"), r["flipped_unread"]
        assert r["flipped_unread_unchanged"]


@pytest.mark.parametrize("keep_at_most", [64 << 20, 100])
def test_hashing_stream_hashes_the_whole_file_in_any_read_order(tmp_path, monkeypatch, keep_at_most):
    """`_HashingRead` under random seeks, reads and readintos, small (kept) and large (hashed in
    place), in any order, also with the kept-bytes cap hit: its digest is the file's."""
    import random

    from smp.checkpointing.storage import RangeFile
    from smp.checkpointing.trust import digest, inline_digest

    monkeypatch.setattr(inline_digest, "_KEEP_AT_MOST", keep_at_most)
    rng = random.Random(0)
    file = tmp_path / "data.bin"
    file.write_bytes(rng.randbytes(5 * (1 << 20) + 123))
    size = file.stat().st_size
    for trial in range(20):
        with open(file, "rb") as raw, open(file, "rb") as gaps:
            stream = inline_digest._HashingRead(raw, "xxh3_64", RangeFile(gaps.fileno()))
            for _ in range(rng.randrange(0, 12)):
                at = rng.randrange(0, size)
                n = rng.choice([1, 30, 4096, (1 << 20) + 7, 3 << 20])
                stream.seek(at)
                if rng.random() < 0.5:
                    stream.read(n)
                else:
                    stream.readinto(bytearray(min(n, size - at)))
            assert stream.finish() == (size, digest.file_digest(str(file), "xxh3_64")), trial


def test_keep_last_and_latest_in_a_shared_root(ranks, tmp_path):
    root = tmp_path / "root"
    for r in ranks(2).run(cases.shared_root, config={}, root=str(root)):
        # Only this run's older checkpoints went; the user's folder, the other run's checkpoint
        # and both links stayed (the link to step_2 now dangles: step_2 itself was rotated).
        assert r["listing"] == [".my_notes.partial", "best", "latest", "step_3", "step_4", "theirs_step_0"], r
        assert r["notes_kept"] and r["theirs_loads"] and r["other_run_loads"], r
        assert r["links"] == ("step_2", str(tmp_path / "other_run" / "step_100")), r
        # Save order, not the (skewed) commit clock or mtime.
        assert r["latest"] == "step_4" and r["latest_step"] == 4, r


def _disk_full_checks(results: list[dict]) -> None:
    for r in results:
        for mode in ("sync", "async"):
            assert _refused(r[mode], "disk full", "MiB"), (mode, r[mode])
            assert r[mode + "_listing"] == ["step_1"], (mode, r)  # partial files removed
        assert r["latest"] == "step_1" and r["step"] == 1 and r["intact"], r


@pytest.mark.parametrize("where", ["data", "partial_marker", "commit", "unexpected_pos"])
def test_disk_full_injected(ranks, tmp_path, where):
    _disk_full_checks(ranks(2).run(cases.disk_full, config={}, root=str(tmp_path), inject=where))


def test_disk_full_on_a_real_small_filesystem(ranks, tmp_path):
    """A 900 KiB tmpfs: step_1 (about 560 KiB) fits, step_2 does not. Needs root."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        _disk_full_checks(ranks(2).run(cases.disk_full, config={}, root=str(small), inject=None))
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.parametrize("world", [1, 2])
def test_planted_files_are_refused_fast(ranks, tmp_path, world):
    """A link to /dev/zero used to be read until memory ran out, a FIFO blocked latest() forever."""
    for r in ranks(world).run(cases.planted_files, config={}, root=str(tmp_path)):
        assert r["ok"] == "", r["ok"]
        for plant in ("meta_devzero", "meta_fifo", "commit_fifo", "commit_devzero", "dcp_fifo"):
            name = {"meta": "smp_meta.json", "commit": "smp_commit.json", "dcp": ".metadata"}[plant.split("_")[0]]
            assert r[f"{plant}_latest"] == "step_1" and r[f"{plant}_latest_s"] < 1, (plant, r)
            assert _refused(r[f"{plant}_load"], name) and r[f"{plant}_load_s"] < 1, (plant, r[f"{plant}_load"])
        for plant in ("meta_devzero", "meta_fifo"):
            assert r[f"{plant}_warned"] is True, (plant, r[f"{plant}_warned"])
        assert "symbolic link" in r["meta_devzero_load"] and "FIFO" in r["meta_fifo_load"], r
        assert _refused(r["plain_dcp"], "not written by smp", "torch.distributed.checkpoint.load"), r["plain_dcp"]


def test_a_folder_one_rank_finds_damaged_is_refused_on_every_rank(ranks, tmp_path):
    """Ranks that see different folders (no shared filesystem): the rank that finds a problem
    does not leave the others waiting in load's next collective; all raise, naming the file."""
    for r in ranks(2).run(cases.one_rank_sees_damage, config={}, root=str(tmp_path), timeout=60):
        assert "smp_commit.json" in r["error"] and "planted on this rank" in r["error"], r
        assert r["seconds"] < 10, r


@pytest.mark.parametrize("world", [1, 2])
def test_downgraded_metadata_does_not_switch_verification_off(ranks, tmp_path, world):
    """format_version 1 without 'files' used to skip every digest check with a log line: a
    flipped byte loaded and latest() returned it. Now loading it needs allow_unverified=True."""
    for r in ranks(world).run(cases.downgraded, config={}, root=str(tmp_path / "root")):
        assert r["latest"] == "step_1" and r["warned"], r
        assert _refused(r["refused"], "step_2", "cannot be verified", "allow_unverified=True"), r["refused"]
        assert r["clean_opt_in"] == "" and r["clean_exact"], r  # the opt-in loads a good old checkpoint
        assert r["flipped_opt_in"] == "", r  # ... and, unverified, damage too: the risk it names


@pytest.mark.parametrize("world", [1, 2])
def test_two_runs_sharing_a_root(ranks, tmp_path, world):
    """Run B used to replace run A's committed step_2 and delete A's live partial folder, and
    latest() gave B the newest checkpoint of whichever run. Beside each refusal, A restarted
    with its own id replaces its own checkpoint (the refusal is about the run, not the name)."""
    for r in ranks(world).run(cases.two_runs, config={}, root=str(tmp_path / "root")):
        assert r["b_latest_first"] is None and r["b_latest_first_warned"], r
        assert _refused(r["b_overwrites"], "another run (run-a)", "run run-b", "SMP_RUN_ID=run-a"), r["b_overwrites"]
        assert _refused(r["b_into_live_partial"], ".step_3.partial", "another run (run-a)"), r["b_into_live_partial"]
        assert r["live_partial_kept"], r
        assert r["a_restart_latest"] == "step_2" and r["a_restart_extra"] == {"step": 2, "run": "a"}, r
        assert r["a_weights_intact"], r
        assert (r["b_latest"], r["b_latest_any"], r["b_latest_of_a"]) == ("b_step_1", "step_3", "step_3"), r
        assert _refused(r["unnamed_latest"], "run-a", "run-b", "SMP_RUN_ID"), r["unnamed_latest"]
        assert r["torchrun_restart_latest"] == "step_1" and r["torchrun_new_launch_latest"] is None, r
        assert r["unnamed_solo_latest"] == "step_1" and r["unnamed_solo_listing"] == ["step_2"], r


@pytest.mark.parametrize("world", [1, 2])
def test_load_hf_names_a_damaged_or_forged_file(ranks, tmp_path, world):
    for r in ranks(world).run(cases.hf_damage, config={}, root=str(tmp_path)):
        assert r["ok"] == "", r["ok"]
        assert _refused(r["truncated"], r["file"], "truncated"), r["truncated"]
        for kind in ("forged_offsets", "forged_text"):
            assert _refused(r[kind], r["file"], "DCP_SHARDING_INFO"), (kind, r[kind])
