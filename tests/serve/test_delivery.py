"""Engine -> event loop hand-over (k3.serve.jobs.Delivery): one loop wake-up per burst of events, every event
delivered once, in order, to its own request's queue."""

import asyncio
import threading

from k3.serve.jobs import Delivery


def test_one_wakeup_per_burst_and_order_kept():
    loop = asyncio.new_event_loop()
    try:
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda cb, *a: wakes.append(cb) or real(cb, *a)
        d = Delivery(loop)
        qa, qb = asyncio.Queue(), asyncio.Queue()

        def engine_step(base):  # the engine thread: one event per running sequence
            for i in range(3):
                d.put(qa, ("a", base + i))
                d.put(qb, ("b", base + i))

        t = threading.Thread(target=engine_step, args=(0,))
        t.start()
        t.join()
        assert len(wakes) == 1  # six events, one wake-up
        loop.run_until_complete(asyncio.sleep(0))
        engine_step(3)  # a second burst after the drain: one more wake-up
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakes) == 2
        got_a = [qa.get_nowait() for _ in range(qa.qsize())]
        got_b = [qb.get_nowait() for _ in range(qb.qsize())]
        assert got_a == [("a", i) for i in range(6)] and got_b == [("b", i) for i in range(6)]
    finally:
        loop.close()
