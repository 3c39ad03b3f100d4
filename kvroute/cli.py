"""The ``kvroute`` command: one entry point, one sub-command per process or task.

Modules are imported where a command needs them: ``kvroute probe`` runs every few seconds
in every worker's container (Kubernetes exec probes), and the server stack's imports take
seconds of CPU that a probe has no use for.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from worker import probe as worker_probe


def _main_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(prog="kvroute", description="Cache-aware, disaggregated LLM serving.")
    return parser, parser.add_subparsers(dest="command", required=True)


def build_probe_parser() -> argparse.ArgumentParser:
    """``kvroute`` with only its ``probe`` command, which imports nothing of the servers."""
    parser, commands = _main_parser()
    worker_probe.add_cli(commands)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from foundation import config, model_prep
    from worker import cli_args as worker_cli

    parser, commands = _main_parser()
    model_prep.add_cli(commands)
    for role, what in (("prefill", "a vLLM engine that prefills prompts"),
                       ("decode", "a vLLM engine that decodes, pulling prompts' KV from prefill workers"),
                       ("unified", "a vLLM engine that prefills and decodes, and lends or pulls KV")):
        sub = commands.add_parser(f"{role}-worker", help=f"run one {role} worker ({what})")
        worker_cli.add_worker_arguments(sub)
        sub.set_defaults(func=lambda args, role=role: _run_worker(args, role))
    orchestrator = commands.add_parser("orchestrator", help="run the orchestrator (OpenAI API + registry)")
    _add_orchestrator_arguments(orchestrator)
    orchestrator.set_defaults(func=_run_orchestrator)
    serve = commands.add_parser("serve", help="the embedded default: orchestrator plus worker pools on "
                                              "this machine, stopped together with Ctrl-C")
    _add_orchestrator_arguments(serve)
    from kvroute.serve import PoolSettings

    config.add_arguments(serve, PoolSettings, with_config_flag=False)
    serve.set_defaults(func=_run_serve)
    _add_node_store_command(commands)
    _add_keys_commands(commands)
    worker_probe.add_cli(commands)
    _add_bench_commands(commands)
    return parser


def _add_node_store_command(commands) -> None:
    from foundation import config, zmq_auth
    from transfer.node_store.settings import NodeStoreSettings

    store = commands.add_parser("node-store", help="run this host's node KV store: host memory (and disk) behind "
                                                   "every engine cache on the host (docs/transfer.md)")
    config.add_arguments(store, NodeStoreSettings)
    zmq_auth.add_security_arguments(store)
    store.add_argument("--ready-file", type=Path, default=None,
                       help="write the store's address as JSON here once it serves")
    store.set_defaults(func=_run_node_store)


def _run_node_store(args: argparse.Namespace) -> int:
    import json

    from foundation import config
    from transfer.node_store.server import run_node_store
    from transfer.node_store.settings import NodeStoreSettings

    def ready(address: str) -> None:
        if args.ready_file is not None:
            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"address": address}))
            tmp.replace(args.ready_file)

    run_node_store(config.load(NodeStoreSettings, args), args.cluster_keys, args.insecure_no_auth,
                   args.transfer_encryption == "on", ready)
    return 0


def _add_keys_commands(commands) -> None:
    from foundation import cluster_keys

    keys = commands.add_parser("keys", help="the cluster's keys (docs/security.md)")
    actions = keys.add_subparsers(dest="keys", required=True)
    init = actions.add_parser("init", help="create a key folder: CURVE keys of the orchestrator and worker roles "
                                           "and the secret cache salts are keyed by")
    init.add_argument("folder", type=Path)
    init.set_defaults(func=lambda args: _print(f"cluster keys written to {cluster_keys.init(args.folder)}; give "
                                               f"every process --cluster-keys {args.folder}"))
    workers = actions.add_parser("worker-set", help="copy what a worker needs (both public keys and the worker's "
                                                    "secret; not the orchestrator's secret or the salt secret)")
    workers.add_argument("folder", type=Path, help="the full key folder")
    workers.add_argument("out", type=Path, help="the new folder for workers")
    workers.set_defaults(func=lambda args: _print(f"worker keys written to "
                                                  f"{cluster_keys.worker_set(args.folder, args.out)}"))
    install = actions.add_parser("install", help="copy a key folder that others may read (a Kubernetes Secret "
                                                 "volume) into a new private one (0700, files 0600) that "
                                                 "--cluster-keys accepts")
    install.add_argument("source", type=Path, help="the folder holding the key files, e.g. a mounted Secret")
    install.add_argument("folder", type=Path, help="the new private folder")
    install.set_defaults(func=lambda args: _print(f"cluster keys installed in "
                                                  f"{cluster_keys.install(args.source, args.folder)}"))


def _print(line: str) -> int:
    print(line)
    return 0


def _add_bench_commands(commands) -> None:
    from kvroute.bench import commands as measurements

    bench = commands.add_parser("bench", help="benchmarks that write JSON and PNG reports")
    measurements.add_cli(bench.add_subparsers(dest="bench", required=True))


def _add_orchestrator_arguments(parser: argparse.ArgumentParser) -> None:
    from foundation import config
    from orchestrator.settings import OrchestratorSettings

    config.add_arguments(parser, OrchestratorSettings)


def _run_orchestrator(args: argparse.Namespace) -> int:
    from foundation import config, model_prep
    from orchestrator.app import run_orchestrator
    from orchestrator.settings import OrchestratorSettings

    settings = config.load(OrchestratorSettings, args)
    run_orchestrator(replace(settings, model=model_prep.resolve_model(settings.model)))
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    from foundation import config
    from kvroute.serve import PoolSettings, run_serve
    from orchestrator.settings import OrchestratorSettings

    return run_serve(config.load(OrchestratorSettings, args, only_known=True),
                     config.load(PoolSettings, args, only_known=True))


def _run_worker(args: argparse.Namespace, role: str) -> int:
    from worker import cli_args as worker_cli
    from worker.process import run_worker

    run_worker(worker_cli.settings_from_args(args, role), args.ready_file)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_probe_parser() if argv[:1] == ["probe"] else build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:  # foundation.config.ConfigError included
        # One line: a settings error is about values, so argparse's usage text would only bury it.
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
