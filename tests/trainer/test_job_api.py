"""The job API on one real replica (a Runtime that forms a cluster of one, a real model):
``Stopped`` from every call of the loop is one exception type, the end barrier and what a
replica sees after it, the leader, and the options' checks."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from p2pft import Runtime
from p2pft.trainer import FaultTolerant, JobFinished, StepLoader, Stopped


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.fixture
def replica() -> Iterator[tuple[Runtime, FaultTolerant, torch.nn.Module]]:
    rt = Runtime(replica_id="r0", data_plane="tcp").start()
    model, opt = _model()
    ft = FaultTolerant(rt, model, opt, batch_per_replica=4, total_steps=3, start_timeout=20.0)
    yield rt, ft, model
    ft.close()
    rt.close()


def _step(ft: FaultTolerant, model: torch.nn.Module) -> None:
    idx = ft.begin()
    ft.zero_grad()
    if idx:
        x = torch.tensor(idx, dtype=torch.float32).unsqueeze(1).repeat(1, 8) / 100
        model(x).pow(2).mean().backward()
    ft.commit()


def test_stop_raises_stopped_from_begin_next_batch_commit_and_finish(replica) -> None:
    rt, ft, model = replica
    _step(ft, model)
    assert ft.step == 1 and ft.is_leader and ft.leader == "r0"
    ft.begin()
    ft.request_stop()
    with pytest.raises(Stopped):
        ft.commit()
    with pytest.raises(Stopped):
        ft.begin()
    loader = StepLoader(ft, [torch.zeros(8)] * 64)
    with pytest.raises(Stopped):
        loader.next_batch()
    with pytest.raises(Stopped):
        ft.finish(timeout=5.0)
    assert ft.step == 1, "a stopped replica committed"


def test_finish_ends_the_job_and_a_begin_after_it_is_job_finished(replica) -> None:
    rt, ft, model = replica
    while not ft.done:
        _step(ft, model)
    assert ft.step == 3
    assert ft.finish(timeout=20.0) == 3
    view = rt.view
    assert view is not None and view.finished == 3 and str(view.target) == "3 steps"
    with pytest.raises(JobFinished) as exc:
        ft.begin()
    assert isinstance(exc.value, Stopped) and exc.value.step == 3
    assert ft.finish() == 3, "finish() twice is the same end"


@pytest.mark.parametrize("kw", [{"total_steps": 0}, {"total_steps": 3, "total_samples": 9}, {"min_replicas": 0},
                                {"on_finished": "later"}, {"initial_state": "maybe"}, {"start_timeout": 0}])
def test_bad_job_options_are_one_clear_error(kw: dict) -> None:
    rt = Runtime(replica_id="r0", data_plane="tcp").start()
    try:
        model, opt = _model()
        with pytest.raises(ValueError):
            FaultTolerant(rt, model, opt, batch_per_replica=4, **kw)
    finally:
        rt.close()


@pytest.mark.parametrize("kw,name", [({"loop_timeout": 5.0}, "loop_timeout"), ({"max_slots": 0}, "max_slots"),
                                     ({"nominal_replicas": 0}, "nominal_replicas"),
                                     ({"lr_policy": "cube"}, "lr_policy|cube")])
def test_bad_engine_options_name_the_option(kw: dict, name: str) -> None:
    """The grouped options (trainer/kernel/options.py) still name the keyword the user wrote."""
    rt = Runtime(replica_id="r0", data_plane="tcp", comm_timeout=10.0).start()
    try:
        model, opt = _model()
        with pytest.raises(ValueError, match=name):
            FaultTolerant(rt, model, opt, batch_per_replica=4, **kw)
    finally:
        rt.close()
