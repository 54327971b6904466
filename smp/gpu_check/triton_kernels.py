"""Step 2 (CUDA only): smp_collectives' fused Triton kernels, compiled for the device.

Gradient sync's kernels: bitwise equality with the torch path (int8 and fp8, with error
feedback), then bandwidth: quantise + error feedback and dequantise + accumulate, in GB/s of the
bytes each must move, against a device-to-device copy measured in the same run (goal: >= 70% of
it) and against the unfused torch chain. The parameter gather's kernels (`parameter_gather:`):
encode a bf16 shard into its message row and decode the gathered rows into bf16 parameters,
bitwise equal to the torch path (int8 and fp8), and their bandwidth against the same copy. On
CPU the test suite runs the same kernels under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch

from smp.gpu_check.report import Figure, StepResult, check, skipped
from smp.gpu_check.timing import cuda_seconds

NAME, TITLE = "triton_kernels", "Triton kernels (smp_collectives)"
BLOCK = 256
ROWS = 8  # destinations of a reduce-scatter (world 8)
# Per row: 8 x 32 Mi fp32 = 1 GiB per bucket, far past any cache, and long enough that the
# dequantise (8 bytes in 5 per element: ~0.15 ms on an H100) is timed, not its ~30 us launch
# from Python (at 8 Mi per row the timed fraction swung 0.58-0.86 between runs).
COLS = 2**25
BANDWIDTH_GOAL = 0.70


def _compile_error(device: torch.device) -> str | None:
    """Why the kernels cannot be compiled and launched here, or None when they can."""
    try:
        from smp_collectives import quantization

        x = torch.randn(2, 1024, device=device)
        quantization.quantize(x, BLOCK, "int8", impl="triton")
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure here means no usable Triton
        return f"Triton cannot compile or launch its kernels here ({type(e).__name__}: {e})"
    return None


def bitwise(device: torch.device, kind: str) -> list[Figure]:
    from smp_collectives import quantization

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(ROWS, 100_000, device=device, generator=g) * 3  # short last block in each row
    res_t = torch.randn(x.shape, device=device, generator=g) * 1e-2
    res_k = res_t.clone()
    q_t, s_t = quantization.quantize(x, BLOCK, kind, residual=res_t, impl="torch")
    q_k, s_k = quantization.quantize(x, BLOCK, kind, residual=res_k, impl="triton")
    quantise_equal = torch.equal(q_t, q_k) and torch.equal(s_t, s_k) and torch.equal(res_t, res_k)
    acc_t = quantization.dequantize_accumulate(q_t, s_t, BLOCK, kind, divisor=ROWS, impl="torch")
    acc_k = quantization.dequantize_accumulate(q_t, s_t, BLOCK, kind, divisor=ROWS, impl="triton")
    return [
        check(f"{kind} quantise + error feedback: bitwise equal to torch", quantise_equal, quantise_equal, "True"),
        check(f"{kind} dequantise + accumulate: bitwise equal to torch", torch.equal(acc_t, acc_k),
              torch.equal(acc_t, acc_k), "True"),
    ]


def bandwidth(device: torch.device, repeats: int) -> list[Figure]:
    from smp_collectives import quantization

    x = torch.randn(ROWS, COLS, device=device)
    residual = torch.zeros_like(x)
    n, blocks = x.numel(), x.numel() // BLOCK
    copy_dst = torch.empty_like(x)
    copy_s = cuda_seconds(lambda: copy_dst.copy_(x), repeats)
    copy_gbs = 2 * n * 4 / copy_s / 1e9  # read + write
    # Bytes each kernel must move: read x and the residual, write the residual, codes, scales.
    quant_bytes = n * 4 * 3 + n + blocks * 4
    q, s = quantization.quantize(x, BLOCK, "int8", impl="triton")
    # Reads all rows' codes and scales, writes one fp32 row.
    deq_bytes = n + blocks * 4 + COLS * 4
    out = torch.empty(COLS, device=device)
    timings = {}
    for impl in ("triton", "torch"):
        timings[("quantise", impl)] = cuda_seconds(
            lambda: quantization.quantize(x, BLOCK, "int8", residual=residual, impl=impl), repeats)
        timings[("dequantise", impl)] = cuda_seconds(
            lambda: quantization.dequantize_accumulate(q, s, BLOCK, "int8", ROWS, impl=impl, out=out), repeats)
    figures = [Figure("device copy bandwidth", copy_gbs, "GB/s", reason=f"{2 * n * 4 / 2**20:.0f} MiB moved per copy")]
    for what, nbytes in (("quantise + error feedback", quant_bytes), ("dequantise + accumulate", deq_bytes)):
        key = what.split()[0]
        gbs = nbytes / timings[(key, "triton")] / 1e9
        figures.append(Figure(f"{what}: Triton bandwidth", gbs, "GB/s"))
        figures.append(check(f"{what}: fraction of copy bandwidth", gbs / copy_gbs, gbs / copy_gbs >= BANDWIDTH_GOAL,
                             f">= {BANDWIDTH_GOAL:.2f}"))
        figures.append(Figure(f"{what}: speedup vs unfused torch chain",
                              timings[(key, "torch")] / timings[(key, "triton")], "x"))
    return figures


def gather_bitwise(device: torch.device, kind: str) -> list[Figure]:
    """The parameter gather's encode and decode: Triton vs torch on one bf16 shard per row."""
    from smp_collectives import parameter_gather as pg

    cols = 100_000  # a short last block
    width = pg.message_width(cols, BLOCK)
    g = torch.Generator(device=device).manual_seed(1)
    shards = (torch.randn(ROWS, cols, device=device, generator=g) * 3).to(torch.bfloat16)
    messages = {impl: torch.empty(ROWS, width, dtype=torch.uint8, device=device) for impl in ("torch", "triton")}
    for impl, message in messages.items():
        for row in range(ROWS):
            pg.encode_shard(shards[row], BLOCK, kind, message[row], impl=impl)
    encode_equal = torch.equal(messages["torch"], messages["triton"])
    decoded = {impl: pg.decode_message(messages["torch"], cols, BLOCK, kind,
                                       torch.empty(ROWS, cols, dtype=torch.bfloat16, device=device), impl=impl)
               for impl in ("torch", "triton")}
    decode_equal = torch.equal(decoded["torch"], decoded["triton"])
    return [
        check(f"parameter gather {kind} encode: bitwise equal to torch", encode_equal, encode_equal, "True"),
        check(f"parameter gather {kind} decode to bf16: bitwise equal to torch", decode_equal, decode_equal, "True"),
    ]


