"""A prompt source a launch cannot read (issue 49): one line naming the source, exit 2, before anything starts,
for each way users get it wrong. The rules behind each message: tests/core/test_sources.py."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from demo_launch import DEMO, assert_one_line_error, asyncrl


def sort_parquet(path, letters=("cba", "fed"), answers=("abc", "def")) -> str:
    pq.write_table(pa.table({"letters": list(letters), "answer": list(answers)}), path)
    return str(path)


def launch_with(tmp_path, train: str) -> None:
    """``--dry-run`` of the demo with ``train`` as data.train (YAML), its output dir under ``tmp_path``."""
    return asyncrl("launch", "--config", str(DEMO), "--set", f"run.out_dir={tmp_path}/runs", "--set",
                   f"data.train={train}", "--dry-run")  # fmt: skip


def write_bad(tmp_path, case: str) -> tuple[str, str]:
    """The source's YAML for ``case`` and what its one error line must say."""
    good = sort_parquet(tmp_path / "good.parquet")
    if case == "missing column":
        return f"{{path: {good}, columns: {{prompt: question}}}}", "no column 'question' (columns.prompt)"
    if case == "wrong type":
        pq.write_table(pa.table({"prompt": [1, 2], "answer": ["a", "b"]}), tmp_path / "ints.parquet")
        return str(tmp_path / "ints.parquet"), "column 'prompt' (the prompt) holds Value('int64'), not strings"
    if case == "empty shard":
        (tmp_path / "shards").mkdir()
        sort_parquet(tmp_path / "shards" / "a.parquet")
        sort_parquet(tmp_path / "shards" / "b.parquet", (), ())
        return f"{{path: '{tmp_path}/shards/*.parquet', template: 'sort:{{letters}}='}}", "b.parquet has no rows"
    if case == "corrupt parquet":
        data = (tmp_path / "good.parquet").read_bytes()
        (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
        return str(tmp_path / "cut.parquet"), "is not a readable Parquet file"
    if case == "glob matching nothing":
        return f"'{tmp_path}/none/*.parquet'", "the glob matches no file"
    assert case == "weight not positive"
    return f"[{{path: {good}, template: 'sort:{{letters}}=', weight: 0}}]", "greater than 0"


@pytest.mark.parametrize(
    "case",
    ["missing column", "wrong type", "empty shard", "corrupt parquet", "glob matching nothing", "weight not positive"],
)
def test_a_bad_source_stops_the_launch_with_one_line(tmp_path, case):
    train, needle = write_bad(tmp_path, case)
    proc = launch_with(tmp_path, train)
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc, needle)
    if case != "weight not positive":  # the config's own error names the field instead
        assert str(tmp_path) in proc.stderr.splitlines()[0]
    assert not (tmp_path / "runs").exists()  # nothing started


def test_a_mapped_parquet_source_passes_the_same_checks(tmp_path):
    good = sort_parquet(tmp_path / "good.parquet")
    proc = launch_with(tmp_path, f"{{path: {good}, template: 'sort:{{letters}}='}}")
    assert proc.returncode == 0, proc.stderr
