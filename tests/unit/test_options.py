"""Tests of ``dmq_server.core.options``: one dataclass behind flags, variables and the config file.

Pins the precedence (flag > environment > config file > default), that every bad
value is reported with the name the operator used (flag, variable, or file and
key), the duration and address syntax, and that ``deploy/dmq.conf.example`` is
exactly what the dataclass renders, so the documented settings cannot drift from
the real ones. The environment is always passed in explicitly, never read.
"""

from __future__ import annotations

import dataclasses
import math
import runpy
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmq_server.core import options as options_module
from dmq_server.core.options import (
    ConfigError,
    Options,
    build_parser,
    env_name,
    flag_name,
    load_config,
    options_from_args,
    parse_config,
    render_example,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "deploy" / "dmq.conf.example"
REGENERATE = "python -m dmq_server.core.options --example > deploy/dmq.conf.example"
FIELDS = dataclasses.fields(Options)


def exit_message(excinfo: pytest.ExceptionInfo[SystemExit]) -> str:
    return str(excinfo.value.code)


# -- the fields themselves ----------------------------------------------------
@pytest.mark.parametrize("f", FIELDS, ids=[f.name for f in FIELDS])
def test_every_field_is_documented_and_typed(f: dataclasses.Field) -> None:
    """Each setting has help text, a known kind, and a default of that kind, since the
    flags, the environment, the file and the example are all generated from them."""
    assert f.metadata["help"].strip(), f"{f.name} has no help text"
    kind = f.metadata["kind"]
    assert kind in {"str", "int", "duration", "bool", "list"}
    expected_type = {"str": str, "int": int, "duration": float, "bool": bool, "list": tuple}[kind]
    assert type(f.default) is expected_type, f"{f.name}: default {f.default!r} is not {kind}"


def test_defaults_are_valid() -> None:
    """The defaults alone make a usable configuration."""
    assert Options().validate() == Options()


def test_flag_and_env_names_are_derived_from_field_names() -> None:
    """--mem-queue-size and DMQ_MEM_QUEUE_SIZE are both the field mem_queue_size."""
    assert flag_name("mem_queue_size") == "--mem-queue-size"
    assert env_name("mem_queue_size") == "DMQ_MEM_QUEUE_SIZE"
    assert len({flag_name(f.name) for f in FIELDS}) == len(FIELDS)


def test_help_lists_every_flag_with_its_variable_and_default() -> None:
    """--help shows each option's flag, environment variable and default (and --config)."""
    text = " ".join(build_parser().format_help().split())
    assert "--config PATH" in text and "DMQ_CONFIG" in text
    for f in FIELDS:
        assert flag_name(f.name) in text
        assert env_name(f.name) in text
    assert "default 1m" in text  # msg_timeout, as a duration
    assert "default: None" not in text


# -- precedence ----------------------------------------------------------------
def write_config(tmp_path: Path, text: str, name: str = "dmq.conf") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_no_sources_gives_the_defaults() -> None:
    """Without flags, variables or a file, every setting is its default."""
    assert options_from_args([], environ={}) == Options()


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    """Four settings, each decided by a different source."""
    config = write_config(
        tmp_path,
        'msg_timeout = "5m"\nmem_queue_size = 300\nmax_credit = 700\n',
    )
    environ = {"DMQ_MSG_TIMEOUT": "2m", "DMQ_MEM_QUEUE_SIZE": "200", "DMQ_CONFIG": ""}
    options = options_from_args(["--config", str(config), "--msg-timeout", "1500ms"], environ)
    assert options.msg_timeout == 1.5  # flag over env and file
    assert options.mem_queue_size == 200  # env over file
    assert options.max_credit == 700  # file over default
    assert options.default_credit == Options().default_credit  # default


def test_config_path_from_the_environment(tmp_path: Path) -> None:
    """DMQ_CONFIG names the file when --config is not given."""
    config = write_config(tmp_path, "ack_batch_size = 42\n")
    options = options_from_args([], {"DMQ_CONFIG": str(config)})
    assert options.ack_batch_size == 42


def test_config_flag_beats_config_env(tmp_path: Path) -> None:
    """--config wins over DMQ_CONFIG, like every other flag over its variable."""
    chosen = write_config(tmp_path, "ack_batch_size = 1\n", "chosen.conf")
    ignored = write_config(tmp_path, "ack_batch_size = 2\n", "ignored.conf")
    options = options_from_args(["--config", str(chosen)], {"DMQ_CONFIG": str(ignored)})
    assert options.ack_batch_size == 1


def test_env_values_are_parsed_like_flags() -> None:
    """Variables are text and go through the same conversions as flags."""
    options = options_from_args([], {"DMQ_SCAN_INTERVAL": "250ms", "DMQ_MAX_MSG_SIZE": "2048"})
    assert options.scan_interval == 0.25 and options.max_msg_size == 2048


def test_file_durations_may_be_strings_or_seconds() -> None:
    """In the file "30s", 30 and 0.5 are all durations; strings stay strings."""
    values = parse_config('msg_timeout = "30s"\nscan_interval = 0.5\nsweep_interval = 45\nnode_id = "n1"\n')
    assert values == {"msg_timeout": 30.0, "scan_interval": 0.5, "sweep_interval": 45.0, "node_id": "n1"}


# -- errors name what the operator wrote ------------------------------------------
def test_bad_flag_value_names_the_flag() -> None:
    """A flag that does not parse is reported under its flag name."""
    with pytest.raises(SystemExit) as excinfo:
        options_from_args(["--mem-queue-size", "lots"], {})
    message = exit_message(excinfo)
    assert "--mem-queue-size" in message and "'lots'" in message


def test_bad_env_value_names_the_variable() -> None:
    """A variable that does not parse is reported under the variable's name."""
    with pytest.raises(SystemExit) as excinfo:
        options_from_args([], {"DMQ_MSG_TIMEOUT": "soon"})
    assert "DMQ_MSG_TIMEOUT" in exit_message(excinfo)


def test_bad_file_value_names_the_file_and_key(tmp_path: Path) -> None:
    """A file value of the wrong type is reported with the file path and the key."""
    config = write_config(tmp_path, 'mem_queue_size = "many"\n')
    with pytest.raises(SystemExit) as excinfo:
        options_from_args(["--config", str(config)], {})
    message = exit_message(excinfo)
    assert str(config) in message and "mem_queue_size" in message and "integer" in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("mem_queue_size = true\n", "mem_queue_size"),
        ("mem_queue_size = 1.5\n", "mem_queue_size"),
        ('max_msg_size = "1048576"\n', "max_msg_size"),
        ('msg_timeout = "soon"\n', "msg_timeout"),
        ("msg_timeout = -5\n", "msg_timeout"),
        ("msg_timeout = false\n", "msg_timeout"),
        ("msg_timeout = inf\n", "msg_timeout"),
        ("pg_dsn = 5\n", "pg_dsn"),
        ("[pg_dsn]\nhost = 'x'\n", "pg_dsn"),
        ("node_id = [1, 2]\n", "node_id"),
    ],
)
def test_wrongly_typed_file_values_are_errors_naming_the_key(text: str, key: str) -> None:
    """Strings are not numbers, numbers are not strings, tables and arrays are nothing."""
    with pytest.raises(ConfigError) as excinfo:
        parse_config(text, "dmq.conf")
    assert str(excinfo.value).startswith(f"dmq.conf: {key}:")


