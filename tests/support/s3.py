"""A real S3 endpoint on 127.0.0.1 for the tests: moto's S3 server (the one s3fs's own tests
use) in a process of its own, stopped when its standard input closes.

Example::

    with S3Server() as s3:
        fs = s3.filesystem()                  # s3fs, talking HTTP to the server
        fs.mkdir("bucket")
        Store.create("s3://bucket/st", storage_options=s3.storage_options)
"""
from __future__ import annotations

import subprocess
import sys
from typing import Any, Dict, Optional

_SERVE = ("import sys; from moto.server import ThreadedMotoServer as S; "
          "s = S('127.0.0.1', 0, verbose=False); s.start(); "
          "print(s.get_host_and_port()[1], flush=True); sys.stdin.read(); s.stop()")


class S3Server:
    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None
        self.endpoint = ""

    def __enter__(self) -> "S3Server":
        self.process = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)
        port = self.process.stdout.readline().strip()  # type: ignore[union-attr]
        if not port.isdigit():
            self.__exit__()
            raise RuntimeError("moto's S3 server did not start")
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.process is not None:
            self.process.stdin.close()  # type: ignore[union-attr]
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    @property
    def storage_options(self) -> Dict[str, Any]:
        """s3fs's options for this endpoint (what a user passes as ``storage_options``)."""
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "eu-west-1"}}

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
