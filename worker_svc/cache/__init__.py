"""The cache host's parts: the shared KV cache and weights as memory, their layout, the backends."""
