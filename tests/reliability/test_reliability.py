"""Reliability: failing ranks stop every rank fast; non-finite gradients are found and agreed on.

Multi-process failure cases cannot use the shared rank pool (they kill processes), so each
launches its own ranks (`_launch`: one Python process per rank, or torchrun for restarts) with
a hard deadline, and kills the whole process group of every rank on failure. Each launch
costs ~5-10 s of start-up on 2 cores, hence @slow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import smp
from smp.reliability import PEER_FAILURE_EXIT_CODE
from smp.testing import free_port
from smp.testing.models import TinyTransformer
from tests.reliability import reliability_cases
from tests import REPO_ROOT

ROOT = REPO_ROOT
WORKER = str(ROOT / "tests" / "reliability" / "reliability_worker.py")
# Wall-clock bound for one launch: start-up (~10 s per rank on a loaded 2-core machine) plus
# the failure handling (< 10 s). Far below the default 600 s collective timeout a hang would hit.
DEADLINE = 150.0


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}
    env.pop("SMP_CONFIG", None)
    return env


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> tuple[list[int | None], float]:
    """Exit codes (None: killed at the deadline) and the seconds until the last one exited."""
    start = time.monotonic()
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() - start < deadline:
            time.sleep(0.1)
        elapsed = time.monotonic() - start
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:  # never leave a rank behind, whatever happened above
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)
    return codes, elapsed


def _launch(world: int, args: list[str], tmp_path: Path, deadline: float = DEADLINE):
    """One process per rank, as torchrun would start them, but with no agent that kills the
    others: what stops them here is smp (or the collective timeout)."""
    procs, logs = _start(world, args, tmp_path)
    codes, elapsed = _wait_all(procs, deadline)
    return codes, [log.read_text() for log in logs], elapsed


def _start(world: int, args: list[str], tmp_path: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = tmp_path / f"rank{rank}.log"
        logs.append(log)
        env = _env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg reaches its children
            ))
    return procs, logs


def _torchrun(args: list[str], tmp_path: Path, nproc: int = 2, max_restarts: int = 0):
    log = tmp_path / "torchrun.log"
    # --standalone: a c10d rendezvous on localhost. Its store outlives a restart; without
    # smp.init's per-attempt namespace (smp/reliability/rendezvous.py) the restarted gloo group
    # read the dead attempt's addresses and failed ("connectFullMesh ... Connection refused").
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), WORKER, *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    (code,), elapsed = _wait_all([proc], DEADLINE * 2)
    return code, log.read_text(), elapsed


def _explain(codes, outputs) -> str:
    return "\n".join(f"--- rank {r} exit {c}\n{o[-3000:]}" for r, (c, o) in enumerate(zip(codes, outputs)))


# ----------------------------------------------------------------------------------------------
# A rank that raises, dies or hangs mid-step


@pytest.mark.slow
def test_rank_raising_mid_step_stops_every_rank(tmp_path):
    # collective_timeout_seconds stays large: what stops rank 0 is step_guard, not the timeout.
    codes, outputs, elapsed = _launch(2, ["--mode", "raise", "--fail-step", "2", "--timeout", "300"], tmp_path)
    assert None not in codes, "a rank was still running at the deadline:\n" + _explain(codes, outputs)
    assert codes[1] == 1 and codes[0] == PEER_FAILURE_EXIT_CODE, _explain(codes, outputs)
    assert "rank 1 failed at step 2: ValueError: injected failure" in outputs[1]
    assert "rank 0 stopping at step 2: rank 1 failed at step 2: ValueError" in outputs[0]
    assert "rank 0 attempt 0 step 2" not in outputs[0]  # it stopped in that step, not after it
    assert elapsed < DEADLINE


@pytest.mark.slow
def test_rank_dying_mid_step_is_named(tmp_path):
    """os._exit: no Python error, no chance to report; the survivors' census names it."""
    codes, outputs, elapsed = _launch(2, ["--mode", "exit", "--fail-step", "1", "--timeout", "300"], tmp_path)
    assert None not in codes, _explain(codes, outputs)
    assert codes[1] == 7 and codes[0] not in (0, None), _explain(codes, outputs)
    assert "rank(s) [1] did not answer" in outputs[0] and "around step 1" in outputs[0], outputs[0]


