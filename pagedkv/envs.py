"""Every environment variable pagedkv reads or sets outside its settings objects, declared once.

Why a registry: the kernels, the commands and the worker used to read variables ad hoc, each with
its own parsing of "true" and its own default, and nothing listed them. Here each variable has a
type, a default and a doc; code reads it only through ``get_str``/``get_bool``/``is_set`` (a name
that is not declared raises ``KeyError``), and ``tests/pagedkv/test_envs.py`` fails when code reads
the environment any other way. docs/usage.md's table is this registry:
``python -m pagedkv.envs --markdown`` prints it and a test checks that the two are equal.

Not listed here: the settings fields of the roles (``PAGEDKV_<FIELD>`` of
``block_manager_svc/settings.py``, ``worker_svc/settings.py``, ``frontend/serve/settings.py``),
which pydantic-settings reads and which are documented with their flags. Variables that belong
to a third-party library (Triton, Hugging Face, OpenMP, the dynamic loader) are listed when pagedkv
reads or sets them, with the library named.

Values are read on every call, not cached, so a test (or ``pagedkv.kernels.use_backend``'s callers) can
change them at run time.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pagedkv import defaults

Kind = Literal["str", "bool", "path", "int"]
TRUE = ("1", "true", "yes", "on")


@dataclass(slots=True, frozen=True)
class EnvVar:
    name: str
    kind: Kind
    default: str  # the value when unset, as text ("" = none)
    doc: str
    owner: str = "pagedkv"  # who reads it: pagedkv, or the third-party library that does


_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "PAGEDKV_KERNEL_BACKEND",
        "str",
        "auto",
        "attention kernels: `auto`, `reference` (torch), `triton` or `cpu` (native C); "
        "`pagedkv.kernels.use_backend()` and a worker's `--kernel-backend` win over it (read on every call)",
    ),
    EnvVar(
        "PAGEDKV_CPU_NATIVE",
        "str",
        "auto",
        "native CPU kernels: `auto` (the best variant this CPU runs), `0`/`off` (never: torch "
        "gathers), or a variant name (`avx512`, `avx2`, `x86_64`) to force it (docs/kernels.md)",
    ),
    EnvVar(
        "PAGEDKV_TOKEN",
        "str",
        "",
        "bearer token the commands (`generate`, `demo`, `loadtest`) send to a secured stack, and the "
        "roles' `token` setting; prefer it or `--token-file` to a flag (docs/security.md)",
    ),
    EnvVar(
        "PAGEDKV_TOKEN_FILE",
        "path",
        "",
        "file holding that bearer token (the commands' `--token-file` default)",
    ),
    EnvVar(
        "PAGEDKV_TLS_CA",
        "path",
        "",
        "CA bundle (PEM) the commands verify servers with (their `--tls-ca` default): TLS on",
    ),
    EnvVar(
        "PAGEDKV_TLS_CLIENT_CERT",
        "path",
        "",
        "client certificate (PEM) the commands present (their `--tls-cert` default): mutual TLS",
    ),
    EnvVar(
        "PAGEDKV_TLS_CLIENT_KEY",
        "path",
        "",
        "private key (PEM) of that certificate (the commands' `--tls-key` default)",
    ),
    EnvVar(
        "PAGEDKV_ALLOW_INSECURE",
        "bool",
        "false",
        "let the commands send a token without TLS (their `--allow-insecure` default; trusted networks only)",
    ),
    EnvVar(
        "PAGEDKV_API_KEY",
        "str",
        "",
        "`pagedkv serve`'s API key; `generate` and `demo --url` send it when no `--api-key-file` is given",
    ),
    EnvVar(
        "PAGEDKV_PORT",
        "str",
        str(defaults.BLOCK_MANAGER_PORT),
        "`pagedkv healthcheck` without a target checks 127.0.0.1 on this port (the port the "
        "container's block manager listens on)",
    ),
    EnvVar(
        "PAGEDKV_BUILD_MACHINE",
        "str",
        "",
        "build time (setup.py): the machine to build the native CPU kernels for, instead of this "
        "one's (`platform.machine()`)",
    ),
    EnvVar(
        "TRITON_INTERPRET",
        "bool",
        "false",
        "run the Triton kernels in Triton's CPU interpreter (the tests set it); the kernel "
        "dispatch reads it to choose the backend, `pagedkv.kernels.aot` refuses to run under it",
        owner="Triton",
    ),
    EnvVar(
        "TRITON_CACHE_DIR",
        "path",
        "",
        "Triton's compile cache; `python -m pagedkv.kernels.aot` sets a temporary one when it is unset",
        owner="Triton",
    ),
    EnvVar(
        "HF_HUB_OFFLINE",
        "bool",
        "",
        "set to 1 (unless already set) before loading a tokenizer or model: pagedkv never fetches from a hub",
        owner="Hugging Face",
    ),
    EnvVar(
        "KMP_BLOCKTIME",
        "str",
        "",
        "Intel/LLVM OpenMP spin time; when set, the worker leaves the runtime's own value "
        "(worker_svc/omp_spin.py), else it shortens the spin to 5 ms",
        owner="Intel OpenMP",
    ),
    EnvVar(
        "OMP_NUM_THREADS",
        "int",
        "",
        "OpenMP team size; `pagedkv up` starts each CPU worker with its planned compute threads here "
        "(frontend/launch/processes.py), so no OpenMP team in it starts with one thread per CPU",
        owner="OpenMP",
    ),
    EnvVar(
        "PAGEDKV_LAUNCHER_PID",
        "int",
        "",
        "set by `pagedkv up` (any launcher of local role processes) on each role it starts: the "
        "role stops (as on SIGTERM) once that process is no longer its parent (pagedkv/parent_watch.py)",
    ),
    EnvVar(
        "OMP_WAIT_POLICY",
        "str",
        "",
        "OpenMP idle threads' wait policy (active | passive); when set, the worker leaves the spin "
        "time as it says (worker_svc/omp_spin.py)",
        owner="OpenMP",
    ),
    EnvVar(
        "LD_PRELOAD",
        "str",
        "",
        "`pagedkv up` adds tcmalloc and Intel OpenMP to the CPU workers' value (pagedkv/cpu_runtime.py)",
        owner="dynamic loader",
    ),
)

REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def _declared(name: str) -> EnvVar:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"environment variable {name} is not declared in pagedkv/envs.py") from None


def get_str(name: str, env: Mapping[str, str] | None = None) -> str:
    """The variable's value (stripped), else its declared default; ``env`` instead of os.environ."""
    var = _declared(name)
    value = (os.environ if env is None else env).get(name)
    return var.default if value is None else value.strip()


def get_bool(name: str, env: Mapping[str, str] | None = None) -> bool:
    """True for 1/true/yes/on (any case), as Triton and the commands parse it."""
    if _declared(name).kind != "bool":
        raise TypeError(f"{name} is not a boolean variable")
    return get_str(name, env).lower() in TRUE


def is_set(name: str) -> bool:
    _declared(name)
    return name in os.environ


def set_default(name: str, value: str, env: MutableMapping[str, str] | None = None) -> None:
    """Set the variable for this process and its children unless it is set already."""
    _declared(name)
    (os.environ if env is None else env).setdefault(name, value)


def markdown() -> str:
    """docs/usage.md's table of these variables."""
    rows = ["| variable | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for v in _VARS:
        default = f"`{v.default}`" if v.default else "unset"
        rows.append(f"| `{v.name}` | {v.kind} | {default} | {v.owner} | {v.doc} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.envs", description=__doc__.split("\n")[0])
    p.add_argument("--markdown", action="store_true", help="print docs/usage.md's table")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:  # names only: some values are secrets
        for v in _VARS:
            sys.stdout.write(f"{v.name}: {'set' if is_set(v.name) else 'unset'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
