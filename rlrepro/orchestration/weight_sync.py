"""Weight sync from the trainer to rollout engines: a collective broadcast, and CUDA IPC for a shared GPU.

**Collective** (``rollout.weight_sync=collective``): the trainer's rank 0 is rank 0 of a separate group and each
rollout worker one more rank. The group is *stateless*: its own ``TCPStore`` and a ``ProcessGroupNCCL`` /
``ProcessGroupGloo`` built directly, not ``init_process_group``, so it lives beside the trainer's data-parallel
group, and a new one (a new ``generation``) can be formed after a rollout worker is replaced without touching
the trainer. Every weight is broadcast from rank 0 in sorted name order, after a header with the version and the
tensors' names, shapes and dtypes that every rank checks first: a worker refuses a mismatched model instead of
loading it silently, and the trainer sends nothing unless all accept. A broadcast is a copy, so the engine
receives the trainer's bits exactly. NCCL between GPUs (an engine on its own GPU), gloo on CPU.

Joining the group is two phases, so that a member that dies before or while joining costs seconds, not the
group's 300 s timeout. First every member checks in on the store and polls it (:func:`check_in`) until all
have, or until the driver sets the group's abort key (:func:`abort_join`), which it does as soon as one join
fails (a worker that died after the liveness check: Ray ends its call at once); the others then raise
:class:`SyncGroupAborted` and the driver replaces the dead worker and forms the group again
(:meth:`CollectiveSync._form`). Then the communicator is built, with every member known to be alive and joining:
gloo under ``FORM_TIMEOUT_S`` (a member that dies in these milliseconds costs that, not 300 s), then the
group's own timeout for the broadcasts; NCCL builds its communicator at the first broadcast. Each member counts
on the store the syncs it has entered, so that a worker hung before a broadcast is told apart from those waiting on
it there (:func:`behind_in_sync`; the driver then restarts only it).

**CUDA IPC** (``rollout.weight_sync=cuda_ipc``, trainer and engine on one GPU): the trainer hands out IPC
handles of its live parameters (:func:`ipc_handles`); the engine maps them and copies device to device
(:func:`open_ipc_handles`). No bytes leave the GPU.
"""
from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from . import network

__all__ = ["Rendezvous", "WeightBroadcaster", "ipc_handles", "open_ipc_handles", "WeightSync", "WEIGHT_SYNC_MODES",
           "resolve_weight_sync", "SyncGroupAborted", "WeightsRefused", "check_in", "abort_join",
           "behind_in_sync"]

JOINED_KEY, ABORT_KEY = "joined", "abort"  # in the group's store, under its generation's prefix
ENTERED_KEY = "entered"  # + "/<rank>": how many syncs that member has entered (:func:`behind_in_sync`)
CHECK_IN_POLL_S = 0.05  # how often a member waiting for the others looks at the store
FORM_TIMEOUT_S = 60.0  # gloo's connections once every member has checked in (then the group's timeout applies)
ABORT_CONNECT_S = 10.0  # the driver's connection to a group's store, to abort its join
GROUP_TIMEOUT_S = 300.0  # a broadcast (and a receive waiting on a member that hung) fails after this long


class SyncGroupAborted(RuntimeError):
    """The driver aborted a weight-sync group's join: another member failed to join (a rollout worker died)."""


class WeightsRefused(ValueError):
    """A rollout worker refused a weight update before writing any tensor (names, shapes or dtypes other than its
    engine's): its weights are still those of its previous version."""


def group_prefix(generation: int) -> str:
    return f"rlrepro-weight-sync/{generation}"