@pytest.mark.slow
def test_hung_rank_is_bounded_by_the_config_timeout(tmp_path):
    """Rank 1 sleeps mid-step. Rank 0's collective times out after `collective_timeout_seconds`
    (8 s here, from the config smp.init reads; short, but long enough that a CPU-starved
    rank is not taken for a hung one before the injected hang), the census finds rank 1 outside any collective,
    and rank 1's watchdog stops it. With the default 600 s timeout this would outlive DEADLINE."""
    codes, outputs, elapsed = _launch(2, ["--mode", "hang", "--fail-step", "1", "--timeout", "8"], tmp_path)
    assert None not in codes, "a rank was still running at the deadline:\n" + _explain(codes, outputs)
    assert codes[0] == 1 and codes[1] == PEER_FAILURE_EXIT_CODE, _explain(codes, outputs)
    assert "Timed out waiting 8000ms" in outputs[0], outputs[0]
    assert "rank 1 is not in a collective (hung?): step 1" in outputs[0], outputs[0]
    assert "reliability_worker.py" in outputs[0]  # where rank 1's main thread was
    assert "rank 1 stopping at step 1" in outputs[1], outputs[1]


@pytest.mark.slow
def test_store_host_killed_is_named_not_the_survivor(tmp_path):
    """Rank 0 hosts the TCPStore and is SIGKILLed mid-step. The survivor used to blame itself
    ("rank 1 failed at step 1: Connection reset", with a C++ stack dump); it now says in one
    line that rank 0, the store's host, is gone, and exits as a stopped rank."""
    codes, outputs, _ = _launch(2, ["--mode", "kill", "--fail-rank", "0", "--fail-step", "1", "--timeout", "300"],
                                tmp_path)
    assert codes[0] == -signal.SIGKILL and codes[1] == PEER_FAILURE_EXIT_CODE, _explain(codes, outputs)
    smp_lines = [line for line in outputs[1].splitlines() if line.startswith("[smp]")]
    assert len(smp_lines) == 1, outputs[1]
    assert smp_lines[0].startswith("[smp] rank 1 stopping at step 1: rank 0 (the rendezvous store's host"), smp_lines
    assert "rank 1 failed" not in outputs[1] and "frame #" not in outputs[1], outputs[1]


@pytest.mark.slow
def test_frozen_rank_is_called_frozen_and_does_not_blame_itself(tmp_path):
    """Rank 1 SIGSTOPs itself mid-step. Rank 0's collective times out; its census sees rank 1's
    process stopped (not dead). Once rank 0 has exited, rank 1 is resumed (SIGCONT): it stops in
    one line, without reporting itself as the failed rank."""
    procs, logs = _start(2, ["--mode", "stop", "--fail-step", "1", "--timeout", "8"], tmp_path)
    try:
        start = time.monotonic()
        while procs[0].poll() is None and time.monotonic() - start < DEADLINE:
            time.sleep(0.1)
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    codes, _ = _wait_all(procs, DEADLINE)
    outputs = [log.read_text() for log in logs]
    assert codes[0] == 1 and codes[1] == PEER_FAILURE_EXIT_CODE, _explain(codes, outputs)
    assert "rank 1 is frozen at step 1: its process" in outputs[0] and "did not answer" not in outputs[0], outputs[0]
    smp_lines = [line for line in outputs[1].splitlines() if line.startswith("[smp]")]
    assert len(smp_lines) == 1 and smp_lines[0].startswith("[smp] rank 1 stopping at step 1"), outputs[1]
    assert "rank 1 failed" not in outputs[1], outputs[1]


@pytest.mark.slow
def test_torchrun_root_cause_is_the_failing_rank(tmp_path):
    """torchrun names as "Root Cause" the first rank it sees fail. The stopped rank used to
    exit first (status 3) while the failing rank waited for acknowledgements, and was named."""
    code, text, _ = _torchrun(["--mode", "raise", "--fail-step", "2", "--timeout", "300"], tmp_path)
    assert code != 0, text[-6000:]
    root = text.split("Root Cause", 1)[-1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root) and re.search(r"exitcode\s*: 1 ", root), text[-6000:]


# ----------------------------------------------------------------------------------------------
# torchrun --max-restarts resumes from the latest complete checkpoint


def _losses(text: str, attempt: int) -> dict[int, str]:
    """Rank 0's printed losses of one attempt: {step: "x.xxxxxx"} (ranks' lines may interleave)."""
    found = re.findall(r"rank 0 attempt (\d+) step (\d+) loss (\d+\.\d{6})", text)
    return {int(step): loss for a, step, loss in found if int(a) == attempt}


