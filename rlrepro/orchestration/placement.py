"""Where the actors of a run go on a Ray cluster: placement groups planned from the recipe (``ray.placement``,
``ray.trainer_node``, ``ray.rollout_node``, ``train.tensor_parallel``), checked against the nodes the cluster
has before any actor starts, and the map from bundles to nodes that says which actors a lost node held.

No scheduler of rlrepro's own: the plan is a list of Ray placement groups, and Ray places them.

* The trainer ranks: one group; with Megatron tensor parallelism (``train.tensor_parallel = T > 1``) one group per
  tensor-parallel group of ``T`` ranks, ``STRICT_PACK`` (one node each), so that the data-parallel replicas may
  spread. ``ray.placement=split`` keeps every trainer rank on one node (``STRICT_PACK``).
* The rollout engines: one group (one bundle per engine); on CUDA with ``ray.colocate=true`` the engines share
  the trainer ranks' GPU bundles instead (no group of their own).
* ``ray.placement``: ``pack`` (``PACK``: as few nodes as the resources allow; the default), ``spread``
  (``SPREAD``: data-parallel replicas and engines over as many nodes as can hold them), ``split`` (the trainer on
  one node, the engines on the other nodes: their bundles exclude the trainer's nodes by Ray's node-id label).
* ``ray.trainer_node`` / ``ray.rollout_node``: a custom Ray resource (``ray start --resources='{"NAME": 1}'``)
  that every trainer / engine bundle asks a sliver of (:data:`NODE_RESOURCE_SHARE`), so they go only to nodes
  that declare it; on a CPU cluster that is how nodes are told apart.
* A bundle: ``{"GPU": 1}`` per GPU on CUDA, ``{"CPU": 1}`` per actor on CPU (:data:`CPU_PER_ACTOR`), plus the node
  resource. The actors themselves ask for no CPU (they run in their bundle).

Placement never changes a bit: requests are dealt to engines by position and results sorted by key, the
trainer's collectives are gathers with an ordered sum (docs/DETERMINISM.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rlrepro.checks import ConfigError

__all__ = ["Placement", "plan_placement", "PLACEMENTS", "CPU_PER_ACTOR", "NODE_RESOURCE_SHARE", "Group", "Layout",
           "NodeInfo", "PlacementError", "plan_layout", "check_capacity", "uses_placement_groups", "shown_resource"]

PLACEMENTS = ("pack", "spread", "split")
CPU_PER_ACTOR = 1.0
NODE_RESOURCE_SHARE = 0.001  # of a node resource per bundle: any number of actors fits a node declaring 1
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node
_RAY_STRATEGY = {"pack": "PACK", "spread": "SPREAD", "split": "STRICT_PACK"}


class PlacementError(ConfigError):
    """The cluster cannot hold the run's layout (raised before any actor starts; exit 2 like any bad input)."""


@dataclass
class Group:
    """One Ray placement group: ``role`` ``trainer`` or ``rollout``; ``members`` names what its bundles hold."""
    role: str
    bundles: list[dict[str, float]]
    strategy: str  # Ray's: PACK, SPREAD, STRICT_PACK
    members: list[str]  # per bundle, e.g. "trainer rank 0", "rollout worker 3"
    exclude_trainer_nodes: bool = False  # ray.placement=split: never on a node that holds a trainer rank


@dataclass
class Layout:
    placement: str
    groups: list[Group] = field(default_factory=list)
    trainers: list[tuple[int, int, float]] = field(default_factory=list)  # (group, bundle, GPU share) per rank
    workers: list[tuple[int, int, float]] = field(default_factory=list)  # the same per rollout engine


@dataclass
class NodeInfo:
    node_id: str
    address: str
    resources: dict[str, float]
    hostname: str = ""
    is_head: bool = False

    def describe(self) -> str:
        res = ", ".join(f"{k} {_num(v)}" for k, v in sorted(self.resources.items()) if shown_resource(k))
        head = ", head" if self.is_head else ""
        return f"{self.address} (node {self.node_id[:8]}{head}): {res or 'no resources'}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def shown_resource(resource: str) -> bool:
    """A resource worth naming (not Ray's per-node, memory or placement-group bookkeeping ones)."""
    return not (resource.startswith("node:") or resource in ("memory", "object_store_memory")
                or resource.startswith("bundle_group"))


