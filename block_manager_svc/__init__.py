"""The block manager service: the control plane of the paged KV cache.

`core/` decides (pure Python, no I/O); `servicer.py` translates gRPC to core
calls and core errors to status codes; `server.py` wires health, reflection,
logging and signals around it.
"""
