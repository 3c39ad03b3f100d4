"""foundation.config: defaults < config file < KVROUTE_* environment < explicit flags, onto
frozen settings dataclasses (the orchestrator's and ``kvroute serve``'s pool)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from foundation import config
from foundation.config import ConfigError, setting
from kvroute.serve import PoolSettings
from orchestrator.settings import OrchestratorSettings


@dataclasses.dataclass(frozen=True)
class Sample:
    """Every kind of field the loader knows about."""

    name: str = setting("default", "a plain string")
    count: int = setting(3, "an integer")
    ratio: float = setting(0.5, "a float")
    enabled: bool = setting(False, "a switch")
    tags: tuple[str, ...] = setting(("a",), "comma-separated tags")
    maybe: int | None = setting(None, "an optional integer")
    hidden: str = dataclasses.field(default="internal")  # no help: no flag


def parser_for(*classes: type, with_config_flag: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    for i, cls in enumerate(classes):
        config.add_arguments(parser, cls, with_config_flag=with_config_flag and i == 0)
    return parser


def parse(cls: type, argv: list[str]) -> argparse.Namespace:
    return parser_for(cls).parse_args(argv)


def write(tmp_path: Path, name: str, data: dict | str) -> Path:
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data)
    elif name.endswith(".json"):
        path.write_text(json.dumps(data))
    else:
        import yaml

        path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------- defaults and precedence


def test_defaults_without_args_or_environment():
    assert config.load(OrchestratorSettings, None, environ={}) == OrchestratorSettings()
    assert config.load(PoolSettings, None, environ={}) == PoolSettings()
    assert config.load(OrchestratorSettings, parse(OrchestratorSettings, []), environ={}) == OrchestratorSettings()


def test_unset_flags_do_not_override():
    args = parse(OrchestratorSettings, [])
    assert all(getattr(args, f.name) is None for f in dataclasses.fields(OrchestratorSettings))
    assert args.config is None


@pytest.mark.parametrize("file_port, env_port, flag_port, expected", [
    (None, None, None, 8000),
    (8001, None, None, 8001),
    (None, "8002", None, 8002),
    (8001, "8002", None, 8002),
    (None, None, 8003, 8003),
    (8001, None, 8003, 8003),
    (None, "8002", 8003, 8003),
    (8001, "8002", 8003, 8003),
])
@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_precedence(tmp_path, file_port, env_port, flag_port, expected, suffix):
    argv = []
    if file_port is not None:
        argv += ["--config", str(write(tmp_path, f"c.{suffix}", {"port": file_port}))]
    if flag_port is not None:
        argv += ["--port", str(flag_port)]
    environ = {} if env_port is None else {"KVROUTE_PORT": env_port}
    settings = config.load(OrchestratorSettings, parse(OrchestratorSettings, argv), environ=environ)
    assert settings.port == expected
    assert isinstance(settings.port, int)


def test_each_source_contributes_its_own_fields(tmp_path):
    path = write(tmp_path, "c.yaml", {"host": "0.0.0.0", "port": 9000, "policy": "round_robin",
                                      "log_level": "debug", "allow_unauthenticated": True})
    args = parse(OrchestratorSettings, ["--config", str(path), "--policy", "least_loaded",
                                        "--heartbeat-timeout-seconds", "2.5"])
    settings = config.load(OrchestratorSettings, args, environ={"KVROUTE_PORT": "9100",
                                                                "KVROUTE_LOG_LEVEL": "warning",
                                                                "KVROUTE_MAX_MODEL_LEN": "4096"})
    assert settings == dataclasses.replace(OrchestratorSettings(), host="0.0.0.0", port=9100, policy="least_loaded",
                                           log_level="warning", max_model_len=4096, heartbeat_timeout_seconds=2.5,
                                           allow_unauthenticated=True)


def test_environment_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("KVROUTE_REGISTRY_PORT", "7777")
    monkeypatch.setenv("KVROUTE_WORKER_TIMEOUT_SECONDS", "1.5")
    settings = config.load(OrchestratorSettings, parse(OrchestratorSettings, []))
    assert settings.registry_port == 7777
    assert settings.worker_timeout_seconds == 1.5
    assert settings.registry_address == "tcp://127.0.0.1:7777"


def test_environment_names_are_prefixed_and_upper_case():
    environ = {"PORT": "1", "kvroute_port": "2", "KVROUTE_port": "3", "KVROUTE_PORTS": "4"}
    assert config.load(OrchestratorSettings, None, environ=environ).port == 8000


# ---------------------------------------------------------------- config files


@pytest.mark.parametrize("name, text", [
    ("c.yaml", "served-model-name: smol\nmax-model-len: 2048\nheartbeat_timeout_seconds: 1.5\n"),
    ("c.yml", "served_model_name: smol\nmax_model_len: 2048\nheartbeat-timeout-seconds: 1.5\n"),
    ("c.json", '{"served-model-name": "smol", "max_model_len": 2048, "heartbeat-timeout-seconds": 1.5}'),
    ("settings", "served_model_name: smol\nmax-model-len: 2048\nheartbeat_timeout_seconds: 1.5\n"),
])
def test_config_file_yaml_or_json_dashed_or_underscored(tmp_path, name, text):
    args = parse(OrchestratorSettings, ["--config", str(write(tmp_path, name, text))])
    settings = config.load(OrchestratorSettings, args, environ={})
    assert (settings.served_model_name, settings.max_model_len, settings.heartbeat_timeout_seconds) == \
        ("smol", 2048, 1.5)


def test_read_config_file_normalises_dashes(tmp_path):
    path = write(tmp_path, "c.json", {"kv-cache-gib": 0.5, "total_kv_gib": 2})
    assert config.read_config_file(path) == {"kv_cache_gib": 0.5, "total_kv_gib": 2}


@pytest.mark.parametrize("name, data", [
    ("c.yaml", {"port": 8001, "colour": "blue"}),
    ("c.json", {"total-kv-gib": 2}),  # a PoolSettings key is foreign to OrchestratorSettings
    ("c.yaml", {"Port": 8001}),
])
def test_unknown_keys_in_a_file_raise(tmp_path, name, data):
    args = parse(OrchestratorSettings, ["--config", str(write(tmp_path, name, data))])
    with pytest.raises(ConfigError, match="unknown settings") as info:
        config.load(OrchestratorSettings, args, environ={})
    foreign = [k.replace("-", "_") for k in data if k.replace("-", "_") not in {"port"}]
    assert all(key in str(info.value) for key in foreign)


def test_only_known_takes_just_its_own_keys(tmp_path):
    """One file configures both settings objects of ``kvroute serve``."""
    path = write(tmp_path, "serve.yaml", {"port": 8100, "policy": "round_robin", "topology": "2u",
                                          "cores_per_engine": 3, "kv_cache_gib": 0.5, "dtype": "float32",
                                          "something_else": True})
    parser = parser_for(OrchestratorSettings, PoolSettings)
    args = parser.parse_args(["--config", str(path), "--cores-per-engine", "4", "--port", "8200"])
    environ = {"KVROUTE_DTYPE": "bfloat16", "KVROUTE_HOST": "0.0.0.0", "KVROUTE_API_KEYS": "keys.yaml"}
    orchestrator = config.load(OrchestratorSettings, args, environ=environ, only_known=True)
    pool = config.load(PoolSettings, args, environ=environ, only_known=True)
    assert orchestrator == dataclasses.replace(OrchestratorSettings(), port=8200, policy="round_robin",
                                               host="0.0.0.0", api_keys="keys.yaml")
    assert pool == PoolSettings(topology="2u", cores_per_engine=4, kv_cache_gib=0.5, dtype="bfloat16")
    # Without only_known the same file is refused.
    with pytest.raises(ConfigError, match="unknown settings"):
        config.load(PoolSettings, args, environ={})


def test_only_known_still_validates_values(tmp_path):
    path = write(tmp_path, "c.yaml", {"policy": "nope", "topology": "1u"})
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        config.load(OrchestratorSettings, parse(OrchestratorSettings, ["--config", str(path)]), environ={},
                    only_known=True)


@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", "- port\n- 8000\n", "must hold a mapping"),
    ("c.yaml", "", "must hold a mapping"),
    ("c.json", "[1, 2]", "must hold a mapping"),
    ("c.yaml", "port: [8000\n", "c.yaml"),
    ("c.json", '{"port": 8000', "c.json"),
])
def test_malformed_config_file(tmp_path, name, text, message):
    args = parse(OrchestratorSettings, ["--config", str(write(tmp_path, name, text))])
    with pytest.raises(ConfigError, match=message):
        config.load(OrchestratorSettings, args, environ={})


def test_missing_config_file(tmp_path):
    args = parse(OrchestratorSettings, ["--config", str(tmp_path / "absent.yaml")])
    with pytest.raises(ConfigError, match="cannot read config file .*absent.yaml"):
        config.load(OrchestratorSettings, args, environ={})


# ---------------------------------------------------------------- parsing from the environment


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), ("on", True), (" true ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
])
def test_bool_from_environment(raw, expected):
    assert config.load(Sample, None, environ={"KVROUTE_ENABLED": raw}).enabled is expected


@pytest.mark.parametrize("env, field, expected", [
    ({"KVROUTE_COUNT": "42"}, "count", 42),
    ({"KVROUTE_COUNT": "-7"}, "count", -7),
    ({"KVROUTE_RATIO": "0.25"}, "ratio", 0.25),
    ({"KVROUTE_RATIO": "3"}, "ratio", 3.0),
    ({"KVROUTE_RATIO": "1e-3"}, "ratio", 0.001),
    ({"KVROUTE_TAGS": "x,y,z"}, "tags", ("x", "y", "z")),
    ({"KVROUTE_TAGS": "solo"}, "tags", ("solo",)),
    ({"KVROUTE_TAGS": "x,,y,"}, "tags", ("x", "y")),
    ({"KVROUTE_TAGS": ""}, "tags", ()),
    ({"KVROUTE_MAYBE": "5"}, "maybe", 5),
    ({"KVROUTE_NAME": " spaced "}, "name", " spaced "),
    ({"KVROUTE_HIDDEN": "env"}, "hidden", "env"),
])
def test_typed_values_from_environment(env, field, expected):
    value = getattr(config.load(Sample, None, environ=env), field)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize("env", [
    {"KVROUTE_PORT": "abc"},
    {"KVROUTE_PORT": "80.5"},
    {"KVROUTE_HEARTBEAT_TIMEOUT_SECONDS": "soon"},
    {"KVROUTE_MAX_MODEL_LEN": ""},
])
def test_invalid_number_in_environment(env):
    (name, raw), = env.items()
    with pytest.raises(ConfigError) as info:
        config.load(OrchestratorSettings, None, environ=env)
    # The message names the variable and the offending value.
    assert f"{name}={raw!r}" in str(info.value)


def test_environment_model_accepts_a_string():
    settings = config.load(OrchestratorSettings, None, environ={"KVROUTE_MODEL": "/models/smol"})
    assert settings.model == "/models/smol"


# ---------------------------------------------------------------- flags


def test_flags_are_typed():
    args = parse(Sample, ["--count", "9", "--ratio", "0.1", "--enabled", "--maybe", "2", "--name", "n"])
    settings = config.load(Sample, args, environ={})
    assert (settings.count, settings.ratio, settings.enabled, settings.maybe, settings.name) == (9, 0.1, True, 2, "n")


def test_no_flag_overrides_a_true_environment():
    args = parse(Sample, ["--no-enabled"])
    assert args.enabled is False
    assert config.load(Sample, args, environ={"KVROUTE_ENABLED": "1"}).enabled is False
    assert config.load(Sample, parse(Sample, []), environ={"KVROUTE_ENABLED": "1"}).enabled is True


def test_tuple_flag_is_split_like_the_environment():
    settings = config.load(Sample, parse(Sample, ["--tags", "p,q"]), environ={})
    assert settings.tags == ("p", "q")
    assert settings.tags == config.load(Sample, None, environ={"KVROUTE_TAGS": "p,q"}).tags


def test_fields_without_help_get_no_flag():
    with pytest.raises(SystemExit):
        parser_for(Sample).parse_args(["--hidden", "x"])


@pytest.mark.parametrize("argv", [["--port", "abc"], ["--max-model-len", "1.5"], ["--heartbeat-timeout-seconds", "x"]])
def test_invalid_flag_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(OrchestratorSettings, argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("cls, env, argv, message", [
    (OrchestratorSettings, {}, ["--policy", "nope"], "unknown policy 'nope'; choose one of "),
    (OrchestratorSettings, {"KVROUTE_POLICY": "nope"}, [], "unknown policy 'nope'"),
    (OrchestratorSettings, {}, ["--max-model-len", "1"], "max_model_len must be at least 2"),
    (PoolSettings, {}, ["--topology", "2p"], "needs a unified worker, or prefill and decode workers both"),
    (PoolSettings, {"KVROUTE_TOPOLOGY": "three"}, [], "not 'auto' nor counts and roles"),
    (PoolSettings, {}, ["--cores-per-engine", "0"], "cores_per_engine must be at least 1"),
])
def test_invalid_values_raise_config_error(cls, env, argv, message):
    with pytest.raises(ConfigError, match=message) as info:
        config.load(cls, parse(cls, argv), environ=env)
    assert isinstance(info.value, ValueError)
    if "policy" in message:
        # The message lists the valid choices.
        from orchestrator.settings import POLICIES

        assert POLICIES and all(name in str(info.value) for name in POLICIES)


def test_invalid_value_in_file(tmp_path):
    args = parse(OrchestratorSettings, ["--config", str(write(tmp_path, "c.yaml", {"policy": "nope"}))])
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        config.load(OrchestratorSettings, args, environ={})


def test_settings_are_frozen():
    settings = config.load(OrchestratorSettings, None, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]


# ---------------------------------------------------------------- help


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("cls", [OrchestratorSettings, PoolSettings, Sample])
def test_every_field_with_help_is_in_the_help_text(cls):
    help_text = _flat(parser_for(cls).format_help())
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        if not field.metadata.get("help"):
            assert flag not in help_text
            continue
        assert flag in help_text
        assert _flat(field.metadata["help"]) in help_text
        assert f"KVROUTE_{field.name.upper()}" in help_text
        assert f"default: {field.default!r}" in _flat(help_text).replace("- ", "-")


def test_config_flag_only_when_asked():
    assert "--config" in parser_for(OrchestratorSettings).format_help()
    assert "--config" not in parser_for(PoolSettings, with_config_flag=False).format_help()


def test_serve_style_parser_combines_both_without_clashes():
    parser = parser_for(OrchestratorSettings, PoolSettings)
    help_text = _flat(parser.format_help())
    for cls in (OrchestratorSettings, PoolSettings):
        for field in dataclasses.fields(cls):
            assert "--" + field.name.replace("_", "-") in help_text


def test_real_cli_parser_builds():
    from kvroute.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--topology", "2p1d", "--port", "8123"])
    assert config.load(PoolSettings, args, environ={}, only_known=True).topology == "2p1d"
    assert config.load(OrchestratorSettings, args, environ={}, only_known=True).port == 8123


def test_the_http_server_keeps_idle_connections_past_the_clients_expiry():
    """httpx, so the openai package, reuses a connection idle for up to 5 s."""
    assert OrchestratorSettings().http_server_options()["timeout_keep_alive"] == 15.0
    assert OrchestratorSettings(keep_alive_seconds=10).http_server_options()["timeout_keep_alive"] == 10
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="keep_alive_seconds"):
            OrchestratorSettings(keep_alive_seconds=bad)


@pytest.mark.parametrize("flags, shared", [([], True), (["--no-shared-copies"], False)])
def test_serve_passes_shared_copies_to_its_workers(flags, shared):
    from kvroute.serve import worker_args
    from kvroute.topology import Engine
    pool = config.load(PoolSettings, parser_for(PoolSettings).parse_args(flags), environ={})
    assert pool.shared_copies is shared
    args = worker_args(pool, OrchestratorSettings(), "model", Engine("unified", "0", None, 0.5))
    assert ("--no-shared-copies" in args) is not shared


def test_the_orchestrators_trace_collector_comes_from_the_environment_and_is_checked():
    settings = config.load(OrchestratorSettings, None, environ={"KVROUTE_OTLP_ENDPOINT": "http://collector:4317",
                                                                "KVROUTE_OTLP_PROTOCOL": "grpc"})
    assert (settings.otlp_endpoint, settings.otlp_protocol) == ("http://collector:4317", "grpc")
    with pytest.raises(ConfigError, match="otlp_endpoint must be an http"):
        config.load(OrchestratorSettings, None, environ={"KVROUTE_OTLP_ENDPOINT": "collector:4317"})
    with pytest.raises(ConfigError, match="otlp_protocol"):
        config.load(OrchestratorSettings, None, environ={"KVROUTE_OTLP_PROTOCOL": "zipkin"})
