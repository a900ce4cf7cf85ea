"""What ``--model`` names: a Hugging Face directory or a GGUF file, decided in one place.

Why one module: every role that takes ``--model`` (cache host, worker, serve, up, demo, generate)
reads the config, the weights or the tokenizer through the functions here or through
``config.load_model_config`` / ``weights.load_checkpoint``, which ask ``resolve``; a path that is
neither kind is refused with one message wherever it is given.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Literal

from pagedkv.worker_svc.model import gguf_file


@dataclass(slots=True, frozen=True)
class ModelSource:
    path: pathlib.Path
    kind: Literal["hf", "gguf"]


def resolve(model: str | pathlib.Path) -> ModelSource:
    """``--model``'s kind: a directory (config.json + safetensors) or a file with the GGUF magic."""
    path = pathlib.Path(model)
    if path.is_dir():
        return ModelSource(path, "hf")
    if gguf_file.is_gguf(path):
        return ModelSource(path, "gguf")
    if path.is_file():
        raise ValueError(
            f"--model {model}: a file that is not GGUF (no GGUF magic); give a GGUF file or a "
            "Hugging Face model directory"
        )
    raise FileNotFoundError(f"--model {model}: no such directory or GGUF file")


def load_tokenizer(model: str | pathlib.Path) -> Any | None:
    """The model's tokenizer, offline: a GGUF file's (from its metadata) or a directory's
    tokenizer files (None when the directory has none). Needs transformers."""
    from pagedkv import envs

    src = resolve(model)
    if src.kind == "gguf":
        return gguf_file.load_tokenizer(src.path)
    if not any(
        (src.path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    envs.set_default("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(src.path), local_files_only=True)


def hf_config_dict(model: str | pathlib.Path) -> dict[str, Any]:
    """The model's config as a Hugging Face ``config.json`` dict (a GGUF file's from its metadata:
    ``max_position_embeddings``, ``eos_token_id``, ...); {} for a directory without config.json."""
    import json

    src = resolve(model)
    if src.kind == "gguf":
        return gguf_file.hf_config(src.path)[0]
    cfg = src.path / "config.json"
    return dict(json.loads(cfg.read_text())) if cfg.is_file() else {}
