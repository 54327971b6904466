"""The `smp` command: run (through torchrun), check (a config), plan (per-rank memory).

    smp run -n 4 train.py --config smp.yaml ...     # exec torchrun; multi-host flags pass through
    smp check smp.yaml --world-size 8                # validate; print the mesh and the recipe
    smp plan smp.yaml --model llama-8b --world-size 1024 --seq-len 4096 --device-memory 80
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

from smp._version import __version__
from smp.config import SMPConfig, json_schema, load_config
from smp.errors import UsageError
from smp.mesh import ParallelDims

# torchrun flags that mean "more than one host": with any of them smp adds no --standalone.
_MULTI_HOST_FLAGS = ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend",
                     "--master-addr", "--master_addr", "--node-rank", "--node_rank")


# ----------------------------------------------------------------------------------------------
# smp run


def torchrun_argv(nproc: int | str, script_and_args: Sequence[str], torchrun_args: Sequence[str] = ()) -> list[str]:
    """The torchrun command `smp run` executes: `python -m torch.distributed.run ...`."""
    if not script_and_args:
        raise UsageError("smp run: name the training script, e.g. `smp run -n 2 train.py --config smp.yaml`")
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    multi_host = any(a.split("=")[0] in _MULTI_HOST_FLAGS for a in torchrun_args)
    if not multi_host:
        argv.append("--standalone")  # one host: a private rendezvous on a free port
    return argv + list(torchrun_args) + list(script_and_args)


def parse_run_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(smp run's own options, torchrun's flags, the script and its arguments).

    Parsed by hand, not by argparse, so that nothing after the script is ever taken for an
    option of ours: the script is the first argument ending in .py, naming a file, after `--`,
    or the module after `-m`.
    """
    opts = argparse.Namespace(nproc="1", config=None, dry_run=False, help=False)
    torchrun: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg == "--":
            return opts, torchrun, list(argv[i + 1:])
        if name in ("-n", "--nproc-per-node", "--nproc_per_node", "--smp-config"):
            if not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"smp run: {name} needs a value")
                i, value = i + 1, argv[i + 1]
            setattr(opts, "config" if name == "--smp-config" else "nproc", value)
        elif arg == "--dry-run":
            opts.dry_run = True
        elif arg in ("-h", "--help"):
            opts.help = True
        elif arg in ("-m", "--module"):  # torchrun's module mode: `smp run -n 2 -m pkg.train ...`
            return opts, torchrun + [arg], list(argv[i + 1:])
        elif arg.endswith(".py") or (not arg.startswith("-") and os.path.isfile(arg)):
            return opts, torchrun, list(argv[i:])
        else:
            torchrun.append(arg)
        i += 1
    return opts, torchrun, []


