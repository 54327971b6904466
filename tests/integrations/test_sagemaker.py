"""smp.sagemaker: an SMP v2 script ported by replacing `torch.sagemaker` with `smp.sagemaker`.

The ported example script (examples/smp_v2_style/train.py: meta-device model, DelayedParamIniter,
transform, clip_grad_norm_, SMP-style data-parallel rank arithmetic, config from
$SM_HP_MP_PARAMETERS) trains like the same loop on smp's native API (eager model): measured
difference 0 at world 2 (TP 2) and world 4 (HSDP 2x2); we assert 1e-5. A different init seed
moves the losses by ~1e-2, which the same check catches.
"""

from __future__ import annotations

import json
import warnings

import pytest
import smp
import smp.sagemaker as tsm
from smp.config import load_config
from smp.mesh import ParallelDims
from smp.sagemaker import MigrationError, NotSupportedBySmp
from tests.integrations import sagemaker_cases as cases

# These tests run SMP v2 configs on purpose: the differences smp reports for them are expected
# here (the tests that check those reports record them themselves).
pytestmark = pytest.mark.filterwarnings("ignore::smp.sagemaker.SMPv2DifferenceWarning")

TOL = 1e-5
ARGV = ["--max_steps", "2"]


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    monkeypatch.delenv("SMP_CONFIG", raising=False)
    return monkeypatch


# --- the ported script --------------------------------------------------------------------------

@pytest.mark.parametrize("world, mp_parameters, mesh", [
    (2, {"tensor_parallel_degree": 2, "sm_activation_offloading": False}, [1, 1, 1, 1, 1, 2]),
    (4, {"hybrid_shard_degree": 2, "sm_activation_offloading": False}, [1, 2, 2, 1, 1, 1]),
], ids=["world2-tp2", "world4-hsdp2x2"])
def test_ported_script_trains_like_the_native_api(ranks, world, mp_parameters, mesh):
    pool = ranks(world)
    ported = pool.run(cases.ported_script, mp_parameters=json.dumps(mp_parameters), argv=ARGV)
    native = pool.run(cases.native_training, config=mp_parameters, argv=ARGV)
    assert all(r["mesh"] == mesh for r in ported), ported  # the config came from the environment
    for r, losses in zip(ported, native):
        assert len(r["losses"]) == 2
        assert max(abs(a - b) for a, b in zip(r["losses"], losses)) <= TOL, (r["losses"], losses)


def test_comparison_catches_a_different_init(ranks):
    """Negative control: another random_seed (another init) moves the losses past the tolerance."""
    pool = ranks(2)
    config = {"sm_activation_offloading": False}
    ported = pool.run(cases.ported_script, mp_parameters=json.dumps(config), argv=ARGV)
    native = pool.run(cases.native_training, config={**config, "random_seed": 1}, argv=ARGV)
    assert max(abs(a - b) for a, b in zip(ported[0]["losses"], native[0])) > 100 * TOL


def test_sm_hp_mp_parameters_changes_the_mesh(ranks):
    """Negative control for the delivery: the same script without the variable runs pure data
    parallel; with {"tensor_parallel_degree": 2} it runs TP 2 (and SMP's dp_rank arithmetic
    agrees with smp's)."""
    pool = ranks(2)
    plain = pool.run(cases.ported_script, mp_parameters=None, argv=["--max_steps", "1"])
    tp = pool.run(cases.ported_script, mp_parameters='{"tensor_parallel_degree": 2}', argv=["--max_steps", "1"])
    assert [r["mesh"] for r in plain] == [[1, 1, 2, 1, 1, 1]] * 2 and [r["dp_rank"] for r in plain] == [0, 1]
    assert [r["mesh"] for r in tp] == [[1, 1, 1, 1, 1, 2]] * 2 and [r["dp_rank"] for r in tp] == [0, 0]