@pytest.mark.slow
def test_torchrun_restart_resumes_from_latest_complete_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # Debris of an earlier crash that must never be taken for a checkpoint: a partial save and
    # a directory with a newer name but no commit marker.
    (ckpt / ".step_00099.partial").mkdir()
    (ckpt / "step_00098").mkdir()
    (ckpt / "step_00098" / "smp_meta.json").write_text("{}")
    args = ["--mode", "raise", "--fail-step", "2", "--steps", "4", "--ckpt", str(ckpt)]
    code, text, _ = _torchrun(args, tmp_path, max_restarts=1)
    assert code == 0, text[-6000:]
    assert "rank 1 failed at step 2" in text  # the first attempt did fail
    assert "rank 0 attempt 1 resumed from step_00001 step 1" in text, text[-6000:]
    resumed = _losses(text, attempt=1)
    assert sorted(resumed) == [2, 3], text[-6000:]  # steps 0-1 were not redone

    # Attempt 1 ran to the end and shut down without the watchdog firing (attempt 0's processes
    # were gone before it started, so every "[smp]" line after its first line would be its own).
    assert "[smp]" not in text[text.index("attempt 1"):], text[-6000:]

    # The resumed run is the uninterrupted run: same losses, to the printed digit. The
    # uninterrupted run is the same script in this process, at world 1: every rank trains on the
    # same rows, so it prints the 2-rank run's losses (a 2-rank launch cost ~10 s more).
    from tests.reliability import reliability_worker

    capsys.readouterr()
    reliability_worker.main(["--mode", "ok", "--steps", "4"])
    clean = _losses(capsys.readouterr().out, attempt=0)
    assert _losses(text, attempt=0) == {s: clean[s] for s in (0, 1)}, (text[-6000:], clean)  # the same run
    assert resumed == {s: clean[s] for s in (2, 3)}, (resumed, clean)


# ----------------------------------------------------------------------------------------------
# step_guard in one process


def test_step_guard_single_process_notes_the_step():
    with pytest.raises(ZeroDivisionError) as err:
        with smp.step_guard(5):
            1 / 0
    assert "failed at step 5" in "".join(getattr(err.value, "__notes__", []))
    assert smp.reliability.current_step() == 5


