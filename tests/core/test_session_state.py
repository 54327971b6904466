"""State belongs to the session: `import smp` registers and patches nothing; what one
`smp.session` sets up (async saves and their group, the context-parallel setup, the watchdog,
the scoped patch of transformers' MoE load-balancing loss) is closed by its shutdown and never
seen by the next session. Each check has its negative control beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import smp
from smp import scope
from smp.checkpointing.commit import async_save
from smp.context_parallel.attention import activate as activate_cp, active as active_cp, deactivate as deactivate_cp
from smp.reliability import guard
from tests.core import session_state_cases as cases
from tests import REPO_ROOT


@pytest.fixture(autouse=True)
def fresh_process_scope(monkeypatch):
    """These tests check what the process scope holds: start each from an empty one, whatever
    earlier in-process tests (a step_guard or a save outside any session) left in the real one."""
    monkeypatch.setattr(scope, "_PROCESS", scope.Scope("process"))

ROOT = str(REPO_ROOT)

# Imports every smp module in a fresh interpreter, after transformers' MoE modules and torch's
# FSDP, and reports what smp changed: hooks, objects, atexit handlers, threads, patched names.
_IMPORT_EVERYTHING = textwrap.dedent("""
    import atexit, importlib, json, pkgutil, sys, threading
    import torch.distributed.fsdp as fsdp
    import transformers
    from transformers import AttentionInterface
    MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "switch_transformers", "doge"]
    modeling = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in MOE]
    before = {m.__name__: m.load_balancing_loss_func for m in modeling}
    fsdp1_init = fsdp.FullyShardedDataParallel.__init__
    threads = threading.active_count()
    registered = []  # atexit handlers registered from here on (third-party imports add their own)
    _register = atexit.register
    atexit.register = lambda fn, *a, **k: (registered.append(getattr(fn, "__module__", None) or ""), _register(fn, *a, **k))[1]
    attention = set(AttentionInterface._global_mapping)
    meta_path = list(sys.meta_path)
    {extra}
    import smp
    import_smp = {  # `import smp` alone: no import hook, no alias of torch.sagemaker
        "meta_path_added": [type(f).__name__ for f in sys.meta_path if f not in meta_path],
        "torch_sagemaker": "torch.sagemaker" in sys.modules,
    }
    failed = {}
    for info in pkgutil.walk_packages(smp.__path__, "smp."):
        if info.name.endswith("__main__"):  # `python -m smp`: runs the CLI
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as e:  # an optional dependency that is not installed here
            failed[info.name] = str(e)
    from smp import runtime, scope
    print(json.dumps({
        "hooks": [repr(h) for h in runtime.shutdown_hooks()],
        "process_objects": [s.name for s in scope.process().objects],
        "sessions": len(scope._SESSIONS),
        "atexit_added": sorted(m for m in registered if m.split(".")[0] in ("smp", "__main__")),
        "threads_added": threading.active_count() - threads,
        "patched": sorted(m.__name__ for m in modeling if m.load_balancing_loss_func is not before[m.__name__]),
        "fsdp1_patched": fsdp.FullyShardedDataParallel.__init__ is not fsdp1_init,
        "attention_added": sorted(set(AttentionInterface._global_mapping) - attention),
        "import_failed": failed,
        "import_smp": import_smp,
    }))