def cmd_run(argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    opts, torchrun_args, script = parse_run_args(argv)
    if opts.help:
        parser.print_help()
        return 0
    argv = torchrun_argv(opts.nproc, script, torchrun_args)
    if opts.config:
        os.environ["SMP_CONFIG"] = os.path.abspath(opts.config)  # smp.init(None) reads it
    if opts.dry_run:
        print(" ".join(argv))
        return 0
    sys.stdout.flush()
    os.execv(argv[0], argv)  # torchrun replaces this process: its exit code is ours
    return 0  # unreachable


# ----------------------------------------------------------------------------------------------
# smp check


def describe_recipe(cfg: SMPConfig, dims: ParallelDims) -> list[str]:
    """What `smp.transform` would do with this config at this mesh, step by step."""
    lines = []
    if dims.tp > 1:
        tp = cfg.tensor_parallel
        plan = "the config's plan" if tp.plan else "the model's own plan (transformers base_model_tp_plan)"
        extra = ", sequence parallel" if tp.sequence_parallel else ""
        extra += ", loss parallel" if tp.loss_parallel else ""
        lines.append(f"1. tensor parallel over {dims.tp} ranks with {plan}{extra}")
    else:
        lines.append("1. tensor parallel: off (tensor_parallel_degree 1)")
    ac = cfg.activation_checkpointing
    if ac.mode == "none":
        lines.append("2. activation checkpointing: off")
    else:
        every = f", every {ac.every_n_layers} blocks" if ac.every_n_layers > 1 else ""
        lines.append(f"2. activation checkpointing: {ac.mode}{every}")
    if cfg.activation_offloading:
        lines.append(f"   activation offloading to host, loading horizon {cfg.activation_loading_horizon}")
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        shard = f"hybrid: shard inside groups of {dims.dp_shard}, replicate across {dims.dp_replicate}"
    elif dims.dp_shard > 1:
        shard = f"full shard over {dims.dp_shard} data-parallel ranks"
    elif dims.dp_replicate > 1:
        shard = f"replicate over {dims.dp_replicate} ranks (no sharding)"
    else:
        shard = "one data-parallel rank (nothing to shard)"
    mp = cfg.mixed_precision
    lines.append(
        f"3. fully_shard per block, then the root: {shard}; param dtype {mp.param_dtype or 'as built'}, "
        f"reduce dtype {mp.reduce_dtype or 'as built'}, reshard_after_forward {cfg.reshard_after_forward}"
        + (", parameters offloaded to CPU" if cfg.cpu_offload else "")
    )
    sync = cfg.gradient_sync
    lines.append(f"4. gradient sync: {sync.algorithm}" + (
        f", cross-replica {sync.cross_replica}" if sync.cross_replica != "default" else ""))
    if cfg.delayed_param_initialization:
        lines.append("5. materialise the meta-device model shard by shard (delayed initialisation)")
    return lines


def cmd_check(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(json_schema(), indent=2))
        return 0
    if not args.config:
        raise UsageError("smp check: name a config file, e.g. `smp check smp.yaml --world-size 8`")
    cfg = load_config(args.config)
    dims = ParallelDims.from_config(cfg, args.world_size)
    print(f"config {args.config}: valid")
    print(f"mesh: {dims.describe()} (axes {' x '.join(dims.mesh_dim_names)}, outermost first; size 1 when off)")
    print("smp.transform would apply:")
    for line in describe_recipe(cfg, dims):
        print(f"  {line}")
    if args.model:
        # The real recipe on meta under a fake world: errors that only transform finds show here.
        from smp.planning import plan

        rows = cfg.pipeline.microbatches or dims.pp * cfg.pipeline.local_stages() if dims.pp > 1 else 1
        plan(cfg, args.model, args.world_size, seq_len=16, micro_batch=rows)
        print(f"smp.transform on {args.model!r} at world size {args.world_size}: ok")
    return 0


# ----------------------------------------------------------------------------------------------
# smp plan


def _parse_memory(text: str | None) -> float | None:
    """GiB from '80', '80GiB', '80G' or '141GB' (GB taken as GiB: device memory is sold in GiB)."""
    if text is None:
        return None
    t = text.strip().upper().removesuffix("IB").removesuffix("B").removesuffix("G")
    try:
        gib = float(t)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise UsageError(f"--device-memory {text[:100]!r}: give GiB per device (> 0), e.g. 80 or 80GiB")
    return gib


# The largest world `smp check` / `smp plan` take: planning builds the mesh of the whole world
# on a fake process group, which costs time and memory per rank (tens of seconds at 2**16).
MAX_WORLD_SIZE = 2**20


def _world_size(text: str) -> int:
    n = _positive_int(text)
    if n > MAX_WORLD_SIZE:
        raise argparse.ArgumentTypeError(f"{n} is larger than smp plans for (at most {MAX_WORLD_SIZE})")
    return n


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:100]!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


def _non_negative_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:100]!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} must be 0 or more")
    return n


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage block), as smp's own errors are."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message[:400]} (see {self.prog} --help)\n")