@pytest.mark.parametrize("watchdog_read_the_record", [True, False], ids=["record-read", "negative-control"])
def test_collective_failing_after_the_store_host_left_still_names_the_failing_rank(monkeypatch, watchdog_read_the_record):
    """The race a loaded CI machine hit at world 4: rank 3's watchdog read rank 1's failure record
    and acknowledged it; rank 0 (the store's host), every acknowledgement in, exited; then rank
    3's own collective failed, and its main thread, finding the store's host gone, blamed rank 0.
    The record the watchdog read is kept on the watch and named instead (negative control: with
    no record read, the store's host is what the line names, as it must be then)."""
    from smp.reliability import guard

    record = "rank 1 failed before its first step_guard: ValueError: injected setup failure on rank 1"
    watch = guard._Watch()
    watch.store = object()  # never reached: the store's host is known dead
    if watchdog_read_the_record:
        watch.record = record
    lines = []

    def stop(message, watch=None):
        lines.append(message)
        raise SystemExit(PEER_FAILURE_EXIT_CODE)

    monkeypatch.setattr(guard.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(guard.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(guard.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(guard, "_ensure_watchdog", lambda watch: None)
    monkeypatch.setattr(guard, "_store_host_died", lambda watch: True)
    monkeypatch.setattr(guard, "_stop_process", stop)
    gloo_error = RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
    assert guard._is_collective_error(gloo_error)
    with pytest.raises(SystemExit):
        guard._handle_failure(watch, gloo_error, step=0)
    if watchdog_read_the_record:
        assert lines == [f"rank 3 stopping at step 0: {record}"]
    else:
        assert len(lines) == 1 and "rendezvous store's host" in lines[0] and "rank 1" not in lines[0]


# ----------------------------------------------------------------------------------------------
# Non-finite gradients


def _model_with_grads(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=64, dim=32, hidden=64, layers=2)
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids).backward()
    return model


def test_finite_grads_pass():
    assert smp.check_finite_grads(_model_with_grads(), step=0) is True


def test_nan_names_step_parameter_and_module():
    model = _model_with_grads()
    model.layers[1].up.weight.grad[3, 4] = float("nan")
    model.head.weight.grad[0, 0] = float("inf")
    with pytest.raises(smp.NonFiniteGradientError) as err:
        smp.check_finite_grads(model, step=42)
    e = err.value
    assert e.step == 42 and e.parameters == ["layers.1.up.weight", "head.weight"]
    assert e.modules == ["layers.1.up", "head"]
    assert "at step 42" in str(e) and "layers.1.up.weight (nan)" in str(e) and "head.weight (inf)" in str(e)


def test_skip_drops_grads_so_the_step_is_a_no_op():
    model = _model_with_grads()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    model.norm.weight.grad[0] = float("-inf")
    with pytest.warns(smp.reliability.NonFiniteGradientWarning, match="step 3 .*norm.weight"):
        assert smp.check_finite_grads(model, step=3, action="skip") is False
    opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_warn_keeps_grads():
    model = _model_with_grads()
    model.embed.weight.grad[1, 1] = float("nan")
    with pytest.warns(smp.reliability.NonFiniteGradientWarning, match="embed.weight"):
        assert smp.check_finite_grads(model, step=1, action="warn") is False
    assert model.embed.weight.grad is not None and model.embed.weight.grad.isnan().any()


def test_bad_action_is_an_error():
    with pytest.raises(ValueError, match="action must be one of"):
        smp.check_finite_grads(_model_with_grads(), action="ignore")


@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "in_step_guard"])
@pytest.mark.parametrize("action", ["raise", "skip"])
def test_nonfinite_on_one_rank_is_seen_by_all(ranks, action, guarded):
    """FSDP: the NaN is in rank 1's shard only; both ranks report it and decide alike, also
    inside step_guard (an agreed error: no rank is blamed or stopped)."""
    results = ranks(2).run(reliability_cases.nonfinite_on_one_rank, bad_rank=1, param_name="layers.0.down.weight",
                           action=action, guarded=guarded)
    if action == "raise":
        for r in results:
            assert r["parameters"] == ["layers.0.down.weight"] and r["modules"] == ["layers.0.down"]
            assert "at step 7" in r["error"]
        assert results[0]["error"] == results[1]["error"]
    else:
        for r in results:
            assert r["ok"] is False and r["grads_dropped"] and r["unchanged"], r
            assert any("layers.0.down.weight" in w for w in r["warnings"])


# ----------------------------------------------------------------------------------------------
# Collective timeouts reach every mesh group


def test_config_timeout_reaches_every_mesh_group(ranks):
    """torch gives mesh sub-groups its own default (30 min on gloo), not init_process_group's;
    smp.init sets collective_timeout_seconds on each. The pool owns the default group (90 s),
    so a dim that reuses it keeps the pool's value."""
    config = {"hybrid_shard_degree": 2, "collective_timeout_seconds": 17}
    for per_rank in ranks(4).run(reliability_cases.mesh_group_timeouts, config=config):
        assert set(per_rank) == {"pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp", "dp"}  # every axis, always
        for name, (seconds, is_default) in per_rank.items():
            assert seconds == (90.0 if is_default else 17.0), (name, seconds, is_default)
        assert not per_rank["dp_shard_mod_ep"][1] and not per_rank["dp_replicate"][1]  # real sub-groups


# ----------------------------------------------------------------------------------------------
# Crash during save (SIGKILL), and checkpoint / model mismatches


@pytest.mark.slow
def test_save_killed_at_any_point_leaves_the_previous_checkpoint_latest(tmp_path):
    """5 kills at named phases of the save (before shards, before metadata, before the commit
    marker, before the rename, while deleting old ones under keep_last) and 30 at random times;
    after each, latest() is a committed checkpoint holding exactly its step's values, partial
    directories are refused by load(). See tests/reliability/reliability_crash_trials.py."""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "tests.reliability.reliability_crash_trials", str(tmp_path), "--trials", "30"],
        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE * 2,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    trials = json.loads(proc.stdout.strip().splitlines()[-1])["trials"]
    bad = [t for t in trials if not t["ok"]]
    assert not bad, bad
    by_phase = {t["phase"]: t for t in trials if t["phase"]}
    last_complete = trials[0]["step"] - 1  # saved in full before the trials
    for phase in ("before_shards", "before_meta", "before_commit_marker", "before_rename"):
        t = by_phase[phase]  # killed before the commit: the last complete checkpoint stays latest
        assert t["outcome"] == "killed" and t["claimed"] == last_complete, t
    assert by_phase["during_keep_last"]["claimed"] == by_phase["during_keep_last"]["step"]
    # The random kills really hit saves in flight (how many depends on the machine's load).
    random_mid_save = [t for t in trials if t["delay"] is not None and t["outcome"] == "killed"
                       and t["claimed"] != t["step"]]
    assert len(random_mid_save) >= 2, trials


