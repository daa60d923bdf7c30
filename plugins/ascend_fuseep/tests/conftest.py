"""What a real launch exports before the process group starts: an HCCL window the vendor's ops
accept (the fakes read HCCL_BUFFSIZE from the process environment at each call, as the ops'
tiling does; normal mode needs at least 213 MB, more than HCCL's default 200). Set at collection,
before the local rank pools spawn, so their processes inherit it."""

import os

os.environ.setdefault("HCCL_BUFFSIZE", "1024")
