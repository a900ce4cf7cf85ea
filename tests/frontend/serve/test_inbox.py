"""frontend/serve/inbox.py: nothing lost or reordered across threads, wake-ups coalesced, timeouts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedkv.frontend.serve.inbox import Inbox


def test_items_from_another_thread_arrive_all_and_in_order_with_fewer_wakeups() -> None:
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        inbox: Inbox[int] = Inbox(loop)
        wakes = 0
        real_wake = inbox._wake  # noqa: SLF001

        def counting_wake() -> None:
            nonlocal wakes
            wakes += 1
            real_wake()

        inbox._wake = counting_wake  # type: ignore[method-assign]  # noqa: SLF001
        n = 20_000

        def produce() -> None:  # bursts (an engine iteration's tokens), with the consumer waiting between
            for burst in range(20):
                for i in range(burst * 1000, (burst + 1) * 1000):
                    inbox.put(i)
                time.sleep(0.005)

        t = threading.Thread(target=produce)
        t.start()
        got = [await inbox.get(5.0) for _ in range(n)]
        t.join()
        return got, wakes

    got, wakes = asyncio.run(main())
    assert got == list(range(20_000))
    assert 1 <= wakes <= 200  # coalesced: a burst of puts needs a wake-up or two, not one per item


def test_get_times_out_without_items_and_then_still_receives() -> None:
    async def main() -> int:
        inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
        with pytest.raises(TimeoutError):
            await inbox.get(0.05)
        threading.Timer(0.05, inbox.put, args=(7,)).start()
        return await inbox.get(5.0)

    assert asyncio.run(main()) == 7
