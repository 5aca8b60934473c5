"""What pytest collects: not the scripts that tests run in processes of their own.

``--doctest-modules`` imports every module under the test paths. The framework examples
(``launch/examples``) and the jobs they run in (``tests/jobs``) import their framework at the
top (Lightning: 5-7 s here), which every run, the fast tier included, would pay for nothing.
``distmon/sources/deepspeed.py`` imports DeepSpeed (~4 s, an optional dependency; its examples
need an engine and are skipped): tests/test_framework_deepspeed.py runs it for real.
"""

import pytest

collect_ignore = ["launch/examples", "tests/jobs", "distmon/sources/deepspeed.py"]


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in the test's own process (fast tier), destroyed afterwards."""
    import torch.distributed as dist
    from ddp_harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
