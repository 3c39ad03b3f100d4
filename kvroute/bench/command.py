"""One ``kvroute bench <name>`` sub-command: its arguments, their checks and what it runs.

Each measurement module ends with a ``COMMAND = Command(...)``; ``kvroute.bench.commands``
registers them under ``kvroute bench``. ``Command.main(argv)`` parses and runs the same
arguments without the ``kvroute`` parser around them (what the tests call).

Every command gets ``--no-progress`` (plain lines instead of bars drawn in place) and ends
by listing the files it wrote under its ``--output`` (``progress.closing_report``), so no
measurement module carries code of its own for either.

A module registered here is imported whenever the ``kvroute`` parser is built, so it
imports nothing heavy at its top (torch, matplotlib, vLLM, transformers): those wait for
``run``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.bench import progress

# What the kvroute parser adds to every sub-command's namespace: not the measurement's arguments
# (measurements write their arguments into their results).
_PARSER_KEYS = ("command", "bench", "func")
# What ``Command`` adds to every sub-command and takes out again before ``run`` sees the arguments.
_DISPLAY_KEY = "no_progress"


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # one line in ``kvroute bench --help``
    doc: str  # the module's docstring: its first paragraph describes the command
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    # Checks (and normalises) the parsed arguments; ``parser.error`` on a bad one.
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None

    @property
    def description(self) -> str:
        return self.doc.split("\n\n")[0]

    def register(self, bench_commands) -> argparse.ArgumentParser:
        parser = bench_commands.add_parser(self.name, help=self.help, description=self.description)
        self._add_all_arguments(parser)
        parser.set_defaults(func=lambda args: self._run(parser, own_arguments(args)))
        return parser

    def parse_args(self, argv: list[str] | None = None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog=f"kvroute bench {self.name}", description=self.description)
        self._add_all_arguments(parser)
        args = parser.parse_args(argv)
        if self.check:
            self.check(parser, args)
        return args

    def main(self, argv: list[str] | None = None) -> int:
        return self.execute(self.parse_args(argv))

    def execute(self, args: argparse.Namespace, run: Callable[[argparse.Namespace], int | None] | None = None) -> int:
        """``run`` (default: the command's own) on checked ``args``, with the progress display
        ``--no-progress`` asks for, then the list of files it wrote under ``--output``."""
        live = not getattr(args, _DISPLAY_KEY, False)
        measured = argparse.Namespace(**{key: value for key, value in vars(args).items() if key != _DISPLAY_KEY})
        with progress.closing_report(getattr(measured, "output", None), live):
            return (run or self.run)(measured) or 0

    def _run(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        if self.check:
            self.check(parser, args)
        return self.execute(args)

    def _add_all_arguments(self, parser: argparse.ArgumentParser) -> None:
        self.add_arguments(parser)
        parser.add_argument("--no-progress", dest=_DISPLAY_KEY, action="store_true",
                            help="plain progress lines instead of bars redrawn in place (as when the output "
                                 "is not a terminal)")


def own_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """The sub-command's arguments alone, as its own parser would have returned them."""
    return argparse.Namespace(**{key: value for key, value in vars(args).items() if key not in _PARSER_KEYS})
