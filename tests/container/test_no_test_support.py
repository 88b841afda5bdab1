"""The runtime image carries no test support: not the handler author's kit or its pytest
plugin (service.testing, built into the wheel only outside the image: hatch_build.py), and
no crash point — the chaos tests' harness installs theirs (tests/crashpoint.py), so the
variable they use changes nothing in the image."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.harness import Workload, check_invariants, queue_depth, send_all
from tests.container.conftest import DAEMON_IMAGE, RECONCILE_IMAGE, Container, docker
from tests.container.test_images import (
    GRACE,
    create_handler_tables,
    daemon,
    wait_all_completed,
)
from tests.servers import free_port, wait_until

pytestmark = [pytest.mark.container, pytest.mark.timeout(600)]

PROBE = r"""
import importlib.metadata as md, importlib.util, pathlib
import service
for name in ("service.testing", "service.testing.kit", "service.testing.pytest_plugin"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:  # the module itself, not one it imports (pytest)
        print("absent" if name.startswith(str(e.name)) else f"PRESENT ({e.name})", name)
    else:
        print("PRESENT", name)
print("pytest11", sorted(e.value for e in md.entry_points(group="pytest11")))
root = pathlib.Path(service.__file__).parent
hits = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
              if b"CRASH_AT" in p.read_bytes() or b"crash_point" in p.read_bytes())
print("crash", hits)
"""


def test_the_runtime_image_has_no_kit_no_plugin_no_crash_point_code(
    images: dict[str, float],
) -> None:
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "python", DAEMON_IMAGE,
                 "-c", "import importlib\n" + PROBE).splitlines()
    assert out == ["absent service.testing", "absent service.testing.kit",
                   "absent service.testing.pytest_plugin", "pytest11 []", "crash []"], out


async def test_the_crash_variable_changes_nothing_in_the_image(
    images: dict[str, float], database_url: str, sqs_client: Any, sqs_endpoint: str,
    containers: list[Container], tmp_path: Path,
) -> None:
    """INGEST_TEST_CRASH_AT as the chaos tests set it: the daemon in the image commits,
    deletes and keeps running (no SIGKILL after the first commit), then stops with 0."""
    await create_handler_tables(database_url)
    queue_url = sqs_client.create_queue(QueueName="x-" + uuid.uuid4().hex[:10],
                                        Attributes={"VisibilityTimeout": "5"})["QueueUrl"]
    w = Workload(seed=23)
    send_all(sqs_client, queue_url, w.bodies(20, prefix="x"))
    port, chaos_dir = free_port(), tmp_path / "chaos"
    chaos_dir.mkdir()
    d = daemon(database_url, queue_url, sqs_endpoint, port, chaos_dir)
    d.env.update(INGEST_TEST_CRASH_AT="after_commit_before_delete", INGEST_POLLERS="1")
    containers.append(d)
    d.run()
    await wait_all_completed(database_url, w, timeout=90, tick=lambda: None if d.running()
                             else pytest.fail(f"the daemon died:\n{d.logs()}"))
    wait_until(lambda: queue_depth(sqs_client, queue_url) == 0 or not d.running(), 60,
               "queue drained")
    assert d.running(), d.logs()
    await check_invariants(database_url, w, sqs_client, queue_url)
    assert d.stop(GRACE) == 0, d.logs()
    assert "crash_point" not in d.logs()


@pytest.mark.parametrize("image", [DAEMON_IMAGE, RECONCILE_IMAGE])
def test_a_file_in_the_working_directory_is_not_imported(
    images: dict[str, float], image: str, tmp_path: Path,
) -> None:
    """/tmp is the images' working directory and their one writable place (shared by the
    daemon and the reconcile sidecar in ECS): a ``urllib.py`` planted there must not shadow
    the standard library for the health check's ``python -c "import urllib.request…"``."""
    planted = tmp_path / "urllib.py"
    planted.write_text("print('PLANTED')\n")
    planted.chmod(0o644)
    tmp_path.chmod(0o755)
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "python",
                 "-v", f"{tmp_path}:/tmp:ro", image,
                 "-c", "import urllib.request; print(urllib.__file__)").strip()
    assert "PLANTED" not in out and not out.startswith("/tmp"), out
