"""The runtime's output delivered beside the step (engines/runtime/delivery.py), as for MLX:
each request's events come in the same order and with the same content as when delivered on
the step's thread; an ending that needs the text (a stop string) still ends the request at
once, its sequence leaves the batch at the next step, and nothing sampled after it is sent;
a cancelled or failed request's last event follows its tokens; stop_all() returns with every
event out; and a bug in one request's delivery ends that request only."""

import logging
import threading
import time

import pytest

from engines.base import Cancelled, RequestStats, SamplingParams, Step
from engines.fake import FakeEngine
from engines.runtime.delivery import Delivery
from engines.runtime.runtime import Runtime, Submission


def test_threaded_work_runs_in_order_off_the_caller_and_drain_waits_for_it():
    delivery = Delivery("test-delivery")
    seen, threads = [], set()

    def work(i):
        time.sleep(0.001 if i % 7 == 0 else 0)
        seen.append(i)
        threads.add(threading.current_thread().name)

    for i in range(50):
        delivery.post(work, i)
    delivery.drain()
    assert seen == list(range(50))
    assert threads == {"test-delivery"}
    delivery.post(work, 50)
    delivery.close()  # what was posted still runs
    assert seen[-1] == 50
    assert not delivery._thread.is_alive()


def test_a_raising_job_is_logged_and_the_work_after_it_still_runs(caplog):
    delivery = Delivery("test-delivery")
    seen = []
    delivery.post(seen.append, 1)
    delivery.post(lambda: 1 / 0)
    delivery.post(seen.append, 2)
    with caplog.at_level(logging.ERROR, logger="duet.runtime"):
        delivery.close()
    assert seen == [1, 2]
    assert "delivering a step's output failed" in caplog.text
    assert "ZeroDivisionError" in caplog.text


def test_drain_returns_at_once_when_nothing_was_posted():
    delivery = Delivery("test-delivery")
    drained = threading.Thread(target=delivery.drain, daemon=True)
    drained.start()
    drained.join(2.0)
    assert not drained.is_alive()
    delivery.close()


def test_inline_work_runs_at_once_and_raises_to_the_caller():
    delivery = Delivery()
    seen = []
    delivery.post(seen.append, 1)
    assert seen == [1]
    with pytest.raises(ZeroDivisionError):
        delivery.post(lambda: 1 / 0)


def run(runtime, jobs, *, stop_after=None, emit_s=0.0):
    """Add every (prompt, params) job, step until the runtime has no work (no drain between
    steps: the delivery runs beside them), then stop_all(). Returns each job's events and the
    names of the threads that emitted them. emit_s: each event takes that long to hand over
    (a delivery that lags the steps)."""
    events = {i: [] for i in range(len(jobs))}
    threads = set()

    def emit_for(i):
        def emit(event):
            threads.add(threading.current_thread().name)
            time.sleep(emit_s)
            events[i].append(event)
        return emit

    stops = {i: threading.Event() for i in range(len(jobs))}
    for i, (prompt, params) in enumerate(jobs):
        runtime.add(Submission(list(prompt), params, emit_for(i), stops[i].is_set))
    steps = 0
    while runtime.has_work:
        runtime.step()
        steps += 1
        if stop_after is not None and steps == stop_after[1]:
            stops[stop_after[0]].set()
        assert steps < 500
    runtime.stop_all()
    return events, threads


def summary(events):
    """(text, finish reason, completion tokens) of one request's events, checking their shape:
    Steps, then one RequestStats last."""
    *steps, stats = events
    assert isinstance(stats, RequestStats), events
    assert all(isinstance(s, Step) for s in steps), events
    assert [s.finish_reason is not None for s in steps] == [False] * (len(steps) - 1) + [True]
    return "".join(s.text for s in steps), stats.finish_reason, stats.completion_tokens