def test_async_save_and_load_resume_the_script(ranks, tmp_path):
    pool = ranks(2)
    config = json.dumps({"sm_activation_offloading": False})
    ckpt = ["--checkpoint_dir", str(tmp_path), "--checkpoint_freq", "2", "--max_steps", "4"]
    full = pool.run(cases.ported_script, mp_parameters=config, argv=ckpt)
    resumed = pool.run(cases.ported_script, mp_parameters=config,
                       argv=["--max_steps", "4", "--resume_from_checkpoint", str(tmp_path / "step_2")])
    for f, r in zip(full, resumed):
        assert r["losses"] == f["losses"][2:], (f, r)  # same world: bitwise


def test_load_state_dict_from_rank0(ranks):
    """Rank 0's weights reach every shard, from meta ranks (the SMP v2 use) and from ranks that
    built other weights; without the flag the latter keep their own (negative control)."""
    assert ranks(2).run(cases.rank0_weights, load_from_rank0=True, others_meta=True)[0] == 0.0
    assert ranks(2).run(cases.rank0_weights, load_from_rank0=True, others_meta=False)[0] == 0.0
    assert ranks(2).run(cases.rank0_weights, load_from_rank0=False, others_meta=False)[0] > 1e-3


# --- smp.state's SMP names --------------------------------------------------------------------

def test_state_names_on_hybrid_sharding(ranks):
    results = ranks(4).run(cases.state_names, config={"hybrid_shard_degree": 2, "sm_activation_offloading": True})
    for rank, r in enumerate(results):
        assert r["same_run"] and r["core_lacks_v2_names"]
        assert r["degrees"] == [1, 1, 1, 2] and r["offloading"] is True
        assert r["cp"] == [0, 1, None] and r["ep"] == [0, 1]
        assert r["tp_group"] == [rank] and r["world_group"] == [0, 1, 2, 3]
        # mesh (dp_replicate 2, dp_shard 2): replica r//2 holds ranks {0,1} or {2,3}; the ranks
        # holding the same shard across replicas (a replication group) are {0,2} and {1,3}.
        assert r["rep_rank"] == rank // 2 and r["rep_rank_of_3"] == 1
        assert r["rep_group"] == [0, 1] if rank < 2 else [2, 3]
        assert r["rep_groups"] == [[0, 2], [1, 3]] and r["shard_groups"] == [[0, 1], [2, 3]]
        assert r["tp_groups"] == [[0], [1], [2], [3]]
        assert "read-only" in r["assign_error"] and r["tp_after_assign"] == 1
        assert "migrating-from-smp-v2.md#state" in r["ranker_error"]


def test_state_names_with_tensor_parallel(ranks):
    results = ranks(4).run(cases.state_names, config={"tensor_parallel_degree": 2, "hybrid_shard_degree": 1})
    for rank, r in enumerate(results):
        assert r["degrees"] == [2, 1, 1, 1]
        assert r["tp_group"] == ([0, 1] if rank < 2 else [2, 3])
        assert r["rep_groups"] == [[0, 2], [1, 3]] and r["rep_group"] == r["tp_group"]


def test_state_is_read_only_before_init():
    with pytest.raises(AttributeError, match="read-only"):
        smp.state.tensor_parallel_degree = 2
    with pytest.raises(AttributeError, match="read-only.*SM_HP_MP_PARAMETERS"):
        tsm.state.tensor_parallel_degree = 1  # SMP v2 scripts' non-SMP path: set the config instead
    with pytest.raises(AttributeError, match="read-only"):
        del smp.state.rank


# --- config delivery --------------------------------------------------------------------------

def test_sm_hp_mp_parameters_is_read(clean_env):
    clean_env.setenv("SM_HP_MP_PARAMETERS", '{"tensor_parallel_degree": 2, "activation_loading_horizon": 4}')
    cfg = load_config(None)
    assert cfg.tensor_parallel_degree == 2 and cfg.activation_loading_horizon == 4


