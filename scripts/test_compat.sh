#!/usr/bin/env bash
# Compatibility run: smp from this checkout against each torch of the declared range's test
# points, one venv per version, on a subset that proves every parallelism by equivalence with a
# single-process run (docs/compatibility.md).
#
#   bash scripts/test_compat.sh                 # every version in SMP_COMPAT_TORCH
#   bash scripts/test_compat.sh 2.11.0          # one version
#   bash scripts/test_compat.sh 2.11.0 -- -x    # arguments after -- go to pytest
#
# Environment:
#   SMP_COMPAT_TORCH   the torch versions to test (default below: the floor, the GPU image's
#                      2.11 and the newest this machine's pip allows)
#   SMP_COMPAT_CACHE   where the venvs live (default ~/.cache/smp-compat); torch-<version>/ is
#                      reused when its .complete marker is there (rm -r the folder to rebuild)
#   SMP_COMPAT_REPORT  folder for one JUnit XML per version and the summary table (default: a
#                      temporary folder)
#
# Each venv holds the CUDA build of torch from the index (it runs on CPU with gloo; 5-7 GB,
# 1-3 minutes to install) and the other pinned versions below. smp is not installed into it:
# the checkout goes on PYTHONPATH, so the run always tests these sources.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

VERSIONS=(${SMP_COMPAT_TORCH:-2.11.0 2.14.1})
CACHE=${SMP_COMPAT_CACHE:-$HOME/.cache/smp-compat}
# Everything but torch at the pinned versions (requirements-ci.txt), so a difference in the run is
# torch's. Keep this line equal in every copy: a venv whose marker holds another line is updated.
PACKAGES="transformers==5.23.0 accelerate==1.15.0 safetensors==0.8.0 pydantic==2.13.4 PyYAML==6.0.3 pytest==9.0.3 hypothesis==6.155.2 xxhash==4.1.0 numpy"

# The subset: "<feature>|<pytest node id>". Each feature has an equivalence case (loss and every
# gradient against one process) and, where the suite has one, its negative control.
SUBSET=(
  "FSDP / HSDP|tests/sharding/test_fsdp.py::test_matches_single_process[full-shard-2-llama]"
  "FSDP / HSDP|tests/sharding/test_fsdp.py::test_matches_single_process[hybrid-2x2-llama]"
  "FSDP / HSDP|tests/sharding/test_fsdp.py::test_broken_sync_is_caught"
  "FSDP / HSDP|tests/sharding/test_fsdp.py::test_mixed_precision_bf16"
  "FSDP / HSDP|tests/sharding/test_fsdp.py::test_delayed_init_equals_eager[llama-2-config0]"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_matches_single_process[tp2-sp-llama]"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_matches_single_process[tp2xshard2-user]"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_matches_single_process[tp2xshard2-sp-lossparallel-gpt2]"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_tp4_with_sequence_parallel"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_hybrid_shard_with_tp"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_missing_all_reduce_is_caught"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_backward_reduces_once_per_region[tp2-sp]"
  "TP + SP|tests/tensor_parallel/test_tensor_parallel.py::test_full_state_dict_keeps_original_layout[4-gpt2]"
  "CP|tests/context_parallel/test_context_parallel.py::test_matches_single_process[w2-lb-ring-llama-pad]"
  "CP|tests/context_parallel/test_context_parallel.py::test_matches_single_process[w2-lb-allgather-llama-pad]"
  "CP|tests/context_parallel/test_context_parallel.py::test_wrong_merge_is_caught[ring-drop_lse]"
  "CP|tests/context_parallel/test_context_parallel.py::test_with_tensor_parallel"
  "CP|tests/context_parallel/test_context_parallel.py::test_checkpoint_resumes_across_cp[2-1]"
  "EP|tests/expert_parallel/test_expert_parallel.py::test_matches_single_process[ep2-mixtral]"
  "EP|tests/expert_parallel/test_expert_parallel.py::test_matches_single_process[ep2xfsdp2-qwen3_moe]"
  "EP|tests/expert_parallel/test_expert_parallel.py::test_matches_single_process_more[ep2-hybrid2-qwen3_moe]"
  "EP|tests/expert_parallel/test_expert_parallel.py::test_broken_dispatch_is_caught[misroute]"
  "EP|tests/expert_parallel/test_expert_parallel.py::test_broken_dispatch_is_caught[no_backward_a2a]"
  "activations|tests/training/test_activations.py::test_every_mode_is_bitwise_equal_to_none"
  "activations|tests/training/test_activations.py::test_horizon_check_catches_a_greedy_schedule"
  "activations|tests/training/test_activations.py::test_fsdp_full_shard[llama]"
  "activations|tests/training/test_activations.py::test_tensor_parallel_with_checkpointing_and_offloading"
  "gradient sync|tests/sharding/test_gradient_sync.py::test_quantized_sync_close_to_single_process[2-int8]"
  "gradient sync|tests/sharding/test_gradient_sync.py::test_cross_replica_uncompressed_equals_native_hsdp[hsdp-2x2]"
  "gradient sync|tests/sharding/test_collectives.py::test_triton_bf16_input_equals_torch[fp8]"
  "checkpoints|tests/checkpointing/test_checkpointing.py::test_exact_resume_is_bitwise[sync]"
  "checkpoints|tests/checkpointing/test_checkpointing.py::test_resume_without_rng_is_caught"
  "checkpoints|tests/checkpointing/test_checkpointing.py::test_reshard_hybrid4_to_full_shard2"
  "checkpoints|tests/checkpointing/test_checkpointing.py::test_reshard_to_tensor_parallel"
  "checkpoints|tests/checkpointing/test_checkpointing.py::test_reshard_tensor_parallel_to_full_shard"
  "checkpoints|tests/checkpointing/test_checkpointing.py::test_export_hf_loads_with_from_pretrained[tp2-tied]"
  "checkpoints|tests/expert_parallel/test_expert_parallel.py::test_checkpoint_reshards_across_degrees_and_world_sizes"
  "example|tests/core/test_example.py::test_finetune_two_ranks_resume_and_export"
  "compat layer|tests/core/test_compat_layer.py"
)

