"""`pagedkv demo --model` on a model with a chat template: the workload as real chat prompts, and a few
real question/answer pairs printed beside the figures.

The workload keeps the shape of the token-id one (frontend/apps/demo.py): a few shared system prompts of
very different lengths, the short one the most popular (so the prefix cache pays), lognormal output
lengths, some `n = 2` and sampled requests. Only the prompts change: a system prompt and a user
question rendered by the tokenizer's chat template, so a real model sees text it can answer. The
answers shown are separate greedy chat requests (`/v1/chat/completions`, stopped by the model's end
of turn), asked after the workload so that they do not change its figures.
"""

from __future__ import annotations

import math
import random

from pagedkv.frontend.engine import GenerationRequest, SamplingOptions
from pagedkv.frontend.serve.text import ModelText

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    (
        "You are a helpful assistant for a travel company. Answer questions about places, history and "
        "geography briefly and accurately. If you do not know something, say so instead of guessing. "
        "Prefer plain words over jargon, and give numbers with their units."
    ),
    (
        "You are a patient tutor for students of all ages. Explain ideas step by step, starting from what "
        "the student already knows, and check each step before moving on. Use short sentences and everyday "
        "examples: cooking, sports, money, travel. When a student makes a mistake, do not just give the "
        "right answer: point at the step that went wrong and ask a question that helps them see it. Keep "
        "every answer under a hundred words unless the student asks for more detail, and end with one "
        "short question that checks the student understood."
    ),
    (
        "You are the assistant of a small public library. The library opens from nine in the morning to "
        "six in the evening on weekdays and from ten to four on Saturdays; it is closed on Sundays and "
        "public holidays. Members may borrow up to eight books, four films and two games at a time, for "
        "three weeks each, and may renew twice online unless someone else reserved the item. Late returns "
        "cost ten cents a day per book and fifty cents a day per film or game, up to the item's price. "
        "Printing costs ten cents a page in black and white and fifty cents in colour; the scanner is free. "
        "Study rooms for up to six people can be booked a week ahead for two hours a day. Children under "
        "twelve must be accompanied by an adult after five o'clock. Answer visitors' questions politely "
        "and briefly from these facts, and send anything else to the front desk."
    ),
]
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Name three primary colours.",
    "What is the boiling point of water at sea level?",
    "Who wrote Romeo and Juliet?",
    "How many days are there in a leap year?",
    "What is the largest planet in the solar system?",
    "Translate 'thank you' into Spanish.",
    "What do bees make?",
    "How many minutes are in two hours?",
]
SHOWN_QUESTIONS = QUESTIONS[:3]
ANSWER_TOKENS = 48


def make_text_workload(num_requests: int, text: ModelText, seed: int) -> list[GenerationRequest]:
    """The demo's workload with chat prompts: (system prompt, question) through the chat template."""
    rng = random.Random(seed)
    popularity = [8, 4, 2, 1]  # the short prompt is the popular one
    reqs = []
    for i in range(num_requests):
        system = rng.choices(SYSTEM_PROMPTS, weights=popularity)[0]
        prompt = text.chat_prompt(
            [{"role": "system", "content": system}, {"role": "user", "content": rng.choice(QUESTIONS)}]
        )
        out = max(4, min(96, int(rng.lognormvariate(math.log(28), 0.5))))
        sampled = rng.random() < 0.3
        reqs.append(
            GenerationRequest(
                f"demo-{i}",
                prompt,
                max_tokens=out,
                n=2 if rng.random() < 0.25 else 1,
                sampling=SamplingOptions(temperature=0.8, top_p=0.95, seed=i)
                if sampled
                else SamplingOptions(),
            )
        )
    return reqs


def ask(url: str, questions: list[str], *, api_key: str = "") -> list[tuple[str, str]]:
    """Each question as a greedy chat request; (question, answer) pairs."""
    import json

    from pagedkv.frontend.clients.http import get_text, post_json

    model = json.loads(get_text(url + "/v1/models", api_key=api_key))["data"][0]["id"]
    pairs = []
    for q in questions:
        r = post_json(
            url + "/v1/chat/completions",
            {
                "model": model,
                "messages": [{"role": "user", "content": q}],
                "temperature": 0,
                "max_tokens": ANSWER_TOKENS,
            },
            api_key=api_key,
        )
        choice = r["choices"][0]
        answer = choice["message"]["content"].strip()
        if choice["finish_reason"] == "length":
            answer += " [...]"
        pairs.append((q, answer))
    return pairs


def format_answers(pairs: list[tuple[str, str]]) -> str:
    lines = ["", f"real answers (greedy chat completions, at most {ANSWER_TOKENS} tokens each)", ""]
    for q, a in pairs:
        lines += [f"  Q: {q}", f"  A: {' '.join(a.split())}", ""]
    return "\n".join(lines)
