"""The CPU kernels: the attention backend, the native C kernels (csrc/) and their wrappers."""
