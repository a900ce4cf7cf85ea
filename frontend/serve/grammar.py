"""Grammar-constrained decoding, the frontend's half: compile a request's constraint (a JSON
schema, any JSON object, a regular expression, a choice of strings) against the model's vocabulary,
and keep one matcher per sample that says which tokens may come next.

Each step, a constrained sequence sends the worker its matcher's allowed-token bitmask
(``SequenceInput.allowed_token_mask``: bit ``t % 32`` of little-endian 32-bit word ``t // 32`` set =
token ``t`` allowed; 6 KiB for a 49k vocabulary); the worker masks the other logits out before it
chooses (worker_svc/model/sampling.py), greedy or sampled, and the token it returns is then
accepted by the matcher here. Once the grammar is complete only the model's stop tokens are
allowed, so the sample ends there.

The library is xgrammar, chosen over llguidance by bench/grammar_mask_bench.py (docs/benchmarks.md):
a mask is filled for every constrained token, so its per-token cost counts more than the compile,
which is paid once per distinct schema (the compiler caches).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from pagedkv.arith import ceil_div


class GrammarError(ValueError):
    """The constraint does not compile (a bad schema or regular expression): the caller's input."""


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """A compiled constraint; ``matcher()`` gives a fresh per-sample state."""

    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    description: str  # for logs and errors: "json_schema", "regex", ...

    def matcher(self) -> Matcher:
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(self.compiled), self.vocab_size)


class Matcher:
    """One sample's place in the grammar."""

    __slots__ = ("_m", "_mask")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._m = matcher
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self) -> bytes:
        """The tokens allowed next, as the step message's bitmask."""
        self._m.fill_next_token_bitmask(self._mask, 0)
        return bytes(self._mask[0].numpy().tobytes())

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it (it stays where it was)."""
        return bool(self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


def mask_bytes(vocab_size: int) -> int:
    """Length of an allowed-token bitmask for this vocabulary."""
    return 4 * ceil_div(vocab_size, 32)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary (thread-safe; compiled grammars are
    cached by xgrammar, so a schema sent with every request compiles once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        """Built on first use: reading the vocabulary takes a while, and most servers never need it."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(
                    tokenizer_info(self._tokenizer, self.vocab_size, self._stop)
                )
            return self._compiler

    def _compile(self, description: str, build: Any) -> Grammar:
        try:
            compiled = build(self._get())
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(
                str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            ) from None
        return Grammar(compiled, self.vocab_size, description)

    def json_schema(self, schema: dict[str, Any] | bool) -> Grammar:
        text = json.dumps(schema)
        return self._compile("json_schema", lambda c: c.compile_json_schema(text, any_whitespace=False))

    def either_ebnf(self, schema: dict[str, Any], ebnf: str) -> Grammar:
        """Text that is either JSON valid against ``schema`` or matched by the EBNF ``ebnf``."""

        def build(c: Any) -> Any:
            import xgrammar as xgr

            either = xgr.Grammar.union(
                xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                xgr.Grammar.from_ebnf(ebnf),
            )
            return c.compile_grammar(either)

        return self._compile("json_schema_or_text", build)

    def json_object(self) -> Grammar:
        return self._compile("json_object", lambda c: c.compile_builtin_json_grammar())

    def regex(self, pattern: str) -> Grammar:
        return self._compile("regex", lambda c: c.compile_regex(pattern))

    def ebnf(self, grammar: str) -> Grammar:
        """A grammar in xgrammar's EBNF (GBNF: ``root ::= ...``)."""
        return self._compile("grammar", lambda c: c.compile_grammar(grammar))

    def choice(self, choices: list[str]) -> Grammar:
        # EBNF string literals take JSON's escapes: each choice exactly, quotes and newlines included.
        rule = "root ::= " + " | ".join(json.dumps(c) for c in choices)
        return self._compile("choice", lambda c: c.compile_grammar(rule))


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary: each id's vocabulary entry, how entries spell bytes, and
    whether the tokenizer puts a space before the text. A ``TextTokenizer`` says so itself; a
    transformers tokenizer is read by xgrammar (``from_huggingface``)."""
    import xgrammar as xgr

    from pagedkv.frontend.serve.tokenizer import TextTokenizer

    if not isinstance(tokenizer, TextTokenizer):
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
    vocab = [""] * vocab_size  # ids past the tokenizer's (a padded output layer) match nothing
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    kinds = {
        "byte_level": xgr.VocabType.BYTE_LEVEL,
        "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
        "raw": xgr.VocabType.RAW,
    }
    stop = stop_token_ids or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None)
    return xgr.TokenizerInfo(
        vocab,
        kinds[tokenizer.vocab_type],
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=tokenizer.add_prefix_space,
    )
