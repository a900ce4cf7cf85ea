"""Shared pieces of the `pagedkv serve` tests: a tiny model WITH a tokenizer, a stack and a server.

The tokenizer is built here with the `tokenizers` library (a word-level vocabulary matching the
tiny model's 128 ids, plus a chat template) and saved beside the model, then loaded the way the
server loads it: transformers, local files only. Nothing comes from a hub.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator

from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve.server import OpenAIServer
from pagedkv.frontend.serve.settings import ServeSettings
from tests.worker_svc.conftest import VOCAB, HFModel, build_hf_model

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
WORDS = ["<unk>", "<s>", "</s>", "system", "user", "assistant"] + [f"w{i}" for i in range(6, VOCAB)]


def save_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def model_with_tokenizer(path: pathlib.Path, seed: int = 3) -> HFModel:
    hf = build_hf_model(path, seed=seed)
    save_tokenizer(path)
    return hf


def stack_config(hf: HFModel, **kw: object) -> StackConfig:
    cfg = dict(
        model=str(hf.path),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_gpu_blocks=128,
        kernel_backend="reference",
    )
    cfg.update(kw)
    return StackConfig(**cfg)  # type: ignore[arg-type]


@contextlib.contextmanager
def serving(stack: LocalStack, **settings: object) -> Iterator[OpenAIServer]:
    s = ServeSettings(
        port=0, block_manager=stack.block_manager_target, workers=",".join(stack.worker_targets), **settings
    )  # type: ignore[arg-type]
    with OpenAIServer(s) as server:
        yield server


def metric_samples(text: str, name: str) -> dict[str, float]:
    """{label string: value} of one metric family in Prometheus text format."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key[len(name) :]] = float(value)
    return out
