"""Model preparation's progress (``foundation.model_prep``): a line per finished step with its
seconds, also where the output is not a terminal; nothing with ``--no-progress``."""

from __future__ import annotations

from foundation import model_prep


def run_steps(enabled: bool) -> None:
    with model_prep._progress_steps(enabled) as step:
        for name in model_prep.STEPS:
            with step(name):
                pass


def test_each_finished_step_is_printed_with_its_seconds(capsys):
    run_steps(True)
    out = capsys.readouterr().out
    assert "\r" not in out and "\x1b" not in out  # pytest's capture is not a terminal
    assert [line for line in out.splitlines() if " done in " in line] == [
        f"{model_prep.DEFAULT_MODEL_NAME}: {name} done in 0.0 s" for name in model_prep.STEPS]


def test_no_progress_prints_nothing(capsys):
    run_steps(False)
    assert capsys.readouterr().out == ""
