"""Bad config input and bad `smp` flags: one short line naming the file, key or flag, exit status
2, within a second, in bounded memory; never a traceback, a hang or an echo of the input."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from smp import cli
from smp.config import load_config
from smp.config_file import MAX_CONFIG_BYTES
from smp.errors import ConfigError
from smp.seeding import seed_everything
from tests import REPO_ROOT

ROOT = REPO_ROOT
# Every message smp prints about bad input stays this short, however large the input.
MAX_MESSAGE = 500
# Time bounds are CPU seconds, not wall seconds: the tests share a loaded machine, and a bomb
# that expands costs CPU (the 10**9 one ran for minutes), which is what they must catch.
MAX_CPU_SECONDS = 1.0


def _alias_bomb(levels: int = 9) -> str:
    """10**levels strings from ~60 bytes per level (561 bytes at 9 levels: 10**9 "lol"s)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        ref = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{','.join([ref] * 10)}]")
    lines.append(f"shard_modules: *a{levels - 1}")
    return "\n".join(lines) + "\n"


def _config_error(path: Path) -> str:
    start = time.process_time()
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert time.process_time() - start < MAX_CPU_SECONDS
    message = str(err.value)
    assert len(message) < MAX_MESSAGE and "\n" not in message, message
    return message


def test_yaml_alias_bomb_is_refused_fast(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9))
    assert len(path.read_bytes()) < 600
    message = _config_error(path)
    assert "bomb.yaml" in message and "aliases" in message


