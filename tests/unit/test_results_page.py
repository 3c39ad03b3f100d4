"""The results page generator (``kvroute bench results-page``) in quick mode: the page and its plots
are written, and every number in its tables is the one in the results JSON beside it."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kvroute.bench.results_page import cli as results_page  # imports matplotlib only when it plots
from kvroute.bench.results_page.runs import REPOSITORY, TIER_MULTIPLE, TRACE
from simulator import TierSettings
from tests.unit.simulated_runs import simulated_repository_run, simulated_trace_run
from worker.settings import WorkerSettings

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Path, dict, str]:
    output = tmp_path_factory.mktemp("results")
    assert results_page.main(["--quick", "--output", str(output)]) == 0
    return output, json.loads((output / "results.json").read_text()), (output / "RESULTS.md").read_text()


def sections(text: str) -> dict[str, str]:
    """The page's "## " sections by title."""
    out, title = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:]
            out[title] = ""
        elif title is not None:
            out[title] += line + "\n"
    return out


def table_rows(section: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


def tables(section: str) -> list[list[list[str]]]:
    """Each table of a section, as its rows (the header included)."""
    return [table_rows(block) for block in section.split("\n\n") if block.startswith("| ")]


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_page_and_plots_exist(page):
    output, report, text = page
    assert text.startswith("# Results")
    assert "Quick run" in text
    for workload, names in report["plots"].items():
        assert len(names) == 3, workload  # TTFT vs size, hit rate vs size, CDF at 8 workers
        for name in names:
            assert f"]({name})" in text
            width, height = png_size(output / name)
            assert width <= 900 and height <= 540  # 900 x 500, the CDF replay_plots' 840 x 540
            assert (output / name).stat().st_size < 200_000


def test_policy_tables_match_the_json(page):
    _, report, text = page
    found = sections(text)
    for workload, rows in report["workloads"].items():
        table = {(int(row[0]), row[1]): row for row in table_rows(found[workload]) if row[1] in row_policies(rows)}
        assert len(table) == sum(len(r["policies"]) for r in rows)
        for row in rows:
            for policy, summary in row["policies"].items():
                cells = table[(row["workers"], policy)]
                assert float(cells[2]) == pytest.approx(summary["ttft_p50_s"], abs=0.005)
                assert float(cells[3]) == pytest.approx(summary["ttft_p99_s"], abs=0.005)
                assert float(cells[4].rstrip("%")) == pytest.approx(100 * summary["hit_rate"], abs=0.05)
                assert float(cells[5].rstrip("%")) == pytest.approx(100 * summary["of_lru"], abs=0.05)
                assert float(cells[6].rstrip("%")) == pytest.approx(100 * summary["of_prefill_lru"], abs=0.05)
                assert int(cells[8]) == summary["rejected"]
                prefill_bound = row["oracle"]["lru_prefill_pool"]["reused_tokens"]
                assert summary["of_prefill_lru"] == pytest.approx(summary["cached_tokens"] / prefill_bound)


def test_the_node_tier_table_matches_the_json(page):
    _, report, text = page
    shown = {(row[0], int(row[1]), row[3]): row for row in table_rows(sections(text)["Node KV tier"])
             if row[0] in report["workloads"]}
    engines = {REPOSITORY: report["repository_engine"]["num_blocks"], TRACE: report["trace_engine"]["num_blocks"]}
    per_node = TierSettings().workers_per_node
    for workload, rows in report["workloads"].items():
        for row in rows:
            tier = row["tier"]
            assert tier["settings"]["host_blocks"] == TIER_MULTIPLE * engines[workload] * min(per_node, row["workers"])
            for policy, tiered in tier["policies"].items():
                cells, without = shown[(workload, row["workers"], policy)], row["policies"][policy]
                assert int(cells[2].replace(",", "")) == tier["settings"]["host_blocks"]
                assert float(cells[4]) == pytest.approx(without["ttft_p50_s"], abs=0.005)
                assert float(cells[5]) == pytest.approx(tiered["ttft_p50_s"], abs=0.005)
                assert float(cells[7]) == pytest.approx(tiered["ttft_p99_s"], abs=0.005)
                assert float(cells[9].rstrip("%")) == pytest.approx(100 * tiered["hit_rate"], abs=0.05)
                assert float(cells[10].rstrip("%")) == pytest.approx(100 * tiered["tier_hit_rate"], abs=0.05)
                assert tiered["hit_rate"] >= tiered["tier_hit_rate"]
    assert len(shown) == sum(len(r["tier"]["policies"]) for rows in report["workloads"].values() for r in rows)


def row_policies(rows: list[dict]) -> set[str]:
    return {policy for row in rows for policy in row["policies"]}


def test_targets_table_matches_the_json(page):
    _, report, text = page
    targets = {(row[0], row[1]): row[2:] for row in table_rows(sections(text)["Targets"])}
    for workload, rows in report["workloads"].items():
        assert [r["workers"] for r in rows] == [2, 8]
        for column, row in enumerate(rows):
            for judged in row["targets"]:
                shown = targets[(workload, judged["target"])][column]
                assert shown.endswith("PASS" if judged["pass"] else "MISS")
                number = float(shown.split()[0].rstrip("%"))
                scale = 100 if judged["kind"] == "%" else 1
                assert number == pytest.approx(scale * judged["value"], abs=0.05 if scale == 100 else 0.005)


def test_ratios_are_cache_aware_over_the_baselines(page):
    _, report, _ = page
    for rows in report["workloads"].values():
        for row in rows:
            policies = row["policies"]
            assert row["p50_ratio"] == pytest.approx(policies["cache_aware"]["ttft_p50_s"]
                                                     / policies["round_robin"]["ttft_p50_s"])
            best = min((p for p in policies if p != "cache_aware"), key=lambda p: policies[p]["ttft_p99_s"])
            assert row["p99_ratio"] == pytest.approx(policies["cache_aware"]["ttft_p99_s"]
                                                     / policies[best]["ttft_p99_s"])


def test_scaling_keeps_the_load_per_worker():
    from simulator import SimCalibration
    from simulator.scaling import cold_prefill_seconds, scale_repository_assistant, trace_time_scale
    from workloads import RepositoryAssistantConfig

    base = RepositoryAssistantConfig(repositories=12, requests=40, rate=0.2)
    scaled = scale_repository_assistant(base, 2, 500, 10_000)
    assert (scaled.repositories, scaled.rate, scaled.requests) == (3000, pytest.approx(50.0), 10_000)
    prompts = [100, 1000, 4000]
    assert trace_time_scale(prompts, 500, SimCalibration()) == pytest.approx(4 / 500)  # simulate_scale's 0.008
    slow = SimCalibration(prefill_per_token_seconds=3e-3)
    ratio = cold_prefill_seconds(prompts, slow) / cold_prefill_seconds(prompts, SimCalibration())
    assert trace_time_scale(prompts, 4, slow) == pytest.approx(ratio)


def test_a_page_redone_from_its_own_record_simulates_the_same(page, tmp_path):
    output, report, _ = page
    assert results_page.main(["--quick", "--from-page", str(output / "results.json"),
                               "--output", str(tmp_path)]) == 0
    redone = json.loads((tmp_path / "results.json").read_text())
    for workload, rows in report["workloads"].items():
        for row, again in zip(rows, redone["workloads"][workload], strict=True):
            for policy, summary in row["policies"].items():
                ours = again["policies"][policy]
                assert {k: v for k, v in ours.items() if k != "wall_seconds"} == \
                       {k: v for k, v in summary.items() if k != "wall_seconds"}, (workload, row["workers"], policy)
    assert redone["calibration"] == report["calibration"] and redone["model"] == report["model"]


def test_engine_settings_a_page_did_not_record_take_the_workers_defaults(page, tmp_path):
    output, report, _ = page
    old = json.loads((output / "results.json").read_text())
    for name in ("repository_engine", "trace_engine"):
        del old[name]["evict_pulled_first"]
    del old["repository_decode_engine"]
    old["real"] = {"summaries": {}, "ratios": {}, "workers": {}, "workload": {}}
    del old["stats_at_step_end"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    setup, real = results_page.setup_from_page(path)  # and the real-cluster sections it carries
    for settings in (setup.repository_settings, setup.trace_settings):
        assert settings.prefill_engine.evict_pulled_first is WorkerSettings.evict_pulled_first
        assert settings.stats_at_step_end  # a page with a real run modelled per-step load reports
    assert "evict_pulled_first = True (kvroute's default now; not recorded by" in setup.model
    assert real["real"]["recorded_by"] == str(path) and real["real_trace"] is None


def kept_page_with(page_folder: Path, flag: str, real_run: Path, output: Path) -> dict:
    """The page in ``page_folder`` redone with its simulated part kept and ``flag real_run``
    as its real-cluster section; the new page's JSON."""
    argv = ["--from-page", str(page_folder / "results.json"), "--keep-simulated", flag, str(real_run),
            "--output", str(output)]
    assert results_page.main(argv) == 0
    return json.loads((output / "results.json").read_text())


def test_a_real_trace_run_is_added_to_a_page_without_simulating_again(page, tmp_path):
    output, report, _ = page
    real_run = simulated_trace_run(tmp_path)
    kept = kept_page_with(output, "--real-trace", real_run, tmp_path / "page")
    assert kept["workloads"] == report["workloads"] and kept["command"] == report["command"]
    for name in (name for names in report["plots"].values() for name in names):
        assert (tmp_path / "page" / name).read_bytes() == (output / name).read_bytes()
    text = (tmp_path / "page" / "RESULTS.md").read_text()
    assert "redone by `kvroute bench results-page --from-page" in text
    section = sections(text)["The real cluster: trace"]
    run = json.loads(real_run.read_text())
    summaries, targets, validation = tables(section)
    rows = {row[0]: row for row in summaries}
    for policy, summary in run["summaries"].items():
        assert float(rows[policy][1]) == pytest.approx(summary["ttft_p50_s"], abs=0.005)
        assert rows[policy][4] == f"{summary['cached_tokens']:,}"
        assert float(rows[policy][5].rstrip("%")) == pytest.approx(100 * summary["of_lru_all_workers"], abs=0.05)
    judged = {t["target"]: t for t in kept["real_trace"]["targets"]}
    assert judged["cache_aware/round_robin P50 TTFT <= 0.8"]["value"] == pytest.approx(
        run["summaries"]["cache_aware"]["ttft_p50_s"] / run["summaries"]["round_robin"]["ttft_p50_s"])
    for name, t in judged.items():
        assert dict(targets)[name].endswith("PASS" if t["pass"] else "MISS")
    assert {row[0] for row in validation[1:]} == set(kept["real_trace"]["comparison"]) == set(run["summaries"])

    # A page made from that one carries the trace run, marked as recorded by it.
    again = tmp_path / "again"
    assert results_page.main(["--from-page", str(tmp_path / "page" / "results.json"), "--keep-simulated",
                              "--output", str(again)]) == 0
    carried = json.loads((again / "results.json").read_text())["real_trace"]
    assert carried["recorded_by"] == str(tmp_path / "page" / "results.json")
    assert "## The real cluster: trace" in (again / "RESULTS.md").read_text()


def test_a_real_repository_run_replaces_the_pages_real_section_without_simulating_again(page, tmp_path):
    output, report, _ = page
    real_run = simulated_repository_run(tmp_path)
    kept = kept_page_with(output, "--real", real_run, tmp_path / "page")
    assert kept["workloads"] == report["workloads"] and kept["calibration"] == report["calibration"]
    assert kept["real"]["source"] == str(real_run) and "recorded_by" not in kept["real"]
    section = sections((tmp_path / "page" / "RESULTS.md").read_text())["The real cluster"]
    assert f"(`{real_run}`)" in section
    run = json.loads(real_run.read_text())
    summaries, targets, validation = tables(section)
    rows = {row[0]: row for row in summaries}
    for policy, summary in run["summaries"].items():
        assert float(rows[policy][1]) == pytest.approx(summary["ttft_p50_s"], abs=0.005)
        assert float(rows[policy][2]) == pytest.approx(summary["ttft_p99_s"], abs=0.005)
    judged = {t["target"]: t for t in kept["real"]["targets"]}
    assert judged["cache_aware/round_robin P50 TTFT <= 0.25"]["value"] == pytest.approx(
        run["summaries"]["cache_aware"]["ttft_p50_s"] / run["summaries"]["round_robin"]["ttft_p50_s"])
    assert set(judged) == {"cache_aware/round_robin P50 TTFT <= 0.25", "cache_aware/best baseline P99 TTFT <= 1"}
    for name, t in judged.items():
        assert dict(targets)[name].endswith("PASS" if t["pass"] else "MISS")
    assert {row[0] for row in validation[1:]} == set(run["summaries"])


def test_keeping_the_simulated_part_needs_a_page():
    with pytest.raises(SystemExit):
        results_page.parse_args(["--keep-simulated"])


def test_a_real_run_and_a_page_without_keeping_its_simulation_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        results_page.parse_args(["--real", str(tmp_path / "run.json"), "--from-page", str(tmp_path / "page.json")])
