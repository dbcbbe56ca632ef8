"""Seeds and identity from SLURM, Kubernetes and torchrun environments (p2pft/deploy/launch.py)."""
from __future__ import annotations

import pytest

from p2pft.deploy.launch import (LaunchError, Scheduler, cluster_args, detect, expand_hostlist, from_k8s, from_slurm,
                                 from_torchrun, place)


# ---------------------------------------------------------------------- SLURM hostlists
@pytest.mark.parametrize("text, hosts", [
    ("node1", ["node1"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[0]", ["n0"]),
    ("n[000-002]x", ["n000x", "n001x", "n002x"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("node[1-2],login, node[5]", ["node1", "node2", "login", "node5"]),
    ("c-[9-10].cluster", ["c-9.cluster", "c-10.cluster"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, needle", [
    ("", "empty hostlist"),
    ("node[1-3", "unbalanced '['"),
    ("node1-3]", "unbalanced ']'"),
    ("node[[1-2]]", "nested"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "bad range"),
    ("node[1-]", "bad range"),
    ("node[]", "bad range"),
    ("a,,b", "empty entry"),
    ("n[1-9999999]", "more than"),
])
def test_expand_hostlist_rejects(text: str, needle: str) -> None:
    with pytest.raises(LaunchError) as err:
        expand_hostlist(text)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------- SLURM
SLURM = {"SLURM_JOB_NODELIST": "node[01-03]", "SLURM_PROCID": "5", "SLURM_NODEID": "2", "SLURM_LOCALID": "1"}


def test_slurm_placement() -> None:
    p = from_slurm(SLURM, "r")
    assert p.scheduler is Scheduler.SLURM
    assert p.replica_id == "r5"
    assert p.seed_hosts == ("node01", "node02", "node03")
    assert p.host == "node03"          # the nodelist entry of SLURM_NODEID
    assert p.port_offset == 1
    assert from_slurm({**SLURM, "SLURMD_NODENAME": "node02"}, "w").host == "node02"


@pytest.mark.parametrize("env, needle", [
    ({}, "SLURM_JOB_NODELIST is not set"),
    ({**SLURM, "SLURM_PROCID": ""}, "SLURM_PROCID is not set"),
    ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not a number"),
    ({**SLURM, "SLURM_PROCID": "-1"}, "negative"),
    ({**SLURM, "SLURM_NODEID": "3"}, "SLURM_NODEID=3 but SLURM_JOB_NODELIST has 3 host(s)"),
    ({**SLURM, "SLURM_JOB_NODELIST": "node[2-1]"}, "SLURM_JOB_NODELIST: range"),
])
def test_slurm_rejects(env: dict[str, str], needle: str) -> None:
    with pytest.raises(LaunchError) as err:
        from_slurm(env, "r")
    assert needle in str(err.value)


# ---------------------------------------------------------------------- Kubernetes
def test_k8s_resolves_the_service_with_the_real_resolver() -> None:
    p = from_k8s({"P2PFT_K8S_SERVICE": "localhost", "HOSTNAME": "trainer-2", "POD_IP": "10.1.2.3"}, 7000)
    assert p.scheduler is Scheduler.K8S
    assert p.replica_id == "trainer-2"
    assert "127.0.0.1" in p.seed_hosts
    assert list(p.seed_hosts) == sorted(set(p.seed_hosts), key=lambda a: (":" in a, a))  # v4 first, no duplicates
    assert p.host == "10.1.2.3"


@pytest.mark.parametrize("env, needle", [
    ({"HOSTNAME": "t-0"}, "P2PFT_K8S_SERVICE is not set"),
    ({"P2PFT_K8S_SERVICE": "localhost"}, "HOSTNAME is not set"),
    ({"P2PFT_K8S_SERVICE": "nohost.invalid", "HOSTNAME": "t-0"},
     "'nohost.invalid' (P2PFT_K8S_SERVICE) does not resolve"),
    ({"P2PFT_K8S_SERVICE": "localhost", "HOSTNAME": "t-0", "POD_IP": "pod"}, "POD_IP='pod' is not an IP address"),
])
def test_k8s_rejects(env: dict[str, str], needle: str) -> None:
    with pytest.raises(LaunchError) as err:
        from_k8s(env, 7000, wait=0.0)
    assert needle in str(err.value)


# ---------------------------------------------------------------------- torchrun
def test_torchrun_placement() -> None:
    p = from_torchrun({"MASTER_ADDR": "head", "GROUP_RANK": "3", "LOCAL_RANK": "2"}, "r")
    assert (p.replica_id, p.seed_hosts, p.host, p.port_offset) == ("r3-2", ("head",), None, 2)


@pytest.mark.parametrize("env, needle", [
    ({"GROUP_RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR is not set"),
    ({"MASTER_ADDR": "h", "LOCAL_RANK": "0"}, "GROUP_RANK is not set"),
    ({"MASTER_ADDR": "h", "GROUP_RANK": "0", "LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not a number"),
])
def test_torchrun_rejects(env: dict[str, str], needle: str) -> None:
    with pytest.raises(LaunchError) as err:
        from_torchrun(env, "r")
    assert needle in str(err.value)


# ---------------------------------------------------------------------- detection and precedence
def test_detect_and_auto() -> None:
    assert detect(SLURM) is Scheduler.SLURM
    assert detect({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "P2PFT_K8S_SERVICE": "svc"}) is Scheduler.K8S
    assert detect({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is None        # no Service named: not ours
    assert detect({"MASTER_ADDR": "h", "GROUP_RANK": "0", "LOCAL_RANK": "0"}) is Scheduler.TORCHRUN
    assert place("auto", SLURM, role="w", port=7000).replica_id == "w5"
    with pytest.raises(LaunchError, match="no SLURM job"):
        place("auto", {}, role="r", port=7000)
    with pytest.raises(LaunchError, match="must be one of"):
        place("mesos", {}, role="r", port=7000)


def test_scheduler_fills_only_what_the_user_left_open() -> None:
    derived = cluster_args(seeds_from="slurm", listen="0.0.0.0:7100", advertise=None, seeds=[], replica_id=None,
                           role="r", seed_port=7000, max_seeds=2, env=SLURM)
    assert derived.listen == "0.0.0.0:7101"                        # base port + SLURM_LOCALID
    assert derived.advertise == "node03:7101"                      # wildcard listen: the node's name
    assert derived.seeds == ["node01:7000", "node02:7000"]         # first max_seeds hosts at the seed port
    assert derived.replica_id == "r5"
    given = cluster_args(seeds_from="slurm", listen="10.0.0.5:7100", advertise="gw:9", seeds=["a:1"],
                         replica_id="mine", role="r", env=SLURM)
    assert (given.advertise, given.seeds, given.replica_id) == ("gw:9", ["a:1"], "mine")
    assert given.listen == "10.0.0.5:7101"
    off = cluster_args(seeds_from=None, listen="127.0.0.1:0", advertise=None, seeds=["x:1"], replica_id=None,
                       role="r", env=SLURM)
    assert (off.listen, off.seeds, off.replica_id, off.placement) == ("127.0.0.1:0", ["x:1"], None, None)


@pytest.mark.parametrize("kw, needle", [
    ({"listen": "0.0.0.0:0"}, "needs a fixed listen port"),
    ({"max_seeds": 0}, "--max-seeds must be at least 1"),
    ({"seed_port": 70000}, "--seed-port 70000 is out of range"),
])
def test_cluster_args_rejects(kw: dict, needle: str) -> None:
    args = dict(seeds_from="slurm", listen="0.0.0.0:7000", advertise=None, seeds=[], replica_id=None, role="r",
                env=SLURM)
    args.update(kw)
    with pytest.raises(LaunchError) as err:
        cluster_args(**args)
    assert needle in str(err.value)


def test_data_and_metrics_ports_follow_the_offset() -> None:
    from p2pft.deploy.launch import data_addrs, offset_port
    ca = cluster_args(seeds_from="torchrun", listen="0.0.0.0:7100", advertise=None, seeds=[], replica_id=None,
                      role="r", env={"MASTER_ADDR": "head", "GROUP_RANK": "1", "LOCAL_RANK": "3"})
    assert ca.listen == "0.0.0.0:7103" and ca.seeds == ["head:7100"] and ca.replica_id == "r1-3"
    listen, adv = data_addrs(ca, "0.0.0.0:7300", None)
    assert listen == "0.0.0.0:7303" and adv is not None and adv.endswith(":7303")
    assert data_addrs(ca, "10.0.0.1:7300", "gw:1") == ("10.0.0.1:7303", "gw:1")
    assert data_addrs(ca, None, None) == (None, None)
    assert offset_port(ca, "9400") == "9403" and offset_port(ca, "0.0.0.0:9400") == "0.0.0.0:9403"
    plain = cluster_args(seeds_from=None, listen="127.0.0.1:0", advertise=None, seeds=[], replica_id="x", role="r")
    assert offset_port(plain, "9400") == "9400" and data_addrs(plain, "0.0.0.0:1", None) == ("0.0.0.0:1", None)
