"""Which InfiniBand/RoCE ports and which IP interfaces NCCL would use on this host, and when to pin them.

The rules are NCCL's documented ones: the NCCL user guide, "Environment Variables"
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html), sections NCCL_SOCKET_IFNAME, NCCL_IB_HCA,
NCCL_IB_DISABLE and NCCL_NET, and the order of NCCL's automatic interface search (`ncclFindInterfaces` in NCCL's
src/misc/socket.cc, which the guide summarises):
- a filter list (both variables) is comma-separated; a leading `^` makes it an exclude list, a following `=` makes
  its tokens exact names, else each token is a prefix (so `mlx5_1` also selects `mlx5_10`..`mlx5_19`: the guide
  recommends the `=`); an NCCL_IB_HCA token may name a port (`mlx5_0:1`);
- HCA ports: every ACTIVE port of every verbs device, InfiniBand or Ethernet (RoCE) link layer, that NCCL_IB_HCA lets
  through; none with NCCL_IB_DISABLE=1 or NCCL_NET=Socket, and none left means NCCL sends over TCP sockets;
- IP interfaces, NCCL_SOCKET_IFNAME unset: those starting with `ib` (IPoIB) first; else any but `docker*` and `lo`;
  else `docker*`; else `lo`. NCCL_SOCKET_IFNAME set replaces the search ("find or fail"). NCCL's bootstrap uses the
  first interface found (getifaddrs order, which follows the interface index), its socket transport all of them.
  NCCL only sees interfaces with an IP address, which sysfs does not show: an interface whose operstate is "down"
  is left out instead.

The choice is ambiguous, and the doctor names the variable that pins it, when the interfaces NCCL would pick are
several (the bootstrap takes the first by index, often a management network, and the ranks of other nodes must reach
it), when the ports span both link layers (InfiniBand and RoCE are separate fabrics, and NCCL pairs ports by position
across ranks), and when a filter the user set selects more than its exact names (the prefix rule above).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hf_dist_recipes.doctor.facts import IbPort, NetInterface

# NCCL's automatic search order without NCCL_SOCKET_IFNAME (ncclFindInterfaces); "^docker,lo": all but those.
SOCKET_SEARCH = ("ib", "^docker,lo", "docker", "lo")


@dataclass(frozen=True)
class NameFilter:
    """A parsed NCCL_SOCKET_IFNAME / NCCL_IB_HCA value. `tokens`: (name or prefix, port or None)."""

    exclude: bool
    exact: bool
    tokens: tuple[tuple[str, int | None], ...]

    @classmethod
    def parse(cls, value: str) -> NameFilter:
        exclude = value.startswith("^")
        value = value[1:] if exclude else value
        exact = value.startswith("=")
        value = value[1:] if exact else value
        tokens = []
        for token in (t.strip() for t in value.split(",")):
            if not token:
                continue
            name, _, port = token.partition(":")
            tokens.append((name, int(port) if port.isdigit() else None))
        return cls(exclude, exact, tuple(tokens))

    def _listed(self, name: str, port: int | None) -> bool:
        for token, token_port in self.tokens:
            named = name == token if self.exact else name.startswith(token)
            if named and (token_port is None or port is None or token_port == port):
                return True
        return False

    def selects(self, name: str, port: int | None = None) -> bool:
        return self._listed(name, port) != self.exclude

    def prefix_surprises(self, names: Sequence[str]) -> dict[str, list[str]]:
        """For an include list of prefixes: token -> the other names it selects besides the exact one."""
        if self.exact or self.exclude:
            return {}
        found = {}
        for token, _ in self.tokens:
            more = sorted(n for n in set(names) if n != token and n.startswith(token))
            if more and token in names:  # a device name used as if exact (an intended family prefix matches none)
                found[token] = more
        return found


@dataclass(frozen=True)
class NcclNetChoice:
    """What NCCL would use. `hca_ports`: "device:port" in sysfs order, `hca_link_layers`: their link layers;
    `sockets`: IP interfaces in NCCL's order (the first one bootstraps); `*_rule`: how they were chosen;
    `ambiguities`: why a choice is not clear-cut; `pins`: variable -> a value that pins it ("<...>" where the user
    must choose); `problems`: a selection that falls back (an NCCL_IB_HCA that matches no port: TCP sockets);
    `failures`: one NCCL stops on (an NCCL_SOCKET_IFNAME that matches no interface)."""

    hca_ports: tuple[str, ...]
    hca_link_layers: tuple[str, ...]
    hca_rule: str
    sockets: tuple[str, ...]
    socket_rule: str
    ambiguities: tuple[str, ...] = ()
    pins: Mapping[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()


def _hcas(
    ports: Sequence[IbPort], env: Mapping[str, str], ambiguities: list, pins: dict, problems: list
) -> tuple[list[IbPort], str]:
    active = [p for p in ports if p.active and (p.link_layer or "InfiniBand") in ("InfiniBand", "Ethernet")]
    if env.get("NCCL_IB_DISABLE", "0") not in ("", "0") or env.get("NCCL_NET", "").lower() == "socket":
        why = "NCCL_IB_DISABLE" if env.get("NCCL_IB_DISABLE", "0") not in ("", "0") else "NCCL_NET=Socket"
        return [], f"none: {why} set (TCP sockets)"
    value = env.get("NCCL_IB_HCA", "")
    if value:
        chosen_filter = NameFilter.parse(value)
        chosen = [p for p in active if chosen_filter.selects(p.device, p.port)]
        rule = f"NCCL_IB_HCA={value}"
        for token, more in chosen_filter.prefix_surprises([p.device for p in ports]).items():
            ambiguities.append(f"NCCL_IB_HCA token '{token}' is a prefix: it also selects {', '.join(more)}")
            pins["NCCL_IB_HCA"] = "=" + value.lstrip("=")
        if active and not chosen:
            problems.append(f"NCCL_IB_HCA={value} matches no ACTIVE port: NCCL falls back to TCP sockets")
    else:
        chosen, rule = active, "every ACTIVE port (NCCL_IB_HCA unset)"
    layers = {p.link_layer or "InfiniBand" for p in chosen}
    if len(layers) > 1:
        ib = [f"{p.device}:{p.port}" for p in chosen if (p.link_layer or "InfiniBand") == "InfiniBand"]
        roce = [f"{p.device}:{p.port}" for p in chosen if p.link_layer == "Ethernet"]
        ambiguities.append(
            f"the ports span two fabrics: InfiniBand {', '.join(ib)} and RoCE {', '.join(roce)}; NCCL uses all "
            "and pairs them by position across ranks"
        )
        pins["NCCL_IB_HCA"] = "=" + ",".join(ib)  # the usual compute fabric; the RoCE ports are then left out
    return chosen, rule


def _sockets(
    nics: Sequence[NetInterface], env: Mapping[str, str], ambiguities: list, pins: dict, failures: list
) -> tuple[list[str], str]:
    usable = sorted((n for n in nics if n.operstate != "down"), key=lambda n: (n.ifindex is None, n.ifindex, n.name))
    value = env.get("NCCL_SOCKET_IFNAME", "")
    if len(value) > 1:  # NCCL reads the variable only when longer than one character
        chosen_filter = NameFilter.parse(value)
        chosen = [n.name for n in usable if chosen_filter.selects(n.name)]
        for token, more in chosen_filter.prefix_surprises([n.name for n in usable]).items():
            ambiguities.append(f"NCCL_SOCKET_IFNAME token '{token}' is a prefix: it also selects {', '.join(more)}")
            pins["NCCL_SOCKET_IFNAME"] = "=" + value.lstrip("=")
        if not chosen:
            failures.append(f"NCCL_SOCKET_IFNAME={value} matches no interface that is up: NCCL stops at init")
        return chosen, f"NCCL_SOCKET_IFNAME={value}"
    for step in SOCKET_SEARCH:
        chosen = [n.name for n in usable if NameFilter.parse(step).selects(n.name)]
        if chosen:
            break
    else:
        return [], "NCCL's search (no interface up)"
    rule = {"ib": "IPoIB first", "^docker,lo": "all but docker*/lo", "docker": "docker*", "lo": "lo only"}[step]
    if len(chosen) > 1:
        ambiguities.append(
            f"{len(chosen)} interfaces qualify ({', '.join(chosen)}): NCCL bootstraps over {chosen[0]} (lowest "
            "index), whichever network that is, and sends over all of them"
        )
        pins["NCCL_SOCKET_IFNAME"] = f"=<the one on the network the nodes share: {' or '.join(chosen)}>"
    return chosen, f"NCCL's search: {rule}"


def nccl_net_choice(ports: Sequence[IbPort], nics: Sequence[NetInterface], environ: Mapping[str, str]) -> NcclNetChoice:
    """What NCCL would use given the verbs `ports`, the IP interfaces `nics` and the environment (module docstring)."""
    ambiguities: list[str] = []
    pins: dict[str, str] = {}
    problems: list[str] = []
    failures: list[str] = []
    chosen, hca_rule = _hcas(ports, environ, ambiguities, pins, problems)
    sockets, socket_rule = _sockets(nics, environ, ambiguities, pins, failures)
    return NcclNetChoice(
        hca_ports=tuple(f"{p.device}:{p.port}" for p in chosen),
        hca_link_layers=tuple(p.link_layer or "InfiniBand" for p in chosen),
        hca_rule=hca_rule,
        sockets=tuple(sockets),
        socket_rule=socket_rule,
        ambiguities=tuple(ambiguities),
        pins=pins,
        problems=tuple(problems),
        failures=tuple(failures),
    )
