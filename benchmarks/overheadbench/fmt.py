"""Number formatting shared by the tables, the verdicts and the log."""

import math

from .results import Row


def fmt_bytes(n: float | None) -> str:
    """Bytes in B, KiB, MiB or GiB; "n/a" for none.

    Example:
        >>> fmt_bytes(512), fmt_bytes(19558.0), fmt_bytes(-3 * 2**30), fmt_bytes(None)
        ('512 B', '19.1 KiB', '-3.0 GiB', 'n/a')
    """
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n}"


def fmt_num(x: float | None, nd: int = 1) -> str:
    """``x`` with thousands separators and ``nd`` decimals; "n/a" for none, NaN or infinity.

    Example:
        >>> fmt_num(2832.56), fmt_num(0.514, 2), fmt_num(float("nan"))
        ('2,832.6', '0.51', 'n/a')
    """
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "n/a"
    return f"{x:,.{nd}f}"


def fmt_range(x: float, lo: float, hi: float) -> str:
    """A ratio and its min-max over blocks of rounds.

    Example:
        >>> fmt_range(0.98, 0.81, 1.065)
        '0.980 (0.810-1.065)'
    """
    return f"{x:.3f} ({lo:.3f}-{hi:.3f})"


def fmt_paired(r: Row) -> str:
    """A row's paired median ratio and its 95% interval; "n/a" in results saved before it was measured.

    Example:
        >>> from types import SimpleNamespace as Figures
        >>> fmt_paired(Figures(paired=1.0004, paired_lo=0.99656, paired_hi=1.0041))
        '1.0004 [0.9966, 1.0041]'
        >>> fmt_paired(Figures(paired=None, paired_lo=None, paired_hi=None))
        'n/a'
    """
    if r.paired is None or r.paired_lo is None or r.paired_hi is None:
        return "n/a"
    return f"{r.paired:.4f} [{r.paired_lo:.4f}, {r.paired_hi:.4f}]"
