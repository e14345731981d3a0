"""``asyncrl slurm``: a run as one heterogeneous SLURM job, or generators that join one.

The rendered sbatch script has one component per role, each started with ``srun --het-group=K``:
0, the head (``asyncrl launch --generators 0``: the run's redis-server and its learner ranks) on the
first learner node, and ``run.learners`` more ranks (``asyncrl learner``) on each further one;
1, generators (``asyncrl generator``) that join it; 2 (optional), a reward
server (``asyncrl reward-serve``). ``--join JOBID``: a job of generators joining job JOBID's run.

Lifetime, decided by the script and never by ``pkill``:
- the head's exit is the run's: when it ends, generators leave by themselves (the run's stop key);
  the script waits for them at most ``--exit-wait-s``, cancels whatever of its *own* steps is left,
  and exits with the head's code (so a failed head fails the job, with its error in the output);
- a generator step that fails while the run goes on is started again, at most ``--generator-restarts``
  times, under a new id (the dead one's lease expires and its admission slots go back to the run);
  past that it is left out and the run goes on with the others; one that exits 0 left: not restarted;
- the run secret is ``$ASYNCRL_SECRET`` when the job was submitted with it, else made by the script at
  start; it travels only in the job's environment (srun passes it on) and ``runs/<name>/secret``
  (0600, written by the head); it is never in the script, an argument or the output.
"""

from __future__ import annotations

import dataclasses
import random
import shlex
import string
import subprocess
import sys
from pathlib import Path

from asyncrl.errors import UserError
from asyncrl.run.slurm_scripts import COMMON, JOIN, LEARNERS, MAIN, REWARD_BLOCK

EXIT_WAIT_S = 60  # generators leave within seconds of the run's stop; a minute covers a loaded node
START_TIMEOUT_S = 1800  # the head's first start may build the demo model or load a large one from disk
GENERATOR_RESTARTS = 3
# the head's Redis port when run.redis_port is 0: above most services' ports and below Linux's ephemeral range
# (32768-60999), where any outgoing connection may take the port between its pick and the head's bind
PORT_RANGE = (20000, 32768)
COMMENT_TAG = "asyncrl"  # job comment: asyncrl;run=<name>;port=<port>;dir=<run dir>, read by --join


class _Template(string.Template):
    delimiter = "@@"  # bash owns $ and ${...}; @@ appears nowhere in bash


