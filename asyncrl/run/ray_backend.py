"""``asyncrl launch --backend ray``: the run's learners and generators as actors of a running Ray cluster.

The launcher is the Ray driver and runs on the head node; it starts the run's redis-server there as
the local launcher does, and trajectories and weights still travel through Redis and the weight bus,
never through Ray objects. Each actor runs the very command line the local launcher runs (``python -m
asyncrl.learners.trainer`` / ``asyncrl.generators.worker``) as a subprocess and waits for it; Ray
only places, restarts and ends the processes. What the actors need (the Redis URL, the run's prefix
and secret) reaches them as constructor arguments and then the subprocess environment, never a
command line.

Placement: learner ranks in one placement group, one bundle per rank (PACK); the rendezvous is the
node of rank 0 (loopback when every rank landed on one node, as ``Launcher.spawn`` does). Generators
ask for one unit of the cluster's ``generator`` resource when it has one, else a CPU.

Supervision keeps the launcher's rules (``asyncrl.run.launch``), read through :class:`ActorProcess`:
- a generator subprocess that exits nonzero (an engine failure) ends its actor (``os._exit``), so Ray
  replaces the process rather than reuse a dead engine; the launcher sees the actor's end as the
  generator's, gives back its in-flight admission slots, and only then starts the next subprocess in
  the replaced actor (so no live generator's slots are ever given away);
- a dead learner rank replaces every actor (``ray.kill`` with restart) and restarts every rank from the
  last committed checkpoint, on a new rendezvous port;
- stopping waits ``STOP_GRACE_S`` for the processes to leave on the run's stop key, then kills every
  actor without restart and removes the placement group. An actor's subprocess gets SIGKILL from the
  kernel when the actor's process dies (``PR_SET_PDEATHSIG``), so no subprocess outlives its actor;
- the actors are not detached: Ray ends them with their driver, so even ``kill -9`` of the launcher
  leaves no actor, placement group or subprocess behind (and redis-server dies with it, as locally).

Every node needs this checkout and its environment at the same path, and the run directory (config,
logs, checkpoints) on storage all of them see at the same path, or a single node.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from asyncrl.config import Config
from asyncrl.errors import UserError
from asyncrl.fleet.rendezvous import engine_env
from asyncrl.lifetime import die_with, lower_priority
from asyncrl.run.gpus import GpuPlan
from asyncrl.run.launch import STOP_GRACE_S, Child, Launcher
from asyncrl.run.resume import ResumePoint

PLACE_TIMEOUT_S = 300.0  # an actor (or the learners' placement group) waits this long for the cluster's room
ACTOR_LOST = -1  # an ActorProcess's returncode when its actor died and the log names no exit code
EXIT_MARK = "asyncrl.ray: exit code "  # the line an actor writes to the log before it ends for a restart
NAMESPACE = "asyncrl"  # the actors' Ray namespace; each is named <run id>/<learner-0 | generator-0 | ...>
LEARNER = "learner"
GENERATOR = "generator"


# -- the actor ---------------------------------------------------------------------------------------
class ProcessActor:
    """One worker process of the run, as a Ray actor (``ray.remote`` is applied at launch: importing this
    module needs no Ray). Methods run on the actor's main thread, one at a time, in the order one caller
    submitted them: ``start`` forks there, so the kernel's death signal follows the actor's life."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.env = env  # the run's environment (Redis URL, prefix, secret): constructor args, not argv
        self.instance = uuid.uuid4().hex  # a new one each time Ray (re)starts this actor
        self.proc: subprocess.Popen | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def identity(self) -> str:
        return self.instance

    def start(self, cmd: list[str], env: dict[str, str], log_path: str, cwd: str, nice: int) -> dict:
        """Run ``cmd`` (its interpreter replaced by this node's) with the run's environment and ``env``."""
        if self.proc is not None and self.proc.poll() is None:  # one subprocess per actor, always
            self.proc.kill()
            self.proc.wait()
        death = die_with(os.getpid(), signal.SIGKILL)

        def preexec() -> None:
            death()
            lower_priority(nice)  # in its own session, so its autogroup too

        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *cmd[1:]],
                env={**os.environ, **self.env, **env},
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=preexec,
            )
        return {"pid": self.proc.pid, "node_ip": self.node_ip(), "instance": self.instance}

    def wait(self, end_on_failure: bool) -> int:
        """The subprocess's exit code; with ``end_on_failure`` a nonzero one ends this actor instead, a
        failure Ray answers with a new actor process (the code goes to the log first)."""
        code = self.proc.wait()
        if code != 0 and end_on_failure:
            with open(self.log_path, "a") as log:
                log.write(f"{EXIT_MARK}{code}; ending the actor so Ray replaces it\n")
            os._exit(1)
        return code