def test_small_yaml_aliases_still_work(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("tensor_parallel:\n  plan: {layers.*.up: &col colwise, layers.*.gate: *col}\n")
    assert load_config(str(path)).tensor_parallel.plan == {"layers.*.up": "colwise", "layers.*.gate": "colwise"}


def test_directory_as_config(tmp_path):
    folder = tmp_path / "conf.yaml"
    folder.mkdir()
    message = _config_error(folder)
    assert "conf.yaml" in message and "directory" in message


def test_non_utf8_config_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("random_seed: 1\nbackend: gl\xf6o\n".encode("latin-1"))
    message = _config_error(path)
    assert "latin1.yaml" in message and "UTF-8" in message and "line 2" in message


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_deep_nesting_is_an_error_not_a_recursion_error(tmp_path, suffix):
    path = tmp_path / f"deep.{suffix}"
    depth = 100_000
    path.write_text('{"shard_modules": ' + "[" * depth + "]" * depth + "}")
    message = _config_error(path)
    assert f"deep.{suffix}" in message and "nested deeper" in message


@pytest.mark.parametrize("suffix,text", [
    ("yaml", "random_seed: 1\nbackend: gloo\nrandom_seed: 2\n"),
    ("json", '{"random_seed": 1, "backend": "gloo", "random_seed": 2}'),
])
def test_duplicate_keys_are_refused(tmp_path, suffix, text):
    path = tmp_path / f"dup.{suffix}"
    path.write_text(text)
    message = _config_error(path)
    assert f"dup.{suffix}" in message and "'random_seed' appears twice" in message


def test_oversized_config_file(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * MAX_CONFIG_BYTES + "\n")
    message = _config_error(path)
    assert "big.yaml" in message and "larger than 1 MiB" in message


def test_random_seed_is_bounded_to_what_torch_takes():
    with pytest.raises(ConfigError, match="random_seed") as err:
        load_config({"random_seed": 2**100})
    assert len(str(err.value)) < MAX_MESSAGE
    largest = load_config({"random_seed": 2**64 - 1}).random_seed
    seed_everything(largest)  # the bound is exactly what smp.init can seed with


def test_error_messages_never_echo_large_input():
    with pytest.raises(ConfigError) as err:
        load_config({"backend": "g" * 10**6})
    assert "'backend'" in str(err.value) and len(str(err.value)) < MAX_MESSAGE
    with pytest.raises(ConfigError) as err:
        load_config({"k" * 10**6: 1})
    assert "unknown key" in str(err.value) and len(str(err.value)) < MAX_MESSAGE
    with pytest.raises(ConfigError) as err:  # 10**5 bad list items: counted, not listed
        load_config({"shard_modules": list(range(10**5))})
    assert "more errors" in str(err.value) and len(str(err.value)) < 10 * MAX_MESSAGE


# ----------------------------------------------------------------------------------------------
# smp check / smp plan flags


def _cli(capsys, *argv: str) -> tuple[int, str]:
    start = time.process_time()
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    assert time.process_time() - start < MAX_CPU_SECONDS, argv
    err = capsys.readouterr().err
    assert err.count("\n") <= 1 and len(err) < MAX_MESSAGE, err
    return rc, err


@pytest.mark.parametrize("argv,flag", [
    (["check", "--world-size", "0"], "--world-size"),
    (["check", "--world-size", "-3"], "--world-size"),
    (["plan", "--model", "tiny", "--world-size", "1000000000"], "--world-size"),
    (["plan", "--model", "tiny", "--world-size", "0"], "--world-size"),
    (["plan", "--model", "tiny", "-w", "2", "--device-memory", "-1"], "--device-memory"),
    (["plan", "--model", "tiny", "-w", "2", "--device-memory", "nan"], "--device-memory"),
    (["plan", "--model", "tiny", "-w", "2", "--device-memory", "inf"], "--device-memory"),
    (["plan", "--model", "tiny", "-w", "2", "--seq-len", "0"], "--seq-len"),
    (["plan", "--model", "tiny", "-w", "2", "--batch", "-1"], "--batch"),
    (["plan", "--model", "tiny", "-w", "2", "--rank", "-1"], "--rank"),
])
def test_bad_flags_are_one_line_and_status_2(capsys, tmp_path, argv, flag):
    cfg = tmp_path / "smp.yaml"
    cfg.write_text("random_seed: 1\n")
    if argv[0] == "check":
        argv = ["check", str(cfg), *argv[1:]]
    rc, err = _cli(capsys, *argv)
    assert rc == 2 and flag in err, err


def test_cli_config_errors_are_one_line(capsys, tmp_path):
    cfg = tmp_path / "seed.yaml"
    cfg.write_text(f"random_seed: {2**100}\nbackend: gloo\n")
    rc, err = _cli(capsys, "check", str(cfg))
    assert rc == 2 and "random_seed" in err


@pytest.mark.parametrize("case", ["bomb", "directory", "duplicate"])
def test_smp_check_subprocess_bad_config(tmp_path, case):
    """The real command, in bounded CPU time and memory (importing smp and torch is most of both:
    ~2 CPU seconds, ~0.5 GiB; the 10**8 bomb took 2.3 GiB and printed 722 MB)."""
    path = tmp_path / "smp.yaml"
    if case == "bomb":
        path.write_text(_alias_bomb(9))
    elif case == "directory":
        path.mkdir()
    else:
        path.write_text("backend: gloo\nbackend: nccl\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SMP_CONFIG", None)
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "smp", "check", str(path)], stdout=subprocess.DEVNULL,
                                stderr=err_file, env=env, cwd=tmp_path)
    usage = _wait_with_usage(proc, timeout=120)
    assert usage.ru_utime + usage.ru_stime < 10, usage
    assert usage.ru_maxrss < 1_500_000, usage  # KiB
    stderr = err_path.read_text()
    assert proc.returncode == 2, stderr[-2000:]
    assert stderr.count("\n") == 1 and len(stderr) < MAX_MESSAGE, stderr[-2000:]
    assert "smp.yaml" in stderr and "Traceback" not in stderr


def _wait_with_usage(proc: subprocess.Popen, timeout: float) -> resource.struct_rusage:
    """Wait for `proc` (killed at `timeout`) and return its own CPU time and peak memory."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.args} still running after {timeout} s")
        time.sleep(0.05)
