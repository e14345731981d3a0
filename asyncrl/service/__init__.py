"""The service kit: what every server and worker pool of a run is built from, written once.

* ``pool``: killable worker processes that run user code by import path (one call, or a stateful session per
  environment), each call with a hard deadline and its cause when it fails (``*_timeout``, ``*_crash``,
  ``*_memory``); ``sessions``: a session's calls, replayed on another worker when its own died, and the suspects
  a crash leaves; ``pool_worker``: the worker process's side of that wire.
* ``sandbox``: one program in a fresh, limited, network-less interpreter (the ``python`` tool's engine).
* ``http``: the JSON-over-HTTP server's pieces: body, depth and read-deadline limits, the bearer token (loaded,
  checked), the versioned request check, ``{"error"}`` refusals, the answer cache by request id (a retry gets
  the same answer) with back-pressure (429) and its counters, listening, and exit codes 130 / 143 on signals.
* ``client``: the retrying JSON-over-HTTP client of a run's servers (the remote reward's, the remote
  environment's): one HTTP session per event loop, a bearer token, one id per logical request that every retry
  sends again, jittered back-off within one deadline, failures as one line naming the URL without credentials.

Used by ``asyncrl reward-serve``, ``asyncrl env-serve``, the generator's pool for plain user code and the
OpenAI-compatible endpoint. It knows nothing of episodes, rewards or models.

May import: the core.
"""