# -- placement, pure -----------------------------------------------------------------------------------
def generator_options(cluster: dict[str, float]) -> dict:
    """Ray options of a generator actor: one unit of the cluster's ``generator`` resource where it has
    one (nodes set aside for sampling; the unit is the slot, so no CPU is asked besides), else a CPU;
    and a GPU on a cluster with GPUs."""
    gpu = {"num_gpus": 1} if cluster.get("GPU", 0) >= 1 else {}  # else Ray hides every GPU from the actor
    if cluster.get(GENERATOR, 0) >= 1:
        return {"resources": {GENERATOR: 1}, "num_cpus": 0, **gpu}
    return {"num_cpus": 1, **gpu}


def learner_bundle(cluster: dict[str, float]) -> dict[str, float]:
    """One learner rank's bundle of the placement group."""
    return {"CPU": 1, **({"GPU": 1} if cluster.get("GPU", 0) >= 1 else {})}


def run_needs(learners: int, generators: int, cluster: dict[str, float]) -> dict[str, float]:
    """What the run's actors ask of the cluster in all: a bundle per learner rank, a generator's
    options per generator (:func:`learner_bundle`, :func:`generator_options`)."""
    need: dict[str, float] = {}
    gen = generator_options(cluster)
    per_generator = {"CPU": gen.get("num_cpus", 0), "GPU": gen.get("num_gpus", 0), **gen.get("resources", {})}
    for count, each in ((learners, learner_bundle(cluster)), (generators, per_generator)):
        for name, amount in each.items():
            need[name] = need.get(name, 0) + count * amount
    return {name: amount for name, amount in need.items() if amount}


def shortfall(need: dict[str, float], free: dict[str, float], total: dict[str, float]) -> str | None:
    """What the cluster lacks for ``need`` (one phrase per resource: needed, free, in all), or None.
    Checked before anything is placed: Ray would otherwise queue what does not fit and wait in silence."""
    short = [
        f"{need[k]:g} {k} (free {free.get(k, 0):g} of {total.get(k, 0):g})"
        for k in sorted(need)
        if need[k] > free.get(k, 0) + 1e-9  # Ray reports fractional resources as floats
    ]
    return ", ".join(short) or None


def rendezvous_env(node_ips: list[str], port: int) -> list[dict[str, str]]:
    """Each rank's torch.distributed environment, ranks on ``node_ips`` (rank 0 first): on one node the
    store and gloo stay on loopback, as for a local run; across nodes the store listens on rank 0's node
    address (and gloo uses the nodes' own ``GLOO_SOCKET_IFNAME``, if any)."""
    one_node = len(set(node_ips)) == 1
    out = []
    for rank, ip in enumerate(node_ips):
        peers = [r for r, other in enumerate(node_ips) if other == ip]
        env = {
            "MASTER_ADDR": "127.0.0.1" if one_node else node_ips[0],
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(peers.index(rank)),
            "WORLD_SIZE": str(len(node_ips)),
            "LOCAL_WORLD_SIZE": str(len(peers)),
        }
        if one_node:
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        out.append(env)
    return out


def exit_code_in_log(path: Path, lines: int = 50) -> int:
    """The exit code an actor wrote to ``path`` before it ended itself (:data:`EXIT_MARK`), else
    :data:`ACTOR_LOST` (the actor was killed, or its node lost)."""
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ACTOR_LOST
    for line in reversed(tail):
        if line.startswith(EXIT_MARK):
            code = line[len(EXIT_MARK) :].split(";")[0]
            return int(code) if code.lstrip("-").isdigit() else ACTOR_LOST
    return ACTOR_LOST


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail at once, not after Ray's minute of reconnects, when nothing listens at a HOST:PORT address."""
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return  # Ray resolves these itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UserError(f"no Ray cluster answers at {address} ({exc}); start one with `ray start --head`") from None


