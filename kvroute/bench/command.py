"""One ``kvroute bench <name>`` sub-command: its arguments, their checks and what it runs.

Each measurement module ends with a ``COMMAND = Command(...)``; ``kvroute.bench.commands``
registers them under ``kvroute bench``. ``Command.main(argv)`` parses and runs the same
arguments without the ``kvroute`` parser around them (what the tests call).

A module registered here is imported whenever the ``kvroute`` parser is built, so it
imports nothing heavy at its top (torch, matplotlib, vLLM, transformers): those wait for
``run``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

# What the kvroute parser adds to every sub-command's namespace: not the measurement's arguments
# (measurements write their arguments into their results).
_PARSER_KEYS = ("command", "bench", "func")


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
        self.add_arguments(parser)
        parser.set_defaults(func=lambda args: self._run(parser, own_arguments(args)))
        return parser

    def parse_args(self, argv: list[str] | None = None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog=f"kvroute bench {self.name}", description=self.description)
        self.add_arguments(parser)
        args = parser.parse_args(argv)
        if self.check:
            self.check(parser, args)
        return args

    def main(self, argv: list[str] | None = None) -> int:
        return self.run(self.parse_args(argv)) or 0

    def _run(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
        if self.check:
            self.check(parser, args)
        return self.run(args) or 0


def own_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """The sub-command's arguments alone, as its own parser would have returned them."""
    return argparse.Namespace(**{key: value for key, value in vars(args).items() if key not in _PARSER_KEYS})
