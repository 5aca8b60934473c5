"""Judging finished step rows: anomaly detectors, the gradient noise scale, what they carry across restarts.

==================  =============================================================================
``judge.py``        batches finished rows through the detectors and the noise scale
``detectors.py``    the anomaly detectors, on the device (:class:`DetectorConfig`)
``noise_scale.py``  the gradient noise scale B_simple
``precursor.py``    the divergence precursor: a warning from sampled attention-logit bounds
``resume.py``       a monitor's state across a restart (``state_dict`` / ``load_state_dict``)
==================  =============================================================================
"""
