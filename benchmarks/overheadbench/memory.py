"""Memory: the bytes an approach keeps between steps, and the host memory left for the next size."""

from typing import Any


def tensor_bytes(root: Any, exclude_ptrs: set[int]) -> tuple[int, int]:
    """(device bytes, host bytes) of the distinct tensor storages reachable from ``root``.

    Walks distmon's own objects (attributes, __slots__, dicts, lists, tuples); parameters and
    anything sharing a parameter's or gradient's storage are excluded. A view counts only when
    its storage is also reached through a tensor that is not a view: views of memory someone
    else owns (e.g. cached views of DDP's bucket buffers) cost the viewer nothing.

    Example:
        >>> import torch
        >>> t = torch.zeros(256)
        >>> tensor_bytes({"a": [t, t[:8]], "p": torch.nn.Parameter(torch.zeros(4))}, set())
        (0, 1024)
        >>> tensor_bytes([t[:8]], set())  # a view of memory held elsewhere
        (0, 0)
    """
    import torch

    seen_obj: set[int] = set()
    storages: dict[int, tuple[int, bool]] = {}
    owned: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if depth > 8 or id(obj) in seen_obj:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if isinstance(obj, torch.nn.Parameter):
                return
            st = obj.untyped_storage()
            ptr = st.data_ptr()
            if ptr in exclude_ptrs or ptr == 0:
                return
            pinned = obj.device.type == "cpu" and obj.is_pinned() if torch.cuda.is_available() else False
            storages[ptr] = (st.nbytes(), obj.device.type != "cpu" and not pinned)
            if obj._base is None:
                owned.add(ptr)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v, depth + 1)
            return
        mod = type(obj).__module__ or ""
        if not mod.startswith(("distmon", "overheadbench")):
            return
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                walk(getattr(obj, name), depth + 1)
        for v in getattr(obj, "__dict__", {}).values():
            walk(v, depth + 1)

    walk(root, 0)
    dev = sum(n for ptr, (n, on_dev) in storages.items() if on_dev and ptr in owned)
    host = sum(n for ptr, (n, on_dev) in storages.items() if not on_dev and ptr in owned)
    return dev, host


def release_host_memory() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise), so the next size's memory
    check sees what is really available."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:
        pass


def mem_available() -> int | None:
    """Bytes of host memory available (``/proc/meminfo``), None where it cannot be read.

    Example:
        >>> n = mem_available()
        >>> n is None or n > 0
        True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
