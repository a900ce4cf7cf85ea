"""transformers' GGUF loads in one block reading each file's metadata once.

transformers' ``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` with
``gguf_file=`` each call ``load_gguf_checkpoint`` (the model twice: its config, then its weights),
and each call builds a new ``gguf.GGUFReader``, which parses every metadata field of the file part
by part: for a vocabulary of 262,144 tokens (Gemma 3) that parse is most of what loading the
tokenizer and the model costs. The reader is only read from (its fields, and its tensors, views of
the memory-mapped file), so within the block every load of the same file gets the first load's
reader: the tokenizer, config and weights transformers builds are those of a fresh parse.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()


@contextlib.contextmanager
def one_gguf_parse_per_file() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` gives one reader per (path, mode).

    transformers imports ``GGUFReader`` from ``gguf`` inside ``load_gguf_checkpoint``, at each call,
    so replacing the module's attribute for the block reaches it. One block at a time (a lock): the
    attribute is the process's.
    """
    import gguf

    with _lock:
        real = gguf.GGUFReader
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: Any, mode: str = "r") -> Any:
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in readers:
                readers[key] = real(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = real