def _tiny(**kw):
    torch.manual_seed(0)
    return TinyTransformer(**{"vocab": 32, "dim": 16, "hidden": 32, "layers": 2, **kw})


@pytest.fixture
def saved(tmp_path):
    model = _tiny()
    path = tmp_path / "step_1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smp.checkpointing.save(path, model, extra={"step": 1})
    return path


def test_model_changed_between_save_and_load_is_named(saved):
    with pytest.raises(smp.checkpointing.CheckpointError) as err:
        smp.checkpointing.load(saved, _tiny(dim=32))  # wider model: every shape differs
    assert "shape mismatches" in str(err.value) and "embed.weight" in str(err.value)
    with pytest.raises(smp.checkpointing.CheckpointError) as err:
        smp.checkpointing.load(saved, _tiny(layers=3))  # deeper model: keys missing
    assert "missing keys" in str(err.value) and "layers.2." in str(err.value)
    with pytest.raises(smp.checkpointing.CheckpointError, match="holds no optimizer state"):
        model = _tiny()
        smp.checkpointing.load(saved, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_versions_are_recorded_and_a_torch_change_is_reported(saved, caplog):
    meta_path = saved / "smp_meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["smp_version"] == smp.__version__ and meta["torch_version"] == torch.__version__
    assert meta["world_size"] == 1 and "fingerprint" in meta
    meta["torch_version"] = "1.0.0"
    meta_path.write_text(json.dumps(meta))
    with caplog.at_level("WARNING"):
        smp.checkpointing.load(saved, _tiny())
    assert "saved with torch 1.0.0" in caplog.text


def test_optimizer_changed_between_save_and_load_is_named(tmp_path):
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = torch.randint(0, 32, (2, 8))
    model(ids, labels=ids).backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smp.checkpointing.save(tmp_path / "s", model, opt)
    other = _tiny()
    with pytest.raises(smp.checkpointing.CheckpointError, match="optimizer") as err:
        smp.checkpointing.load(tmp_path / "s", other, torch.optim.AdamW(other.parameters()))
    assert "SGD" in str(err.value) and "AdamW" in str(err.value)


def test_trace_finds_the_first_module_with_a_nonfinite_output():
    model = _model_with_grads()
    ids = torch.randint(0, 64, (2, 16))
    with smp.reliability.trace_nonfinite_forward(model) as trace:
        model(ids, labels=ids)
    assert trace.first is None  # a clean forward
    with torch.no_grad():
        model.layers[1].up.weight[0, 0] = float("nan")
    with smp.reliability.trace_nonfinite_forward(model) as trace:
        model(ids, labels=ids)
    # layers.1.up completes before its parents (layers.1, the root), which are NaN too.
    assert (trace.first, trace.kind) == ("layers.1.up", "nan")
    assert not model.layers[1].up._forward_hooks  # hooks removed


@pytest.mark.parametrize("plant", ["fifo", "devzero"])
def test_planted_config_file_is_refused_fast(tmp_path, plant, capsys, monkeypatch):
    """A FIFO given as the config file made `smp check` / `smp plan` hang in open(); a link to
    /dev/zero is a character device, not a config. Refused by load_config and by the command, in
    well under a second of work, naming the file; a regular config beside it still loads."""
    from smp import cli
    from smp.config import load_config

    path = tmp_path / "smp.yaml"
    if plant == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    start = time.monotonic()
    with pytest.raises(smp.ConfigError) as e:
        load_config(str(path))
    assert time.monotonic() - start < 1, time.monotonic() - start
    kind = "FIFO" if plant == "fifo" else "character device"
    assert "smp.yaml" in str(e.value) and kind in str(e.value), e.value
    good = tmp_path / "good.yaml"
    good.write_text("backend: gloo\n")
    assert load_config(str(good)).backend == "gloo"  # negative control: a real file still loads
    # The command's own entry point, in this process (`python -m smp` is `sys.exit(cli.main())`;
    # a process per command cost ~1.4 s each).
    monkeypatch.delenv("SMP_CONFIG", raising=False)
    for command in (["check", str(path)], ["plan", str(path), "--model", "tiny", "--world-size", "2"]):
        capsys.readouterr()
        start = time.monotonic()
        code, err = cli.main(command), capsys.readouterr().err
        assert code == 2 and "smp.yaml" in err and kind in err, (command, err[-2000:])
        assert time.monotonic() - start < 1, (command, time.monotonic() - start)


@pytest.mark.slow
def test_trainer_resumes_after_rank0_died_between_commit_and_trainer_state(ranks, tmp_path):
    """Rank 0 writes trainer_state.json right after the commit; killed in between, it left a
    committed checkpoint-N without it, and train(resume_from_checkpoint=True) raised on every
    rank until a person picked an earlier checkpoint. The Trainer state is inside the commit
    (`extra`): the file is restored from it and the run continues bitwise."""
    import shutil

    from tests.integrations import trainer_cases

    first = ranks(2).run(trainer_cases.train, config={}, output_dir=str(tmp_path / "a"), save_steps=2)
    for name, drop_commit in (("b", False), ("c", True)):
        (tmp_path / name).mkdir()
        copy = tmp_path / name / "checkpoint-2"
        shutil.copytree(tmp_path / "a" / "checkpoint-2", copy)
        (copy / "trainer_state.json").unlink()
        (copy / "training_args.bin").unlink()
        if drop_commit:
            (copy / "smp_commit.json").unlink()
    resumed = ranks(2).run(trainer_cases.train, config={}, output_dir=str(tmp_path / "b"), save_steps=2, resume=True)
    assert resumed[0]["losses"] == first[0]["losses"]
    for name, p in first[0]["params"].items():
        assert torch.equal(p, resumed[0]["params"][name]), name
    assert (tmp_path / "b" / "checkpoint-2" / "trainer_state.json").exists()
    # Negative control: a folder whose save never committed is not trusted for its Trainer state.
    with pytest.raises(Exception, match="has no trainer_state.json and it is not a committed smp checkpoint"):
        ranks(2).run(trainer_cases.train, config={}, output_dir=str(tmp_path / "c"), save_steps=2, resume=True)


def test_sagemaker_parameters_have_the_config_file_bounds(monkeypatch):
    """$SM_HP_MP_PARAMETERS 50,000 levels deep raised a RecursionError, and a key given twice
    was taken silently (the last one won); the config file refuses both. A plain one loads."""
    from smp.config import load_config

    monkeypatch.delenv("SMP_CONFIG", raising=False)
    cases = {"deep": '{"a": ' * 50_000 + "1" + "}" * 50_000,
             "duplicate": '{"tensor_parallel_degree": 2, "tensor_parallel_degree": 1}'}
    for case, text in cases.items():
        monkeypatch.setenv("SM_HP_MP_PARAMETERS", text)
        with pytest.raises(smp.ConfigError) as e:
            load_config(None)
        assert "SM_HP_MP_PARAMETERS" in str(e.value) and len(str(e.value)) < 600, (case, str(e.value)[:600])
        assert ("nested deeper" if case == "deep" else "appears twice") in str(e.value), (case, e.value)
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"tensor_parallel_degree": 1}')
    assert load_config(None).tensor_parallel_degree == 1  # negative control


