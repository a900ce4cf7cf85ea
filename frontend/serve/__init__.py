"""``pagedkv serve``: the OpenAI-compatible HTTP server (server.py) and what only it uses."""
