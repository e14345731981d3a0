"""``scripts/bench/weights.py --delta`` (see its doc): delta weight versions against full ones, side by side.

SmolLM2-135M trains in float32 (AdamW, ``--delta-lr``, on the arith prompts with their answers; a learner
step's update to every weight is what matters here, not the loss) and each version is published in
``--delta-dtype``: in bfloat16, the weights a bfloat16 learner over float32 master weights publishes (its
module holds the masters rounded to bfloat16 after each step). Two zmq publishers get every version, one
with deltas (``DeltaPolicy``, as ``weights.delta`` makes it) and one without, each to its own G subscriber
processes that apply what they get and report its checksum, which must equal the trained weights' at every
version. On one host (no ``--delta-link-mbit``) a shared-memory publisher (``weights.type: shm``, full
versions: its subscribers map the file it writes) serves G more, the same-host alternative to a delta. Per
version it prints the kind and bytes the delta publisher sent and the time from ``publish`` to the last
subscriber's applied copy on each bus; the publishers take turns going first.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def sft_batches(tokenizer, data: str, batch: int):
    """Endless batches of (input ids, attention mask): each prompt with its answer, as the chat template puts it."""
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    texts = [
        tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) + r["answer"] + "\n"
        for r in rows
    ]
    for start in itertools.cycle(range(0, len(texts) - batch + 1, batch)):
        enc = tokenizer(texts[start : start + batch], return_tensors="pt", padding=True)
        yield enc["input_ids"], enc["attention_mask"]


def delta_main(args, harness) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = str(Path(args.lora_model).resolve())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.gradient_checkpointing_enable()
    tokenizer = AutoTokenizer.from_pretrained(path)
    g = max(int(x) for x in args.groups.split(","))
    with contextlib.ExitStack() as stack:
        netns = None
        if args.delta_link_mbit:
            netns = stack.enter_context(harness.network_namespace(args.delta_link_mbit))
        return _publish_both(args, harness, model, tokenizer, path, g, netns)


def _publish_both(args, harness, model, tokenizer, path: str, g: int, netns: str | None) -> None:
    from asyncrl.weights import ShmWeightPublisher, ZmqWeightPublisher, state_dict_checksum
    from asyncrl.weights.delta import DeltaPolicy
    from asyncrl.weights.ties import untied

    batches = sft_batches(tokenizer, "data/arith/train.jsonl", batch=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.delta_lr, weight_decay=0.0)
    dtype = getattr(torch, args.delta_dtype)
    labels = ("delta", "full") if netns else ("delta", "full", "shm")
    subs = {label: harness.Subscribers(g, [netns] * g, None) for label in labels}
    times: dict[str, list[float]] = {label: [] for label in labels}
    sent_bytes: list[int] = []
    kinds: dict[str, int] = {}
    full_bytes = 0
    try:
        with tempfile.TemporaryDirectory(prefix="wdelta", dir="/tmp") as tmp:
            where = {"delta": f"ipc://{tmp}/d.sock", "full": f"ipc://{tmp}/f.sock"}
            if netns is not None:
                where = dict.fromkeys(labels, f"tcp://{harness.NETNS_HOST}:*")
            pubs = {
                "delta": ZmqWeightPublisher(where["delta"], args.bucket_mb << 20, deltas=DeltaPolicy()),
                "full": ZmqWeightPublisher(where["full"], args.bucket_mb << 20),
            }
            if "shm" in labels:
                pubs["shm"] = ShmWeightPublisher(bucket_bytes=args.bucket_mb << 20)
            for label in labels:
                transport = "shm" if label == "shm" else "zmq"
                subs[label].command(g, ["sub", transport, pubs[label].address, "structure", True, None])
                deadline = time.monotonic() + 60
                while transport == "zmq" and pubs[label].stats()["subscribers"] < g and time.monotonic() < deadline:
                    time.sleep(0.01)
            link = f", across a {args.delta_link_mbit} Mbit/s link" if netns else ""
            print(f"{path}: versions in {args.delta_dtype}, lr {args.delta_lr:g}, {g} subscribers per publisher{link}")
            print(f"version   loss  kind    sent MB  changed  publish-to-applied: {'  '.join(labels)}")
            for version in range(1, args.delta_steps + 1):
                ids, mask = next(batches)
                loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state = {n: t.detach().to(dtype).clone() for n, t in untied(model).items()}
                full_bytes = sum(t.numel() * t.element_size() for t in state.values())
                want = state_dict_checksum(state)
                took = {}
                for label in labels[version % len(labels) :] + labels[: version % len(labels)]:
                    t0 = time.perf_counter()
                    pubs[label].publish(version, state)
                    got = subs[label].arrivals(g, version)
                    took[label] = max(t for t, _ in got.values()) - t0
                    times[label].append(took[label])
                    received = [subs[label].received[i] for i in range(g)]
                    bad = [i for i, (_, checksum) in enumerate(received) if checksum != want]
                    assert not bad, f"version {version}: subscribers {bad} hold other bytes than the learner's"
                sent = subs["delta"].received[0][0]
                sent_bytes.append(sent["bytes"])
                kinds[sent["kind"]] = kinds.get(sent["kind"], 0) + 1
                changed = sent.get("changed_fraction")
                print(
                    f"{version:>7} {loss.item():6.3f}  {sent['kind']:<5} {sent['bytes'] / 1e6:9.2f}  "
                    f"{f'{changed:.4f}' if changed is not None else sent.get('full_reason', ''):>7}"
                    f"  {' '.join(f'{took[label]:7.3f}' for label in labels):>25}",
                    flush=True,
                )
            for pub in pubs.values():
                pub.close()
    finally:
        for s in subs.values():
            s.close()
    ratio = statistics.mean(sent_bytes) / full_bytes
    median = {label: statistics.median(times[label]) for label in labels}
    print(f"full version {full_bytes / 1e6:.1f} MB; {kinds}; every version bit-exact in {len(labels) * g} subscribers")
    print(f"RESULT delta_bytes_ratio {ratio:.4f}")
    print(f"RESULT delta_sync_ratio {median['delta'] / median['full']:.3f}")
    if "shm" in labels:
        print(f"RESULT delta_vs_shm_sync_ratio {median['delta'] / median['shm']:.3f}")
