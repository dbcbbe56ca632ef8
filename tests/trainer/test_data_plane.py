"""The trainer's choice of data plane with a real Runtime: an impossible 'nccl' fails before the
engine serves state; 'tcp' and 'auto' on CPU tensors build tcp communicators."""
from __future__ import annotations

import pytest
import torch

from p2pft import Runtime
from p2pft.trainer import FaultTolerant
from p2pft.transport.backend import Backend, DataPlane, DataPlaneError


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = torch.nn.Linear(4, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def test_nccl_with_cpu_tensors_fails_before_serving_state() -> None:
    rt = Runtime(replica_id="r0", data_plane="tcp").start()
    try:
        m, opt = _model()
        with pytest.raises(DataPlaneError, match="needs the step buffer on a CUDA device"):
            FaultTolerant(rt, m, opt, batch_per_replica=2, data_plane="nccl")
        assert rt.data._provider is None, "the engine served state before refusing"
    finally:
        rt.close()


@pytest.mark.parametrize("plane", ["tcp", "auto", None])
def test_cpu_replica_builds_tcp_communicators(plane: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PFT_DATA_PLANE", "tcp")
    rt = Runtime(replica_id="r0", data_plane=plane).start()
    ft = None
    try:
        assert rt.data_plane is (DataPlane(plane) if plane else DataPlane.TCP)
        m, opt = _model()
        ft = FaultTolerant(rt, m, opt, batch_per_replica=2, loop_timeout=None)
        assert ft.kernel.backend is Backend.TCP and ft.kernel.comms.backend is Backend.TCP
        assert rt.wait_view(lambda v: v.role_of(rt.node_id) is not None, 10.0) is not None
        idx = ft.begin()
        m(torch.randn(len(idx) or 1, 4)).sum().backward()
        res = ft.commit()
        assert res.committed and res.contributors == 1
        comm = ft.kernel.comms.get(rt.view.data_epoch, 0, rt.view.shard_addrs(0))
        assert type(comm).__name__ == "StagingTcpCommunicator"
    finally:
        if ft is not None:
            ft.close()
        rt.close()


def test_state_requests_round_trip_and_malformed_ones_are_refused() -> None:
    """The requests replicas send each other are typed on both sides of the wire edge."""
    import pytest as _pytest

    from p2pft.trainer.kernel.requests import RequestKind, StateRequest
    for req in (StateRequest.snapshot(7, 1), StateRequest.grads(3, 5, 0), StateRequest.signature(9),
                StateRequest.initial(True), StateRequest.initial(False), StateRequest.checked(False, "r2")):
        assert StateRequest.from_wire(req.to_wire()) == req
    assert StateRequest.from_wire({"kind": "grads", "from": 1, "to": 2}).kind is RequestKind.GRADS
    for bad in ({"kind": "nope"}, {"kind": "grads", "from": 1}, {"kind": "sig", "step": "3"},
                {"kind": "snapshot", "min_step": True}, ["snapshot"], {"kind": "checked", "ok": 1, "who": "r"}):
        with _pytest.raises((KeyError, TypeError, ValueError)):
            StateRequest.from_wire(bad)
