"""pagedkv: PagedAttention KV-cache management as gRPC microservices.

This umbrella package holds what every service shares: the command line
(`pagedkv.cli`) and the code generated from protos/ (`pagedkv.v1`).
"""

__version__ = "0.1.0"
