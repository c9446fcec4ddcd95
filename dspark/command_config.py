"""How a `dspark` command gets its serving configuration: one path for every command and service.

    add_config_arguments(p)                                        # --config, on every command that serves
    add_config_flag(p, "--port", key="gateway.port", type=int)     # a flag that sets one key
    config = command_config(args)                                  # what the command runs with

Precedence, lowest first: the defaults of dspark/serving_config.py; the command's own defaults
(`command_defaults`: `dspark generate` verifies all γ drafts, `dspark gateway` dials a local
Redis); the file (`--config`, else $DSPARK_CONFIG); the `DSPARK_<SECTION>_<KEY>` environment
variables; the flags given. A flag that sets a key defaults to None, so that a flag left out
overrides nothing: only flags typed on the command line beat the file and the environment.
`dspark.cli.resolve_for(command, argv, env)` is the same resolution from a command line, without
running the command (tests/test_command_config.py checks every key of every command with it).

The key each flag sets is declared where the flag is added (`add_config_flag`), and recorded in
the parser's defaults (`args.config_flags`), so that the table cannot drift from the flags and
the help shows the key and its default. This module imports nothing heavy (no torch): the
exec-probe `dspark healthcheck` uses it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from dspark.serving_config import ServingConfig

__all__ = ["add_config_arguments", "add_config_flag", "command_config"]


def add_config_arguments(p: argparse.ArgumentParser, *, command_defaults: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """`--config` on `p`, and `p`'s record of the keys its flags set (filled by add_config_flag).
    `command_defaults` ({section: {key: value}}) are this command's defaults where they differ
    from the serving configuration's; the file, the environment and the flags override them."""
    p.add_argument("--config", default=None, help="JSON or TOML file of {section: {key: value}} (default: $DSPARK_CONFIG); "
                                                  "then DSPARK_<SECTION>_<KEY> variables, then the flags given")
    p.set_defaults(config_flags={}, config_defaults=dict(command_defaults or {}))


def add_config_flag(p: argparse.ArgumentParser, *names: str, key: str, help: str = "", **kwargs: Any) -> argparse.Action:
    """A flag of `p` that sets configuration key `key` ("section.name"). Its default is None (left
    out, it overrides nothing); its help names the key and the key's default for this command."""
    section, name = key.split(".")
    default = p.get_default("config_defaults").get(section, {}).get(name, getattr(getattr(ServingConfig(), section), name))
    shown = "(secret)" if (section, name) in ServingConfig.secret_keys() else repr(default)
    action = p.add_argument(*names, default=None, help=f"{help} (config: {key}, default {shown})".lstrip(), **kwargs)
    p.get_default("config_flags")[action.dest] = key
    return action


def command_config(args: argparse.Namespace, *, env: Mapping[str, str] | None = None) -> ServingConfig:
    """The configuration a parsed command line runs with (module docstring); `env` defaults to
    os.environ. A bad file, variable or value is a ValueError (FileNotFoundError for a missing
    file) that names it."""
    overrides: dict[str, dict[str, Any]] = {}
    for dest, key in args.config_flags.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if isinstance(value, list):  # a repeatable flag (--api-key): the key's comma-separated form
            value = ",".join(value)
        section, name = key.split(".")
        overrides.setdefault(section, {})[name] = value
    return ServingConfig.load(args.config, env=env, command_defaults=args.config_defaults, overrides=overrides)
