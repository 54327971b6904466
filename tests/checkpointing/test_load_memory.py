"""Resident memory of `smp.transform(meta model, weights=folder)` per rank, loosely (the
benchmark, bench/bench_load_memory.py, holds the 1.10 target on a 0.47B model): the peak above
the rank's memory before the load stays within 1.5x of (model / world + largest tensor) on a
small Llama at world 2, FSDP and TP. Negative control beside it: the same load with each read
through a mapping of the whole file kept to the end (safetensors' way) exceeds the bound under
TP, whose column-split weights touch every page of the file."""

import pytest

from tests.checkpointing import load_memory_cases as cases

LOOSE = 1.5


@pytest.mark.parametrize("config", [{}, {"tensor_parallel_degree": 2}], ids=["fsdp2", "tp2"])
def test_load_holds_its_shard_and_one_tensor(ranks, tmp_path, config):
    for r in ranks(2).run(cases.load_ratio, config=config, root=str(tmp_path), mapped=False, timeout=240):
        assert r["ratio"] <= LOOSE, r


def test_mapped_reads_exceed_the_bound(ranks, tmp_path):
    """The negative control: a mapping kept open holds the file's touched pages resident."""
    for r in ranks(2).run(cases.load_ratio, config={"tensor_parallel_degree": 2}, root=str(tmp_path),
                          mapped=True, timeout=240):
        assert r["ratio"] > LOOSE, r


@pytest.mark.parametrize("piece_bytes", [4096, 1 << 30], ids=["pieces", "one_piece"])
def test_export_in_pieces_is_bitwise(ranks, tmp_path, piece_bytes):
    """export_hf writes each rank's shards in files of a bounded part of the model (what bounds its
    memory), consolidated into the requested files: from_pretrained of the folder is bitwise the
    model, with pieces finer and coarser than the output files."""
    for r in ranks(2).run(cases.export_in_pieces, config={}, root=str(tmp_path), piece_bytes=piece_bytes):
        assert r["differ"] == [] and len(r["files"]) > 1, r


def test_eager_path_is_named_with_its_cost():
    """(One process) A model built whole, about to be sharded over 2 ranks, gets the line
    transform logs: its whole size per rank and the meta path's figure, naming
    transform(weights=); a meta model, or one that is not sharded, gets none."""
    import torch
    from transformers import LlamaForCausalLM

    from smp.checkpointing.hf import eager_load_note

    model = LlamaForCausalLM(cases._config())
    whole = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    note = eager_load_note(model, shard_ranks=2)
    assert note and "weights=FOLDER" in note and f"whole on every rank ({whole / 2**30:.2f} GiB" in note, note
    with torch.device("meta"):
        meta = LlamaForCausalLM(cases._config())
    assert eager_load_note(meta, shard_ranks=2) is None
    assert eager_load_note(LlamaForCausalLM(cases._config()), shard_ranks=1) is None


def test_plan_reports_host_memory_while_loading():
    """(One process) `smp plan` gives both loading figures: the whole model for the eager path,
    this rank's shards + the largest tensor + one read slab for transform(weights=)."""
    import torch
    from transformers import LlamaForCausalLM

    from smp.checkpointing.hf.read import CHUNK_BYTES
    from smp.planning import plan

    with torch.device("meta"):
        model = LlamaForCausalLM(cases._config())
    sizes = [t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())]
    result = plan({}, cases._config(), 2)
    assert result.load_host_bytes["eager"] == sum(sizes), (result.load_host_bytes, sum(sizes))
    expected = sum(sizes) / 2 + max(sizes) + CHUNK_BYTES  # buffers, whole on every rank, counted once
    assert abs(result.load_host_bytes["weights"] - expected) < 2**20, (result.load_host_bytes, expected)
    assert "host memory while loading" in result.format()


def test_read_box_equals_slicing(tmp_path, monkeypatch):
    """(One process) read.read_box of boxes cut every way equals slicing the tensor: whole rows,
    a column split (each row's part read straight into place), a cut in a later dim (slabs of
    whole rows); into the file's dtype, cast (bf16 -> fp32, fp32 -> fp64) and into a strided
    destination; also through a file whose reads stop short after 100 bytes (resumed).
    Negative control: every read shifted 2 bytes further into the file differs."""
    import torch
    from safetensors.torch import save_file

    from smp.checkpointing import storage
    from smp.checkpointing.hf import read as hf_read

    torch.manual_seed(0)
    tensors = {"a": torch.randn(1300, 96), "b": torch.randn(7, 10, 12), "c": torch.randn(600, 40).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    entries, _ = hf_read.read_header(str(tmp_path / "m.safetensors"))
    boxes = [("a", [5, 17], [1200, 40]), ("a", [0, 48], [1300, 48]), ("a", [2, 0], [700, 96]),
             ("b", [1, 3, 0], [5, 4, 12]), ("b", [1, 3, 2], [5, 4, 7]), ("c", [3, 1], [590, 13])]

    def differing() -> list[str]:
        wrong = []
        for name, offsets, sizes in boxes:
            expected = tensors[name]
            for dim, (o, z) in enumerate(zip(offsets, sizes)):
                expected = expected.narrow(dim, o, z)
            for dtype in {tensors[name].dtype, torch.float32, torch.float64}:
                for strided in (False, True):
                    out = torch.empty(sizes, dtype=dtype)
                    if strided:
                        out = torch.empty([sizes[1], sizes[0], *sizes[2:]], dtype=dtype).transpose(0, 1)
                    hf_read.read_box(entries[name], offsets, sizes, out)
                    if not torch.equal(out, expected.to(dtype)):
                        wrong.append(f"{name}{offsets}{sizes}:{dtype}:{'strided' if strided else 'contiguous'}")
        return wrong

    assert differing() == []
    read_into = storage.RangeFile.read_into
    monkeypatch.setattr(storage.RangeFile, "read_into", lambda self, view, offset: read_into(self, view[:100], offset))
    assert differing() == []
    monkeypatch.setattr(storage.RangeFile, "read_into", lambda self, view, offset: read_into(self, view, offset + 2))
    reads = sum(2 * len({tensors[name].dtype, torch.float32, torch.float64}) for name, _, _ in boxes)
    assert len(differing()) == reads  # every read, whichever path it took


@pytest.mark.parametrize("family", ["gpt2", "mixtral"])
def test_export_of_packed_weights_in_boxes_is_bytewise(ranks, tmp_path, family):
    """export_hf at TP 2, where GPT-2's c_attn (q|k|v) / Mixtral's gate_up_proj (gate|up) are
    packed parts written box by box (never gathered whole), writes safetensors files and index
    byte-identical to the export of the same model at FSDP 2 (plain shards). Negative control:
    the boxes of a packed weight put into one file (one chunk per name per file: all but one
    lost) differ."""
    plain = ranks(2).run(cases.export_packed, config={}, root=str(tmp_path / "fsdp"), family=family)[0]
    boxed = ranks(2).run(cases.export_packed, config={"tensor_parallel_degree": 2}, root=str(tmp_path / "tp"),
                         family=family)[0]
    assert plain["packed"] == [] and boxed["packed"], (plain, boxed)
    assert len(plain["files"]) > 2 and boxed["files"] == plain["files"], (plain, boxed)
    one_file = ranks(2).run(cases.export_packed, config={"tensor_parallel_degree": 2}, root=str(tmp_path / "control"),
                            family=family, one_file=True)[0]
    assert one_file["files"] != plain["files"], one_file
