"""Every Redis key of a run, in one table: the buffer (``buffers/redis_buffer.py``), run control
(``asyncrl/control.py``) and ``asyncrl status`` all name keys through :class:`RunKeys`.

A run's keys share the prefix ``P = asyncrl:{<run-id>}:`` (run id = run name + a random suffix, in
``runs/<name>/run.json``); the ``{...}`` hash tag puts them in one Redis Cluster slot, which multi-key
Lua scripts need.

==================  ====================  ==========================================================
key                 type                  contents
==================  ====================  ==========================================================
``P traj``          stream                one entry per group: ``gid``, ``producer``, ``frame`` (msgpack);
                                          consumer group ``learners``, one consumer ``rank<r>`` per rank
``P dead``          stream                ``reason``, ``producer``, ``size``, ``frame`` (first 1 MiB);
                                          about ``DEAD_MAX_ENTRIES`` kept
``P counters``      hash                  the counters of ``buffers.base.COUNTER_KEYS``
``P seen``          zset                  the newest ``SEEN_WINDOW`` group ids pushed, by push order (dedup)
``P unacked``       hash                  group id -> 1 (pushed) or the id of the entry that claimed it
                                          when first delivered, until acknowledged: what tells a pushed
                                          entry from a foreign one
``P once:<token>``  string, expires       the answer of an admission or release, or the mark of a
                                          staleness count, for their retries
``P version``       string                the learner's policy version (absent: 0)
``P meta``          hash                  ``weights_address``, ``final_version``, ...: written once;
                                          ``tied`` (the model's tied names, JSON), ``probe:<v>`` (the
                                          learner's probe log-probs of version v, JSON, with a sampled
                                          sequence's ids and its log-probs before the step; eight kept),
                                          ``probe_diff:<v>`` (the largest probe difference a generator
                                          found at version v), ``probe_broken:<v>`` (1 - the version
                                          fraction of an engine found broken at v; both eight kept);
                                          ``starting:<role>-<id>``
                                          (what a starting process waits for and since when, JSON;
                                          removed once it is up)
``P hb:<role>:<id>``hash, expires         heartbeat of one process: version served, pid, time
``P seen:<role>``   hash                  every process ever seen: id -> its last heartbeat (JSON)
``P staleness``     hash                  staleness of trained groups: steps behind -> groups
``P claim:<name>``  string                once-only claims (SET NX), e.g. who evaluates version v
``P held``          hash                  producer -> groups admitted for it that it has not pushed or
                                          released (moved with the admission, push or release)
``P admissions``    stream                one entry per admitted group: ``seq``, ``live`` (groups holding
                                          a slot after it), ``limit``; about the newest 200k kept
``P journals``      hash                  group seq -> the generator whose episodes it journals ('' for an
                                          orphan: its generator died, another will resume it)
``P journal:<seq>`` hash                  a group's journal: episode index -> its state after its last
                                          completed turn (JSON, ``asyncrl.generators.journal``)
``P orphans``       list                  seqs of orphaned groups, oldest first (``Buffer.take_orphan``)
``P members:<role>``zset                  live processes of ``role``: id -> when its lease expires
                                          (Redis server time); the fleet is what has not expired
``P leases:<role>`` hash                  id -> the token of the process holding that id's lease
``P ids:<role>``    string                counter that names processes joining a running job
``P metrics``       stream                JSON metric records from every process; the launcher reads
                                          and trims it
``P stop``          string                set by the launcher; every child loop exits when it sees it
==================  ====================  ==========================================================
"""

from __future__ import annotations

# Keys whose presence marks a run on a server (``asyncrl status`` finds runs by them).
# Metadata fields (``P meta``) a joining process reads.
CONFIG_FIELD = "config"  # the resolved config, YAML (secrets redacted)
REDIS_FIELD = "redis_address"  # host:port, as other hosts reach it
MASTER_FIELD = "learner_master"  # host:port of the learners' rendezvous, when ranks join from other hosts
LAST_EVAL_FIELD = "last_eval"  # the newest evaluation's metrics record, JSON (``asyncrl status`` shows it)
LENGTH_BIAS_FIELD = "length_bias"  # the launcher's summary of lengths generated, trained, dropped (JSON; status)

RUN_MARKERS = ("version", "counters", "traj")


def starting_field(role: str, ident: int | str) -> str:
    """The metadata field that says what a starting process waits for (``asyncrl.learners.trainer.start_phase``)."""
    return f"starting:{role}-{ident}"


def run_prefix(run_id: str) -> str:
    """``asyncrl:{<run_id>}:``: the ``{...}`` hash tag keeps a run's keys in one Redis Cluster slot."""
    return f"asyncrl:{{{run_id}}}:"


class RunKeys:
    """The full key names of the run under ``prefix`` (see the table above)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix if prefix.endswith(":") else prefix + ":"
        self.traj = self.prefix + "traj"
        self.dead = self.prefix + "dead"
        self.counters = self.prefix + "counters"
        self.seen = self.prefix + "seen"
        self.unacked = self.prefix + "unacked"
        self.version = self.prefix + "version"
        self.meta = self.prefix + "meta"
        self.staleness = self.prefix + "staleness"
        self.held = self.prefix + "held"
        self.metrics = self.prefix + "metrics"
        self.stop = self.prefix + "stop"
        self.admissions = self.prefix + "admissions"
        self.journals = self.prefix + "journals"
        self.orphans = self.prefix + "orphans"

    def journal(self, seq: int | str) -> str:
        return f"{self.prefix}journal:{seq}"

    def once(self, token: str) -> str:
        return f"{self.prefix}once:{token}"

    def heartbeat(self, role: str, ident: str) -> str:
        return f"{self.prefix}hb:{role}:{ident}"

    def seen_processes(self, role: str) -> str:
        return f"{self.prefix}seen:{role}"

    def members(self, role: str) -> str:
        return f"{self.prefix}members:{role}"

    def leases(self, role: str) -> str:
        return f"{self.prefix}leases:{role}"

    def ids(self, role: str) -> str:
        return f"{self.prefix}ids:{role}"

    def claim(self, name: str) -> str:
        return f"{self.prefix}claim:{name}"

    def markers(self) -> list[str]:
        return [self.prefix + name for name in RUN_MARKERS]
