"""A mixture of experts' routed experts as vLLM chose them, inside its worker: the probe's, and with rollout
routing replay (R3, ``algorithm.routing_replay``) every sampled sequence's, for the learner to replay.

vLLM's routers take a capture function (``set_capture_fn``, what its own routed-experts output uses; that
output lives in its GPU model runner only, not in the CPU worker's): called once per MoE layer and forward
with the (tokens, top_k) expert ids of the forward's flattened batch. :class:`RoutesCapture` (mixed into the
worker by ``vllm_engine.WeightReloadExtension``) cuts those rows per request by the model runner's own batch
layout (``input_batch.req_ids``, ``query_start_loc``: request i's rows are ``[start_i, start_{i+1})``) and files
them by position (``num_computed_tokens``: where the request's rows of this step begin), so chunked prefills,
preempted-and-recomputed requests and the n children of one prompt each end with one row per position.
A prefix-cache hit computes nothing for its cached prompt positions, so the engine runs without prefix
caching while it captures (``VllmEngine(routes=True)``).

A sequence's routes cover the positions the engine ran a forward on: the prompt and every sampled token but
the last (whose own routing no forward computed; the learner's forward of it feeds no log-prob).
"""

from __future__ import annotations

import numpy as np
import torch

FIRST_POSITIONS = 256  # a request's routes start with room for this many positions (or its first step's)


class RoutesCapture:
    """Mixed into vLLM's worker class (through the engine's worker extension); methods run inside the worker."""

    def asyncrl_routing(self, record: bool) -> dict[int, list] | None:
        """Start (``record``) or stop recording the expert choices of every forward (the probe's, run alone);
        stopping returns them, per layer: the (tokens, top_k) ids of every forward since the start,
        concatenated. None: the model has no routers."""
        if not self._asyncrl_hooked():
            return None
        routes, self._asyncrl_routes = self._asyncrl_routes, ({} if record else None)
        return None if record else {layer: torch.cat(rows).tolist() for layer, rows in (routes or {}).items()}

    def asyncrl_capture_routes(self, max_len: int, skip: str) -> bool:
        """From now on, file each request's expert choices by position (at most ``max_len`` positions), for
        :meth:`asyncrl_take_routes`, but for requests whose id starts with ``skip`` (the probe's); False: the
        model has no routers."""
        if not self._asyncrl_hooked():
            return False
        self._asyncrl_max_len, self._asyncrl_skip, self._asyncrl_requests = max_len, skip, {}
        return True

    def asyncrl_take_routes(self, take: list[str], drop: list[str]) -> dict[str, tuple[list[int], bytes]]:
        """The routes of the finished requests ``take`` (vLLM's internal ids), each ``(shape, uint8 bytes)`` of
        a (positions, layers, top_k) array, positions 0..the last one a forward ran; forgets them and ``drop``
        (aborted requests, and the children ``<index>_<id>`` of each). A request no forward ran is left out."""
        requests, out = self._asyncrl_requests, {}
        for rid in take:
            held = requests.pop(rid, None)
            if held is not None:
                routes, ran = held
                out[rid] = ([ran, *routes.shape[1:]], routes[:ran].tobytes())
        if drop:
            children = tuple(f"_{rid}" for rid in drop)
            for rid in [r for r in requests if r in drop or r.endswith(children)]:
                del requests[rid]
        return out

    def asyncrl_routes_held(self) -> int:
        """How many requests' routes are held (started and not yet taken or dropped)."""
        return len(self._asyncrl_requests or ())

    def _asyncrl_hooked(self) -> bool:
        if not hasattr(self, "_asyncrl_layers"):  # the first call (at the engine's start) hooks the routers, once
            model = self.model_runner.get_model()
            self._asyncrl_routes, self._asyncrl_requests = None, None
            runners = [m for m in model.modules() if hasattr(getattr(m, "router", None), "set_capture_fn")]
            # the learner's layer order (transformers' routers in module order) is the layers' own
            self._asyncrl_layers = {layer: i for i, layer in enumerate(sorted(r.layer_id for r in runners))}
            for runner in runners:
                runner.router.set_capture_fn(lambda ids, layer=runner.layer_id: self._asyncrl_route(layer, ids))
        return bool(self._asyncrl_layers)

    def _asyncrl_route(self, layer: int, ids: torch.Tensor) -> None:
        if self._asyncrl_routes is not None:
            self._asyncrl_routes.setdefault(layer, []).append(ids.detach().cpu())
        if self._asyncrl_requests is not None:
            rows = ids.detach().cpu().numpy()
            if rows.size and rows.max() > 255:
                raise ValueError("routing replay files expert ids as uint8: at most 256 experts")
            self._asyncrl_file(self._asyncrl_layers[layer], rows)

    def _asyncrl_file(self, layer: int, ids: np.ndarray) -> None:
        runner, requests = self.model_runner, self._asyncrl_requests
        batch = runner.input_batch
        n = batch.num_reqs
        starts, computed = runner.query_start_loc.np[: n + 1], batch.num_computed_tokens_cpu[:n]
        for i, rid in enumerate(batch.req_ids[:n]):
            if rid.startswith(self._asyncrl_skip):
                continue
            rows = ids[starts[i] : starts[i + 1]]
            at = int(computed[i])
            held = requests.get(rid)
            if held is None:  # room for what this step runs, doubled as the sequence grows (not max_len at once:
                # 32k positions x 48 layers x 8 experts would be 12 MB a request)
                shape = (max(FIRST_POSITIONS, at + len(rows)), len(self._asyncrl_layers), ids.shape[1])
                held = requests[rid] = [np.zeros(shape, dtype=np.uint8), 0]
            elif at + len(rows) > len(held[0]):
                grown = np.zeros((min(max(2 * len(held[0]), at + len(rows)), self._asyncrl_max_len),
                                  *held[0].shape[1:]), dtype=np.uint8)  # fmt: skip
                grown[: held[1]] = held[0][: held[1]]
                held[0] = grown
            held[0][at : at + len(rows), layer] = rows
            held[1] = max(held[1], at + len(rows))


