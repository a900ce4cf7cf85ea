"""frontend/serve/inbox.py: nothing lost or reordered across threads, wake-ups coalesced, timeouts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedkv.frontend.serve.inbox import Inbox


def _counting(inbox: Inbox[int]) -> list[int]:
    """Counts the inbox's loop wake-ups in the returned one-element list."""
    wakes = [0]
    real_wake = inbox._wake  # noqa: SLF001

    def counting_wake() -> None:
        wakes[0] += 1
        real_wake()

    inbox._wake = counting_wake  # type: ignore[method-assign]  # noqa: SLF001
    return wakes


def test_items_from_another_thread_arrive_all_and_in_order() -> None:
    async def main() -> list[int]:
        inbox: Inbox[int] = Inbox(asyncio.get_running_loop())

        def produce() -> None:  # bursts (an engine iteration's tokens), with the consumer waiting between
            for burst in range(20):
                for i in range(burst * 1000, (burst + 1) * 1000):
                    inbox.put(i)
                time.sleep(0.005)

        t = threading.Thread(target=produce)
        t.start()
        got = [await inbox.get(5.0) for _ in range(20_000)]
        t.join()
        return got

    assert asyncio.run(main()) == list(range(20_000))


def test_a_burst_put_while_the_loop_is_busy_costs_one_wakeup() -> None:
    """How many wake-ups interleaved puts cost depends on how the threads are scheduled (each
    self-pipe write may hand the loop the GIL); a burst put while the loop is busy elsewhere, as
    while the server formats the previous iteration's chunks, costs exactly one."""

    async def main() -> tuple[list[int], int]:
        inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
        wakes = _counting(inbox)
        got: list[int] = []
        for burst in range(20):
            items = range(burst * 1000, (burst + 1) * 1000)

            def put_all(items: range = items) -> None:
                for i in items:
                    inbox.put(i)

            t = threading.Thread(target=put_all)
            t.start()
            t.join()  # the loop is held here: the burst's one wake-up stays pending until it runs
            got += [await inbox.get(5.0) for _ in items]
            await asyncio.sleep(0)  # let the loop run what is pending
        return got, wakes[0]

    got, wakes = asyncio.run(main())
    assert got == list(range(20_000))
    assert wakes == 20  # one per burst, not one per item


def test_get_times_out_without_items_and_then_still_receives() -> None:
    async def main() -> int:
        inbox: Inbox[int] = Inbox(asyncio.get_running_loop())
        with pytest.raises(TimeoutError):
            await inbox.get(0.05)
        threading.Timer(0.05, inbox.put, args=(7,)).start()
        return await inbox.get(5.0)

    assert asyncio.run(main()) == 7