@pytest.mark.parametrize("key", ["moe_aux_loss_coeff", "capacity_factor"])
def test_infinite_moe_numbers_are_refused(key, tmp_path):
    """`.inf` passed `smp check`; a finite value beside it still does (negative control)."""
    from smp.config import load_config

    path = tmp_path / "moe.yaml"
    for value, ok in ((".inf", False), ("1.5", True)):
        path.write_text(f"moe:\n  {key}: {value}\n")
        if ok:
            assert getattr(load_config(str(path)).moe, key) == 1.5
        else:
            with pytest.raises(smp.ConfigError, match=key):
                load_config(str(path))


def test_cp_hybrid_message_names_the_real_reason():
    """cp 2, hybrid 3 at world 6: 3 divides 6, the problem is that 3 is not a multiple of 2."""
    from smp.config import load_config
    from smp.mesh import ParallelDims

    with pytest.raises(smp.ConfigError) as e:
        ParallelDims.from_config(load_config({"context_parallel_degree": 2, "hybrid_shard_degree": 3}), 6)
    message = str(e.value)
    assert "is not a multiple of context_parallel_degree=2" in message and "does not divide" not in message, message
    assert "[2, 6]" in message, message
    with pytest.raises(smp.ConfigError, match="hybrid_shard_degree=4 does not divide the data-parallel size 6"):
        ParallelDims.from_config(load_config({"context_parallel_degree": 2, "hybrid_shard_degree": 4}), 6)