# -- the launcher's view of an actor ------------------------------------------------------------------
def call(method, *args, what: str, timeout_s: float = PLACE_TIMEOUT_S):
    """``method.remote(*args)``'s result; submitted again while Ray restarts the actor (the call may
    not have run), within ``timeout_s`` in all, after which the actor is taken as unplaceable."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(method.remote(*args), timeout=max(deadline - time.monotonic(), 1.0))
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise UserError(f"{what}: its Ray actor stayed unavailable for {timeout_s:.0f}s") from None
            time.sleep(0.2)
        except GetTimeoutError:
            raise UserError(
                f"Ray could not place or start {what} within {timeout_s:.0f}s: the cluster has "
                f"{ray.available_resources()} free"
            ) from None
        except RayActorError as exc:  # died for good: past its max_restarts
            raise UserError(f"{what}: its Ray actor died and will not be restarted: {exc}") from None


class ActorProcess:
    """What the launcher's supervision reads of a ``Popen`` (``poll``, ``returncode``, ``pid``), for a
    subprocess that an actor runs and waits for. ``pid`` is on the actor's node."""

    def __init__(self, pid: int, done, log_path: Path) -> None:
        self.pid = pid
        self.done = done  # the ObjectRef of the actor's ``wait``
        self.log_path = log_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            import ray
            from ray.exceptions import RayActorError

            ready, _ = ray.wait([self.done], timeout=0)
            if ready:
                try:
                    self.returncode = ray.get(self.done)
                except RayActorError:  # the actor ended (itself, on a failure) or was lost
                    self.returncode = exit_code_in_log(self.log_path)
        return self.returncode


class RayChild(Child):
    """A :class:`~asyncrl.run.launch.Child` whose process an actor runs; ``env`` holds only what differs per
    process (the run's environment went to the actor's constructor)."""

    actor = None
    cwd = ""
    node_ip = ""
    instance = ""

    def start(self) -> None:
        cmd = [*self.cmd, "--incarnation", str(self.incarnation)] if self.role == GENERATOR else self.cmd
        args = (cmd, self.env, str(self.log_path), self.cwd, self.nice)
        info = call(self.actor.start, *args, what=self.name)
        self.node_ip, self.instance = info["node_ip"], info["instance"]
        done = self.actor.wait.remote(self.role == GENERATOR)
        self.proc = ActorProcess(info["pid"], done, self.log_path)

    def replace(self) -> None:
        """End this actor's process (its subprocess with it) and wait for the one Ray starts instead."""
        import ray

        ray.kill(self.actor, no_restart=False)
        deadline = time.monotonic() + PLACE_TIMEOUT_S
        while call(self.actor.identity, what=self.name) == self.instance:  # the kill has not landed yet
            if time.monotonic() > deadline:
                raise UserError(f"{self.name}: Ray did not restart its actor within {PLACE_TIMEOUT_S:.0f}s")
            time.sleep(0.2)


