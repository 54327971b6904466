"""Write the model-coverage matrix: every model family x parallelism mode (FSDP, delayed init,
TP=2, TP=2 + sequence parallel, full checkpointing + offloading, pipeline 2, packed sequences
through smp.step, PEFT LoRA under TP=2 on world 2; FSDP hybrid sharding, and TP=2 x FSDP 2 + SP
for the families exact at TP=2 + SP, on world 4), each cell "exact" (loss and gradients within
1e-5 of one process; delayed init also bitwise parameters) or "refused" with smp's reason;
beside smp's TP=2, the same check for transformers' own TP=2 (`DistributedConfig(tp_size=2)`),
the peer.
Families come from transformers' registry (every causal-LM family whose config ships a
`base_model_tp_plan`) plus BERT-MLM, T5 and GPT-2; nothing is listed by hand.

    .venv/bin/python scripts/model_coverage.py [--families llama,qwen2] [--modes tp2,tp2-sp]
                                               [--out evidence/model-coverage.md]

Runs on gloo ranks (CPU), one cell at a time, 240 s at most per cell. A family that neither
matches nor is refused (a crash, a silent mismatch, a mode that did nothing) is written as such
and makes the script exit 1. Only the cells a run computes are rewritten (--families and
--modes choose them); before each write the script re-reads --out and keeps every other cell,
so runs on other families or columns at the same time keep theirs. The files are rewritten after
each cell, so an interrupted run keeps the cells it finished. The page shows a verdict per cell
with each distinct reason once; the full cell texts are kept in evidence/model-coverage.json.
Beside that evidence page, the user's summary (docs/model-coverage.md: totals per column, the
families exact everywhere, and each kind of refusal with its families) is rewritten from the
same cells. `--render-only` rewrites both pages from the JSON.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import fcntl
import hashlib
import json
import os
import re
import sys
import tempfile
from typing import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from smp.testing.rank_pool import RankFailure, RankPool, RankTimeout  # noqa: E402
from tests.models import model_coverage_cases as cases  # noqa: E402
from tests.models import model_coverage_vlm_cases as vcases  # noqa: E402

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
    "pp2": "pipeline 2 stages, 1F1B, 4 micro-batches (world 2)",
    "packed": "packed sequences through smp.step, TP=2 + sequence parallel (FSDP 2 where TP=2 + SP is not exact; "
              "world 2)",
    "lora-tp2": "PEFT LoRA on every linear but the head, TP=2 (world 2)",
}
# mode -> its column head in the table (the full title is in the legend under it)
SHORT = {
    "fsdp": "FSDP", "hybrid": "hybrid 2x2", "delayed": "delayed init", "tp2": "TP 2", "peer": "peer TP 2",
    "tp2-sp": "TP 2 + SP", "ac-offload": "AC + offload", "tp2-fsdp2-sp": "TP2 x FSDP2 + SP",
    "pp2": "PP 2", "packed": "packed", "lora-tp2": "LoRA x TP 2",
}
# mode -> the mode whose exact cell it needs first: world 4 is costly on a small machine, and a
# family not exact at TP=2 + SP on world 2 gains nothing from the larger world.
NEEDS_EXACT = {"tp2-fsdp2-sp": "tp2-sp"}
# mode -> (the mode whose exact cell its layout needs, its case's arguments otherwise): packed
# rows run under TP=2 + SP where the family is exact there (rows cut by sequence across the
# documents' boundaries), else under FSDP 2 (rows split over the data ranks), so that a family's
# packed cell is about packing, not the TP refusal it already has.
FALLBACK = {"packed": ("tp2-sp", {"layout": "fsdp"})}
# modes of the text families only: not columns of the vision section
TEXT_ONLY = ("peer", "packed", "lora-tp2")
NOT_RUN = "not run yet"

# The vision, multimodal and speech section ("--section vision"): the text columns that apply
# (every one but the peer, which compares text families only), plus its own two.
VISION_EXTRA = {
    "mixed": "mixed batch: rank 0 holds the images, rank 1 only text (world 2; image-text families)",
    "round-trip": "pretrained round trip: save_pretrained -> load_hf -> transform -> export_hf -> from_pretrained, bitwise (world 2)",
    "meta-weights": "pretrained on meta: built on the meta device, transform(model, weights=folder) vs from_pretrained + transform, every parameter and buffer (non-persistent too) bitwise (world 2)",
}
VISION_SHORT = {"mixed": "mixed batch", "round-trip": "pretrained round trip", "meta-weights": "pretrained on meta"}
VISION_CASES = {"mixed": vcases.mixed_batch, "round-trip": vcases.pretrained_round_trip,
                "meta-weights": vcases.pretrained_on_meta}


def vision_columns() -> dict[str, str]:
    """mode -> title of the section's columns: the text matrix's that apply (read when called:
    another mode may join COLUMNS) and the section's own."""
    return {**{m: t for m, t in COLUMNS.items() if m not in TEXT_ONLY}, **VISION_EXTRA}


