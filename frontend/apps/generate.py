"""`pagedkv generate`: one request through a running server, a running stack, or an in-process one.

Prints the result as JSON on stdout (logs go to stderr), e.g.

    pagedkv generate --token-ids 1,2,3 --max-tokens 16                       # `pagedkv serve` at --url
    pagedkv generate --token-ids 1,2,3 --max-tokens 16 --local               # an in-process stack
    pagedkv generate --token-ids 1,2,3 --n 2 --block-manager 127.0.0.1:50051 --workers 127.0.0.1:50053

By default it is an HTTP client of `pagedkv serve` (--url, http://127.0.0.1:8000; the API key from
PAGEDKV_API_KEY or --api-key-file); --block-manager runs an engine in this process against a running
stack's block manager and workers; --local starts the whole stack in this process.

Greedy (temperature 0) is the default, so `--n 2` alone prints two identical
completions; give a temperature to sample. Every call uses a fresh request id
and (with --block-manager or --local) its own engine, with its own sequence ids
and lease, so any number of `generate` processes can share one stack. Every
sampling option is checked before anything is sent or allocated, and every
error path frees what was allocated: no call, failed or interrupted, leaves a
sequence behind (one killed outright loses its sequences when its lease
expires; the server aborts a request whose client went away mid-stream).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import uuid
from collections.abc import Sequence

import grpc

from pagedkv import defaults, envs
from pagedkv.frontend.clients.connection import add_connection_args, client_kwargs
from pagedkv.frontend.clients.http import HttpError
from pagedkv.frontend.engine import EngineConfig, GenerationRequest, RequestOutput, SamplingOptions


def parse_token_ids(text: str) -> list[int]:
    """Comma-separated integers; an empty item (``1,,2``, a trailing comma) is an error, not dropped."""
    parts = text.replace(" ", "").split(",")
    if parts == [""]:
        raise argparse.ArgumentTypeError("at least one token id is needed")
    if any(p == "" for p in parts):
        raise argparse.ArgumentTypeError(
            f"token ids must be comma-separated integers with no empty item, got {text!r}"
        )
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"token ids must be comma-separated integers, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--token-ids", type=parse_token_ids, required=True, help="prompt, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--n", type=int, default=1, help="parallel samples (forked from the prompt)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", type=parse_token_ids, default=None)
    p.add_argument("--url", default=defaults.SERVE_URL, help="a running `pagedkv serve` [%(default)s]")
    p.add_argument(
        "--api-key-file", default="", help="file holding the server's API key (default: env PAGEDKV_API_KEY)"
    )
    p.add_argument("--local", action="store_true", help="run an in-process stack instead of connecting")
    p.add_argument("--model", default=None, help="with --local: Hugging Face model directory or GGUF file")
    p.add_argument(
        "--num-gpu-blocks", type=int, default=defaults.LOCAL_NUM_GPU_BLOCKS, help="with --local [%(default)s]"
    )
    p.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE, help="with --local [%(default)s]")
    p.add_argument("--device", default="auto", help="with --local: auto | cpu | cuda")
    p.add_argument(
        "--block-manager",
        default=None,
        help="run the engine here against this block manager host:port (instead of --url)",
    )
    p.add_argument(
        "--workers",
        default=defaults.WORKER_ADDRESS,
        help="with --block-manager: comma-separated worker host:port list (default: the first "
        "worker `pagedkv up` starts; it prints them all)",
    )
    p.add_argument("--timeout-s", type=float, default=EngineConfig().timeout_s)
    add_connection_args(p)
    return p


def output_json(out: RequestOutput) -> dict[str, object]:
    return {
        "request_id": out.request_id,
        "prompt_token_ids": out.prompt,
        "num_cached_tokens": out.num_cached_tokens,
        "completions": [
            {
                "index": c.index,
                "token_ids": c.token_ids,
                "logprobs": [round(x, 6) for x in c.logprobs],
                "finish_reason": c.finish_reason,
            }
            for c in out.completions
        ],
    }


def via_server(args: argparse.Namespace, request: GenerationRequest) -> RequestOutput:
    """The request as an OpenAI completion on a running `pagedkv serve`; the same RequestOutput."""
    import pathlib
    import ssl

    from pagedkv.frontend.clients.http import post_json
    from pagedkv.frontend.engine import Completion

    key = envs.get_str("PAGEDKV_API_KEY")
    if args.api_key_file:
        key = pathlib.Path(args.api_key_file).read_text().strip()
    ctx = None
    if args.url.startswith("https"):
        ctx = ssl.create_default_context(cafile=args.tls_ca or None)
        if args.tls_cert:
            ctx.load_cert_chain(args.tls_cert, args.tls_key or None)
    s = request.sampling
    body: dict[str, object] = {
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "n": request.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k or -1,
        "logprobs": 0,
        "ignore_eos": True,
        "stop_token_ids": list(request.stop_token_ids),
    }
    if s.seed is not None:
        body["seed"] = s.seed
    resp = post_json(
        args.url.rstrip("/") + "/v1/completions",
        body,
        api_key=key,
        timeout_s=args.timeout_s * 10,
        ssl_context=ctx,
    )
    comps = [
        Completion(
            index=c["index"],
            token_ids=list(c["token_ids"]),
            logprobs=list((c.get("logprobs") or {}).get("token_logprobs") or []),
            finish_reason=c["finish_reason"],
        )
        for c in sorted(resp["choices"], key=lambda c: c["index"])
    ]
    cached = int((resp.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return RequestOutput(str(resp["id"]), list(request.prompt), comps, cached)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model and not args.local:
        parser.error("--model applies to --local; a running stack serves the model its workers loaded")
    from pagedkv.logging_setup import configure_logging

    configure_logging("warning")
    request = GenerationRequest(
        f"generate-{uuid.uuid4().hex[:12]}",
        args.token_ids,
        max_tokens=args.max_tokens,
        n=args.n,
        sampling=SamplingOptions(args.temperature, args.top_p, args.top_k, args.seed),
        stop_token_ids=tuple(args.stop_token_ids or ()),
    )
    try:
        request.validate()  # before anything is allocated or even connected
    except ValueError as e:
        flag = next(
            (
                f
                for f in ("temperature", "top_p", "top_k", "seed", "max_tokens", "n")
                if str(e).startswith(f) or f" {f} " in f" {e} "
            ),
            None,
        )
        name = f"--{flag.replace('_', '-')}: " if flag else ""
        print(f"pagedkv generate: {name}{e}", file=sys.stderr)
        return 2
    config = EngineConfig(timeout_s=args.timeout_s)
    try:
        if args.local:
            from pagedkv.frontend.launch.config import StackConfig
            from pagedkv.frontend.launch.local_stack import LocalStack

            with LocalStack(
                StackConfig(
                    model=args.model,
                    num_gpu_blocks=args.num_gpu_blocks,
                    block_size=args.block_size,
                    device=args.device,
                )
            ) as stack:
                with stack.engine(config) as engine:
                    out = engine.generate([request])[0]
        elif args.block_manager is None:
            out = via_server(args, request)
        else:
            out = _generate_remote(args, request, config)
    except urllib.error.URLError as e:
        print(
            f"pagedkv generate: cannot reach {args.url}: {e.reason} (is the server running? `pagedkv up`)",
            file=sys.stderr,
        )
        return 1
    except (ValueError, OSError) as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return 2
    except HttpError as e:
        print(f"pagedkv generate: {e}", file=sys.stderr)
        return 2 if e.status in (400, 404) else 1
    except grpc.RpcError as e:
        hint = " (is the stack running? `pagedkv up`)" if e.code() == grpc.StatusCode.UNAVAILABLE else ""
        print(f"pagedkv generate: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
        return 1
    json.dump(output_json(out), sys.stdout)
    sys.stdout.write("\n")
    return 0


def _generate_remote(
    args: argparse.Namespace, request: GenerationRequest, config: EngineConfig
) -> RequestOutput:
    """One request on a running stack; the engine frees its sequences on every way out
    (success, error, Ctrl-C), and its lease covers a process killed outright."""
    from pagedkv.frontend.clients.block_manager import BlockManagerClient
    from pagedkv.frontend.clients.worker import WorkerClient
    from pagedkv.frontend.engine import Engine

    conn = client_kwargs(args)
    with BlockManagerClient(args.block_manager, **conn) as bm:
        workers = [WorkerClient(t, **conn) for t in args.workers.split(",") if t]
        try:
            engine = Engine(bm, workers, config)
            try:
                return engine.generate([request])[0]
            finally:
                try:
                    engine.close()
                except grpc.RpcError:
                    pass  # the stack went away: the lease frees them
        finally:
            for w in workers:
                w.close()
