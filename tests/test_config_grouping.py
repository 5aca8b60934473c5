"""Options are validated at construction, environment variables apply, grouping rules hold."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
import torch.nn as nn
from ddp_harness import run_ranks

import distmon
from distmon.layout.grouping import OTHER, build_grouping
from distmon.serve.file_sd import TargetFile
from distmon.setup.config import MonitorConfig


@pytest.mark.parametrize(
    "option,value,match",
    [
        ("export_every", 0, "export_every"),
        ("export_every", 2.5, "export_every"),
        ("serve", "everyone", "serve must be one of"),
        ("port", 70000, "port"),
        ("max_layers", 0, "max_layers"),
        ("groups", [("(unclosed", "x")], "bad regex"),
        ("guard", "maybe", "guard"),
        ("linger_s", -1, "linger_s"),
        ("comm_hook", 42, "comm_hook"),
        ("detect", "yes", "detect"),
    ],
)
def test_bad_options_fail_with_a_message_naming_them(option, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        MonitorConfig.from_options(**{option: value})


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="expot_every"):
        MonitorConfig.from_options(expot_every=3)


def test_environment_fills_unset_options_and_arguments_win(monkeypatch):
    monkeypatch.setenv("DISTMON_EXPORT_EVERY", "7")
    monkeypatch.setenv("DISTMON_SERVE", "node")
    monkeypatch.setenv("DISTMON_PORT", "0")
    monkeypatch.setenv("DISTMON_PORT_FALLBACK", "true")
    monkeypatch.setenv("DISTMON_LINGER_S", "2.5")
    cfg = MonitorConfig.from_options(
        export_every=None, serve="all", port=None, port_fallback=None, linger_s=None
    )
    assert (cfg.export_every, cfg.serve, cfg.port, cfg.port_fallback, cfg.linger_s) == (
        7,
        "all",
        0,
        True,
        2.5,
    )


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("DISTMON_PORT", "ninety")
    with pytest.raises(ValueError, match="DISTMON_PORT"):
        MonitorConfig.from_options(port=None)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.ones(1))  # owned by the root module
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_default_grouping_by_owning_module_tied_once_frozen_out():
    g = build_grouping(Net(), None, 128)
    # model order of named_parameters(): the root's own parameters come first
    assert g.layers == ("root", "emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4")
    assert len(g.params) == 1 + 10 + 1  # emb (tied with head), 5 x (weight, bias), scale
    assert "frozen" not in " ".join(g.layers)


def test_regex_rules_and_callable():
    g = build_grouping(Net(), [(r"^blocks\.(\d+)\.", r"block\1"), (r"^emb", "embedding")], 128)
    assert set(g.layers) == {"embedding", "block0", "block1", "block2", "block3", "block4", "root"}
    g = build_grouping(Net(), lambda name, p: "weights" if name.endswith("weight") else "rest", 128)
    assert set(g.layers) == {"weights", "rest"}


def test_cap_folds_the_tail_into_other():
    g = build_grouping(Net(), None, 4)
    assert g.layers == ("root", "emb", "blocks.0", OTHER)
    assert sum(1 for i in g.param_layer if g.layers[i] == OTHER) == 2 * 4  # blocks.1-4


def test_target_file_is_written_atomically_and_removed(tmp_path):
    f = TargetFile(str(tmp_path / "sd"), "run/1 x")
    f.write(
        [("h0:9290", {"run_id": "run/1 x", "node": "h0"}), ("h1:9290", {"run_id": "run/1 x", "node": "h1"})]
    )
    assert os.listdir(tmp_path / "sd") == ["run_1_x.json"]  # no temporary file left behind
    groups = json.loads((tmp_path / "sd" / "run_1_x.json").read_text())
    assert [g["targets"] for g in groups] == [["h0:9290"], ["h1:9290"]]
    f.remove()
    f.remove()  # idempotent
    assert os.listdir(tmp_path / "sd") == []


def _constructor_errors(rank: int, world: int) -> list[str]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = nn.Linear(3, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    messages = []
    with pytest.raises(TypeError) as e:
        distmon.GradMonitor(net, opt, serve="none")
    messages.append(str(e.value))
    model = DDP(net)
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(RuntimeError) as e:
        distmon.GradMonitor(model, opt, serve="none")
    messages.append(str(e.value))
    return messages


@pytest.mark.slow
def test_constructor_errors_are_clear():
    # a plain module is fine in a single process, not on several ranks
    not_ddp, has_hook = run_ranks(_constructor_errors, 2)[0]
    assert "on 2 ranks got a plain Linear" in not_ddp
    # what to do: wrap, then build the monitor; and the frameworks' flag when they did not wrap
    assert "DistributedDataParallel(model)" in not_ddp and "build GradMonitor after wrapping" in not_ddp
    assert "--use_cpu" in not_ddp and "use_cpu=True" in not_ddp
    assert "comm_hook=" in has_hook


def _declared_on_ddp_pairs(rank: int, world: int, log_dir: str) -> tuple[str, list[str]]:
    """DDP over pairs of ranks, a parameter declared replicated over the whole job."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    net = DDP(nn.Linear(4, 2), process_group=pairs[rank // 2])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    log = os.path.join(log_dir, f"rank{rank}.jsonl")
    try:
        distmon.GradMonitor(
            net, opt, serve="none", log_path=log, replicated_over={r"^bias$": dist.group.WORLD}
        )
        message = "accepted"
    except ValueError as e:
        message = str(e)
    dist.barrier()  # every rank released what it opened
    return message, sorted(os.listdir(log_dir))


