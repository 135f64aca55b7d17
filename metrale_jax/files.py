"""Reading the small files of a checkpoint directory safely: regular files only, JSON problems as typed errors.

Every config / index / tokenizer file goes through `read_json`, every weights file through `open_regular`, so that
a FIFO, a device or a directory named like one is refused at once (opened without blocking, then fstat decides),
and non-UTF-8 text, invalid or absurdly nested JSON, and a 5000-digit number come out as the caller's MetraleError
naming the file instead of UnicodeDecodeError / RecursionError / ValueError.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from metrale_jax.errors import CheckpointError, ConfigError, MetraleError

# The error a caller wants for a file problem: (path, what is wrong) -> the exception to raise.
Reject = Callable[[Path, str], MetraleError]
# config.json, an index or a tokenizer spec is kilobytes (a 500-shard index a few MB); a bigger one is not one.
MAX_JSON_BYTES = 64 * 1024 ** 2


def checkpoint_error(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: {why}")


def config_error(path: Path, why: str) -> ConfigError:
    return ConfigError(str(path), why)


def open_regular(path: str | os.PathLike, reject: Reject = checkpoint_error) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file (a symlink to one counts). O_NONBLOCK makes
    opening a FIFO return at once instead of waiting for a writer; fstat of the opened descriptor then decides,
    so the file checked is the file read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise reject(path, "no such file") from None
    except OSError as e:
        raise reject(path, f"cannot open ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise reject(path, f"not a regular file ({_kind(mode)})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def read_json(path: str | os.PathLike, reject: Reject = checkpoint_error, *, max_bytes: int = MAX_JSON_BYTES
              ) -> dict[str, Any]:
    """The JSON object in the regular file `path`; any other content raises reject(path, why)."""
    return parse_json_object(read_text(path, reject, max_bytes=max_bytes), lambda why: reject(Path(path), why))


def read_text(path: str | os.PathLike, reject: Reject = checkpoint_error, *, max_bytes: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (at most max_bytes); anything else raises reject(path, why)."""
    path = Path(path)
    with open_regular(path, reject) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise reject(path, f"larger than {max_bytes} bytes; not a config, index or tokenizer file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise reject(path, f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_json_object(text: str, fail: Callable[[str], Exception]) -> dict[str, Any]:
    """The JSON object in `text`; fail(why) for anything else (bad JSON, nesting too deep for the parser, a
    number with more digits than Python converts, a top level that is not an object)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise fail(f"not valid JSON ({e})") from None
    except RecursionError:
        raise fail("not valid JSON (nested too deeply)") from None
    except ValueError as e:                 # e.g. an integer past sys.get_int_max_str_digits()
        raise fail(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object at the top level, got {type(obj).__name__}")
    return obj