# -- the launcher -------------------------------------------------------------------------------------
class RayLauncher(Launcher):
    """The local launcher's run, supervision and summary, with processes placed by Ray (module doc)."""

    forks_children = False  # they are Ray's actors

    def __init__(self, cfg: Config, address: str = "auto", console=None, resume: ResumePoint | None = None) -> None:
        super().__init__(cfg, console=console, resume=resume)
        self.address = address
        self.group = None  # the learners' placement group
        self.terminated = False  # SIGTERM came: the run exits 143, not Ctrl-C's 130

    def place_gpus(self) -> GpuPlan:
        return GpuPlan([], [])  # each actor's own, by its num_gpus

    def connect(self) -> dict[str, float]:
        try:
            import ray
        except ImportError:
            raise UserError("--backend ray needs Ray: pip install -e '.[ray]'") from None
        check_reachable(self.address)
        started = time.monotonic()
        # ray.init puts its own SIGTERM handlers in place of the launcher's (Python's sys.exit, then the
        # core worker's, which prints a stack dump): the launcher's own come back, so SIGTERM is a clean stop
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise UserError(f"cannot join the Ray cluster at {self.address}: {exc}") from None
        finally:
            for sig, handler in handlers.items():
                if handler is not None:  # None: not set from Python; nothing of ours to put back
                    signal.signal(sig, self._noting_sigterm(handler) if sig == signal.SIGTERM else handler)
        cluster = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        shown = ", ".join(f"{k} {v:g}" for k, v in sorted(cluster.items()) if k in ("CPU", "GPU", GENERATOR))
        self.log(f"Ray cluster at {self.address}: {nodes} nodes ({shown}); joined in {time.monotonic() - started:.1f}s")
        return cluster

    def _noting_sigterm(self, handler):
        """``handler`` (the launcher's SIGTERM handler), noting first that SIGTERM came (exit 143)."""
        if not callable(handler):  # SIG_DFL or SIG_IGN: not the launcher's stop; left as it was
            return handler

        def on_sigterm(signum, frame):
            self.terminated = True
            handler(signum, frame)

        return on_sigterm

    def check_room(self, cluster: dict[str, float]) -> None:
        """One line naming what the cluster lacks for every learner rank and generator at once."""
        import ray

        cfg = self.cfg.run
        need = run_needs(cfg.learners, cfg.generators, cluster)
        short = shortfall(need, ray.available_resources(), cluster)
        if short:
            raise UserError(
                f"the Ray cluster at {self.address} has too little room for {cfg.learners} learner ranks and "
                f"{cfg.generators} generators: they need {short}; add nodes or CPUs (`ray start --num-cpus N`) "
                "or ask for fewer --learners / --generators"
            )

    def spawn(self, config_path: Path, url: str, prefix: str) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.cfg.run.remote_learners:
            raise UserError("--backend ray starts every learner rank as an actor: leave run.remote_learners at 0")
        cluster = self.connect()
        self.check_room(cluster)
        started = time.monotonic()
        cfg, logs, cwd = self.cfg, (self.run_dir / "logs").resolve(), os.getcwd()
        run_env = {k: v for k, v in self.child_env(url, prefix).items() if os.environ.get(k) != v}
        remote = ray.remote(ProcessActor)
        bundle = learner_bundle(cluster)
        self.group = placement_group([bundle] * cfg.run.learners, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACE_TIMEOUT_S)
        except GetTimeoutError:
            raise UserError(
                f"the Ray cluster found no room for {cfg.run.learners} learner bundles of {bundle} within "
                f"{PLACE_TIMEOUT_S:.0f}s (free: {ray.available_resources()})"
            ) from None
        config, run_id = str(config_path.resolve()), self.run_info["run_id"]
        for rank in range(cfg.run.learners):
            log_path = logs / f"learner-{rank}.log"
            cmd = ["python", "-m", "asyncrl.learners.trainer", "--config", config, "--log-file", str(log_path)]
            child = RayChild(LEARNER, rank, cmd, {}, log_path)
            child.actor = remote.options(
                name=f"{run_id}/{child.name}",
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=cfg.learner.max_restarts,  # each learner restart replaces every actor
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
            ).remote(child.name, run_env)
            self.children.append(child)
        options = generator_options(cluster)
        ncpu = os.cpu_count() or 1
        for i in range(cfg.run.generators):
            log_path = logs / f"generator-{i}.log"
            cmd = ["python", "-m", "asyncrl.generators.worker", "--config", config, "--id", str(i)]
            env = engine_env(core=i % ncpu)
            child = RayChild(GENERATOR, i, [*cmd, "--log-file", str(log_path)], env, log_path, nice=self.generator_nice)
            restarts = cfg.run.max_generator_restarts + cfg.learner.max_restarts
            named = remote.options(name=f"{run_id}/{child.name}", max_restarts=restarts, **options)
            child.actor = named.remote(child.name, run_env)
            self.children.append(child)
        for child in self.children:
            child.cwd = cwd
        self.rendezvous()
        for child in self.children:
            child.start()
        self.log(f"Ray: {len(self.children)} actors placed and started in {time.monotonic() - started:.1f}s")

    def rendezvous(self) -> None:
        """Rank 0's node, and a port free there, into every learner's environment."""
        learners = [c for c in self.children if c.role == LEARNER]
        ips = [call(c.actor.node_ip, what=c.name) for c in learners]
        host = "127.0.0.1" if len(set(ips)) == 1 else ips[0]
        port = call(learners[0].actor.free_port, host, what=learners[0].name)
        self.learner_master = f"{host}:{port}"
        for child, env in zip(learners, rendezvous_env(ips, port), strict=True):
            child.env = env

    # -- supervision: the local launcher's rules, with actors ---------------------------------------
    def end_for_restart(self) -> None:
        for c in self.children:
            c.replace()

    def new_rendezvous(self) -> None:
        self.rendezvous()

    def write_run_info(self) -> None:
        self.run_info["ray"] = {
            "address": self.address,
            "namespace": NAMESPACE,
            "nodes": {c.name: c.node_ip for c in self.children},
            "actors": {c.name: c.instance for c in self.children},
        }
        super().write_run_info()

    def end_children(self, grace_s: float) -> None:
        started = [c for c in self.children if c.proc is not None]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in started):
            time.sleep(0.1)
        self.end_actors()

    def end_actors(self) -> None:
        """Kill every actor for good (their subprocesses die with them) and remove the placement group."""
        if "ray" not in sys.modules:
            return
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        actors = [c.actor for c in self.children if c.actor is not None]
        for actor in actors:
            ray.kill(actor, no_restart=True)
        for actor in actors:  # gone once a call fails with the actor's death (the kill lands at once)
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.identity.remote(), timeout=STOP_GRACE_S)
                except (RayActorError, GetTimeoutError):
                    break
                time.sleep(0.1)
        for c in self.children:
            c.actor = None
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None

    def run(self) -> int:
        try:
            code = super().run()
        finally:
            self.end_actors()
            if "ray" in sys.modules:
                import ray

                ray.shutdown()
        return 143 if code == 130 and self.terminated else code  # 128 + SIGTERM, as a shell reports it
