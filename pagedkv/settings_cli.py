"""Command-line flags generated from a pydantic-settings class, shared by every command.

Every settings field is a flag (``num_gpu_blocks`` -> ``--num-gpu-blocks``), an environment
variable (``PAGEDKV_NUM_GPU_BLOCKS``) and a key of the command's section in a ``--config`` file
(pagedkv/settings_file.py). A flag wins over the file, which wins over the environment, which wins
over the default. Flags that were not given are not passed to the settings object, so the settings
know which values were explicit (explicit geometry must match the block manager / cache host).
A field with ``json_schema_extra={"flag": False}`` (a secret such as a bearer token) has no flag:
only its environment variable sets it.

The settings classes are the one definition of each setting (type, default, bounds, help): these
flags, ``pagedkv up``'s flags and what it passes on to each role, and docs/settings.md
(pagedkv/settings_doc.py) all derive from them.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource

from pagedkv import settings_file
from pagedkv.settings_file import SettingsFileError, flag_key, has_flag

S = TypeVar("S", bound=BaseSettings)

ENV_PREFIX = "PAGEDKV_"
REFERENCE = "docs/settings.md"


def flag(name: str) -> str:
    return "--" + flag_key(name)


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def default_text(field: FieldInfo) -> str:
    """The default as a reader writes it (``""`` for an empty string, ``unset`` for None)."""
    d = field.get_default(call_default_factory=True)
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return str(d).lower()
    if hasattr(d, "get_secret_value"):
        d = d.get_secret_value()
    return '""' if d == "" else str(d)


def help_text(name: str, field: FieldInfo, env: bool = True, default: str | None = None) -> str:
    """The description, then the variable and the default (``default``: instead of the field's)."""
    default = default_text(field) if default is None else default
    tail = [f"env {env_var(name)}"] if env else []
    tail += [f"default {default}"] if default != "unset" else []
    return (f"{field.description} [{', '.join(tail)}]" if tail else str(field.description)).replace("%", "%%")


def metavar(name: str, annotation: object) -> str:
    if annotation is int:
        return "N"
    if annotation is float:
        return "X"
    return "PATH" if name.endswith(("_file", "_dir", "_cert", "_key", "_ca")) else "VALUE"


def add_flag(
    target: argparse._ActionsContainer,
    name: str,
    field: FieldInfo,
    dest: str | None = None,
    hidden: bool = False,
    env: bool = True,
    default: str | None = None,
) -> None:
    """``--name`` for ``field``: a boolean is ``--name/--no-name``, a Literal has choices; the
    default is None (not given), so the caller knows what the command line said."""
    annotation = settings_file._unwrap_optional(field.annotation)
    help_ = argparse.SUPPRESS if hidden else help_text(name, field, env, default)
    kwargs: dict[str, Any] = {"dest": dest or name, "default": None, "help": help_}
    if annotation is bool:
        target.add_argument(flag(name), action=argparse.BooleanOptionalAction, **kwargs)
    elif typing.get_origin(annotation) is Literal:
        target.add_argument(flag(name), choices=typing.get_args(annotation), **kwargs)
    else:
        conv = annotation if annotation in (int, float, str) else str
        target.add_argument(flag(name), type=conv, metavar=metavar(name, annotation), **kwargs)


def add_config_flag(target: argparse._ActionsContainer, section: str) -> None:
    target.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"settings file (TOML): its [{section}] section, keys named as the flags; a flag wins over "
        f"it, it wins over PAGEDKV_* variables ({REFERENCE})",
    )


def build_parser(
    cls: type[BaseSettings], prog: str, description: str, section: str | None = None
) -> argparse.ArgumentParser:
    """Every flag of ``cls``, and ``--config FILE`` when the command has a ``section`` in the file."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, field in cls.model_fields.items():
        if has_flag(field):  # else environment only (a secret: flag values show in the process list)
            add_flag(parser, name, field)
    if section is not None:
        add_config_flag(parser, section)
    return parser


def _section_of(prog: str) -> str | None:
    """``pagedkv serve`` reads ``[serve]``: a command's section is named as the command."""
    command = prog.split()[-1]
    return command if command in settings_file.SECTIONS else None


def load_settings(
    cls: type[S], argv: Sequence[str] | None, prog: str, description: str, section: str | None = None
) -> S:
    """Settings from flags over a ``--config`` file over env vars; exits (code 2) with a readable
    error on bad values. ``section``: the file's section this command reads (default: its name)."""
    section = section or _section_of(prog)
    parser = build_parser(cls, prog, description, section)
    args = parser.parse_args(None if argv is None else list(argv))
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    from_file: dict[str, object] = {}
    if section is not None and args.config:
        try:
            from_file = settings_file.load_section(cls, args.config, section)
        except SettingsFileError as e:
            parser.error(str(e))
    try:
        return cls(**{**from_file, **given})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in e.errors()
        )
        parser.error(problems)
        raise  # unreachable: parser.error exits


def env_values(cls: type[BaseSettings], names: Iterable[str]) -> dict[str, object]:
    """The ``PAGEDKV_*`` variables set for these fields of ``cls``, checked (ValueError naming the
    variable): what a command that passes settings on reads before its defaults."""
    raw = EnvSettingsSource(cls)()
    out: dict[str, object] = {}
    for name in names:
        if name in raw:
            try:
                out[name] = settings_file.check(cls.model_fields[name], raw[name], strict=False)
            except ValueError as e:
                raise ValueError(f"{env_var(name)}: {e}") from None
    return out


def to_argv(values: Mapping[str, object]) -> list[str]:
    """Field values as flags of the command they belong to (``--[no-]name`` for booleans)."""
    out: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            out.append(flag(name) if value else "--no-" + flag_key(name))
        else:
            out += [flag(name), str(value)]
    return out


class LayeredParser(argparse.ArgumentParser):
    """An ArgumentParser whose values not given as flags come from ``layers(config_path)``: the
    ``--config`` file's, then the environment's, then the defaults (``layers`` returns them by dest,
    the file's already over the environment's). The namespace it parses is then complete, so a
    caller that parses a command line (``up_config``) sees the same values as the command."""

    def __init__(self, *args: Any, layers: Callable[[str | None], dict[str, object]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layers = layers

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", default=None)
        config = pre.parse_known_args(argv)[0].config
        try:
            layered = self._layers(config)
        except (SettingsFileError, ValueError) as e:
            self.error(str(e))
        namespace = namespace or argparse.Namespace()
        for dest, value in layered.items():
            if not hasattr(namespace, dest):
                setattr(namespace, dest, value)  # argparse keeps it unless a flag says otherwise
        return super().parse_known_args(argv, namespace)


class HelpAll(argparse.Action):
    """``--help-all``: the help with every flag (``--help`` shows the ones most users change)."""

    def __init__(self, option_strings: Sequence[str], full: Callable[[], argparse.ArgumentParser], **kw: Any):
        kw.update(dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0)
        super().__init__(option_strings, **kw)
        self._full = full

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        self._full().print_help()
        parser.exit()
