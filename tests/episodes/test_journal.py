"""Episodes that outlive their generator (``asyncrl.generators.journal``), against a real ``asyncrl env-serve``:
an episode journaled turn by turn and cut off (its generator "died") goes on in a new context from its last
completed turn, in the same session; every step the server really ran is in its log exactly once.

The scripted model and the counting environment are deterministic, so a resumed episode's record must be
exactly the uninterrupted one's.
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import pytest
from test_env_serve import PLAIN, start_env_serve, steps_logged
from test_episodes import EOS, TOK, make_ctx, scripted

from asyncrl.buffers import MemoryBuffer
from asyncrl.buffers.base import CLAIM_PART
from asyncrl.episodes.api import Outcome, env_episode, run_episode
from asyncrl.episodes.remote_env import RemoteEnv
from asyncrl.generators.journal import GroupJournal

TURNS = 4
ACTIONS = [f"a{i}" for i in range(1, TURNS + 1)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = start_env_serve(tmp_path_factory.mktemp("env-serve-journal"), PLAIN, "--workers", "1")
    yield s
    s.stop()


def episode_of(server, log: Path):
    make_env = functools.partial(RemoteEnv, server.token_url, options={"log": str(log), "turns": TURNS})
    return env_episode(make_env, max_turns=TURNS)


def journaled_ctx(complete, kept: list, resumed: dict | None = None):
    ctx = make_ctx(complete)
    ctx.keep = lambda state: kept.append(json.loads(json.dumps(state)))  # as it crosses Redis
    ctx.resumed = resumed
    return ctx


def stalling(*texts: str):
    """A model that answers ``texts`` and then never again (its generator is about to die)."""
    answered = scripted(*texts)

    async def complete(ids, max_new):
        if len(answered.seen) == len(texts):
            await asyncio.Event().wait()
        return await answered(ids, max_new)

    return complete


def run_until_stalled(episode, ctx, turns: int) -> None:
    """Play ``episode`` until its model stalls on turn ``turns + 1``, then cut it off as a dying generator's
    shutdown does (its sessions handed over, not closed)."""

    async def go():
        task = asyncio.ensure_future(run_episode(episode, ctx, 60))
        while ctx.turns < turns or not ctx.mask or ctx.mask[-1] != 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the episode is now waiting for its next model turn
        ctx.hand_over = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


def uninterrupted(server, tmp_path: Path) -> tuple:
    ctx = make_ctx(scripted(*ACTIONS))
    out = asyncio.run(run_episode(episode_of(server, tmp_path / "whole.log"), ctx, 60))
    return ctx, out


def test_a_cut_off_episode_goes_on_from_its_last_turn_in_the_same_session(server, tmp_path: Path):
    whole, whole_out = uninterrupted(server, tmp_path)
    log = tmp_path / "steps.log"
    kept: list[dict] = []
    run_until_stalled(episode_of(server, log), journaled_ctx(stalling("a1", "a2"), kept), turns=2)
    assert steps_logged(log) == ["step ? 1 a1", "step ? 2 a2"], "cut off before its third turn"
    state = kept[-1]
    assert state["action"] is None and state["ctx"]["turns"] == 2 and state["env"]["session"]

    resumed_kept: list[dict] = []
    ctx = journaled_ctx(scripted("a3", "a4"), resumed_kept, resumed=state)
    out = asyncio.run(run_episode(episode_of(server, log), ctx, 60))
    assert out.status == "ok" and out.parts == whole_out.parts == {"reward": float(TURNS)}
    assert steps_logged(log) == [f"step ? {i} a{i}" for i in range(1, TURNS + 1)] + ["close ?"], "each step once"
    for field in ("tokens", "mask", "logprobs", "versions", "turns", "turn_rewards"):
        assert getattr(ctx, field) == getattr(whole, field), field
    assert resumed_kept[-1]["ctx"]["turns"] == TURNS


def test_an_action_sent_before_the_death_is_sent_again_under_its_id_and_stepped_once(server, tmp_path: Path):
    log = tmp_path / "steps.log"
    kept: list[dict] = []
    run_until_stalled(episode_of(server, log), journaled_ctx(stalling("a1"), kept), turns=1)
    # the dying generator sampled its second turn, journaled it, and sent it: no answer reached it
    ctx = make_ctx(scripted("a2"))
    pending = {**kept[-1], "ctx": {**kept[-1]["ctx"]}}
    ctx.restore(pending["ctx"])
    turn = TOK.encode("a2") + [EOS]
    pending["ctx"].update(tokens=ctx.tokens + turn, mask=ctx.mask + [1] * len(turn), turns=2,
                          logprobs=ctx.logprobs + [-0.5] * len(turn), versions=ctx.versions + [7] * len(turn),
                          _last_turn=turn)  # fmt: skip
    pending["action"] = "a2"
    sent = RemoteEnv(server.token_url)
    sent.resume(pending["env"])
    asyncio.run(sent.step("a2"))
    repeats = server.health()["repeats"]

    ctx = journaled_ctx(scripted("a3", "a4"), [], resumed=pending)
    out = asyncio.run(run_episode(episode_of(server, log), ctx, 60))
    assert out.status == "ok" and out.parts == {"reward": float(TURNS)}
    assert steps_logged(log) == [f"step ? {i} a{i}" for i in range(1, TURNS + 1)] + ["close ?"]
    assert server.health()["repeats"] == repeats + 1, "the second send was answered from the server's cache"


def test_a_resumed_episode_whose_session_is_gone_starts_again_in_a_new_one(server, tmp_path: Path):
    log = tmp_path / "steps.log"
    kept: list[dict] = []
    run_until_stalled(episode_of(server, log), journaled_ctx(stalling("a1", "a2"), kept), turns=2)
    gone = RemoteEnv(server.token_url)
    gone.resume(kept[-1]["env"])
    asyncio.run(gone.close())  # its lease expired, or the server restarted

    # its third turn is sampled before the first step finds the session gone: then all four again
    ctx = journaled_ctx(scripted("a3", *ACTIONS), [], resumed=kept[-1])
    out = asyncio.run(run_episode(episode_of(server, log), ctx, 60))
    assert out.status == "ok" and ctx.turns == TURNS, out
    whole, _ = uninterrupted(server, tmp_path)
    assert ctx.tokens == whole.tokens, "a fresh record, played from the start"
    assert steps_logged(log)[3:] == [f"step ? {i} a{i}" for i in range(1, TURNS + 1)] + ["close ?"]


def test_a_group_journal_replays_finished_episodes_and_resumes_the_rest():
    """The generator's side: finished episodes keep their outcome and record; a new producer taking the
    orphan gets them back without playing them; an episode without a state starts afresh."""
    buf = MemoryBuffer()
    seq = buf.try_start_group(0, 1, 1, producer="g0")
    journal = GroupJournal(buf, seq, "g0")
    done, running, fresh = (make_ctx(scripted()) for _ in range(3))
    assert journal.attach(0, done) is None and journal.attach(1, running) is None and journal.attach(2, fresh) is None
    done.tokens, done.mask, done.turns = [5, 6], [1, 1], 1
    running.keep({"ctx": running.snapshot(), "parts": {}, "action": "x", "env": {"session": "s", "step_id": "i"}})
    journal.finished(0, done, Outcome({"reward": 1.0}))
    assert buf.release_held("g0", resume=True) == 0
    taken_seq, saved = buf.take_orphan("g1")
    assert taken_seq == seq and sorted(saved) == [CLAIM_PART, "0", "1"]  # the claim, journaled by the admission

    again = GroupJournal(buf, seq, "g1", saved)
    replayed = make_ctx(scripted())
    assert again.attach(0, replayed) == Outcome({"reward": 1.0}) and replayed.tokens == [5, 6]
    resumed, new = make_ctx(scripted()), make_ctx(scripted())
    assert again.attach(1, resumed) is None and resumed.resumed["action"] == "x"
    assert again.attach(2, new) is None and new.resumed is None
    assert again.resumed_turns == 1