def gather_bandwidth(device: torch.device, repeats: int, copy_gbs: float) -> list[Figure]:
    """Encode one rank's bf16 shard (COLS values) and decode ROWS gathered rows into bf16."""
    from smp_collectives import parameter_gather as pg

    width = pg.message_width(COLS, BLOCK)
    shard = torch.randn(COLS, device=device).to(torch.bfloat16)
    message = torch.empty(ROWS, width, dtype=torch.uint8, device=device)
    pg.encode_shard(shard, BLOCK, "int8", message[0], impl="triton")
    message[1:] = message[0]
    out = torch.empty(ROWS, COLS, dtype=torch.bfloat16, device=device)
    encode_s = cuda_seconds(lambda: pg.encode_shard(shard, BLOCK, "int8", message[0], impl="triton"), repeats)
    decode_s = cuda_seconds(lambda: pg.decode_message(message, COLS, BLOCK, "int8", out, impl="triton"), repeats)
    # Bytes each must move: encode reads the bf16 shard, writes codes and scales; decode reads
    # every row's message and writes the bf16 parameters.
    moved = {"encode (bf16 shard -> message)": (2 * COLS + width, encode_s),
             "decode (messages -> bf16 parameters)": (ROWS * width + 2 * ROWS * COLS, decode_s)}
    figures = []
    for what, (nbytes, seconds) in moved.items():
        gbs = nbytes / seconds / 1e9
        figures.append(Figure(f"parameter gather int8 {what}: Triton bandwidth", gbs, "GB/s"))
        figures.append(check(f"parameter gather int8 {what}: fraction of copy bandwidth", gbs / copy_gbs,
                             gbs / copy_gbs >= BANDWIDTH_GOAL, f">= {BANDWIDTH_GOAL:.2f}"))
    return figures


def run(device: torch.device, *, size: str, steps: int, out_dir: str) -> StepResult:
    try:
        import triton  # noqa: F401
    except ImportError:
        return skipped(NAME, TITLE, "Triton is not installed")
    error = _compile_error(device)
    if error:
        return skipped(NAME, TITLE, error)
    result = StepResult(NAME, TITLE, notes=[f"block {BLOCK}, {ROWS} rows x {COLS} columns fp32 for bandwidth"])
    for kind in ("int8", "fp8"):
        result.figures += bitwise(device, kind)
    result.figures += bandwidth(device, repeats=max(steps, 20))
    for kind in ("int8", "fp8"):
        result.figures += gather_bitwise(device, kind)
    copy_gbs = next(f.value for f in result.figures if f.name == "device copy bandwidth")
    result.figures += gather_bandwidth(device, max(steps, 20), copy_gbs)
    return result.finish()