def vision_short(mode: str) -> str:
    return VISION_SHORT.get(mode) or SHORT[mode]


def vision_not_applicable(mode: str, kind: str) -> str | None:
    """Why column `mode` does not apply to a family of `kind` (None when it does)."""
    if mode == "mixed" and kind != "image-text":
        return f"n/a: a {kind} model has no text-only rows"
    if mode not in VISION_EXTRA and mode in cases.CASE_FUNCTIONS:
        return "n/a: this column's case covers the text families only"
    return None


def families(only: list[str] | None) -> list[tuple[str, str | None]]:
    listed = cases.registry_families() + [(f, None) for f in cases.EXTRA_FAMILIES]
    return [(f, r) for f, r in listed if not only or f in only]


def cell(pool: RankPool, family: str, mode: str, arguments: dict | None = None) -> dict:
    """The family's cell under `mode`, its case called with cases.MODES[mode] updated by `arguments`."""
    case = cases.CASE_FUNCTIONS.get(mode, cases.classify)
    try:
        results = pool.run(case, family=family, timeout=240, **{**cases.MODES[mode], **(arguments or {})})
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


def vision_cell(pool: RankPool, family: str, kind: str, mode: str) -> dict:
    try:
        if mode in VISION_CASES:
            results = pool.run(VISION_CASES[mode], config={}, family=family, kind=kind, timeout=240)
        else:
            results = pool.run(vcases.classify, family=family, kind=kind, timeout=240, **cases.MODES[mode])
    except RankTimeout as e:
        return {"status": "crash", "detail": f"timed out: {e}"}
    except RankFailure as e:
        return {"status": "crash", "detail": str(e).strip().splitlines()[-1]}
    worst = {"exact": 0, "refused": 1, "unproven": 2, "mismatch": 2, "crash": 3}
    return max(results, key=lambda r: worst[r["status"]])


def run_vision_rows(pool: Callable[[int], RankPool], only: list[str] | None, modes: list[str],
                    rows: dict[str, dict[str, str]]) -> Iterator[tuple[str, str, str]]:
    """As run_rows, for the vision, multimodal and speech section."""
    for family, kind in vcases.vision_families():
        if only and family not in only:
            continue
        reason = vcases.can_build(family, kind)
        texts = {"kind": kind}
        yield family, "kind", kind
        for mode in modes:
            needed = NEEDS_EXACT.get(mode)
            needed_text = texts.get(needed, rows.get(family, {}).get(needed, NOT_RUN)) if needed else ""
            if reason:
                texts[mode] = f"skipped: {reason}"
            elif vision_not_applicable(mode, kind):
                texts[mode] = f"not run: {vision_not_applicable(mode, kind)}"
            elif needed and not needed_text.startswith("exact"):
                texts[mode] = f"not run: {needed_text.split(':')[0]} under {COLUMNS[needed]}"
            else:
                world = cases.WORLD.get(mode, 2)
                texts[mode] = cell_text(vision_cell(pool(world), family, kind, mode))
            print(family, mode, texts[mode][:160], flush=True)
            yield family, mode, texts[mode]