def test_unknown_key_is_an_error_with_a_suggestion() -> None:
    """A misspelt key is refused (not silently ignored) and the likely key is named."""
    with pytest.raises(ConfigError, match=r"dmq.conf: unknown key 'mem_queue_sise' \(did you mean 'mem_queue_size'\?\)"):
        parse_config("mem_queue_sise = 5\n", "dmq.conf")
    with pytest.raises(ConfigError, match=r"unknown key 'mem-queue-size' \(did you mean 'mem_queue_size'\?\)"):
        parse_config("mem-queue-size = 5\n", "dmq.conf")
    with pytest.raises(ConfigError, match=r"unknown key 'zookeeper'$"):
        parse_config("zookeeper = 'zk:2181'\n", "dmq.conf")


def test_invalid_toml_is_an_error_naming_the_file() -> None:
    """A syntax error names the file and keeps TOML's line and column."""
    with pytest.raises(ConfigError, match=r"dmq.conf: invalid TOML: .*line 1"):
        parse_config("mem_queue_size = = 5\n", "dmq.conf")


def test_missing_config_file_is_reported(tmp_path: Path) -> None:
    """A config path that does not exist stops the server with the path in the message."""
    missing = tmp_path / "nope.conf"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(missing)
    with pytest.raises(SystemExit) as excinfo:
        options_from_args(["--config", str(missing)], {})
    assert str(missing) in exit_message(excinfo)


def test_value_valid_in_type_but_not_usable_names_flag_and_key(tmp_path: Path) -> None:
    """validate() reports a parsed but unusable value under both its flag and its key."""
    config = write_config(tmp_path, "mem_queue_size = 0\n")
    with pytest.raises(SystemExit) as excinfo:
        options_from_args(["--config", str(config)], {})
    message = exit_message(excinfo)
    assert "--mem-queue-size" in message and "mem_queue_size" in message and "0" in message


