"""The block manager service: the control plane of the paged KV cache.

`core/` decides (pure Python, no I/O); `servicer.py` runs each RPC through the
pipeline tenancy -> reliability -> `handlers.py` (gRPC to core calls, core
errors to status codes); `server.py` wires health, reflection, logging and
signals around it.
"""