def cmd_plan(args: argparse.Namespace) -> int:
    from smp.planning import GiB, plan, suggest

    memory = _parse_memory(args.device_memory)  # before planning, which can take seconds
    cfg = load_config(args.config) if args.config else load_config({})
    kwargs = dict(rank=args.rank, seq_len=args.seq_len, micro_batch=args.batch, optimizer=args.optimizer,
                  grad_accum=args.grad_accum)
    result = plan(cfg, args.model, args.world_size, **kwargs)
    out: dict = {"plan": result.to_dict()}
    if not args.json:
        print(result.format())
        print(f"(planned in {result.seconds:.1f} s)")
    if memory is not None:
        fits = result.device_bytes <= memory * GiB
        out["fits"] = fits
        if not args.json:
            print(f"fits in {memory:g} GiB per device: {'yes' if fits else 'no'}")
        if not fits or args.suggest:
            found = suggest(cfg, args.model, args.world_size, memory, **kwargs)
            out["suggestion"] = None if found is None else {"degrees": found[0], "device_bytes": found[1].device_bytes}
            if not args.json:
                if found is None:
                    print("no tensor_parallel_degree / hybrid_shard_degree fits; use activation "
                          "checkpointing, a smaller --batch or --seq-len, or more ranks")
                else:
                    degrees, best = found
                    print(f"smallest degrees that fit: {degrees} -> {best.device_bytes / GiB:.2f} GiB per device")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="smp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"smp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    parser.run_parser = sub.add_parser(  # type: ignore[attr-defined]
        "run", help="launch a training script through torchrun",
        description="Launch SCRIPT on N processes with torchrun. Flags before the script "
                                     "(e.g. --nnodes 2 --rdzv-endpoint host:29500) go to torchrun; the script's own "
                                     "arguments follow it. -n N: processes on this host (a number, or gpu / cpu / auto "
                                     "as torchrun takes). --smp-config CFG: sets SMP_CONFIG for scripts that call "
                                     "smp.init() with no argument. --dry-run: print the torchrun command.",
                   usage="smp run [-n N] [--smp-config CFG] [--dry-run] [torchrun flags] SCRIPT [script args]")

    check = sub.add_parser("check", help="validate a config and show what transform would do")
    check.add_argument("config", nargs="?", help="YAML / JSON config")
    check.add_argument("--world-size", "-w", type=_world_size, default=1)
    check.add_argument("--model", default=None, help="also run transform on this model on meta (a named shape or a folder)")
    check.add_argument("--schema", action="store_true", help="print the config's JSON schema")

    plan = sub.add_parser("plan", help="per-rank memory and communication of a config at N ranks")
    plan.add_argument("config", nargs="?", help="YAML / JSON config (default: smp's defaults)")
    plan.add_argument("--model", required=True, help="named shape (tiny, llama-1b, llama-8b, llama-70b), a local "
                                                     "model folder with config.json, or a config.json file")
    plan.add_argument("--world-size", "-w", type=_world_size, required=True)
    plan.add_argument("--seq-len", type=_positive_int, default=2048)
    plan.add_argument("--batch", type=_positive_int, default=1, help="sequences per data-parallel rank per micro-step "
                      "(under pipeline_parallel_degree: per smp.step, split into pipeline.microbatches)")
    plan.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-steps per optimizer step")
    plan.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd or sgd-momentum")
    plan.add_argument("--rank", type=_non_negative_int, default=0, help="which rank to plan for")
    plan.add_argument("--device-memory", default=None, help="GiB per device: say whether it fits, and suggest degrees")
    plan.add_argument("--suggest", action="store_true", help="suggest degrees even when the config fits")
    plan.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        # Everything after the script belongs to it: `smp run` parses its few options by hand.
        try:
            return cmd_run(argv[1:], parser.run_parser)  # type: ignore[attr-defined]
        except ValueError as e:
            print(f"smp run: error: {e}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            return cmd_check(args)
        return cmd_plan(args)
    except ValueError as e:  # UsageError, ConfigError, ModelSpecError: the message is the whole story
        one_line = " ".join(line.strip() for line in str(e).splitlines())
        print(f"smp {args.command}: error: {one_line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
