"""The frontend: what turns requests into engine steps, and everything that starts or drives it.

One folder per job, so that a change has one obvious home:

- ``engine/``: the continuous-batching engine (scheduling, the block-manager conversation, dispatch
  to the workers, admission, recovery). Talks gRPC only; imports neither torch nor worker code.
- ``serve/``: ``pagedkv serve``, the OpenAI-compatible HTTP server, and what only it uses (request
  parsing, the engine thread, detokenising, metrics, settings).
- ``launch/``: starting whole stacks: ``pagedkv up``'s processes and their supervisor, the one
  stack description (config), the stack's certificates and tokens, and the in-process stack (the
  only frontend module that imports service internals: it runs the services in its own process).
- ``clients/``: gRPC clients of the block manager and the workers, the shared connection flags, and
  the small HTTP client the programs use.
- ``apps/``: programs built on the above: ``pagedkv demo``, ``generate``, ``loadtest``.

docs/architecture.md has the module map.
"""
