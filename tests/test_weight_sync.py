"""The collective weight-sync path (gloo on CPU; the same code runs NCCL between GPUs): the engine's model
receives the trainer's weights bit for bit, with the version, and a mismatched model is refused."""
import multiprocessing as mp

import torch

from rlrepro.model import tiny_model


def _run(rank, world, ports, seed_send, queue, mismatch):
    from rlrepro.orchestration.weight_sync import Rendezvous, WeightBroadcaster

    torch.set_num_threads(1)
    rdv = None
    if rank == 0:  # rank 0 hosts the store on a port of its own choosing and tells the others
        rdv = Rendezvous("127.0.0.1")
        port = rdv.port
        for _ in range(world - 1):
            ports.put(port)
    else:
        port = ports.get(timeout=60)
    sync = WeightBroadcaster("127.0.0.1", port, rank, world, generation=3, rendezvous=rdv)
    try:
        if rank == 0:
            model = tiny_model(seed=seed_send)
            try:
                sync.send(model.named_parameters(), version=7)
                queue.put(("sent", {n: p.detach().numpy().copy() for n, p in model.named_parameters()}))
            except ValueError as e:
                queue.put(("error", rank, str(e)))
        else:
            model = tiny_model(seed=99, num_hidden_layers=1 if mismatch else 2)
            try:
                version = sync.receive(dict(model.named_parameters()))
                queue.put(("got", rank, version, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}))
            except ValueError as e:
                queue.put(("error", rank, str(e)))
    finally:
        sync.close()


def _spawn(world, mismatch=False):
    ctx = mp.get_context("spawn")
    queue, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, world, ports, 3, queue, mismatch)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in range(world)]
    for p in procs:
        p.join(timeout=60)
    return results  # numpy arrays, not tensors: torch shares tensors through fds that die with the child


def test_broadcast_delivers_exact_weights_and_version():
    results = _spawn(3)
    sent = next(r[1] for r in results if r[0] == "sent")
    got = [r for r in results if r[0] == "got"]
    assert len(got) == 2
    for _, _, version, params in got:
        assert version == 7
        assert sent.keys() == params.keys()
        for name in sent:
            assert torch.equal(torch.from_numpy(sent[name]), torch.from_numpy(params[name])), name


def test_mismatched_model_is_refused():
    results = _spawn(2, mismatch=True)
    errors = {r[1]: r[2] for r in results if r[0] == "error"}
    assert "same model" in errors[1]  # the worker names the mismatch
    assert "refused" in errors[0]  # and the trainer stops before sending any tensor


def test_store_keeps_listening_after_its_rendezvous_is_gone():
    """Rank 0 builds the store and returns at once (NCCL starts lazily); a rank that connects only later must
    still reach it. The store once shared the Rendezvous socket's descriptor, which closed with the object, and
    the 2-GPU trainer's second rank waited forever (seen on the H200s)."""
    import datetime
    import gc

    import torch.distributed as dist

    from rlrepro.orchestration.weight_sync import Rendezvous, tcp_store

    timeout = datetime.timedelta(seconds=10)
    rdv = Rendezvous("127.0.0.1")
    port = rdv.port
    server = tcp_store("127.0.0.1", port, 2, rdv, timeout)
    del rdv
    gc.collect()
    client = tcp_store("127.0.0.1", port, 2, None, timeout)
    server.set("key", "value")
    assert client.get("key") == b"value"
