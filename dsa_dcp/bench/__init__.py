"""``dsa-dcp bench``: speed measured on the machine at hand (tables go to ``docs/benchmarks.md``)."""
