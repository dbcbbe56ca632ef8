"""One options object for every algorithm: checked once with its cross-constraints, built whole or
overridden by keyword, the CLI's flags derived from it, one positional order everywhere."""
from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from p2pft.trainer import HSDP, DiLoCo, FaultTolerant, Options
from p2pft.trainer.examples.local_sgd import LocalSGD
from p2pft.trainer.job.cli import JOB_FIELDS, add_job_args, job_kwargs
from p2pft.trainer.kernel.options import JobOptions, TargetKind

BAD = [
    ({"batch_per_replica": 0}, "batch_per_replica"),
    ({"batch_per_replica": True}, "batch_per_replica"),
    ({"min_replicas": 0}, "min_replicas"),
    ({"total_steps": 0}, "total_steps"),
    ({"total_steps": 4, "total_samples": 8}, "total_steps or total_samples"),
    ({"start_timeout": 0}, "start_timeout"),
    ({"on_finished": "later"}, "on_finished"),
    ({"initial_state": "guess"}, "initial_state"),
    ({"step_timeout": -1}, "step_timeout"),
    ({"loop_timeout": 0}, "loop_timeout"),
    ({"comm_timeout": 30.0, "loop_timeout": 20.0}, "loop_timeout"),
    ({"lr_policy": "cubic"}, "cubic"),
    ({"nominal_replicas": 0}, "nominal_replicas"),
    ({"max_slots": 0}, "max_slots"),
    ({"checkpoint_every": 5}, "checkpoint_every needs a checkpoint_dir"),
    ({"checkpoint_dir": "/ckpt", "checkpoint_every": -1}, "checkpoint_every"),
    ({"checkpoint_dir": "/ckpt", "checkpoint_keep": 0}, "checkpoint_keep"),
]


@pytest.mark.parametrize("kw,names", BAD, ids=[next(iter(k)) for k, _ in BAD])
def test_a_bad_value_is_one_error_naming_the_keyword(kw: dict[str, object], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        Options(**{"batch_per_replica": 4, **kw})  # type: ignore[arg-type]


def test_the_job_checks_itself_however_it_is_built() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        JobOptions(min_replicas=0)


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="lr_polcy"):
        Options.of(Options(batch_per_replica=4), lr_polcy="sqrt")


def test_built_whole_then_overridden() -> None:
    base = Options(batch_per_replica=8, total_steps=60, min_replicas=2)
    got = Options.of(base, step_timeout=30.0)
    assert (got.batch_per_replica, got.total_steps, got.min_replicas, got.step_timeout) == (8, 60, 2, 30.0)
    assert Options.of(base) is base and base.step_timeout == 120.0
    with pytest.raises(TypeError):
        Options.of({"batch_per_replica": 8})  # type: ignore[arg-type]


def test_the_engine_options_take_the_runtime_where_left_to_it() -> None:
    eng = Options(batch_per_replica=4).engine(comm_timeout=5.0, secret=b"s")
    assert eng.timeouts.comm_timeout == 5.0 and eng.plane.secret == b"s" and eng.update.lr_policy == "sqrt"
    own = Options(batch_per_replica=4, comm_timeout=2.0, secret=b"mine").engine(comm_timeout=5.0, secret=b"s")
    assert own.timeouts.comm_timeout == 2.0 and own.plane.secret == b"mine"
    with pytest.raises(ValueError, match="loop_timeout"):   # against the Runtime's, once it is known
        Options(batch_per_replica=4, loop_timeout=3.0).engine(comm_timeout=5.0, secret=None)


def test_a_span_counts_the_loops_steps() -> None:
    eng = Options(batch_per_replica=4, total_steps=12).engine(comm_timeout=1.0, secret=None, span=4)
    assert eng.batch_per_replica == 16 and eng.job.target is not None
    assert (eng.job.target.kind, eng.job.target.n) == (TargetKind.STEPS, 3)
    with pytest.raises(ValueError, match="multiple of the span"):   # no silent flooring
        Options(batch_per_replica=4, total_steps=10).engine(comm_timeout=1.0, secret=None, span=4)


def test_the_cli_flags_are_the_options_fields_with_their_defaults() -> None:
    p = argparse.ArgumentParser()
    add_job_args(p)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--min-replicas", type=int, default=1)
    kw = job_kwargs(p.parse_args([]))
    defaults = {f.name: f.default for f in dataclasses.fields(Options)}
    assert set(JOB_FIELDS) <= set(defaults)
    assert {k: kw[k] for k in JOB_FIELDS} == {k: defaults[k] for k in JOB_FIELDS}
    Options(batch_per_replica=4, **kw)   # every flag is a keyword Options takes


@pytest.mark.parametrize("algo", [FaultTolerant, HSDP, DiLoCo, LocalSGD], ids=lambda a: a.__name__)
def test_one_positional_order_for_every_algorithm(algo: type) -> None:
    params = list(inspect.signature(algo.__init__).parameters.values())[1:5]
    assert [p.name for p in params][0] == "runtime" and params[3].name == "options"
    assert params[1].name == "model" and params[2].name.endswith("optimizer")
