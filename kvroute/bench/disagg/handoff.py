"""Timed requests of ``kvroute bench disagg``: one engine computing the prompt itself against
the disaggregated path (prefill worker → KV transfer → decode worker), for TTFT, and the
real end-to-end hand-off at the transfer phase's sizes."""

from __future__ import annotations

import time
import uuid

from kvroute.bench.disagg.context import STATS_TIMEOUT, MiB, console, fmt, gbps, median, summary
from kvroute.bench.meters import ForeignLoad


async def run_stream(stream) -> dict:
    """Consume a chunk stream; arrival time of every token, and the chunks' facts."""
    token_times: list[float] = []
    cached = None
    finish = None
    async for chunk in stream:
        now = time.perf_counter()
        token_times.extend(now for _ in chunk.token_ids)
        if cached is None and chunk.num_prompt_tokens:
            cached = chunk.num_cached_tokens
        if chunk.finished:
            finish = chunk.finish_reason
    return {"token_times": token_times, "num_cached_tokens": cached, "finish_reason": finish}


def gaps(token_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


async def single_engine_request(ctx, prompt: list[int]) -> dict:
    from foundation import wire

    request = wire.GenerateRequest(request_id=f"single-{uuid.uuid4().hex}", prompt_token_ids=prompt,
                                   sampling=ctx.sampling, cache_salt=f"salt-{uuid.uuid4().hex}")
    await ctx.gate.wait()
    foreign = ForeignLoad()
    start = time.perf_counter()
    result = await run_stream(ctx.decode.generate(request, ctx.args.request_timeout))
    foreign = foreign.cores()
    times = result["token_times"]
    return {"prompt_tokens": len(prompt), "ttft_s": times[0] - start,
            "second_token_gap_s": times[1] - times[0] if len(times) > 1 else None,
            "decode_itl_s": median(gaps(times)[1:]), "num_tokens": len(times),
            "num_cached_tokens": result["num_cached_tokens"], "finish_reason": result["finish_reason"],
            "foreign_cpu_cores": foreign}


async def disaggregated_request(ctx, prompt: list[int]) -> dict:
    from orchestrator.disagg import HandoffRecord, generate_disaggregated

    before_decode = await ctx.decode.stats(STATS_TIMEOUT)
    before_prefill = await ctx.prefill.stats(STATS_TIMEOUT)
    record = HandoffRecord(request_id=f"disagg-{uuid.uuid4().hex}")
    await ctx.gate.wait()
    foreign = ForeignLoad()
    start = time.perf_counter()
    result = await run_stream(generate_disaggregated(ctx.prefill, ctx.decode, record, prompt, ctx.sampling,
                                                     timeout=ctx.args.request_timeout))
    foreign = foreign.cores()
    after_decode = await ctx.decode.stats(STATS_TIMEOUT)
    after_prefill = await ctx.prefill.stats(STATS_TIMEOUT)
    times = result["token_times"]
    received = after_decode.transfer.bytes_received - before_decode.transfer.bytes_received
    handoff = (record.second_token_at - record.first_token_at
               if record.second_token_at is not None and record.first_token_at is not None else None)
    itl = median(gaps(times)[1:])
    return {
        "prompt_tokens": len(prompt),
        "ttft_s": record.first_token_at - start if record.first_token_at is not None else None,
        "handoff_gap_s": handoff,  # first token (prefill worker) → second token (decode worker)
        "decode_itl_s": itl,  # median gap between later tokens, all from the decode worker
        "num_tokens": len(times),
        "prefill_cached_tokens": record.prefill_cached_tokens,
        "pull_source_tokens": record.pull_source.num_tokens if record.pull_source else None,
        "decode_bytes_received": received,
        # The pull as the decode worker's own connector timed it (into the real paged cache).
        "decode_pull_seconds": record.transfer.seconds if record.transfer and record.transfer.ok else None,
        "decode_blocks_received": after_decode.transfer.blocks_received - before_decode.transfer.blocks_received,
        "decode_pulls_ok": after_decode.transfer.pulls_ok - before_decode.transfer.pulls_ok,
        "decode_pulls_failed": after_decode.transfer.pulls_failed - before_decode.transfer.pulls_failed,
        "decode_external_tokens": (after_decode.prompt_tokens.external_kv_transfer
                                   - before_decode.prompt_tokens.external_kv_transfer),
        "decode_computed_tokens": after_decode.prompt_tokens.computed - before_decode.prompt_tokens.computed,
        "prefill_bytes_sent": after_prefill.transfer.bytes_sent - before_prefill.transfer.bytes_sent,
        "handoff_throughput_gbps": gbps(received, handoff),
        "handoff_minus_itl_throughput_gbps": (gbps(received, handoff - itl)
                                              if handoff and itl and handoff > itl else None),
        "finish_reason": result["finish_reason"],
        "foreign_cpu_cores": foreign,
    }


async def measure_ttft(ctx) -> dict:
    console.rule("TTFT: single engine vs disaggregated")
    # Warm both paths once (first requests pay one-off costs), at the shortest length.
    await single_engine_request(ctx, ctx.prompts.chat(min(ctx.args.ttft_lengths)))
    await disaggregated_request(ctx, ctx.prompts.chat(min(ctx.args.ttft_lengths)))
    results = {}
    for length in ctx.args.ttft_lengths:
        single, disagg = [], []
        for rep in range(ctx.args.ttft_reps):
            single.append(await single_engine_request(ctx, ctx.prompts.chat(length)))
            disagg.append(await disaggregated_request(ctx, ctx.prompts.chat(length)))
            console.log(f"~{length} tokens rep {rep + 1}: single TTFT {single[-1]['ttft_s']:.3f} s, "
                        f"disagg TTFT {disagg[-1]['ttft_s']:.3f} s, hand-off {disagg[-1]['handoff_gap_s']:.3f} s, "
                        f"pulled {disagg[-1]['decode_bytes_received'] / MiB:.1f} MiB")
        results[str(length)] = {
            "prompt_tokens": summary([r["prompt_tokens"] for r in single + disagg]),
            "foreign_cpu_cores": summary([r["foreign_cpu_cores"] for r in single + disagg]),
            "single": {"ttft_s": summary([r["ttft_s"] for r in single]),
                       "second_token_gap_s": summary([r["second_token_gap_s"] for r in single]),
                       "decode_itl_s": summary([r["decode_itl_s"] for r in single]),
                       "runs": single},
            "disagg": {"ttft_s": summary([r["ttft_s"] for r in disagg]),
                       "handoff_gap_s": summary([r["handoff_gap_s"] for r in disagg]),
                       "decode_itl_s": summary([r["decode_itl_s"] for r in disagg]),
                       "runs": disagg},
        }
    return results


async def measure_end_to_end(ctx, transfer: dict) -> dict:
    console.rule("End-to-end hand-off at the transfer sizes")
    results = {}
    for key, entry in transfer["sizes"].items():
        runs = []
        for _ in range(ctx.args.e2e_reps):
            runs.append(await disaggregated_request(ctx, ctx.prompts.exact(entry["prompt_tokens"])))
            r = runs[-1]
            console.log(f"{key} MiB: hand-off {r['handoff_gap_s']:.3f} s, decode ITL {r['decode_itl_s']:.4f} s, "
                        f"real consumer pull {fmt(r['decode_pull_seconds'], '.4f', suffix=' s')}, "
                        f"received {r['decode_bytes_received'] / MiB:.1f} MiB "
                        f"(pulls ok {r['decode_pulls_ok']}, failed {r['decode_pulls_failed']})")
        handoff = median([r["handoff_gap_s"] for r in runs])
        itl = median([r["decode_itl_s"] for r in runs])
        received = median([r["decode_bytes_received"] for r in runs])
        pull = median([r["decode_pull_seconds"] for r in runs])
        results[key] = {
            "decode_pull_seconds": summary([r["decode_pull_seconds"] for r in runs]),
            "real_pull_gbps": gbps(received, pull),
            # The real consumer's pull against the raw pyzmq baseline for the same bytes.
            "ratio_real_pull_vs_raw": entry["raw"]["median"] / pull if pull and entry["raw"]["median"] else None,
            "prompt_tokens": entry["prompt_tokens"], "bytes_expected": entry["bytes"],
            "decode_bytes_received": summary([r["decode_bytes_received"] for r in runs]),
            "handoff_gap_s": summary([r["handoff_gap_s"] for r in runs]),
            "decode_itl_s": summary([r["decode_itl_s"] for r in runs]),
            "ttft_s": summary([r["ttft_s"] for r in runs]),
            "foreign_cpu_cores": summary([r["foreign_cpu_cores"] for r in runs]),
            "handoff_throughput_gbps": gbps(received, handoff),
            "handoff_minus_itl_throughput_gbps": gbps(received, handoff - itl) if handoff and itl and handoff > itl
            else None,
            "all_pulled": all(r["decode_pulls_ok"] == 1 and r["decode_pulls_failed"] == 0
                              and r["decode_bytes_received"] == entry["bytes"] for r in runs),
            "runs": runs,
        }
        console.log(f"{key} MiB: real consumer pull {fmt(results[key]['real_pull_gbps'], '.2f', suffix=' GB/s')}, "
                    f"raw pyzmq / real pull = {fmt(results[key]['ratio_real_pull_vs_raw'], '.2f', suffix='x')}")
    return results