def test_sm_hp_mp_parameters_and_smp_config(clean_env, tmp_path):
    path = tmp_path / "smp.json"
    path.write_text('{"tensor_parallel_degree": 2}')
    clean_env.setenv("SMP_CONFIG", str(path))
    clean_env.setenv("SM_HP_MP_PARAMETERS", '{"tensor_parallel_degree": 2}')
    assert load_config(None).tensor_parallel_degree == 2  # both say the same: fine
    clean_env.setenv("SM_HP_MP_PARAMETERS", '{"tensor_parallel_degree": 4}')
    with pytest.raises(smp.ConfigError, match="SM_HP_MP_PARAMETERS.*SMP_CONFIG"):
        load_config(None)


@pytest.mark.parametrize("raw, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"tensor_parallel_degre": 2}', "(?s)SM_HP_MP_PARAMETERS.*did you mean 'tensor_parallel_degree'"),
])
def test_sm_hp_mp_parameters_errors(clean_env, raw, match):
    clean_env.setenv("SM_HP_MP_PARAMETERS", raw)
    with pytest.raises(smp.ConfigError, match=match):
        load_config(None)


# --- what smp does not do the SMP way ---------------------------------------------------------

@pytest.mark.parametrize("lookup, section", [
    (lambda: tsm.pipeline, "#names"),
    (lambda: __import__("smp.sagemaker.nn.attn", fromlist=["FlashSelfAttention"]).FlashSelfAttention, "#flash-attention"),
    (lambda: __import__("smp.sagemaker.nn.huggingface.llama_flashattn", fromlist=["x"]).LlamaFlashAttention, "#flash-attention"),
    (lambda: __import__("smp.sagemaker.distributed.checkpoint.state_dict_utils", fromlist=["x"]).sm_state_dict_type, "#checkpoints"),
    (lambda: tsm.utils.utils.some_helper, "#names"),
], ids=["top-level", "flash-attn", "llama-flash-attn", "sm_state_dict_type", "utils"])
def test_unimplemented_names_point_at_the_guide(lookup, section):
    with pytest.raises(NotImplementedError, match=f"migrating-from-smp-v2.md{section}") as info:
        lookup()
    assert isinstance(info.value, (NotSupportedBySmp, smp.Error))


def test_moe_config_is_smps_moe_section():
    from smp.sagemaker.moe.moe_config import MoEConfig

    assert MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=0.01).moe.moe_aux_loss_coeff == 0.01
    with pytest.raises(smp.ConfigError, match="sinkhorn"):
        MoEConfig(smp_moe=True, moe_load_balancing="sinkhorn")  # SMP v2's default: not in smp


def test_fsdp1_wrap_of_a_transformed_model_says_what_to_change(clean_env):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from smp.testing.models import TinyTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tsm.SMPv2DifferenceWarning)
        tsm.init({"sm_activation_offloading": False})
    try:
        model = tsm.transform(TinyTransformer())
        with pytest.raises(MigrationError, match="delete that call.*migrating-from-smp-v2.md#fsdp-wrapping"):
            FSDP(model, use_orig_params=True)
        with pytest.raises(MigrationError, match="#transform"):
            tsm.transform(TinyTransformer(), device="meta")
        with pytest.raises(NotImplementedError, match="#transform"):
            tsm.transform(TinyTransformer(), config={"tensor_parallel_degree": 2})
        with pytest.raises(ValueError, match="cp_comm_type"):
            tsm.transform(TinyTransformer(), cp_comm_type="ring")
        from smp.sagemaker.moe.moe_config import MoEConfig

        with pytest.raises(smp.ConfigError, match="under `moe:`.*migrating-from-smp-v2.md#moe"):
            tsm.transform(TinyTransformer(), config=MoEConfig(moe_load_balancing="none"))
        tsm.transform(TinyTransformer(), config=MoEConfig())  # the same as the init config: fine
    finally:
        smp.shutdown()


