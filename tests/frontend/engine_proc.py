"""One engine in its own process, for the many-frontends tests: `python -m tests.frontend.engine_proc`.

Reads a JSON job from argv (targets, requests, lease TTL), prints JSON lines on stdout:
{"instance": id} first, {"tokens": n} as tokens arrive, then {"outputs": [...], "stats": {...}}.
Request i > 0 is added only once request 0's prompt is computed (and so committed in the next
Step), so later requests can hit the shared prefix.
"""

from __future__ import annotations

import json
import sys

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest


def main() -> None:
    job = json.loads(sys.argv[1])
    bm = BlockManagerClient(job["block_manager"])
    workers = [WorkerClient(t) for t in job["workers"]]
    engine = Engine(bm, workers, EngineConfig(lease_ttl_s=job["lease_ttl_s"], max_batch_tokens=512))
    print(json.dumps({"instance": engine.instance_id}), flush=True)
    reqs = [GenerationRequest(r["id"], r["prompt"], max_tokens=r["max_tokens"]) for r in job["requests"]]
    outs = [engine.add_request(reqs[0])]
    while outs[0].completions[0].token_ids == []:
        engine.step()
    outs += [engine.add_request(r) for r in reqs[1:]]
    n = 0
    for _ in engine.stream():
        n += 1
        print(json.dumps({"tokens": n}), flush=True)
    print(
        json.dumps(
            {
                "outputs": [
                    {"id": o.request_id, "tokens": o.completions[0].token_ids, "cached": o.num_cached_tokens}
                    for o in outs
                ],
                "stats": {
                    "steps": engine.stats.steps,
                    "bm_round_trips": engine.stats.bm_round_trips,
                    "worker_steps": engine.stats.worker_steps,
                },
            }
        ),
        flush=True,
    )
    engine.close()


if __name__ == "__main__":
    main()
