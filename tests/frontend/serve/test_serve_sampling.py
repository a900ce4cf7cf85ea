"""Sampling through the whole stack (`openai` SDK -> `pagedkv serve` -> engine -> worker) follows
the model's distribution.

Each request asks for n=64 samples of ONE token of the same prompt with a seed: sample i of a
request is drawn with seed + i (``Seq.seed``, frontend/engine/types.py), so requests with seeds 0,
64, 128, ... give independent seeded draws from the distribution at the prompt's last position.
Their counts are compared with transformers' softmax of the same logits (temperature, top-k and
top-p applied by this test's own filter, not the server's) by a chi-square test. The seeds are
fixed, so the test is deterministic: the same draws every run.

What this catches (each verified by breaking the code on purpose, docs/testing.md): a temperature
dropped or forced to 0 (greedy: one token every time), a top-k or a top-p ignored (tokens outside
the support appear), a temperature ignored (the counts follow the wrong distribution), a seed
dropped (the same seeded request no longer reproduces).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.frontend.serve.server import OpenAIServer
from tests.frontend.serve_fixtures import model_with_tokenizer, serving, stack_config
from tests.worker_svc.conftest import HFModel

openai = pytest.importorskip("openai")

PROMPT = [5, 9, 17, 33, 2, 64, 7, 12]
N = 64  # samples per request (the API's maximum)
REQUESTS = 40  # 2560 draws per distribution
P_MIN = 1e-4  # the fixed draws must fit at least this well ...
P_WRONG = 1e-8  # ... and a wrong distribution must fit at most this well


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return model_with_tokenizer(tmp_path_factory.mktemp("sampling-llama"))


@pytest.fixture(scope="module")
def server(hf: HFModel) -> Iterator[OpenAIServer]:
    with (
        LocalStack(stack_config(hf, num_gpu_blocks=160)) as stack,
        serving(stack, model=str(hf.path), model_name="tiny", max_num_seqs=64) as srv,
    ):
        yield srv


@pytest.fixture(scope="module")
def client(server: OpenAIServer) -> object:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def logits(hf: HFModel) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([PROMPT])).logits[0, -1].double()  # type: ignore[operator]


def model_distribution(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """softmax(logits / T) restricted to the top_k most likely tokens and then to the smallest
    prefix (by probability) whose mass reaches top_p, renormalized."""
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[: top_k or len(order)]] = True
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    if top_p < 1.0:
        cum = torch.cumsum(kept[order], 0)
        size = int((cum < top_p).sum()) + 1
        # The oracle is float64 and the worker fp32: a boundary this close could go either way.
        assert abs(float(cum[size - 1]) - top_p) > 1e-3 and abs(float(cum[size - 2]) - top_p) > 1e-3
        nucleus = torch.zeros_like(keep)
        nucleus[order[:size]] = True
        kept = torch.where(nucleus, kept, 0.0)
        kept = kept / kept.sum()
    return kept


def chi_square_p(counts: Counter[int], expected: torch.Tensor) -> float:
    """p-value of the counts under ``expected`` (tokens expected fewer than 5 times pooled in one
    bin); 0.0 when a token outside the support was drawn."""
    n = sum(counts.values())
    if any(expected[t] == 0 for t in counts):
        return 0.0
    exp = expected * n
    big = (exp >= 5).nonzero().flatten().tolist()
    bins = [(float(counts.get(t, 0)), float(exp[t])) for t in big]
    rest_exp = float(exp.sum()) - sum(e for _, e in bins)
    if rest_exp >= 5:
        bins.append((float(n - sum(o for o, _ in bins)), rest_exp))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    df = len(bins) - 1
    if df < 1:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


def draws(client, base_seed: int, temperature: float, top_p: float = 1.0, top_k: int = -1) -> list[int]:  # type: ignore[no-untyped-def]
    """REQUESTS x N first tokens of PROMPT, drawn with seeds base_seed, base_seed + 1, ..."""
    out: list[int] = []
    for r in range(REQUESTS):
        resp = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=1,
            n=N,
            seed=base_seed + r * N,
            temperature=temperature,
            top_p=top_p,
            extra_body={"ignore_eos": True, "top_k": top_k},
        )
        assert len(resp.choices) == N
        out += [c.token_ids[0] for c in sorted(resp.choices, key=lambda c: c.index)]
    return out


def test_temperature_1_follows_the_models_softmax_and_is_not_greedy(
    client, hf: HFModel, logits: torch.Tensor
) -> None:
    tokens = draws(client, 0, temperature=1.0)
    counts = Counter(tokens)
    greedy = hf.greedy(PROMPT, 1)[0]
    assert int(logits.argmax()) == greedy
    assert len(counts) > 10, f"only {len(counts)} distinct tokens in {len(tokens)} draws at temperature 1"
    assert counts[greedy] < len(tokens) / 2
    p = chi_square_p(counts, model_distribution(logits, 1.0))
    assert p > P_MIN, f"temperature 1 draws do not follow the model's softmax (chi-square p={p:.2e})"
    # The test has power: the same draws do not fit a sharper distribution.
    assert chi_square_p(counts, model_distribution(logits, 0.5)) < P_WRONG


def test_temperature_scales_the_distribution(client, logits: torch.Tensor) -> None:
    counts = Counter(draws(client, 10_000, temperature=0.5))
    p = chi_square_p(counts, model_distribution(logits, 0.5))
    assert p > P_MIN, f"temperature 0.5 draws do not follow softmax(logits / 0.5) (chi-square p={p:.2e})"
    assert chi_square_p(counts, model_distribution(logits, 1.0)) < P_WRONG


def test_top_k_keeps_the_k_most_likely_tokens_in_proportion(client, logits: torch.Tensor) -> None:
    k = 6
    counts = Counter(draws(client, 20_000, temperature=1.0, top_k=k))
    allowed = set(logits.topk(k).indices.tolist())
    assert set(counts) <= allowed, f"top_k={k}: drew {sorted(set(counts) - allowed)} outside the top {k}"
    assert len(counts) > 1
    p = chi_square_p(counts, model_distribution(logits, 1.0, top_k=k))
    assert p > P_MIN, f"top_k={k} draws do not follow the renormalized top-{k} softmax (p={p:.2e})"


def test_top_p_keeps_the_nucleus_in_proportion(client, logits: torch.Tensor) -> None:
    top_p = 0.42
    want = model_distribution(logits, 1.0, top_p=top_p)
    counts = Counter(draws(client, 30_000, temperature=1.0, top_p=top_p))
    allowed = set(want.nonzero().flatten().tolist())
    assert 1 < len(allowed) < 0.5 * len(logits)  # the nucleus really cuts the tail
    assert set(counts) <= allowed, f"top_p={top_p}: drew {sorted(set(counts) - allowed)} outside the nucleus"
    p = chi_square_p(counts, want)
    assert p > P_MIN, f"top_p={top_p} draws do not follow the renormalized nucleus (chi-square p={p:.2e})"


def test_a_seed_reproduces_its_draws_and_another_seed_does_not(client) -> None:
    kw = dict(
        model="tiny", prompt=PROMPT, max_tokens=6, n=N, temperature=1.0, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(seed=123, **kw)
    b = client.completions.create(seed=123, **kw)
    c = client.completions.create(seed=123 + N, **kw)
    toks = [[ch.token_ids for ch in sorted(r.choices, key=lambda ch: ch.index)] for r in (a, b, c)]
    assert toks[0] == toks[1], "the same seed gave different samples"
    assert toks[0] != toks[2], "different seeds gave the same 64 samples"
    assert len({tuple(t) for t in toks[0]}) > N // 2  # the 64 samples of one request differ
