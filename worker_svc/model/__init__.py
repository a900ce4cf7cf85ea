"""The models that run on the paged KV cache: one module per architecture (``registry.py``), the
step's batch layout (``batch.py``), sampling, and the building blocks they share (rope, linear)."""
