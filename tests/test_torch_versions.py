"""distmon on every torch release it supports (issue #34): 2.6 and newer, complete from 2.9.

Run by the pinned suite and, with the fast tier and the N-D parity job, by each CI tier on an
older torch (``tests/run_torch_tiers.sh``). What differs between releases lives in
``distmon/compat.py``; these tests check its fallbacks against float64, the release it names
for each (so a fallback is deleted when the floor passes it), that no other module reaches a
name whose presence differs between releases, the refusal of an older torch at import, and real
2-rank DDP and FSDP2 jobs and a world of one under FSDP2 against float64 references: within
1e-5, ``valid`` every step, no monitor error. On torch 2.6-2.8 FSDP2's per-rank local figures
are refused at construction (said in the log, ``batch_size=`` an error) and absent, never NaN.
"""

import ast
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ddp_harness import REPO_ROOT, run_ranks
from helpers import GPT, close, lm_loss, make_batch, reference_norms, rel_err

from distmon import compat

REL = 1e-5
STEPS = 4
RELEASE = compat.TORCH
# torch's own limits on CPU/gloo (not distmon's): such a case is skipped, naming the reason
FSDP_ON_CPU = pytest.mark.skipif(
    RELEASE < (2, 7),
    reason="torch 2.6's FSDP2 does not run on CPU ('Stream' object has no attribute 'record_event')",
)

# names whose presence differs between the supported releases: only compat.py may use them
VERSIONED_NAMES = {
    "_foreach_powsum",
    "_foreach_norm",
    "all_gather_single",
    "all_gather_into_tensor",
    "_get_root_mesh",
    "_mesh_resources",
    "get_root_mesh",
    "_fsdp_param_groups",
    "_fsdp_param_group",
    "_get_gradient_divide_factors",
    "gradient_divide_factor",
    "reduce_scatter_reduce_op",
    "ReduceScatter",
}
VERSIONED_MODULES = {"_fsdp_api", "_fsdp_collectives"}


# --- compat's fallbacks and notes ----------------------------------------------------------------
def _tensors(seed):
    """Generated gradients: shapes from empty to ~10^4 elements, fp32/bf16/fp16, magnitudes over
    12 decades, now and then a non-finite element or a non-contiguous view."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(int(torch.randint(1, 9, (), generator=g))):
        dtype = (torch.float32, torch.bfloat16, torch.float16)[int(torch.randint(0, 3, (), generator=g))]
        n = int(torch.randint(0, 3000, (), generator=g))
        scale = 10.0 ** float(torch.randint(-6, 3, (), generator=g))
        t = (torch.randn(n, 3, generator=g) * scale).to(dtype)
        if n and torch.rand((), generator=g) < 0.15:
            at = int(torch.randint(0, t.numel(), (), generator=g))
            t.view(-1)[at] = (math.inf, -math.inf, math.nan)[seed % 3]
        if torch.rand((), generator=g) < 0.3:
            t = t.t()  # non-contiguous
        out.append(t)
    return out


def _check_sq_sums(sums, tensors):
    for s, t in zip(sums, tensors):
        want = float(t.double().pow(2).sum())
        assert s.dtype == torch.float32 and s.dim() == 0
        if math.isfinite(want):
            assert close(float(s), want, REL, abs_tol=1e-30), (float(s), want, t.dtype, t.shape)
        else:  # non-finite exactly when an element is
            assert not math.isfinite(float(s)), (float(s), want)


@pytest.mark.parametrize("path", ["this_torch", "fallback"])
def test_sq_sums_equal_float64_on_generated_gradients(path, monkeypatch):
    if path == "fallback" and hasattr(torch, "_foreach_powsum"):
        monkeypatch.delattr(torch, "_foreach_powsum")  # as on torch < 2.11
    for seed in range(60):
        tensors = _tensors(seed)
        _check_sq_sums(compat.sq_sums_fp32(tensors), tensors)


def test_each_fallback_names_the_release_that_made_it_unnecessary():
    """compat's notes say which release added each API; on this torch each is there exactly
    from that release on (a fallback whose release the floor reached is dead: delete it)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    added = {
        (2, 13): hasattr(dist, "all_gather_single"),
        (2, 11): hasattr(torch, "_foreach_powsum"),
        (2, 10): hasattr(DeviceMesh, "_get_root_mesh"),
        (2, 9): hasattr(FSDPModule, "set_custom_reduce_scatter"),
        (2, 8): hasattr(FSDPModule, "set_gradient_divide_factor"),
    }
    for release, present in added.items():
        assert present == (RELEASE >= release), (release, RELEASE)
    assert compat.FSDP_LOCAL_FIGURES == (RELEASE >= compat.COMPLETE)
    assert compat.ALL_GATHER == ("all_gather_single" if RELEASE >= (2, 13) else "all_gather_into_tensor")
    assert compat.FLOOR <= RELEASE  # this torch is one distmon runs on
    with open(os.path.join(REPO_ROOT, "distmon", "compat.py"), encoding="utf-8") as f:
        notes = f.read()
    for release in added:  # each fallback's note names its release
        assert f"torch {release[0]}.{release[1]}" in notes, release


