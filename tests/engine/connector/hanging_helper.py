"""A helper engine that dies mid-claim, for test_coldshare: it takes one cold segment
another engine offered (claiming it through the daemon), writes the segment key to
READY, and then hangs without computing it until the test kills it.

    python tests/engine/connector/hanging_helper.py SOCKET FINGERPRINT READY
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from engine.connector.config import StoreConnectorConfig
from engine.connector.store_cache import StoreSignatureCache


def main() -> None:
    socket, fingerprint, ready = sys.argv[1:4]
    cache = StoreSignatureCache(fingerprint, "cpu", StoreConnectorConfig(socket=socket))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        taken = cache.share.take()
        if taken is not None:
            Path(ready).write_text(taken[0].key.hex())
            time.sleep(3600)  # "dies" here: the test kills this process
        time.sleep(0.01)
    raise SystemExit("nothing offered within 120 s")


if __name__ == "__main__":
    main()
