"""A DDP step beside an unwrapped twin, and the comparison of a snapshot with it.

Shared by the modules that train ``helpers.GPT`` under DDP on real gloo ranks and check what
distmon reports (test_nonfinite_attribution, test_host_syncs_and_collective_schedule,
test_rank0_http_serving, test_failure_isolation). The references are ``p.grad`` of the DDP
module after backward (the reduced gradient) and an un-wrapped twin of the module that runs the
same batch on each rank (its ``.grad`` is that rank's local gradient), both in float64
(``helpers.reference_norms``); never distmon's.
"""

import contextlib
import copy
import socket
import time

import torch
from helpers import BUCKET_CAP_MB, GPT, close, lm_loss, make_batch, reference_norms, sync_twin
from torch.nn.parallel import DistributedDataParallel as DDP

REL = 1e-5
LAYERS = ["emb", "blocks.0.ln", "blocks.0.fc", "blocks.1.ln", "blocks.1.fc", "norm", "head"]


def setup(seed=0):
    """(model, twin, ddp, opt): the GPT, its un-wrapped copy, DDP with small buckets, SGD."""
    torch.manual_seed(seed)
    model = GPT()
    twin = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    return model, twin, ddp, opt


def train_step(rank, step, model, twin, ddp, opt, batch=None, after_backward=None, accum=1):
    """One optimizer step on DDP and on the twin; returns the references (computed before
    opt.step). With accum > 1, the first accum - 1 micro-batches run under ddp.no_sync()."""
    sync_twin(twin, model)
    opt.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    for micro in range(accum):
        x, y = batch if batch is not None else make_batch(rank, step, micro)
        with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
            loss = lm_loss(ddp(x), y)
            loss.backward()
        lm_loss(twin(x), y).backward()
    params = dict(model.named_parameters())
    tparams = dict(twin.named_parameters())
    names = [n for n, p in params.items() if p.requires_grad]
    ref_total, ref_layers = reference_norms([(n, params[n].grad) for n in names])
    loc_total, loc_layers = reference_norms([(n, tparams[n].grad) for n in names])
    if after_backward is not None:
        after_backward()
    opt.step()
    return {
        "step": step,
        "loss": loss.detach(),
        "ref_total": ref_total,
        "ref_layers": ref_layers,
        "local_total": loc_total,
        "local_layers": loc_layers,
    }


def plain_recs(recs):
    """A rank's records as plain data (the loss as a float), to travel back to the test."""
    return [{k: (float(v) if k == "loss" else v) for k, v in r.items()} for r in recs]


def port_closed(port, within_s=5.0):
    """Whether 127.0.0.1:port refuses connections within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                pass
        except OSError:
            return True
        time.sleep(0.1)
    return False


def number_problems(snap, step, recs_by_rank, world_size, skip=()):
    """Compare a snapshot with the references of `step`. `skip` = {(rank or 'reduced', layer or None)}."""
    problems = []
    where = f"step {step}"
    if snap is None:
        return [f"{where}: no snapshot"]
    if snap["step"] != step:
        problems.append(f"{where}: snapshot.step = {snap['step']!r}")
    ref = recs_by_rank[0][step - 1]
    if ("reduced", None) not in skip and not close(snap["grad_norm"], ref["ref_total"], REL):
        problems.append(f"{where}: grad_norm {snap['grad_norm']!r} != reference {ref['ref_total']!r}")
    lg = snap["layer_grad_norms"]
    if not isinstance(lg, dict) or list(lg) != LAYERS:
        problems.append(f"{where}: layer_grad_norms keys {lg!r}")
    else:
        for layer in LAYERS:
            if ("reduced", layer) in skip:
                continue
            if not close(lg[layer], ref["ref_layers"][layer], REL):
                problems.append(
                    f"{where}: layer {layer} {lg[layer]!r} != reference {ref['ref_layers'][layer]!r}"
                )
    for q in range(world_size):
        loc = recs_by_rank[q][step - 1]
        if (q, None) not in skip and not close(snap["rank_grad_norms"][q], loc["local_total"], REL):
            problems.append(
                f"{where}: rank_grad_norms[{q}] {snap['rank_grad_norms'][q]!r} != twin {loc['local_total']!r}"
            )
        for j, layer in enumerate(LAYERS if snap["rank_layer_grad_norms"] is not None else ()):
            if (q, layer) in skip:
                continue
            got = snap["rank_layer_grad_norms"][q][j]
            if not close(got, loc["local_layers"][layer], REL):
                problems.append(
                    f"{where}: rank_layer_grad_norms[{q}][{layer}] {got!r} != "
                    f"twin {loc['local_layers'][layer]!r}"
                )
    return problems
