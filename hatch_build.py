"""Two wheels from one tree: the handler author's and the runtime image's.

The default wheel (``pip install 'sqs-ingest[testing]'``, ``pip wheel .``) carries the test
kit — ``service/testing/`` (fakes, the kit that starts a throwaway PostgreSQL) and its pytest
plugin, registered as the ``pytest11`` entry point ``sqs_ingest``. With
``SQS_INGEST_WHEEL=runtime`` (the Dockerfile's build) the wheel leaves both out: the runtime
image has no kit, no plugin and no entry point naming them. ``service/testing/`` is excluded
in pyproject.toml and added back here, file by file, for the default wheel.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from hatchling.metadata.plugin.interface import MetadataHookInterface

KIT = "service/testing"
PLUGIN = {"pytest11": {"sqs_ingest": "service.testing.pytest_plugin"}}


def runtime_wheel() -> bool:
    flavour = os.environ.get("SQS_INGEST_WHEEL", "")
    if flavour not in ("", "runtime"):
        raise ValueError(f"SQS_INGEST_WHEEL={flavour!r}: 'runtime' or unset")
    return flavour == "runtime"


class KitEntryPoints(MetadataHookInterface):
    """The plugin's entry point, in the default wheel only (``project.dynamic``)."""

    def update(self, metadata: dict[str, Any]) -> None:
        if not runtime_wheel():
            metadata["entry-points"] = PLUGIN


class KitFiles(BuildHookInterface):  # type: ignore[type-arg]
    """service/testing's modules, in the default wheel only (an editable install reads them
    from the tree)."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable" or runtime_wheel():
            return
        for path in sorted((Path(self.root) / KIT).glob("*.py")):
            build_data["force_include"][str(path)] = f"{KIT}/{path.name}"
