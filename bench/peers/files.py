"""Writing a report file: shared by bench/gpu_peers.py and bench/megatron_bench/ (stdlib only, so that
importing it costs nothing)."""
import contextlib
import os
import tempfile


def write_atomic(path, text):
    """Writes text to path through a temporary file in the same folder (created if missing), flushed to disk,
    then os.replace: a reader sees the old file or the whole new one, never part of it."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
