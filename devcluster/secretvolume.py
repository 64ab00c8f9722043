"""Files laid out and updated the way the kubelet projects a Secret into a pod.

The kubelet's AtomicWriter writes every version into a fresh hidden directory,
points the ``..data`` symlink at it with one ``rename`` and exposes each key as
``<key> -> ..data/<key>``. A reader therefore never sees a new ``tls.crt``
beside an old ``tls.key`` when it opens both after the swap. Writing the local
webhook's certificate the same way means a rotation here exercises the webhook's
reload exactly as a Secret update in a cluster does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

_DATA = "..data"


class SecretVolume:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str) -> Path:
        return self.directory / key

    def write(self, files: Mapping[str, bytes]) -> None:
        """Replace the whole set of files at once; readers see either all old or all new."""
        self.directory.mkdir(parents=True, exist_ok=True)
        data_link = self.directory / _DATA
        old = os.readlink(data_link) if data_link.is_symlink() else None
        version = Path(tempfile.mkdtemp(prefix="..", dir=self.directory))
        for key, content in files.items():
            target = version / key
            target.write_bytes(content)
            # Keys may be private keys: owner-only, like the chart's defaultMode 0400.
            target.chmod(0o600)
        tmp_link = self.directory / "..data_tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp_link.unlink()
        tmp_link.symlink_to(version.name)
        tmp_link.replace(data_link)  # the one atomic step
        for key in files:
            link = self.directory / key
            if not link.is_symlink():
                link.symlink_to(f"{_DATA}/{key}")
        if old is not None and old != version.name:
            shutil.rmtree(self.directory / old, ignore_errors=True)
