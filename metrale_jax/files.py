"""Checkpoint files read and written safely.

Reading: every config / index / tokenizer file goes through `read_json` / `read_text`, every weights file through
`open_regular`, so that a FIFO, a device or a directory named like one is refused at once (opened without
blocking, then fstat decides), and non-UTF-8 text, invalid or absurdly nested JSON, and a 5000-digit number come
out as the caller's MetraleError naming the file instead of UnicodeDecodeError / RecursionError / ValueError.

Writing: a checkpoint directory is written whole into a temporary directory beside it (`staged_directory`) and
then swapped into place, so that a reader (or a writer killed at any file) sees the old checkpoint or the new one,
never a mixture. Every file the library writes there is made by `create` (exclusive: nothing is overwritten).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
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


# ---- writing ----------------------------------------------------------------------------------------------
def create(path: str | os.PathLike) -> BinaryIO:
    """A new file at `path`, open for binary writing; an existing one is an error (FileExistsError), never
    truncated. Every file the library writes is made here (tests raise from it to stand for a killed writer)."""
    return open(path, "xb")


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A file to write that takes `path`'s place (os.replace) once written whole, so that a reader sees the old
    file or the new one; on an exception the partial file is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with create(tmp) as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    """`obj` as indented JSON in `path` (replacing it whole)."""
    with replacing(path) as fh:
        fh.write(json.dumps(obj, indent=2).encode() + b"\n")


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike, *, overwrite: bool, replaces: Callable[[str], bool]
                     ) -> Iterator[Path]:
    """A fresh empty directory beside `target` to write a checkpoint into; on a clean exit it takes `target`'s
    place in one atomic step (see `_commit`), and on an exception it is removed (it holds only what the caller
    wrote), leaving `target` as it was. A killed writer leaves `target` as it was and a `.<name>.tmp-*` directory.

    replaces(name): whether an entry of an existing `target` belongs to the checkpoint being replaced (weights,
    index, configs, tokenizer). If `target` holds any, writing is refused unless `overwrite`; with it, they are
    dropped, so that no stale shard or index outlives the write. Every other entry of `target` (notes, logs,
    subdirectories) is carried into the new directory unchanged (hard links where the filesystem has them), and
    so is never deleted."""
    if not isinstance(overwrite, bool):                    # "no" / "false" would read as consent
        raise ConfigError("overwrite", f"expected True or False, got {overwrite!r:.60}")
    target = Path(target).resolve()                        # a symlink's target; "" and "x/.." by their real names
    if not target.name:
        raise CheckpointError(f"{target}: the filesystem root cannot be replaced by a checkpoint directory")
    held = _held_entries(target, replaces)
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (" ..." if len(held) > 4 else "")
        raise CheckpointError(f"{target}: already holds a checkpoint ({shown}); pass overwrite=True "
                              f"(CLI: --overwrite) to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_sibling(target, "tmp")
    try:
        yield tmp
        _commit(tmp, target, replaces)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _held_entries(target: Path, replaces: Callable[[str], bool]) -> list[str]:
    """The entries of `target` that `replaces` claims ([] when it does not exist); CheckpointError when it is not
    a directory."""
    if not os.path.lexists(target):
        return []
    if not target.is_dir():
        raise CheckpointError(f"{target}: exists and is not a directory")
    return sorted(name for name in os.listdir(target) if replaces(name))


def _new_sibling(target: Path, tag: str) -> Path:
    """A new empty directory `.<name>.<tag>-<random>` beside target (mkdir: the umask's usual permissions; those of
    target when it exists)."""
    while True:
        path = target.with_name(f".{target.name}.{tag}-{secrets.token_hex(4)}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        if target.is_dir():
            shutil.copymode(target, path)
        return path


def _commit(tmp: Path, target: Path, replaces: Callable[[str], bool]) -> None:
    """Put the finished directory `tmp` in `target`'s place. A new target: one rename. An existing one: its
    entries that are not replaced are carried into tmp first, then the two directories are exchanged in one
    atomic step (renameat2 RENAME_EXCHANGE) and the old one, now at tmp, is removed. Where the filesystem cannot
    exchange, two renames with the old directory kept aside until the new one is in place."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    _carry(target, tmp, replaces)
    if exchange(tmp, target):
        shutil.rmtree(tmp)
        return
    aside = _new_sibling(target, "old")
    os.rename(target, aside / target.name)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside / target.name, target)                 # the old one back
        os.rmdir(aside)
        raise
    shutil.rmtree(aside)


def _carry(old: Path, new: Path, replaces: Callable[[str], bool]) -> None:
    """Entries of `old` that the new checkpoint neither replaces nor wrote again, linked (or copied) into `new`:
    symlinks as symlinks, directories entry by entry. A FIFO, socket or device cannot be carried (reading it
    could block, deleting it would lose it): CheckpointError before anything changes."""
    for name in sorted(os.listdir(old)):
        src, dst = old / name, new / name
        if replaces(name) or os.path.lexists(dst):
            continue
        mode = os.lstat(src).st_mode
        if stat.S_ISLNK(mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISDIR(mode):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        elif stat.S_ISREG(mode):
            _link_or_copy(src, dst)
        else:
            raise CheckpointError(f"{src}: {_kind(mode)} cannot be carried into the new checkpoint directory; "
                                  f"move it away first")


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:                                            # no hard links here: a copy
        shutil.copy2(src, dst)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the directory entries a and b in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    C library, kernel or filesystem has no such call (the caller falls back to renames)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))
