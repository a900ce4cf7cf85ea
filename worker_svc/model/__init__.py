"""A Llama-architecture decoder that runs on the paged KV cache (see ``llama.py``)."""
