"""The repository root's conftest: pytest puts this folder on ``sys.path``
(it holds a conftest and is no package), so tests import the benchmarks as
the package ``benchmarks``, as the command lines do."""