def test_differences_are_warned_once(clean_env):
    from smp.sagemaker import _session

    cfg = load_config({"allow_empty_shards": False})
    keys = [key for key, _ in _session.config_differences(cfg, ParallelDims.from_config(cfg, 4))]
    assert keys == ["hybrid_shard_degree", "sm_activation_offloading", "allow_empty_shards"]
    quiet = load_config({"hybrid_shard_degree": 2, "sm_activation_offloading": True})
    assert _session.config_differences(quiet, ParallelDims.from_config(quiet, 4)) == []
    floor = load_config({"activation_offloading": True, "hybrid_shard_degree": 2})  # smp's key: smp's 1 MiB floor
    assert [k for k, _ in _session.config_differences(floor, ParallelDims.from_config(floor, 4))] == [
        "activation_offload_min_bytes"]
    _session._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            tsm.init({})
            smp.shutdown()
    messages = [str(w.message) for w in caught if w.category is tsm.SMPv2DifferenceWarning]
    assert len(messages) == 1 and "sm_activation_offloading is not set" in messages[0]


def test_smp_v2_offloading_key_offloads_every_activation():
    """A config in SMP v2's terms offloads as SMP v2 does (every saved activation); smp's own key
    keeps smp's size floor; an explicit floor wins."""
    assert load_config({"sm_activation_offloading": True}).activation_offload_min_bytes == 0
    assert load_config({"activation_offloading": True}).activation_offload_min_bytes == 1 << 20
    assert load_config({"sm_activation_offloading": True, "activation_offload_min_bytes": 7}).activation_offload_min_bytes == 7


# --- SMP v2 names a script imports ------------------------------------------------------------

@pytest.mark.parametrize("module, section", [
    ("smp.sagemaker.pipeline", "#names"),
    ("smp.sagemaker.distributed.checkpoint.megatron_utils", "#checkpoints"),
    ("smp.sagemaker.nn.huggingface.gpt_neox_flashattn.deeper", "#flash-attention"),
    ("smp.sagemaker.tensor_parallel.embedding", "#transform"),
])
def test_missing_modules_point_at_the_guide(module, section):
    import importlib

    with pytest.raises(NotSupportedBySmp, match=f"migrating-from-smp-v2.md{section}"):
        importlib.import_module(module)


def test_names_an_smp_v2_script_imports():
    from smp.sagemaker.checkpoint.utils import SORT_BY_LAST_INT, limit_num_subdirs  # noqa: F401
    from smp.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
    from smp.sagemaker.distributed.checkpoint.state_dict_saver import PyTorchDistSaveShardedStrategy
    from smp.sagemaker.moe.moe_layer import MoELayer
    from smp.sagemaker.tensor_parallel.transformer import TETransformerLayer, TransformerLayer

    assert AsyncCallsQueue().get_num_unfinalized_calls() == 0
    PyTorchDistSaveShardedStrategy("torch_dist", 1)
    for cls in (TransformerLayer, TETransformerLayer, MoELayer):
        with pytest.raises(NotSupportedBySmp):
            cls()


