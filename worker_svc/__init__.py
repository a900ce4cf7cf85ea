"""The worker service: the data plane that owns the KV-cache tensors."""
