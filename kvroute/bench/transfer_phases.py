"""The phases of ``kvroute bench transfer`` (see ``transfer_bench``), filling one results document.

Each phase stores what it measured as soon as it has it, so a failure late in the run
still leaves the earlier numbers in ``results.json``.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from kvroute.bench import transfer_calibration, transfer_report
from kvroute.bench.progress import Bar, track
from kvroute.bench.transfer_bench import (
    ENCRYPTION_BACKENDS,
    NIXL_MISSING,
    SHAPED_BACKENDS,
    TransferBenchSettings,
    describe_run,
    loopback_backends,
)
from kvroute.bench.transfer_netns import (
    RECEIVER_ADDRESS,
    SENDER_ADDRESS,
    ShapedLink,
    rate_bits_per_second,
    shaping_available,
)
from kvroute.bench.transfer_pair import PairEnd, PairPlan, run_pair
from kvroute.bench.transfer_sweep import KVBytes, crossovers, lengths_within, prompt_lengths, result_rows, sort_rows
from orchestrator.planner.calibration import LinkCalibrator

LOOPBACK = "loopback"
INTO_CACHE_MIN_BYTES = 1_000_000


class Phases:
    def __init__(self, settings: TransferBenchSettings, console: Console, output: Path, cluster_keys: str):
        self.settings = settings
        self.cluster_keys = cluster_keys  # the folder every pair's links speak under
        self.console = console
        self.output = output
        self.lengths = prompt_lengths(settings.max_prompt_tokens)
        self.recompute: dict[int, float] = {}
        self.kv: KVBytes | None = None
        self.results: dict = {"config": describe_run(settings), "prompt_tokens": self.lengths, "links": [],
                              "skipped": {}}

    def run_all(self) -> None:
        with Bar(self.console, "phases", 5) as phase:
            phase.step("engine")
            self.measure_engine()
            phase.step("loopback")
            backends = loopback_backends()
            if "nixl" not in backends:
                self.results["skipped"]["nixl"] = NIXL_MISSING
            self.measure_link(LOOPBACK, backends, self.lengths, PairEnd(), PairEnd())
            phase.step("into cache")
            if self.settings.into_cache:
                self.measure_into_cache("nixl" in backends)
            else:
                self.results["skipped"]["into_cache"] = "--no-into-cache"
            phase.step("encryption")
            if self.settings.encryption:
                self.measure_encryption()
            else:
                self.results["skipped"]["encryption"] = "--no-encryption"
            phase.step("shaped links")
            if self.settings.shaped:
                self.measure_shaped_links()
            else:
                self.results["skipped"]["shaped"] = "--no-shaped"
        self.results["skipped"]["nccl"] = "the pair moves host-memory frames only; NCCL is not measured here"
        self.summarise()

    # ---------------------------------------------------------------- engine

    def measure_engine(self) -> None:
        from foundation.model_prep import resolve_model
        from worker.dtype import resolve_here

        model = resolve_model(self.settings.model or None, progress=True)
        dtype = resolve_here(self.settings.dtype)
        if not self.settings.engine:
            from kvroute.bench.transfer_recompute import kv_bytes_from_model

            self.results["skipped"]["recompute"] = "--no-engine"
            self._set_layout(kv_bytes_from_model(model, dtype))
            return
        from kvroute.bench.transfer_recompute import RecomputeEngine

        self.console.rule("recompute on the engine")
        with RecomputeEngine(model, dtype, self.lengths[-1], self.output / "logs",
                             self.settings.start_timeout) as engine:
            self._set_layout(engine.kv_bytes())
            self.results["recompute"] = {}
            with Bar(self.console, "recompute", len(self.lengths), unit="prompt lengths") as bar:
                def measured_one(tokens: int, measured: dict) -> None:
                    self._log_recompute(tokens, measured)
                    bar.advance()

                for tokens, measured in engine.measure(self.lengths, self.settings.reps, measured_one).items():
                    self.recompute[tokens] = measured["median"]

    def _log_recompute(self, tokens: int, measured: dict) -> None:
        self.results["recompute"][str(tokens)] = measured
        self.console.log(f"recompute {tokens} tokens: {measured['median'] * 1e3:.1f} ms")

    def _set_layout(self, kv: KVBytes) -> None:
        self.kv = kv
        self.results["layout"] = {"bytes_per_token": kv.bytes_per_token, "num_layers": kv.num_layers,
                                  "dtype": kv.dtype, "source": kv.source}
        self.console.log(f"KV layout ({kv.source}): {kv.bytes_per_token:,} bytes per token in {kv.dtype}, "
                         f"{kv.num_layers} layers")

    # ---------------------------------------------------------------- links

    def measure_link(self, name: str, backends: tuple[str, ...], lengths: list[int], sender: PairEnd,
                     receiver: PairEnd, rate: str | None = None, nixl_ucx_tls: str = "") -> None:
        self.console.rule(f"transfers over {name}")
        plan = PairPlan(backends=backends, frame_sizes=tuple(self.kv.frame_bytes(n) for n in lengths),
                        num_frames=self.kv.num_layers, reps=self.settings.reps, sender=sender, receiver=receiver,
                        cluster_keys=self.cluster_keys, checksum=self.settings.checksum, nixl_ucx_tls=nixl_ucx_tls)
        link = {"name": name, "rate": rate, "prompt_tokens": lengths, "pair_rows": []}
        self.results["links"].append(link)
        with Bar(self.console, f"transfers over {name}", len(backends) * len(lengths)) as bar:
            def measured_one(row: dict) -> None:
                self._log_transfer(link, row)
                bar.advance()

            run_pair(plan, on_row=measured_one)

    def _log_transfer(self, link: dict, row: dict) -> None:
        link["pair_rows"].append(row)
        tokens = row["bytes"] // self.kv.bytes_per_token
        self.console.log(f"{link['name']} {row['backend']} {tokens} tokens ({row['bytes'] / 1e6:.1f} MB): "
                         f"{row['backend_seconds'] * 1e3:.1f} ms, {row['baseline']} {row['raw_seconds'] * 1e3:.1f} ms, "
                         f"ratio {row['ratio']:.2f}"
                         + (f", with checksums {row['checksum_seconds'] * 1e3:.1f} ms "
                            f"(on/off ratio {row['checksum_ratio']:.2f})" if "checksum_seconds" in row else ""))

    def measure_into_cache(self, with_nixl: bool) -> None:
        from kvroute.bench.transfer_into_cache import NIXL_PATHS, PATHS, measure_into_cache

        self.console.rule("a staged lease pulled into a paged cache")
        lengths = [n for n in self.lengths if self.kv.prompt_bytes(n) >= INTO_CACHE_MIN_BYTES]
        paths = PATHS if with_nixl else tuple(path for path in PATHS if path not in NIXL_PATHS)
        self.results["into_cache"] = []

        def measured_one(row: dict) -> None:
            self.results["into_cache"].append(row)
            self.console.log(f"into cache, {row['path']}, {row['prompt_tokens']} tokens "
                             f"({row['bytes'] / 1e6:.1f} MB): {row['seconds'] * 1e3:.1f} ms")

        measure_into_cache(self.cluster_keys, self.kv.bytes_per_token, self.kv.num_layers, lengths,
                           self.settings.reps, paths, measured_one)

    def measure_encryption(self) -> None:
        """The zmq links with transfer encryption on, then off, against the same raw pyzmq."""
        self.console.rule("transfer encryption on and off")
        lengths = encryption_lengths(self.lengths)
        frame_sizes = tuple(self.kv.frame_bytes(n) for n in lengths)
        measured = {}
        for encrypted in track((True, False), "encryption", self.console, name=lambda on: "on" if on else "off"):
            plan = PairPlan(backends=ENCRYPTION_BACKENDS, frame_sizes=frame_sizes, num_frames=self.kv.num_layers,
                            reps=self.settings.reps, cluster_keys=self.cluster_keys, transfer_encryption=encrypted)
            measured[encrypted] = run_pair(plan)
        self.results["encryption"] = encryption_rows(measured[True], measured[False], self.kv.bytes_per_token)
        for row in self.results["encryption"]:
            self.console.log(f"{row['backend']} {row['prompt_tokens']} tokens: encrypted {row['encrypted_ms']:.1f} ms, "
                             f"clear {row['clear_ms']:.1f} ms ({row['encryption_cost']:.2f}x), "
                             f"raw pyzmq {row['raw_ms']:.1f} ms")

    def measure_shaped_links(self) -> None:
        reason = shaping_available()
        if reason:
            self.results["skipped"]["shaped"] = reason
            self.console.log(f"[yellow]no shaped links: {reason}")
            return
        # nixl between the namespaces on tcp: left to choose, UCX would read through cma, past
        # the shaped veth, which stands for a network here.
        backends = SHAPED_BACKENDS + tuple(b for b in loopback_backends() if b == "nixl")
        for rate in self.settings.shaped_rates:
            lengths = lengths_within(self.lengths, self.kv, rate_bits_per_second(rate),
                                     self.settings.shaped_max_seconds)
            # Unique per run, short enough for interface names (15 characters).
            with ShapedLink(f"kvrb{os.getpid() % 100000}", rate) as shaped:
                self.measure_link(f"veth-{rate}", backends, lengths,
                                  PairEnd(SENDER_ADDRESS, shaped.sender_namespace, shaped.sender_device),
                                  PairEnd(RECEIVER_ADDRESS, shaped.receiver_namespace, shaped.receiver_device),
                                  rate, nixl_ucx_tls="tcp")

    # ---------------------------------------------------------------- results

    def summarise(self) -> None:
        calibrator = transfer_calibration.observe_results(LinkCalibrator(), self.results)
        self.results["link_estimates"] = transfer_calibration.estimates_report(calibrator)
        rows = []
        for link in self.results["links"]:
            rows += result_rows(link["name"], self.kv, link["pair_rows"], self.recompute)
            rows += self._predicted_rows(link, calibrator)
        self.results["results"] = sort_rows(rows)
        self.results["crossovers"] = crossovers(rows)

    def _predicted_rows(self, link: dict, calibrator: LinkCalibrator) -> list[dict]:
        """Lengths this link skipped, predicted from its estimate, so a slow link's crossover
        shows even where measuring it would take minutes."""
        skipped = [n for n in self.lengths if n not in link["prompt_tokens"]]
        backends = sorted({row["backend"] for row in link["pair_rows"]})
        return [row for backend in backends for row in transfer_calibration.predicted_rows(
            link["name"], backend, self.kv, skipped,
            calibrator.estimate(*transfer_calibration.link_key(link["name"], backend)), self.recompute)]

    def report(self) -> None:
        transfer_report.print_report(self.results, self.console)
        transfer_report.plot(self.results, self.output / transfer_report.PLOT_NAME)


def encryption_lengths(lengths: list[int]) -> list[int]:
    """Shortest, middle and longest prompt of the sweep."""
    return sorted({lengths[0], lengths[len(lengths) // 2], lengths[-1]})


def encryption_rows(encrypted: list[dict], clear: list[dict], bytes_per_token: int) -> list[dict]:
    """Per backend and size: the link encrypted and in clear, raw pyzmq (the faster of the
    two runs' baselines), and what encryption costs (encrypted s / clear s)."""
    in_clear = {(row["backend"], row["bytes"]): row for row in clear}
    rows = []
    for row in encrypted:
        plain = in_clear[(row["backend"], row["bytes"])]
        raw = min(row["raw_seconds"], plain["raw_seconds"])
        rows.append({"backend": row["backend"], "prompt_tokens": row["bytes"] // bytes_per_token,
                     "bytes": row["bytes"], "encrypted_ms": row["backend_seconds"] * 1e3,
                     "clear_ms": plain["backend_seconds"] * 1e3, "raw_ms": raw * 1e3,
                     "encryption_cost": row["backend_seconds"] / plain["backend_seconds"],
                     "encrypted_vs_raw": raw / row["backend_seconds"], "clear_vs_raw": raw / plain["backend_seconds"]})
    return rows