def run_rows(pool: Callable[[int], RankPool], only: list[str] | None, modes: list[str],
             rows: dict[str, dict[str, str]]) -> Iterator[tuple[str, str, str]]:
    """(family, mode, cell text) as each cell finishes; `pool(world)` gives the ranks, `rows` the
    cells known so far (for NEEDS_EXACT)."""
    for family, reason in families(only):
        reason = reason or cases.can_build(family)
        texts = {}
        for mode in modes:
            needed = NEEDS_EXACT.get(mode)
            needed_text = texts.get(needed, rows.get(family, {}).get(needed, NOT_RUN)) if needed else ""
            if reason:
                texts[mode] = f"skipped: {reason}"
            elif needed and not needed_text.startswith("exact"):
                texts[mode] = f"not run: {needed_text.split(':')[0]} under {COLUMNS[needed]}"
            else:
                world = cases.WORLD.get(mode, 2)
                preferred, otherwise = FALLBACK.get(mode, (None, {}))
                preferred_text = texts.get(preferred, rows.get(family, {}).get(preferred, NOT_RUN))
                arguments = otherwise if preferred and not preferred_text.startswith("exact") else {}
                texts[mode] = cell_text(cell(pool(world), family, mode, arguments))
            print(family, mode, texts[mode][:160], flush=True)
            yield family, mode, texts[mode]


def data_path(out: str) -> str:
    """The full cell texts live beside the page (`evidence/model-coverage.json`): the page shows a
    verdict per cell and each distinct reason once, the JSON keeps every word for reruns."""
    return os.path.splitext(out)[0] + ".json"


def read_rows(path: str) -> dict[str, dict[str, str]]:
    """family -> {mode: cell text} this script wrote earlier (none if there is none yet). Reads
    the JSON beside `path`; a page written before the JSON existed is parsed by its header."""
    if os.path.exists(data_path(path)):
        with open(data_path(path)) as f:
            return json.load(f)["cells"]
    if not os.path.exists(path):
        return {}
    by_title = {title: mode for mode, title in COLUMNS.items()}
    rows, header = {}, None
    for line in open(path).read().splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "family":
            header = [by_title.get(title) for title in cells[1:]]
        elif header and len(cells) == len(header) + 1:
            rows[cells[0]] = {mode: text for mode, text in zip(header, cells[1:]) if mode}
    return rows


def read_vision_rows(path: str) -> dict[str, dict[str, str]]:
    """family -> {"kind": kind, mode: cell text} of the vision section (none if there is none yet)."""
    if not os.path.exists(data_path(path)):
        return {}
    with open(data_path(path)) as f:
        return json.load(f).get("vision", {})


def verdict(text: str) -> tuple[str, str | None]:
    """('refused', reason) from 'refused: reason'; ('exact', note) from 'exact (note)'."""
    status = re.match(r"[\w ]+?(?=:|$| \()", text).group()
    rest = text[len(status):].strip()
    if rest.startswith(":"):
        rest = rest[1:].strip()
    elif rest.startswith("(") and rest.endswith(")"):
        rest = rest[1:-1].strip()
    return status, rest or None


