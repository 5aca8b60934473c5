"""The models (GPT shapes of launch/model.py), the modes, and how many rounds a size gets."""

# name -> GPT shape (launch/model.py) and per-rank batch. Tokens per rank per step = batch * seq_len.
SIZES: dict[str, dict[str, int]] = {
    "smoke": dict(vocab=128, seq_len=32, d_model=32, n_layers=2, n_heads=2, batch=4),
    "1M": dict(vocab=1024, seq_len=256, d_model=128, n_layers=4, n_heads=4, batch=8),
    "5M": dict(vocab=2048, seq_len=256, d_model=256, n_layers=6, n_heads=4, batch=8),
    # ~2,000 small parameter tensors: 166 blocks x 12 tensors + 4
    "2k-tensors": dict(vocab=256, seq_len=64, d_model=32, n_layers=166, n_heads=2, batch=8),
    "20M": dict(vocab=4096, seq_len=256, d_model=512, n_layers=6, n_heads=8, batch=8),
    # 512 tokens per rank keep a 50M step within the time budget on 2 CPU cores
    "50M": dict(vocab=2048, seq_len=256, d_model=768, n_layers=7, n_heads=12, batch=2),
    # the GPU preset's (issue #35): GPT-2 small and medium, batch 8 x 1024 tokens
    "124M": dict(vocab=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12, batch=8),
    "350M": dict(vocab=50257, seq_len=1024, d_model=1024, n_layers=24, n_heads=16, batch=8),
}
# mode -> [(size, seconds of timed rounds)]; rounds = budget / measured round time, clamped
MODES: dict[str, list[tuple[str, float]]] = {
    "smoke": [("smoke", 0.0)],
    "quick": [("1M", 60.0), ("2k-tensors", 75.0), ("5M", 90.0)],
    "full": [("1M", 30.0), ("2k-tensors", 40.0), ("5M", 50.0), ("20M", 300.0), ("50M", 120.0)],
    # one GPU, bf16 autocast, within ~5 minutes: a round of 7 copies is 0.1-0.5 s there
    "gpu": [("20M", 20.0), ("124M", 30.0), ("350M", 40.0)],
}
MIN_ROUNDS = {"smoke": 3, "20M": 8}  # the acceptance size gets more rounds
DEFAULT_MIN_ROUNDS = 5
MAX_ROUNDS = 60


def timed_rounds(
    size: str, budget_s: float, round_s: float, budget_scale: float = 1.0, fixed: int = 0
) -> int:
    """Rounds to time for ``size``: ``fixed`` when given, else the budget over one round's time,
    clamped to ``[MIN_ROUNDS, MAX_ROUNDS]``.

    Example:
        >>> timed_rounds("5M", 90.0, 3.0), timed_rounds("5M", 90.0, 60.0), timed_rounds("5M", 90.0, 0.1)
        (30, 5, 60)
        >>> timed_rounds("smoke", 0.0, 0.1), timed_rounds("5M", 90.0, 3.0, fixed=1200)
        (3, 1200)
    """
    if fixed:
        return fixed
    return max(
        MIN_ROUNDS.get(size, DEFAULT_MIN_ROUNDS), min(MAX_ROUNDS, int(budget_s * budget_scale / round_s))
    )
