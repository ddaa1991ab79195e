"""Daemon configuration from flags, the environment and a TOML file.

    dualpace-gpu --config /etc/dualpace/gpu.toml --kv-blocks 1024

Every long flag of the daemon can also be given
  - in the environment as DUALPACE_<FLAG> (dashes as underscores, upper case):
    DUALPACE_KV_BLOCKS=512, DUALPACE_NO_MIGRATE=true, a repeatable flag comma-separated:
    DUALPACE_PEER=127.0.0.1:50062,unix:/run/dualpace/cpu.sock;
  - in the TOML file named by --config (or DUALPACE_CONFIG), under its long name with
    dashes or underscores: `kv-blocks = 512`, `listen = "127.0.0.1:50061"`, `no-migrate = true`,
    a repeatable flag as a list: `peer = ["127.0.0.1:50062"]`.
Precedence: command-line flag > environment > config file > the flag's default.

An unknown key in the file, a value of the wrong type or outside the flag's choices, or
two keys that exclude each other is one line naming the key, and exit status 2.
Unknown DUALPACE_* variables are ignored (other tools use the prefix too).

`effective_config(args)` is what the daemon logs at start: every setting, with the
value of anything named like a secret (token, key, secret, password) shown as "***"
(a file *path* such as --auth-token-file stays visible; the token itself never appears).
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "DUALPACE_"
CONFIG_ENV = "DUALPACE_CONFIG"
SECRET_WORDS = ("token", "key", "secret", "password")
MASK = "***"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(Exception):
    """A bad configuration value; the message names the key."""


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE.toml",
                        help="settings as `long-flag-name = value` (TOML); flags and DUALPACE_<FLAG> "
                             "environment variables take precedence over it")


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None,
                      environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """parser.parse_args(argv), with what the flags leave unset taken from the environment,
    then from the --config file, then the parser's defaults. A bad value: one line on
    stderr naming the key, SystemExit(2)."""
    try:
        return resolve_config(parser, argv, environ)
    except ConfigError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def resolve_config(parser: argparse.ArgumentParser, argv: list[str] | None = None,
                   environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """parse_with_config, raising ConfigError instead of exiting."""
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = os.environ if environ is None else environ
    args = parser.parse_args(argv)  # flag errors: argparse's own message and exit 2
    given = _given_on_command_line(parser, argv)
    actions = _configurable_actions(parser)

    from_env: dict[str, Any] = {}
    for name, action in actions.items():
        variable = ENV_PREFIX + name.replace("-", "_").upper()
        if variable in environ and action.dest != "config":
            from_env[action.dest] = _convert(action, environ[variable], f"environment {variable}", from_text=True)

    config_path = getattr(args, "config", None) if "config" in given else environ.get(CONFIG_ENV) or None
    from_file: dict[str, Any] = {}
    if config_path is not None:
        if hasattr(args, "config"):
            args.config = config_path
        for key, value in _read_toml(config_path).items():
            where = f"--config {config_path}: key {key!r}"
            action = actions.get(key.replace("_", "-"))
            if action is None or action.dest == "config":
                raise ConfigError(f"{where}: unknown setting (use the long flag names of {parser.prog} --help)")
            if action.dest in from_file:
                raise ConfigError(f"{where}: given twice (with dashes and with underscores)")
            from_file[action.dest] = _convert(action, value, where, from_text=False)

    layers = [({dest: None for dest in given}, "the command line"), (from_env, "the environment"),
              (from_file, f"--config {config_path}")]
    _apply_exclusions(parser, layers)
    for dest, value in {**from_file, **from_env}.items():
        if dest not in given:
            setattr(args, dest, value)
    return args


def effective_config(args: argparse.Namespace) -> dict[str, Any]:
    """The settings in `args`, secrets masked (for the start-up log line). A name is secret when one
    of its words is token, key, secret or password, unless it names a file (auth_token_file)."""
    return {name: mask(name, value) for name, value in sorted(vars(args).items())}


def is_secret_name(name: str) -> bool:
    words = name.lower().replace("-", "_").split("_")  # whole words: max_batch_tokens is no secret
    return any(word in SECRET_WORDS for word in words) and words[-1] != "file"


def mask(name: str, value: Any) -> Any:
    return MASK if value is not None and is_secret_name(name) else value


# ----------------------------------------------------------------- internals


def _configurable_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long flag name (without dashes) -> action, for options that take a value or are switches."""
    actions = {}
    for action in parser._actions:  # argparse has no public listing
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or not action.option_strings:
            continue
        if action.nargs == 0 and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option[2:]] = action
    return actions


def _given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests the command line set (parsed again with every default suppressed)."""
    saved = [(action, action.default, action.required) for action in parser._actions]
    try:
        for action, _, _ in saved:
            action.default = argparse.SUPPRESS
            action.required = False
        probe = parser.parse_args(argv, argparse.Namespace())
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required
    return set(vars(probe))


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None
    return data


def _convert(action: argparse.Action, value: Any, where: str, from_text: bool) -> Any:
    """The value as the flag would have produced it (type, choices); ConfigError naming `where`.
    A repeatable flag (action="append", e.g. --peer) takes a TOML list, or in the environment a
    comma-separated text."""
    if isinstance(action, argparse._AppendAction):
        items = value.split(",") if isinstance(value, str) and from_text else value
        items = [items] if isinstance(items, str) else items
        if not isinstance(items, list):
            raise ConfigError(f"{where}: expected a list of values, got {value!r}")
        return [_convert_one(action, item.strip() if isinstance(item, str) else item, where, from_text)
                for item in items if not (isinstance(item, str) and not item.strip())]
    return _convert_one(action, value, where, from_text)


def _convert_one(action: argparse.Action, value: Any, where: str, from_text: bool) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, str) and from_text:
            if value.strip().lower() in _TRUE:
                value = True
            elif value.strip().lower() in _FALSE:
                value = False
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{where}: expected a single value, got {type(value).__name__}")
    kind = action.type
    if isinstance(value, bool) or (kind in (None, str) and not isinstance(value, str)):
        expected = "a string" if kind in (None, str) else getattr(kind, "__name__", "a value")
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    if kind is int and isinstance(value, float):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if kind is not None and (isinstance(value, str) or kind is not int):
        try:
            value = kind(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            name = getattr(kind, "__name__", "value")
            raise ConfigError(f"{where}: invalid {name} value {value!r} ({exc})") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {value!r} is not one of {choices}")
    return value


def _apply_exclusions(parser: argparse.ArgumentParser, layers: list[tuple[dict[str, Any], str]]) -> None:
    """Mutually exclusive flags: the highest layer that sets one of a group decides; a lower
    layer's other members are dropped; two in one layer are an error."""
    for group in parser._mutually_exclusive_groups:
        dests = [action.dest for action in group._group_actions]
        for index, (layer, source) in enumerate(layers):
            present = [dest for dest in dests if dest in layer]
            if not present:
                continue
            if len(present) > 1:
                names = " and ".join(d.replace("_", "-") for d in present)
                raise ConfigError(f"{source}: {names} exclude each other")
            for lower, _ in layers[index + 1:]:
                for dest in dests:
                    lower.pop(dest, None)
            break