def test_torch_sagemaker_alias_is_opt_in():
    import subprocess
    import sys

    code = ("import smp.sagemaker.as_torch_sagemaker, smp.sagemaker, torch.sagemaker as tsm; "
            "from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue; "
            "from torch.sagemaker import state; print(tsm is smp.sagemaker, state is smp.sagemaker.state)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
    plain = subprocess.run([sys.executable, "-c", "import smp.sagemaker, torch.sagemaker"], capture_output=True, text=True)
    assert plain.returncode != 0 and "ModuleNotFoundError" in plain.stderr


def test_limit_num_subdirs_keeps_the_newest(tmp_path):
    from smp.sagemaker.checkpoint.utils import SORT_BY_LAST_INT, limit_num_subdirs

    for step in (2, 10, 4, 8):
        (tmp_path / f"llama_v3-{step}steps" / "tp2-0").mkdir(parents=True)
    (tmp_path / "notes").mkdir()
    regex = r"^.*\d+steps$"
    # from a per-rank folder inside the newest checkpoint, as SMP v2 scripts call it; log=False: no-op
    inner = tmp_path / "llama_v3-10steps" / "tp2-0"
    assert limit_num_subdirs(inner, 2, sort_fn=SORT_BY_LAST_INT, regex=regex, log=False) == []
    limit_num_subdirs(inner, 2, sort_fn=SORT_BY_LAST_INT, regex=regex, log=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama_v3-10steps", "llama_v3-8steps", "notes"]


def test_fsdp1_patch_lives_with_the_session(clean_env):
    import subprocess
    import sys

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.optimizer as dcp_optimizer

    torch_methods = {n: FSDP.__dict__[n] for n in ("__init__", "state_dict_type", "optim_state_dict")}
    torch_dcp = {n: getattr(dcp, n) for n in ("save_state_dict", "load_state_dict")}
    # what torch's load_sharded_optimizer_state_dict calls to find and cut over its group
    loader_group = {n: getattr(dcp_optimizer, n) for n in ("_get_state_dict_2d_layout", "_create_chunk_sharded_tensor")}
    tsm.init({"sm_activation_offloading": False})
    try:
        assert all(FSDP.__dict__[n] is not m for n, m in torch_methods.items())
        assert all(getattr(dcp, n) is not f for n, f in torch_dcp.items())
        assert all(getattr(dcp_optimizer, n) is not f for n, f in loader_group.items())
    finally:
        smp.shutdown()
    assert all(FSDP.__dict__[n] is m for n, m in torch_methods.items())
    assert all(getattr(dcp, n) is f for n, f in torch_dcp.items())
    assert all(getattr(dcp_optimizer, n) is f for n, f in loader_group.items())
    code = ("import torch.distributed.checkpoint.optimizer as o; "
            "names = ('_get_state_dict_2d_layout', '_create_chunk_sharded_tensor'); "
            "before = [getattr(o, n) for n in names]; "
            "import smp, smp.sagemaker; from torch.distributed.fsdp import FullyShardedDataParallel as F; "
            "print(F.__init__.__module__, F.__dict__['optim_state_dict'].__func__.__module__, "
            "[getattr(o, n) for n in names] == before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["torch.distributed.fsdp.fully_sharded_data_parallel"] * 2 + ["True"]


def test_session_ends_after_the_script_destroyed_its_process_group(tmp_path):
    """SMP v2 scripts end with dist.destroy_process_group() and never call smp.shutdown: the exit
    handler tsm.init registers then shuts the session down without an error (it used to fail
    resolving the destroyed mesh groups) and torch's FSDP1 gets its methods back."""
    import subprocess
    import sys

    code = (
        "import torch.distributed as dist, smp, smp.sagemaker as tsm\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "tsm.init({'sm_activation_offloading': False})\n"
        "dist.destroy_process_group()\n"
        "smp.shutdown()\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as F\n"
        "print('ended', F.__dict__['optim_state_dict'].__func__.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ended", "torch.distributed.fsdp.fully_sharded_data_parallel"], out
    assert "smp: " not in out.stderr, out.stderr


def test_coordinator_rank_is_read_as_smp_v2_scripts_pass_it(ranks, tmp_path):
    first, second = ranks(2).run(cases.coordinator_global_rank, root=str(tmp_path))
    assert first == {"session": "saved", "torch": "saved"}  # rank 0: both readings agree
    assert second["session"] == "saved" and "Group rank 1 is not part of group" in second["torch"], second
    assert (tmp_path / "session1" / ".metadata").exists()


def test_ranks_with_different_save_paths_are_refused_on_every_rank(ranks, tmp_path):
    results = ranks(2).run(cases.save_paths, root=str(tmp_path))
    for r in results:
        assert "different checkpoint paths" in r["world"] and "tp2-0" in r["world"] and "tp2-1" in r["world"], r
        assert r["per_group"] == "saved"  # each rank's folder with its own group: the SMP v2 way
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp2-0", "tp2-1"]
    assert all((tmp_path / f"tp2-{i}" / ".metadata").exists() for i in (0, 1))


def test_core_save_refuses_different_paths_on_every_rank(ranks, tmp_path):
    for message in ranks(2).run(cases.core_save_paths, root=str(tmp_path)):
        assert "different checkpoint paths" in message and "rank0" in message and "rank1" in message, message
    assert list(tmp_path.iterdir()) == []  # nothing written
