"""Record, for every family of the model-coverage matrix (tests/models/model_coverage_cases.py and
tests/models/model_coverage_vlm_cases.py, tiny configs built on the meta device), the parts smp finds:
FSDP blocks, the pipeline split (its parts and a 2-stage split), the TP head and input embedding,
and the tensor-parallel assignments (`model._smp_tp_plan` without applying it, sequence parallel
off and on). tests/core/test_anatomy.py compares what smp finds now with this record.

Run from the repository root: python scripts/record_model_parts.py [families...]
It writes tests/fixtures/model_parts.json (the record made before smp/anatomy.py existed).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "model_parts.json"


def families() -> list[tuple[str, str]]:
    """(family, kind): the causal-LM column's families, then the vision / speech ones."""
    from tests.models import model_coverage_cases as causal
    from tests.models import model_coverage_vlm_cases as vision

    out = [(f, "causal") for f, reason in causal.registry_families() if reason is None]
    out += [(f, "causal") for f in causal.EXTRA_FAMILIES]
    return out + vision.vision_families()


def build_on_meta(family: str, kind: str) -> torch.nn.Module:
    from tests.models import model_coverage_cases as causal
    from tests.models import model_coverage_vlm_cases as vision

    with torch.device("meta"):
        if kind == "causal":
            return causal.build_family(family)
        return vision.model_class(family, kind)(vision.tiny_config(family, kind))


def _outcome(fn):
    """fn()'s value, or the error it raised as {"error": type}: smp's refusals are part of the record."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the record keeps any refusal's type
        return {"error": type(e).__name__}


def parts_of(model: torch.nn.Module) -> dict:
    """What smp finds in `model` (plain values: names, not modules)."""
    from smp.pipeline.split import find_parts, plan_split
    from smp.sharding import find_blocks
    from smp.tensor_parallel.registry import Options
    from smp.tensor_parallel.rules import expand_plan
    from smp.tensor_parallel.tp_plan import resolve_plan

    try:
        from smp.anatomy import describe

        def head() -> str | None:
            return describe(model).head

        def embedding() -> str | None:
            return describe(model).embedding
    except ImportError:  # the code before smp/anatomy.py, which the fixture was recorded with
        from smp.tensor_parallel.tp_plan import _head_name, _input_embedding_name

        def head() -> str | None:
            return _head_name(model)

        def embedding() -> str | None:
            return _input_embedding_name(model)

    names = {id(m): n for n, m in model.named_modules()}

    def pipeline() -> dict:
        parts = find_parts(model)
        record = {"layers": parts.layers, "first": parts.first, "last": parts.last, "hf": parts.hf}
        stages = _outcome(lambda: [[s.layers.start, s.layers.stop, s.params, s.flops_per_token]
                                   for s in plan_split(model, 2)])
        return {**record, "stages": stages}

    def tp(sequence_parallel: bool) -> dict:
        m = expand_plan(model, resolve_plan(model, None, None), Options(sequence_parallel=sequence_parallel))
        return {a.name: (a.style if isinstance(a.style, str) else type(a.style).__name__) + (f" ({a.why})" if a.why else "")
                for a in m.assignments}

    return {
        "blocks": _outcome(lambda: [names[id(b)] for b in find_blocks(model)]),
        "pipeline": _outcome(pipeline),
        "head": _outcome(head),
        "embedding": _outcome(embedding),
        "tp": _outcome(lambda: tp(False)),
        "tp_sp": _outcome(lambda: tp(True)),
    }


def record(selected: list[str] | None = None) -> dict:
    out = {}
    for family, kind in families():
        if selected and family not in selected:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model = build_on_meta(family, kind)
            except Exception as e:  # noqa: BLE001 - a family that does not build at the tiny shape
                out[family] = {"kind": kind, "build": type(e).__name__}
                continue
            out[family] = {"kind": kind, **parts_of(model)}
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = record(sys.argv[1:] or None)
    if sys.argv[1:]:
        print(json.dumps(result, indent=1))
    else:
        FIXTURE.parent.mkdir(exist_ok=True)
        rows = [f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(result.items())]
        FIXTURE.write_text("{\n" + ",\n".join(rows) + "\n}\n")  # one family a line: readable diffs
        print(f"{len(result)} families -> {FIXTURE}")