INTRO = """\
What each cell says: whether `smp.transform` with that column's config trains the family exactly
like one process. **exact**: one SGD step gives the loss and every gradient within 1e-5 of the same
model in one process (delayed init: every parameter and buffer also bitwise equal to eager
construction; TP: at least one parameter really split; offloading: activations really moved to
host). **refused [n]**: smp raised its own error before training, reason *n* below. **skipped [n]**:
the family cannot be built or run from `input_ids` alone at the tiny shape (such families are
listed under the table, not in it). **not run [n]**: the column does not apply, reason *n*. **unproven**: within 1e-5 but the mode did nothing. A
**crash** or **mismatch** appears only in the peer's column: they are findings about transformers.

How it is made: `scripts/model_coverage.py` (do not edit by hand; full cell texts in
`model-coverage.json` beside this page; the summary is [docs/model-coverage.md](../docs/model-coverage.md)), families from transformers' registry (every causal-LM
family whose config ships a `base_model_tp_plan`) plus BERT masked LM, T5 and GPT-2, at hidden 64,
2 layers, 4 heads, 2 KV heads, vocab 256, intermediate 128. TP columns use the model's own plan;
SP also shards the norms and dropout regions along the sequence; *TP2 x FSDP2 + SP* runs for the
families exact at TP 2 + SP. *Peer TP 2* is transformers' own tensor parallelism on the same
folder (`from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))`) against the same
folder in one process. *AC + offload* wraps every block in full checkpointing and offloads every
saved activation (`activation_offload_min_bytes: 0`). A family whose training forward draws random
numbers (PhiMoE's sampled routing) is compared in eval mode and says so. *Packed* runs a packed
batch (4 rows of 3 documents, position ids restarting at each document, each document's first
token not a target, no attention mask: what `DataCollatorWithFlattening` and TRL's padding-free
packing make) through `smp.step` under TP 2 + SP, or FSDP 2 for a family not exact at TP 2 + SP
(the cell says so), against one process on the same batch; that one-process run is first held to
the documents run one by one (1e-5), and a family whose transformers model attends across the
documents is *not run* with the two gaps, never exact (causal LMs only). *LoRA x TP 2* wraps the
family in PEFT LoRA (rank 4, adapters random at start) on every linear layer but the head, and
compares the loss and every gradient with the same PEFT model in one process (exact needs at
least one adapter split). The hand-built TP cases
behind this (per-head norms, MoE experts, gathered regions, user plans, negative controls) are in
[Tensor parallelism](../docs/tensor-parallel.md)."""


def render(rows: dict[str, dict[str, str]], vision_rows: dict[str, dict[str, str]] | None = None) -> str:
    """The matrix in registry order (families no longer in the registry dropped): a verdict per
    cell, each distinct reason once as a numbered footnote, then totals per column."""
    counts: dict[str, dict[str, int]] = {mode: {} for mode in COLUMNS}
    reasons: dict[str, int] = {}  # full reason text -> footnote number, in order of first use
    table, skipped = [], {}  # skipped: footnote number -> families skipped in every column for it
    for family, _ in families(None):
        if family not in rows:
            continue
        cells = []
        for mode in COLUMNS:
            status, reason = verdict(rows[family].get(mode, NOT_RUN))
            if status != "skipped":
                counts[mode][status] = counts[mode].get(status, 0) + 1
            if reason:
                number = reasons.setdefault(f"{status}: {reason}", len(reasons) + 1)
                status = f"{status} [{number}]"
            cells.append(status)
        if len(set(cells)) == 1 and cells[0].startswith("skipped"):
            skipped.setdefault(cells[0], []).append(family)  # one line under the table, not a row
        else:
            table.append(f"| {family} | " + " | ".join(cells) + " |")
    lines = [
        "# Model coverage",
        "",
        f"Every transformers family smp was run on, by parallelism mode (generated {datetime.date.today().isoformat()}).",
        "",
        INTRO,
        "",
        f"| family | {' | '.join(SHORT[m] for m in COLUMNS)} |",
        f"|---|{'---|' * len(COLUMNS)}",
        *table,
        "",
        "Skipped in every column: " + "; ".join(f"{', '.join(fams)} ({cell})" for cell, fams in skipped.items()) + ".",
        "",
        "Columns: " + "; ".join(f"*{SHORT[m]}*: {COLUMNS[m]}" for m in COLUMNS) + ".",
        "",
        "Totals (skipped families not counted):",
        "",
        *(f"- {SHORT[m]}: " + ", ".join(f"{n} {status}" for status, n in sorted(c.items())) for m, c in counts.items()),
        "",
        peer_summary(rows),
        "",
        *render_vision(vision_rows or {}, reasons),
        "## Reasons",
        "",
        *(f"{n}. {text}" for text, n in reasons.items()),
        "",
    ]
    return "\n".join(lines)


