"""The GPU check: kvroute's GPU paths against raw torch, wherever a CUDA device exists.

No GPU runs on the development machines, so everything that needs one is in this one
prepared command (see README, "GPU check")::

    python -m kvroute bench gpu-check [--output gpu_check.json] [--reps 7]

1. paged-cache gather / scatter / copies on CUDA tensors in vLLM's GPU layouts, every
   dtype this torch has: bit-exact round trips, and throughput against raw
   ``index_select`` / ``index_copy_`` / contiguous ``copy_`` (``copies``);
2. the torch.distributed NCCL link between two processes, on two GPUs or else on one,
   against raw torch.distributed send/recv of the same bytes (``links``);
3. the same pair over a NIXL link (READs of VRAM between the two processes), against a
   copy of the same frames on the receiver's device; skipped, saying why, without nixl_cu12.

It prints a table and writes JSON to ``--output``. Without a CUDA device it prints
"skipped: no CUDA device", writes a JSON saying so, and exits 0; without torch it says
so and exits 2. ``--device cpu`` runs the same checks on the CPU with tiny sizes (Gloo
for the link): the logic only, for the tests. Exit status 1 when something is not
bit-exact or a check failed to run; a ratio under the 0.8 target is reported, not an
error. It needs torch and kvroute's own dependencies (run from the checkout, or with
kvroute installed): no vLLM, no network.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from rich.console import Console

from kvroute.bench.command import Command
from kvroute.bench.progress import Bar

MIN_REPS = 5


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}


def skipped_report() -> dict:
    return {"status": "skipped", "reason": "no CUDA device", "environment": environment()}


def run_checks(device_type: str, reps: int) -> dict:
    import torch

    from kvroute.bench.gpu_check import copies as gpu_copies
    from kvroute.bench.gpu_check import links as gpu_links

    device = torch.device(f"{device_type}:0" if device_type == "cuda" else "cpu")
    on_gpu = device_type == "cuda"
    link_sizes = gpu_links.GPU_LINK_SIZES if on_gpu else gpu_links.CPU_LINK_SIZES
    with Bar(Console(), "GPU check", 3, redraw=False) as phase:  # nothing redrawn while copies are timed
        phase.step("gather, scatter and copies")
        copies = gpu_copies.check_copies(device, gpu_copies.GPU_COPY_SIZES if on_gpu else gpu_copies.CPU_COPY_SIZES,
                                         reps)
        phase.step("link")
        link = gpu_links.check_link(device_type, link_sizes, reps)
        phase.step("nixl link")
        nixl_link = gpu_links.check_nixl_link(device_type, link_sizes, reps)
    return {"status": overall_status(copies, link, nixl_link), "device": device_type, "reps": reps,
            "environment": environment(), "copies": copies, "link": link, "nixl_link": nixl_link}


def overall_status(copies: list[dict], *links: dict) -> str:
    """``error`` when bytes came out wrong or a check could not run; ratios only inform."""
    broken_copies = any("error" in row or not row["bit_exact"] for row in copies)
    return "error" if broken_copies or any(link["status"] == "failed" for link in links) else "ok"


def copies_table(rows: list[dict]) -> list[str]:
    lines = [f"{'dtype':<14}{'dim':>4}{'MiB':>8}{'exact':>7}{'gather GB/s':>13}{'raw':>8}{'ratio':>7}"
             f"{'scatter GB/s':>14}{'raw':>8}{'ratio':>7}{'copy_ GB/s':>12}"]
    for row in rows:
        head = f"{row['dtype']:<14}{row['block_dim']:>4}"
        if "error" in row:
            lines.append(f"{head}  error: {row['error']}")
            continue
        rate, ratio = row["gb_per_second"], row["ratios"]
        lines.append(f"{head}{row['moved_bytes'] / 2**20:>8.1f}{'yes' if row['bit_exact'] else 'NO':>7}"
                     f"{rate['gather']:>13.1f}{rate['raw_index_select']:>8.1f}{ratio['gather_vs_index_select']:>7.2f}"
                     f"{rate['scatter']:>14.1f}{rate['raw_index_copy']:>8.1f}{ratio['scatter_vs_index_copy']:>7.2f}"
                     f"{rate['raw_contiguous_copy']:>12.1f}")
    return lines


def link_table(link: dict) -> list[str]:
    head = f"link {link['devices'][0]} -> {link['devices'][1]} over {link.get('backend', 'default')}"
    if link["status"] == "skipped":
        return [f"{head}: skipped ({link['reason']})"]
    target = "meets" if link["meets_target"] else "misses"
    lines = [f"{head}: {link['status']}, {target} the 0.8x target" + (f" ({link['error']})" if "error" in link else "")]
    if link["rows"]:
        lines.append(f"raw: {link['rows'][0]['baseline']}")
        lines.append(f"{'backend':<9}{'MiB':>8}{'exact':>7}{'link GB/s':>11}{'raw GB/s':>10}{'ratio':>7}{'>=0.8':>7}")
    for row in link["rows"]:
        lines.append(f"{row['backend']:<9}{row['bytes'] / 2**20:>8.1f}{'yes' if row['bit_exact'] else 'NO':>7}"
                     f"{row['link_gb_per_second']:>11.2f}{row['raw_gb_per_second']:>10.2f}{row['ratio']:>7.2f}"
                     f"{'yes' if row['ratio'] >= row['target_ratio'] else 'no':>7}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=Path("gpu_check.json"), help="where the JSON report goes")
    parser.add_argument("--reps", type=int, default=7, help=f"timed repetitions per case (at least {MIN_REPS})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same checks with tiny sizes, to test the logic without a GPU")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.reps < MIN_REPS:
        parser.error(f"--reps must be at least {MIN_REPS}")


def run(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError as error:
        print(f"kvroute bench gpu-check needs torch (pip install torch): {error}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        report = skipped_report()
        print("skipped: no CUDA device")
    else:
        report = run_checks(args.device, args.reps)
        print("\n".join(copies_table(report["copies"]) + [""] + link_table(report["link"]) + [""]
                        + link_table(report["nixl_link"])))
        print(f"status: {report['status']}")
    args.output.write_text(json.dumps(report, indent=2))
    return 1 if report["status"] == "error" else 0


COMMAND = Command("gpu-check", "kvroute's GPU paths against raw torch (skips without CUDA)", __doc__, add_arguments,
                  run, check)
parse_args, main = COMMAND.parse_args, COMMAND.main
