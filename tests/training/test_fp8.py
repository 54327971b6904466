"""FP8 training config (`fp8: {recipe: tensorwise | rowwise}`, torchao float8).

On this CPU machine: the config, the refusal at smp.init (no CUDA; a GPU below compute
capability 8.9, simulated), and the module swap on the meta device when torchao is installed
(skipped cleanly without it). Training equivalence needs a CUDA >= 8.9 device (not here).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import smp
from smp import fp8
from smp.config import load_config


def test_config_section():
    assert load_config({}).fp8 is None
    assert load_config({"fp8": {}}).fp8.recipe == "tensorwise"
    assert load_config({"fp8": {"recipe": "rowwise"}}).fp8.recipe == "rowwise"
    with pytest.raises(smp.ConfigError, match="fp8.recipe"):
        load_config({"fp8": {"recipe": "delayed"}})


def test_refused_at_init_on_cpu():
    with pytest.raises(smp.ConfigError) as e:
        smp.init({"fp8": {"recipe": "tensorwise"}})
    assert "CUDA device of compute capability >= 8.9" in str(e.value) and "this run is on cpu" in str(e.value)
    assert not smp.is_initialized()  # refused before the process group exists


def test_refused_below_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(smp.ConfigError, match="A100 has 8.0"):
        fp8.check_fp8("rowwise", torch.device("cuda", 0))


def test_accepted_on_capability_9_0_with_torchao(monkeypatch):
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_fp8("tensorwise", torch.device("cuda", 0))
    fp8.check_fp8(None, torch.device("cpu"))  # off: nothing to check


def test_without_torchao_the_error_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(smp.ConfigError, match="pip install torchao"):
        fp8.check_fp8("tensorwise", torch.device("cuda", 0))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_module_swap_on_meta(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from smp.testing.models import tiny_llama

    with torch.device("meta"):
        model = tiny_llama(vocab_size=128, hidden_size=32, intermediate_size=64)
    converted = fp8.apply_fp8(model, recipe)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert converted and set(converted) < linears
    for name, module in model.named_modules():
        if name in converted:
            assert isinstance(module, Float8Linear), name
            assert module.weight.is_meta
    assert "lm_head" not in converted and type(model.lm_head) is nn.Linear  # the output head stays
    # k/v projections are 16 wide (2 key/value heads x 8): converted; nothing narrower than 16 is
    assert all(model.get_submodule(n).in_features % 16 == 0 for n in converted)


def test_layer_filter():
    assert fp8.fp8_layer("model.layers.0.mlp.up_proj", nn.Linear(32, 64, device="meta"))
    assert not fp8.fp8_layer("model.layers.0.mlp.up_proj", nn.Linear(32, 60, device="meta"))  # 60 % 16
    assert not fp8.fp8_layer("lm_head", nn.Linear(32, 64, device="meta"))
    assert not fp8.fp8_layer("model.norm", nn.LayerNorm(32, device="meta"))
