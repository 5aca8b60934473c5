"""The demo trainer (launch/train.py, launch/model.py) and the launch scripts.

Nothing here needs distmon: the distributed runs use ``--no-monitor`` and check what the
trainer itself prints (rank 0's progress lines: the loss averaged over ranks, and the
norm of the all-reduced gradient). Distributed runs use 2 gloo ranks under
``python -m torch.distributed.run`` with a c10d rendezvous on a free local port.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
TRAIN = LAUNCH / "train.py"
SCRIPTS = [LAUNCH / "torchrun_single_node.sh", LAUNCH / "torchrun_multi_node.sh", LAUNCH / "slurm.sbatch"]

sys.path.insert(0, str(LAUNCH))
import model as gpt_model  # noqa: E402  (launch/model.py)
import train  # noqa: E402  (launch/train.py)

STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s+loss (\S+)\s+grad_norm (\S+)", re.M)


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DISTMON_")
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


def _python(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python launch/train.py FLAGS`` (no torchrun: a single process)."""
    return subprocess.run(
        [sys.executable, str(TRAIN), *flags],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _torchrun(*flags: str, nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = train.torchrun_command(nproc, flags)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    return proc


def _progress(stdout: str) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad_norm) from rank 0's progress lines."""
    return {int(m[1]): (float(m[3]), float(m[4])) for m in STEP_LINE.finditer(stdout)}


# ------------------------------------------------------------------------- distributed runs


@pytest.mark.slow
def test_ddp_run_without_monitor_learns():
    proc = _torchrun("--no-monitor", "--preset", "tiny", "--steps", "40", "--print-every", "10")
    out = proc.stdout
    assert "world_size 2" in out and "backend gloo" in out
    assert "monitor: off" in out
    steps = _progress(out)
    assert sorted(steps) == [1, 10, 20, 30, 40], out  # rank 0 only: each line once
    first, last = steps[1][0], steps[40][0]
    assert abs(first - torch.log(torch.tensor(128.0)).item()) < 0.3, "initial loss should be ~ln(vocab)"
    assert last < first - 1.0, f"loss did not decrease enough: {first} -> {last}\n{out}"
    assert all(0 < g < 100 for _, g in steps.values())
    assert re.search(r"^done: 40 steps", out, re.M)


@pytest.mark.slow
def test_nan_on_one_rank_reaches_every_rank_through_allreduce():
    """--nan-rank 1: rank 0 never computed a NaN, yet its reduced gradient holds one."""
    proc = _torchrun(
        "--no-monitor",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--print-every",
        "1",
        "--nan-step",
        "3",
        "--nan-rank",
        "1",
        "--nan-layer",
        "blocks.0.attn.qkv",
    )
    out = proc.stdout
    assert "NaN into blocks.0.attn.qkv on rank 1 at step 3" in out
    steps = _progress(out)
    assert all(map(torch.isfinite, map(torch.tensor, steps[2]))), out
    assert torch.isnan(torch.tensor(steps[3][1])), f"step 3 grad norm should be NaN:\n{out}"
    assert torch.isnan(torch.tensor(steps[4][0])), f"the NaN update should poison step 4's loss:\n{out}"


@pytest.mark.slow
def test_spike_on_one_rank_scales_its_local_gradient_before_allreduce():
    proc = _torchrun(
        "--no-monitor",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--print-every",
        "1",
        "--spike-step",
        "3",
        "--spike-rank",
        "1",
        "--spike-factor",
        "1000",
        "--spike-layer",
        "blocks.1.mlp.fc2",
    )
    steps = _progress(proc.stdout)
    # Rank 1's fc2 gradient x1000, averaged with rank 0's: the reduced norm jumps ~100x+.
    assert steps[3][1] > 50 * steps[2][1], proc.stdout
    assert steps[4][1] < 10 * steps[2][1], proc.stdout  # one step only


@pytest.mark.slow
def test_spike_until_sustains_the_spike_through_that_step():
    proc = _torchrun(
        "--no-monitor",
        "--preset",
        "tiny",
        "--steps",
        "6",
        "--print-every",
        "1",
        "--spike-step",
        "3",
        "--spike-until",
        "5",
        "--spike-factor",
        "1000",
        "--spike-layer",
        "blocks.1.mlp.fc2",
    )
    out = proc.stdout
    assert "gradient x1000 in blocks.1.mlp.fc2 on all ranks at steps 3-5" in out
    steps = _progress(out)
    base = steps[2][1]
    assert all(steps[s][1] > 50 * base for s in (3, 4, 5)), out  # every step of the range
    assert steps[6][1] < 10 * base, out  # and no further


@pytest.mark.slow
def test_min_step_s_throttles_every_step():
    proc = _python(
        "--no-monitor", "--preset", "tiny", "--steps", "4", "--min-step-s", "0.5", "--print-every", "1"
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(_progress(proc.stdout)) == [1, 2, 3, 4]
    done = re.search(r"^done: 4 steps in ([\d.]+)s", proc.stdout, re.M)
    assert done, proc.stdout
    assert float(done[1]) >= 4 * 0.5 - 0.01, proc.stdout  # unthrottled, 4 tiny steps take ~0.1 s


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--spike-until", "5"], "--spike-until needs --spike-step"),
        (["--spike-step", "5", "--spike-until", "4"], "--spike-until (4) must be >= --spike-step (5)"),
        (["--min-step-s", "-1"], "--min-step-s must be a number >= 0"),
        (["--min-step-s", "inf"], "--min-step-s must be a number >= 0"),
    ],
    ids=["until-without-step", "until-before-step", "negative-min-step", "infinite-min-step"],
)
def test_bad_spike_until_and_min_step_s_are_rejected(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--no-monitor", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------- single process


@pytest.mark.slow
def test_plain_python_runs_a_world_of_one():
    """No torchrun: one process, no process group, no DDP; distmon measures the plain module."""
    proc = _python(
        "--preset",
        "tiny",
        "--steps",
        "10",
        "--grad-accum",
        "2",
        "--print-every",
        "5",
        "--port",
        "0",
        "--linger",
        "0",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "world_size 1  backend none" in proc.stdout and "2 micro-batch(es)" in proc.stdout
    lines = STEP_LINE.findall(proc.stdout)
    assert [int(m[0]) for m in lines] == [1, 5, 10]
    final = re.search(r"final grad_norm ([0-9.]+)", proc.stdout)  # measured by distmon
    assert final and 0 < float(final.group(1)) < 100, proc.stdout


@pytest.mark.slow
@pytest.mark.serial  # fails within 30 s: run alone
def test_unknown_layer_fails_fast_with_the_valid_names():
    t0 = time.monotonic()
    proc = _python("--no-monitor", "--preset", "tiny", "--nan-step", "2", "--nan-layer", "blocks.9.mlp.fc1")
    assert proc.returncode == 2
    assert "unknown layer 'blocks.9.mlp.fc1' for --nan-layer" in proc.stderr
    assert "  blocks.0.mlp.fc1\n" in proc.stderr and "  tok_emb\n" in proc.stderr
    assert "distmon demo:" not in proc.stdout  # failed before joining a process group / training
    assert time.monotonic() - t0 < 30


def test_bad_fault_flags_are_rejected_before_training(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as e:
        train.main(["--no-monitor", "--spike-step", "5", "--spike-layer", "lm_head"])
    assert e.value.code == 2
    assert "unknown layer 'lm_head' for --spike-layer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--no-monitor", "--nan-step", "5", "--nan-rank", "1"])  # world size 1
    assert "not a rank of this job" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--no-monitor", "--hang-step", "0"])
    with pytest.raises(SystemExit):
        train.main(["--no-monitor", "--hang-rank", "0"])  # without --hang-step
    assert "--hang-rank needs --hang-step" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(["--no-monitor", "--guard", "skip"])


@pytest.mark.slow
def test_hang_step_stops_the_loop_but_not_the_process():
    proc = subprocess.Popen(
        [
            sys.executable,
            str(TRAIN),
            "--no-monitor",
            "--preset",
            "tiny",
            "--steps",
            "50",
            "--hang-step",
            "3",
            "--print-every",
            "1",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "--hang-step 3" in line:
                break
        assert "--hang-step 3" in lines[-1], "".join(lines)
        time.sleep(1.0)
        assert proc.poll() is None, "the process should stay up while hung"
        assert sorted(_progress("".join(lines))) == [1, 2]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# ------------------------------------------------------------------------- model


def _model(preset: str, device: str | None = None) -> gpt_model.GPT:
    return train.build_model(train.parse_args(["--preset", preset]), device=device)


def test_lm_head_is_tied_to_the_token_embedding():
    m = _model("tiny")
    assert m.lm_head.weight is m.tok_emb.weight
    assert m.lm_head.weight.data_ptr() == m.tok_emb.weight.data_ptr()
    names = [n for n, _ in m.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # listed once
    # Gradient flows into the shared tensor from both uses: rows of tokens that do not occur
    # in the input still get a gradient (through the LM head's softmax).
    idx = torch.zeros(2, 8, dtype=torch.long)  # only token 0 is embedded
    _, loss = m(idx, torch.ones(2, 8, dtype=torch.long))
    loss.backward()
    assert m.tok_emb.weight.grad[5:].abs().sum() > 0
    # An update through one name is visible through the other.
    with torch.no_grad():
        m.lm_head.weight[3, 0] = 42.0
    assert m.tok_emb.weight[3, 0].item() == 42.0


@pytest.mark.parametrize("preset, low, high", [("tiny", 5e4, 5e5), ("small", 5e5, 2e6), ("20m", 15e6, 25e6)])
def test_preset_sizes(preset, low, high):
    m = _model(preset, device="meta")
    n = gpt_model.num_params(m)
    assert low <= n <= high, f"{preset}: {n:,} params"
    assert n == sum(p.numel() for _, p in m.named_parameters())


def test_layer_names_and_default_fault_layer():
    for preset in train.PRESETS:
        args = train.parse_args(["--preset", preset])
        names = gpt_model.layer_names(train.build_model(args, device="meta"))
        assert names[:2] == ["tok_emb", "pos_emb"] and names[-1] == "ln_f"
        assert train.default_fault_layer(args) in names
        per_block = ["ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc1", "mlp.fc2"]
        assert names[2:-1] == [f"blocks.{i}.{s}" for i in range(args.n_layers) for s in per_block]


def test_synthetic_stream_is_seeded_and_learnable_structure():
    a = gpt_model.MarkovTokenStream(64, grammar_seed=0, stream_seed=1)
    b = gpt_model.MarkovTokenStream(64, grammar_seed=0, stream_seed=1)
    c = gpt_model.MarkovTokenStream(64, grammar_seed=0, stream_seed=2)  # another rank's shard
    xa, ya = a.batch(4, 32)
    xb, _ = b.batch(4, 32)
    xc, _ = c.batch(4, 32)
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    assert xa.shape == ya.shape == (4, 32) and torch.equal(xa[:, 1:], ya[:, :-1])
    assert 0 <= int(xa.min()) and int(xa.max()) < 64
    # Every next token is one of its predecessor's few allowed successors.
    tokens = a.sample(16, 200)
    allowed = a.successors[tokens[:, 1:-1]]
    assert (allowed == tokens[:, 2:, None]).any(-1).all()
    assert 0 < a.entropy < torch.log(torch.tensor(4.0)).item()


# ------------------------------------------------------------------------- launch scripts


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_scripts_parse(script):
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_multi_node_script_requires_its_settings():
    env = {k: v for k, v in _env().items() if k not in ("NNODES", "RDZV_ENDPOINT", "RUN_ID", "SLURM_JOB_ID")}
    proc = subprocess.run(
        ["bash", str(LAUNCH / "torchrun_multi_node.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode != 0 and "NNODES" in proc.stderr


def test_free_port_is_drawn_below_the_kernels_ephemeral_range_and_skips_a_bound_port(monkeypatch):
    """A rendezvous port drawn before a job starts cannot be taken in the meantime by a connection's
    local port or a ``bind(0)`` listener, the kernel's picks: the 4-node e2e test's reference job once
    failed to start that way, its port drawn with ``bind(0)`` 40 s before."""
    low = train._ephemeral_floor()
    ports = [train.free_port() for _ in range(50)]
    assert all(1024 <= p < low for p in ports), ports
    assert len(set(ports)) > 40, ports  # drawn at random, not one port again and again
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        draws = iter([ports[0], ports[1]])

        class Draws:
            def randrange(self, a, b):
                return next(draws)

        monkeypatch.setattr(train.random, "Random", Draws)
        assert train.free_port() == ports[1]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_scripts_restart_with_c10d_and_their_own_rank_0_store(script, tmp_path):
    """Restartable jobs get the configuration whose restarts work (#39, docs/deployment.md): the c10d
    rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, with MAX_RESTARTS passed on. A stand-in
    ``torchrun`` (and ``srun``, ``scontrol``) on PATH prints what the script would have run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "torchrun": 'echo "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-}" "$@"',
        "srun": 'while [[ $1 == --* ]]; do shift; done; exec "$@"',  # its options, then the command
        "scontrol": "echo node0",
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in _env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", MAX_RESTARTS="3", NPROC="2", NNODES="1")
    env.update(RDZV_ENDPOINT="127.0.0.1:29400", RUN_ID="job", SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="1")
    env.update(SLURM_JOB_NODELIST="node0", DISTMON_FILE_SD_DIR=str(tmp_path / "sd"), REPO_DIR=str(ROOT))
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    ran = proc.stdout.strip().splitlines()[-1]
    assert ran.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "), ran
    assert "--max-restarts 3" in ran and ("--rdzv-backend c10d" in ran or "--standalone" in ran), ran
