"""The address a decode engine (or a router) reaches this context server at: ``remote_host`` of every KV
response (``remote_port`` is the bound HTTP port, filled in by the front once it listens).

Which host, first match wins:

  1. an explicit advertise host (``--kv-advertise-host`` / ``DWDP_KV_ADVERTISE_HOST``): a NAT, a node port,
     a DNS name — only the operator of the deployment knows it;
  2. the bound address, when it is one address (``--host 10.0.0.5``, ``127.0.0.1``): the server answers on
     nothing else, so nothing else can be right;
  3. the pod IP (``DWDP_POD_IP``, the downward API's ``status.podIP``) for a wildcard bind in a pod;
  4. for a wildcard bind outside a pod, the address of this host's outgoing interface (the source address
     the kernel picks for a route out; no packet is sent);
  5. otherwise refuse at start (``AdvertiseError``, the launcher exits 2 naming the flag).

Invariants: the result is never a wildcard (``0.0.0.0``, ``::``) nor empty: a decode engine given one would
connect to itself. An explicit host is checked for shape only (a host name or an address, no scheme, no
port, no spaces), never resolved here: a name may resolve only where the decode engine runs.
"""

from __future__ import annotations

import ipaddress
import re
import socket

#: addresses that mean "every interface": listening there is fine, advertising it never is
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
#: a documentation-only address (TEST-NET-1, RFC 5737): connecting a UDP socket "to" it makes the kernel
#: choose the outgoing interface's address without sending anything
_ROUTE_PROBE = ("192.0.2.1", 9)
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


class AdvertiseError(ValueError):
    """No address a decode engine could reach (the message names the fix)."""


def _is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARDS


def check_host(host: str, *, what: str) -> str:
    """``host`` if it is a host name or an IP address others could connect to; ``AdvertiseError`` otherwise."""
    h = host.strip()
    if _is_wildcard(h):
        raise AdvertiseError(f"{what}={host!r} is a wildcard (every interface): a decode engine cannot connect "
                             "to it; give this server's address or name")
    try:
        ipaddress.ip_address(h.strip("[]"))
        return h.strip("[]")
    except ValueError:
        pass
    if not _HOSTNAME.match(h):
        raise AdvertiseError(f"{what}={host!r} is neither an IP address nor a host name (no scheme, port or "
                             "path: e.g. 10.0.0.5 or ctx-0.example.svc)")
    return h


def route_address() -> str | None:
    """This host's address on its outgoing interface, or None when it has no route out (or only loopback)."""
    for family, probe in ((socket.AF_INET, _ROUTE_PROBE), (socket.AF_INET6, ("2001:db8::1", 9))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(addr).is_loopback and not _is_wildcard(addr):
            return addr
    return None


def advertise_host(*, explicit: str | None, pod_ip: str | None, bind_host: str, route=route_address) -> str:
    """The ``remote_host`` of this server's KV responses (see the module docstring for the order)."""
    if explicit:
        return check_host(explicit, what="--kv-advertise-host")
    if not _is_wildcard(bind_host):
        return check_host(bind_host, what="--host")
    if pod_ip:
        return check_host(pod_ip, what="DWDP_POD_IP")
    found = route()
    if found:
        return found
    raise AdvertiseError(f"--host {bind_host or '0.0.0.0'} listens on every interface and this host has no "
                         "outgoing address to advertise in KV responses (remote_host); set --kv-advertise-host "
                         "(env DWDP_KV_ADVERTISE_HOST) to the address decode engines reach this server at")