@dataclasses.dataclass(frozen=True)
class Component:
    """One het component's ``#SBATCH`` line."""

    role: str  # "learners" | "generators" | "reward"
    nodes: int
    partition: str | None = None
    tasks_per_node: int = 1
    cpus_per_task: int = 1
    mem: str | None = None

    def sbatch(self) -> str:
        opts = [f"--partition={self.partition}"] if self.partition else []
        opts += [f"--nodes={self.nodes}", f"--ntasks-per-node={self.tasks_per_node}"]
        opts += [f"--cpus-per-task={self.cpus_per_task}"] + ([f"--mem={self.mem}"] if self.mem else [])
        return "#SBATCH " + " ".join(opts)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything a script needs; paths are absolute (the job runs on other nodes, in ``workdir``)."""

    name: str
    run_dir: Path
    workdir: Path
    python: str
    port: int
    components: tuple[Component, ...]  # learners first; generators; reward server if any
    launch_args: tuple[str, ...] = ()  # the head's `asyncrl launch` arguments after the fixed ones
    reward: str | None = None  # module:function the reward component serves
    reward_port: int = 0
    generator_restarts: int = GENERATOR_RESTARTS
    exit_wait_s: int = EXIT_WAIT_S
    start_timeout_s: int = START_TIMEOUT_S
    time: str | None = None
    join: str | None = None  # a job id: this job's generators join its run
    learners_per_node: int = 1  # run.learners of the config: the ranks on each learner node

    @property
    def slurm_dir(self) -> Path:
        """The job scripts and outputs, next to the run directory (which the head alone creates)."""
        return self.run_dir.with_name(self.run_dir.name + ".slurm")

    def component(self, role: str) -> int | None:
        return next((k for k, c in enumerate(self.components) if c.role == role), None)


def job_comment(spec: JobSpec) -> str:  # no spaces: scontrol -o prints fields space-separated
    return f"{COMMENT_TAG};run={spec.name};port={spec.port};dir={spec.run_dir}"


def parse_comment(text: str) -> dict[str, str]:
    """The fields of :func:`comment` (``{}`` for another job's comment)."""
    tag, *fields = text.strip().split(";")
    return dict(f.split("=", 1) for f in fields if "=" in f) if tag == COMMENT_TAG else {}


def parse_job_records(text: str) -> list[dict[str, str]]:
    """``scontrol -o show job`` output: one dict per line (a het job has one per component).

    Values never hold spaces in the fields read here (JobState, NodeList, Comment, HetJobOffset)."""
    records = [dict(tok.split("=", 1) for tok in line.split() if "=" in tok) for line in text.splitlines()]
    return [r for r in records if r]


def _q(value) -> str:
    return shlex.quote(str(value))


def _values(spec: JobSpec) -> dict[str, str]:
    gen = spec.component("generators")
    return {
        "workdir": _q(spec.workdir),
        "python": _q(spec.python),
        "run_dir": _q(spec.run_dir),
        "slurm_dir": _q(spec.slurm_dir),
        "port": str(int(spec.port)),
        "per_node": str(spec.components[gen].tasks_per_node if gen is not None else 1),
        "restarts": str(int(spec.generator_restarts)),
        "exit_wait": str(int(spec.exit_wait_s)),
        "start_timeout": str(int(spec.start_timeout_s)),
        "gen_het": f"--het-group={gen} " if gen is not None and len(spec.components) > 1 else "",
        "name": spec.name,
    }


def _header(spec: JobSpec, job_name: str, output: str, with_comment: bool) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job_name}", f"#SBATCH --output={output}"]
    tag = job_comment(spec)
    lines += [f"#SBATCH --comment={tag}"] * with_comment + [f"#SBATCH --time={spec.time}"] * bool(spec.time)
    for k, comp in enumerate(spec.components):
        if k:
            lines.append("#SBATCH hetjob")
        lines.append(comp.sbatch() + f"  # component {k}: {comp.role}")
    return "\n".join(lines)


def render(spec: JobSpec) -> str:
    """The sbatch script of the whole run (see the module doc); deterministic in ``spec``."""
    values = _values(spec)
    gen, reward = spec.component("generators"), spec.component("reward")
    het = len(spec.components) > 1
    blocks = {"reward_block": "", "gen_start": "", "learner_block": ""}
    launch = ["--name", spec.name, "--generators", "0", "--host", '"$HEAD_ADDR"', "--set", '"run.redis_port=$PORT"']
    launch += [_q(a) for a in spec.launch_args]
    nodes, local = spec.components[0].nodes, spec.learners_per_node
    if nodes > 1:  # the head starts ranks 0..local-1; each other learner node runs `local` more
        launch += ["--set", f"run.learners={nodes * local}", "--set", f"run.local_learners={local}"]
        lv = {"local": str(local), "head_het": "--het-group=0 " if het else ""}
        blocks["learner_block"] = _Template(LEARNERS).substitute(lv)
    if reward is not None:
        rv = {"k": str(reward), "reward": _q(spec.reward), "reward_port": str(int(spec.reward_port))}
        blocks["reward_block"] = _Template(REWARD_BLOCK).substitute(rv)
        launch += ["--set", f'"data.reward=http://$REWARD_ADDR:{int(spec.reward_port)}/score"']
    if gen is not None:
        nodelist = f"$SLURM_JOB_NODELIST_HET_GROUP_{gen}" if het else "$SLURM_JOB_NODELIST"
        blocks["gen_start"] = (  # once the head's Redis answers (the head creates the run directory first)
            f'wait_reachable "the head" "$HEAD_ADDR" "$PORT" "$HEAD_PID" && start_generators "{nodelist}"'
        )
    body = _Template(MAIN).substitute(
        values, **blocks, head_het="--het-group=0 " if het else "", launch_args=" ".join(launch)
    )
    roles = ", ".join(f"{k} {c.role}" for k, c in enumerate(spec.components))
    head = _header(spec, f"asyncrl-{spec.name}", str(spec.slurm_dir / "job-%j.out"), with_comment=True)
    intro = f"# asyncrl run {spec.name}, rendered by `asyncrl slurm` (components: {roles}); see asyncrl/run/slurm.py\n"
    return head + "\n" + intro + _Template(COMMON).substitute(values) + body