JOBS = [
    (b"abc", SamplingParams(max_tokens=40, temperature=0.0)),
    (b"de", SamplingParams(max_tokens=7, temperature=0.0)),
    (b"fghi", SamplingParams(max_tokens=40, temperature=0.0, stop=["engine"])),
    (b"j", SamplingParams(max_tokens=40, temperature=0.0, stop=["你"])),
    (b"kl", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
]


def test_a_threaded_delivery_gives_every_request_what_the_inline_one_gives():
    got = {}
    for threaded in (False, True):
        engine = FakeEngine(max_batch=4, token_delay_s=0.001)
        runtime = Runtime(engine, threaded_output=threaded)
        events, threads = run(runtime, JOBS)
        got[threaded] = [summary(events[i]) for i in range(len(JOBS))]
        assert engine.kv_pool.used_blocks == 0
        assert threads == ({"fake-output"} if threaded else {threading.current_thread().name})
        runtime.close()
    assert got[True] == got[False]
    reply = "Hello from the fake engine! 你好 🙂"
    assert got[True][0] == (reply, "stop", len(reply.encode()) + 1)
    assert got[True][1] == (reply.encode()[:7].decode(), "length", 7)
    assert got[True][2] == ("Hello from the fake ", "stop", len(b"Hello from the fake engine"))
    assert got[True][3][:2] == ("Hello from the fake engine! ", "stop")


def test_a_stop_string_seen_beside_the_step_ends_the_request_and_frees_its_sequence():
    """The step's thread cannot see a stop string: the sequence runs a step more before it
    leaves the batch, and the token of that step is never sent."""
    engine = FakeEngine(max_batch=2, token_delay_s=0.002)
    ended = []
    engine.ended = lambda request_no, tokens: ended.append((request_no, tokens))
    runtime = Runtime(engine, threaded_output=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=["from"])
    events, _ = run(runtime, [(b"x", params)])
    text, finish, completion = summary(events[0])
    assert (text, finish, completion) == ("Hello ", "stop", len(b"Hello from"))
    assert ended and ended[0][0] == 0
    # Given at most a step's tokens more than it used, then let go; none of them sent.
    assert completion <= ended[0][1] <= completion + 2
    assert engine.kv_pool.used_blocks == 0
    runtime.close()


def test_a_cancelled_request_ends_after_its_tokens_and_stop_all_leaves_nothing_unsent():
    engine = FakeEngine(max_batch=4, token_delay_s=0.001, reply="y" * 200)
    runtime = Runtime(engine, threaded_output=True)
    params = SamplingParams(max_tokens=150, temperature=0.0)
    events, _ = run(runtime, [(b"a", params), (b"b", params)], stop_after=(0, 20), emit_s=0.002)
    text, finish, completion = summary(events[0])
    assert finish == "cancelled" and text == "y" * completion and 10 < completion < 150
    assert summary(events[1]) == ("y" * 150, "length", 150)

    # A request still running when stop_all() returns has had all of its events.
    got = []
    runtime.add(Submission([1], params, got.append))
    for _ in range(5):
        runtime.step()
    runtime.stop_all()
    assert summary(got)[1] == "cancelled" and summary(got)[2] >= 1
    waiting = []
    runtime.add(Submission([2], params, waiting.append))
    runtime.stop_all()  # never scheduled: only Cancelled
    assert len(waiting) == 1 and isinstance(waiting[0], Cancelled)
    runtime.close()


def test_a_failure_delivering_one_request_ends_that_request_only(caplog):
    engine = FakeEngine(max_batch=4, token_delay_s=0.001)
    runtime = Runtime(engine, threaded_output=True)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    events = {0: [], 1: []}
    runtime.add(Submission([1], params, events[0].append))
    runtime.add(Submission([2], params, events[1].append))
    broken = runtime._live[min(runtime._live)].out
    calls = [0]
    add = broken.add

    def flaky(token, now=None, logprobs=None):
        calls[0] += 1
        if calls[0] == 5:
            raise UnicodeError("a bad token")
        return add(token, now, logprobs)

    broken.add = flaky
    with caplog.at_level(logging.ERROR, logger="duet.runtime"):
        while runtime.has_work:
            runtime.step()
        runtime.close()
    assert isinstance(events[0][-1], UnicodeError)
    assert [type(e) for e in events[0]] == [Step] * 4 + [UnicodeError]
    assert summary(events[1])[1:] == ("length", 20)
    assert engine.kv_pool.used_blocks == 0
    assert "delivering a token failed" in caplog.text


def test_a_failed_step_ends_its_requests_after_the_tokens_they_had():
    engine = FakeEngine(max_batch=2, token_delay_s=0.001)
    runtime = Runtime(engine, threaded_output=True)

    def before_token(request_no, index):
        if index == 6:
            raise RuntimeError("the device went away")

    engine.before_token = before_token
    got = []

    def slow(event):  # a delivery that lags the steps: the error must still come last
        time.sleep(0.005)
        got.append(event)

    runtime.add(Submission([1], SamplingParams(max_tokens=20, temperature=0.0), slow))
    while runtime.has_work:
        runtime.step()
    runtime.close()
    assert [type(e) for e in got] == [Step] * 6 + [RuntimeError]


def test_endings_without_text_leave_the_batch_at_once_however_the_delivery_lags():
    """End-of-sequence and max_tokens are seen on the step's thread: the sequence is given no
    token past its last, even while the delivery is steps behind (a stop string, which only the
    delivery sees, costs a step)."""
    engine = FakeEngine(max_batch=2, reply="abc")
    given = {}
    engine.ended = lambda request_no, tokens: given.__setitem__(request_no, tokens)
    runtime = Runtime(engine, threaded_output=True)
    jobs = [(b"x", SamplingParams(max_tokens=40, temperature=0.0)),  # "abc" then EOS
            (b"y", SamplingParams(max_tokens=2, temperature=0.0))]
    events, _ = run(runtime, jobs, emit_s=0.005)
    runtime.close()
    assert summary(events[0]) == ("abc", "stop", 4)
    assert summary(events[1]) == ("ab", "length", 2)
    assert given == {0: 4, 1: 2}


def test_the_step_waits_for_the_output_once_it_lags_more_than_a_step():
    """The step's thread may run one posted output ahead of the delivery, no further: however
    busy the machine, a stop string seen there ends its sequence a bounded number of steps
    later."""
    delivery = Delivery("test-delivery")
    gate = threading.Event()
    delivery.post(gate.wait)  # the delivery is stuck on the step before's output
    delivery.post(lambda: None)
    waited = threading.Event()
    threading.Thread(target=lambda: (delivery.wait_behind(1), waited.set()), daemon=True).start()
    assert not waited.wait(0.2)
    gate.set()
    assert waited.wait(5)
    delivery.close()
