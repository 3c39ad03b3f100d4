"""``kvroute.bench.progress``: bars as plain lines where the output is not a terminal (or under
``--no-progress``), drawn in place on one; the closing list of the files a run wrote, and
``Command`` giving every bench both."""

from __future__ import annotations

import argparse
import io
import os
import time

import pytest
from rich.console import Console

from kvroute.bench import planner
from kvroute.bench.command import Command
from kvroute.bench.progress import Bar, Outputs, closing_report, live_bars, report_outputs, request_bar, track


def recording(terminal: bool = False) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=120)


def printed(console: Console) -> str:
    return console.file.getvalue()


def control_codes(text: str) -> bool:
    return "\x1b" in text or "\r" in text


def test_a_replay_bar_without_a_terminal_prints_a_line_every_tenth_with_the_errors():
    console = recording()
    with request_bar(console, "cache_aware", 40) as bar:
        for index in range(40):
            bar.advance(failed=index in (5, 6))
    lines = printed(console).splitlines()
    assert not control_codes(printed(console))
    assert len(lines) == 10
    assert lines[0].startswith("cache_aware: 4/40 requests, 0 errors (0:00:0")
    assert lines[-1].startswith("cache_aware: 40/40 requests, 2 errors (")


def test_phases_without_a_terminal_print_a_line_as_each_starts_and_one_at_the_end():
    console = recording()
    for _ in track([4, 32], "fleet sizes", console, name=lambda size: f"{2 * size} workers"):
        for _ in track(["cache_aware"], "policies", console):
            pass
    assert [line.split(" (")[0] for line in printed(console).splitlines()] == [
        "[1/2] fleet sizes: 8 workers", "[1/1] policies: cache_aware", "policies: 1/1 done in 0:00:00",
        "[2/2] fleet sizes: 64 workers", "[1/1] policies: cache_aware", "policies: 1/1 done in 0:00:00",
        "fleet sizes: 2/2 done in 0:00:00"]


def test_a_phase_left_by_an_error_is_not_counted_done():
    console = recording()
    with pytest.raises(RuntimeError), Bar(console, "phases", 2) as phase:
        phase.step("engine")
        raise RuntimeError("the engine did not start")
    assert phase.done == 0
    assert "done in" not in printed(console)


def test_a_terminal_gets_one_display_for_nested_bars_and_no_progress_turns_it_into_lines():
    console = recording(terminal=True)
    with Bar(console, "policies", 1) as outer:
        outer.step("cache_aware")
        with request_bar(console, "cache_aware", 3) as inner:
            assert inner._progress is outer._progress  # a row of the outer display
            for _ in range(3):
                inner.advance()
        assert len(outer._progress.tasks) == 1  # the finished replay's row is gone
    assert control_codes(printed(console))

    console = recording(terminal=True)
    with live_bars(False), request_bar(console, "cache_aware", 3) as bar:
        for _ in range(3):
            bar.advance()
    assert not control_codes(printed(console))
    assert printed(console).splitlines()[-1].startswith("cache_aware: 3/3 requests, 0 errors")


def test_outputs_are_the_files_created_or_changed_since_the_start_not_older_ones(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    (tmp_path / "rewritten.json").write_text("{}")
    past = time.time() - 60
    os.utime(tmp_path / "rewritten.json", (past, past))
    watch = Outputs.watch(tmp_path)
    (tmp_path / "results.json").write_text('{"a": 1}')
    (tmp_path / "rewritten.json").write_text('{"b": 2}')
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "serve.log").write_text("started\n")
    assert watch.written() == [tmp_path / "logs" / "serve.log", tmp_path / "results.json",
                               tmp_path / "rewritten.json"]


def test_outputs_of_a_single_file_and_of_a_folder_made_by_the_run(tmp_path):
    file_watch, folder_watch = Outputs.watch(tmp_path / "gpu_check.json"), Outputs.watch(tmp_path / "new")
    (tmp_path / "gpu_check.json").write_text("{}")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "plot.png").write_bytes(b"png")
    assert file_watch.written() == [tmp_path / "gpu_check.json"]
    assert folder_watch.written() == [tmp_path / "new" / "plot.png"]


def test_the_report_lists_result_files_with_sizes_and_counts_logs_per_folder(tmp_path):
    files = {"results.json": 2048, "ttft_cdf.png": 10, "RESULTS.md": 3 * 2**20, "serve.log": 5,
             "logs/a.log": 100, "logs/b.log": 200, "logs/c.txt.gz": 1}
    for name, size in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    console = recording()
    report_outputs([tmp_path / name for name in files], console)
    lines = printed(console).splitlines()
    assert lines[0] == "Results of this run:"
    assert [line.split() for line in lines[1:]] == [
        ["3.0", "MiB", str(tmp_path / "RESULTS.md")],
        ["2.0", "KiB", str(tmp_path / "results.json")],
        ["10", "B", str(tmp_path / "ttft_cdf.png")],
        ["301", "B", f"{tmp_path / 'logs'}/", "(3", "files:", ".gz,", ".log)"],
        ["5", "B", str(tmp_path / "serve.log")]]
    assert not control_codes(printed(console))


def test_a_failed_run_lists_its_partial_results_and_a_run_that_wrote_nothing_says_so(tmp_path):
    console = recording()
    with pytest.raises(KeyboardInterrupt), closing_report(tmp_path, console=console):
        (tmp_path / "results.json").write_text("{}")
        raise KeyboardInterrupt
    assert str(tmp_path / "results.json") in printed(console)

    console = recording()
    with closing_report(tmp_path / "dry-run", console=console):
        pass
    assert printed(console) == "This run wrote no files.\n"


def test_a_command_runs_without_its_display_flag_and_ends_with_the_report(tmp_path, capsys):
    seen = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--output", default=str(tmp_path))

    def run(args: argparse.Namespace) -> int:
        seen.append(vars(args))
        for _ in track(["a", "b"], "phases", Console()):
            (tmp_path / "results.json").write_text("{}")
        return 0

    assert Command("probe", "a probe", "A probe.", add_arguments, run).main(["--no-progress"]) == 0
    assert seen == [{"output": str(tmp_path)}]  # measurements record their arguments; not the display's
    out = capsys.readouterr().out
    assert out.splitlines()[-2:] == ["Results of this run:", f"         2 B  {tmp_path / 'results.json'}"]


def test_a_real_bench_ends_by_listing_what_it_wrote(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("an earlier run's")
    assert planner.main(["--sizes", "2", "--requests", "3", "--policies", "round_robin",
                         "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not control_codes(out)
    assert "[1/1] fleet sizes: 4 workers" in out
    report = out[out.index("Results of this run:"):].splitlines()
    assert len(report) == 2 and report[1].endswith(f"  {tmp_path / 'results.json'}")
