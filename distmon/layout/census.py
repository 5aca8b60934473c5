"""The layout read from the whole job at start-up, and the job's norm counted by value.

Whatever object ``GradMonitor`` is handed (a DDP or FSDP2 model, a pipeline stage's module, a
``PipelineStage``, a tensor-parallel module), distmon first reads from it where each gradient
lives (:func:`distmon.sources.read_layout`): for each tracked parameter, whether this rank's
part counts in the job's figures or is a copy counted on another rank. That reading rests on
what the object says about the job (its group is the job; a mesh dimension its mesh does not
span holds copies). Before anything is installed, every rank checks it against what the job
holds, over the job's process group (the default group: the whole job):

* the layers every rank holds: the job's layers are their union, in pipeline order;
* per parameter, which ranks hold it, where their part sits (:func:`layout.part_position`) and a
  fingerprint of its values (:func:`fingerprint`). Copies are bit-identical at construction (DDP
  broadcasts them, FSDP2 and tensor parallelism shard or replicate identically seeded weights);
  different parts are not. Among the ranks that hold one position of a parameter, every distinct
  value must be counted exactly once (:func:`rule`).

Where the reading and the values disagree, a value that no rank counts because the copy it was
taken for exists nowhere is counted on the lowest rank holding it (unambiguous: a stage's own
parameters, say); every other disagreement is refused at construction, naming the parameter and
the declaration that resolves it (``distinct_over=``, ``replicated_over=``, ``job_group=``).
Declarations are trusted here (but one value counted on ranks declared distinct over different
groups is refused: they are copies over a group left undeclared) and checked by the first step's
gradients (:class:`JobNorm`).

The cost is bounded whatever the world size: each parameter's record (ten integers) travels
to one rank chosen by a hash of its name, which judges every holder of that name and sends the
rulings back: three all-to-alls (the first carries, next to the record counts, four integers
per rank: whether it failed, its stage, a digest of its layers and their size), and one
broadcast per distinct set of layers when the ranks hold different ones (a pipeline's stages).
No rank ever holds every rank's list of parameters: a rank receives the records of the names it
owns, about as many as it sends.

The first step's check (:mod:`distmon.layout.verify`) uses the same routing: :func:`distinct_sq` adds
up the sums of squares of every rank's gradients, each distinct (position, value) once.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..setup.hostinfo import _collective_device

__all__ = [
    "RankParts",
    "JobLayout",
    "read_job",
    "alone",
    "rule",
    "fingerprint",
    "fingerprints",
    "digest",
    "distinct_sq",
    "Ruling",
]

_P = (1 << 61) - 1  # a prime: sums reduced modulo it stay exact in int64
_CHUNK = 1 << 20  # elements fingerprinted at once (one int64 copy of this many)
_SMALL = 1 << 12  # tensors up to this many elements are fingerprinted together (their cost is per call)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def digest(*parts: object) -> int:
    """A 63-bit hash of ``parts``' repr, the same in every process (Python's ``hash`` is not).

    Example:
        >>> digest("emb.weight", (24, 8)) == digest("emb.weight", (24, 8)) != digest("emb.bias")
        True
    """
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's bits as a flat integer tensor (8-byte elements as two 4-byte halves)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    return flat.view(_INT.get(flat.element_size(), torch.int32))


def fingerprints(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor, two int64 checksums of its bits (an ``[n, 2]`` tensor on the host): equal
    tensors give equal fingerprints on every rank (integer sums do not depend on the order of a
    reduction), different ones differ but with negligible probability: a plain sum and one
    weighted by position (1..251), modulo a 61-bit prime. Small tensors (biases, norms) are
    taken together, a million elements at a time on their device: their cost is per operation,
    not per element (one host read per device at the end).

    Example:
        >>> a = torch.tensor([1.0, 2.0])
        >>> p = fingerprints([a, a.clone(), a.flip(0)])
        >>> torch.equal(p[0], p[1]), torch.equal(p[0], p[2])
        (True, False)
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}

    def flush(key: tuple[torch.device, torch.dtype]) -> None:
        batch = batches.pop(key, [])
        if batch:
            for (i, _), row in zip(batch, _batch_prints([bits for _, bits in batch])):
                out[i] = row

    for i, t in enumerate(tensors):
        if t.is_sparse:
            t = t.coalesce()
            pair = fingerprints([t.indices(), t.values()])
            out[i] = (pair[0] * 3 + pair[1]).remainder_(_P)
            continue
        bits = _bits(t)
        if bits.numel() > _SMALL:  # a large tensor alone, a chunk at a time
            out[i] = _large_print(bits)
            continue
        key = (bits.device, bits.dtype)
        if sum(b.numel() for _, b in batches.get(key, [])) + bits.numel() > _CHUNK:
            flush(key)
        batches.setdefault(key, []).append((i, bits))
    for key in list(batches):
        flush(key)
    return torch.stack([row.cpu() for row in out]) if out else torch.zeros(0, 2, dtype=torch.int64)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """One tensor's fingerprint (:func:`fingerprints`): two int64 on the host.

    Example:
        >>> a = torch.tensor([1.0, 2.0]); torch.equal(fingerprint(a), fingerprint(a.flip(0)))
        False
    """
    return fingerprints([t])[0]


def _batch_prints(bits: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fingerprints of small tensors of one integer dtype on one device, taken together."""
    device = bits[0].device
    sizes = torch.tensor([b.numel() for b in bits], dtype=torch.int64, device=device)
    flat = torch.cat(bits).to(torch.int64)  # |bits| < 2**31
    seg = torch.repeat_interleave(torch.arange(len(bits), device=device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    weight = (torch.arange(flat.numel(), device=device) - starts[seg]).remainder_(251).add_(1)
    sums = torch.zeros(2, len(bits), dtype=torch.int64, device=device)
    sums[0].index_add_(0, seg, flat)  # integer sums: exact in any order (< 2**60 here)
    sums[1].index_add_(0, seg, flat.mul_(weight))
    return list(sums.t().remainder(_P))


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """1..251 by position, the first ``n`` (kept per device, grown as needed)."""
    w = _WEIGHTS.get(device)
    if w is None or w.numel() < n:
        w = _WEIGHTS[device] = torch.arange(n, device=device).remainder_(251).add_(1)
    return w[:n]


def _large_print(bits: torch.Tensor) -> torch.Tensor:
    """A large tensor's fingerprint, a chunk at a time (each chunk's sums < 2**60)."""
    out = torch.zeros(2, dtype=torch.int64, device=bits.device)
    weight = _weights(min(bits.numel(), _CHUNK), bits.device)
    for start in range(0, bits.numel(), _CHUNK):
        piece = bits[start : start + _CHUNK].to(torch.int64)
        out[0] += piece.sum()
        out[1] += piece.mul_(weight[: piece.numel()]).sum()
        out.remainder_(_P)
    return out


@dataclass(frozen=True)
class RankParts:
    """What one rank tells the job about its tracked parameters (the grouping's order) at start-up.

    ``counted``/``why``: the reading of the object passed (counts here, or why it is a copy
    counted elsewhere); ``declared``: matched by ``replicated_over=``/``distinct_over=``;
    ``undeclared``: reduced by no wrapper, no DTensor, not declared (this rank's own unless other
    ranks hold it too); ``distinct``: per parameter, a digest of the ranks of the group it is
    declared ``distinct_over`` (0: none; empty: none at all); ``plain``: the refusal of a plain
    module on several ranks, raised if other ranks hold its parameters; ``unstaged``: the refusal
    of a module that holds parameters other ranks do not while ``torch.distributed.pipelining``
    is in use without a ``PipelineStage`` around it; ``stage``: this rank's pipeline stage (None: not known).
    """

    names: Sequence[str]
    tensors: Sequence[torch.Tensor]  # this rank's part of each parameter's values
    positions: Sequence[tuple]
    layer_of: Sequence[str]  # each parameter's layer
    layers: tuple[str, ...]  # this rank's layers, in model order
    counted: Sequence[bool]
    why: Sequence[str]
    declared: Sequence[bool]
    undeclared: Sequence[bool]
    plain: str | None = None
    unstaged: str | None = None
    stage: int | None = None
    distinct: Sequence[int] = ()


@dataclass(frozen=True)
class JobLayout:
    """The job's layout as every rank confirmed it.

    ``layers``: the job's layers, every part's, in pipeline order; ``parts``: how many different
    sets of layers the ranks hold (stages; 1 for a job whose ranks hold the same layers);
    ``part``: this rank's (0-based, in that order); ``counted``: per tracked parameter, whether
    this rank's part counts in the job's figures; ``refusal``: what is wrong, naming the parameter
    and the fix (raised at construction on this rank).
    """

    layers: tuple[str, ...]
    counted: tuple[bool, ...]
    parts: int = 1
    part: int = 0
    refusal: Exception | None = None


def alone(parts: RankParts) -> JobLayout:
    """The reading of a job of one rank: nothing to confirm."""
    return JobLayout(layers=parts.layers, counted=tuple(parts.counted))


# -- the judgement of one parameter name's holders ------------------------------------------------

# a record per (rank, parameter): what its owner judges (DISTINCT: a digest of the ranks of the
# group it is declared distinct over, 0 where none is declared)
NAME, SLOT, FP0, FP1, COUNTED, DECLARED, LAYER, UNDECLARED, RANK, DISTINCT = range(10)
N_FIELDS = 10


class Ruling:
    """What the owner of a parameter name says of one rank's record (with ``other``, a rank
    concerned, and ``holders``, how many ranks hold the name)."""

    OK = 0
    COUNT = 1  # taken for a copy of a part that no rank counts: counted here
    UNDECLARED = 2  # no wrapper, no placement, no declaration, and other ranks hold it too
    COPIES_DIFFER = 3  # taken for a copy, but its values differ from the copy that counts
    COUNTED_TWICE = 4  # identical values counted on several ranks, nothing declared
    AMBIGUOUS = 5  # one position held with different values, each counted, nothing declared
    LAYER = 6  # another rank puts the parameter in another layer (groups= differs)


def rule(records: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """Per record, ``(ruling, other rank, holders)``: every holder of a parameter name at once.

    Among the records of one position (``SLOT``), each distinct value (``FP0``, ``FP1``) must be
    counted by exactly one rank: none (a value taken for a copy of another) is counted on its
    lowest rank when its position holds no other value and nobody counts any (the copy it was
    taken for does not exist), refused otherwise; several counting one value, or several values
    counted at one position, are refused unless declared (the declaration is trusted here, except
    that one value counted by ranks declared distinct over different groups is refused: nothing
    says they differ).

    Example:
        >>> r = lambda rank, fp, counted: (7, 1, fp, 0, counted, 0, 5, 0, rank, 0)
        >>> rule([r(0, 11, 1), r(1, 11, 0)])                 # a copy and the one that counts
        [(0, -1, 2), (0, -1, 2)]
        >>> rule([r(0, 11, 1), r(1, 12, 0)])[1][0] == Ruling.COPIES_DIFFER
        True
    """
    out = [(Ruling.OK, -1, 0)] * len(records)
    by_name: dict[int, list[int]] = {}
    for i, rec in enumerate(records):
        by_name.setdefault(rec[NAME], []).append(i)
    for idx in by_name.values():
        holders = len({records[i][RANK] for i in idx})
        ruling = {i: (Ruling.OK, -1) for i in idx}
        first = min(idx, key=lambda i: records[i][RANK])
        for i in idx:
            if records[i][LAYER] != records[first][LAYER]:
                ruling[i] = (Ruling.LAYER, records[first][RANK])
            elif records[i][UNDECLARED] and holders > 1:
                other = next(records[j][RANK] for j in idx if records[j][RANK] != records[i][RANK])
                ruling[i] = (Ruling.UNDECLARED, other)
        slots: dict[int, list[int]] = {}
        for i in idx:
            slots.setdefault(records[i][SLOT], []).append(i)
        for members in slots.values():
            _rule_slot(records, members, ruling)
        for i in idx:
            out[i] = (*ruling[i], holders)
    return out


def _rule_slot(records: Sequence[Sequence[int]], members: list[int], ruling: dict) -> None:
    """The rulings on the holders of one position of one parameter (see :func:`rule`)."""
    values: dict[tuple[int, int], list[int]] = {}
    for i in sorted(members, key=lambda i: records[i][RANK]):
        values.setdefault((records[i][FP0], records[i][FP1]), []).append(i)
    counting = {v: [i for i in held if records[i][COUNTED]] for v, held in values.items()}
    anyone = [c[0] for c in counting.values() if c]

    def say(i: int, code: int, other: int) -> None:
        if ruling[i][0] == Ruling.OK:  # the first thing wrong with a record is the one said
            ruling[i] = (code, records[other][RANK])

    for v, held in values.items():
        count = counting[v]
        if not count:
            if not anyone and len(values) == 1:
                ruling[held[0]] = (Ruling.COUNT, -1) if ruling[held[0]][0] == Ruling.OK else ruling[held[0]]
            else:
                other = anyone[0] if anyone else next(i for i in members if i not in held)
                for i in held:
                    say(i, Ruling.COPIES_DIFFER if anyone else Ruling.AMBIGUOUS, other)
        elif len(count) > 1 and not all(records[i][DECLARED] for i in count):
            for i in count[1:]:
                say(i, Ruling.COUNTED_TWICE, count[0])
        elif len(count) > 1 and all(records[i][DISTINCT] for i in count):
            # declared distinct, but over different groups: nothing says these two differ (copies
            # over a group left undeclared: the expert-data-parallel group of plain experts)
            for i in count[1:]:
                if records[i][DISTINCT] != records[count[0]][DISTINCT]:
                    say(i, Ruling.COUNTED_TWICE, count[0])
    if len(anyone) > 1:
        for i in anyone[1:]:
            if not (records[i][DECLARED] and records[anyone[0]][DECLARED]):
                say(i, Ruling.AMBIGUOUS, anyone[0])


# -- routing records to the owner of their key, and the answers back --------------------------------


def _route(
    records: torch.Tensor, owners: torch.Tensor, group: dist.ProcessGroup, head: Sequence[int] = ()
) -> tuple[torch.Tensor | None, torch.Tensor, list[int], list[int], torch.Tensor]:
    """Send each row of ``records`` (int64, on the host) to rank ``owners[row]`` of ``group``, and
    ``head`` (a few integers) to every rank.

    Returns what this rank received (every sender's rows, in rank order; None when some rank's
    head says it failed: its first integer), every rank's head, how many rows came from each
    rank, how many went to each, and the order the rows were sent in (for :func:`_answer`).
    Two all-to-alls: the counts with the heads, then the rows.
    """
    world = dist.get_world_size(group)
    device = _collective_device(group)
    order = torch.argsort(owners, stable=True)
    sent = torch.bincount(owners, minlength=world)
    mine = torch.cat(
        [sent.reshape(world, 1), torch.tensor(list(head), dtype=torch.int64).expand(world, len(head))], 1
    )
    theirs = torch.empty_like(mine, device=device)
    dist.all_to_all_single(theirs, mine.contiguous().to(device), group=group)
    theirs = theirs.cpu()
    came, heads = theirs[:, 0], theirs[:, 1:]
    if len(head) and int(heads[:, 0].max()):
        return None, heads, came.tolist(), sent.tolist(), order
    got = torch.empty(int(came.sum()), records.shape[1], dtype=torch.int64, device=device)
    dist.all_to_all_single(
        got,
        records[order].contiguous().to(device),
        output_split_sizes=came.tolist(),
        input_split_sizes=sent.tolist(),
        group=group,
    )
    return got.cpu(), heads, came.tolist(), sent.tolist(), order


def _answer(
    answers: torch.Tensor, *, came: list[int], sent: list[int], order: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Send each received row's answer back to the rank it came from; this rank's answers come back
    in the order of its own records (one all-to-all)."""
    device = _collective_device(group)
    back = torch.empty(sum(sent), answers.shape[1], dtype=torch.int64, device=device)
    dist.all_to_all_single(
        back, answers.contiguous().to(device), output_split_sizes=sent, input_split_sizes=came, group=group
    )
    mine = torch.empty_like(back.cpu())
    mine[order] = back.cpu()
    return mine


# -- the start-up reading ---------------------------------------------------------------------------


def read_job(parts: RankParts | None, group: dist.ProcessGroup) -> JobLayout | None:
    """Every rank's reading of the layout, checked against what the job holds (collectives on every
    rank of ``group``, whatever happened locally: ``parts`` None when this rank failed before).

    Returns None when some rank failed (every rank then raises that rank's error at ``agree``),
    else the job's reading, whose ``refusal`` names what is wrong on this rank. Raises, after the
    first collective, what failed on this rank while it made its records.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    records, failure = torch.zeros(0, N_FIELDS, dtype=torch.int64), None
    try:
        if parts is not None:
            records = _records(parts, me)
    except Exception as e:  # raised once every rank knows (a hang otherwise)
        parts, failure = None, e
    # 1. the records to their owners, with who failed, each rank's stage and its layers' digest
    blob = pickle.dumps(parts.layers) if parts is not None else b""
    stage = -1 if parts is None or parts.stage is None else parts.stage
    head = (int(parts is None), stage, digest(parts.layers) if parts is not None else 0, len(blob))
    got, heads, came, sent, order = _route(records, records[:, NAME].remainder(world), group, head)
    if failure is not None:
        raise failure
    if got is None or parts is None:
        return None
    # 2. the owners' rulings back (one all-to-all)
    answers = torch.tensor(rule(got.tolist()), dtype=torch.int64).reshape(-1, 3)
    rulings = _answer(answers, came=came, sent=sent, order=order, group=group).tolist()
    # 3. the job's layers: every distinct set once, stages first to last (a broadcast each)
    kinds: dict[int, list[int]] = {}
    for r in range(world):
        kinds.setdefault(int(heads[r, 2]), []).append(r)
    ordered = sorted(
        kinds.values(), key=lambda rs: (int(heads[rs[0], 1]) if heads[rs[0], 1] >= 0 else world, rs[0])
    )
    layers: dict[str, None] = dict.fromkeys(parts.layers) if len(ordered) == 1 else {}
    for ranks in ordered if len(ordered) > 1 else ():
        told = _broadcast_layers(parts.layers, blob, src=ranks[0], size=int(heads[ranks[0], 3]), group=group)
        layers.update(dict.fromkeys(told))
    counted = tuple(bool(parts.counted[i]) or code == Ruling.COUNT for i, (code, _, _) in enumerate(rulings))
    return JobLayout(
        layers=tuple(layers),
        counted=counted,
        parts=len(ordered),
        part=next(k for k, ranks in enumerate(ordered) if me in ranks),
        refusal=_refusal(parts, rulings, world, stages=heads[:, 1].tolist()),
    )


def _records(parts: RankParts, rank: int) -> torch.Tensor:
    """Per parameter: its name, position, value and reading, for the owner of its name to judge."""
    p = parts
    rows = [
        (
            digest(name),
            digest(name, p.positions[i]),
            0,
            0,
            int(p.counted[i]),
            int(p.declared[i]),
            digest(p.layer_of[i]),
            int(p.undeclared[i]),
            rank,
            p.distinct[i] if p.distinct else 0,
        )
        for i, name in enumerate(p.names)
    ]
    records = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), N_FIELDS)
    records[:, FP0 : FP1 + 1] = fingerprints(parts.tensors)
    return records


def _broadcast_layers(
    mine: tuple[str, ...], blob: bytes, *, src: int, size: int, group: dist.ProcessGroup
) -> tuple[str, ...]:
    """Rank ``src``'s layers (``size`` bytes pickled), from it to every rank of ``group``."""
    device = _collective_device(group)
    if dist.get_rank(group) == src:
        dist.broadcast(
            torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device),
            src=dist.get_global_rank(group, src),
            group=group,
        )
        return mine
    data = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(data, src=dist.get_global_rank(group, src), group=group)
    return pickle.loads(bytes(data.cpu().tolist()))


def _refusal(
    parts: RankParts, rulings: list[list[int]], world: int, stages: Sequence[int] = ()
) -> Exception | None:
    """What this rank refuses, naming the parameters (at most three) and the fix (``stages``: every
    rank's pipeline stage, -1 where none is known)."""
    if parts.plain is not None and any(holders > 1 for _, _, holders in rulings):
        return TypeError(parts.plain)
    if parts.unstaged is not None and any(holders < world for _, _, holders in rulings):
        return ValueError(parts.unstaged)
    wrong: dict[int, list[int]] = {}
    for i, (code, _, _) in enumerate(rulings):
        if code not in (Ruling.OK, Ruling.COUNT):
            wrong.setdefault(code, []).append(i)
    if not wrong:
        return None
    code, idx = min(wrong.items())
    names = [parts.names[i] for i in idx]
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    i = idx[0]
    holders, other = rulings[i][2], rulings[i][1]
    if parts.stage is not None and 0 <= other < len(stages) and stages[other] not in (-1, parts.stage):
        return ValueError(
            f"distmon: pipeline stages {parts.stage} and {stages[other]} (ranks here and {other}) both "
            f"hold parameter {shown}: each stage's parameters must keep their names in the whole model, "
            "which is how distmon tells the stages' parameters and layers apart. Cut the stages "
            "torchtitan's way (a copy of the whole model with the other stages' modules deleted, "
            "names kept), not as re-indexed slices (nn.Sequential(*layers[a:b]) numbers them from 0)"
        )
    if code == Ruling.LAYER:
        return ValueError(
            f"distmon: options differ between ranks: groups puts parameter {shown} in layer "
            f"{parts.layer_of[i]!r} here and in another layer on rank {rulings[i][1]}: every rank "
            "must group its parameters alike"
        )
    distinct = "distinct_over={r'<name pattern>': process_group}"
    replicated = "replicated_over={r'<name pattern>': process_group}"
    if code == Ruling.UNDECLARED:
        return ValueError(
            f"distmon: parameter {shown} is reduced by no DDP or FSDP wrapper and is no DTensor, and "
            f"{holders} ranks of the {world}-rank job hold it: distmon cannot tell which of them hold "
            "copies of its gradient. Declare it: GradMonitor(..., "
            f"{replicated}) names the group over which the model's own code makes it identical (a "
            "group of one rank: its gradient is this rank's own); GradMonitor(..., "
            f"{distinct}) says each rank of that group holds a different part of it (experts over "
            "their expert-parallel group)"
        )
    if code == Ruling.COPIES_DIFFER:
        return ValueError(
            f"distmon: parameter {shown} holds other values here than on the rank whose copy counts "
            f"(distmon reads it as a copy: {parts.why[i]}). If each of these ranks holds a "
            f"different part of it (experts over an expert-parallel group), declare it: "
            f"GradMonitor(..., {distinct}) with the group whose ranks hold different parts; if they "
            "are copies, make them identical before building GradMonitor (the same seed on every "
            "rank, or a broadcast)"
        )
    if code == Ruling.COUNTED_TWICE:
        return ValueError(
            f"distmon: parameter {shown} holds the same values here as on another rank, and both "
            "count it as a part of their own: nothing says whether they hold copies of "
            f"one gradient. If they do, declare the group they are copies over: GradMonitor(..., "
            f"{replicated}); if they hold different parts that start alike, GradMonitor(..., "
            f"{distinct}). Separate jobs sharing one default process group (a sweep trained side "
            "by side) are each measured on their own with GradMonitor(..., job_group=the job's "
            "process group)"
        )
    return ValueError(
        f"distmon: parameter {shown} is held here with other values than on another rank, at the "
        "same place, and both count it as a part of their own: distmon cannot tell "
        f"different parts of it (experts: declare GradMonitor(..., {distinct}) with the group whose "
        "ranks hold different parts) from copies that differ (make them identical: the same seed "
        "on every rank) or from separate jobs sharing one default process group (GradMonitor(..., "
        "job_group=the job's process group))"
    )


# -- the job's norm, counted by value -----------------------------------------------------------------


def distinct_sq(
    slots: Sequence[int], parts: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None
) -> float:
    """The sum of squares of every rank's ``parts`` over ``group``, each distinct (slot, value) once:
    copies of one part are bitwise equal, different parts are not (collectives on every rank;
    the same float on every rank). ``slots``: where each part sits (a digest of its parameter's
    name and position); None parts (no gradient) add nothing.

    Example:
        >>> distinct_sq([1], [torch.ones(2)], None)   # one process: its own
        2.0
    """
    present = [(s, t) for s, t in zip(slots, parts) if t is not None]
    records = torch.zeros(len(present), 4, dtype=torch.int64)
    if present:  # one host read of every part's fingerprint and sum of squares
        records[:, 0] = torch.tensor([s for s, _ in present], dtype=torch.int64)
        records[:, 1:3] = fingerprints([t for _, t in present])
        records[:, 3] = torch.stack([_sq(t) for _, t in present]).cpu().view(torch.int64)
    if group is None:
        return float(records[:, 3].view(torch.float64).sum())
    got, _, _, _, _ = _route(records, records[:, 0].remainder(dist.get_world_size(group)), group)
    seen: dict[tuple[int, int, int], float] = {}
    for (slot, a, b), value in zip(got[:, :3].tolist(), got[:, 3].view(torch.float64).tolist()):
        seen.setdefault((slot, a, b), value)
    total = torch.tensor([sum(seen.values())], dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(total, group=group)
    return float(total.cpu())


def _sq(grad: torch.Tensor) -> torch.Tensor:
    """A part's float64 sum of squares (on its device): a sparse one's coalesced values, a complex
    one's real and imaginary parts."""
    g = grad.coalesce().values() if grad.is_sparse else grad
    g = torch.view_as_real(g) if g.is_complex() else g
    return g.double().pow(2).sum()
