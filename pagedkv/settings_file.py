"""The settings file: ``--config FILE``, TOML with one section per command.

One file describes a deployment: ``[up]`` holds ``pagedkv up``'s own settings, and ``[serve]``,
``[block-manager]``, ``[cache-host]`` and ``[worker]`` the settings of those commands (``pagedkv up``
passes them on to the processes it starts; ``pagedkv serve --config FILE`` and the other roles read
their own section). A key is the flag's name without the dashes in front (``max-num-seqs``;
``max_num_seqs`` is accepted too) and its value has the setting's type and bounds.

Precedence, highest first: a command-line flag, the file, the ``PAGEDKV_*`` environment variable,
the default. A file that names an unknown section or key, or gives a value of the wrong type or out
of bounds, is refused with its path, section and key (docs/settings.md).
"""

from __future__ import annotations

import pathlib
import typing
from difflib import get_close_matches
from typing import Annotated, Any

import tomllib
from pydantic import SecretStr, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

# Every section a file may hold: the commands that read one.
SECTIONS = ("up", "serve", "block-manager", "cache-host", "worker")


class SettingsFileError(ValueError):
    """A file that cannot be used as it is; the message names the file, the section and the key."""

    def __init__(self, path: str, problem: str, section: str = "", key: str = "") -> None:
        where = " ".join(w for w in (f"[{section}]" if section else "", key) if w)
        super().__init__(f"{path}: {where + ': ' if where else ''}{problem}")
        self.path, self.section, self.key = path, section, key


def read(path: str) -> dict[str, dict[str, object]]:
    """The file's sections (each a table of keys), checked against ``SECTIONS``."""
    try:
        data = tomllib.loads(pathlib.Path(path).read_text())
    except OSError as e:
        raise SettingsFileError(path, f"cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsFileError(path, f"not TOML: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            why = "a setting outside a section: put it under [up], [serve], ..."
            raise SettingsFileError(path, why, key=section)
        if section not in SECTIONS:
            hint = did_you_mean(section, SECTIONS)
            raise SettingsFileError(path, f"unknown section{hint}; sections: {', '.join(SECTIONS)}", section)
    return data


def field_name(key: str) -> str:
    """``max-num-seqs`` (a flag's name) and ``max_num_seqs`` -> the field ``max_num_seqs``."""
    return key.replace("-", "_")


def flag_key(name: str) -> str:
    """The field ``max_num_seqs`` -> the key and flag name ``max-num-seqs``."""
    return name.replace("_", "-")


def has_flag(field: FieldInfo) -> bool:
    """False for a field set only by its environment variable (a secret: flags show in ``ps``)."""
    return not (isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("flag") is False)


def is_secret(field: FieldInfo) -> bool:
    return _unwrap_optional(field.annotation) is SecretStr


def adapter(field: FieldInfo) -> TypeAdapter[Any]:
    """The field's type with its bounds (``ge``, ``le``, ...): what one value is checked against."""
    annotation: Any = field.annotation
    if field.metadata:
        annotation = Annotated.__class_getitem__((annotation, *field.metadata))  # type: ignore[attr-defined]
    return TypeAdapter(annotation)


def check(field: FieldInfo, value: object, strict: bool) -> object:
    """``value`` as the field holds it; ValueError with a short reason otherwise. ``strict``: a
    file's value must have the type (a number for a number); an environment variable is text."""
    try:
        return adapter(field).validate_python(value, strict=strict)
    except ValidationError as e:
        raise ValueError("; ".join(problem(err, value) for err in e.errors())) from None


def problem(err: Any, value: object) -> str:
    """A pydantic error as a reader wants it: ``must be at least 1, got 0``."""
    ctx = err.get("ctx") or {}
    bounds = {
        "greater_than_equal": ("at least", "ge"),
        "greater_than": ("more than", "gt"),
        "less_than_equal": ("at most", "le"),
        "less_than": ("less than", "lt"),
    }
    if err["type"] in bounds:
        words, key = bounds[err["type"]]
        return f"must be {words} {ctx.get(key)}, got {value!r}"
    if err["type"] == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {value!r}"
    return f"{err['msg'][0].lower()}{err['msg'][1:]}, got {value!r} ({type(value).__name__})"


def section_values(
    cls: type[BaseSettings], path: str, section: str, table: dict[str, object]
) -> dict[str, object]:
    """``table`` (the file's ``[section]``) as field values of ``cls``, each checked."""
    out: dict[str, object] = {}
    for key, value in table.items():
        name = field_name(key)
        field = cls.model_fields.get(name)
        if field is None:
            known = [flag_key(n) for n, f in cls.model_fields.items() if has_flag(f)]
            raise SettingsFileError(
                path, f"unknown setting{did_you_mean(flag_key(name), known)} (docs/settings.md)", section, key
            )
        if not has_flag(field):
            raise SettingsFileError(path, f"set only by PAGEDKV_{name.upper()}, not in a file", section, key)
        if name in out:
            raise SettingsFileError(path, "given twice (with dashes and with underscores)", section, key)
        try:
            out[name] = check(field, value, strict=True)
        except ValueError as e:
            raise SettingsFileError(path, str(e), section, key) from None
    return out


def load_section(cls: type[BaseSettings], path: str, section: str) -> dict[str, object]:
    """``read`` and ``section_values`` of one command's section (empty when the file has none)."""
    return section_values(cls, path, section, read(path).get(section, {}))


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unwrap_optional(annotation: object) -> object:
    """``X | None`` -> ``X``; anything else as it is."""
    import types

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation
