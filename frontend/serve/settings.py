"""`pagedkv serve`'s configuration: one object, from env vars (PAGEDKV_<NAME>) and flags.

Two kinds of security settings: the HTTP server's own (``api_key``/``api_key_file``, ``tls_cert``,
``tls_key``, ``tls_client_ca``, the same names and loopback rule as the gRPC servers) and the
outbound gRPC connections to the block manager and workers (``tls_ca``, ``tls_client_cert``,
``tls_client_key``, ``token``/``token_file``: the environment names `pagedkv generate` uses).
Prefer the file or environment forms of secrets: a flag value shows up in the process list.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagedkv import defaults, settings_cli
from pagedkv.frontend.engine import EngineConfig
from pagedkv.frontend.engine.speculate import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

# The engine's own defaults (frontend/engine/types.py) are the server's: written once, there.
_ENGINE = EngineConfig()
_SPEC = SpeculativeConfig()


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDKV_", extra="forbid")

    host: str = Field(defaults.HOST, description="address to listen on (127.0.0.1 = this machine only)")
    port: int = Field(defaults.SERVE_PORT, ge=0, le=65535, description="HTTP port (0 = pick a free one)")
    block_manager: str = Field(defaults.BLOCK_MANAGER_ADDRESS, description="block manager host:port")
    workers: str = Field(defaults.WORKER_ADDRESS, description="comma-separated worker host:port list")
    model: str = Field(
        "",
        description="local model directory or GGUF file (the workers' --model): tokenizer, chat template, "
        "EOS ids and context length; never fetched from a hub (empty = token ids only)",
    )
    model_name: str = Field(
        "",
        description="name clients use in `model` (default: the --model directory's or file's name, "
        "else the workers' model name)",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="how tool calls are read from answers with tool_choice auto: hermes "
        "(<tool_call>{...}</tool_call>: Hermes, Qwen), llama3_json (Llama 3.1+), "
        "auto = from the chat template",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: a request's priority must be 0 (400 otherwise); priority: vLLM's request "
        "priority is honoured (lower first): the block manager preempts the highest value first",
    )
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] | None = Field(
        None,
        description="the pool's KV dtype this frontend expects: start refused when the block manager has "
        "another (unset = any)",
    )
    max_waiting: int = Field(
        256, ge=0, description="requests allowed to wait for admission; beyond that: 503 with Retry-After"
    )
    max_num_seqs: int = Field(_ENGINE.max_num_seqs, ge=1, description="sequences the engine runs at once")
    max_batch_tokens: int = Field(
        _ENGINE.max_batch_tokens, ge=1, description="tokens per engine iteration (decode + prefill chunks)"
    )
    decode_steps: int = Field(
        _ENGINE.decode_steps,
        ge=1,
        le=defaults.MAX_DECODE_STEPS,
        description="decode steps a worker runs in one call while no request waits for admission "
        "(multi-step decode): an iteration's fixed cost is paid once for that many tokens, which "
        "stream that many at a time; 1 = one step per iteration",
    )
    speculative: Literal["off", "ngram", "draft_model"] = Field(
        "off",
        description="speculative decoding (docs/speculative.md): ngram = n-gram prompt lookup, "
        "proposals from earlier in the same sequence; draft_model = the workers' draft model "
        "(--speculative-model) proposes; verified in one pass, while at most "
        "--speculative-max-num-seqs sequences run and not under a grammar; greedy and seeded "
        "outputs are those of plain decoding",
    )
    speculative_model: str | None = Field(
        None,
        description="the draft model of speculative decoding (vLLM's speculative_config model): a Hugging "
        "Face directory or GGUF file with the model's vocabulary, which the workers run beside the "
        "model (their --speculative-model); setting it turns on --speculative draft_model",
    )
    num_speculative_tokens: int = Field(
        _SPEC.num_speculative_tokens,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="the most tokens proposed per verification pass (vLLM's num_speculative_tokens); "
        "after a pass that rejects one, a sequence proposes one more than it kept, and twice as many "
        "again while every one is kept",
    )
    prompt_lookup_max: int = Field(
        _SPEC.prompt_lookup_max, ge=1, description="longest n-gram looked up (vLLM's prompt_lookup_max)"
    )
    prompt_lookup_min: int = Field(
        _SPEC.prompt_lookup_min, ge=1, description="shortest n-gram looked up (vLLM's prompt_lookup_min)"
    )
    speculative_max_num_seqs: int = Field(
        _SPEC.max_num_seqs,
        ge=1,
        description="speculate only while at most this many sequences run (a larger batch makes "
        "plain decode compute-bound, where rejected proposals cost more than they save)",
    )
    timeout_s: float = Field(
        _ENGINE.timeout_s, gt=0, description="deadline of each gRPC call to the block manager/workers"
    )
    step_transport: Literal["auto", "grpc", "shm"] = Field(
        "auto",
        description="how worker steps travel: shm = through the worker's one-host step channel (shared "
        "memory, same host and user), grpc = always gRPC, auto = shm where the worker offers it and "
        'this process can open it, else gRPC (docs/worker.md "Step transport")',
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After seconds sent with 503")
    block_manager_outage_s: float = Field(
        _ENGINE.block_manager_outage_s,
        gt=0,
        description="how long the block manager may stay unreachable "
        "(retried with backoff) before requests in flight end with 503",
    )
    block_manager_timeout_s: float = Field(
        _ENGINE.block_manager_timeout_s,
        gt=0,
        description="deadline of each block-manager call (it answers in milliseconds); past it the "
        "same request is sent again, within --block-manager-outage-s",
    )
    metrics_vllm_names: bool = Field(
        False,
        description="also export vLLM's metric names (vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc, ...) for scrapers built for vLLM",
    )
    # The HTTP server's own security.
    api_key: SecretStr = Field(
        SecretStr(""),
        description="bearer key required on every route but /health "
        "(prefer PAGEDKV_API_KEY or --api-key-file)",
    )
    api_key_file: str = Field("", description="file holding the API key")
    allowed_origins: str = Field(
        "",
        description="comma-separated origins (https://app.example.com) whose browser pages may call "
        "this server (CORS); * = any; empty = none",
    )
    tls_cert: str = Field("", description="server certificate chain (PEM); with tls_key: serve HTTPS")
    tls_key: str = Field("", description="server private key (PEM)")
    tls_client_ca: str = Field(
        "", description="CA bundle (PEM) for client certificates: mutual TLS, required"
    )
    allow_insecure: bool = Field(
        False,
        description="allow plain HTTP on a non-loopback address, and sending "
        "the bearer token to the block manager/workers without --tls-ca (trusted networks only)",
    )
    # Outbound gRPC to the block manager and the workers.
    tls_ca: str = Field("", description="CA bundle to verify the block manager and workers (turns TLS on)")
    tls_client_cert: str = Field(
        "", description="client certificate for mutual TLS to the block manager/workers"
    )
    tls_client_key: str = Field("", description="client key for mutual TLS to the block manager/workers")
    token: SecretStr = Field(
        SecretStr(""),
        description="bearer token for the block manager/workers (prefer PAGEDKV_TOKEN or --token-file)",
    )
    token_file: str = Field("", description="file holding that bearer token")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log threshold")
    log_format: Literal["console", "json"] = Field("console", description="key=value or JSON lines")

    def resolved_api_key(self) -> str:
        if self.api_key_file:
            return pathlib.Path(self.api_key_file).read_text().strip()
        return self.api_key.get_secret_value()

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for BlockManagerClient / WorkerClient (TLS + token)."""
        token = self.token.get_secret_value()
        if self.token_file:
            token = pathlib.Path(self.token_file).read_text().strip()
        return {
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_client_cert,
            "tls_key": self.tls_client_key,
            "token": token,
            "allow_insecure": self.allow_insecure,
        }

    def engine_config(self) -> EngineConfig:
        """The engine this server runs: its limits and deadlines from these settings; a lost cache
        host is recovered (wait for a re-attached worker, recompute), not fatal."""
        return EngineConfig(
            max_num_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_batch_tokens,
            decode_steps=self.decode_steps,
            speculative=self.speculative_config(),
            timeout_s=self.timeout_s,
            recover_lost_cache=True,
            block_manager_outage_s=self.block_manager_outage_s,
            block_manager_timeout_s=self.block_manager_timeout_s,
        )

    @model_validator(mode="after")
    def _check_speculative(self) -> ServeSettings:
        if self.speculative == "ngram" and self.speculative_model:
            raise ValueError("--speculative ngram and --speculative-model: choose one proposer")
        if self.speculative == "draft_model" and not self.speculative_model:
            raise ValueError("--speculative draft_model needs --speculative-model PATH")
        return self

    def speculative_config(self) -> SpeculativeConfig | None:
        method = "draft_model" if self.speculative_model else self.speculative
        if method == "off":
            return None
        return SpeculativeConfig(
            method=method,
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_max=self.prompt_lookup_max,
            prompt_lookup_min=self.prompt_lookup_min,
            max_num_seqs=self.speculative_max_num_seqs,
        )

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in self.allowed_origins.split(",") if o.strip()]

    @property
    def worker_targets(self) -> list[str]:
        return [t.strip() for t in self.workers.split(",") if t.strip()]


DESCRIPTION = (
    "Serve the OpenAI completions/chat API from one continuous-batching engine (docs/serve.md). Every flag "
    "can also be set by the environment variable PAGEDKV_<FLAG_NAME> (e.g. PAGEDKV_API_KEY)."
)


def load_settings(argv: Sequence[str] | None = None) -> ServeSettings:
    return settings_cli.load_settings(ServeSettings, argv, "pagedkv serve", DESCRIPTION)