def render_join(spec: JobSpec) -> str:
    """The sbatch script of generators joining the run of job ``spec.join``."""
    values = _values(spec)
    head = _header(spec, f"asyncrl-{spec.name}-join", str(spec.slurm_dir / "join-%j.out"), with_comment=False)
    intro = f"# generators joining asyncrl run {spec.name} of job {spec.join}, rendered by `asyncrl slurm --join`\n"
    body = _Template(JOIN).substitute(values, join=_q(spec.join))
    return head + "\n" + intro + _Template(COMMON).substitute(values) + body


# -- from the command line ---------------------------------------------------------------------------
def _check_path(path: Path) -> Path:
    if any(c.isspace() or c in ";%" for c in str(path)):
        raise UserError(f"{path}: a path with spaces, ';' or '%' cannot go in a job's comment or output name")
    return path


def _components(args, learners: int) -> tuple[Component, ...]:
    comps = []
    if not args.join:
        comps.append(Component("learners", args.learner_nodes, args.partition_learners, 1,
                               args.cpus_learners or learners, args.mem_learners))  # fmt: skip
    if args.generator_nodes:
        comps.append(Component("generators", args.generator_nodes, args.partition_generators,
                               args.generators_per_node, args.cpus_generators, args.mem_generators))  # fmt: skip
    if args.reward_nodes and not args.join:
        partition = args.partition_reward or args.partition_generators
        comps.append(Component("reward", args.reward_nodes, partition, 1, args.cpus_generators, None))
    return tuple(comps)


def _job_kwargs(args) -> dict:
    return dict(
        workdir=_check_path(Path.cwd()),
        python=sys.executable,
        generator_restarts=args.generator_restarts,
        exit_wait_s=args.exit_wait_s,
        start_timeout_s=args.start_timeout_s,
        time=args.time,
    )


def spec_from_args(args) -> JobSpec:
    from asyncrl.config import load_config, parse_override

    if args.learner_nodes < 1:
        raise UserError("--learner-nodes: the head needs one node at least")
    if args.reward_nodes > 1:
        raise UserError("--reward-nodes: a run scores with one reward server (data.reward is one URL); use 0 or 1")
    if args.reward_nodes and not args.reward:
        raise UserError("--reward-nodes needs --reward MODULE:FUNCTION (the function the server runs)")
    overrides = dict(parse_override(o) for o in args.overrides)
    if args.name:
        overrides["run.name"] = args.name
    cfg = load_config(args.config, overrides)
    per_node = cfg.run.learners
    if args.learner_nodes > 1:  # what the head will run: every node's ranks, its own first
        cfg = load_config(args.config, {**overrides, "run.learners": per_node * args.learner_nodes,
                                        "run.local_learners": per_node})  # fmt: skip
    run_dir = _check_path(cfg.run_dir.resolve())
    if run_dir.exists() and not cfg.run.overwrite:
        raise UserError(f"run directory {run_dir} exists: pick another --name, or --set run.overwrite=true")
    port = cfg.run.redis_port or random.SystemRandom().randrange(*PORT_RANGE)
    launch = (*(("--config", str(Path(args.config).resolve())) if args.config else ()),)
    launch += tuple(x for o in args.overrides for x in ("--set", o))
    return JobSpec(
        name=cfg.run.name,
        run_dir=run_dir,
        port=port,
        components=_components(args, per_node),
        launch_args=launch,
        learners_per_node=per_node,
        reward=args.reward,
        reward_port=args.reward_port or random.SystemRandom().randrange(*PORT_RANGE),
        **_job_kwargs(args),
    )


