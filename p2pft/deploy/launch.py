"""Seeds and identity from the job scheduler: SLURM, Kubernetes, torchrun.

A batch job knows where its processes run before any of them starts, so a peer or a replica
need not be told its seeds by hand: ``--seeds-from slurm|k8s|torchrun|auto`` derives them, the
replica id, the address peers should use (when the process listens on a wildcard address) and
a port offset for several processes on one host.

Precedence, highest first: the command line (``--seeds``, ``--replica-id``, ``--advertise``),
then the ``P2PFT_*`` environment variables, then what the scheduler says, then the defaults.
A value the user gave is never replaced; the scheduler only fills the gaps.

- SLURM: hosts from ``SLURM_JOB_NODELIST`` (hostlist syntax, ``node[01-04,07]``), replica id
  ``<role><SLURM_PROCID>``, own host ``SLURMD_NODENAME`` (else the nodelist entry of
  ``SLURM_NODEID``), port offset ``SLURM_LOCALID``.
- Kubernetes: seeds are every address the headless Service ``P2PFT_K8S_SERVICE`` resolves to
  (``getaddrinfo``), replica id the pod name (``HOSTNAME``), own host ``POD_IP``.
- torchrun: the seed host is ``MASTER_ADDR``, replica id ``<role><GROUP_RANK>-<LOCAL_RANK>``,
  port offset ``LOCAL_RANK`` (every process of the job is one replica).

Seeds are ``host:seed_port`` for the first ``max_seeds`` hosts in the scheduler's order, where
``seed_port`` defaults to this process's own base listen port: the usual layout of one port
per role on every host. Bad input raises ``LaunchError`` with one line that names the variable.
"""
from __future__ import annotations

import enum
import ipaddress
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..transport.addr import is_wildcard, join_hostport, parse_hostport, reachable_host

log = logging.getLogger(__name__)

MAX_HOSTS = 100_000        # a hostlist expanding to more than this is refused (a typo like [1-9999999])
DEFAULT_MAX_SEEDS = 3      # seeds taken from the scheduler's host list (every process takes the same ones)
K8S_RESOLVE_WAIT = 30.0    # seconds to keep resolving a headless Service that lists no address yet

Resolver = Callable[..., list]


class LaunchError(ValueError):
    """The scheduler's environment cannot give seeds or identity; the message is one line."""


class Scheduler(str, enum.Enum):
    SLURM = "slurm"
    K8S = "k8s"
    TORCHRUN = "torchrun"

    def __str__(self) -> str:
        return self.value


SEEDS_FROM_CHOICES = ("auto", "slurm", "k8s", "torchrun")


@dataclass(frozen=True)
class Placement:
    """What the scheduler says about this process."""

    scheduler: Scheduler
    replica_id: str
    seed_hosts: tuple[str, ...]        # in the scheduler's order; seeds are the first max_seeds
    host: str | None = None            # this process's address as peers reach it (None: unknown)
    port_offset: int = 0               # added to the base listen port (several processes per host)


@dataclass(frozen=True)
class ClusterArgs:
    """The addresses and identity a peer or replica starts with, after precedence."""

    listen: str
    advertise: str | None
    seeds: list[str]
    replica_id: str | None
    placement: Placement | None = None


