"""`compile:` in the config: each block torch.compiled inside smp.transform (smp/compile.py).

World 1 on CPU with the "aot_eager" backend: the same graphs inductor would get, traced by
dynamo and AOTAutograd, without code generation (about a second per graph).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo import register_backend

import smp
from smp.config import load_config
from smp.testing.distributed import max_grad_diff
from smp.testing.models import loss_of, random_batch, tiny_llama

# Calls of graphs compiled by the counting backend below (one per compiled block forward).
COMPILED_CALLS: list[str] = []


@register_backend
def smp_test_counting(gm: torch.fx.GraphModule, example_inputs):
    """aot_eager, with every call of a compiled graph counted."""
    from torch._dynamo.backends.debugging import aot_eager

    compiled = aot_eager(gm, example_inputs)

    def run(*args):
        COMPILED_CALLS.append(gm.__class__.__name__)
        return compiled(*args)

    return run


def _loss_and_model(config: dict, reference: torch.nn.Module, batch: torch.Tensor):
    with smp.session(config):
        model = smp.transform(copy.deepcopy(reference))
        loss = loss_of(model, batch)
        loss.backward()
        return loss.detach(), model


@pytest.fixture(scope="module")
def reference_run():
    torch.manual_seed(0)
    reference = tiny_llama(use_cache=False)
    batch = random_batch(2, 16, 256, seed=3)
    ref = copy.deepcopy(reference)
    ref_loss = loss_of(ref, batch)
    ref_loss.backward()
    return reference, batch, ref_loss.detach(), ref


def test_compiled_transform_equals_uncompiled(reference_run):
    reference, batch, ref_loss, ref = reference_run
    torch._dynamo.reset()
    loss, model = _loss_and_model({"compile": {"enabled": True, "backend": "aot_eager"}}, reference, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5
    assert max_grad_diff(model, ref) <= 1e-5
    # Compiled in place: parameter names and state-dict keys are the uncompiled model's.
    assert sorted(model.state_dict()) == sorted(ref.state_dict())


def test_blocks_really_run_compiled(reference_run):
    reference, batch, _, _ = reference_run
    torch._dynamo.reset()
    COMPILED_CALLS.clear()
    _loss_and_model({"compile": {"enabled": True, "backend": "smp_test_counting"}}, reference, batch)
    compiled_forwards = len(COMPILED_CALLS)
    COMPILED_CALLS.clear()
    # Negative control: the same run without compile calls no compiled graph.
    _loss_and_model({"compile": False}, reference, batch)
    assert compiled_forwards >= reference.config.num_hidden_layers
    assert COMPILED_CALLS == []


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compile_with_activation_checkpointing(reference_run, mode):
    reference, batch, ref_loss, ref = reference_run
    torch._dynamo.reset()
    loss, model = _loss_and_model(
        {"compile": {"enabled": True, "backend": "aot_eager"}, "activation_checkpointing": mode}, reference, batch
    )
    assert abs(float(loss) - float(ref_loss)) <= 1e-5
    assert max_grad_diff(model, ref) <= 1e-5


def test_compile_config_spellings_and_errors():
    assert load_config({}).compile.enabled is False
    assert load_config({}).compile.backend == "inductor"
    assert load_config({"compile": True}).compile.enabled is True
    cfg = load_config({"compile": {"enabled": True, "backend": "aot_eager"}})
    assert (cfg.compile.enabled, cfg.compile.backend) == (True, "aot_eager")
    with pytest.raises(smp.ConfigError, match="compile.backend.*unknown torch.compile backend 'inductr'"):
        load_config({"compile": {"backend": "inductr"}})
    with pytest.raises(smp.ConfigError, match="unknown key 'compile.enable'"):
        load_config({"compile": {"enable": True}})
