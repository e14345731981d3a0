"""One generator process: its engine, buffer, weight subscriber and tokenizer, set up for a
:class:`~asyncrl.generators.generator.Generator` whose loop runs until the run ends or SIGTERM
(``python -m asyncrl.generators.worker``, started by ``asyncrl launch``, ``asyncrl join`` or a Ray or
SLURM backend)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time
import zlib

from asyncrl import buffers
from asyncrl.config import Config, load_config
from asyncrl.control import RunControl, connect
from asyncrl.generators import setup_engine
from asyncrl.generators.generator import Generator
from asyncrl.lifetime import NICE_WHEN_UP_ENV, lower_priority, pin_when_up, starting_up
from asyncrl.observe.metrics import setup_logging
from asyncrl.secret import read_secret
from asyncrl.weights import setup_subscriber

log = logging.getLogger("asyncrl.generator")

HUNG_AFTER_S = 0.5  # at the end, how long an episode thread may take to finish before it counts as hung


async def _serve(cfg: Config, ident: str, engine, buffer, control, tokenizer, subscriber) -> None:
    gen = Generator(
        cfg, ident=ident, engine=engine, buffer=buffer, control=control, tokenizer=tokenizer, subscriber=subscriber
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, gen.stop)
    log.info(
        "generator %s up (engine %s, %d episodes in flight, %d generators in the fleet)",
        ident,
        cfg.generator.engine.type,
        gen.capacity * cfg.generator.n_samples,
        len(control.members("generator")),
    )
    await gen.run()


def engine_slots(cfg: Config) -> int:
    """The sequences the engine runs at once (vLLM's ``max_num_seqs``): the episodes in flight and, beside them, a
    whole evaluation (its prompts are played together). Fewer, and an evaluation runs in waves, each paying the
    engine's fixed cost a step again: the demo evaluating every version took 29.4 engine steps a version (both
    generators) at 64 sequences, 17.8 at 192."""
    return cfg.generator.episodes_in_flight + (cfg.data.eval_prompts if cfg.evaluates else 0)


def serve(cfg: Config, ident: str, url: str, prefix: str, incarnation: int = 0) -> None:
    """Run generator ``ident`` of the run under ``prefix`` on the Redis server at ``url`` until the run
    ends or SIGTERM; the weights come from the address the learner advertised there. A clean end ends the
    process too (``os._exit(0)``, see the end); an error is raised."""
    with starting_up():  # the collector's passes left for the end of set-up (asyncrl.lifetime)
        control = RunControl(connect(url), prefix)
        buffer = buffers.setup(cfg.buffer, url, prefix)

        from transformers import AutoTokenizer

        seed = zlib.crc32(f"{cfg.run.seed}/{ident}/{incarnation}".encode())
        g = cfg.generator
        engine = setup_engine(
            g.engine, cfg.model, engine_slots(cfg), seed, g.max_model_len, routes=cfg.algorithm.routing_replay
        )
        lower_priority(int(os.environ.pop(NICE_WHEN_UP_ENV, "0")))  # started at full priority (asyncrl.lifetime.Child)
        pin_when_up()  # ... and on any core
        address = control.wait_meta("weights_address", timeout_s=600)
        subscriber = setup_subscriber(cfg.weights, address, subscriber_id=f"generator-{ident}", secret=read_secret())
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    # plain environments, tools and rewards run on threads: one per episode, so none waits for another
    threads = concurrent.futures.ThreadPoolExecutor(cfg.generator.episodes_in_flight + 8, "episode")
    loop = asyncio.new_event_loop()
    loop.set_default_executor(threads)
    try:
        loop.run_until_complete(_serve(cfg, ident, engine, buffer, control, tokenizer, subscriber))
    finally:
        threads.shutdown(wait=False, cancel_futures=True)  # asyncio.run would wait for them
        with contextlib.suppress(Exception):  # async generators' cleanup: a RemoteEnv's HTTP session closes
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        subscriber.close()
        buffer.close()
        engine.close()
    # idle workers leave at once on the shutdown; one still in a call after this is hung past its timeout
    deadline = time.monotonic() + HUNG_AFTER_S
    for t in [t for t in threading.enumerate() if t.name.startswith("episode")]:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t for t in threading.enumerate() if t.name.startswith("episode") and t.is_alive()]
    if hung:  # a plain reward, tool or environment that never returned: the process must still end
        log.warning(
            "%d calls of episodes are still running (hung past their timeouts); exiting without them", len(hung)
        )
    # everything of the run's is closed: the process ends here, without vLLM's teardown at exit (it
    # unfreezes the heap and collects it all: 1.5 s of a core), and without waiting for a hung call
    logging.shutdown()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="asyncrl generator process (started by `asyncrl launch`)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--incarnation", type=int, default=0, help="restart count; varies the sampling seed")
    ap.add_argument("--log-file")
    args = ap.parse_args(argv)
    setup_logging(args.log_file, name=f"generator-{args.id}")
    cfg = load_config(args.config)
    serve(cfg, args.id, os.environ["ASYNCRL_REDIS_URL"], os.environ["ASYNCRL_PREFIX"], args.incarnation)


if __name__ == "__main__":
    main()
