"""Fixtures for the worker tests: a tiny random Llama saved the Hugging Face way, and its oracle.

The oracle is ``transformers.LlamaForCausalLM`` with the same weights, in fp32 on CPU with its
dense cache. The worker must generate exactly its greedy tokens. The torch reference kernels are
forced (TRITON_INTERPRET=1 is set suite-wide, and the interpreter is far too slow for a model),
except in the one test that runs the Triton kernels in the interpreter on purpose.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import pytest
import torch

VOCAB = 128


def make_hf_config(**overrides: object):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    kwargs: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        # Larger than HF's 0.02 so that next-token distributions are sharp: no greedy near-ties.
        initializer_range=0.2,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


@dataclass(slots=True)
class HFModel:
    path: pathlib.Path
    model: object  # transformers.LlamaForCausalLM

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """transformers' own greedy generation with its dense cache."""
        with torch.inference_mode():
            out = self.model.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]),
                max_new_tokens=n,
                do_sample=False,
                min_new_tokens=n,
                pad_token_id=None,
                eos_token_id=None,
            )
        return out[0, len(prompt) :].tolist()

    def beam_search(
        self,
        prompt: list[int],
        n: int,
        max_tokens: int,
        end_tokens: list[int] | None = None,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ) -> list[tuple[list[int], float]]:
        """transformers' beam search (num_beams = num_return_sequences = n): the n best hypotheses,
        best first, each (its generated tokens, the end token included; its score)."""
        return hf_beam_search(self.model, prompt, n, max_tokens, end_tokens, length_penalty, early_stopping)

    def last_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(torch.tensor([tokens])).logits[0, -1].float()  # type: ignore[operator]


def hf_beam_search(
    model: object,
    prompt: list[int],
    n: int,
    max_tokens: int,
    end_tokens: list[int] | None = None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> list[tuple[list[int], float]]:
    """``model.generate(num_beams=n, num_return_sequences=n, do_sample=False, ...)``: the n best
    hypotheses, best first, as (generated tokens, the end token included; sequences_scores)."""
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt]),
            num_beams=n,
            num_return_sequences=n,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=end_tokens or None,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(-1).tolist()  # what follows is padding
    return [
        (out.sequences[i, len(prompt) : len(prompt) + k].tolist(), float(out.sequences_scores[i]))
        for i, k in enumerate(lengths)
    ]


def build_hf_model(path: pathlib.Path, seed: int = 0, **overrides: object) -> HFModel:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_hf_config(**overrides)).eval()
    model.save_pretrained(path)
    return HFModel(path=path, model=model)


def noisy_copy(hf: HFModel, path: pathlib.Path, scale: float = 1.5, seed: int = 1) -> pathlib.Path:
    """``hf`` saved to ``path`` with noise on its MLP output weights (``scale`` times their
    spread): a speculative-decoding draft that agrees with the model often, not always."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf.path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.down_proj.weight
            w.add_(torch.randn(w.shape, generator=gen) * w.std() * scale)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    """Untied head, Llama 3 rope scaling, GQA 4:2."""
    return build_hf_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
