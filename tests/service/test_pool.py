"""The worker pool for plain user code (``asyncrl.service.pool``), with real worker processes: answers,
each fault and its cause, who else a fault takes down, sessions, scheduling, and that processes and
threads stay bounded. The user code is ``pool_targets`` (this folder). No assertion is on timing: the
timeouts below only decide which calls hang, with wide margins either side."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time

import pool_targets
import pytest
from pool_fixtures import in_pool

from asyncrl.episodes.user_code import target_of
from asyncrl.errors import EpisodeFailure
from asyncrl.service import pool as pool_module
from asyncrl.service import sessions
from asyncrl.service.pool import WorkerFault

T = "pool_targets:"
WAIT_S = 30.0  # a deadline no healthy call here comes near, even on a loaded machine


def children(but: frozenset = frozenset()) -> dict[int, str]:
    """``{pid: state}`` of this process's child processes (state ``Z``: a zombie) but those in ``but``
    (started before the test: servers of other test modules' fixtures)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and int(entry) not in but:
                found[int(entry)] = fields[0]
    return found


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


async def until_gone(pid: int) -> None:
    while not gone(pid):
        await asyncio.sleep(0.05)


async def fault(call) -> EpisodeFailure:
    with pytest.raises(EpisodeFailure) as caught:
        await call
    return caught.value


# ----- stateless calls -------------------------------------------------------------------------


def test_call_answers_json_from_another_process():
    async def test(pool):
        answer = await pool.call(T + "add", [1, 2], {"scale": 3}, timeout_s=WAIT_S, kind="tool")
        assert answer["sum"] == 9 and answer["pair"] == [1, 2]  # a tuple arrives as a list
        assert answer["pid"] != os.getpid()
        assert await pool.call(T + "add_later", [2, 3], {}, timeout_s=WAIT_S, kind="tool") == 5  # async def

    in_pool(test)


def test_user_errors_are_answers_and_the_worker_stays():
    async def test(pool):
        first = await pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool")
        error = await fault(pool.call(T + "fail", ["boom"], {}, timeout_s=WAIT_S, kind="tool"))
        assert error.cause == "tool_error"
        assert error.detail.startswith("ValueError: boom (") and "pool_targets.py:" in error.detail
        own = await fault(pool.call(T + "invalid", [], {}, timeout_s=WAIT_S, kind="reward"))
        assert (own.cause, own.detail) == ("reward_invalid", "not a number")  # the user's own cause is kept
        not_json = await fault(pool.call(T + "not_json", [], {}, timeout_s=WAIT_S, kind="reward"))
        assert not_json.cause == "reward_error" and "not JSON" in not_json.detail
        for target, says in [(T + "missing", "has no attribute 'missing'"), ("no_such_module:f", "No module named")]:
            missing = await fault(pool.call(target, [], {}, timeout_s=WAIT_S, kind="env"))
            assert missing.cause == "env_error" and "cannot import" in missing.detail and says in missing.detail
        bad_args = await fault(pool.call(T + "add", [object(), 1], {}, timeout_s=WAIT_S, kind="tool"))
        assert bad_args.cause == "tool_error" and "not JSON" in bad_args.detail
        assert await pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool") == first
        assert pool.stats()["workers_started"] == 1

    in_pool(test)


def test_a_hang_kills_its_worker_and_a_neighbour_runs_again():
    async def test(pool):
        hung_pid = await pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool")
        neighbour = asyncio.ensure_future(pool.call(T + "sleep", [1.0], {}, timeout_s=WAIT_S, kind="tool"))
        await asyncio.sleep(0.2)  # the neighbour is in the worker before the hang
        timeout = await fault(pool.call(T + "hang", [], {}, timeout_s=0.5, kind="tool"))
        assert timeout.cause == "tool_timeout" and f"pid {hung_pid}" in timeout.detail
        assert gone(hung_pid)  # killed and reaped by the time the timeout is raised
        assert await neighbour not in (hung_pid, None)  # run again, on another worker
        assert await pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool") != hung_pid
        stats = pool.stats()
        assert (stats["timeouts"], stats["retried"], stats["lost"], stats["workers_alive"]) == (1, 1, 0, 1)

    in_pool(test, workers=1, threads=4)


def test_hung_calls_on_one_worker_each_end_as_timeout_and_neighbours_are_run_until_answered():
    """Hangs come together (every sample of a prompt that hangs the reward): each hung call ends as
    ``timeout`` at its own deadline, though the first one's kill made it collateral and it ran again
    elsewhere; a quick neighbour killed under it twice is run a third time and answers."""

    async def test(pool):
        hangs = [asyncio.ensure_future(fault(pool.call(T + "hang", [], {}, timeout_s=1.0 + i / 2, kind="reward")))
                 for i in range(2)]  # fmt: skip
        await asyncio.sleep(0.2)
        neighbour = asyncio.ensure_future(pool.call(T + "sleep", [2.0], {}, timeout_s=WAIT_S, kind="reward"))
        assert [f.cause for f in await asyncio.gather(*hangs)] == ["reward_timeout", "reward_timeout"]
        assert await neighbour is not None
        stats = pool.stats()
        assert stats["timeouts"] == 2 and stats["lost"] == 0 and stats["retried"] >= 2

    in_pool(test, workers=1, threads=4)


@pytest.mark.parametrize(
    ("target", "args", "says"), [("abort", [], "died of SIGABRT"), ("exit_with", [3], "exited with code 3")]
)
def test_a_worker_that_dies_is_a_crash(target, args, says):
    async def test(pool):
        session = await pool.open(T + "Counter", {}, timeout_s=WAIT_S)
        await session.call("step", [1], timeout_s=WAIT_S)  # answers its worker's pid: a replay cannot match
        crash = await fault(pool.call(T + target, args, {}, timeout_s=WAIT_S, kind="reward"))
        assert crash.cause == "reward_crash" and says in crash.detail
        held = await fault(session.call("step", [1], timeout_s=WAIT_S))  # idle, it died with the worker
        assert held.cause == "env_lost" and "during another session's call" in held.detail and says in held.detail
        assert "call 1 of 1 (step) returned something else" in held.detail
        await session.close(timeout_s=WAIT_S)  # never raises for a dead worker
        assert await pool.call(T + "add_later", [1, 1], {}, timeout_s=WAIT_S, kind="reward") == 2
        assert pool.stats()["crashes"] == 1

        crashing = await pool.open(T + "Counter", {}, timeout_s=WAIT_S)  # its own step kills the worker
        crash = await fault(crashing.call("abort", [], timeout_s=WAIT_S))
        assert crash.cause == "env_crash" and "died of SIGABRT" in crash.detail
        assert (await fault(crashing.call("step", [1], timeout_s=WAIT_S))).cause == "env_crash"

    in_pool(test, workers=1)


def test_memory_past_the_limit_kills_the_worker():
    async def test(pool):
        pid = await pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool")
        with open(f"/proc/{pid}/oom_score_adj") as f:
            assert f.read().strip() == "1000"  # the kernel's first choice if memory runs out before a poll
        memory = await fault(pool.call(T + "hog", [400], {}, timeout_s=WAIT_S, kind="tool"))
        assert memory.cause == "tool_memory" and "past the 200 MB limit" in memory.detail
        assert pool.stats()["memory_kills"] == 1
        assert await pool.call(T + "add_later", [1, 1], {}, timeout_s=WAIT_S, kind="tool") == 2

    in_pool(test, workers=1, memory_mb=200)


def test_a_worker_that_cannot_start_is_a_crash(monkeypatch):
    monkeypatch.setattr(pool_module, "_WORKER_CODE", "import sys; sys.exit(5)")

    async def test(pool):
        crash = await fault(pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool"))
        assert crash.cause == "tool_crash" and "did not start" in crash.detail and "exited with code 5" in crash.detail

    in_pool(test)


def test_preloads_are_imported_as_a_worker_starts_and_a_broken_one_is_left_to_its_call():
    async def test(pool):
        loaded = await pool.call("sys:modules.__contains__", ["pool_targets"], {}, timeout_s=WAIT_S, kind="tool")
        assert loaded  # imported before the worker said it was ready: no call had named it
        missing = await fault(pool.call("no_such_module:f", [], {}, timeout_s=WAIT_S, kind="tool"))
        assert missing.cause == "tool_error" and "cannot import 'no_such_module:f'" in missing.detail
        assert pool.stats()["workers_started"] == 1  # the broken preload did not fail the worker's start

    in_pool(test, workers=1, start_timeout_s=WAIT_S, preload=("no_such_module:f", T + "add"))


def test_queueing_does_not_count_against_the_timeout():
    async def test(pool):
        # one thread: the sixth call queues 1.5 s, past its 1.2 s timeout, and still succeeds
        calls = [pool.call(T + "sleep", [0.3], {}, timeout_s=1.2, kind="tool") for _ in range(6)]
        assert len(set(await asyncio.gather(*calls))) == 1
        assert pool.stats()["peak_workers"] == 1

    in_pool(test, workers=1, threads=1)


def test_many_blocking_calls_share_few_workers():
    async def test(pool):
        calls = [pool.call(T + "sleep", [0.5], {}, timeout_s=WAIT_S, kind="tool") for _ in range(64)]
        pids = await asyncio.gather(*calls)
        stats = pool.stats()
        assert len(set(pids)) <= 2 and stats["peak_workers"] <= 2
        assert stats["peak_threads"] <= 32 + 1  # the calls' threads and each worker's main thread

    in_pool(test, workers=2, threads=32)


def test_a_cancelled_call_holds_its_thread_until_its_deadline():
    async def test(pool):
        hung_pid = await pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool")
        abandoned = asyncio.ensure_future(pool.call(T + "hang", [], {}, timeout_s=0.5, kind="tool"))
        await asyncio.sleep(0.1)
        abandoned.cancel()  # its thread still sleeps in the worker...
        other = await pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool")
        assert other != hung_pid  # ...so the one-thread worker is full, and a second one serves
        await asyncio.wait_for(until_gone(hung_pid), WAIT_S)  # ...until its deadline kills that worker
        assert pool.stats()["timeouts"] == 1

    in_pool(test, workers=2, threads=1)


def test_hangs_leave_processes_bounded_and_reaped():
    before = frozenset(children())

    async def test(pool):
        for _ in range(20):
            timeout = await fault(pool.call(T + "hang", [], {}, timeout_s=0.3, kind="tool"))
            assert timeout.cause == "tool_timeout"
        stats = pool.stats()
        assert stats["timeouts"] == 20 and stats["workers_alive"] <= 2
        assert "Z" not in children(before).values() and len(children(before)) <= 2

    in_pool(test, workers=2, threads=4)
    assert children(before) == {}


# ----- sessions --------------------------------------------------------------------------------


def test_a_session_keeps_its_object_in_one_worker(tmp_path):
    async def test(pool):
        session = await pool.open(T + "Counter", {"start": 10, "log": str(tmp_path / "closed")}, timeout_s=WAIT_S)
        total, pid = await session.call("step", [1], timeout_s=WAIT_S)
        assert total == 11
        assert await session.call("step", [2], timeout_s=WAIT_S) == [13, pid]
        assert pool.stats()["sessions_open"] == 1
        await session.close(timeout_s=WAIT_S)
        assert (tmp_path / "closed").read_text() == "13"  # its close() ran
        after = await fault(session.call("step", [1], timeout_s=WAIT_S))
        assert after.cause == "env_error" and "closed" in after.detail
        assert pool.stats()["sessions_open"] == 0

        queued = await pool.open(T + "AsyncCounter", {}, timeout_s=WAIT_S)
        await queued.call("put", ["x"], timeout_s=WAIT_S)  # an asyncio.Queue made on the session's loop...
        assert await queued.call("get", [], timeout_s=WAIT_S) == "x"  # ...works in its next call
        await queued.close(timeout_s=WAIT_S)

    in_pool(test)


def test_sessions_spread_over_workers():
    async def test(pool):
        sessions = [await pool.open(T + "Counter", {}, timeout_s=WAIT_S) for _ in range(4)]
        pids = [(await s.call("step", [0], timeout_s=WAIT_S))[1] for s in sessions]
        assert len(set(pids[:2])) == 2 and sorted(pids[2:]) == sorted(pids[:2])  # two per worker

    in_pool(test, workers=2)


def test_a_neighbours_hang_loses_a_session():
    async def test(pool):
        hung = await pool.open(T + "Counter", {}, timeout_s=WAIT_S)
        idle = await pool.open(T + "Counter", {}, timeout_s=WAIT_S)
        await idle.call("step", [1], timeout_s=WAIT_S)  # answers its worker's pid: a replay cannot match
        timeout = await fault(hung.call("hang", [], timeout_s=0.5))
        assert timeout.cause == "env_timeout"
        lost = await fault(idle.call("step", [1], timeout_s=WAIT_S))
        assert lost.cause == "env_lost" and "after another session's step hung" in lost.detail
        assert (await fault(hung.call("step", [1], timeout_s=WAIT_S))).cause == "env_timeout"
        await hung.close(timeout_s=WAIT_S)
        await idle.close(timeout_s=WAIT_S)
        fresh = await pool.open(T + "Counter", {"start": 1}, timeout_s=WAIT_S)
        assert (await fresh.call("step", [1], timeout_s=WAIT_S))[0] == 2
        stats = pool.stats()
        assert (stats["lost"], stats["replay_mismatch"], stats["sessions_replayed"]) == (1, 1, 0)

    in_pool(test, workers=1)


# ----- replaying an innocent session onto another worker ----------------------------------------


def test_an_idle_session_outlives_its_workers_crash_by_replay():
    """Two sessions on one worker; one aborts it: the culprit fails ``env_crash``, the idle one is
    rebuilt on a new worker from its recorded calls and goes on as if nothing happened."""

    async def test(pool):
        culprit = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        idle = await pool.open(T + "Tally", {"start": 10}, timeout_s=WAIT_S)
        assert [await idle.call("step", [n], timeout_s=WAIT_S) for n in (1, 2, 3)] == [11, 13, 16]
        crash = await fault(culprit.call("abort", [], timeout_s=WAIT_S))  # a suspect, it crashes alone again
        assert crash.cause == "env_crash" and "died of SIGABRT" in crash.detail
        assert "abort call in flight" in crash.detail and "run again on a worker of its own" in crash.detail
        assert pool.stats()["sessions_open"] == 1  # the idle one, detached, is still open; the culprit is not
        assert await idle.call("step", [4], timeout_s=WAIT_S) == 20  # what an uncrashed Tally answers
        assert await idle.call("step", [5], timeout_s=WAIT_S) == 25
        assert (await fault(culprit.call("step", [1], timeout_s=WAIT_S))).cause == "env_crash"
        stats = pool.stats()
        assert (stats["crashes"], stats["suspects_blamed"], stats["sessions_replayed"], stats["lost"]) == (2, 1, 1, 0)
        assert stats["workers_started"] == 3  # the shared one, the culprit's own, the shared one's replacement

        crash = await fault(idle.call("abort", [], timeout_s=WAIT_S))  # replayed, its own crash is its own
        assert crash.cause == "env_crash"
        await idle.close(timeout_s=WAIT_S)
        await culprit.close(timeout_s=WAIT_S)
        assert pool.stats()["sessions_open"] == 0

    in_pool(test, workers=1)


def test_a_step_in_flight_at_a_crash_runs_again_alone_and_goes_on():
    """A crash has suspects: every session with a step in flight. Each runs again, after its replay,
    on a worker of its own: the culprit crashes that one too (``env_crash``), the innocent answers."""

    async def test(pool):
        culprit = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        busy = await pool.open(T + "Tally", {"start": 5}, timeout_s=WAIT_S)
        assert await busy.call("step", [1], timeout_s=WAIT_S) == 6
        slow = asyncio.ensure_future(busy.call("slow_step", [2, 1.0], timeout_s=WAIT_S))
        await asyncio.sleep(0.3)  # in flight when its worker dies
        crash = await fault(culprit.call("abort", [], timeout_s=WAIT_S))
        assert crash.cause == "env_crash" and "run again on a worker of its own" in crash.detail
        assert await slow == 8  # run again alone after its replay: what an uncrashed Tally answers
        assert await busy.call("step", [3], timeout_s=WAIT_S) == 11  # replayed once more, on a shared worker
        stats = pool.stats()
        assert (stats["suspects_cleared"], stats["suspects_blamed"], stats["sessions_replayed"]) == (1, 1, 1)
        assert (stats["crashes"], stats["lost"], stats["workers_alive"]) == (2, 0, 1)

    in_pool(test, workers=1)


def test_suspects_run_alone_one_at_a_time_and_one_cancelled_waiting_holds_no_one_up():
    async def test(pool):
        first, second, culprit = [await pool.open(T + "Tally", {}, timeout_s=WAIT_S) for _ in range(3)]
        steps = [asyncio.ensure_future(s.call("slow_step", [1, 1.0], timeout_s=WAIT_S)) for s in (first, second)]
        await asyncio.sleep(0.3)
        crash = asyncio.ensure_future(fault(culprit.call("abort", [], timeout_s=WAIT_S)))
        await asyncio.sleep(0.5)  # the first suspect runs alone, the others wait their turn
        steps[1].cancel()
        assert await steps[0] == 1
        assert (await crash).cause == "env_crash"
        with pytest.raises(asyncio.CancelledError):
            await steps[1]
        stats = pool.stats()
        assert (stats["suspects_cleared"], stats["suspects_blamed"], stats["peak_workers"]) == (1, 1, 1)
        fresh = await pool.open(T + "Tally", {"start": 1}, timeout_s=WAIT_S)
        assert await fresh.call("step", [1], timeout_s=WAIT_S) == 2

    in_pool(test, workers=1)


def test_a_replay_whose_new_worker_crashes_under_it_is_replayed_again():
    async def test(pool):
        first = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        idle = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        assert await idle.call("slow_step", [1, 1.0], timeout_s=WAIT_S) == 1  # its replay takes a second
        assert (await fault(first.call("abort", [], timeout_s=WAIT_S))).cause == "env_crash"
        second = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)  # on the replacement worker
        replayed = asyncio.ensure_future(idle.call("step", [1], timeout_s=WAIT_S))  # replayed there too
        await asyncio.sleep(0.4)
        assert (await fault(second.call("abort", [], timeout_s=WAIT_S))).cause == "env_crash"
        assert await replayed == 2  # its replay crashed under it: replayed on a third worker
        stats = pool.stats()
        assert (stats["sessions_replayed"], stats["lost"], stats["suspects_blamed"]) == (1, 0, 2)
        assert stats["workers_started"] == 5  # two shared ones crashed, each culprit's own, the third shared one

    in_pool(test, workers=1)


def test_an_idle_session_is_replayed_after_a_neighbours_hang_and_closes_unreplayed():
    async def test(pool):
        hung = await pool.open(T + "Counter", {}, timeout_s=WAIT_S)
        idle = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        never = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        assert await idle.call("step", [2], timeout_s=WAIT_S) == 2
        assert (await fault(hung.call("hang", [], timeout_s=0.5))).cause == "env_timeout"
        assert await idle.call("step", [2], timeout_s=WAIT_S) == 4
        await never.close(timeout_s=WAIT_S)  # detached: nothing to close, nothing replayed
        stats = pool.stats()
        assert (stats["timeouts"], stats["sessions_replayed"], stats["lost"], stats["sessions_open"]) == (1, 1, 0, 1)

    in_pool(test, workers=1)


def test_a_session_whose_replay_differs_is_lost():
    async def test(pool):
        culprit = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        clock = await pool.open(T + "Clock", {}, timeout_s=WAIT_S)
        await clock.call("step", [], timeout_s=WAIT_S)
        assert (await fault(culprit.call("abort", [], timeout_s=WAIT_S))).cause == "env_crash"
        lost = await fault(clock.call("step", [], timeout_s=WAIT_S))
        assert lost.cause == "env_lost" and "during another session's call" in lost.detail
        assert "replaying its calls on another worker failed: its call 1 of 1 (step) returned" in lost.detail
        assert (await fault(clock.call("step", [], timeout_s=WAIT_S))).cause == "env_lost"
        await clock.close(timeout_s=WAIT_S)  # its rebuilt object was closed in the new worker already
        stats = pool.stats()
        assert (stats["replay_mismatch"], stats["sessions_replayed"], stats["lost"]) == (1, 0, 1)
        assert stats["sessions_open"] == 0

    in_pool(test, workers=1)


def test_a_session_past_the_replay_cap_is_lost_and_one_at_it_is_replayed():
    cap = sessions.REPLAY_CALLS

    async def test(pool):
        culprit = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        at_cap = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        past_cap = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        for _ in range(cap):
            await at_cap.call("step", [1], timeout_s=WAIT_S)
            await past_cap.call("step", [1], timeout_s=WAIT_S)
        await past_cap.call("step", [1], timeout_s=WAIT_S)
        assert (await fault(culprit.call("abort", [], timeout_s=WAIT_S))).cause == "env_crash"
        assert await at_cap.call("step", [1], timeout_s=WAIT_S) == cap + 1  # replayed: cap calls
        lost = await fault(past_cap.call("step", [1], timeout_s=WAIT_S))
        assert lost.cause == "env_lost" and f"not replayed: its record passed {cap} calls" in lost.detail
        stats = pool.stats()
        assert (stats["sessions_replayed"], stats["lost"]) == (1, 1)

    in_pool(test, workers=1)


def test_a_session_whose_call_raised_is_not_replayed():
    async def test(pool):
        culprit = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        broken = await pool.open(T + "Tally", {}, timeout_s=WAIT_S)
        assert (await fault(broken.call("step", ["x"], timeout_s=WAIT_S))).cause == "env_error"  # int + str
        assert (await fault(culprit.call("abort", [], timeout_s=WAIT_S))).cause == "env_crash"
        lost = await fault(broken.call("step", [1], timeout_s=WAIT_S))
        assert lost.cause == "env_lost" and "not replayed: its step call raised" in lost.detail

    in_pool(test, workers=1)


# ----- naming targets, closing ---------------------------------------------------------------------


def test_target_of_names_only_what_a_fresh_interpreter_can_import():
    def closure():
        pass

    in_main = functools.partial(pool_targets.add)
    main_function = type(closure)(closure.__code__, {})  # a plain function...
    main_function.__module__, main_function.__qualname__ = "__main__", "f"  # ...from a script
    assert target_of(pool_targets.add) == "pool_targets:add"
    assert target_of(pool_targets.Counter) == "pool_targets:Counter"
    for unnamed in (lambda: 0, closure, in_main, main_function, len, dict, pool_targets.Counter().step):
        assert target_of(unnamed) is None


def test_aclose_kills_every_worker():
    threads, before = set(threading.enumerate()), frozenset(children())

    async def test(pool):
        sessions = [await pool.open(T + "Counter", {}, timeout_s=WAIT_S) for _ in range(2)]
        pids = {(await s.call("step", [0], timeout_s=WAIT_S))[1] for s in sessions}
        in_flight = asyncio.ensure_future(pool.call(T + "hang", [], {}, timeout_s=WAIT_S, kind="tool"))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await pool.aclose()
        assert time.monotonic() - started < WAIT_S  # the hung call did not hold it
        assert len(pids) == 2 and all(gone(pid) for pid in pids)
        assert (await fault(in_flight)).cause == "tool_lost"
        assert (await fault(sessions[0].call("step", [1], timeout_s=WAIT_S))).cause == "env_lost"
        assert (await fault(pool.call(T + "pid", [], {}, timeout_s=WAIT_S, kind="tool"))).cause == "tool_lost"
        await pool.aclose()  # idempotent

    in_pool(test, workers=2)
    assert children(before) == {}
    # asyncio's child watcher threads end with their child, but a moment after handing its exit to the loop
    # (the exit is what aclose awaited): wait for that moment instead of racing it
    for thread in set(threading.enumerate()) - threads:
        if thread.name.startswith("asyncio-waitpid-"):
            thread.join(WAIT_S)
    assert set(threading.enumerate()) <= threads  # none left behind


def test_worker_fault_is_an_episode_failure():
    fault_ = WorkerFault("env", "lost", "why")
    assert isinstance(fault_, EpisodeFailure) and (fault_.cause, fault_.what, fault_.detail) == (
        "env_lost",
        "lost",
        "why",
    )
