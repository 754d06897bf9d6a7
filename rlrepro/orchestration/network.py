"""Where rlrepro's own listeners listen: the TCPStores of its process groups, gloo's and NCCL's sockets.

Every group member listens on the address Ray knows its node by (:func:`node_address`): 127.0.0.1 in local mode
(``ray_start`` keeps the node address there), the node's address on a cluster. Left to themselves the libraries
choose otherwise: gloo's default device resolves the *hostname* (on many cloud machines an outward address, so a
CPU data-parallel run and the collective weight sync listened on it), and NCCL's bootstrap and socket transport
take the first interface that is not loopback. So:

* a gloo group rlrepro builds itself gets an explicit device for that address (:func:`gloo_options`);
* before ``init_process_group`` (and megatron's ``new_group`` calls) or the first NCCL communicator, the process
  pins ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` (:func:`pin_socket_interfaces`): to the loopback
  interface in local mode, whatever they were; on a cluster to the interface the configuration names
  (``RLREPRO_NETWORK_INTERFACE`` for now, read in each actor's environment), else to a value the user set,
  else to the interface that carries the node's address.
"""
from __future__ import annotations

import datetime
import fcntl
import ipaddress
import os
import socket
import struct
import sys

__all__ = ["NETWORK_INTERFACE_ENV", "SOCKET_IFNAME_ENVS", "node_address", "is_loopback", "interface_addresses",
           "interface_of", "socket_interface", "pin_socket_interfaces", "gloo_options"]

NETWORK_INTERFACE_ENV = "RLREPRO_NETWORK_INTERFACE"  # a cluster's interface for them (ray.network_interface)
SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 in local mode); 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK
    except Exception:  # noqa: BLE001 - outside Ray (in-process tests)
        return LOOPBACK


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 by ioctl, IPv6 from /proc/net/if_inet6)."""
    out: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            out.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
        except OSError:
            out.setdefault(name, [])
        finally:
            s.close()
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    addr = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
                    out.setdefault(fields[5], []).append(addr)
    except OSError:
        pass
    return out


def interface_of(address: str) -> str | None:
    """The name of the interface that carries ``address`` (None: no interface of this machine has it)."""
    try:
        want = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    for name, addrs in interface_addresses().items():
        if any(ipaddress.ip_address(a) == want for a in addrs):
            return name
    return None


def socket_interface(host: str, configured: str | None = None) -> str | None:
    """The interface for the sockets of a group member whose node address is ``host``: loopback's for a loopback
    host (local mode: always); else ``configured`` (default: ``$RLREPRO_NETWORK_INTERFACE``), else None (a
    value the user set in ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` stands, else the interface of ``host``)."""
    if is_loopback(host):
        return interface_of(LOOPBACK) or "lo"
    if configured is None:
        configured = os.environ.get(NETWORK_INTERFACE_ENV) or None
    return configured


def pin_socket_interfaces(host: str, configured: str | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` of this process (read when gloo groups are made by
    ``init_process_group``/``new_group`` and when NCCL starts) for a member at ``host``; returns the interface
    pinned for gloo (None: the library's own choice stands, no interface being known)."""
    forced = socket_interface(host, configured)
    pinned = None
    for var in SOCKET_IFNAME_ENVS:
        value = forced or os.environ.get(var) or interface_of(host)
        if value is None:
            print(f"rlrepro: no interface of this machine carries the node address {host}; {var} left unset "
                  f"(set {NETWORK_INTERFACE_ENV} to choose one)", file=sys.stderr, flush=True)
            continue
        old = os.environ.get(var)
        if old is not None and old != value and is_loopback(host):
            print(f"rlrepro: local mode listens on loopback only: {var}={old} replaced by {value}", file=sys.stderr,
                  flush=True)
        os.environ[var] = value
        pinned = value if var == "GLOO_SOCKET_IFNAME" else pinned
    return pinned


def gloo_options(host: str, timeout: datetime.timedelta, configured: str | None = None):
    """``ProcessGroupGloo`` options whose one device listens on ``host`` (or on the configured interface on a
    cluster), never on what the hostname resolves to."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    interface = None if is_loopback(host) else socket_interface(host, configured)
    device = (dist.ProcessGroupGloo.create_device(interface=interface) if interface else
              dist.ProcessGroupGloo.create_device(hostname=host))
    opts._devices = [device]
    return opts