class Placement(NamedTuple):
    num_gpus: int
    trainers: list[tuple[int, float]]  # (GPU bundle, share of that GPU) per trainer rank
    workers: list[tuple[int, float]]  # the same per rollout worker


def plan_placement(num_trainers: int, num_workers: int, colocate: bool) -> Placement:
    """Colocated: trainer rank g and rollout workers g, g + N, g + 2N, ... share GPU g (N trainer ranks), half of
    it for the trainer and the other half split evenly among its workers. Separate: the trainer ranks on the first
    N GPUs, one GPU per rollout worker after them. (Ray's shares schedule; they do not cap memory: the engine's KV
    cache is sized by rollout.gpu_memory_fraction, split among the engines of a GPU.)"""
    if colocate:
        per_gpu = -(-num_workers // num_trainers)
        return Placement(num_trainers, [(g, 0.5) for g in range(num_trainers)],
                         [(i % num_trainers, 0.5 / per_gpu) for i in range(num_workers)])
    return Placement(num_trainers + num_workers, [(g, 1.0) for g in range(num_trainers)],
                     [(num_trainers + i, 1.0) for i in range(num_workers)])


def uses_placement_groups(device: str, local: bool, placement: str, trainer_node: str | None,
                          rollout_node: str | None) -> bool:
    """Placement groups on CUDA, on a joined cluster, or when a placement key asks; a local CPU run with the
    defaults keeps plain actors (one process each, nothing to place)."""
    return device == "cuda" or not local or placement != "pack" or bool(trainer_node) or bool(rollout_node)


def plan_layout(*, num_trainers: int, num_workers: int, tensor_parallel: int = 1, device: str = "cpu",
                colocate: bool = False, placement: str = "pack", trainer_node: str | None = None,
                rollout_node: str | None = None) -> Layout:
    """The placement groups of a run (see the module docstring). ``tensor_parallel``: Megatron's T (1 else)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"ray.placement={placement!r}: use one of {', '.join(PLACEMENTS)}")
    on_gpu = device == "cuda"
    base = {"GPU": 1.0} if on_gpu else {"CPU": CPU_PER_ACTOR}

    def bundle(*nodes: str | None) -> dict[str, float]:
        b = dict(base)
        b.update({n: NODE_RESOURCE_SHARE for n in nodes if n})
        return b

    shared = on_gpu and colocate  # the engines share the trainer ranks' GPU bundles
    trainer_bundle = bundle(trainer_node, rollout_node) if shared else bundle(trainer_node)
    layout = Layout(placement)
    tp = tensor_parallel if tensor_parallel > 1 and placement != "split" else num_trainers
    tp = max(1, min(tp, num_trainers))
    strategy = "STRICT_PACK" if tensor_parallel > 1 else _RAY_STRATEGY[placement]
    for start in range(0, num_trainers, tp):
        ranks = list(range(start, min(start + tp, num_trainers)))
        tp_group = f" (tensor-parallel group {start // tp})" if tensor_parallel > 1 else ""
        layout.groups.append(Group("trainer", [dict(trainer_bundle) for _ in ranks], strategy,
                                   [f"trainer rank {r}{tp_group}" for r in ranks]))
        layout.trainers += [(len(layout.groups) - 1, j, 1.0) for j in range(len(ranks))]
    if shared:  # GPU shares as plan_placement gives them (bundle b: trainer rank b's GPU)
        plan = plan_placement(num_trainers, num_workers, colocate=True)
        layout.workers = [(*layout.trainers[b][:2], share) for b, share in plan.workers]
        layout.trainers = [(*layout.trainers[b][:2], share) for b, share in plan.trainers]
        return layout
    if num_workers:
        layout.groups.append(Group("rollout", [bundle(rollout_node) for _ in range(num_workers)],
                                   "PACK" if placement == "split" else _RAY_STRATEGY[placement],
                                   [f"rollout worker {i}" for i in range(num_workers)],
                                   exclude_trainer_nodes=placement == "split"))
        layout.workers = [(len(layout.groups) - 1, i, 1.0) for i in range(num_workers)]
    if not on_gpu:  # on CPU the actors ask for no GPU
        layout.trainers = [(g, j, 0.0) for g, j, _ in layout.trainers]
        layout.workers = [(g, j, 0.0) for g, j, _ in layout.workers]
    return layout


# ------------------------------------------------------------------------------------------ capacity check
def _fits(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def _total(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(res.items())) + "}"


def _place(groups: list[Group], nodes: list[NodeInfo], free: dict[str, dict[str, float]],
           trainer_nodes: frozenset[str]) -> tuple[bool, str]:
    """Whether ``groups`` fit (first fit; every choice of node for a STRICT_PACK group is tried); else the
    sentence naming the first group and bundle that did not fit, and what is missing."""
    if not groups:
        return True, ""
    g, rest = groups[0], groups[1:]
    candidates = [n for n in nodes if not (g.exclude_trainer_nodes and n.node_id in trainer_nodes)]
    where = "no node other than the trainer's" if g.exclude_trainer_nodes else "no node"
    if g.strategy == "STRICT_PACK":
        need = _total(g.bundles)
        problem = ""
        for n in candidates:
            if not _fits(free[n.node_id], need):
                continue
            trial = {k: dict(v) for k, v in free.items()}
            _take(trial[n.node_id], need)
            tn = trainer_nodes | {n.node_id} if g.role == "trainer" else trainer_nodes
            ok, problem = _place(rest, nodes, trial, tn)
            if ok:
                return True, ""
        if problem:
            return False, problem
        return False, (f"{where} can hold {', '.join(g.members)} together (one node: {_fmt(need)}); "
                       + _missing(need, candidates, free))
    trial = {k: dict(v) for k, v in free.items()}
    used = set()
    for member, b in zip(g.members, g.bundles):
        for n in candidates:
            if _fits(trial[n.node_id], b):
                _take(trial[n.node_id], b)
                used.add(n.node_id)
                break
        else:
            return False, f"{where} has room for {member} ({_fmt(b)}) once the bundles before it are placed; " + \
                _missing(b, candidates, trial)
    tn = trainer_nodes | used if g.role == "trainer" else trainer_nodes
    return _place(rest, nodes, trial, tn)


def _missing(need: dict[str, float], candidates: list[NodeInfo], free: dict[str, dict[str, float]]) -> str:
    if not candidates:
        return "missing: another node"
    parts = []
    for k, v in sorted(need.items()):
        most = max(free[n.node_id].get(k, 0.0) for n in candidates)
        if most + 1e-9 < v:
            parts.append(f"{k} (needs {_num(v)}, at most {_num(max(most, 0.0))} free on one node)" if most > 0 else
                         f"{k} (no node has it)" if not any(k in n.resources for n in candidates) else
                         f"{k} (needs {_num(v)}, none left)")
    return "missing: " + ("; ".join(parts) if parts else "room on one node for all of it together")


def check_capacity(layout: Layout, nodes: list[NodeInfo], *, num_nodes: int | None = None,
                   what: str = "") -> None:
    """Raise :class:`PlacementError` naming what is missing when the alive ``nodes`` (their total resources)
    cannot hold ``layout``, or when there are fewer than ``num_nodes`` (``ray.num_nodes``) of them."""
    listing = "; ".join(n.describe() for n in nodes) or "none"
    head = f"the Ray cluster has {len(nodes)} alive node(s): {listing}"
    if num_nodes is not None and len(nodes) < num_nodes:
        raise PlacementError(f"ray.num_nodes={num_nodes} but {head}. Start the missing node(s) (ray start "
                             "--address=HEAD:PORT on each), or lower ray.num_nodes")
    if layout.placement == "split" and len(nodes) < 2:
        raise PlacementError(f"ray.placement=split puts the trainer on one node and the rollout engines on the "
                             f"others, but {head}. Add a node, or use ray.placement=pack")
    free = {n.node_id: dict(n.resources) for n in nodes}
    ok, problem = _place(layout.groups, nodes, free, frozenset())
    if not ok:
        fixes = ("add nodes or resources (ray start --num-cpus/--num-gpus/--resources on a node), lower "
                 "train.num_gpus / rollout.num_workers")
        if layout.placement != "pack":
            fixes += ", or use ray.placement=pack"
        raise PlacementError(f"this run's layout ({what or 'ray.placement=' + layout.placement}) does not fit: "
                             f"{problem}. {head[0].upper() + head[1:]}. Fix: {fixes}")


def nodes_from_ray(ray: Any) -> list[NodeInfo]:
    """The alive nodes of the cluster Ray is connected to, with their total resources."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = {k: float(v) for k, v in (n.get("Resources") or {}).items()}
        out.append(NodeInfo(n["NodeID"], n.get("NodeManagerAddress", "?"), res, n.get("NodeManagerHostname", ""),
                            "node:__internal_head__" in res))
    return out