def test_no_module_but_compat_uses_a_name_that_differs_between_releases():
    found = []
    for top, _, files in os.walk(os.path.join(REPO_ROOT, "distmon")):
        for name in files:
            path = os.path.join(top, name)
            if not name.endswith(".py") or path.endswith(os.path.join("distmon", "compat.py")):
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Attribute):
                    names = [node.attr]
                elif isinstance(node, ast.Name):
                    names = [node.id]
                elif isinstance(node, ast.alias):
                    names = [node.name]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names = [node.value]
                bad = [n for n in names if n in VERSIONED_NAMES]
                if isinstance(node, ast.ImportFrom) and node.module:
                    bad += [m for m in node.module.split(".") if m in VERSIONED_MODULES]
                found += [f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno}: {n}" for n in bad]
    assert found == []


@pytest.mark.parametrize(
    "version,ok",
    [("2.5.1", False), ("1.13.1", False), ("2.6.0", True), ("2.9.1+cu128", True), ("2.15.0a0+git1", True)],
)
def test_the_supported_range_is_checked_by_release(version, ok):
    if ok:
        assert compat.require_supported(version) >= compat.FLOOR
    else:
        with pytest.raises(ImportError, match=r"distmon needs torch >= 2\.6 \(complete from 2\.9"):
            compat.require_supported(version)


_OLD_TORCH = """
import sys, torch
torch.__version__ = "2.5.1"
import distmon  # needs no torch yet
try:
    {entry}
except ImportError as e:
    print("refused:", e)
else:
    print("ran")
print(sorted(m for m in sys.modules if m.startswith("distmon.")))  # what ran before the refusal
"""


@pytest.mark.slow  # three fresh interpreters (~1.4 s each): the fast tier stays under 90 s
@pytest.mark.parametrize(
    "entry", ["from distmon import GradMonitor", "distmon.DetectorConfig", "import distmon.integrations"]
)
def test_an_older_torch_is_refused_at_import_naming_the_range(entry):
    code = _OLD_TORCH.format(entry=entry)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: distmon needs torch >= 2.6"), out.stdout
    assert "this is torch 2.5.1" in out.stdout
    assert out.stdout.splitlines()[-1] == "['distmon._version']", out.stdout  # refused first