class SampleRoutes:
    """The engine's side: which of vLLM's requests each of ours is, to take every finished sample's routes
    from the worker (``StepOutput.routes``) and have it forget aborted ones."""

    def __init__(self, llm):
        self.llm = llm
        self._internal: dict[str, tuple[str, bool]] = {}  # our id -> (vLLM's, has children) until its samples end
        self._to_drop: list[str] = []  # vLLM's ids of aborted requests, for the worker to forget at the next take

    @classmethod
    def start(cls, llm, max_len: int, skip: str) -> SampleRoutes | None:
        """Capture on in the worker (:meth:`RoutesCapture.asyncrl_capture_routes`); None for a dense model."""
        return cls(llm) if llm.collective_rpc("asyncrl_capture_routes", args=(max_len, skip))[0] else None

    def added(self, request_id: str, internal: str, children: bool) -> None:
        self._internal[request_id] = (internal, children)

    def aborted(self, request_ids: list[str]) -> None:
        self._to_drop += [self._internal.pop(rid)[0] for rid in request_ids if rid in self._internal]

    def attach(self, outs: list, ended: list[str]) -> None:
        """Each finished sample of ``outs``'s routes, taken by vLLM's id of it (a child of an n-sample request:
        ``<index>_<parent's>``); ``ended``: our requests whose every sample is done."""
        ids = {}
        for o in outs:
            if o.finished and o.request_id in self._internal:
                internal, children = self._internal[o.request_id]
                ids[o.request_id, o.index] = f"{o.index}_{internal}" if children else internal
        for rid in ended:
            self._internal.pop(rid, None)
        drop, self._to_drop = self._to_drop, []
        if not ids and not drop:
            return
        taken = self.llm.collective_rpc("asyncrl_take_routes", args=(list(ids.values()), drop))[0]
        for o in outs:
            if (key := (o.request_id, o.index)) in ids and (got := taken.get(ids[key])) is not None:
                shape, data = got
                o.routes = np.frombuffer(data, dtype=np.uint8).reshape(shape)
