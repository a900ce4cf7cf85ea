"""Generated from protos/pagedkv/v1 by `make protos`; do not edit by hand."""