@pytest.mark.slow
def test_ddp_on_subgroups_holding_the_same_parameters_is_refused_as_one_job(tmp_path):
    # the ranks agree over the job, not over each DDP pair (before 3e74fbf rank 2, rank 0 of its
    # pair, wrote a second log). The pairs hold the same weight, seeded alike, each counting it as
    # its own: two models' gradients, or copies nothing declared. Refused at construction on every
    # rank, naming the declarations and job_group= (separate jobs), and no log is written.
    for message, logs in run_ranks(_declared_on_ddp_pairs, 4, str(tmp_path)):
        assert "'weight'" in message and "replicated_over=" in message and "job_group=" in message, message
        assert logs == []


def test_endpoint_security_options_from_arguments_and_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DISTMON_TLS_CERT", "/etc/distmon/server.pem")
    monkeypatch.setenv("DISTMON_TLS_KEY", "/etc/distmon/server.key")
    monkeypatch.setenv("DISTMON_TLS_CLIENT_CA", "/etc/distmon/ca.pem")
    monkeypatch.setenv("DISTMON_BASIC_AUTH_FILE", "/etc/distmon/users")
    cfg = MonitorConfig.from_options(
        tls_cert=None, tls_key=None, tls_client_ca=None, basic_auth_file=str(tmp_path / "users")
    )
    assert (
        cfg.security.tls_cert,
        cfg.security.tls_key,
        cfg.security.tls_client_ca,
        cfg.security.basic_auth_file,
    ) == (
        "/etc/distmon/server.pem",
        "/etc/distmon/server.key",
        "/etc/distmon/ca.pem",
        str(tmp_path / "users"),
    )
    monkeypatch.delenv("DISTMON_TLS_KEY")
    with pytest.raises(ValueError, match=r"tls_cert \(DISTMON_TLS_CERT\) needs tls_key"):
        MonitorConfig.from_options(tls_cert=None, tls_key=None)
    with pytest.raises(ValueError, match=r"tls_client_ca \(DISTMON_TLS_CLIENT_CA\) needs tls_cert"):
        MonitorConfig.from_options(tls_client_ca="ca.pem")


def _bind_errors(rank: int, world: int, missing_cert: str) -> list[tuple[str, object, str]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = nn.Linear(3, 3)
    model, opt = DDP(net), torch.optim.SGD(net.parameters(), lr=0.1)
    errors = []
    for options in ({"addr": "not-an-ip"}, {"tls_cert": missing_cert, "tls_key": missing_cert}):
        with pytest.raises((OSError, ValueError)) as e:
            distmon.GradMonitor(model, opt, port=0, linger_s=0, **options)
        errors.append((type(e.value).__name__, getattr(e.value, "errno", None), str(e.value)))
    return errors


@pytest.mark.slow
def test_bind_errors_at_construction_say_what_they_are(tmp_path):
    """A name that does not resolve is not "address in use"; a TLS file that cannot be loaded
    fails construction (through the same exchange as a taken port: no rank is left waiting)."""
    missing = str(tmp_path / "missing.pem")
    bad_addr, bad_cert = run_ranks(_bind_errors, 1, missing)[0]
    kind, code, msg = bad_addr
    assert kind == "OSError" and code != errno.EADDRINUSE and "in use" not in msg, bad_addr
    assert "not-an-ip" in msg and "DISTMON_ADDR" in msg, bad_addr
    kind, code, msg = bad_cert
    assert kind == "ValueError" and "tls_cert" in msg and repr(missing) in msg, bad_cert
