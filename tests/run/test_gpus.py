"""The local launch's GPU layout (asyncrl/run/gpus.py): the learners' GPUs first, one GPU per generator after
them, and the layouts NCCL refuses said in one line before anything starts."""

from types import SimpleNamespace

import pytest

from asyncrl.errors import UserError
from asyncrl.run import gpus
from asyncrl.run.gpus import plan_gpus, visible_gpus


def run(learners=1, generators=1, weights="shm", remote_learners=0):
    return SimpleNamespace(
        run=SimpleNamespace(learners=learners, remote_learners=remote_learners, generators=generators),
        weights=SimpleNamespace(type=weights),
    )


def test_no_gpus_names_none():
    plan = plan_gpus(run(learners=2, generators=4), [])
    assert plan.learners == [] and plan.generator_env(0) == {}


def test_generators_get_the_gpus_after_the_learners_round_robin():
    plan = plan_gpus(run(learners=2, generators=3), ["0", "1", "2", "3"])
    assert plan.learners == ["0", "1"]
    assert plan.generators == ["2", "3", "2"]
    assert [plan.generator_env(i) for i in range(3)] == [{"CUDA_VISIBLE_DEVICES": g} for g in ("2", "3", "2")]


def test_generators_share_the_learners_gpus_when_none_is_left():
    plan = plan_gpus(run(learners=2, generators=3), ["4", "7"])  # names as CUDA_VISIBLE_DEVICES gives them
    assert plan.learners == ["4", "7"] and plan.generators == ["4", "7", "4"]


def test_remote_learner_ranks_take_no_local_gpu():
    plan = plan_gpus(run(learners=3, remote_learners=2, generators=2), ["0", "1", "2"])
    assert plan.learners == ["0"] and plan.generators == ["1", "2"]


def test_more_learner_ranks_than_gpus_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"3 learner ranks on this host need a GPU each and it has 2 .*--learners 2"):
        plan_gpus(run(learners=3), ["0", "1"])


@pytest.mark.parametrize(
    "learners, generators, n, fits",
    [(1, 1, 2, True), (1, 3, 4, True), (2, 2, 4, True), (1, 1, 1, False), (1, 2, 2, False), (2, 3, 4, False)],
)
def test_nccl_weights_need_rank_0_and_every_generator_on_a_gpu_of_its_own(learners, generators, n, fits):
    cfg, names = run(learners=learners, generators=generators, weights="nccl"), [str(i) for i in range(n)]
    if fits:
        plan = plan_gpus(cfg, names)
        members = plan.learners[:1] + plan.generators
        assert len(set(members)) == len(members)
    else:
        more = f"at most {n - learners} generators" if n > learners else "a host with more GPUs"
        with pytest.raises(UserError, match=rf"^weights.type=nccl needs learner rank 0 and every generator on a GPU "
                           rf"of its own .*: {generators} generators .* on {n} GPUs here; .*, or {more}$"):  # fmt: skip
            plan_gpus(cfg, names)
    plan_gpus(run(learners=learners, generators=generators, weights="shm"), names)  # shm shares GPUs freely


def test_visible_gpus_reads_the_driver_and_cuda_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "NVIDIA", tmp_path / "nvidia")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() == []  # no driver: no GPU, and torch is not asked
    (tmp_path / "nvidia" / "gpus").mkdir(parents=True)
    (tmp_path / "nvidia" / "version").write_text("NVRM version: 580\n")
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (tmp_path / "nvidia" / "gpus" / bus).mkdir()
    assert visible_gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-5e1f,-1,2")
    assert visible_gpus() == ["3", "GPU-5e1f"]  # CUDA stops at the first invalid entry
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
