"""Channel: messages put while the scheduler thread holds them (a step) reach the caller in order
at the end of the step, also when the step fails; other threads' messages go at once."""
import threading

import pytest

from kvboost_engine.request.decode import Channel, messages_after


def _pending(channel: Channel) -> list:
    out = []
    while not channel._queue.empty():
        out.append(channel._queue.get_nowait())
    return out


def test_held_messages_arrive_in_order_at_the_end_of_the_step():
    a, b = Channel(), Channel()
    with messages_after():
        a.delta("x")
        b.delta("y")
        with messages_after():                  # nested: the outer block puts them
            a.delta("z")
        assert _pending(a) == [] and _pending(b) == []
        a.done("gen")
    assert _pending(a) == [("delta", "x"), ("delta", "z"), ("done", "gen")]
    assert _pending(b) == [("delta", "y")]
    a.delta("now")                              # outside a step: at once
    assert _pending(a) == [("delta", "now")]


def test_a_failing_step_still_hands_over_its_messages():
    channel = Channel()
    err = RuntimeError("step failed")
    with pytest.raises(RuntimeError):
        with messages_after():
            channel.delta("x")
            channel.error(err)
            raise RuntimeError("boom")
    assert _pending(channel) == [("delta", "x"), ("error", err)]


def test_another_threads_messages_are_not_held():
    channel = Channel()
    with messages_after():
        thread = threading.Thread(target=channel.delta, args=("other",))
        thread.start()
        thread.join()
        assert _pending(channel) == [("delta", "other")]