@pytest.mark.parametrize(
    "changes",
    [
        {"log_level": "verbose"},
        {"default_credit": 3000},
        {"max_credit": 0},
        {"commit_writers": 0},
        {"registry_refresh": 0.0},
        {"sweep_interval": 0.0},
        {"scan_interval": 0.0},
        {"tcp_address": "nowhere"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_validate_rejects_unusable_values(changes: dict) -> None:
    """Values the server cannot run with fail at startup, naming the setting."""
    (name,) = changes
    with pytest.raises(ConfigError, match=name):
        Options().replace(**changes).validate()


# -- the example file -----------------------------------------------------------
def test_committed_example_matches_the_dataclass() -> None:
    """deploy/dmq.conf.example is generated; a field added or changed without
    regenerating it fails here."""
    assert EXAMPLE.exists(), f"missing {EXAMPLE}; create it with: {REGENERATE}"
    assert EXAMPLE.read_text(encoding="utf-8") == render_example(), (
        f"{EXAMPLE.relative_to(REPO_ROOT)} is out of date; regenerate it with: {REGENERATE}"
    )


def test_example_is_all_comments_and_uncommented_gives_the_defaults() -> None:
    """Used as is, the example sets nothing; with every key uncommented it is valid TOML
    that reproduces exactly the defaults."""
    text = render_example()
    assert parse_config(text) == {}
    prefixes = tuple(f"# {f.name} = " for f in FIELDS)
    uncommented = "\n".join(
        line[2:] if line.startswith(prefixes) else line for line in text.splitlines()
    )
    assert parse_config(uncommented) == {f.name: f.default for f in FIELDS}


def test_example_documents_every_field() -> None:
    """Each key appears once with its help text, flag and variable."""
    text = render_example()
    for f in FIELDS:
        assert text.count(f"# {f.name} = ") == 1
        assert f"flag {flag_name(f.name)}, env {env_name(f.name)}" in text
        assert " ".join(f.metadata["help"].split()[:4]) in text


def test_example_entry_point_prints_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m dmq_server.core.options --example`` writes exactly render_example()."""
    saved = sys.argv
    sys.argv = ["dmq_server.core.options", "--example"]
    try:
        with warnings.catch_warnings():
            # runpy warns that the module is already imported; harmless here
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(SystemExit) as excinfo:
                runpy.run_module("dmq_server.core.options", run_name="__main__")
    finally:
        sys.argv = saved
    assert excinfo.value.code == 0
    assert capsys.readouterr().out == render_example()


def test_entry_point_without_a_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """With nothing to do, the tool prints its usage and exits with status 2."""
    assert options_module.main([]) == 2
    assert "--example" in capsys.readouterr().err


def test_duration_defaults_are_finite_and_positive() -> None:
    """Duration defaults are finite and positive where the server loops on them."""
    for f in FIELDS:
        if f.metadata["kind"] == "duration":
            assert math.isfinite(f.default) and f.default > 0


@pytest.mark.parametrize(
    "raw, expected", [("true", True), ("1", True), ("on", True), ("false", False), ("0", False), ("OFF", False)]
)
def test_boolean_settings_from_flags_and_environment(raw: str, expected: bool) -> None:
    """Boolean options accept the usual spellings from flags and the environment."""
    assert options_from_args(["--deflate", raw], environ={}).deflate is expected
    assert options_from_args([], environ={"DMQ_DEFLATE": raw}).deflate is expected


def test_boolean_setting_rejects_other_words() -> None:
    """A boolean option given something else is an error naming the flag."""
    with pytest.raises(SystemExit) as info:
        options_from_args(["--deflate", "maybe"], environ={})
    assert "--deflate" in str(info.value)


def test_pg_cluster_repeats_and_comes_from_the_environment_and_file(tmp_path: Path) -> None:
    """--pg-cluster NAME=DSN may be given again and again; the environment separates
    entries by lines or ';', the config file takes a list; each is checked."""
    opts = options_from_args(["--pg-cluster", "b=dbname=b host=x", "--pg-cluster", "c=postgresql:///c"], environ={})
    assert opts.pg_clusters == {"b": "dbname=b host=x", "c": "postgresql:///c"}
    opts = options_from_args([], environ={"DMQ_PG_CLUSTER": "b=postgresql:///b; c=postgresql:///c"})
    assert list(opts.pg_clusters) == ["b", "c"]
    config = tmp_path / "dmq.toml"
    config.write_text('pg_cluster = ["b=postgresql:///b"]\n')
    assert options_from_args(["--config", str(config)], environ={}).pg_clusters == {"b": "postgresql:///b"}
    for bad, why in (
        ("main=postgresql:///x", "'main' is --pg-dsn"),
        ("B=postgresql:///x", "lower-case"),
        ("b", "expected NAME=DSN"),
    ):
        with pytest.raises(SystemExit) as excinfo:
            options_from_args(["--pg-cluster", bad], environ={})
        assert "--pg-cluster" in exit_message(excinfo) and why in exit_message(excinfo)
    with pytest.raises(SystemExit) as excinfo:
        options_from_args(["--pg-cluster", "b=x", "--pg-cluster", "b=y"], environ={})
    assert "given twice" in exit_message(excinfo)