VISION_INTRO = """\
Families from transformers' auto mappings, each under the first of these kinds that lists it:
image-text-to-text (*image-text*), zero-shot image classification (*contrastive*), image
classification, vision backbones, speech seq2seq, audio classification and CTC; nothing is listed
by hand. Each is built from its default config with every size shrunk (nested text, vision and
audio configs too: hidden 64, 2 layers, 4 heads, vocab 256; convolutional stages 16 channels wide)
and fed inputs of its modality without a processor: image tokens counted from the model's own
`get_image_features`, pixel values at the config's image size, mel features at the encoder's
length, raw audio for wav2vec2-style encoders. Losses: the LM loss with labels (image tokens
unlabelled) for image-text and speech seq2seq, the classification or CTC loss with labels, the
global-batch contrastive loss (`smp.vision.clip_loss` / `siglip_loss` over embeddings gathered
with gradient) for CLIP-like models, a feature-map loss for backbones. Cells as above, except
that a gradient gap is taken relative to the reference gradient where that exceeds 1 (the tiny
default init gives Gemma3's projector gradients of 2e9, where float32 rounding alone is 3e2), and
a family whose training forward draws random numbers is compared in eval mode and says so; *mixed
batch* runs image-text families with images on rank 0 only (rank 1's rows are text-only, the same
labelled length) against one process on the whole batch; *pretrained round trip* is bitwise;
*pretrained on meta* is the path a large fine-tune takes (built on the meta device, then
`smp.transform(model, weights=folder)`), bitwise against `from_pretrained` + transform in every
parameter and every buffer, the non-persistent ones too, where *delayed init* (random init
replayed) refuses a family whose construction it cannot reproduce.
A family that does not build or train in one process at the tiny shape is skipped with the
error (a limit of the generic tiny config, not of smp). Unlike the text table's peer column, a
**crash** or **mismatch** here is an open finding about smp (the script exits 1 on it)."""


def render_vision(rows: dict[str, dict[str, str]], reasons: dict[str, int]) -> list[str]:
    """The vision, multimodal and speech section's lines; footnote numbers continue `reasons`."""
    if not rows:
        return []
    columns = vision_columns()
    counts: dict[str, dict[str, int]] = {mode: {} for mode in columns}
    table, skipped = [], []
    for family, kind in vcases.vision_families():
        if family not in rows:
            continue
        cells = []
        for mode in columns:
            status, reason = verdict(rows[family].get(mode, NOT_RUN))
            if status != "skipped":
                counts[mode][status] = counts[mode].get(status, 0) + 1
            if reason and status != "skipped":
                number = reasons.setdefault(f"{status}: {reason}", len(reasons) + 1)
                status = f"{status} [{number}]"
            cells.append(status)
        if all(c == "skipped" for c in cells):
            skipped.append(f"{family} ({kind}): {verdict(rows[family][next(iter(columns))])[1]}")
        else:
            table.append(f"| {family} | {kind} | " + " | ".join(cells) + " |")
    return [
        "## Vision, multimodal and speech families",
        "",
        VISION_INTRO,
        "",
        f"| family | kind | {' | '.join(vision_short(m) for m in columns)} |",
        f"|---|---|{'---|' * len(columns)}",
        *table,
        "",
        "Columns: " + "; ".join(f"*{vision_short(m)}*: {t}" for m, t in columns.items()) + ".",
        "",
        "Totals (skipped families not counted):",
        "",
        *(f"- {vision_short(m)}: " + ", ".join(f"{n} {status}" for status, n in sorted(c.items())) for m, c in counts.items()),
        "",
        f"Skipped ({len(skipped)} families: they do not build or train in one process at the tiny shape):",
        "",
        *(f"- {line}" for line in skipped),
        "",
    ]


def peer_summary(rows: dict[str, dict[str, str]]) -> str:
    """One line comparing smp's TP=2 column with the peer's, family by family."""
    # families built here with both cells computed, in registry order
    listed = [f for f, _ in families(None)
              if f in rows and NOT_RUN not in (rows[f].get("tp2", NOT_RUN), rows[f].get("peer", NOT_RUN))
              and not rows[f]["peer"].startswith("skipped")]
    smp_exact = {f for f in listed if rows[f]["tp2"].startswith("exact")}
    peer_exact = {f for f in listed if rows[f]["peer"].startswith("exact")}
    only_peer = [f for f in listed if f in peer_exact - smp_exact]
    only_smp = [f for f in listed if f in smp_exact - peer_exact]
    return (f"smp vs transformers' own TP=2, over the {len(listed)} families with both cells: the peer is exact "
            f"on {len(peer_exact)}, smp on {len(smp_exact)}. Exact in the peer but not in smp: {len(only_peer)}"
            f"{' (' + ', '.join(only_peer) + ')' if only_peer else ''}. Exact in smp but not in the peer: "
            f"{len(only_smp)}{' (' + ', '.join(only_smp) + ')' if only_smp else ''}.")