# Cases a torch older than the given version refuses with smp.UnsupportedVersionError (by design,
# smp/_compat/; docs/compatibility.md): "<oldest torch that runs it>|<node id>". Below that
# version the case is deselected and the table lists it as refused.
NEEDS=(
  # sequence parallel: torch 2.9 has no DTensor rule for aten.alias (_compat.check_sequence_parallel)
  "2.11|tests/tensor_parallel/test_tensor_parallel.py::test_matches_single_process[tp2-sp-llama]"
  "2.11|tests/tensor_parallel/test_tensor_parallel.py::test_matches_single_process[tp2xshard2-sp-lossparallel-gpt2]"
  "2.11|tests/tensor_parallel/test_tensor_parallel.py::test_tp4_with_sequence_parallel"
  "2.11|tests/tensor_parallel/test_tensor_parallel.py::test_backward_reduces_once_per_region[tp2-sp]"
  "2.11|tests/context_parallel/test_context_parallel.py::test_with_tensor_parallel"
)

# True when version $1 is older than $2 (2.9.1 < 2.11 <= 2.11.0).
older() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -1)" = "$1" ]; }

PYTEST_ARGS=()
ARGS=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; PYTEST_ARGS=("$@"); break; fi
  ARGS+=("$1"); shift
done
[ ${#ARGS[@]} -gt 0 ] && VERSIONS=("${ARGS[@]}")

REPORT=${SMP_COMPAT_REPORT:-$(mktemp -d)}
mkdir -p "$REPORT"

# Create or reuse $CACHE/torch-<version>. The marker is written only after pip succeeded, so an
# interrupted install is resumed (pip skips what is already there) on the next run.
ensure_venv() {
  local version=$1 dir=$CACHE/torch-$1
  local spec="torch==$version $PACKAGES"
  if [ -f "$dir/.complete" ] && { [ ! -s "$dir/.complete" ] || [ "$(cat "$dir/.complete")" = "$spec" ]; }; then
    return 0
  fi
  echo "== torch $version: installing into $dir"
  mkdir -p "$CACHE"
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  # shellcheck disable=SC2086  # $spec is a list of requirement specifiers
  "$dir/bin/python" -m pip install -q --disable-pip-version-check $spec
  echo "$spec" > "$dir/.complete"
}

nodes=()
for entry in "${SUBSET[@]}"; do nodes+=("${entry#*|}"); done

failed=()
for version in "${VERSIONS[@]}"; do
  ensure_venv "$version"
  py=$CACHE/torch-$version/bin/python
  echo "== torch $version: $("$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
  run=()
  : > "$REPORT/refused-$version.txt"
  for node in "${nodes[@]}"; do
    refused=""
    for need in "${NEEDS[@]}"; do
      if [ "${need#*|}" = "$node" ] && older "$version" "${need%%|*}"; then refused=${need%%|*}; fi
    done
    if [ -n "$refused" ]; then
      echo "   refused below torch $refused (not run): $node"
      echo "$refused|$node" >> "$REPORT/refused-$version.txt"
    else
      run+=("$node")
    fi
  done
  start=$SECONDS
  rc=0
  PYTHONPATH="$REPO:$REPO/kernels" TRITON_INTERPRET=1 OMP_NUM_THREADS=1 \
    "$py" -m pytest -q -p no:cacheprovider -rfEs --junitxml="$REPORT/torch-$version.xml" \
    "${run[@]}" ${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"} || rc=$?
  echo "== torch $version: pytest exit $rc after $((SECONDS - start)) s"
  if [ "$rc" -eq 5 ]; then
    echo "the compatibility subset selected no test: update SUBSET in scripts/test_compat.sh" >&2
  fi
  [ "$rc" -eq 0 ] || failed+=("$version")
done

# Versions x features, from the JUnit files (pass / fail / skip counts per cell).
printf '%s\n' "${SUBSET[@]}" > "$REPORT/subset.txt"
python3 - "$REPORT" "${VERSIONS[@]}" <<'EOF'
import os, sys, xml.etree.ElementTree as ET
report, versions = sys.argv[1], sys.argv[2:]
subset = [line.rstrip("\n").split("|", 1) for line in open(os.path.join(report, "subset.txt"))]
features = list(dict.fromkeys(f for f, _ in subset))
def feature_of(nodeid):
    for f, prefix in subset:
        if nodeid == prefix or nodeid.startswith(prefix + "::"):
            return f
    return None
table = {}
for v in versions:
    path = os.path.join(report, f"torch-{v}.xml")
    if not os.path.exists(path):
        continue
    for case in ET.parse(path).iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        nodeid = cls.replace(".", "/") + ".py::" + name
        f = feature_of(nodeid)
        outcome = "fail" if case.find("failure") is not None or case.find("error") is not None else \
            "skip" if case.find("skipped") is not None else "pass"
        cell = table.setdefault((f, v), {"pass": 0, "fail": 0, "skip": 0, "refused": 0})
        cell[outcome] += 1
    refused = os.path.join(report, f"refused-{v}.txt")
    for line in open(refused) if os.path.exists(refused) else ():
        need, nodeid = line.rstrip("\n").split("|", 1)
        cell = table.setdefault((feature_of(nodeid), v), {"pass": 0, "fail": 0, "skip": 0, "refused": 0})
        cell["refused"] += 1
        cell["needs"] = need
print("| feature | " + " | ".join(f"torch {v}" for v in versions) + " |")
print("|---|" + "---|" * len(versions))
for f in features + ([None] if any(k[0] is None for k in table) else []):
    cells = []
    for v in versions:
        c = table.get((f, v))
        if c is None:
            cells.append("-")
            continue
        text = ", ".join(f"{c[k]} {k}" for k in ("pass", "fail", "skip") if c[k])
        if c["refused"]:
            text += (", " if text else "") + f"{c['refused']} refused (needs torch >= {c['needs']})"
        cells.append(text or "-")
    print(f"| {f or 'other'} | " + " | ".join(cells) + " |")
EOF
echo "JUnit files and the table's input: $REPORT"

if [ ${#failed[@]} -gt 0 ]; then
  echo "compatibility run FAILED on torch ${failed[*]}" >&2
  exit 1
fi
echo "compatibility run passed on torch ${VERSIONS[*]}"