# ---------------------------------------------------------------------- SLURM hostlists
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM hostlist: ``node[01-04,07]``, ``a[1-2],b3``, ``r[1-2]n[1-2]``.

    A range keeps the zero padding of its first bound (``[08-11]`` gives 08, 09, 10, 11);
    several bracket groups in one name expand as a product, in order. Raises LaunchError on an
    empty list, unbalanced brackets, a range that runs backwards or a non-numeric range."""
    text = (text or "").strip()
    if not text:
        raise LaunchError("empty hostlist")
    out: list[str] = []
    for item in _split_top_level(text):
        if not item:
            raise LaunchError(f"empty entry in hostlist {text!r}")
        expanded = _expand_item(item, text)
        out.extend(expanded)
        if len(out) > MAX_HOSTS:
            raise LaunchError(f"hostlist {text!r} expands to more than {MAX_HOSTS} hosts")
    return out


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"nested '[' in hostlist {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"unbalanced ']' in hostlist {text!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise LaunchError(f"unbalanced '[' in hostlist {text!r}")
    items.append("".join(cur).strip())
    return items


def _expand_item(item: str, whole: str) -> list[str]:
    names = [""]
    pos = 0
    while pos < len(item):
        lb = item.find("[", pos)
        if lb < 0:
            names = [n + item[pos:] for n in names]
            break
        rb = item.index("]", lb)   # balanced: checked by _split_top_level
        prefix, body = item[pos:lb], item[lb + 1:rb]
        values = _expand_ranges(body, whole)
        names = [n + prefix + v for n in names for v in values]
        if len(names) > MAX_HOSTS:
            raise LaunchError(f"hostlist {whole!r} expands to more than {MAX_HOSTS} hosts")
        pos = rb + 1
    return names


def _expand_ranges(body: str, whole: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise LaunchError(f"bad range {part!r} in hostlist {whole!r} (expected N or N-M)")
        lo_s, hi_s = m.group(1), m.group(2)
        lo, hi = int(lo_s), int(hi_s) if hi_s is not None else int(lo_s)
        if hi < lo:
            raise LaunchError(f"range {part!r} runs backwards in hostlist {whole!r}")
        if hi - lo + 1 > MAX_HOSTS:
            raise LaunchError(f"hostlist {whole!r} expands to more than {MAX_HOSTS} hosts")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        values.extend(str(v).zfill(width) for v in range(lo, hi + 1))
    return values


# ---------------------------------------------------------------------- environment readers
def _need(env: Mapping[str, str], name: str, scheduler: Scheduler) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise LaunchError(f"--seeds-from {scheduler}: {name} is not set")
    return value


def _int(env: Mapping[str, str], name: str, scheduler: Scheduler, default: int | None = None) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        if default is not None:
            return default
        raise LaunchError(f"--seeds-from {scheduler}: {name} is not set")
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"--seeds-from {scheduler}: {name}={raw!r} is not a number") from None
    if value < 0:
        raise LaunchError(f"--seeds-from {scheduler}: {name}={raw!r} is negative")
    return value


def from_slurm(env: Mapping[str, str], role: str) -> Placement:
    """Placement of one SLURM task (one task per replica or witness)."""
    s = Scheduler.SLURM
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist.strip():
        raise LaunchError("--seeds-from slurm: SLURM_JOB_NODELIST is not set (not inside a SLURM job?)")
    try:
        hosts = expand_hostlist(nodelist)
    except LaunchError as exc:
        raise LaunchError(f"--seeds-from slurm: SLURM_JOB_NODELIST: {exc}") from None
    procid = _int(env, "SLURM_PROCID", s)
    nodeid = _int(env, "SLURM_NODEID", s, default=0)
    if nodeid >= len(hosts):
        raise LaunchError(f"--seeds-from slurm: SLURM_NODEID={nodeid} but SLURM_JOB_NODELIST has "
                          f"{len(hosts)} host(s)")
    host = env.get("SLURMD_NODENAME", "").strip() or hosts[nodeid]
    return Placement(s, f"{role}{procid}", tuple(hosts), host, _int(env, "SLURM_LOCALID", s, default=0))


def from_k8s(env: Mapping[str, str], port: int, *, resolver: Resolver = socket.getaddrinfo,
             wait: float = K8S_RESOLVE_WAIT, sleep: Callable[[float], None] = time.sleep) -> Placement:
    """Placement of one pod: the headless Service's addresses are the seeds, the pod name is
    the replica id. A Service that does not resolve yet (pods still starting) is retried for
    `wait` seconds before the error."""
    s = Scheduler.K8S
    service = _need(env, "P2PFT_K8S_SERVICE", s)
    replica_id = _need(env, "HOSTNAME", s)
    deadline = time.monotonic() + wait
    while True:
        try:
            infos = resolver(service, port, type=socket.SOCK_STREAM)
            hosts = sorted({str(info[4][0]) for info in infos}, key=_addr_key)
        except (OSError, UnicodeError) as exc:   # socket.gaierror is an OSError
            hosts, why = [], str(getattr(exc, "strerror", None) or exc)
        else:
            why = "no address"
        if hosts:
            break
        if time.monotonic() >= deadline:
            raise LaunchError(f"--seeds-from k8s: headless Service {service!r} (P2PFT_K8S_SERVICE) does not "
                              f"resolve: {why}")
        log.warning("headless Service %r does not resolve yet (%s); retrying", service, why)
        sleep(1.0)
    own = env.get("POD_IP", "").strip() or None
    if own is not None:
        try:
            ipaddress.ip_address(own)
        except ValueError:
            raise LaunchError(f"--seeds-from k8s: POD_IP={own!r} is not an IP address") from None
    return Placement(s, replica_id, tuple(hosts), own, 0)


def _addr_key(addr: str) -> tuple[int, int, str]:
    """Numeric order for IPs (every pod sorts the Service's addresses the same way)."""
    try:
        ip = ipaddress.ip_address(addr)
        return (ip.version, int(ip), addr)
    except ValueError:
        return (9, 0, addr)


def from_torchrun(env: Mapping[str, str], role: str) -> Placement:
    """Placement of one torchrun process, each process one replica: the rendezvous host
    (MASTER_ADDR) is the seed host; local rank r listens on the base port + r."""
    s = Scheduler.TORCHRUN
    master = _need(env, "MASTER_ADDR", s)
    group = _int(env, "GROUP_RANK", s)
    local = _int(env, "LOCAL_RANK", s)
    return Placement(s, f"{role}{group}-{local}", (master,), None, local)


def detect(env: Mapping[str, str]) -> Scheduler | None:
    """The scheduler this process runs under, by its environment (SLURM, then Kubernetes
    with P2PFT_K8S_SERVICE set, then torchrun)."""
    if env.get("SLURM_JOB_NODELIST") and env.get("SLURM_PROCID"):
        return Scheduler.SLURM
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("P2PFT_K8S_SERVICE"):
        return Scheduler.K8S
    if env.get("MASTER_ADDR") and env.get("GROUP_RANK") and env.get("LOCAL_RANK"):
        return Scheduler.TORCHRUN
    return None


def place(mode: str, env: Mapping[str, str], *, role: str, port: int, resolver: Resolver = socket.getaddrinfo,
          wait: float = K8S_RESOLVE_WAIT) -> Placement:
    """The placement `mode` (one of SEEDS_FROM_CHOICES) gives in `env`."""
    if mode == "auto":
        found = detect(env)
        if found is None:
            raise LaunchError("--seeds-from auto: no SLURM job (SLURM_JOB_NODELIST, SLURM_PROCID), Kubernetes pod "
                              "(KUBERNETES_SERVICE_HOST with P2PFT_K8S_SERVICE) or torchrun process "
                              "(MASTER_ADDR, GROUP_RANK, LOCAL_RANK) found in the environment")
        mode = found.value
    if mode == Scheduler.SLURM.value:
        return from_slurm(env, role)
    if mode == Scheduler.K8S.value:
        return from_k8s(env, port, resolver=resolver, wait=wait)
    if mode == Scheduler.TORCHRUN.value:
        return from_torchrun(env, role)
    raise LaunchError(f"--seeds-from must be one of {', '.join(SEEDS_FROM_CHOICES)}, got {mode!r}")


# ---------------------------------------------------------------------- options
def add_launch_args(p: Any) -> None:
    """--seeds-from, --seed-port, --max-seeds (env P2PFT_SEEDS_FROM, P2PFT_SEED_PORT,
    P2PFT_MAX_SEEDS, read by the caller so that the command line wins)."""
    p.add_argument("--seeds-from", choices=SEEDS_FROM_CHOICES, default=None,
                   help="derive seeds, replica id and advertised address from the scheduler (env P2PFT_SEEDS_FROM)")
    p.add_argument("--seed-port", type=int, default=None,
                   help="port the seeds listen on, with --seeds-from (default: this process's base listen port; "
                        "env P2PFT_SEED_PORT)")
    p.add_argument("--max-seeds", type=int, default=None,
                   help=f"seeds taken from the scheduler's host list (default {DEFAULT_MAX_SEEDS}; "
                        "env P2PFT_MAX_SEEDS)")


def env_int(env: Mapping[str, str], name: str) -> int | None:
    """An optional integer P2PFT_* variable; LaunchError naming it when it is not one."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a number") from None


# ---------------------------------------------------------------------- precedence

def cluster_args(*, seeds_from: str | None, listen: str, advertise: str | None, seeds: Sequence[str],
                 replica_id: str | None, role: str, seed_port: int | None = None,
                 max_seeds: int = DEFAULT_MAX_SEEDS, env: Mapping[str, str] | None = None,
                 resolver: Resolver = socket.getaddrinfo, wait: float = K8S_RESOLVE_WAIT) -> ClusterArgs:
    """Fill what the user left open from the scheduler. `listen`, `advertise`, `seeds` and
    `replica_id` are the values already taken from the command line or P2PFT_* (they win).

    `role` prefixes derived replica ids ("r" for replicas, "w" for witnesses). With a scheduler
    the listen port is the job's base port: the process listens on base + port offset."""
    if not seeds_from or seeds_from == "none":
        return ClusterArgs(listen, advertise, list(seeds), replica_id)
    env = os.environ if env is None else env
    host, base = parse_hostport(listen, "--listen")
    if base == 0:
        raise LaunchError(f"--seeds-from {seeds_from} needs a fixed listen port (got {listen!r}): every process "
                          "of the job must know where the seeds listen")
    if max_seeds < 1:
        raise LaunchError(f"--max-seeds must be at least 1, got {max_seeds}")
    sport = seed_port if seed_port else base
    if not 0 < sport <= 65535:
        raise LaunchError(f"--seed-port {sport} is out of range")
    p = place(seeds_from, env, role=role, port=sport, resolver=resolver, wait=wait)
    port = base + p.port_offset
    if port > 65535:
        raise LaunchError(f"listen port {base} + offset {p.port_offset} is out of range")
    listen_out = join_hostport(host, port)
    out_seeds = list(seeds) or [join_hostport(h, sport) for h in p.seed_hosts[:max_seeds]]
    adv = advertise
    if adv is None and is_wildcard(host):
        # the scheduler's name for this host, else this host's address towards the seeds
        adv = join_hostport(p.host or reachable_host(host, toward=out_seeds), port)
    log.info("%s placement: replica id %s, seeds %s, listen %s%s", p.scheduler, replica_id or p.replica_id,
             ",".join(out_seeds), listen_out, f" advertised as {adv}" if adv else "")
    return ClusterArgs(listen_out, adv, out_seeds, replica_id or p.replica_id, p)


def cluster_args_from(ns: Any, *, listen: str, advertise: str | None, seeds: Sequence[str],
                      replica_id: str | None, role: str, env: Mapping[str, str] | None = None) -> ClusterArgs:
    """cluster_args with --seeds-from, --seed-port and --max-seeds from parsed options `ns`
    (see add_launch_args), each falling back to its P2PFT_* variable."""
    env = os.environ if env is None else env
    seeds_from = getattr(ns, "seeds_from", None) or env.get("P2PFT_SEEDS_FROM", "").strip() or None
    if not seeds_from:
        return ClusterArgs(listen, advertise, list(seeds), replica_id)
    seed_port = getattr(ns, "seed_port", None)
    max_seeds = getattr(ns, "max_seeds", None)
    if seed_port is None:
        seed_port = env_int(env, "P2PFT_SEED_PORT")
    if max_seeds is None:
        max_seeds = env_int(env, "P2PFT_MAX_SEEDS")
    return cluster_args(seeds_from=seeds_from, listen=listen, advertise=advertise, seeds=seeds, replica_id=replica_id,
                        role=role, seed_port=seed_port, max_seeds=DEFAULT_MAX_SEEDS if max_seeds is None else max_seeds,
                        env=env)


def data_addrs(ca: ClusterArgs, data_listen: str | None, advertise_data: str | None) -> tuple[str | None, str | None]:
    """The data port's listen and advertised addresses under a scheduler: the same port offset
    as the control port, and the placement's host when it listens on a wildcard address.
    Without a scheduler, or with no --data-listen, they are returned unchanged (the runtime
    then binds the control address's host and advertises what peers can reach)."""
    if ca.placement is None or not data_listen:
        return data_listen, advertise_data
    host, base = parse_hostport(data_listen, "--data-listen")
    if base == 0:
        return data_listen, advertise_data
    port = base + ca.placement.port_offset
    if port > 65535:
        raise LaunchError(f"data port {base} + offset {ca.placement.port_offset} is out of range")
    if advertise_data is None and is_wildcard(host):
        advertise_data = join_hostport(ca.placement.host or reachable_host(host, advertise=ca.advertise,
                                                                           toward=ca.seeds), port)
    return join_hostport(host, port), advertise_data


def offset_port(ca: ClusterArgs, value: str | None) -> str | None:
    """A PORT or HOST:PORT option (the metrics port) moved by the placement's port offset, so
    that several processes on one host do not collide."""
    if ca.placement is None or not value or not ca.placement.port_offset:
        return value
    text = str(value)
    if text.isdigit():
        return str(int(text) + ca.placement.port_offset)
    try:
        hp = parse_hostport(text, "--metrics-port")
    except ValueError:
        return value   # the caller's own check reports it
    return join_hostport(hp.host, hp.port + ca.placement.port_offset)


__all__ = ["add_launch_args", "cluster_args_from", "data_addrs", "offset_port", "env_int", "ClusterArgs", "LaunchError",
           "Placement", "Scheduler", "SEEDS_FROM_CHOICES", "cluster_args", "detect",
           "expand_hostlist", "from_k8s", "from_slurm", "from_torchrun", "place"]
