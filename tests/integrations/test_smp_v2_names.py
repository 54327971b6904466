"""SMP v2's names stay at the edge: smp's core uses smp's own names; only smp/sagemaker (SMP v2's
API, a view over the core) and the config loader (which accepts SMP v2's keys as aliases)
mention them. Importing smp.sagemaker installs its import hooks; importing smp does not."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
from tests import REPO_ROOT

SMP = REPO_ROOT / "smp"
# Names that exist only in SMP v2 (smp's concept has another name, or no counterpart).
SMP_V2_ONLY = [
    "sm_activation_offloading", "rep_rank", "rep_rank_process_group", "ranker", "get_rep_rank", "tp_process_group",
    "cp_process_group", "world_process_group", "torch.sagemaker", "smp_moe", "SMStateDictType",
    "DelayedParamIniter", "maybe_finalize_async_calls",
]
ALLOWED = {SMP / "config.py"}  # the loader: SMP v2 keys as aliases


def test_core_modules_never_mention_smp_v2_names():
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in SMP_V2_ONLY) + r")\b")
    found = []
    for path in SMP.rglob("*.py"):
        if "sagemaker" in path.relative_to(SMP).parts or path in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(SMP.parent)}:{number}: {line.strip()}")
    assert not found, "SMP v2 names outside smp/sagemaker and the config loader:\n" + "\n".join(found)


def test_the_check_sees_a_mention(tmp_path):
    """Negative control: the pattern finds a mention as the core once had it."""
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in SMP_V2_ONLY) + r")\b")
    assert pattern.search("    def rep_rank_process_group(self) -> dist.ProcessGroup:")
    assert pattern.search("        return self.config.sm_activation_offloading")


def _fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=SMP.parent).stdout.strip()


def test_import_hooks_come_with_smp_sagemaker_only():
    hooks = "import sys; print(sum(type(f).__module__.startswith('smp.') for f in sys.meta_path))"
    assert _fresh("import smp; " + hooks) == "0"
    assert _fresh("import smp.sagemaker; " + hooks) == "1"
    assert _fresh("import smp.sagemaker.as_torch_sagemaker; " + hooks) == "2"
