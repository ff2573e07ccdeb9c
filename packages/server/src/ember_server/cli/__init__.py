"""The ``ember`` command (``cli.main``) and what only it runs: ``run-batch``, ``collect-env``,
``bench``, the disaggregation proxy, and the demo model it serves when given none."""
