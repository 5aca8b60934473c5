"""One optimizer step's life on the device: sums of squares, the step's row, its collective, the export.

=======================  ========================================================================
``sums.py``              pure tensor math: fused sums of squares, their fold into layers, EMAs
``backward.py``          what the sources hand over in a step's backwards (:class:`BackwardSums`)
``loss_scale.py``        the loss scale in force: figures in gradient units
``optimizer_hooks.py``   where a step begins and ends (the optimizers' step hooks), the guard
``schedule.py``          the per-step schedule: fold, keep the row, collective, judge, export
``data_path.py``         the global norm's path, hop by hop, from a gradient to its gauge
``rows.py``              the row schema: where every figure of a step sits
``ring.py``              the device ring of step rows and its non-blocking copy to the host
``exchange.py``          the step's collectives: which ones, and where what they bring lands
``crossrank.py``         the job's fixed-size reductions of every rank's figures
``release.py``           the wait until gloo's thread let go of what the collectives were handed
``clip.py``              ``clip_grad_norm_`` with the norm already measured
``activations.py``       forward activation statistics (opt-in)
``attention_watch.py``   attention blocks' logit bounds on sampled forwards (the precursor's)
``grad_cosine.py``       consecutive steps' gradient cosine (the precursor's oscillation rule)
``update_ratio.py``      per-layer update-to-weight ratios (opt-in)
=======================  ========================================================================
"""