# Kinds of refusal, for the summary: (pattern in the cell text, what it means for the user).
# A refusal matching none is listed under "other", with its own first words.
REFUSAL_KINDS = [
    (r"has no tensor-parallel plan", "no tensor-parallel plan: the family ships none and smp's table has none "
                                     "(give `tp_plan=` or `tensor_parallel.plan`)"),
    (r"normalises with the batch statistics", "BatchNorm in training mode: each rank would normalise its own rows "
                                              "(eval mode, frozen norms, or SyncBatchNorm)"),
    (r"blank image|image path", "mixed batch: the image path cannot run on a rank whose rows have no image"),
    (r"delayed initialisation cannot", "delayed init: construction that smp cannot replay on the meta device "
                                       "(build eagerly, or `transform(weights=folder)`)"),
    (r"lora_[AB]\.\w+\.weight .* is replicated inside the split region",
     "LoRA on a whole layer inside a split region (MLA's q_a_proj): smp cannot tell whether its adapter's "
     "gradient is whole (leave that layer out of target_modules)"),
    (r"replicated inside the split region", "a replicated parameter inside a tensor-parallel region"),
    (r"carries LoRA adapters and its plan style is",
     "LoRA beside a layer the plan splits other than plain column- or row-wise (gathered, fused or expert "
     "styles): leave it out of target_modules, or out of the plan"),
    (r"pipeline stages|base_model_pp_plan|smp splits a transformers causal LM",
     "pipeline split: the forward does more between layers than smp can place on stages"),
    (r"sequence_parallel", "sequence parallel does not apply to this model's regions"),
    (r"fused \[gate / up\]|all_reduce", "a fused or shared layer the plan would split wrongly"),
    (r"tied parameters differently", "tied parameters split differently by the plan"),
    (r"ScaledWordEmbedding|style 'embedding", "an embedding the plan splits in a way its forward does not allow"),
    (r"leaves tensors of this model unloaded", "transformers' own `from_pretrained` leaves tensors unloaded"),
]


# Kinds of "not run" (the column does not apply to the family), for the summary's text section,
# as REFUSAL_KINDS.
NOT_RUN_KINDS = [
    (r"not packing-aware in transformers", "packed rows: transformers' model mixes tokens across the documents "
                                           "(its mask ignores position_ids, or a convolution or linear-attention "
                                           "layer crosses them), in one process already: train it unpacked"),
    (r"cannot run the packed rows", "packed rows: transformers' model fails on them in one process"),
    (r"is not a causal LM", "packed rows: not a causal LM"),
    (r"splits none of the linear layers LoRA adapts", "LoRA x TP 2: the plan splits none of the adapted layers "
                                                      "(only the experts), the adapters run whole"),
    (r"PEFT cannot wrap|PEFT's LoRA model fails", "LoRA: PEFT itself refuses or fails on the family's linears"),
    (r"under TP=2 \+ sequence parallel", "not exact at TP 2 + SP on world 2, so not run on world 4"),
]


def refusal_kind(text: str, kinds: list[tuple[str, str]] = REFUSAL_KINDS) -> str:
    for pattern, meaning in kinds:
        if re.search(pattern, text):
            return meaning
    return "other: " + re.sub(r"\s+", " ", text)[:90]


