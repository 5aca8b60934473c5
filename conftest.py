"""What pytest collects: not the scripts that tests run in processes of their own.

``--doctest-modules`` imports every module under the test paths. The framework examples
(``launch/examples``) and the jobs they run in (``tests/jobs``) import their framework at the
top (Lightning: 5-7 s here), which every run, the fast tier included, would pay for nothing.
"""

collect_ignore = ["launch/examples", "tests/jobs"]