""")


def _import_report(extra: str = "") -> dict:
    code = _IMPORT_EVERYTHING.replace("{extra}", extra)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_registers_nothing_and_patches_nothing():
    report = _import_report()
    assert report == {
        "hooks": [], "process_objects": [], "sessions": 0, "atexit_added": [], "threads_added": 0,
        "patched": [], "fsdp1_patched": False, "attention_added": [], "import_failed": report["import_failed"],
        "import_smp": {"meta_path_added": [], "torch_sagemaker": False},
    }, report
    # Every module imported (an optional dependency missing here would be named).
    assert not report["import_failed"], report["import_failed"]


def test_import_check_catches_a_patch_and_a_hook():
    """Negative control: an import that patches transformers' MoE loss, registers an atexit
    handler (what smp's import used to do) and adds an import hook is reported."""
    report = _import_report(extra=(
        "modeling[0].load_balancing_loss_func = lambda *a, **k: 0; atexit.register(lambda: None); "
        "sys.meta_path.append(type('Finder', (), {'find_spec': lambda *a: None})())"
    ))
    assert report["patched"] == ["transformers.models.mixtral.modeling_mixtral"], report
    assert report["atexit_added"] == ["__main__"], report
    assert report["import_smp"]["meta_path_added"] == ["Finder"], report


def test_sessions_own_their_objects():
    """One process, two world-1 sessions: each has its own async-save object, watchdog state and
    context-parallel slot; shutdown closes the first's (its commit thread ends)."""
    with smp.session({}):
        saves = async_save.saves()
        saves.submit(lambda: None, "unused")
        with smp.step_guard(3):
            assert guard.current_step() == 3
        activate_cp("a stand-in setup")  # any object: nothing reads it here
        assert active_cp() == "a stand-in setup"
        assert {s.name for s in scope.current().objects} >= {"async checkpoint saves", "step_guard watchdog",
                                                             "context parallel setup"}
    assert saves._executor is None and saves._pending is None  # closed: waited, thread ended
    assert active_cp() is None and guard.current_step() is None
    with smp.session({}):
        assert async_save.saves() is not saves
        assert active_cp() is None and guard.current_step() is None
    assert not scope.process().objects


def test_a_slot_outside_a_session_is_the_process_scope():
    """Negative control for the test above: outside a session an object lives in the process
    scope, and a session does not close it (and does not see it)."""
    activate_cp("process-wide")
    try:
        with smp.session({}):
            assert active_cp() is None
        assert active_cp() == "process-wide"
    finally:
        deactivate_cp()
    assert not scope.process().objects


def test_register_shutdown_hook_needs_a_session():
    calls = []
    with pytest.raises(RuntimeError, match="no smp session is open"):
        smp.runtime.register_shutdown_hook(lambda: calls.append(1))
    with smp.session({}):
        smp.runtime.register_shutdown_hook(lambda: calls.append(2))
        assert len(smp.runtime.shutdown_hooks()) == 1
    assert calls == [2] and smp.runtime.shutdown_hooks() == []


def test_moe_loss_patch_is_scoped_to_the_transformed_model(ranks):
    """Two sessions at dp 2 in one process, the first with a transformed tiny Mixtral (its
    load-balancing loss summed over the ranks), the second with a transformed dense Llama and an
    untransformed Mixtral: only the transformed Mixtral's forward sees smp's function; transformers'
    module holds its own function outside that forward, during and after both sessions; the
    second session's Mixtral computes transformers' per-rank value (equal to the untransformed
    copy's in the first session, bitwise)."""
    for r in ranks(2).run(cases.moe_patch_isolation, timeout=300):
        assert r["s1_transformed_saw_smp"] and r["s1_transformed_is_smp"], r
        assert r["s1_reference_saw_transformers"] and r["s2_mixtral_saw_transformers"], r
        assert not r["s1_patched_after_transform"] and not r["s1_patched_between_forwards"], r
        assert not r["patched_after_sessions"], r
        assert r["s2_aux"] == r["s1_reference_aux"], r


def test_moe_patch_leak_is_caught(ranks):
    """Negative control: smp's function left in transformers' module after the first session (a
    process-wide patch) is seen by the second session's Mixtral and reported."""
    for r in ranks(2).run(cases.moe_patch_isolation, leak=True, timeout=300):
        assert not r["s2_mixtral_saw_transformers"] and r["patched_after_sessions"], r


def test_session_objects_close_with_the_session(ranks):
    """At world 2: the first session's async-save group is destroyed by its shutdown and its
    context-parallel setup is gone; the second session (and code outside any) sees neither."""
    for r in ranks(2).run(cases.scoped_objects, timeout=300):
        assert r == {"s1_cp_active": True, "s1_group_destroyed": True, "s2_cp_active": False,
                     "s2_same_saves": False, "outside_cp_active": False}, r



def _plan_refused_after_context_parallel(monkeypatch, isolate: bool):
    """Run `smp plan` on a tiny Mixtral with its load-balancing loss at context parallel 2: the
    recipe sets up context parallel over the fake world's group, then refuses the loss (its
    router statistics cannot be summed over cp ranks). Returns the setup left behind."""
    import contextlib

    from transformers import MixtralConfig

    from smp.planning import plan

    if not isolate:  # the control: the recipe's objects land in the process scope
        monkeypatch.setattr(scope, "isolated", lambda name: contextlib.nullcontext())
    moe = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, output_router_logits=True)
    with pytest.raises(smp.ConfigError, match="context_parallel_degree=2"):
        plan({"context_parallel_degree": 2}, moe, 2, seq_len=16, micro_batch=2)
    left = active_cp()
    deactivate_cp()
    return left


def test_plan_leaves_nothing_behind_when_it_fails(monkeypatch):
    """`smp plan` runs the recipe in a scope of its own: a plan refused after context parallel
    was set up leaves no setup over the fake world's (destroyed) group; without that scope
    (negative control) the stale setup stays in the process, where attention would use it."""
    assert _plan_refused_after_context_parallel(monkeypatch, isolate=True) is None
    leaked = _plan_refused_after_context_parallel(monkeypatch, isolate=False)
    assert leaked is not None and leaked.size == 2, leaked
    assert not scope.process().objects