def test_readme_pyproject_and_the_tiers_state_one_range():
    def read(*path):
        with open(os.path.join(REPO_ROOT, *path), encoding="utf-8") as f:
            return f.read()

    floor = "{}.{}".format(*compat.FLOOR)
    assert re.search(rf'"torch>={re.escape(floor)}"', read("pyproject.toml"))
    tiers = (
        re.search(r"^TIERS=\$\{TIERS:-([^}]*)\}", read("tests", "run_torch_tiers.sh"), re.M).group(1).split()
    )
    pinned = re.search(r"torch==([0-9.]+)", read("launch", "install.sh")).group(1)
    assert tiers and pinned not in tiers
    readme = read("README.md")
    assert f"torch {floor}" in readme
    for version in [*tiers, pinned]:
        assert version in readme, version


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_tier_whose_torch_cannot_be_installed_fails_under_ci(tmp_path, ci):
    """Under CI=true a tier whose venv cannot be built fails the run (never a silent skip); by
    hand it is skipped, saying why. (A release no index serves, pip kept off the network.)"""
    env = {**os.environ, "CI": ci, "TIERS": "0.0.1", "DISTMON_CI_CACHE": str(tmp_path)}
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path))
    out = subprocess.run(
        ["bash", os.path.join(REPO_ROOT, "tests", "run_torch_tiers.sh")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "torch 0.0.1 cannot be installed" in out.stderr, out.stderr
    if ci:
        assert out.returncode != 0 and "failing (CI=true)" in out.stderr
    else:
        assert out.returncode == 0 and "skipped" in out.stderr


# --- real ranks against float64 ------------------------------------------------------------------
def _named_full(net):
    """(name, gradient as a whole plain tensor) in model order: a DTensor's full_tensor(); DDP's
    ``module.`` prefix off, as distmon names layers."""
    out = []
    for name, p in net.named_parameters():
        g = p.grad
        out.append((name.removeprefix("module."), g.full_tensor() if hasattr(g, "full_tensor") else g))
    return out


def _mine(grad):
    """This rank's part of a gradient (a DTensor's local shard)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _train(rank, net, bare, twin, opt, mon, *, shard):
    """STEPS steps; per step the snapshot, float64 references of the reduced and the local
    gradient (the twin: an unwrapped copy on this rank's batch alone) and whether the gradients
    are bit for bit those of ``bare``, the same model trained without distmon."""
    recs = []
    bare_opt = torch.optim.SGD(bare.parameters(), lr=0.1)
    for step in range(1, STEPS + 1):
        with torch.no_grad():  # the twin holds this step's weights
            for (_, t), (_, p) in zip(twin.named_parameters(), net.named_parameters()):
                t.copy_(p.full_tensor() if shard else p)
        twin.zero_grad()
        x, y = make_batch(rank, step)
        lm_loss(net(x), y).backward()
        lm_loss(bare(x), y).backward()
        lm_loss(twin(x), y).backward()
        reduced = reference_norms(_named_full(net))
        local = reference_norms([(n, p.grad) for n, p in twin.named_parameters()])
        same = all(
            torch.equal(_mine(a.grad), _mine(b.grad)) for a, b in zip(net.parameters(), bare.parameters())
        )
        for o in (opt, bare_opt):
            o.step()
            o.zero_grad()
        mon.flush()
        s = mon.latest()
        recs.append(
            {
                "step": s.step,
                "valid": s.valid,
                "errors": s.monitor_errors,
                "norm": s.grad_norm,
                "layers": dict(s.layer_grad_norms),
                "ranks": list(s.rank_grad_norms),
                "rank_layers": s.rank_layer_grad_norms,
                "rank_valid": list(s.rank_valid),
                "outliers": list(s.rank_outlier_scores),
                "reduced": reduced,
                "local": local,
                "same": same,
            }
        )
    return recs


def _ddp_job(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import distmon

    # a complex parameter where torch's DDP can broadcast one on gloo (not 2.6-2.8: "Invalid scalar
    # type"): before 2.10 it has a complex bucket of its own
    kw = {"complex_param": RELEASE >= (2, 9)}
    torch.manual_seed(0)
    net, twin = DDP(GPT(**kw), bucket_cap_mb=0.002), GPT(**kw)
    torch.manual_seed(0)
    bare = DDP(GPT(**kw), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mon = distmon.GradMonitor(net, opt, serve="none", export_every=1, export_interval_s=0)
    recs = _train(rank, net, bare, twin, opt, mon, shard=False)
    mon.close()
    return recs


def _fsdp_job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmon

    torch.manual_seed(0)
    net, twin = GPT(), GPT()
    torch.manual_seed(0)
    bare = GPT()
    mesh = init_device_mesh("cpu", (world,))
    for model in (net, bare):
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmon").addHandler(handler)
    refused = None
    if world > 1:
        try:
            distmon.GradMonitor(net, opt, serve="none", batch_size=4).close()
        except ValueError as e:
            refused = str(e)
    mon = distmon.GradMonitor(net, opt, serve="none", export_every=1, export_interval_s=0)
    recs = _train(rank, net, bare, twin, opt, mon, shard=True)
    mon.close()
    return {"recs": recs, "said": said, "refused": refused}


def _check(job, outs, *, local):
    """Every rank's snapshots against the float64 references (local: per-rank figures measured);
    prints the largest relative errors (``pytest -s`` shows them)."""
    world, worst = len(outs), {"global and per-layer": 0.0, "per-rank": 0.0}
    for rank, recs in enumerate(outs):
        for i, r in enumerate(recs):
            where = (rank, r["step"])
            assert r["step"] == i + 1 and r["valid"] and r["errors"] == 0, (where, r)
            assert r["same"], (where, "the gradients differ from those of the run without distmon")
            total, layers = r["reduced"]
            assert close(r["norm"], total, REL), (where, r["norm"], total)
            assert list(r["layers"]) == list(layers), where
            for name, want in layers.items():
                assert close(r["layers"][name], want, REL), (where, name, r["layers"][name], want)
            pairs = [(r["norm"], total), *((r["layers"][k], v) for k, v in layers.items())]
            worst["global and per-layer"] = max(worst["global and per-layer"], *(rel_err(*p) for p in pairs))
            if not local:  # refused at construction: absent, never NaN
                assert r["ranks"] == r["rank_valid"] == r["outliers"] == [] and r["rank_layers"] is None, r
                continue
            assert r["rank_valid"] == [True] * world, (where, r["rank_valid"])
            for q in range(world):
                mine_total, mine_layers = outs[q][i]["local"]
                assert close(r["ranks"][q], mine_total, REL), (where, q, r["ranks"][q], mine_total)
                for j, want in enumerate(mine_layers.values()):
                    assert close(r["rank_layers"][q][j], want, REL), (where, q, j)
                pairs = [(r["ranks"][q], mine_total), *zip(r["rank_layers"][q], mine_layers.values())]
                worst["per-rank"] = max(worst["per-rank"], *(rel_err(*p) for p in pairs))
    said = ", ".join(f"{k} within {v:.1e}" for k, v in worst.items() if local or k != "per-rank")
    print(f"\n{job}, torch {torch.__version__}, {world} rank(s): {said} of float64, valid, no error")


@pytest.mark.slow
def test_a_2_rank_ddp_job_equals_float64_every_step():
    _check("DDP", run_ranks(_ddp_job, 2, timeout=150), local=True)


@pytest.mark.slow
@FSDP_ON_CPU
def test_a_2_rank_fsdp2_job_equals_float64_every_step():
    outs = run_ranks(_fsdp_job, 2, timeout=150)
    _check("FSDP2", [o["recs"] for o in outs], local=compat.FSDP_LOCAL_FIGURES)
    for o in outs:
        if compat.FSDP_LOCAL_FIGURES:
            assert o["refused"] is None and not any("per-rank local figures" in m for m in o["said"]), o
        else:  # torch 2.6-2.8: said once per monitor, at construction; batch_size= refused by name
            assert sum("per-rank local figures are not measured" in m for m in o["said"]) == 2, o["said"]
            assert "batch_size=" in o["refused"] and "torch 2.9" in o["refused"], o["refused"]


@pytest.mark.slow
@FSDP_ON_CPU
def test_fully_shard_on_one_rank_is_measured_like_one_process():
    (out,) = run_ranks(_fsdp_job, 1, timeout=150)
    _check("fully_shard on one rank", [out["recs"]], local=True)
    assert not any("per-rank local figures" in m for m in out["said"]), out["said"]
