"""The forms a model's weights can be held in (``--weight-format``), named where every role and
program can read them without importing worker code (the frontend imports no worker modules).

``auto``: a GGUF file on CPU keeps its own quantization, everything else is dense in ``--dtype``;
``fp32`` / ``bf16``: dense; ``int8`` / ``int4``: weight-only quantization of a Hugging Face
directory at load (worker_svc/model/weight_format.py decides and builds)."""

from __future__ import annotations

from typing import Literal

WeightFormat = Literal["auto", "fp32", "bf16", "int8", "int4"]
