"""What does gradient monitoring cost a DDP training step? distmon against its peers, in one run.

``benchmarks/overhead.py`` runs it (see its docstring for the commands). The modules:

* ``sizes``       the GPT shapes, the modes and how many rounds a size gets;
* ``approaches``  bare DDP, distmon and its peers, each attached to its own DDP copy;
* ``distmon_internals``  every private name of distmon the benchmark touches (its timing
  instrumentation), in one place;
* ``runner``      the rounds: ``Bench`` (one size: build, warm up, time, measure memory, profile)
  and ``round_order``; ``measure``, ``memory``, ``profiling`` its clocks, byte counts and
  profiler breakdown;
* ``stats``       paired ratios, their bootstrap interval, the order check, per-approach rows;
* ``verdicts``    the targets and the acceptance verdicts (``gpu``: the GPU preset's, and its report);
* ``report``, ``plot``, ``fmt``  ``overhead.md``, the README's Performance section, ``overhead.png``;
* ``results``     the typed results and their JSON form (``overhead.json``, format unchanged);
* ``cli``, ``machine``, ``paths``  the command line, the machine it ran on, the checkout it measures.

Every approach gets its own DDP copy of the same model (same initial weights; a DDP model
accepts one comm hook). Every round runs ONE training step of every approach on the SAME
batch, in an order that puts every approach in every place equally often (``round_order``),
each timed with ``time.perf_counter`` around forward + backward + the approach's extra work +
``optimizer.step()``, after a ``dist.barrier()`` so the ranks start together. Machine drift
(other jobs on a shared box, thermal state) hits every approach alike and cancels in the ratios.
A step's time is the slowest rank's.

Approaches (see ``approaches.APPROACHES``):

* ``baseline``         bare DDP, no monitoring.
* ``distmon``          ``distmon.GradMonitor(model, opt, serve="none")``: everything default
                       (per-layer + per-rank norms, detectors on, host copy every 10 steps).
                       ``serve="none"``: no HTTP server in a benchmark.
* ``distmon-detailed`` its most detailed setting: ``export_every=1, rank_layers=True``, every
                       parameter its own layer, ``max_layers=100000``.
* ``tutorial``         ``p.register_hook(lambda g: g.norm().item())`` on every parameter.
* ``wandb-hist``       ``wandb.watch(log="gradients")``-style: a hook per parameter that every
                       ``--hist-freq`` steps takes min/max (``.item()``), ``torch.histc`` (64
                       bins) and copies the histogram to the host (``.cpu()``).
* ``wandb-hist-1``     the same, every step.
* ``lightning``        PyTorch Lightning's ``grad_norm(module, 2)`` after every backward.
* ``hand-written``     after backward: ``torch._foreach_norm`` over all gradients, ONE
                       ``all_reduce`` of the stacked squares, no host copy.
* ``distmon-tensorboard``  (``--approaches``; issue #43) distmon's defaults with
                       ``tracker="tensorboard:DIR"``: rank 0's tracker thread writes every step.
* ``wandb-watch``      (``--approaches``; issue #43) ``wandb.watch(model, log="gradients",
                       log_freq=--hist-freq)`` on rank 0's offline W&B run (W&B's own hooks).
* ``allreduce-hook``   (``--gpu``) DDP with torch's ``allreduce_hook``: a Python comm hook alone.
* ``clip-item``        (``--gpu``) ``clip_grad_norm_(...).item()`` after every backward.

``--gpu`` (``gpu``: its targets and report) is issue #35's preset: one GPU, one NCCL rank, bf16
autocast, GPT-20M/124M/350M, ~5 minutes, into ``benchmarks/results/gpu/``.

and the *floor*: one fused read of all gradient bytes (``torch._foreach_norm`` over the
baseline's gradients), timed alone. Extra time is also given in units of the floor
("gradient passes").

Besides the end-to-end step times, the time spent inside each approach's own code is
measured directly (``self ms``: distmon's comm-hook and optimizer-hook code, the peers' hook
bodies and calls); on a noisy shared machine it resolves what step-time differences cannot.
``--profile`` (on by default) adds a ``torch.profiler`` breakdown of distmon's time.

Outputs (``--out``, default ``benchmarks/results``): ``overhead.md`` (tables, machine, torch,
command, notes), ``overhead.json`` (raw numbers), ``overhead.png`` (plot) and
``benchmarks/README_performance.md`` (the README's "Performance" section, generated; only for
``--quick``/``--full`` runs written to the default place).
"""
