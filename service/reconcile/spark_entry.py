"""Entry file for ``spark-submit`` (which runs a file, not a module or console script).

    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master local[4] \\
        --jars /usr/share/java/postgresql.jar service/reconcile/spark_entry.py --date 2024-05-01

Arguments are those of ``sqs-ingest reconcile``. The master and jars given to
spark-submit win; the job uses only built-in Spark SQL functions (no Python UDFs), so
executors need no copy of this package — only the driver imports it.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The script's own directory lands on sys.path[0]; its io.py must never shadow the stdlib.
_here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]

try:
    import service.reconcile.cli  # noqa: F401 - installed package
except ImportError:  # running from a source checkout: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.reconcile.cli import main  # noqa: E402 - after the sys.path fix above

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