# ----------------------------------------------------------------------------------------------
# Run ids: agreed by every rank, bounded in length, one live writer per partial folder


@pytest.mark.parametrize("where", ["init", "first_save"])
@pytest.mark.parametrize("ids", [{"0": "1764300000", "1": "1764300003"}, {"1": "only-rank-1"}],
                         ids=["differ", "one_rank"])
def test_run_ids_that_differ_between_ranks_are_refused_on_every_rank(ranks, tmp_path, where, ids):
    """`$(date +%s)` per node, or SMP_RUN_ID on one rank only: saves used to succeed, then each
    rank's latest() picked another checkpoint and the job hung until the collective timeout. Now
    smp.init (or, under plain torch.distributed, the first save) refuses on every rank in one
    line naming the values, in seconds. Negative control: the same id on both ranks passes."""
    save_dir = str(tmp_path) if where == "first_save" else None
    for r in ranks(2).run(reliability_cases.run_ids_per_rank, ids=ids, save_dir=save_dir):
        assert r["error"] and r["error"].startswith("ConfigError: the ranks name different runs"), r
        assert "\n" not in r["error"] and ("rank 1: 'only-rank-1'" in r["error"] or "'1764300003'" in r["error"]), r
        assert "export SMP_RUN_ID" in r["error"], r
        assert r["seconds"] < 10, r
    assert not list(tmp_path.iterdir())  # nothing written
    same = {"0": "run-a", "1": "run-a"}
    for r in ranks(2).run(reliability_cases.run_ids_per_rank, ids=same, save_dir=save_dir):
        assert r["error"] is None, r


def test_a_run_id_longer_than_the_bound_is_refused_early(tmp_path, monkeypatch):
    """A 70 KB SMP_RUN_ID: saves succeeded, then latest() could not read this run's markers (a
    64 KiB bound) and returned None, and the warning printed the whole id. Now smp.init and
    latest() refuse it naming the variable, quoting under 100 characters of it; an id at the
    bound saves and is found (negative control)."""
    from smp.checkpointing.commit import run

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SMP_RUN_ID", "x" * 70_000)
    with pytest.raises(smp.ConfigError) as e:
        smp.init({"backend": "gloo"})
    assert not smp.is_initialized()
    message = str(e.value)
    assert "SMP_RUN_ID is 70000 characters long" in message and len(message) < 500, message[:600]
    with pytest.raises(smp.ConfigError, match="at most 256"):
        smp.checkpointing.latest(tmp_path)
    monkeypatch.setenv("SMP_RUN_ID", "y" * run.MAX_RUN_ID_CHARS)
    with smp.session({"backend": "gloo"}):
        smp.checkpointing.save(tmp_path / "step_1", _tiny())
        assert smp.checkpointing.latest(tmp_path) == str(tmp_path / "step_1")


def _live_process():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_live_writer_of_the_same_run_id_is_refused_not_deleted(tmp_path, monkeypatch):
    """Two live runs with one SMP_RUN_ID in one root (unsupported): the second deleted the
    first's partial folder (same run id: "a crashed save's leftover") and both wrote into one
    folder that committed damaged. Now a partial folder a live process of this host writes is
    refused naming it and left alone; the leftover of a dead process is still cleared (negative
    control: a restarted run is not blocked)."""
    from smp.checkpointing.commit import atomic

    monkeypatch.setenv("SMP_RUN_ID", "shared")
    other = _live_process()
    try:
        partial = tmp_path / ".step_1.partial"
        partial.mkdir()
        marker = {"run_id": "shared", "host": __import__("socket").gethostname(), "pid": other.pid,
                  "started": atomic._process_start(other.pid)}
        (partial / "smp_partial.json").write_text(json.dumps(marker))
        (partial / "__0_0.distcp").write_text("the other run's shard")
        with pytest.raises(smp.checkpointing.CheckpointError) as e:
            smp.checkpointing.save(tmp_path / "step_1", _tiny())
        assert f"pid {other.pid}" in str(e.value) and "another live process of this run" in str(e.value), e.value
        assert (partial / "__0_0.distcp").exists()  # not deleted
        assert smp.checkpointing.latest(tmp_path) is None
    finally:
        other.kill()
        other.wait()
    smp.checkpointing.save(tmp_path / "step_1", _tiny())  # the dead writer's leftover is cleared
    assert smp.checkpointing.latest(tmp_path) == str(tmp_path / "step_1")