def head_job(jobid: str) -> dict[str, str]:
    """Run name, port and run directory of job ``jobid``, from the comment its script set."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", jobid], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise UserError("scontrol is not on PATH: --join needs SLURM's client commands") from None
    records = parse_job_records(out.stdout)
    if out.returncode != 0 or not records:
        raise UserError(f"job {jobid}: {out.stderr.strip() or 'not found'}")
    info = parse_comment(records[0].get("Comment", ""))
    if not {"run", "port", "dir"} <= info.keys():
        raise UserError(f"job {jobid} is not an `asyncrl slurm` job (its comment is {records[0].get('Comment')!r})")
    return info


def join_spec_from_args(args) -> JobSpec:
    if not args.generator_nodes:
        raise UserError("--join needs --generator-nodes (at least 1)")
    if args.config or args.overrides:
        raise UserError("--join: the generators read the run's config from its Redis; leave out --config and --set")
    info = head_job(args.join)
    if args.name and args.name != info["run"]:
        raise UserError(f"job {args.join} runs {info['run']!r}, not {args.name!r}")
    return JobSpec(
        name=info["run"],
        run_dir=Path(info["dir"]),
        port=int(info["port"]),
        components=_components(args, 1),
        join=args.join,
        **_job_kwargs(args),
    )


def cmd_slurm(args) -> int:
    spec = join_spec_from_args(args) if args.join else spec_from_args(args)
    text = render_join(spec) if args.join else render(spec)
    default = spec.slurm_dir / (f"join-{args.join}.sbatch" if args.join else "job.sbatch")
    path = Path(args.out) if args.out else default
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    spec.slurm_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # the jobs' output files go there
    path.write_text(text)
    print(path, flush=True)
    if args.submit:
        try:
            out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise UserError("sbatch is not on PATH: submit the script on a SLURM login node") from None
        if out.returncode != 0:
            raise UserError(f"sbatch {path}: {out.stderr.strip()}")
        print(out.stdout.strip().split(";")[0], flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("slurm", help="render (and submit) a SLURM job of a run, or of generators joining one")
    add = p.add_argument
    add("--config", help="YAML run config, as for launch")
    add("--name", help="run name (run.name); with --join, checked against the job's")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="dotted config override for the head's launch (repeatable)")  # fmt: skip
    add("--learner-nodes", type=int, default=1, help="nodes of component 0: the head, and run.learners ranks on each")
    add("--generator-nodes", type=int, default=1, help="nodes of the generator component (0: none)")
    add("--generators-per-node", type=int, default=1, help="generator processes on each of them")
    add("--reward-nodes", type=int, default=0, help="1: a reward server component (with --reward)")
    add("--reward", metavar="MODULE:FUNCTION", help="the reward function the reward server runs")
    add("--reward-port", type=int, default=0, help="its port (0: one picked now)")
    for role in ("learners", "generators", "reward"):
        add(f"--partition-{role}", help=f"partition of the {role} component (default: the cluster's)")
    add("--cpus-learners", type=int, help="CPUs of the head's node (default: run.learners)")
    add("--cpus-generators", type=int, default=1, help="CPUs per generator process (and of the reward server)")
    add("--mem-learners", help="memory of the head's node (sbatch --mem)")
    add("--mem-generators", help="memory per generator node (sbatch --mem)")
    add("--time", help="the job's time limit (sbatch --time)")
    add("--generator-restarts", type=int, default=GENERATOR_RESTARTS, help="starts again of a failed generator")
    add("--exit-wait-s", type=int, default=EXIT_WAIT_S, help="after the head ends, the generators' time to leave")
    add("--start-timeout-s", type=int, default=START_TIMEOUT_S, help="the head's (or joined job's) time to listen")
    add("--join", metavar="JOBID", help="render a generators-only job joining the run of job JOBID")
    add("--out", metavar="SCRIPT", help="where to write the script (default: runs/<name>.slurm/)")
    add("--submit", action="store_true", help="submit it with sbatch and print the job id")
    p.set_defaults(func=cmd_slurm)
