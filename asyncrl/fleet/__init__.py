"""The fleet: what processes on many machines share to find and join one run.

* ``rendezvous``: the run's metadata in Redis (config, Redis address), membership, locating a run from
  ``--redis`` or ``--run`` and the secret.
* ``redis_server``: the run's private ``redis-server`` (loopback, password, append-only file) and the
  reachability check of an external one.

The run secret and the credentials derived from it are core (``asyncrl.secret``): the buffer, the weight
bus and every process use them.

May import: the core.
"""
