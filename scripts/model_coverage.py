"""Write docs/model-coverage.md: every model family x parallelism mode (FSDP, delayed init,
TP=2, TP=2 + sequence parallel, full checkpointing + offloading on world 2; FSDP hybrid
sharding, and TP=2 x FSDP 2 + SP for the families exact at TP=2 + SP, on world 4), each cell
"exact" (loss and gradients within 1e-5 of one process; delayed init also bitwise parameters)
or "refused" with smp's reason; beside smp's TP=2, the same check for transformers' own TP=2
(`DistributedConfig(tp_size=2)`), the peer.
Families come from transformers' registry (every causal-LM family whose config ships a
`base_model_tp_plan`) plus BERT-MLM, T5 and GPT-2; nothing is listed by hand.

    .venv/bin/python scripts/model_coverage.py [--families llama,qwen2] [--modes tp2,tp2-sp]
                                               [--out docs/model-coverage.md]

Runs on gloo ranks (CPU), one cell at a time, 240 s at most per cell. A family that neither
matches nor is refused (a crash, a silent mismatch, a mode that did nothing) is written as such
and makes the script exit 1. Only the cells a run computes are rewritten (--families and
--modes choose them); before each write the script re-reads --out and keeps every other cell,
so runs on other families or columns at the same time keep theirs. The file is rewritten after
each cell, so an interrupted run keeps the cells it finished.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import hashlib
import os
import re
import sys
import tempfile
from typing import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from smp.testing.rank_pool import RankFailure, RankPool, RankTimeout  # noqa: E402
from tests import model_coverage_cases as cases  # noqa: E402

# mode (cases.MODES: the arguments of its case function) -> its column title
COLUMNS = {
    "fsdp": "FSDP full shard (world 2)",
    "hybrid": "FSDP hybrid, 2 replicas x 2 shards (world 4)",
    "delayed": "delayed init (world 2)",
    "tp2": "TP=2 (world 2)",
    "peer": "transformers' own TP=2 (world 2)",
    "tp2-sp": "TP=2 + sequence parallel (world 2)",
    "ac-offload": "full checkpointing + offloading (world 2)",
    "tp2-fsdp2-sp": "TP=2 x FSDP 2 + sequence parallel (world 4)",
}
# mode -> the mode whose exact cell it needs first: world 4 is costly on a small machine, and a
# family not exact at TP=2 + SP on world 2 gains nothing from the larger world.
NEEDS_EXACT = {"tp2-fsdp2-sp": "tp2-sp"}
TITLES = list(COLUMNS.values())
NOT_RUN = "not run yet"


def families(only: list[str] | None) -> list[tuple[str, str | None]]:
    listed = cases.registry_families() + [(f, None) for f in cases.EXTRA_FAMILIES]
    return [(f, r) for f, r in listed if not only or f in only]


def cell(pool: RankPool, family: str, mode: str) -> dict:
    case = cases.CASE_FUNCTIONS.get(mode, cases.classify)
    try:
        results = pool.run(case, family=family, timeout=240, **cases.MODES[mode])
    except RankTimeout as e:
        return {"status": "crash", "detail": f"timed out: {e}"}
    except RankFailure as e:  # the case itself failed before it could classify
        return {"status": "crash", "detail": str(e).strip().splitlines()[-1]}
    worst = {"exact": 0, "refused": 1, "skipped": 1, "not run": 1, "unproven": 2, "mismatch": 2, "crash": 3}
    return max(results, key=lambda r: worst[r["status"]])  # the worst rank speaks for the family


def cell_text(result: dict) -> str:
    if result["status"] == "exact":
        return f"exact ({result['note']})" if result.get("note") else "exact"
    detail = result["detail"].splitlines()[0] if isinstance(result["detail"], str) else repr(result["detail"])
    detail = " ".join(detail.split()).replace("|", "/")
    return f"{result['status']}: {detail[:240]}"


def run_rows(pool: Callable[[int], RankPool], only: list[str] | None, modes: list[str],
             rows: dict[str, dict[str, str]]) -> Iterator[tuple[str, str, str]]:
    """(family, column title, cell text) as each cell finishes; `pool(world)` gives the ranks,
    `rows` the cells known so far (for NEEDS_EXACT)."""
    for family, reason in families(only):
        reason = reason or cases.can_build(family)
        texts = {}
        for mode in modes:
            title, needed = COLUMNS[mode], NEEDS_EXACT.get(mode)
            needed_text = texts.get(COLUMNS[needed], rows.get(family, {}).get(COLUMNS[needed], NOT_RUN)) if needed else ""
            if reason:
                texts[title] = f"skipped: {reason}"
            elif needed and not needed_text.startswith("exact"):
                texts[title] = f"not run: {needed_text.split(':')[0]} under {COLUMNS[needed]}"
            else:
                world = cases.WORLD.get(mode, 2)
                texts[title] = cell_text(cell(pool(world), family, mode))
            print(family, mode, texts[title][:160], flush=True)
            yield family, title, texts[title]


def read_rows(path: str) -> dict[str, dict[str, str]]:
    """family -> {column title: cell text} of a matrix this script wrote earlier, read by its
    header, so that a file with fewer columns keeps its cells (none if there is no such file)."""
    if not os.path.exists(path):
        return {}
    rows, header = {}, None
    for line in open(path).read().splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "family":
            header = cells[1:]
        elif header and len(cells) == len(header) + 1:
            rows[cells[0]] = dict(zip(header, cells[1:]))
    return rows


def render(rows: dict[str, list[str]]) -> str:
    """The matrix in registry order (families no longer in the registry dropped), with totals."""
    counts: dict[str, dict[str, int]] = {t: {} for t in TITLES}
    lines = [
        "# Model coverage",
        "",
        "Generated by `scripts/model_coverage.py` (do not edit by hand) on "
        f"{datetime.date.today().isoformat()}. Families: every causal-LM family in transformers' "
        "registry whose config ships a `base_model_tp_plan`, built at a tiny shape (hidden 64, "
        "2 layers, 4 heads, 2 KV heads, vocab 256, intermediate 128), plus BERT masked LM, T5 and "
        "GPT-2 (no `base_model_tp_plan`; under TP they get smp's own table or its refusal). Each cell "
        "compares one SGD step with the same model in one process: **exact** means loss and every "
        "gradient within 1e-5 (delayed init: every parameter and buffer also bitwise equal to eager "
        "construction; TP: at least one parameter split over the TP ranks; offloading: activations "
        "moved to host); **refused** means smp raised its own error, quoted; **unproven** means within "
        "1e-5 but the mode did nothing (no parameter split, nothing offloaded); **crash** quotes the "
        "error's first line; **skipped** families cannot be built from `input_ids` alone here. TP "
        "columns use the model's own plan and no user plan; sequence parallel also shards the norms "
        "and dropout regions along the sequence; the world-4 column puts TP=2 inside FSDP over the 2 "
        "data-parallel ranks, and runs for the families exact at TP=2 + SP on world 2. The hybrid column "
        "shards each model over 2 ranks and replicates it twice (`hybrid_shard_degree: 2`, world 4). "
        "Beside smp's TP=2, **transformers' own TP=2** is the peer: the same tiny model written with "
        "`save_pretrained` and loaded with `from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))`, "
        "compared with the same folder loaded in one process (same step, batch and tolerance; any "
        "error from the peer is a crash, as it has no refusals to tell apart; **not run** says why, "
        "e.g. the family ships no `base_model_tp_plan`). The checkpointing column wraps every block in full "
        "activation checkpointing and offloads every saved activation to host "
        "(`activation_offload_min_bytes: 0`). A family whose training forward draws random numbers "
        "(PhiMoE's router samples its experts) is compared in eval mode, and says so: those draws "
        "differ between one process and each rank's rows by design. The hand-built TP cases behind "
        "this (per-head norms, MoE experts, gathered regions, GPT-J's user plan, the negative "
        "controls) are in [Tensor parallelism](tensor-parallel.md#model-coverage).",
        "",
        f"| family | {' | '.join(TITLES)} |",
        f"|---|{'---|' * len(TITLES)}",
    ]
    for family, _ in families(None):
        if family not in rows:
            continue
        texts = [rows[family].get(title, NOT_RUN) for title in TITLES]
        for title, text in zip(TITLES, texts):
            status = re.match(r"[\w ]+?(?=:|$| \()", text).group()
            if status != "skipped":
                counts[title][status] = counts[title].get(status, 0) + 1
        lines.append(f"| {family} | " + " | ".join(texts) + " |")
    lines += ["", "Totals:", ""] + [
        f"- {title}: " + ", ".join(f"{n} {status}" for status, n in sorted(c.items())) for title, c in counts.items()
    ] + ["", peer_summary(rows), ""]
    return "\n".join(lines)


def peer_summary(rows: dict[str, dict[str, str]]) -> str:
    """One line comparing smp's TP=2 column with the peer's, family by family."""
    smp_title, peer_title = COLUMNS["tp2"], COLUMNS["peer"]
    # families built here with both cells computed, in registry order
    listed = [f for f, _ in families(None)
              if f in rows and NOT_RUN not in (rows[f].get(smp_title, NOT_RUN), rows[f].get(peer_title, NOT_RUN))
              and not rows[f][peer_title].startswith("skipped")]
    smp_exact = {f for f in listed if rows[f][smp_title].startswith("exact")}
    peer_exact = {f for f in listed if rows[f][peer_title].startswith("exact")}
    only_peer = [f for f in listed if f in peer_exact - smp_exact]
    only_smp = [f for f in listed if f in smp_exact - peer_exact]
    return (f"smp vs transformers' own TP=2, over the {len(listed)} families with both cells: the peer is exact "
            f"on {len(peer_exact)}, smp on {len(smp_exact)}. Exact in the peer but not in smp: {len(only_peer)}"
            f"{' (' + ', '.join(only_peer) + ')' if only_peer else ''}. Exact in smp but not in the peer: "
            f"{len(only_smp)}{' (' + ', '.join(only_smp) + ')' if only_smp else ''}.")


def write_merged(path: str, computed: dict[str, dict[str, str]]) -> None:
    """Re-read `path` and write it back with every cell of `computed` (all this run has
    computed, not only the last cell: a concurrent run that rewrote the file from an older copy
    loses nothing of ours at our next write) and every other cell as it stands now. Runs of this
    script take turns through a lock file, and the file is replaced whole, never half-written."""
    lock = os.path.join(tempfile.gettempdir(), "model-coverage-" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12] + ".lock")
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        rows = read_rows(path)
        for family, texts in computed.items():
            rows[family] = {**rows.get(family, {}), **texts}
        staged = f"{path}.{os.getpid()}.tmp"
        with open(staged, "w") as f:
            f.write(render(rows))
        os.replace(staged, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated subset (default: all)")
    parser.add_argument("--modes", help=f"comma-separated columns to run (default: all): {', '.join(COLUMNS)}")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "model-coverage.md"))
    args = parser.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    only = args.families.split(",") if args.families else None
    modes = args.modes.split(",") if args.modes else list(COLUMNS)
    unknown = sorted(set(modes) - set(COLUMNS))
    if unknown:
        parser.error(f"unknown --modes {unknown}; choose from {list(COLUMNS)}")
    rows = read_rows(args.out)
    computed: dict[str, dict[str, str]] = {}  # family -> {column title: cell text} of this run
    pools: dict[int, RankPool] = {}

    def pool(world: int) -> RankPool:
        if world not in pools:
            pools[world] = RankPool(world)
        return pools[world]

    try:
        for family, title, text in run_rows(pool, only, modes, rows):
            computed.setdefault(family, {})[title] = text
            write_merged(args.out, computed)  # after each cell: an interrupted run keeps its cells
    finally:
        for p in pools.values():
            p.close()
    # the peer's crashes and mismatches are findings about transformers, not failures of smp
    bad = sorted(f for f, texts in computed.items()
                 if any(t.startswith(("crash", "mismatch", "unproven")) for title, t in texts.items()
                        if title != COLUMNS["peer"]))
    if bad:
        print(f"neither exact nor refused: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
