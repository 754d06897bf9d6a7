"""Starting Ray: a local instance of our own on 127.0.0.1, or joining the cluster that ``ray.address`` names.

Local mode (``ray.address`` unset) always starts a new instance (``ray.init(address="local")``): a cluster that a
``ray start`` left on the machine (its address file under Ray's temp dir) or ``RAY_ADDRESS`` is never joined, so
rlrepro's ``num_cpus``/``num_gpus`` apply and a run does not land on someone else's cluster. Only a given
``ray.address`` joins one.

Local mode binds loopback only. Ray 2.60 turns a node address of 127.0.0.1 into the machine's outward address
(``services.resolve_ip_for_localhost`` -> ``get_node_ip_address``) unless ``ray_constants.ENABLE_RAY_CLUSTER`` is
false; that constant is read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ``ray`` is imported, and Ray's own
processes (GCS, raylet, agents, workers) inherit the variable. So :func:`start_ray` sets it before its
``import ray``. A process that imported ray before (a test, a notebook) has the constant already; then it is set
on the module too, and after ``ray.init`` the node address is checked: anything but 127.0.0.1 shuts Ray down
and raises (``tests/test_ray_start.py`` pins both paths, ``tests/test_exposure.py`` every listening socket).

Token authentication: a new local instance enables it when ``RAY_AUTH_MODE`` is unset, and warns on every run
that it did. Local mode sets ``RAY_AUTH_MODE=token`` (Ray's documented setting; it keeps what Ray does by default,
minus the warning) unless the user set it; authentication errors still raise. A ray imported before start_ray
has read its mode already: it then enables token authentication itself and says so once. Joining a cluster, the
mode is the user's to set (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN_PATH``), as Ray documents.

SIGTERM: ``rlrepro train`` turns SIGTERM into an interrupt (:func:`sigterm_as_interrupt`, installed before the run
directory is touched). ``ray.init`` installs a handler of its own (``sys.exit(15)``) at its start; while the
interrupt handler is the one in place, :func:`start_ray` puts it back once ``ray.init`` returns, and a SIGTERM that
Ray's handler caught meanwhile (its ``SystemExit(15)``) is raised as the interrupt it would have been. A
``ray.init`` that raises (an interrupt, a refused join) is shut down before the error goes on: nothing of a
half-started Ray is left.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import sys

from .import_path import job_config_without_driver_paths

LOOPBACK = "127.0.0.1"
CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # ray._private.authentication.authentication_token_setup.AUTH_MODE_ENV_VAR
# Set in the environment of local mode before ray is imported (and inherited by every Ray process): the node
# address stays 127.0.0.1 and every server binds loopback; no usage statistics.
LOCAL_ONLY_ENV = {CLUSTER_ENV: "0", "RAY_USAGE_STATS_ENABLED": "0"}


def is_local(address: str | None) -> bool:
    """``ray.address`` unset, empty or ``"local"``: start a local instance of our own."""
    return address is None or not str(address).strip() or str(address).strip() == "local"


def is_loopback_address(address: str) -> bool:
    """``host:port`` with a loopback host (127.0.0.0/8, ::1, localhost); not a ``scheme://`` (Ray client) one."""
    address = str(address).strip()
    if "://" in address or ":" not in address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt from now on, as Ctrl-C does (a run then ends with a clean message naming its
    checkpoint); returns the handler it replaced (the current one when this is not the main thread)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    handler.rlrepro_interrupt = True
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (a test calling the driver from a thread)
        return signal.getsignal(signal.SIGTERM)


def restore_sigterm(handler) -> None:
    """Put back the SIGTERM handler that :func:`sigterm_as_interrupt` returned."""
    if handler is None:
        return
    try:
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, TypeError):  # not the main thread, or no handler to put back
        pass


