"""Command-line flags generated from a pydantic-settings class, shared by every role.

Every settings field is a flag (``num_gpu_blocks`` -> ``--num-gpu-blocks``) and an environment
variable (``PAGEDKV_NUM_GPU_BLOCKS``); a flag wins over the environment, which wins over the
default. Flags that were not given are not passed to the settings object, so the settings know
which values were explicit (explicit geometry must match the block manager / cache host).
A field with ``json_schema_extra={"flag": False}`` (a secret such as a bearer token) has no flag:
only its environment variable sets it.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from typing import Literal, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: object) -> object:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def build_parser(cls: type[BaseSettings], prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for name, field in cls.model_fields.items():
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("flag") is False:
            continue  # environment only (a secret: flag values show in the process list)
        annotation = _unwrap_optional(field.annotation)
        help_ = f"{field.description} [env PAGEDKV_{name.upper()}, default {field.default!r}]"
        if annotation is bool:
            parser.add_argument(
                _flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        elif typing.get_origin(annotation) is Literal:
            parser.add_argument(
                _flag(name), dest=name, choices=typing.get_args(annotation), default=None, help=help_
            )
        else:
            conv = annotation if annotation in (int, float, str) else str
            parser.add_argument(_flag(name), dest=name, type=conv, default=None, help=help_)
    return parser


def load_settings(cls: type[S], argv: Sequence[str] | None, prog: str, description: str) -> S:
    """Settings from flags over env vars; exits (code 2) with a readable error on bad values."""
    parser = build_parser(cls, prog, description)
    args = parser.parse_args(None if argv is None else list(argv))
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return cls(**overrides)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in e.errors()
        )
        parser.error(problems)
        raise  # unreachable: parser.error exits