def summary_section(title: str, rows: dict[str, dict[str, str]], columns: dict[str, str],
                    list_not_run: bool = False) -> list[str]:
    """Totals per column, the families exact in every column that ran, and each kind of refusal
    (and, with `list_not_run`, of "not run") with the families (and columns) it hit."""
    counts: dict[str, collections.Counter] = {mode: collections.Counter() for mode in columns}
    everywhere, skipped, odd = [], [], []
    kinds: dict[str, dict[str, list[str]]] = {}
    not_run: dict[str, dict[str, list[str]]] = {}
    for family, row in rows.items():
        statuses = {mode: verdict(row.get(mode, NOT_RUN))[0] for mode in columns}
        if all(s == "skipped" for s in statuses.values()):
            skipped.append(family)
            continue
        for mode, status in statuses.items():
            counts[mode][status] += 1
            if status == "refused":
                kinds.setdefault(refusal_kind(row[mode]), {}).setdefault(family, []).append(columns[mode])
            elif status == "not run" and list_not_run and mode != "peer":
                not_run.setdefault(refusal_kind(row[mode], NOT_RUN_KINDS), {}).setdefault(family, []).append(columns[mode])
            elif status in ("crash", "mismatch", "unproven") and mode != "peer":
                odd.append(f"{family} ({columns[mode]}: {status})")
        if all(s in ("exact", "not run") for m, s in statuses.items() if m != "peer"):
            everywhere.append(family)
    statuses = sorted({s for c in counts.values() for s in c})
    lines = [
        f"## {title}",
        "",
        f"| column | {' | '.join(statuses)} |",
        f"|---|{'---|' * len(statuses)}",
        *(f"| {columns[m]} | " + " | ".join(str(counts[m][s] or "") for s in statuses) + " |" for m in columns),
        "",
        f"Exact in every column that applies ({len(everywhere)}): {', '.join(everywhere)}.",
        "",
    ]
    if odd:
        lines += [f"Neither exact nor refused: {'; '.join(odd)}.", ""]
    lines += ["Refused, by kind (family: columns):", ""]
    for meaning, by_family in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        listed = "; ".join(f"{f}: {', '.join(cols)}" if len(cols) < len(columns) - 1 else f"{f}: most" for f, cols in by_family.items())
        lines.append(f"- **{meaning}** ({len(by_family)}): {listed}")
    if not_run:
        lines += ["", "Not run (the column does not apply), by reason (family: columns):", ""]
        for meaning, by_family in sorted(not_run.items(), key=lambda kv: -len(kv[1])):
            listed = "; ".join(f"{f}: {', '.join(cols)}" for f, cols in by_family.items())
            lines.append(f"- **{meaning}** ({len(by_family)}): {listed}")
    if skipped:
        lines += ["", f"Not built at the tiny shape ({len(skipped)}; a limit of the generic tiny config): {', '.join(skipped)}."]
    return lines + [""]


def render_summary(rows: dict[str, dict[str, str]], vision_rows: dict[str, dict[str, str]] | None = None) -> str:
    """docs/model-coverage.md: what a user needs to know of the matrix in a few screens; the
    per-family matrix with every reason is the evidence page beside the JSON."""
    text_rows = {f: rows[f] for f, _ in families(None) if f in rows}
    vision = vision_rows or {}
    vision_ordered = {f: vision[f] for f, _ in vcases.vision_families() if f in vision}
    lines = [
        "# Model coverage",
        "",
        "Every transformers family smp was run on, in each parallelism mode. A family is **exact** in a "
        "column when `smp.transform` with that column's config gives the loss and every gradient of one "
        "SGD step within 1e-5 of the same model in one process (delayed init and pretrained loads: every "
        "parameter and buffer bitwise); **refused** when smp raised its own error, naming the module and "
        "the fix, before training. Nothing in between: a family smp cannot prove is refused.",
        "",
        "Families come from transformers' registry (every causal-LM family whose config ships a "
        "`base_model_tp_plan`, plus BERT, T5 and GPT-2; vision, multimodal and speech families from its "
        "auto mappings), built tiny (hidden 64, 2 layers, 4 heads, vocab 256). The per-family matrix with "
        "every reason is [evidence/model-coverage.md](../evidence/model-coverage.md); "
        "`.venv/bin/python scripts/model_coverage.py` reruns it (`--render-only` rewrites both pages).",
        "",
        "Two columns are about fine-tuning data and adapters. *packed*: rows holding several documents back to "
        "back, position ids restarting at each, no attention mask (transformers' `DataCollatorWithFlattening`, "
        "TRL's padding-free packing), trained with `smp.step` under TP 2 + sequence parallel (FSDP 2 where the "
        "family is not exact at TP 2 + SP) against one process, whose own packed run must first equal the "
        "documents run one by one: a family whose transformers model mixes the documents is *not run*, never "
        "exact. *LoRA x TP 2*: PEFT LoRA on every linear layer but the head, under TP 2, against the same PEFT "
        "model in one process.",
        "",
        *summary_section("Language models", text_rows, {m: SHORT[m] for m in COLUMNS}, list_not_run=True),
        *summary_section("Vision, multimodal and speech", vision_ordered,
                         {m: vision_short(m) for m in vision_columns()}),
        "The peer column (transformers' own TP 2) is there for comparison: its crashes and mismatches are "
        "findings about transformers, not smp.",
        "",
    ]
    return "\n".join(lines)


def write_merged(path: str, computed: dict[str, dict[str, str]],
                 vision_computed: dict[str, dict[str, str]] | None = None, summary: str | None = None) -> None:
    """Re-read the cells and write them back with every cell of `computed` (all this run has
    computed, not only the last cell: a concurrent run that rewrote the files from an older copy
    loses nothing of ours at our next write) and every other cell as it stands now. Runs of this
    script take turns through a lock file, and each file is replaced whole, never half-written."""
    lock = os.path.join(tempfile.gettempdir(), "model-coverage-" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12] + ".lock")
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        rows, vision = read_rows(path), read_vision_rows(path)
        for family, texts in computed.items():
            rows[family] = {**rows.get(family, {}), **texts}
        for family, texts in (vision_computed or {}).items():
            vision[family] = {**vision.get(family, {}), **texts}
        replace_whole(data_path(path), json.dumps({"cells": rows, "vision": vision}, indent=1, sort_keys=True) + "\n")
        replace_whole(path, render(rows, vision))
        if summary:
            replace_whole(summary, render_summary(rows, vision))


def replace_whole(path: str, text: str) -> None:
    staged = f"{path}.{os.getpid()}.tmp"
    with open(staged, "w") as f:
        f.write(text)
    os.replace(staged, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated subset (default: all)")
    parser.add_argument("--modes", help=f"comma-separated columns to run (default: all): {', '.join(COLUMNS)}")
    parser.add_argument("--out", default=os.path.join(ROOT, "evidence", "model-coverage.md"))
    parser.add_argument("--summary", default=os.path.join(ROOT, "docs", "model-coverage.md"),
                        help="the user's page rewritten from the same cells")
    parser.add_argument("--render-only", action="store_true", help="rewrite the page from the stored cells; run nothing")
    parser.add_argument("--section", choices=("text", "vision"), default="text",
                        help="text: the causal-LM table; vision: the vision, multimodal and speech families")
    args = parser.parse_args()
    if args.render_only:
        write_merged(args.out, {}, summary=args.summary)
        return 0
    os.environ.setdefault("TRITON_INTERPRET", "1")
    only = args.families.split(",") if args.families else None
    known = vision_columns() if args.section == "vision" else COLUMNS
    modes = args.modes.split(",") if args.modes else list(known)
    unknown = sorted(set(modes) - set(known))
    if unknown:
        parser.error(f"unknown --modes {unknown}; choose from {list(known)}")
    rows = read_vision_rows(args.out) if args.section == "vision" else read_rows(args.out)
    computed: dict[str, dict[str, str]] = {}  # family -> {mode: cell text} of this run
    pools: dict[int, RankPool] = {}

    def pool(world: int) -> RankPool:
        if world not in pools:
            pools[world] = RankPool(world)
        return pools[world]

    try:
        vision = args.section == "vision"
        for family, mode, text in (run_vision_rows if vision else run_rows)(pool, only, modes, rows):
            computed.setdefault(family, {})[mode] = text
            # after each cell: an interrupted run keeps its cells
            write_merged(args.out, {} if vision else computed, computed if vision else None, summary=args.summary)
    finally:
        for p in pools.values():
            p.close()
    # the peer's crashes and mismatches are findings about transformers, not failures of smp
    bad = sorted(f for f, texts in computed.items()
                 if any(t.startswith(("crash", "mismatch", "unproven")) for mode, t in texts.items()
                        if mode not in ("peer", "kind")))
    if bad:
        print(f"neither exact nor refused: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
