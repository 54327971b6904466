"""The `smp` command: run (exec torchrun), check (validate + recipe), plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from smp import cli
from smp.config import ConfigError, load_config
from smp.mesh import ParallelDims
from tests import REPO_ROOT

ROOT = str(REPO_ROOT)


def _main(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_builds_a_torchrun_command(capsys):
    rc, out, _ = _main(capsys, "run", "-n", "2", "--dry-run", "train.py", "--config", "x.yaml", "-n", "7", "--dry-run")
    assert rc == 0
    argv = out.split()
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in argv and "--standalone" in argv
    # Everything after the script is the script's, even flags that look like ours.
    assert argv[argv.index("train.py"):] == ["train.py", "--config", "x.yaml", "-n", "7", "--dry-run"]


def test_run_passes_multi_host_flags_through(capsys):
    rc, out, _ = _main(capsys, "run", "-n", "8", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                       "head:29500", "--dry-run", "train.py")
    argv = out.split()
    assert rc == 0 and "--standalone" not in argv
    assert argv[argv.index("--nnodes"):] == ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29500",
                                             "train.py"]
    rc, _, err = _main(capsys, "run", "-n", "2", "--dry-run")
    assert rc == 2 and "name the training script" in err
    rc, out, _ = _main(capsys, "run", "-n", "2", "--dry-run", "-m", "pkg.train", "-n", "5")
    assert out.split()[-4:] == ["-m", "pkg.train", "-n", "5"]  # torchrun's module mode


@pytest.mark.slow
def test_run_launches_ranks_through_torchrun(tmp_path):
    script = tmp_path / "show_env.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SMP_CONFIG"]
        with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
            json.dump({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[2:]}, f)
    """))
    cfg = tmp_path / "smp.yaml"
    cfg.write_text("hybrid_shard_degree: 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "smp.cli", "run", "-n", "2", "--smp-config", str(cfg), str(script), str(tmp_path),
         "--steps", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["RANK"] for s in seen] == ["0", "1"] and {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert all(s["TORCHELASTIC_RUN_ID"] for s in seen)  # set by torchrun's elastic agent
    assert {s["SMP_CONFIG"] for s in seen} == {str(cfg)}
    assert seen[0]["argv"] == ["--steps", "3"]


def test_check_prints_mesh_and_recipe(capsys):
    rc, out, _ = _main(capsys, "check", os.path.join(ROOT, "examples/configs/hybrid.yaml"), "--world-size", "8")
    assert rc == 0
    assert "world 8 = dp_replicate 4 x dp_shard 2 x tp 1" in out
    assert "hybrid: shard inside groups of 2, replicate across 4" in out
    assert "param dtype bf16" in out


def test_check_errors_are_smp_init_errors(capsys, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("hybrid_shard_degree: 3\n")
    rc, _, err = _main(capsys, "check", str(cfg), "--world-size", "8")
    with pytest.raises(ConfigError) as expected:  # what smp.init raises for the same input
        ParallelDims.from_config(load_config(str(cfg)), 8)
    assert rc == 2 and str(expected.value) in err
    cfg.write_text("hybird_shard_degree: 2\n")
    rc, _, err = _main(capsys, "check", str(cfg))
    assert rc == 2 and "did you mean 'hybrid_shard_degree'" in err
    rc, _, err = _main(capsys, "check", str(tmp_path / "missing.yaml"))
    assert rc == 2 and "does not exist" in err


def test_check_schema(capsys):
    rc, out, _ = _main(capsys, "check", "--schema")
    assert rc == 0 and "hybrid_shard_degree" in json.loads(out)["properties"]


def test_plan_json_and_suggestion(capsys):
    rc, out, _ = _main(capsys, "plan", "--model", "tiny", "--world-size", "4", "--seq-len", "16", "--json")
    assert rc == 0
    plan = json.loads(out)["plan"]
    assert plan["world_size"] == 4 and plan["param_bytes"] > 0 and plan["comm_bytes"]["total"] > 0
    # A memory limit below the replicate plan but above full shard: the suggestion shards.
    limit_gib = plan["device_bytes"] * 1.2 / 2**30
    rc, out, _ = _main(capsys, "plan", "--model", "tiny", "-w", "4", "--seq-len", "16", "--json",
                       "--device-memory", f"{limit_gib:.9f}", "--suggest")
    result = json.loads(out)
    assert rc == 0 and result["fits"] is True
    degrees = result["suggestion"]["degrees"]
    assert degrees["tensor_parallel_degree"] == 1 and degrees["hybrid_shard_degree"] in (2, 0)
    assert result["suggestion"]["device_bytes"] <= limit_gib * 2**30


def test_plan_model_folder_without_config(capsys, tmp_path):
    rc, _, err = _main(capsys, "plan", "--model", str(tmp_path), "-w", "2")
    assert rc == 2 and "has no config.json" in err


def test_check_with_model_runs_transform(capsys, tmp_path):
    """Errors only transform can find (here: heads that TP cannot split) surface in `smp check`."""
    cfg = tmp_path / "tp.yaml"
    cfg.write_text("tensor_parallel_degree: 4\n")
    rc, out, err = _main(capsys, "check", str(cfg), "-w", "4", "--model", "tiny")
    assert rc == 2 and "tensor_parallel_degree" in err  # tiny has 2 key/value heads
    rc, out, _ = _main(capsys, "check", os.path.join(ROOT, "examples/configs/full_shard.yaml"), "-w", "4",
                       "--model", "tiny")
    assert rc == 0 and "smp.transform on 'tiny' at world size 4: ok" in out
