"""Reproductions of Transformer divergence on CPU, and the early-warning benchmark built on them.

``model`` (a tiny pre-LN GPT with qk-layernorm and z-loss as options), ``data`` (stdlib source
bytes), ``train`` (one run, AdamW as in Wortsman et al. 2023), ``recorder`` (every candidate
signal, with plain torch hooks), ``divergence`` (the verdict from the loss alone), ``runs``
(the sweep and its cache), ``detectors`` (distmon's precursor and the alternatives on a
recording), ``candidates`` (every signal and rule scored), ``cost`` and ``plot``.
``benchmarks/early_warning.py`` is the command line.
"""