def test_a_partial_folder_taken_over_mid_save_is_not_committed(tmp_path, monkeypatch):
    """Commit checks that the partial folder's marker still names this process: one that another
    process replaced (holding both processes' files) is refused and never looks committed."""
    from smp.checkpointing.commit import atomic

    other = _live_process()
    try:
        path = str(tmp_path / "step_1")
        tmp = atomic.prepare(path, "shared")
        atomic.commit(path, run_id="shared")  # negative control: its own folder commits
        assert atomic.is_committed(path)
        path2 = str(tmp_path / "step_2")
        tmp = atomic.prepare(path2, "shared")
        marker = json.loads(open(os.path.join(tmp, "smp_partial.json")).read())
        marker["pid"] = other.pid
        open(os.path.join(tmp, "smp_partial.json"), "w").write(json.dumps(marker))
        with pytest.raises(FileExistsError, match=f"pid {other.pid}"):
            atomic.commit(path2, run_id="shared")
        assert not os.path.exists(path2) and not atomic.is_committed(tmp)
    finally:
        other.kill()
        other.wait()


def _smp_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[smp]")]


@pytest.mark.slow
def test_a_wrapped_error_is_reported_by_its_cause_once_per_rank(tmp_path):
    """torch's pipeline raises "[Stage 1] failed to run forward:" (multi-line) from the stage's
    own error; the one-line [smp] message kept only that line, and rank 0 printed its stop line
    twice (its main thread and its watchdog both reached the stop). Now the line names the
    innermost cause, and each rank prints one [smp] line."""
    codes, outputs, _ = _launch(2, ["--mode", "chained", "--fail-step", "1", "--timeout", "300"], tmp_path)
    assert codes[1] == 1 and codes[0] == PEER_FAILURE_EXIT_CODE, _explain(codes, outputs)
    cause = "(caused by ValueError: injected failure on rank 1 at step 1)"
    own, stop = _smp_lines(outputs[1]), _smp_lines(outputs[0])
    assert len(own) == 1 and "RuntimeError: [Stage 1] failed to run forward:" in own[0] and cause in own[0], own
    assert len(stop) == 1 and stop[0].startswith("[smp] rank 0 stopping at step 1") and cause in stop[0], outputs[0]


def test_describe_names_the_innermost_cause():
    """The one-line description (negative control: an unchained error stays as it was)."""
    from smp.reliability.guard import _describe

    try:
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise RuntimeError("\n  outer\n  more") from e
    except RuntimeError as e:
        assert _describe(e) == "RuntimeError: outer (caused by KeyError: 'inner')"
    assert _describe(ValueError("plain\nsecond")) == "ValueError: plain"


@pytest.mark.slow
def test_an_error_before_the_first_step_guard_is_an_error_not_a_death(tmp_path):
    """World 4: rank 1 raises while setting up, the others are in step 0. They described it as
    a rank that "died without a Python error (killed, OOM, segfault)", plus a census line about
    a peer that was itself taking the census. Now rank 1 reports its error (smp.init installs
    the report for errors outside every step_guard) and every other rank stops naming it."""
    codes, outputs, elapsed = _launch(4, ["--mode", "setup", "--timeout", "300"], tmp_path)
    assert None not in codes, _explain(codes, outputs)
    assert codes[1] == 1 and all(codes[r] == PEER_FAILURE_EXIT_CODE for r in (0, 2, 3)), _explain(codes, outputs)
    record = "rank 1 failed before its first step_guard: ValueError: injected setup failure on rank 1"
    assert record in outputs[1], outputs[1]
    for r in (0, 2, 3):
        assert any(record in line for line in _smp_lines(outputs[r])), _explain(codes, outputs)
        assert "did not answer" not in outputs[r] and "not in a collective" not in outputs[r], outputs[r]
    assert elapsed < DEADLINE


def test_the_uncaught_error_report_lives_with_the_session():
    """smp.init installs the report of errors outside every step_guard as sys.excepthook;
    smp.shutdown puts the previous hook back (importing smp changes nothing)."""
    from smp.reliability.guard import _UncaughtErrors

    with smp.session({"backend": "gloo"}):
        hook = sys.excepthook
        assert isinstance(hook, _UncaughtErrors)
    assert sys.excepthook is hook.previous  # (init_process_group installs torch's own before it)
