"""Episodes that outlive their generator: a group's journal in the buffer.

A group whose episodes play an environment that lives outside the generator and can be taken up
elsewhere (an ``asyncrl env-serve`` session: ``RemoteEnv.journal`` / ``resume``) keeps a journal in the
buffer (``Buffer.journal``): each episode's state after its reset, after each model turn (with the
action not yet answered) and after each step (``asyncrl.episodes.api.env_episode``), and each finished
episode's outcome. When its generator dies, the launcher makes the group an orphan
(``Buffer.release_held(resume=True)``) instead of giving its slot back; the next generator with room
takes it first (``Buffer.take_orphan``) and plays it on from the journal:

* a finished episode is not played again: its record and outcome come from the journal;
* an unfinished one goes on from its last completed turn, in the same environment session; an action
  that was sent but not answered is sent again under the same request id, so the environment steps
  once (the server answers it from its cache); a model turn that was being sampled is sampled again;
* one without a state (not reset yet), or whose session is gone, starts from the beginning.

Tokens, behaviour log-probs and versions are kept as sampled: a resumed episode's later turns carry
the versions that sample them, as a turn continued across a weight update does, and the group's
version is its oldest model token's. Episodes whose environment lived in the dead process (plain or
``async`` code in the generator, its worker pool) and single-turn groups keep no state, but every group's
claim is journaled by its admission, in the same atomic step (``Buffer.try_start_group`` with a producer;
:meth:`GroupJournal.claim` checks it is still this generator's when the group starts): such a group is an
orphan too and is played again from the beginning, on the same prompt, so a dead generator or a ``kill -9``
and ``--resume`` at any instant skips no prompt of the run's order (:mod:`asyncrl.data.sources`). A journal
ends with its group's push or release, in the same atomic step.

Cost: one small Redis write per group (its claim), and per turn and episode of a journaled environment (the
record so far, JSON: about 30 bytes a token).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from asyncrl.buffers.base import CLAIM_PART
from asyncrl.episodes.api import Outcome

if TYPE_CHECKING:
    from asyncrl.buffers import Buffer
    from asyncrl.episodes.api import Context

log = logging.getLogger("asyncrl.generator")
CLAIM = int(CLAIM_PART)  # the journal part that holds a group's claim (episodes are parts 0..n-1)


class GroupJournal:
    """The journal of group ``seq``, held by ``producer``; ``saved``: what a taken orphan's held."""

    def __init__(self, buffer: Buffer, seq: int, producer: str, saved: dict[str, bytes] | None = None):
        self.buffer, self.seq, self.producer = buffer, seq, producer
        self.saved = {int(part): json.loads(state) for part, state in (saved or {}).items()}
        self.kept = False  # anything journaled by this generator: then outcomes are journaled too
        self.claimed = False  # the claim is journaled: the push or release must end the journal
        self.lost = False  # another generator took the group: this one must neither push nor release it
        self.contexts: dict[int, Context] = {}
        self.resumed_turns = 0  # model turns taken from the journal instead of being played again

    def claim(self) -> None:
        """The group's claim (a fresh group's only), journaled by its admission: still this generator's (else
        ``lost``: it stalled past its lease and another took the group), and kept again."""
        if not self.saved and not self.lost:
            self.claimed = self.buffer.journal(self.seq, str(CLAIM), b"{}", self.producer)
            self.lost = not self.claimed

    def attach(self, index: int, ctx: Context) -> Outcome | None:
        """Make episode ``index`` journal into this group; the outcome of an episode the journal says
        has finished (its record restored into ``ctx``), else None (it runs, from its state if any)."""
        state = self.saved.get(index)
        if state is not None and "outcome" in state:
            ctx.restore(state["ctx"])
            self.resumed_turns += ctx.turns
            o = state["outcome"]
            return Outcome(o["parts"], o["cause"], o["detail"])
        if state is not None:
            ctx.resumed = state
            self.resumed_turns += state["ctx"]["turns"]
        ctx.keep = lambda kept: self._write(index, kept)
        self.contexts[index] = ctx
        return None

    def finished(self, index: int, ctx: Context, outcome: Outcome) -> None:
        """Episode ``index`` ended: keep its outcome, so a group resumed later does not play it again."""
        self.contexts.pop(index, None)
        if self.kept or self.saved:
            outcome_fields = {"parts": outcome.parts, "cause": outcome.cause, "detail": outcome.detail}
            self._write(index, {"ctx": ctx.snapshot(), "outcome": outcome_fields})

    def hand_over(self) -> None:
        """This generator leaves while the run goes on: the episodes' sessions stay open for the next."""
        for ctx in self.contexts.values():
            ctx.hand_over = True

    def _write(self, index: int, state: dict) -> None:
        if self.lost:
            return
        self.kept = True
        if not self.buffer.journal(self.seq, str(index), json.dumps(state).encode(), self.producer):
            self.lost = True
            log.warning("group %d was taken over by another generator (this one stalled): leaving it", self.seq)
