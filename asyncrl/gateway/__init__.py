"""The OpenAI gateway: an OpenAI-compatible endpoint in each generator, through which agents written against
the OpenAI API play episodes, every request of a session turned into turns of its episode's ``Context``.

* ``server``: the HTTP endpoint (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``), one key and one
  session per episode; ``wire``: the request parameters it accepts and the bodies and stream events it answers.
* ``transcript``: a session's requests matched against its episode's sample: only new messages are encoded, a
  rewritten history forks the sample.
* ``agent``: the agent kinds of episode (``episode.type: agent``, an ``async def agent(client, task)``;
  ``agent_command``, a program per episode; ``agent_service``, through ``agent_remote``, the client of an agent
  service), each against its own session of the endpoint.
* ``agent_serve``: ``asyncrl agent-serve``, an agent function as a service that plays a run's episodes.

May import: the core, asyncrl.episodes, asyncrl.rewards, asyncrl.service.
"""