@contextlib.contextmanager
def _ray_init_guard(ray):
    """Around ``ray.init``: when SIGTERM is an interrupt (:func:`sigterm_as_interrupt`), it stays one (Ray's own
    handler, installed inside ``ray.init``, is replaced again; a SIGTERM it caught is re-raised as
    KeyboardInterrupt). Whatever ``ray.init`` raises, the part of Ray it started is shut down first."""
    try:
        ours = getattr(signal.getsignal(signal.SIGTERM), "rlrepro_interrupt", False)
    except ValueError:
        ours = False
    try:
        yield
    except BaseException as e:
        try:
            ray.shutdown()  # a half-started local node (GCS, raylet) goes too; nothing after a refused join
        except BaseException:  # noqa: BLE001 - best effort, the first error is the one to report
            pass
        if ours and isinstance(e, SystemExit) and e.code == signal.SIGTERM:
            raise KeyboardInterrupt(f"signal {signal.SIGTERM.value}") from None
        raise
    finally:
        if ours:
            sigterm_as_interrupt()


def prepare_ray_env(address: str | None) -> tuple[bool, bool]:
    """The environment :func:`start_ray` sets before its ``import ray``; returns (local, loopback)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    local = is_local(address)
    loopback = local or is_loopback_address(address)
    imported_before = "ray" in sys.modules
    if loopback:
        os.environ.update(LOCAL_ONLY_ENV)
    if local and not imported_before:  # an imported ray has read its auth mode already: then Ray decides (and
        os.environ.setdefault(AUTH_MODE_ENV, "token")  # says so); joining, the cluster's mode is the user's to set
    return local, loopback


def start_ray(address: str | None, num_cpus: int | None) -> bool:
    """Start a local Ray (``address`` unset) or join the cluster at ``address``; nothing if Ray is up already.
    Returns whether this call started (or joined) it: a Ray that the caller had initialised before is the
    caller's, and rlrepro never shuts it down (:meth:`~.actors.ActorGroup.shutdown`).

    ``num_cpus`` applies to a local instance only (None: every core); a joined cluster keeps its own resources.
    A loopback ``address`` (``127.0.0.1:PORT``) is a loopback-only cluster on this machine (started with
    ``--node-ip-address=127.0.0.1`` and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``): the driver stays on 127.0.0.1 too
    (otherwise Ray would turn the address into the machine's outward one and never reach it). Give any other
    cluster by its own address (or ``auto``).
    """
    local, loopback = prepare_ray_env(address)
    import ray

    if ray.is_initialized():
        return False
    if loopback:
        _loopback_for_imported_ray()
    if not local:
        _check_reachable(str(address).strip())
        try:
            with _ray_init_guard(ray):
                ray.init(address=str(address).strip(), include_dashboard=False, log_to_driver=True,
                         job_config=job_config_without_driver_paths())
        except ConnectionError as e:
            raise ConnectionError(join_failure_hint(str(address).strip(), e, loopback)) from e
        return True
    if os.environ.get("RAY_ADDRESS"):
        env_address = os.environ["RAY_ADDRESS"]
        print(f"rlrepro: RAY_ADDRESS={env_address} is set but ray.address is not: starting a local Ray instance "
              f"(ray.address={env_address} joins that cluster)", file=sys.stderr, flush=True)
    import torch

    # Name the GPUs: a stripped Ray may not detect them, and actors asking for one would wait forever.
    with _ray_init_guard(ray):
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), num_gpus=torch.cuda.device_count(),
                 include_dashboard=False, _node_ip_address=LOOPBACK, job_config=job_config_without_driver_paths(),
                 log_to_driver=True, configure_logging=True, logging_level="WARNING")
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the local Ray instance took the node address {node_ip}, not {LOOPBACK}, so its servers "
                           f"would not be on loopback only; this Ray ({ray.__version__}) no longer honours "
                           f"{CLUSTER_ENV}=0 (see rlrepro/orchestration/ray_start.py). Ray was shut down")
    return True


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A ``host:port`` ``ray.address`` that nothing answers on (no head node there, a wrong port) is refused at
    once: ``ray.init`` would retry it for minutes, printing GCS time-outs. ``auto`` and ``ray://`` are Ray's."""
    import socket

    from .config import ConfigError

    if "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        port_no = int(port)
    except ValueError:
        raise ConfigError(f"ray.address={address}: {port!r} is not a port; give the head node's GCS address as "
                          "host:port (e.g. 10.0.0.1:6379), or leave ray.address unset for a local Ray") from None
    try:
        socket.create_connection((host.strip("[]"), port_no), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"ray.address={address}: nothing answers there ({e.strerror or type(e).__name__}); is a "
                          f"head node running (ray status --address={address})? Give the head's GCS address "
                          "(host:port, default port 6379), or leave ray.address unset for a local Ray of "
                          "rlrepro's own") from None


def _loopback_for_imported_ray() -> None:
    """A ray imported before :func:`start_ray` set ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` has read it already:
    apply the same value to its constant (``services.get_node_ip_address`` reads it at each call)."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise RuntimeError(f"ray was imported before rlrepro could set {CLUSTER_ENV}=0, and this Ray has no "
                           "ray_constants.ENABLE_RAY_CLUSTER to apply it to; set it in the environment "
                           f"({CLUSTER_ENV}=0) or let rlrepro's start_ray be the first to import ray")
    if ray_constants.ENABLE_RAY_CLUSTER:
        ray_constants.ENABLE_RAY_CLUSTER = False


def _cluster_nodes(address: str, timeout_s: float = 10.0) -> tuple[list[str] | None, str | None]:
    """The node addresses the GCS at ``address`` lists (None when it cannot be asked) and the error of asking;
    on a thread of its own, so a GCS that does not answer cannot hold the caller past ``timeout_s``."""
    import threading

    out: dict = {}

    def ask() -> None:
        try:
            from ray._raylet import GcsClient

            info = GcsClient(address=address).get_all_node_info(timeout=timeout_s)
            out["nodes"] = sorted({n.node_manager_address for n in info.values() if n.state == 0})  # 0: ALIVE
        except Exception as e:  # noqa: BLE001 - a hint only
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout_s + 5)
    return out.get("nodes"), out.get("error", None if "nodes" in out else "no answer")


def join_failure_hint(address: str, error: BaseException, loopback: bool) -> str:
    """Why joining the cluster at ``address`` may have failed, in words: the two causes seen on a cluster
    started by ``ray start`` (docs/CLUSTER.md): token authentication the driver was not given, and, for a
    loopback address, nodes that took the machine's outward address."""
    nodes, asked = _cluster_nodes(address)
    lines = [f"could not join the Ray cluster at ray.address={address} ({str(error).strip().splitlines()[-1]})."]
    if asked and ("Authentication" in asked or "auth" in asked.lower()):
        lines.append("The cluster uses token authentication and this process has no token: set "
                     f"{AUTH_MODE_ENV}=token (and RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token, or RAY_AUTH_TOKEN) as "
                     "Ray documents, the same as the cluster's nodes.")
    elif nodes is not None and loopback and any(not is_loopback_address(f"{n}:0") for n in nodes):
        outward = [n for n in nodes if not is_loopback_address(f"{n}:0")]
        port = address.rsplit(":", 1)[1]
        lines.append(f"Its nodes took the address(es) {', '.join(outward)}, not 127.0.0.1: `ray start "
                     f"--node-ip-address=127.0.0.1` turns 127.0.0.1 into the machine's outward address unless "
                     f"{CLUSTER_ENV}=0 is set for it. Join it as ray.address={outward[0]}:{port}, or restart it "
                     f"with {CLUSTER_ENV}=0 to keep it on loopback (docs/CLUSTER.md).")
    elif nodes is None:
        lines.append(f"Its GCS did not answer ({asked}): is a head node running there (ray status "
                     f"--address={address})?")
    lines.append("rlrepro runs its driver on a node of the cluster (ray.address is the head's GCS address, "
                 "host:port; not ray://).")
    return " ".join(lines)
