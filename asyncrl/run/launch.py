"""The local launcher: one redis-server, L learner ranks and G generators as OS processes.

It owns the run directory and is the only writer of ``metrics.jsonl`` and ``summary.json``.
Supervision rules:
- a generator that dies is restarted (up to ``run.max_generator_restarts`` times in all);
- a learner rank that dies takes the others with it (they would hang in a collective): every
  rank restarts from the last committed checkpoint (up to ``learner.max_restarts`` times), and
  every generator restarts with it, so none serves weights the restart threw away; past the
  budget the run stops with an error naming the log;
- the run's own redis-server, if it dies, is restarted on the same port from its append-only
  file (up to ``run.max_redis_restarts`` times); clients reconnect by themselves;
- Ctrl-C (or SIGTERM) stops every child it started, by process group, flushes metrics and writes
  the summary, whatever signal dispositions the launcher inherited (a background job's ignored SIGINT);
- a full disk under the run directory stops the run with one error naming the path and the free space
  (``asyncrl.run.disk``); partial checkpoints are removed, and the summary is still written.
The exit code is 0 only when the run completed (with its final evaluation, if it has one); 130 after
Ctrl-C, 143 after SIGTERM; 2 after an error (a full disk included; ``asyncrl.cli``); 1 after a timeout.
Children run in their own sessions, so a terminal's Ctrl-C reaches only the launcher, which then
stops them in order: generators and learners first, redis-server last.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path

import redis

from asyncrl import lifetime
from asyncrl.buffers.base import BufferUnavailableError
from asyncrl.config import Config, dump_config
from asyncrl.control import RunControl, connect
from asyncrl.errors import UserError
from asyncrl.fleet.redis_server import free_loopback_port
from asyncrl.fleet.rendezvous import engine_env, publish_run, still_starting, wait_for_leaves, watch_fleet
from asyncrl.keys import MASTER_FIELD
from asyncrl.learners.checkpoint import read_committed, remove_uncommitted
from asyncrl.lifetime import Child, die_with, exit_soon, live_processes, signal_processes, stop_processes
from asyncrl.net import interface_of, is_loopback, url_address
from asyncrl.observe.metrics import DiskFull
from asyncrl.run.disk import Reserve, check_full_disk, run_error
from asyncrl.run.forkserver import ForkServer, fork_servers
from asyncrl.run.gpus import GpuPlan, has_driver, plan_gpus, visible_gpus
from asyncrl.run.preflight import check_prompt_lengths, external_redis_url, in_background, preflight
from asyncrl.run.resume import ResumePoint, reset_for_resume
from asyncrl.run.samples import SAMPLES_FILE
from asyncrl.run.stats import Progress, RunStats, final_buffer_stats
from asyncrl.rundir import write_atomic
from asyncrl.secret import ENV as SECRET_ENV
from asyncrl.secret import new_secret, read_secret, redis_password, write_secret

STOP_GRACE_S = 10.0  # children get this long to leave on their own before SIGTERM, then SIGKILL
OWN_REDIS_RETRIES = 1  # the launcher's clients of the redis-server it runs (see Launcher.run)
FINAL_EVAL_TIMEOUT_S = 180.0  # after the learners finish, how long the final evaluation may take


def core_plan(cores: list[int], learners: int, generators: int) -> tuple[list[int], list[int]]:
    """The core each local learner rank and each generator is pinned to under ``run.cpu_scheduling``: ranks on
    the first of ``cores`` (those the launcher may use), generators on the next ones, round the cores again
    when there are more processes than cores (2 cores, 2 + 2: learner r and generator r share core r)."""
    at = [cores[i % len(cores)] for i in range(learners + generators)]
    return at[:learners], at[learners:]


class Launcher:
    forks_children = True  # from fork servers (asyncrl.run.forkserver) where run.fork_generators/_learners allow

    def __init__(self, cfg: Config, redis_url: str | None = None, console=None, resume: ResumePoint | None = None):
        self.cfg = cfg
        self.resume = resume  # continue the run in cfg.run_dir (asyncrl.run.resume) instead of starting one
        self.redis_url = redis_url or external_redis_url(cfg)
        self.run_dir = cfg.run_dir
        self.console = console
        self.children: list[Child] = []
        self.restarts = 0
        self.learner_restarts = 0
        self.redis_restarts = 0
        self.redis = None
        self.run_info: dict = {}
        self.buffer = None
        self.chores: list = []  # waits for the start-up's background checks (preflight.in_background)
        self.stats: RunStats | None = None
        self.secret = ""
        self.learner_master = ""  # host:port of the learners' rendezvous
        self.fleet: set[str] = set()  # the live generators, as of the last look
        self.reserve = Reserve(self.run_dir)  # room for the end of a run on a full disk
        self.forks: dict[str, ForkServer] = {}  # role -> where its processes are forked from (asyncrl.run.forkserver)
        self.learners_started, self.learners_started_said = 0.0, False  # when ranks (re)started; check_learners_up

    # -- set-up ------------------------------------------------------------------------------------
    def prepare_run_dir(self) -> Path:
        """The run directory, private to this user (0700: it holds the weights, every trajectory in the
        AOF and the Redis URL), with the resolved config in it (secrets redacted)."""
        alive = live_processes(self.run_dir)
        if alive:
            listed = ", ".join(f"{name} (pid {pid})" for name, pid in alive.items())
            raise UserError(f"run directory {self.run_dir} belongs to a launch that still runs: {listed}")
        if self.resume is None and self.run_dir.exists() and not self.cfg.run.overwrite:
            raise UserError(
                f"run directory {self.run_dir} exists: continue it with --resume {self.run_dir}, or start "
                f"it over with --set run.overwrite=true, or pick another run.name"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.chmod(0o700)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if self.resume is None:
            for stale in ("metrics.jsonl", "summary.json", SAMPLES_FILE, SAMPLES_FILE + ".1"):
                (self.run_dir / stale).unlink(missing_ok=True)
            # a restarted learner must never resume an old run; and the metrics of the run this one starts over
            for stale in ("checkpoint", "export", "redis", "tensorboard", "wandb"):
                shutil.rmtree(self.run_dir / stale, ignore_errors=True)
        self.remove_uncommitted()  # a resumed run's: its learners start from the committed one
        self.reserve.take()
        return write_secret(self.run_dir / "config.yaml", dump_config(self.cfg, shown=False), newline=False)

    def take_secret(self) -> str:
        """The run's secret (``asyncrl.secret``): the resumed run's own, else ``$ASYNCRL_SECRET``, else a
        new one; kept in ``runs/<name>/secret`` (0600) for ``asyncrl generator --run`` and resumes."""
        path = self.run_dir / "secret"
        secret = read_secret(path) if self.resume is not None and path.exists() else None
        secret = secret or read_secret() or new_secret()
        write_secret(path, secret)
        return secret

    def start_redis(self) -> str:
        if self.redis_url:
            return self.redis_url
        from asyncrl.fleet.redis_server import start_redis_server

        workdir, password = (self.run_dir / "redis").resolve(), redis_password(self.secret)
        if self.resume is not None:  # the same data (the AOF) and password; a new port
            workdir, password = self.resume.redis_dir, self.resume.redis_password
        host = None if is_loopback(self.cfg.run.host) else self.cfg.run.host
        self.redis = start_redis_server(
            workdir, password=password, host=host, port=self.cfg.run.redis_port, preexec_fn=die_with(os.getpid())
        )
        return self.redis.url

    def child_env(self, url: str, prefix: str) -> dict[str, str]:
        env = lifetime.child_env(os.environ)
        env.update(ASYNCRL_REDIS_URL=url, ASYNCRL_PREFIX=prefix)
        env[SECRET_ENV] = self.secret  # the environment, never the command line: ps shows that
        return env

    def place_gpus(self) -> GpuPlan:
        return plan_gpus(self.cfg, visible_gpus())  # each local process's GPU (Ray's actors: Ray places them)

    @property
    def pin_cpus(self) -> bool:
        return self.cfg.run.cpu_scheduling and not has_driver()

    @property
    def generator_nice(self) -> int:
        return self.cfg.run.generator_nice if self.pin_cpus else 0

    def spawn(self, config_path: Path, url: str, prefix: str) -> None:
        cfg, logs = self.cfg, self.run_dir / "logs"
        base = self.child_env(url, prefix)
        learner_env = lifetime.learner_env(base, cfg.learner.jemalloc, self.log)
        master_port = str(free_loopback_port())
        local = cfg.run.learners - cfg.run.remote_learners
        affinity = getattr(os, "sched_getaffinity", None)  # Linux: the cores this launcher may use
        cores = sorted(affinity(0)) if affinity else list(range(os.cpu_count() or 1))
        learner_cores, generator_cores = core_plan(cores, local, cfg.run.generators)
        # the rendezvous store listens on this address only (learners.deepspeed_engine), gloo's pair sockets on
        # its interface: loopback, unless ranks on other hosts join (`asyncrl learner`)
        master, ifname = "127.0.0.1", base.get("GLOO_SOCKET_IFNAME", "lo")
        if cfg.run.remote_learners:
            master, ifname = cfg.run.host, interface_of(cfg.run.host)
        self.learner_master = f"{master}:{master_port}"
        for rank in range(local):
            env = dict(
                learner_env,
                MASTER_ADDR=master,
                MASTER_PORT=master_port,
                GLOO_SOCKET_IFNAME=ifname,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(cfg.run.learners),
                LOCAL_WORLD_SIZE=str(local),
            )
            log_path = logs / f"learner-{rank}.log"
            cmd = [sys.executable, "-m", "asyncrl.learners.trainer", "--config", str(config_path), "--log-file"]
            cmd.append(str(log_path))
            pin = {learner_cores[rank]} if self.pin_cpus else None
            self.children.append(Child("learner", rank, cmd, env, log_path, cpus=pin, forks=self.forks.get("learner")))
        for i in range(cfg.run.generators):
            core = generator_cores[i]
            env = dict(base, **engine_env(core=core), **self.gpus.generator_env(i))
            log_path = logs / f"generator-{i}.log"
            cmd = [sys.executable, "-m", "asyncrl.generators.worker", "--config", str(config_path), "--id", str(i)]
            cmd += ["--log-file", str(log_path)]
            # pinned once up, by itself (vLLM's binding, engine_env, pins no thread in-process): pinned from the
            # start, its start-up would wait for its core while the other is free (+0.6 s to the first step)
            pin = {core} if self.pin_cpus else None
            nice = self.generator_nice
            child = Child("generator", i, cmd, env, log_path, nice=nice, nice_when_up=i == 0, cpus_when_up=pin)
            child.forks = self.forks.get("generator")
            self.children.append(child)
        # all at once: the other generators' start-ups (niced) then come up in the CPU the learners' leave them,
        # by about the 18th of the demo's 40 steps; held back until the learners were ready (before 2026-12-04),
        # they came up by about the 26th for the same CPU-seconds and first step (docs/benchmarks.md)
        for child in self.children:
            child.start()

    # -- supervision -------------------------------------------------------------------------------
    def check_children(self, control: RunControl) -> str | None:
        """Restart what died (see the module doc); return an exit reason when the run must end."""
        self.check_redis()
        learners = [c for c in self.children if c.role == "learner"]
        dead = [c for c in learners if c.proc.poll() not in (None, 0)]
        if dead:
            # one rank's death fails the others' collectives (exit 1) within the same poll: name the
            # rank a signal killed, the cause, before those that exited because of it
            dead.sort(key=lambda c: c.proc.returncode >= 0)
            check_full_disk(self.run_dir, f"{dead[0].name} exited with code {dead[0].proc.returncode}")
            self.restart_learners(control, dead[0])
            return None
        if all(c.proc.poll() == 0 for c in learners):
            return "learners_done"
        self.check_learners_up(control)
        for c in self.children:
            if c.role == "generator" and c.proc is not None and c.proc.poll() is not None:
                check_full_disk(self.run_dir, f"{c.name} exited with code {c.proc.returncode}")
                self.restarts += 1
                if self.restarts > self.cfg.run.max_generator_restarts:
                    raise UserError(
                        f"{c.name} exited with code {c.proc.returncode} and the restart budget "
                        f"({self.cfg.run.max_generator_restarts}) is spent; see {c.log_path}:\n{c.log_tail()}"
                    )
                self.log(f"{c.name} exited with code {c.proc.returncode}; restarting ({self.restarts})")
                self.release_held(c)
                c.incarnation += 1
                c.start()
                self.write_run_info()
        return None

    def watch_fleet(self, control: RunControl) -> None:
        try:
            self.fleet = watch_fleet(control, self.buffer, self.fleet, self.log)
        except redis.RedisError:  # redis-server died since check_redis: the next poll restarts it
            return
        self.stats.fleet = len(self.fleet)

    def advertised_redis(self, url: str) -> str:
        """host:port where processes of other hosts reach the run's Redis (loopback unless run.host)."""
        if self.redis is None or is_loopback(self.cfg.run.host):
            return url_address(url)
        return f"{self.cfg.run.host}:{self.redis.port}"

    def release_held(self, c: Child) -> None:
        """A dead generator's admitted-but-unpushed groups would hold admission slots forever; those with
        a journal (``asyncrl.generators.journal``) are resumed by the next generator with room."""
        self.buffer.release_held(str(c.ident), resume=True)

    def check_learners_up(self, control: RunControl) -> None:
        """Once the learner ranks are ``learner.start_timeout_s`` late (no version published since they started),
        one line with what each local rank said it waits for (``asyncrl.learners.trainer.start_phase``)."""
        late = time.monotonic() - self.learners_started
        if self.learners_started_said or late < self.cfg.learner.start_timeout_s:
            return
        self.learners_started_said = True  # once, until a restart
        if control.get_meta("weights_address") is None:
            ranks = [(c.role, str(c.ident), str(c.log_path)) for c in self.children if c.role == "learner"]
            self.log(f"the learner ranks are not up {late:.0f} s after they started: {still_starting(control, ranks)}")

    def restart_learners(self, control: RunControl, failed: Child) -> None:
        code = failed.proc.returncode
        self.learner_restarts += 1
        if self.cfg.run.remote_learners:
            raise UserError(
                f"{failed.name} exited with code {code}; a run with learner ranks on other hosts is not restarted "
                f"(resume it with --resume {self.run_dir}); see {failed.log_path}:\n{failed.log_tail()}"
            )
        if self.learner_restarts > self.cfg.learner.max_restarts:
            raise UserError(f"{failed.name} exited with code {code}; see {failed.log_path}:\n{failed.log_tail()}")
        committed = read_committed(self.run_dir / "checkpoint")
        start = committed["version"] if committed is not None else 0
        self.log(
            f"{failed.name} exited with code {code}; restarting every learner rank from version {start} "
            f"and every generator ({self.learner_restarts}/{self.cfg.learner.max_restarts})"
        )
        self.end_for_restart()
        self.remove_uncommitted()
        self.remove_stale_weights()
        for c in self.children:
            if c.role == "generator":
                self.release_held(c)
                c.incarnation += 1
        control.forget_meta("weights_address")  # generators wait for the new publisher's
        self.new_rendezvous()
        for c in self.children:
            c.start()
        self.learners_started, self.learners_started_said = time.monotonic(), False
        self.write_run_info()

    # -- how processes end and meet: a backend's own (asyncrl.run.ray_backend overrides them) -----------
    def end_for_restart(self) -> None:
        """End every process of the run now (a learner restart starts them all again)."""
        stop_processes(self.children)

    def new_rendezvous(self) -> None:
        """A fresh rendezvous port for the restarted learner ranks."""
        port = str(free_loopback_port())
        for c in self.children:
            if c.role == "learner":
                c.env.update(MASTER_PORT=port)

    def end_children(self, grace_s: float) -> None:
        """Give the run's processes ``grace_s`` to leave on their own, then end them. Generators are told
        at once: their SIGTERM is the run's stop (the same clean leave), seen without waiting for their next
        tick, or for the end of a start-up that would serve nothing (its default action, before the handler)."""
        signal_processes([c for c in self.children if c.role == "generator"], signal.SIGTERM)
        stop_processes(self.children, grace_s=grace_s)

    def check_redis(self) -> None:
        if self.redis is None or self.redis.is_running():
            return
        check_full_disk(self.run_dir, "redis-server died")
        self.redis_restarts += 1
        if self.redis_restarts > self.cfg.run.max_redis_restarts:
            raise UserError(f"redis-server died {self.redis_restarts} times; its log:\n{self.redis.log_tail()}")
        self.log(f"redis-server died; restarting it from its append-only file ({self.redis_restarts})")
        self.redis.restart()
        self.run_info["redis_pid"] = self.redis.pid
        self.write_run_info()

    def write_run_info(self) -> None:
        """``run.json``: the run's Redis prefix and the pids of every process this launcher started. Written
        atomically: ``asyncrl status``, a resume, a joining fleet member and a relaunch read it while the run
        goes on, and a truncated file in between is no run at all to them."""
        pids = {c.name: c.proc.pid for c in self.children if c.proc is not None}
        pids.update({f"forkserver-{role}": s.pid for role, s in self.forks.items() if s.pid is not None})
        write_atomic(self.run_dir / "run.json", json.dumps({**self.run_info, "pids": pids}, indent=2) + "\n")

    def stop_children(self, control: RunControl | None, reason: str) -> None:
        if control is not None:
            try:
                control.request_stop(reason)
            except Exception:  # redis may be the thing that failed
                pass
        self.end_children(STOP_GRACE_S)
        if control is not None:
            wait_for_leaves(control, STOP_GRACE_S, self.log)

    def remove_stale_weights(self) -> None:
        """Shared-memory weight versions of publishers that died without cleaning up (SIGKILL), this run's or any
        earlier one's on this host."""
        from asyncrl.weights.shm_reclaim import remove_stale_weights

        remove_stale_weights(self.cfg.weights, self.log)

    def remove_uncommitted(self) -> None:
        """Checkpoints whose save never finished; only while no learner rank runs."""
        for name in remove_uncommitted(self.run_dir / "checkpoint"):
            self.log(f"removed checkpoint/{name}: its save never finished (the run goes on from the committed one)")

    def log(self, message: str) -> None:
        if self.console is not None:
            self.console.log(message)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> int:
        # the config the run uses (config.yaml, `meta config`): a GGUF model.path becomes its converted directory
        self.cfg = cfg = preflight(self.cfg, self.redis_url, log=self.log)
        self.gpus = self.place_gpus()
        try:  # a disk too full to start on is one line too
            config_path = self.prepare_run_dir()
        except OSError as exc:
            raise run_error(exc, self.run_dir) from None
        self.stats = RunStats(cfg.run, self.run_dir, resumed=self.resume is not None)
        control = None
        reason, code = "interrupted", 130
        previous = lifetime.stop_on_signals()  # Ctrl-C: KeyboardInterrupt whatever was inherited; SIGTERM too
        try:
            if self.forks_children:
                self.forks = fork_servers(cfg, self.gpus, self.run_dir / "logs", self.log)
            self.secret = self.take_secret()
            url = self.start_redis()
            from asyncrl.buffers import run_prefix
            from asyncrl.buffers import setup as setup_buffer

            if self.resume is not None:
                run_id, prefix = self.resume.run_id, self.resume.prefix
            else:
                run_id = f"{cfg.run.name}-{secrets.token_hex(4)}"
                prefix = run_prefix(run_id)
            # our own redis-server: its clients here fail fast, and supervise restarts a dead server
            # (check_redis) instead of waiting in their retries while the other processes' run out
            retries = {} if self.redis is None else {"retries": OWN_REDIS_RETRIES}
            control = RunControl(connect(url, **retries), prefix)
            self.buffer = setup_buffer(cfg.buffer, url, prefix, **retries)
            if self.resume is not None:
                undone = reset_for_resume(control, self.buffer, self.stats.eval_points)
                self.stats.skip_logged(control)
                self.log(f"resuming {run_id} from version {self.resume.committed_version}; undone: {undone}")
            self.run_info = {
                "run_id": run_id,
                "prefix": prefix,
                "launcher_pid": os.getpid(),
                "redis_pid": self.redis.pid if self.redis else None,
                "redis_address": self.advertised_redis(url),
                "redis_url_file": str(write_secret(self.run_dir / "redis.url", url)),
                "redis_dir": str(self.redis.workdir) if self.redis else None,
            }
            publish_run(control, config_path.read_text(), self.run_info["redis_address"])
            if not is_loopback(cfg.run.host) or not cfg.run.generators:
                self.log(
                    f"generators join with: ASYNCRL_SECRET=$(cat {self.run_dir / 'secret'}) "
                    f"asyncrl generator --redis {self.run_info['redis_address']}"
                )
            self.spawn(config_path, url, prefix)
            self.learners_started = time.monotonic()
            # beside the children's start-up, on threads: the prompts' lengths (the tokenizer; transformers where it
            # needs that) and the shared-memory weights of any earlier run on this host whose learner was killed
            self.chores = [in_background(check_prompt_lengths, cfg), in_background(self.remove_stale_weights)]
            if cfg.run.remote_learners:  # where `asyncrl learner` ranks meet the launcher's
                control.set_meta(MASTER_FIELD, self.learner_master)
            self.write_run_info()
            reason, code = self.supervise(control)
            for chore in self.chores:
                chore()  # a run shorter than the prompt check: its verdict still counts
        except KeyboardInterrupt as stop:
            reason, code = ("terminated", 143) if isinstance(stop, lifetime.Terminated) else ("interrupted", 130)
            self.log(f"{reason}: stopping every process of the run")
        except (UserError, OSError) as exc:
            error = run_error(exc, self.run_dir)
            reason, code = ("disk_full" if isinstance(error, DiskFull) else "failed"), 2
            self.stats.error = str(error)
            if error is exc:
                raise
            raise error from None
        finally:
            lifetime.set_handlers(dict.fromkeys(previous, signal.SIG_IGN))  # a second Ctrl-C must not orphan children
            self.end_run(control, reason)
            lifetime.set_handlers(previous)
            exit_soon()
        return code

    def end_run(self, control: RunControl | None, reason: str) -> None:
        """Stop every child; then, with no child left to write, remove partial checkpoints and give back the
        reserve (a full disk's room for what follows), log the last records and write the summary (or, if
        even that fails, print it); redis-server last."""
        self.stop_children(control, reason)
        for server in self.forks.values():
            server.close()
        self.remove_uncommitted()
        self.reserve.release()
        if control is not None:
            try:  # after a full disk: counted for the summary, not logged
                self.stats.drain(control)
            except DiskFull as exc:  # the last records filled it
                self.log(str(exc))
        self.stats.buffer = final_buffer_stats(self.buffer, self.log)
        self.stats.restarts = dict(generators=self.restarts, learners=self.learner_restarts, redis=self.redis_restarts)
        self.stats.write_summary(self.run_dir, reason, say=self.log)
        for tmp in self.run_dir.glob("*.tmp"):  # a file the disk cut short (run.json's)
            tmp.unlink(missing_ok=True)
        self.remove_stale_weights()
        if self.buffer is not None:
            self.buffer.close()
        if self.redis is not None:
            self.redis.stop()

    def supervise(self, control: RunControl) -> tuple[str, int]:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.run.timeout_s
        with Progress(self.console, cfg.run.steps) as progress:
            learners_done_at = None
            while True:
                self.check_redis()  # first: every client of the run waits on it, the launcher too
                for chore in self.chores:
                    chore(0)  # a dataset that does not fit the model stops the run with its error
                try:
                    self.stats.drain(control, say=self.log, buffer=self.buffer)  # + the buffer's depth
                    self.watch_fleet(control)
                    progress.update(self.stats)
                    fatal = control.get_meta("fatal")
                    if fatal is not None:  # a generator's failure limit: the run trains on nothing
                        raise UserError(f"{fatal} (see {self.run_dir / 'logs'})")
                    if learners_done_at is None and self.check_children(control) == "learners_done":
                        learners_done_at = time.monotonic()
                except (redis.ConnectionError, redis.TimeoutError, BufferUnavailableError):
                    if self.redis is None or self.redis.is_running():
                        raise
                    continue  # our redis-server died during this tick: check_redis restarts it at once
                if learners_done_at is not None:
                    if self.stats.final_eval_reward is not None or not cfg.evaluates:
                        return "completed", 0
                    if time.monotonic() - learners_done_at > FINAL_EVAL_TIMEOUT_S:
                        raise UserError("the learners finished but no generator ran the final evaluation")
                if time.monotonic() > deadline:
                    return "timeout", 1
                time.sleep(0.25)
