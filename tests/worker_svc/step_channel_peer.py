"""A process serving the step channel with a stand-in handler, for the channel's process tests:
it prints the socket path, then answers each step with ``num_tokens`` = the number of token ids of
its first sequence, after sleeping that sequence's ``num_cached_tokens`` milliseconds.

    python -m tests.worker_svc.step_channel_peer BASE_DIR
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from pagedkv.v1 import worker_pb2 as wpb
from pagedkv.worker_svc.step_channel import StepChannelServer


def handler(request: wpb.WorkerStepRequest) -> wpb.WorkerStepResponse:
    first = request.sequences[0] if request.sequences else wpb.SequenceInput()
    time.sleep(first.num_cached_tokens / 1000)
    return wpb.WorkerStepResponse(num_tokens=len(first.token_ids))


def main() -> None:
    server = StepChannelServer(handler, base=Path(sys.argv[1]))
    print(f"PATH={server.path}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
