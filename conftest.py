"""What pytest collects, and in which order.

Not the scripts that tests run in processes of their own: ``--doctest-modules`` imports every
module under the test paths. The framework examples (``launch/examples``) and the jobs they run
in (``tests/jobs``) import their framework at the top (Lightning: 5-7 s here), which every run,
the fast tier included, would pay for nothing. ``distmon/sources/deepspeed.py`` imports
DeepSpeed (~4 s, an optional dependency; its examples need an engine and are skipped):
tests/test_framework_deepspeed.py runs it for real.

``--serial=skip|only`` (tests/run.sh): leave out, or run only, the tests marked ``serial`` (they
bound elapsed seconds: run alone, after the parallel part). Under xdist (``-n``) the modules
that take longest come first (:data:`LONGEST_FIRST`), so that ``--dist loadscope`` does not
start one of them last, on one worker, while the other worker idles.
"""

import pytest

collect_ignore = ["launch/examples", "tests/jobs", "distmon/sources/deepspeed.py"]

# The slow modules, longest first (measured: python3 -m pytest -m slow --durations=0, torch 2.13,
# 2 cores); any other module keeps its place after them.
LONGEST_FIRST = (
    "test_framework_deepspeed.py",
    "test_e2e_deploy.py",
    "test_layout_property.py",
    "test_layouts.py",
    "test_compile.py",
    "test_framework_lightning.py",
    "test_e2e_nodes.py",
    "test_core_numerics.py",
    "test_fsdp.py",
    "test_framework_hf.py",
    "test_alert_rules.py",
    "test_layouts_moe.py",
    "test_first_hour.py",
    "test_startup_lifecycle.py",
    "test_framework_fabric.py",
    "test_train_demo.py",
    "test_resume.py",
    "test_torch_versions.py",
    "test_training_unchanged.py",
    "test_pipeline_soak.py",
    "test_docs.py",
    "test_benchmark_smoke.py",
)


def pytest_addoption(parser):
    parser.addoption(
        "--serial",
        choices=("include", "skip", "only"),
        default="include",
        help="the tests marked serial: run them with the others (default), leave them out, or run only them",
    )


def pytest_collection_modifyitems(config, items):
    which = config.getoption("serial")
    if which != "include":
        serial = {id(item) for item in items if item.get_closest_marker("serial") is not None}
        keep = [item for item in items if (id(item) in serial) == (which == "only")]
        left = [item for item in items if (id(item) in serial) != (which == "only")]
        config.hook.pytest_deselected(items=left)
        items[:] = keep
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        # a stable sort: each module's tests stay together and in their order
        items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


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
