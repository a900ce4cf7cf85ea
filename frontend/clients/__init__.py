"""Clients of the services: the block manager (block_manager.py), the workers (worker.py), the
shared connection flags (connection.py) and a small HTTP client for the OpenAI server (http.py)."""
