"""What the model wrote (issue 25): generators send a few rendered prompts and completions with their
rewards, per evaluation and every few versions, through the metrics channel; the launcher keeps them in
``runs/<name>/samples.jsonl`` (bounded: rotated to ``samples.jsonl.1``). ``asyncrl launch --dry-run
--show-prompts N`` prints the first N prompts of the run as the model will see them."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
from demo_launch import ROOT, assert_one_line_error, asyncrl, demo_launch_cmd
from metrics_fixtures import Stream

from asyncrl.config import RunConfig
from asyncrl.episodes.api import Outcome
from asyncrl.observe.metrics import read_metrics
from asyncrl.run.samples import SamplesLog, sample_lines
from asyncrl.run.stats import RunStats


def sample_record(kind: str, version: int, n: int = 2, text: str = "sort:cba=") -> dict:
    items = [
        {"prompt": text, "completion": f"abc{i}</s>", "reward": 0.5 * i, "finish_reason": "stop"} for i in range(n)
    ]
    return {"time": 3.0, "source": "generator/1", "samples/kind": kind, "samples/version": version,
            "samples/point": version, "samples/items": items}  # fmt: skip


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sample_records_go_to_samples_jsonl_one_line_per_completion_not_to_metrics(tmp_path):
    stats = RunStats(RunConfig(), tmp_path)
    metric = {"time": 2.0, "source": "generator/1", "generator/version": 0, "episodes/done": 8}
    stats.drain(Stream([metric, sample_record("eval", 0), sample_record("train", 10, n=1)]))
    stats.write_summary(tmp_path, "completed")
    assert read_metrics(tmp_path / "metrics.jsonl") == [metric]
    got = lines(tmp_path / "samples.jsonl")
    assert [(s["kind"], s["version"], s["generator"]) for s in got] == [
        ("eval", 0, "1"),
        ("eval", 0, "1"),
        ("train", 10, "1"),
    ]
    assert got[1] | {"time": 0} == {"time": 0, "kind": "eval", "version": 0, "point": 0, "generator": "1",
                                     "prompt": "sort:cba=", "completion": "abc1</s>", "reward": 0.5,
                                     "finish_reason": "stop"}  # fmt: skip


def test_a_samples_record_of_the_wrong_shape_is_skipped_and_counted(tmp_path):
    stats = RunStats(RunConfig(), tmp_path)
    bad = [{"samples/items": 3}, {"samples/items": ["text"]}]
    stats.drain(Stream([*bad, sample_record("eval", 0, n=1)]))
    assert stats.bad_records == 2 and len(lines(tmp_path / "samples.jsonl")) == 1
    assert stats.write_summary(tmp_path, "completed")["bad_metric_records"] == 2


def test_the_samples_log_is_bounded_and_rotated(tmp_path):
    log = SamplesLog(tmp_path, max_bytes=4000)
    for v in range(40):
        log.log(sample_lines(sample_record("train", v, n=2, text="p" * 100)))
    log.close()
    now, old = tmp_path / "samples.jsonl", tmp_path / "samples.jsonl.1"
    assert old.exists() and now.stat().st_size <= 4000 and old.stat().st_size <= 4000
    kept = [(s["version"], s["completion"]) for s in lines(old) + lines(now)]  # whole lines in both
    written = [(v, f"abc{i}</s>") for v in range(40) for i in range(2)]
    assert kept == written[-len(kept) :] and len(kept) > 10  # the newest, in order, none lost between the two
    assert not (tmp_path / "samples.jsonl.2").exists()


def test_an_oversized_text_is_cut_not_the_log(tmp_path):
    log = SamplesLog(tmp_path, max_bytes=100_000)
    log.log(sample_lines(sample_record("eval", 0, n=1, text="q" * 1_000_000)))
    log.close()
    (line,) = lines(tmp_path / "samples.jsonl")
    assert len(line["prompt"]) < 10_000 and line["prompt"].endswith("[... cut]")


def test_a_generator_renders_its_items_from_the_token_ids():
    from asyncrl.demo.model import build_tokenizer
    from asyncrl.generators.evaluation import sample_items

    tok = build_tokenizer()
    prompt = tok.encode("sort:cba=")
    played = [
        (SimpleNamespace(tokens=tok.encode("abc") + [tok.eos_token_id], finish_reason="stop"), Outcome({"r": 1.0})),
        (SimpleNamespace(tokens=tok.encode("ab"), finish_reason="length"), Outcome(None, cause="reward_error")),
        (SimpleNamespace(tokens=tok.encode("x"), finish_reason="stop"), Outcome({"r": 0.0})),
    ]
    items = sample_items(tok, [prompt] * 3, played, limit=2)
    assert items == [
        {"prompt": "sort:cba=", "completion": "abc</s>", "reward": 1.0, "finish_reason": "stop"},
        {
            "prompt": "sort:cba=",
            "completion": "ab",
            "reward": None,
            "finish_reason": "length",
            "failed": "reward_error",
        },
    ]


def test_dry_run_shows_the_first_prompts_as_the_model_sees_them():
    from transformers import AutoTokenizer

    from asyncrl.chat import ChatTokens
    from asyncrl.config import load_config
    from asyncrl.data import load_jsonl, prompt_for_sequence, prompt_of

    done = asyncrl("launch", "--config", "configs/demo-cpu.yaml", "--dry-run", "--show-prompts", "3")
    assert done.returncode == 0, done.stderr
    cfg = load_config(ROOT / "configs/demo-cpu.yaml")
    chat = ChatTokens(AutoTokenizer.from_pretrained(ROOT / cfg.model.path), use_template=cfg.episode.chat_template)
    records = load_jsonl(ROOT / cfg.data.train)
    for seq in range(3):
        _, idx = prompt_for_sequence(seq, len(records), cfg.run.seed)
        ids = chat.prompt_ids(prompt_of(records[idx]))
        assert f"--- prompt {seq + 1} of 3 ({cfg.data.train}:{idx + 1}, {len(ids)} tokens)" in done.stdout
        assert chat.tok.decode(ids) in done.stdout
    assert "--- prompt 4" not in done.stdout
    assert done.stdout.startswith("run:")  # the resolved config first, as a plain --dry-run prints it


def test_show_prompts_goes_with_dry_run():
    done = asyncrl("launch", "--config", "configs/demo-cpu.yaml", "--show-prompts", "3")
    assert_one_line_error(done, "--show-prompts", "--dry-run")


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.vllm
def test_a_launch_keeps_samples_of_every_eval_and_of_training(tmp_path):
    pytest.importorskip("vllm")
    cmd = demo_launch_cmd(tmp_path, "samples", "--generators", "1", "--learners", "1", "--steps", "4")
    done = subprocess.run([*cmd, "--set", "run.eval_every=2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = lines(tmp_path / "samples" / "samples.jsonl")
    evals = {(s["point"], s["version"]) for s in got if s["kind"] == "eval"}
    assert all(point <= version for point, version in evals) and {(0, 0), (4, 4)} <= evals, evals
    covered = set()  # every eval point, each evaluated at the first version served at or after it
    for r in read_metrics(tmp_path / "samples" / "metrics.jsonl"):
        covered |= set(r.get("eval/points") or [r["eval/point"]]) if "eval/point" in r else set()
    assert covered == {0, 2, 4}
    assert any(s["kind"] == "train" for s in got)
    for s in got:
        assert s["prompt"].startswith("sort:") and isinstance(s["completion"], str) and s["generator"] == "0"
        assert s["reward"] is None or 0.0 <= s["reward"] <= 1.0
    assert not [r for r in read_metrics(tmp_path / "samples" / "metrics.jsonl") if "samples/items" in r]
