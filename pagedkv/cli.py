"""The `pagedkv` command: one entry point, a subcommand per role.

Each subcommand lives with the service it starts and is imported only when
chosen, so `pagedkv block-manager` never imports torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# subcommand -> ("module:function", one-line help). The function takes argv
# (without the subcommand) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "block-manager": ("pagedkv.block_manager_svc.server:main", "run the block manager gRPC service"),
    "cache-host": ("pagedkv.worker_svc.cli:cache_host_main", "allocate and export the shared KV cache"),
    "worker": ("pagedkv.worker_svc.cli:worker_main", "run a compute worker attached to the shared cache"),
    "loadtest": ("pagedkv.frontend.apps.loadtest:main", "bounded ghz-style load against a block manager"),
    "serve": (
        "pagedkv.frontend.serve.server:main",
        "OpenAI-compatible HTTP server over one continuous-batching engine",
    ),
    "up": (
        "pagedkv.frontend.launch.processes:main",
        "start block manager, cache host and workers as local processes",
    ),
    "generate": (
        "pagedkv.frontend.apps.generate:main",
        "one request through a running (or --local) stack, JSON out",
    ),
    "demo": (
        "pagedkv.frontend.apps.demo:main",
        "a realistic workload with a progress bar, then throughput and memory figures",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: pagedkv <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `pagedkv <command> --help` for the options of one command."]
    return "\n".join(lines)


def _resolve(target: str) -> Callable[[Sequence[str]], int]:
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage() + "\n")
        return 0
    if args[0] in ("-V", "--version"):
        from pagedkv import __version__

        sys.stdout.write(f"pagedkv {__version__}\n")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        sys.stderr.write(f"pagedkv: unknown command {args[0]!r}\n\n{_usage()}\n")
        return 2
    from pagedkv import parent_watch

    parent_watch.start_from_env()  # started by `pagedkv up`: stop if it dies without stopping us
    return int(_resolve(command[0])(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