def check_in(store, world_size: int, timeout_s: float, poll_s: float = CHECK_IN_POLL_S) -> None:
    """Count this member in on ``store`` and wait until all ``world_size`` have, polling, so that the driver's
    abort key (:func:`abort_join`) ends the wait at once: :class:`SyncGroupAborted`. ``TimeoutError`` after
    ``timeout_s``."""
    store.add(JOINED_KEY, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([ABORT_KEY]):
            raise SyncGroupAborted(f"weight-sync group join aborted: {store.get(ABORT_KEY).decode()}")
        joined = store.add(JOINED_KEY, 0)
        if joined >= world_size:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight-sync group join: {joined} of {world_size} members joined in {timeout_s:.0f} s")
        time.sleep(poll_s)


def driver_store(host: str, port: int, generation: int, timeout_s: float = ABORT_CONNECT_S) -> dist.PrefixStore:
    """Driver side: a client of group ``generation``'s keys in the store at ``host:port`` (raises if it is gone)."""
    tcp = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(group_prefix(generation), tcp)


def abort_join(host: str, port: int, generation: int, reason: str, timeout_s: float = ABORT_CONNECT_S) -> bool:
    """Driver side: set the abort key of group ``generation`` in the store at ``host:port``, so that every member
    still in :func:`check_in` raises now. False when the store cannot be reached (rank 0's join ended, and the
    others' connections to its store fail on their own)."""
    try:
        driver_store(host, port, generation, timeout_s).set(ABORT_KEY, reason)
        return True
    except Exception:  # noqa: BLE001 - the store is gone: nobody waits on it any more
        return False


def behind_in_sync(host: str, port: int, generation: int, world_size: int,
                   timeout_s: float = ABORT_CONNECT_S) -> set[int] | None:
    """Driver side, for a broadcast that does not end: the ranks of group ``generation`` that have entered fewer
    syncs than the furthest member (each member counts its syncs on the store as it enters one: ``_enter``). Such
    a member is hung before the sync, and the others wait on it; a member hung inside the sync is not told apart
    from them. An empty set when all are level; None when the store cannot be read."""
    try:
        store = driver_store(host, port, generation, timeout_s)
        keys = [f"{ENTERED_KEY}/{rank}" for rank in range(world_size)]
        counts = [int(store.get(key)) if store.check([key]) else 0 for key in keys]
    except Exception:  # noqa: BLE001 - the store is gone (rank 0's group closed): nothing can be told
        return None
    return {rank for rank, count in enumerate(counts) if count < max(counts)}


class Rendezvous:
    """A listening socket on ``host`` (port chosen by the OS) that rank 0 of a group keeps until it builds the
    group's TCPStore on it (``master_listen_fd``): no race for the port, and the store listens on ``host`` only
    (127.0.0.1 in local mode), never on every interface."""

    def __init__(self, host: str) -> None:
        import socket

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, 0))
        self.sock.listen(256)
        self.host, self.port = host, self.sock.getsockname()[1]

    def store(self, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
        """The TCPStore server, listening on this socket. It gets its own duplicate of the descriptor: the
        store uses the descriptor without owning the Python socket, so the socket's closing (when this object
        is collected) must not close the store's listener under clients that have not connected yet (with
        NCCL's lazy start, rank 0 returns before the others connect). The store is also kept here (``served``):
        when rank 0's join fails (aborted), its holder keeps this object until its next rendezvous, so that the
        members still connecting find the store and its abort key; a store gone would make their connection
        retry for twice the group's timeout."""
        import os

        store = dist.TCPStore(self.host, self.port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=os.dup(self.sock.fileno()))
        self.sock.close()
        self.served = store
        return store


def tcp_store(host: str, port: int, world_size: int, rendezvous: Rendezvous | None,
              timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's store: served from ``rendezvous`` on rank 0, a client elsewhere."""
    if rendezvous is not None:
        return rendezvous.store(world_size, timeout)
    return dist.TCPStore(host, port, world_size, False, timeout)


class WeightBroadcaster:
    """One member of a weight-sync group: ``rank 0`` (the trainer) sends, every other rank receives.

    ``host``/``port``: rank 0 hosts the group's TCPStore there, from ``rendezvous`` (required on rank 0, made by
    it); ``generation`` names this incarnation of the group, so a re-formed group never meets an old one's keys.
    The constructor returns once every member joined (see the module docstring: check-in, then the communicator
    under ``form_timeout_s``).
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 generation: int = 0, timeout_s: float = GROUP_TIMEOUT_S, rendezvous: Rendezvous | None = None,
                 form_timeout_s: float = FORM_TIMEOUT_S) -> None:
        if world_size < 2:
            raise ValueError(f"a weight-sync group needs the trainer and at least one worker; world_size={world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.held_version: int | None = None  # a receiver's weight version: an older broadcast is refused
        timeout = datetime.timedelta(seconds=timeout_s)
        if (rank == 0) != (rendezvous is not None):
            raise ValueError("rank 0 of a weight-sync group hosts its store: pass rendezvous= on rank 0 only")
        self._tcp = tcp_store(host, port, world_size, rendezvous, timeout)
        self._store = store = dist.PrefixStore(group_prefix(generation), self._tcp)
        self.syncs = 0  # the syncs this member has entered (written to the store as each begins)
        check_in(store, world_size, timeout_s)
        own = network.node_address()  # this member's sockets listen here (127.0.0.1 in local mode), not where
        if backend == "nccl":  # the hostname resolves to nor on NCCL's first non-loopback interface
            network.pin_socket_interfaces(own)
            self.device = torch.device("cuda", torch.cuda.current_device())
            # the group's timeout for its collectives too (torch's NCCL default is 10 minutes, longer than the
            # driver waits for a broken sync's members: ActorGroup._wait_all_or_name_the_hung)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self.device = torch.device("cpu")
            # gloo's connections under the form timeout, the broadcasts under the group's (a torch whose gloo
            # group cannot change its timeout keeps the group's for both)
            settable = hasattr(dist.ProcessGroupGloo, "_set_default_timeout")
            form = datetime.timedelta(seconds=min(form_timeout_s, timeout_s)) if settable else timeout
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, network.gloo_options(own, form))
            if settable:
                self.pg._set_default_timeout(timeout)

    def _enter(self) -> None:
        """Say on the store that this member has entered its next sync: a member hung before it is then told
        apart from those waiting on it in the broadcast (:func:`behind_in_sync`)."""
        self.syncs += 1
        self._store.set(f"{ENTERED_KEY}/{self.rank}", str(self.syncs))

    # --------------------------------------------------------------------------------- collectives on self.pg
    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([t], opts).wait()

    def _broadcast_object(self, obj):
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size)
        if self.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(payload)
        return obj if self.rank == 0 else pickle.loads(payload.cpu().numpy().tobytes())

    def _all_accept(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([flag], opts).wait()
        return bool(flag.item())

    # --------------------------------------------------------------------------------- send / receive
    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 (the trainer) sends weights")
        try:
            self._enter()
            self._send(named, version)
        except BaseException:  # a member died mid-broadcast: the group is closed at once, so that the others'
            self.close()  # receive fails now instead of waiting for the group's timeout
            raise

    def _send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        items = sorted(named, key=lambda kv: kv[0])
        header = {"version": version, "tensors": [(n, tuple(t.shape), str(t.dtype)) for n, t in items]}
        self._broadcast_object(header)
        if not self._all_accept(True):
            raise ValueError(f"weight sync to version {version}: a worker refused the weights (a model mismatch "
                             "or an older version; the worker's error says which)")
        for _, t in items:
            self._broadcast(t.detach().to(self.device).contiguous())
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()

    def receive(self, params: dict[str, torch.Tensor]) -> int:
        """Receive into ``params`` (name -> tensor, e.g. ``dict(model.named_parameters())``); returns the version.
        A tensor already on this group's device is written in place; others go through one staging buffer.
        A version older than ``held_version`` (the receiver's, set by its holder) is refused
        (:class:`WeightsRefused`) as a model mismatch is, before any tensor moves."""
        if self.rank == 0:
            raise RuntimeError("rank 0 sends; receivers have rank >= 1")
        try:
            self._enter()
            return self._receive(params)
        except BaseException:
            self.close()
            raise

    def _receive(self, params: dict[str, torch.Tensor]) -> int:
        header = self._broadcast_object(None)
        stale = version_problem(header.get("version"), getattr(self, "held_version", None))
        problem = self._check(header, params) or (f"weight sync: {stale}" if stale else None)
        if not self._all_accept(problem is None):  # every rank agrees before any tensor moves
            raise WeightsRefused(problem or "weight sync: another worker refused the weights (its error says why)")
        with torch.no_grad():
            for name, shape, dtype in header["tensors"]:
                target = params[name]
                if target.device == self.device and target.is_contiguous():
                    self._broadcast(target.data)
                else:
                    buf = torch.empty(shape, dtype=target.dtype, device=self.device)
                    self._broadcast(buf)
                    target.copy_(buf)
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()
        return int(header["version"])

    @staticmethod
    def _check(header: dict, params: dict[str, torch.Tensor]) -> str | None:
        """The header's tensors against this engine's parameters: all of them, once each, same shapes and
        dtypes (``rollout.engine.weight_problem``, the check of ``Engine.load_weights`` too)."""
        from rlrepro.rollout.engine import weight_problem

        problem = weight_problem(header["tensors"], params, complete=True, sender="the trainer's weights")
        return None if problem is None else f"weight sync: {problem}"

    def close(self) -> None:
        """Drop the group (its communicator is freed with the object)."""
        pg = getattr(self, "pg", None)
        if pg is not None and self.backend == "nccl" and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort: a peer may be gone
                pass
        self.pg = None
        self._tcp = None


def version_problem(version, held: int | None) -> str | None:
    """Why weights of ``version`` may not replace those of version ``held`` (None: they may): not an integer, or
    older (a late or repeated update would silently run a stale policy under a newer one's samples)."""
    if isinstance(version, bool) or not isinstance(version, int):
        return f"the weight version {version!r} is not an integer"
    if held is not None and version < held:
        return (f"the update is version {version} but this engine holds version {held}, which is "
                "newer; a weight version never goes backwards (a fresh worker may start from any version)")
    return None


def ipc_handles(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple]]:
    """(name, picklable CUDA IPC handle) for each CUDA tensor, in the given order. The tensors must stay alive
    (and unchanged) until every receiver has copied them: the trainer's parameters between two steps are."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream().synchronize()  # the receiver reads what the last update wrote
    out = []
    for name, t in named:
        if not t.is_cuda:
            raise ValueError(f"CUDA IPC weight sync: {name} is on {t.device}; it needs CUDA tensors "
                             "(use rollout.weight_sync=object_store on CPU)")
        out.append((name, reduce_tensor(t.detach().contiguous())))
    return out


def open_ipc_handles(handles: list[tuple[str, tuple]], device_index: int | None = None):
    """Map handles made by :func:`ipc_handles` in another process on the same GPU; yields (name, tensor).
    ``device_index``: this process's index of that GPU (the sender's index is replaced by it)."""
    if device_index is None:
        device_index = torch.cuda.current_device()
    for name, (rebuild, args) in handles:
        args = list(args)
        args[6] = device_index  # rebuild_cuda_tensor(cls, size, stride, offset, storage_cls, dtype, device, ...)
        yield name, rebuild(*args)


# ------------------------------------------------------------------------------------- driver-side strategies
class WeightSync:
    """One way of moving the trainer's weights to every rollout worker (``rollout.weight_sync``).

    :meth:`send` starts the transfer of weight ``version`` and returns ``(calls, weights_ref, trainer_ref)``:
    one Ray call per worker slot that returns the version the worker now holds, the object-store reference a
    replacement worker may load instead of asking the trainer (or None), and a trainer call to wait for (or None).
    The actor group waits for the calls, replaces workers that died, and checks every version."""
    name = ""

    def send(self, group, version: int):
        raise NotImplementedError

    def worker_replaced(self) -> None:
        """A worker slot got a new actor (a collective group must be formed again)."""


class ObjectStoreSync(WeightSync):
    """The trainer's weights as one object in Ray's object store, loaded by every worker (CPU, any layout)."""
    name = "object_store"

    def send(self, group, version: int):
        weights_ref = group.trainer.get_weights.remote()
        group._wait_for_trainer(weights_ref, "weight sync")  # so that a worker's timed call is its own work only
        calls = {i: group._call(i, "load_weights", weights_ref, version) for i in range(len(group.workers))}
        return calls, weights_ref, None


class CudaIpcSync(WeightSync):
    """Each engine maps the parameters of the trainer rank on its own GPU and copies device to device."""
    name = "cuda_ipc"

    def send(self, group, version: int):
        handles = {g: group.trainers[g].ipc_handles.remote() for g in sorted(set(group.worker_gpu))}
        for ref in handles.values():  # the trainer's part first: a worker's timed call is its own work only
            group._wait_for_trainer(ref, "weight sync")
        calls = {i: group._call(i, "load_weights_ipc", handles[g], version) for i, g in enumerate(group.worker_gpu)}
        return calls, None, None


class CollectiveSync(WeightSync):
    """A broadcast from trainer rank 0 over a group of its own with every worker (NCCL on CUDA, gloo on CPU),
    formed at first use and again after a worker was replaced (a new generation: the old group's keys are never
    met)."""
    name = "collective"

    def __init__(self) -> None:
        self.generation = 0
        self.ready = False
        self.address, self.world = None, 0  # the group's store and size, from its last forming

    def worker_replaced(self) -> None:
        self.ready = False

    def _form(self, group, version: int) -> None:
        """Form the group (again) unless it is; a worker that died before or while joining is replaced (it gets
        the weights by the broadcast that follows) and the group formed anew, within rollout.max_restarts."""
        while not self.ready:
            self.generation += 1
            backend = "nccl" if group.cfg.run.device == "cuda" else "gloo"
            world = len(group.workers) + 1
            host, port = group.get(group.trainer.rendezvous_address.remote())
            self.address, self.world = (host, port), world
            group._before("join", version)
            trainer_ref = group.trainer.sync_group_join.remote(host, port, world, backend, self.generation)
            joins = {i: group._call(i, "sync_group_join", host, port, i + 1, world, backend, self.generation)
                     for i in range(len(group.workers))}
            dead = self._wait_joins(group, trainer_ref, joins, (host, port))
            for i, error in sorted(dead.items()):
                group._replace_worker(i, error, "weight sync", -1)  # sets self.ready = False
            self.ready = not dead

    def _wait_joins(self, group, trainer_ref, joins: dict, address: tuple[str, int]) -> dict:
        """Wait for every member's join. Ray ends the call of a worker that died at once, and that first failure
        aborts the others' waits (:func:`abort_join`), which would otherwise last the group's timeout. Returns
        {slot: error} of the workers that died or hung; the trainer's death, or a failure without a death, raises.

        With ``rollout.hang_timeout_s`` (T) a join not over after T is aborted: the members that merely wait for
        a hung one then answer (:class:`SyncGroupAborted`), and a rollout worker whose join has still not answered
        T later is hung: it is killed and counted as dead (a ``WorkerHung``), so that it is replaced."""
        from .errors import describe, is_actor_death, log
        from .worker_calls import hung

        ray = group._ray
        pending = {trainer_ref: None, **{ref: i for i, ref in joins.items()}}
        dead, failed = {}, []
        timeout = getattr(group, "hang_timeout_s", 0.0)
        started, aborted_at = time.monotonic(), None
        while pending:
            wait_s = 2.0  # to look at the nodes
            if timeout:
                due = (started if aborted_at is None else aborted_at) + timeout
                wait_s = max(0.0, min(wait_s, due - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not ready:
                group.check_nodes("the weight-sync group's join")
                now = time.monotonic()
                if timeout and aborted_at is None and now - started >= timeout:
                    aborted_at = now
                    abort_join(*address, self.generation, f"the join was not over in {timeout:g} s "
                               "(rollout.hang_timeout_s): a member is hung")
                elif timeout and aborted_at is not None and now - aborted_at >= timeout:
                    for ref in [r for r, i in pending.items() if i is not None]:
                        i = pending.pop(ref)
                        log(f"rollout worker {i} has not answered its sync_group_join call in {now - started:.1f} s "
                            f"(rollout.hang_timeout_s={timeout:g}, the join aborted {now - aborted_at:.1f} s ago): "
                            "taken as hung, it is killed and replaced")
                        try:
                            ray.kill(group.workers[i], no_restart=True)
                        except Exception:  # noqa: BLE001 - gone already
                            pass
                        dead[i] = hung(i, "sync_group_join (weight sync)", now - started, timeout)
                    aborted_at = now  # the trainer's answer to the abort is waited for as long again
                continue
            i = pending.pop(ready[0])
            try:
                ray.get(ready[0])
                continue
            except Exception as e:  # noqa: BLE001
                error = e
            if i is not None and is_actor_death(error):
                dead[i] = error
            else:
                failed.append((i, error))
            if len(dead) + len(failed) == 1:
                who = f"rollout worker {i}" if i is not None else "the trainer"
                abort_join(*address, self.generation, f"{who} failed to join: {describe(error, 300)}")
        for i, e in failed:
            if i is None and is_actor_death(e):
                group.check_nodes("the weight-sync group's join", e)
                raise e
        if not dead and failed:
            real = [e for _, e in failed if not isinstance(e, SyncGroupAborted)]
            if aborted_at is not None and not real:
                raise TimeoutError(
                    f"the weight-sync group's join (generation {self.generation}) was not over in {timeout:g} s "
                    f"(rollout.hang_timeout_s={timeout:g}) and was aborted, yet every rollout worker answered the "
                    "abort (none is hung): raise rollout.hang_timeout_s, or look at the workers' logs "
                    "(/tmp/ray/session_latest/logs) for what made the join slow")
            raise failed[0][1] if aborted_at is None else real[0]
        return dead

    def hung_among(self, late: set[int]) -> set[int]:
        """Of the rollout worker slots ``late`` in a broadcast that does not end, those hung before it, whom the
        others wait on (:func:`behind_in_sync`); all of ``late`` when none can be told apart."""
        behind = self.address and behind_in_sync(*self.address, self.generation, self.world) or set()
        return {i for i in late if i + 1 in behind} or late

    def send(self, group, version: int):
        self._form(group, version)
        trainer_ref = group.trainer.sync_send.remote(version)
        calls = {i: group._call(i, "sync_receive") for i in range(len(group.workers))}
        return calls, None, trainer_ref


# the registry: rollout.weight_sync accepts these names and "auto" (resolve_weight_sync)
WEIGHT_SYNC_MODES = {cls.name: cls for cls in (ObjectStoreSync, CollectiveSync, CudaIpcSync)}


def resolve_weight_sync(mode: str, device: str, colocate: bool) -> str:
    """``auto`` is CUDA IPC when trainer and engines share GPUs (ray.colocate on CUDA), a collective broadcast
    (NCCL) when they do not, and the object store on CPU."""
    if mode != "auto":
        return mode
    if device != "cuda":
        return "object_store"
    return "cuda_ipc" if colocate else "collective"
